// A checkpoint carries everything that defines the model it holds (docs/model.md "What a checkpoint
// carries"): score_before_experts in its config.json (moetrain_score_before_experts) and the aux-loss-free
// balancing bias in router_bias.safetensors. Tiny models trained a few steps by the real binary, then
// `grads` and greedy `generate` on the checkpoint, each compared with an in-process model built by hand
// with the same options (equal) and without them (different: so the test can fail); a setting that
// contradicts the checkpoint is an error naming both (a resume too); `train --init-from` with rate 0, and
// grpo, keep the bias in their checkpoints; convert refuses a score-before-experts model; every rank of a
// launch routes the same (dp_shard, ep, tp); a checkpoint without the key or the file runs as before.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/hf_checkpoint.h"
#include "model/qwen3_moe.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"
#include "test_util.h"
#include "train/load_balance.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

// A few steps of `moetrain train` on the tiny preset (synthetic addition), `extra` the options under test;
// returns the checkpoint directory.
std::string train_tiny(const std::string& tag, const std::string& extra, const std::string& model = "tiny") {
  const std::string out = tmp_path("ckptmodel", tag);
  fs::remove_all(out);
  const ShellRun r = sh(kMoetrainBin + " train --model " + model +
                        " --device cpu --steps 3 --micro_batch_size 4 --seq_len 32 --eval_problems 0 --lr 1e-2 "
                        "--warmup_steps 0 --tensorboard 0 --threads 1 --out_dir " +
                        out + " " + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  return out + "/checkpoint-3";
}

// The checkpoint's weights in a model built by hand: `score_before` and, when `bias`, the file's bias.
std::unique_ptr<Qwen3MoeModel> model_of(const std::string& dir, bool score_before, bool bias) {
  ModelConfig c = load_model_config(dir);
  c.score_before_experts = score_before;
  auto m = std::make_unique<Qwen3MoeModel>(c);
  load_hf_weights(dir, c, m->table(), m->params());
  if (bias) {
    m->enable_router_bias();
    EXPECT_TRUE(load_router_bias(dir, c, m->router_bias())) << dir;
  }
  return m;
}

// grads' loss and every gradient against a model's (relative L2 of all gradients together).
struct GradsGap {
  double loss = 0, grads = 0;
};
GradsGap grads_gap(const std::string& grads_file, Qwen3MoeModel& m, const std::string& batch) {
  SafetensorsFile bf(batch), gf(grads_file);
  MicroBatch mb{bf.view("input_ids").clone(), bf.view("labels").clone()};
  int64_t n = 0;
  for (int64_t i = 0; i < mb.labels.numel(); ++i)
    n += (i % mb.labels.size(1)) != mb.labels.size(1) - 1 && mb.labels.data<int64_t>()[(i + 1)] != -100;
  m.zero_grads();
  PassOptions po;
  po.ce_scale = 1.0 / double(n);
  po.aux_scale = m.aux_enabled() ? m.config().router_aux_loss_coef : 0.0;
  const LossParts lp = m.forward_backward(mb, po);
  GradsGap g;
  g.loss = std::fabs(lp.loss - gf.read_f32("loss").data<float>()[0]) / std::fabs(lp.loss);
  double num = 0, den = 0;
  int64_t compared = 0;
  for (const auto& [name, mine] : export_hf_tensors(m.config(), m.table(), m.grads(), ExpertLayout::PerExpert)) {
    if (!gf.has("grad." + name)) continue;  // a tied lm_head
    const Tensor t = gf.read_f32("grad." + name);
    EXPECT_EQ(t.shape(), mine.shape()) << name;
    ++compared;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double d = double(t.data<float>()[i]) - mine.data<float>()[i];
      num += d * d;
      den += double(t.data<float>()[i]) * t.data<float>()[i];
    }
  }
  EXPECT_GT(compared, 10);
  g.grads = std::sqrt(num / den);
  return g;
}

// Greedy `generate` on `dir`: per prompt its token ids and log-probs.
std::vector<nlohmann::json> generate_greedy(const std::string& dir, const std::string& tag) {
  const std::string prompts = tmp_path("ckptmodel", tag + "_prompts.jsonl"), out = tmp_path("ckptmodel", tag + ".jsonl");
  {
    std::ofstream f(prompts);
    f << R"({"prompt_ids": [3, 14, 15, 9, 2, 6]})" << "\n" << R"({"prompt_ids": [27, 1, 8]})" << "\n";
  }
  const ShellRun r = sh(kMoetrainBin + " generate --device cpu --threads 1 --model " + dir + " --prompts " + prompts +
                        " --out " + out + " --max-new-tokens 8 --temperature 0 --ignore-eos");
  EXPECT_EQ(r.code, 0) << r.out;
  return read_json_lines(out);
}

