// `moetrain generate` end to end, as a user runs it (the real binary, fp32 CPU): greedy decoding of a
// golden model gives transformers' tokens (tests/assets/goldens/tiny/generate.json) and ends with the
// summary line; n samples per prompt come back as n lines with per-token log-probs; under `moetrain
// launch` with FSDP (--dp-shard 2) and with expert parallelism (--ep 2, ranks with different numbers of
// prompts, so one steps idle for the other's exchanges) the output equals one process's, sampled tokens
// included; bad prompt files are errors naming the line; with a tokenizer.json in the model directory,
// text and chat prompts are encoded and each sample's text comes back.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/params.h"
#include "model/qwen3_moe.h"
#include "parallel/launch_test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

// The golden prompts (and two more, so that two ranks get 3 and 2) as a prompts file.
std::string write_prompts(const std::string& tag, const nlohmann::json& golden) {
  const std::string path = tmp_path(tag, "prompts.jsonl");
  std::ofstream f(path);
  for (const auto& p : golden.at("prompts")) f << nlohmann::json{{"prompt_ids", p}}.dump() << "\n";
  f << R"({"prompt_ids": [5, 6, 7, 8], "answer": "x"})" << "\n" << R"({"prompt_ids": [300]})" << "\n";
  return path;
}

nlohmann::json golden() {
  std::ifstream f(kGoldens + "/tiny/generate.json");
  return nlohmann::json::parse(f);
}

void expect_same_samples(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b,
                         const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["prompt_index"], b[i]["prompt_index"]) << what << " line " << i;
    EXPECT_EQ(a[i]["sample_index"], b[i]["sample_index"]) << what << " line " << i;
    EXPECT_EQ(a[i]["token_ids"], b[i]["token_ids"]) << what << " line " << i;
    EXPECT_EQ(a[i]["finish_reason"], b[i]["finish_reason"]) << what << " line " << i;
    const auto& la = a[i]["logprobs"];
    const auto& lb = b[i]["logprobs"];
    ASSERT_EQ(la.size(), lb.size());
    for (size_t t = 0; t < la.size(); ++t) EXPECT_NEAR(la[t].get<double>(), lb[t].get<double>(), 1e-5) << what;
  }
}

}  // namespace

TEST(GenerateCli, GreedyMatchesTransformersAndSamplesComeBackPerLine) {
  const nlohmann::json g = golden();
  const std::string prompts = write_prompts("gencli", g), out = tmp_path("gencli", "greedy.jsonl");
  const int64_t new_tokens = g.at("max_new_tokens").get<int64_t>();
  ShellRun r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + prompts +
                  " --out " + out + " --max-new-tokens " + std::to_string(new_tokens) + " --temperature 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("generate: 5 sequences, " + std::to_string(5 * new_tokens) + " new tokens in "),
            std::string::npos)
      << r.out;
  const std::vector<nlohmann::json> lines = read_json_lines(out);
  ASSERT_EQ(lines.size(), 5u);
  for (size_t p = 0; p < g["prompts"].size(); ++p) {
    EXPECT_EQ(lines[p]["prompt_index"], p);
    EXPECT_EQ(lines[p]["token_ids"], g["tokens"][p]) << "prompt " << p << " (transformers' greedy tokens)";
    EXPECT_EQ(lines[p]["finish_reason"], "length");
  }

  const std::string sampled = tmp_path("gencli", "sampled.jsonl");
  r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + prompts + " --out " +
         sampled + " --max-new-tokens 6 --temperature 1 --top-p 0.9 --n 3 --seed 7");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<nlohmann::json> s = read_json_lines(sampled);
  ASSERT_EQ(s.size(), 15u);
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i]["prompt_index"], i / 3);
    EXPECT_EQ(s[i]["sample_index"], i % 3);
    EXPECT_EQ(s[i]["token_ids"].size(), 6u);
    EXPECT_EQ(s[i]["logprobs"].size(), 6u);
    for (const auto& lp : s[i]["logprobs"]) EXPECT_LE(lp.get<double>(), 0.0);
  }
}

