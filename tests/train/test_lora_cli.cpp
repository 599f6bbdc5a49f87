// LoRA as the user runs it (the real binary, CPU): `train --lora-rank` writes checkpoints of the adapters
// (a PEFT directory and their optimizer state, no base weights) and resumes to the same bits as a straight
// run; `grpo --lora-rank` on a prompt file likewise; the run's settings are checked.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/lora_peft.h"
#include "parallel/launch_test_util.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

bool same_file(const std::string& a, const std::string& b) {
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  const std::string sa((std::istreambuf_iterator<char>(fa)), {}), sb((std::istreambuf_iterator<char>(fb)), {});
  return fa.good() || fa.eof() ? !sa.empty() && sa == sb : false;
}

}  // namespace

TEST(LoraCli, TrainWritesAdaptersAndResumesToTheSameBits) {
  const std::string a = tmp_path("loracli", "straight"), b = tmp_path("loracli", "resumed");
  fs::remove_all(a);
  fs::remove_all(b);
  const std::string args = " train --device cpu --model tiny --steps 12 --lora-rank 4 --lora-targets attn,experts "
                           "--lr 3e-3 --warmup-steps 2 --save-every 6 --eval-every 0 --eval-problems 0 --out-dir ";
  ShellRun r = sh(kMoetrainBin + args + a);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("LoRA: rank 4, alpha 8 (scale 2) on attn,experts"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(LoRA adapters + training state, manifest)"), std::string::npos) << r.out;
  const std::string ck = a + "/checkpoint-12";
  EXPECT_TRUE(fs::exists(ck + "/adapter/adapter_config.json"));
  EXPECT_FALSE(fs::exists(ck + "/model.safetensors"));  // the base is not copied
  const LoraSpec s = read_peft_config(ck + "/adapter");
  EXPECT_EQ(s.rank, 4);
  EXPECT_EQ(lora_targets_text(s), "attn,experts");
  EXPECT_NO_THROW(read_peft_adapter(ck + "/adapter", preset_model_config("tiny"), s));
  // Stopped at 6 and resumed: the same adapters at 12.
  r = sh(kMoetrainBin + args + b + " --max-steps 6");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + args + b + " --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step 6"), std::string::npos) << r.out;
  EXPECT_TRUE(same_file(ck + "/adapter/adapter_model.safetensors", b + "/checkpoint-12/adapter/adapter_model.safetensors"));
  // A LoRA checkpoint resumed without --lora-rank is named, not misread.
  r = sh(kMoetrainBin + " train --device cpu --model tiny --steps 14 --eval-every 0 --eval-problems 0 --resume --out-dir " + b);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("holds LoRA adapters (rank 4)"), std::string::npos) << r.out;
  // keep-last 0 reduces older checkpoints to their weights: a LoRA run's adapters stay.
  r = sh(kMoetrainBin + args + a + "_k0 --keep-last 0 --save-every 3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(a + "_k0/checkpoint-3/adapter/adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(a + "_k0/checkpoint-3/train_state.json"));
  fs::remove_all(a + "_k0");
}

TEST(LoraCli, BadSettingsAreNamed) {
  const std::string d = tmp_path("loracli", "bad");
  ShellRun r = sh(kMoetrainBin + " train --device cpu --model tiny --steps 2 --lora-rank 4 --lora-targets attn,qproj "
                                 "--out-dir " + d);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown target 'qproj'"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " grpo --device cpu --lora-rank 4 --algorithm ppo --run-dir " + d);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("the critic has no LoRA form"), std::string::npos) << r.out;
}

// grpo on a prompt file with the golden tiny model as the base: adapters only in the checkpoints, a resume
// that reaches the straight run's adapters bit for bit.
TEST(LoraCli, GrpoOnPromptsResumesToTheSameBits) {
  const std::string prompts = tmp_path("loragrpo", "prompts.jsonl");
  {
    std::ofstream f(prompts);
    for (int i = 0; i < 8; ++i)
      f << nlohmann::json{{"prompt_ids", {1 + i, 2 + i, 3 + i}}, {"answer", std::to_string(i % 3)}}.dump() << "\n";
  }
  const std::string a = tmp_path("loragrpo", "straight"), b = tmp_path("loragrpo", "resumed");
  fs::remove_all(a);
  fs::remove_all(b);
  // A reward that varies within a group: the response's length in characters, odd or even.
  const std::string reward = tmp_path("loragrpo", "reward.py");
  std::ofstream(reward) << "import sys, json\nfor line in sys.stdin:\n"
                           "    print(len(json.loads(line)['response']) % 2, flush=True)\n";
  const std::string args = " grpo --device cpu --model " + kGoldens + "/tiny --prompts " + prompts +
                           " --reward 'program:python3 " + reward +
                           "' --max-new-tokens 4 --n 4 --prompts-per-step 2 --steps 4 --save-every 2 --lora-rank 4 "
                           "--run-dir ";
  ShellRun r = sh(kMoetrainBin + args + a);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(a + "/checkpoint-4/adapter/adapter_model.safetensors")) << r.out;
  r = sh(kMoetrainBin + args + b + " --max-steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + args + b + " --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(same_file(a + "/checkpoint-4/adapter/adapter_model.safetensors",
                        b + "/checkpoint-4/adapter/adapter_model.safetensors"));
}