// The largest gap between generate's log-probs and a full forward of prompt + response by `m`, and
// whether `m`'s greedy choice is generate's token at every step.
struct GenGap {
  double logprob = 0;
  bool same_tokens = true;
};
GenGap generate_gap(const std::vector<nlohmann::json>& lines, Qwen3MoeModel& m) {
  const std::vector<std::vector<int64_t>> prompts = {{3, 14, 15, 9, 2, 6}, {27, 1, 8}};
  GenGap g;
  EXPECT_EQ(lines.size(), prompts.size());
  for (const nlohmann::json& line : lines) {
    const std::vector<int64_t>& p = prompts[line.at("prompt_index").get<size_t>()];
    const std::vector<int64_t> resp = line.at("token_ids").get<std::vector<int64_t>>();
    std::vector<int64_t> seq = p;
    seq.insert(seq.end(), resp.begin(), resp.end());
    const int64_t S = int64_t(seq.size()), V = m.config().vocab_size;
    Tensor ids = Tensor::empty({1, S}, DType::I64);
    for (int64_t t = 0; t < S; ++t) ids.data<int64_t>()[t] = seq[size_t(t)];
    Tensor logits;
    m.forward(MicroBatch{ids, ids.clone()}, &logits);
    for (size_t k = 0; k < resp.size(); ++k) {
      const float* row = logits.data<float>() + (int64_t(p.size()) - 1 + int64_t(k)) * V;
      double mx = row[0];
      int64_t arg = 0;
      for (int64_t v = 1; v < V; ++v)
        if (row[v] > mx) mx = row[v], arg = v;
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(double(row[v]) - mx);
      const double lp = double(row[resp[k]]) - mx - std::log(z);
      g.logprob = std::max(g.logprob, std::fabs(lp - line.at("logprobs")[k].get<double>()));
      g.same_tokens = g.same_tokens && arg == resp[k];
    }
  }
  return g;
}

// A copy of model directory `dir` whose config.json has `key` set to `value` (null: removed).
// `moetrain grads` on `ckpt` (no option given) against the in-process models with and without the setting
// (`what`): the same loss and gradients as `with`, gradients at least `min_other` from `without` (else the
// test could not fail). Returns the command's output.
std::string expect_grads_follow(const std::string& ckpt, const std::string& batch, const std::string& tag,
                                Qwen3MoeModel& with, Qwen3MoeModel& without, const char* what, double min_other) {
  const std::string gout = tmp_path("ckptmodel", tag + "_grads.safetensors");
  const ShellRun r = sh(kMoetrainBin + " grads --model " + ckpt + " --batch " + batch + " --out " + gout);
  EXPECT_EQ(r.code, 0) << r.out;
  if (r.code != 0) return r.out;
  const GradsGap same = grads_gap(gout, with, batch), other = grads_gap(gout, without, batch);
  std::printf("grads vs in-process: with %s loss %.2e grads %.2e; without loss %.2e grads %.2e\n", what, same.loss,
              same.grads, other.loss, other.grads);
  EXPECT_LE(same.loss, 1e-6);
  EXPECT_LE(same.grads, 1e-6);
  EXPECT_GT(other.grads, min_other) << what << " changes nothing here: the test could not fail";
  return r.out;
}

// Greedy `moetrain generate` on `ckpt`: the tokens and log-probs of the in-process model `with`, and log-probs
// at least 1e-3 from `without`.
void expect_generate_follows(const std::string& ckpt, const std::string& tag, Qwen3MoeModel& with,
                             Qwen3MoeModel& without, const char* what) {
  const std::vector<nlohmann::json> lines = generate_greedy(ckpt, tag);
  const GenGap gs = generate_gap(lines, with), go = generate_gap(lines, without);
  std::printf("generate vs in-process: with %s %.2e (tokens %s); without %.2e (tokens %s)\n", what, gs.logprob,
              gs.same_tokens ? "same" : "differ", go.logprob, go.same_tokens ? "same" : "differ");
  EXPECT_LE(gs.logprob, 1e-4);
  EXPECT_TRUE(gs.same_tokens);
  EXPECT_GT(go.logprob, 1e-3) << what << " changes nothing here: the test could not fail";
}