TEST(GenerateCli, UnderLaunchFsdpAndExpertParallelEqualOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const nlohmann::json g = golden();
  const std::string prompts = write_prompts("genlaunch", g);
  const std::string args = " --device cpu --model " + kGoldens + "/tiny --prompts " + prompts +
                           " --max-new-tokens 7 --temperature 0.9 --n 2 --seed 3";
  const std::string one = tmp_path("genlaunch", "one.jsonl");
  ShellRun r = sh(kMoetrainBin + " generate" + args + " --out " + one);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<nlohmann::json> want = read_json_lines(one);
  ASSERT_EQ(want.size(), 10u);
  for (const std::string layout : {"--dp-shard 2", "--ep 2"}) {
    const std::string out = tmp_path("genlaunch", "two.jsonl");
    r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- generate" + args + " " + layout + " --out " + out);
    ASSERT_EQ(r.code, 0) << layout << "\n" << r.out;
    EXPECT_NE(r.out.find("weight sync (inference layout)"), std::string::npos) << r.out;
    expect_same_samples(read_json_lines(out), want, layout);
  }
}

TEST(GenerateCli, BadPromptFilesAreErrorsNamingTheLine) {
  const std::string bad = tmp_path("genbad", "bad.jsonl"), out = tmp_path("genbad", "out.jsonl");
  {
    std::ofstream f(bad);
    f << R"({"prompt_ids": [1, 2]})" << "\n" << R"({"prompt_ids": [1, 2)" << "\n";
  }
  ShellRun r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + bad + " --out " + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("bad.jsonl:2"), std::string::npos) << r.out;
  {
    std::ofstream f(bad);
    f << R"({"prompt_ids": [1, 99999]})" << "\n";
  }
  r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + bad + " --out " + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("99999"), std::string::npos) << r.out;
}

TEST(GenerateCli, TextAndChatPromptsWithTheModelDirectorysTokenizer) {
  // A model directory with a tokenizer.json: the tiny preset grown to the trained tokenizer's vocabulary.
  const std::string dir = tmp_path("gentext", "model");
  const std::string tok_path = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/trained/tokenizer.json";
  const Tokenizer tok = Tokenizer::from_file(tok_path);
  ModelConfig c = preset_model_config("tiny");
  c.vocab_size = int64_t(tok.vocab_size()) + 5;  // padded past the tokenizer, as real models are
  c.validate();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 3);
  save_hf_checkpoint(dir, c, m.table(), m.params());
  std::filesystem::copy_file(tok_path, dir + "/tokenizer.json", std::filesystem::copy_options::overwrite_existing);
  const std::string prompts = tmp_path("gentext", "prompts.jsonl"), ids_prompts = tmp_path("gentext", "ids.jsonl");
  {
    std::ofstream f(prompts);
    f << R"({"prompt": "The cat sat on", "answer": "mat"})" << "\n"
      << R"({"messages": [{"role": "user", "content": "Hello!"}]})" << "\n";
    std::ofstream g(ids_prompts);
    g << nlohmann::json{{"prompt_ids", tok.encode("The cat sat on")}}.dump() << "\n";
  }
  const std::string common = " --device cpu --model " + dir + " --max-new-tokens 6 --temperature 0 --ignore-eos";
  const std::string out = tmp_path("gentext", "out.jsonl"), out_ids = tmp_path("gentext", "out_ids.jsonl");
  ShellRun r = sh(kMoetrainBin + " generate" + common + " --prompts " + prompts + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + " generate" + common + " --prompts " + ids_prompts + " --out " + out_ids);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<nlohmann::json> text = read_json_lines(out), ids = read_json_lines(out_ids);
  ASSERT_EQ(text.size(), 2u);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(text[0]["token_ids"], ids[0]["token_ids"]);  // the text prompt is its encoding
  for (const auto& line : text) {
    ASSERT_TRUE(line.contains("text")) << line.dump();
    std::vector<uint32_t> known;
    for (int64_t t : line["token_ids"].get<std::vector<int64_t>>())
      if (t < int64_t(tok.vocab_size())) known.push_back(uint32_t(t));
    EXPECT_EQ(line["text"], tok.decode(known, true));
  }
}