// convert --adapter and --merge of a LoRA run on an HF base: the adapter directory and the merged model
// generate the same tokens and log-probs (greedy), and differ from the base. (tools/check_peft_adapter.py
// and PEFT: the adapter loads there with the merged model's logits; docs/lora.md.)
TEST(LoraCli, ConvertAdapterAndMergeGenerateAlike) {
  const std::string run = tmp_path("loraconv", "run"), ad = tmp_path("loraconv", "adapter"),
                    merged = tmp_path("loraconv", "merged"), base = kGoldens + "/tiny";
  for (const std::string& d : {run, ad, merged}) fs::remove_all(d);
  ShellRun r = sh(kMoetrainBin + " train --device cpu --model " + base + " --init-from " + base +
                  " --steps 10 --lora-rank 4 --lora-targets attn,experts,router --lr 3e-3 --warmup-steps 1 "
                  "--eval-every 0 --eval-problems 0 --out-dir " + run);
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + " convert --from " + run + "/checkpoint-10 --to " + ad + " --adapter");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("a PEFT adapter directory"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " convert --from " + run + "/checkpoint-10 --to " + merged + " --merge --dtype f32");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string prompts = tmp_path("loraconv", "prompts.jsonl");
  std::ofstream(prompts) << R"({"prompt_ids": [1, 5, 9, 33]})" << "\n" << R"({"prompt_ids": [300, 2]})" << "\n";
  auto gen = [&](const std::string& extra, const std::string& tag) {
    const std::string out = tmp_path("loraconv", tag + ".jsonl");
    const ShellRun g = sh(kMoetrainBin + " generate --device cpu " + extra + " --prompts " + prompts + " --out " + out +
                          " --max-new-tokens 6 --temperature 0");
    EXPECT_EQ(g.code, 0) << g.out;
    return read_json_lines(out);
  };
  const auto beside = gen("--model " + base + " --adapter " + ad + " --merge-adapter off", "beside");
  const auto from_merged = gen("--model " + merged, "merged");
  const auto plain = gen("--model " + base, "base");
  ASSERT_EQ(beside.size(), 2u);
  ASSERT_EQ(from_merged.size(), 2u);
  bool differs = false;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(beside[i]["token_ids"], from_merged[i]["token_ids"]);
    for (size_t t = 0; t < beside[i]["logprobs"].size(); ++t)
      EXPECT_NEAR(beside[i]["logprobs"][t].get<double>(), from_merged[i]["logprobs"][t].get<double>(), 1e-4);
    differs = differs || beside[i]["logprobs"] != plain[i]["logprobs"];
  }
  EXPECT_TRUE(differs) << "the adapters changed nothing";
  // Both flags, or neither on a LoRA source, are refused by name.
  r = sh(kMoetrainBin + " convert --from " + run + "/checkpoint-10 --to " + tmp_path("loraconv", "x") + " --adapter --merge");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("give one of --adapter"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " convert --from " + run + "/checkpoint-10 --to " + tmp_path("loraconv", "y"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("holds LoRA adapters, not a model"), std::string::npos) << r.out;
}

// grpo from a preset (its init at --seed: no model directory, as for Qwen3-30B-A3B here) with LoRA: the run,
// a resume that checks the start is the same init, and convert --merge making the base again from the seed.
TEST(LoraCli, GrpoFromAPresetAndItsMergedExport) {
  const std::string prompts = tmp_path("lorapreset", "prompts.jsonl"), reward = tmp_path("lorapreset", "reward.py");
  {
    std::ofstream f(prompts);
    for (int i = 0; i < 4; ++i) f << nlohmann::json{{"prompt_ids", {1 + i, 2 + i}}, {"answer", "1"}}.dump() << "\n";
    std::ofstream(reward) << "import sys, json\nfor line in sys.stdin:\n"
                             "    print(len(json.loads(line)['response']) % 2, flush=True)\n";
  }
  const std::string run = tmp_path("lorapreset", "run"), merged = tmp_path("lorapreset", "merged");
  fs::remove_all(run);
  fs::remove_all(merged);
  const std::string args = " grpo --device cpu --model tiny --prompts " + prompts + " --reward 'program:python3 " +
                           reward + "' --max-new-tokens 3 --n 2 --prompts-per-step 2 --lora-rank 2 --run-dir " + run;
  ShellRun r = sh(kMoetrainBin + args + " --steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + args + " --steps 3 --resume --seed 5");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("a preset's start is its init at --seed"), std::string::npos) << r.out;
  r = sh(kMoetrainBin + " convert --from " + run + "/checkpoint-2 --to " + merged + " --merge");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(merged + "/model.safetensors"));
  r = sh(kMoetrainBin + " grpo --device cpu --model no-such-model --prompts " + prompts + " --run-dir " + run + "x");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("nor is it a preset"), std::string::npos) << r.out;
}

// sft with LoRA: packed chat documents (document boundaries in attention), the loss on the assistant turns;
// the adapters learn (the loss falls) and the checkpoint is an adapter.
TEST(LoraCli, SftTrainsAdaptersOnPackedChats) {
  const std::string dir = tmp_path("lorasft", "run");
  fs::remove_all(dir);
  const ShellRun r = sh(kMoetrainBin + " sft --device cpu --model tiny --tokenizer " + std::string(MT_SOURCE_DIR) +
                        "/tests/assets/tokenizer/trained/tokenizer.json --data " + std::string(MT_SOURCE_DIR) +
                        "/examples/chat_small.jsonl --steps 12 --seq-len 256 --lr 3e-3 --warmup-steps 2 "
                        "--lora-rank 8 --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("packed documents"), std::string::npos) << r.out;
  const auto steps = read_json_lines(dir + "/metrics.jsonl");
  std::vector<double> loss;
  for (const auto& j : steps)
    if (j.contains("loss") && j.contains("step")) loss.push_back(j["loss"].get<double>());
  ASSERT_EQ(loss.size(), 12u);
  EXPECT_LT(loss.back(), loss.front() - 0.3) << loss.front() << " -> " << loss.back();
  EXPECT_TRUE(fs::exists(dir + "/checkpoint-12/adapter/adapter_model.safetensors"));
}