// One grpo step on `ckpt` with a KL term (its reference must route as the policy), `prefix` before `grpo`
// (e.g. a launch) and `layout` after it; the run's directory is fresh.
ShellRun grpo_one_step(const std::string& ckpt, const std::string& run, const std::string& prefix = "",
                       const std::string& layout = "") {
  fs::remove_all(run);
  return sh(kMoetrainBin + " " + prefix + "grpo --device cpu " + layout + "--model " + ckpt +
            " --steps 1 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 1 --eval-problems 4 "
            "--epochs 1 --mini-batches 1 --kl-coef 0.01 --dynamic-sampling off --out-dir " +
            run);
}

std::string copy_with_key(const std::string& dir, const std::string& tag, const char* key, const nlohmann::json& value) {
  const std::string out = tmp_path("ckptmodel", tag);
  fs::remove_all(out);
  fs::create_directories(out);
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) fs::copy_file(e.path(), fs::path(out) / e.path().filename());
  std::ifstream in(dir + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  if (value.is_null()) j.erase(key);
  else j[key] = value;
  std::ofstream(out + "/config.json") << j.dump(2) << "\n";
  return out;
}

}  // namespace

TEST(CheckpointModel, ScoreBeforeExpertsTravelsWithTheCheckpoint) {
  const std::string ckpt = train_tiny("sbe", "--score_before_experts 1");
  std::ifstream cf(ckpt + "/config.json");
  EXPECT_EQ(nlohmann::json::parse(cf).value("moetrain_score_before_experts", false), true);
  EXPECT_TRUE(load_model_config(ckpt).score_before_experts);
  auto with = model_of(ckpt, true, false), without = model_of(ckpt, false, false);

  // grads, no option given: the checkpoint's model.
  const std::string batch = make_batch(ckpt, tmp_path("ckptmodel", "sbe_batch.safetensors"));
  const std::string out = expect_grads_follow(ckpt, batch, "sbe", *with, *without, "the option", 1e-3);
  EXPECT_NE(out.find("score_before_experts (its config.json)"), std::string::npos) << out;
  // The same weights without the key: Qwen3-MoE's formula, as before.
  const std::string keyless = copy_with_key(ckpt, "sbe_keyless", "moetrain_score_before_experts", nullptr);
  const std::string gout2 = tmp_path("ckptmodel", "sbe_grads_keyless.safetensors");
  ASSERT_EQ(sh(kMoetrainBin + " grads --model " + keyless + " --batch " + batch + " --out " + gout2).code, 0);
  EXPECT_LE(grads_gap(gout2, *without, batch).grads, 1e-6);

  // generate (greedy): the checkpoint's model's tokens and log-probs.
  expect_generate_follows(ckpt, "sbe_gen", *with, *without, "the option");
}