// --adapter: a PEFT adapter (the LoRA golden's, tools/make_peft_goldens.py) on the base. The first greedy token
// after a prefix of the golden's batch is PEFT's argmax there, with PEFT's log-prob; merged into the weights
// (the default) and beside them (--merge-adapter off) give the same samples.
TEST(GenerateCli, AdapterGivesPeftsNextTokenMergedOrNot) {
  const std::string lora = kGoldens + "/lora/moe";
  SafetensorsFile batch(lora + "/batch.safetensors"), exp(lora + "/expected.safetensors");
  const Tensor ids = batch.read_f32("input_ids"), logits = exp.read_f32("logits");
  const int64_t P = 8, V = logits.size(2);
  nlohmann::json prompt = nlohmann::json::array();
  for (int64_t i = 0; i < P; ++i) prompt.push_back(int64_t(ids.data<float>()[i]));
  const std::string prompts = tmp_path("genlora", "prompts.jsonl");
  std::ofstream(prompts) << nlohmann::json{{"prompt_ids", prompt}}.dump() << "\n";
  // PEFT's next token and its log-prob from row 0, position P - 1.
  const float* row = logits.data<float>() + (P - 1) * V;
  int64_t best = 0;
  double lse = 0, mx = row[0];
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
  for (int64_t v = 0; v < V; ++v) {
    lse += std::exp(double(row[v]) - mx);
    if (row[v] > row[best]) best = v;
  }
  const double want_lp = double(row[best]) - mx - std::log(lse);
  std::vector<std::vector<nlohmann::json>> outs;
  for (const char* merge : {"on", "off"}) {
    const std::string out = tmp_path("genlora", std::string("out_") + merge + ".jsonl");
    const ShellRun r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --adapter " + lora +
                          "/adapter --merge-adapter " + merge + " --prompts " + prompts + " --out " + out +
                          " --max-new-tokens 6 --temperature 0");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("LoRA adapters from"), std::string::npos) << r.out;
    outs.push_back(read_json_lines(out));
    ASSERT_EQ(outs.back().size(), 1u);
    EXPECT_EQ(outs.back()[0]["token_ids"][0].get<int64_t>(), best) << merge;
    EXPECT_NEAR(outs.back()[0]["logprobs"][0].get<double>(), want_lp, 1e-4) << merge;
  }
  expect_same_samples(outs[0], outs[1], "merged vs beside the weights");
  // A directory that is no adapter is named.
  const ShellRun bad = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --adapter " + kGoldens +
                          "/tiny --prompts " + prompts + " --out " + tmp_path("genlora", "bad.jsonl"));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("holds no adapter_config.json"), std::string::npos) << bad.out;
}

// --true-on-policy (the CPU's batch-invariant mode): a prompt generated greedily among others and alone gives the
// same tokens and the same log-prob bits (without the mode, measured: 2 of 12 log-probs bit-equal).
TEST(GenerateCli, TrueOnPolicyMakesASampleIndependentOfItsBatch) {
  const std::string dir = tmp_path("generate_top", "x");
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/three.jsonl") << "{\"prompt_ids\": [1, 2, 3]}\n{\"prompt_ids\": [7, 8, 9, 10, 11]}\n"
                                           "{\"prompt_ids\": [5, 6]}\n";
    std::ofstream(dir + "/one.jsonl") << "{\"prompt_ids\": [5, 6]}\n";
  }
  auto run = [&](const std::string& prompts, const std::string& out) {
    const ShellRun r = sh(kMoetrainBin + " generate --device cpu --model " + kGoldens + "/tiny --prompts " + dir + "/" +
                          prompts + " --out " + dir + "/" + out + " --temperature 0 --max-new-tokens 12 --true-on-policy");
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<nlohmann::json> lines;
    std::ifstream f(dir + "/" + out);
    for (std::string l; std::getline(f, l);) lines.push_back(nlohmann::json::parse(l));
    return lines;
  };
  const std::vector<nlohmann::json> three = run("three.jsonl", "three_out.jsonl"), one = run("one.jsonl", "one_out.jsonl");
  ASSERT_EQ(three.size(), 3u);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(three[2]["token_ids"], one[0]["token_ids"]);
  const std::vector<float> a = three[2]["logprobs"].get<std::vector<float>>(), b = one[0]["logprobs"].get<std::vector<float>>();
  ASSERT_EQ(a.size(), 12u);
  for (size_t j = 0; j < a.size(); ++j) EXPECT_EQ(a[j], b[j]) << "token " << j;
}