TEST(CheckpointModel, RouterBiasTravelsWithTheCheckpoint) {
  const std::string ckpt = train_tiny("bias", "--router_bias_update_rate 0.05");
  ASSERT_TRUE(fs::exists(ckpt + "/" + kRouterBiasFile));
  auto with = model_of(ckpt, false, true), without = model_of(ckpt, false, false);
  double amax = 0;
  for (int64_t i = 0; i < with->router_bias().numel(); ++i)
    amax = std::max(amax, double(std::fabs(with->router_bias().data<float>()[i])));
  EXPECT_GT(amax, 0.1) << "the bias did not move";

  const std::string batch = make_batch(ckpt, tmp_path("ckptmodel", "bias_batch.safetensors"));
  expect_grads_follow(ckpt, batch, "bias", *with, *without, "the bias", 1e-2);
  expect_generate_follows(ckpt, "bias_gen", *with, *without, "the bias");

  // train --init-from with rate 0 routes with the bias, unchanged, and its checkpoint keeps it.
  const std::string next = train_tiny("bias_next", "--init-from " + ckpt);
  ASSERT_TRUE(fs::exists(next + "/" + kRouterBiasFile)) << "train --init-from dropped the model's routing bias";
  SafetensorsFile a(ckpt + "/" + kRouterBiasFile), b(next + "/" + kRouterBiasFile);
  for (const std::string& n : a.names()) EXPECT_TRUE(mt::testutil::same_bits(a.read_f32(n), b.read_f32(n))) << n;

  // grpo: its checkpoint keeps the bias it ran with, and its reference routes as the policy (the KL to the
  // reference before the first update is 0).
  const std::string run = tmp_path("ckptmodel", "bias_grpo");
  const ShellRun g = grpo_one_step(ckpt, run);
  ASSERT_EQ(g.code, 0) << g.out;
  ASSERT_TRUE(fs::exists(run + "/checkpoint-1/" + kRouterBiasFile)) << "grpo's checkpoint lacks the routing bias";
  SafetensorsFile c(run + "/checkpoint-1/" + kRouterBiasFile);
  for (const std::string& n : a.names()) EXPECT_TRUE(mt::testutil::same_bits(a.read_f32(n), c.read_f32(n))) << n;
  const std::vector<nlohmann::json> metrics = read_step_metrics(run + "/metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(metrics[0].at("ref_kl").get<double>(), 0.0) << metrics[0].dump();
}

TEST(CheckpointModel, ASettingThatContradictsTheCheckpointIsAnError) {
  const std::string ckpt = train_tiny("contra", "--score_before_experts 1");
  // train from it with the other formula, and grads asking for it on a model without it.
  ShellRun r = sh(kMoetrainBin + " train --model tiny --device cpu --steps 1 --warmup_steps 0 --eval_problems 0 --init-from " + ckpt +
                  " --score_before_experts 0 --out_dir " + tmp_path("ckptmodel", "contra_run"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("score_before_experts 0 contradicts " + ckpt + "/config.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"moetrain_score_before_experts\": true"), std::string::npos) << r.out;
  const std::string plain = kGoldens + "/tiny";
  const std::string batch = make_batch(plain, tmp_path("ckptmodel", "contra_batch.safetensors"));
  r = sh(kMoetrainBin + " grads --score-before-experts --model " + plain + " --batch " + batch + " --out " +
         tmp_path("ckptmodel", "contra_grads.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--score-before-experts 1 contradicts " + plain + "/config.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("has no \"moetrain_score_before_experts\""), std::string::npos) << r.out;
  // Without the key, train --init-from takes the checkpoint's (and its checkpoint carries it on).
  const std::string next = train_tiny("contra_next", "--init-from " + ckpt);
  EXPECT_TRUE(load_model_config(next).score_before_experts);
  // convert refuses it: transformers would run the other formula.
  r = sh(kMoetrainBin + " convert --from " + ckpt + " --to " + tmp_path("ckptmodel", "contra_hf"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("transformers' Qwen3-MoE computes y = sum_k w_k expert_k(x)"), std::string::npos) << r.out;
}

TEST(CheckpointModel, ACheckpointWithoutTheKeyOrTheFileRunsAsBefore) {
  // The golden tiny model (transformers' checkpoint: neither key nor bias): grads is the plain model's.
  const std::string dir = kGoldens + "/tiny";
  ASSERT_FALSE(fs::exists(dir + "/" + kRouterBiasFile));
  EXPECT_FALSE(load_model_config(dir).score_before_experts);
  auto plain = model_of(dir, false, false);
  const std::string batch = make_batch(dir, tmp_path("ckptmodel", "plain_batch.safetensors"));
  const std::string gout = tmp_path("ckptmodel", "plain_grads.safetensors");
  const ShellRun r = sh(kMoetrainBin + " grads --model " + dir + " --batch " + batch + " --out " + gout);
  ASSERT_EQ(r.code, 0) << r.out;
  const GradsGap g = grads_gap(gout, *plain, batch);
  EXPECT_LE(g.loss, 1e-6);
  EXPECT_LE(g.grads, 1e-6);
  // A checkpoint written from it has no key (transformers' config stays as it was) and no bias file.
  const std::string next = train_tiny("plain_next", "--init-from " + dir, dir);
  std::ifstream cf(next + "/config.json");
  EXPECT_FALSE(nlohmann::json::parse(cf).contains("moetrain_score_before_experts"));
  EXPECT_FALSE(fs::exists(next + "/" + kRouterBiasFile));
}

TEST(CheckpointModel, EveryRankOfALaunchRoutesWithTheCheckpoints) {
  MT_SKIP_WITHOUT_GLOO();
  // Both settings at once; rank 0 reads the bias and broadcasts it, so every layout equals one process.
  const std::string ckpt = train_tiny("ranks", "--score_before_experts 1 --router_bias_update_rate 0.05");
  auto with = model_of(ckpt, true, true);
  const std::string batch = make_batch(ckpt, tmp_path("ckptmodel", "ranks_batch.safetensors"));
  const std::string ref = tmp_path("ckptmodel", "ranks_ref.safetensors");
  ASSERT_EQ(sh(kMoetrainBin + " grads --model " + ckpt + " --batch " + batch + " --out " + ref).code, 0);
  EXPECT_LE(grads_gap(ref, *with, batch).grads, 1e-6);
  for (const char* layout : {"--dp-shard 2", "--ep 2", "--tp 2"}) {
    const std::string out = tmp_path("ckptmodel", "ranks_got.safetensors");
    const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- grads --model " + ckpt + " --batch " + batch +
                          " --out " + out + " " + layout);
    ASSERT_EQ(r.code, 0) << layout << "\n" << r.out;
    expect_same(out, ref, std::string("grads ") + layout);
  }
  const std::string prompts = tmp_path("ckptmodel", "ranks_prompts.jsonl");
  {
    std::ofstream f(prompts);
    f << R"({"prompt_ids": [3, 14, 15, 9, 2, 6]})" << "\n" << R"({"prompt_ids": [27, 1, 8]})" << "\n";
  }
  const std::string args = " --device cpu --model " + ckpt + " --prompts " + prompts +
                           " --max-new-tokens 8 --temperature 0 --ignore-eos --out ";
  const std::string one = tmp_path("ckptmodel", "ranks_gen1.jsonl"), two = tmp_path("ckptmodel", "ranks_gen2.jsonl");
  ASSERT_EQ(sh(kMoetrainBin + " generate" + args + one).code, 0);
  EXPECT_LE(generate_gap(read_json_lines(one), *with).logprob, 1e-4);
  const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- generate" + args + two + " --ep 2");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<nlohmann::json> a = read_json_lines(one), b = read_json_lines(two);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["token_ids"], b[i]["token_ids"]) << i;
    for (size_t t = 0; t < a[i]["logprobs"].size(); ++t)
      EXPECT_NEAR(a[i]["logprobs"][t].get<double>(), b[i]["logprobs"][t].get<double>(), 1e-5) << i;
  }
  // grpo under tp 2 generates on a one-device copy of the policy: it routes as the policy (the rollout's
  // log-probs equal the trainer's; 6.8e-3 apart when the copy lacks the bias) and as the reference.
  const std::string run = tmp_path("ckptmodel", "ranks_grpo");
  const ShellRun g = grpo_one_step(ckpt, run, "launch --nproc-per-node 2 -- ", "--tp 2 ");
  ASSERT_EQ(g.code, 0) << g.out;
  const std::vector<nlohmann::json> metrics = read_step_metrics(run + "/metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_LT(metrics[0].at("logprob_diff_max").get<double>(), 1e-5) << metrics[0].dump();
  EXPECT_EQ(metrics[0].at("ref_kl").get<double>(), 0.0) << metrics[0].dump();
}

TEST(CheckpointModel, TheKeyIsCheckedAndAResumeKeepsTheModel) {
  // config.json's key is checked like every field: a boolean, and only where there are MoE layers.
  ModelConfig dense = preset_model_config("tiny");
  dense.architecture = "Qwen3ForCausalLM";
  dense.num_experts = dense.num_experts_per_tok = dense.moe_intermediate_size = 0;
  nlohmann::json j = nlohmann::json::parse(model_config_to_json(dense));
  j["moetrain_score_before_experts"] = true;
  EXPECT_NE(mt::testutil::error_of([&] { parse_model_config(j.dump(), "dense.json"); })
                .find("score_before_experts (moetrain_score_before_experts) true needs MoE layers"),
            std::string::npos);
  nlohmann::json m = nlohmann::json::parse(model_config_to_json(preset_model_config("tiny")));
  m["moetrain_score_before_experts"] = 1;
  EXPECT_NE(mt::testutil::error_of([&] { parse_model_config(m.dump(), "moe.json"); })
                .find("field 'moetrain_score_before_experts' must be true or false, got 1"),
            std::string::npos);
  // A resume runs the model its checkpoint holds: without the key it is refused, naming the value to give.
  const std::string ckpt = train_tiny("resume", "--score_before_experts 1 --save_every 1 --max_steps 2");
  const std::string run = fs::path(ckpt).parent_path().string();
  ASSERT_TRUE(fs::exists(run + "/checkpoint-2"));
  const std::string base = kMoetrainBin +
                           " train --model tiny --device cpu --steps 3 --micro_batch_size 4 --seq_len 32 --eval_problems 0 "
                           "--lr 1e-2 --warmup_steps 0 --tensorboard 0 --threads 1 --resume --out_dir " +
                           run;
  ShellRun r = sh(base);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("was trained with score_before_experts 1, but this run's model has 0"), std::string::npos)
      << r.out;
  r = sh(base + " --score_before_experts 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(load_model_config(run + "/checkpoint-3").score_before_experts);
}
