// The RL update under the parallel layouts: for the same rollouts (`moetrain _selftest rl`:
// fixed prompts, samples, engine log-probs, rewards and routing records), grpo_update's loss and every
// gradient (16 samples in 3-sample micro-batches, so some are padded for 2 ranks; a KL term to the
// reference session; the tempered head; one optimizer step) under dp_shard 2, ep 2, tp 2 and sp 2 equal one
// process (fp32 CPU, DESIGN's layout tolerance: 1e-6 all together), and so do the weights after the
// AdamW step (1e-5 a tensor, 2e-6 together: measured 1.3e-6 under tp, where the step's g / (|g| + eps)
// magnifies the rounding of near-zero expert gradients). PPO (the critic initialised from the policy
// shard by shard, the critic's own update and gradients) under dp_shard 2 likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/safetensors.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

void expect_layout_equal(const std::string& args, const std::string& layout, const std::string& tag, int nproc = 2) {
  const std::string ref = tmp_path("rl_ranks", tag + "_ref.safetensors"),
                    got = tmp_path("rl_ranks", tag + "_got.safetensors");
  const std::string cmd = " _selftest rl --model " + kGoldens + "/tiny " + args;
  ShellRun r = sh(kMoetrainBin + cmd + " --out " + ref + " --params-out " + ref + ".params");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + " launch --nproc-per-node " + std::to_string(nproc) + " --" + cmd + " " + layout + " --out " +
         got + " --params-out " + got + ".params");
  ASSERT_EQ(r.code, 0) << layout << "\n" << r.out;
  double worst = 0, all = 0;
  expect_same(got, ref, tag + " " + layout, &worst, &all);
  EXPECT_LE(all, 1e-6) << layout;
  // The weights after the update: AdamW's first step (about lr g / (|g| + eps)) magnifies the rounding of
  // gradients near zero (rarely routed experts).
  SafetensorsFile a(got + ".params"), b(ref + ".params");
  ASSERT_EQ(a.names(), b.names());
  double num = 0, den = 0;
  for (const std::string& name : b.names()) {
    const Tensor x = a.read_f32(name), y = b.read_f32(name);
    EXPECT_LE(rel_l2(x, y), 1e-5) << tag << " " << layout << ": " << name;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double d = double(x.data<float>()[i]) - y.data<float>()[i];
      num += d * d;
      den += double(y.data<float>()[i]) * y.data<float>()[i];
    }
  }
  EXPECT_LE(std::sqrt(num / den), 2e-6) << tag << " " << layout << ": all weights after the update";
  SafetensorsFile f(ref);
  EXPECT_NE(f.read_f32("loss").data<float>()[0], 0.0f);
  EXPECT_GT(f.read_f32("grad_norm").data<float>()[0], 0.0f);
}

}  // namespace

TEST(RlRanks, GrpoUpdateEqualsOneProcessUnderDpShardEpTpSp) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--mini-batches 1", "--dp-shard 2", "grpo");
  expect_layout_equal("--mini-batches 1", "--ep 2", "grpo");
  expect_layout_equal("--mini-batches 1", "--sp 2", "grpo");  // each rank's chunk of the positions, replayed
  // The model does not replay routing under tp: the router decides, in both runs.
  expect_layout_equal("--no-replay --mini-batches 1", "--tp 2", "grpo_noreplay");
}

// Four ranks: sp with tp (each tp rank a slice of its sp chunk's tokens, placed back by mesh coordinates),
// sp with dp_shard, HSDP (dp_replicate 2 x dp_shard 2); the whole step with generation under tp 2 x sp 2.
TEST(RlRanks, GrpoEqualsOneProcessOnFourRanksTpSpDpShardSpHsdp) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--no-replay --mini-batches 1", "--tp 2 --sp 2", "grpo_tpsp", 4);
  expect_layout_equal("--mini-batches 1", "--dp-shard 2 --sp 2", "grpo_dpsp", 4);
  expect_layout_equal("--mini-batches 1", "--dp-replicate 2 --dp-shard 2", "grpo_hsdp", 4);  // HSDP
  expect_layout_equal("--generate --no-replay --mini-batches 1", "--tp 2 --sp 2", "step_tpsp", 4);
}

TEST(RlRanks, PpoUpdateEqualsOneProcessUnderDpShard) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--algorithm ppo --kl-coef 0 --mini-batches 1", "--dp-shard 2", "ppo");
  expect_layout_equal("--algorithm ppo --kl-coef 0 --mini-batches 1", "--sp 2", "ppo");
}

TEST(RlRanks, ReplayUnderTpIsAnErrorNamingIt) {
  MT_SKIP_WITHOUT_GLOO();
  const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- _selftest rl --model " + kGoldens +
                        "/tiny --tp 2 --out " + tmp_path("rl_ranks", "x.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("routing replay under tp 2 is not supported"), std::string::npos) << r.out;
}

// GSPO's sequence ratio is a mean over each sample's every token, which a tp or sp rank holds only a slice
// of: the loop refuses the loss there (it ran before and gave other gradients than one process: `_selftest
// rl --loss gspo --no-replay`, grad norm 4.9335 on one process, 4.8494 under tp 2, 4.8308 under sp 2).
// Under dp_shard 2 and ep 2 (whole samples per rank, some micro-batches padded) it equals one process.
TEST(RlRanks, GspoEqualsOneProcessUnderDpShardAndIsRefusedUnderTpAndSp) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--loss gspo", "--dp-shard 2", "gspo");
  expect_layout_equal("--loss gspo", "--ep 2", "gspo");
  for (const std::string layout : {"--tp 2", "--sp 2"}) {
    const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 -- _selftest rl --model " + kGoldens +
                          "/tiny --loss gspo --no-replay " + layout + " --out " + tmp_path("rl_ranks", "x.safetensors"));
    EXPECT_NE(r.code, 0) << layout;
    EXPECT_NE(r.out.find("the gspo loss under " + layout.substr(2) + " is not supported"), std::string::npos)
        << layout << "\n" << r.out;
  }
}

// The whole step with generation: each data-parallel rank samples its share of the fixed prompts (seeds
// by global prompt index), rewards it, and the exchange gives every rank the whole round; dynamic
// sampling decides from it. The engine's logits under the layout equal one process's to rounding, so
// the same tokens are drawn (measured: the same reward, loss and gradients) and the update follows.
TEST(RlRanks, GrpoStepWithGenerationEqualsOneProcessUnderDpShardEpTpSp) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--generate --mini-batches 1", "--dp-shard 2", "step");
  expect_layout_equal("--generate --mini-batches 1", "--ep 2", "step");
  // Under tp every rank generates on its TpGenerator copy (the full weights gathered before the round).
  expect_layout_equal("--generate --no-replay --mini-batches 1", "--tp 2", "step_noreplay");
  // Under sp too (the copy records routing, and the sp chunks replay it).
  expect_layout_equal("--generate --mini-batches 1", "--sp 2", "step");
}

// `moetrain grpo` under launch: token-id prompts rewarded by a program (the share of '1' characters in
// the response's token list, so groups differ), 2 steps; under dp_shard 2, ep 2 and tp 2 each step's
// reward equals one process's and the loss and grad norm follow (after the first AdamW step they drift by
// rounding only), rank 0 alone writes metrics.jsonl and the summary line, and the sharded checkpoint is
// committed.
TEST(RlRanks, GrpoCommandUnderLaunchFollowsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dir = tmp_path("rl_ranks", "cli");
  {
    std::ofstream f(dir + ".jsonl");
    f << "{\"prompt_ids\": [1, 2, 3]}\n{\"prompt_ids\": [7, 8]}\n{\"prompt_ids\": [5, 9, 4, 4]}\n"
         "{\"prompt_ids\": [11, 3]}\n";
    std::ofstream p(dir + ".py");
    p << "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)['response']\n"
         "    print(r.count('1') / (1 + len(r)), flush=True)\n";
  }
  const std::string args = " grpo --device cpu --model " + kGoldens + "/tiny --prompts " + dir +
                           ".jsonl --reward 'program:python3 " + dir +
                           ".py' --prompts-per-step 2 --n 4 --steps 2 --max-new-tokens 4 --temperature 1 "
                           "--dynamic-sampling off --run-dir ";
  ShellRun r = sh(kMoetrainBin + args + dir + "_one");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<nlohmann::json> one = read_step_metrics(dir + "_one/metrics.jsonl");
  ASSERT_EQ(one.size(), 2u);
  double reward_sum = 0;
  for (const auto& j : one) reward_sum += j["reward_mean"].get<double>();
  EXPECT_GT(reward_sum, 0) << "the test needs rewards to train on";
  for (const std::string layout : {"--dp-shard 2", "--ep 2", "--tp 2", "--sp 2"}) {
    const std::string run = dir + "_" + layout.substr(2, 2);
    r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + args + run + " " + layout);
    ASSERT_EQ(r.code, 0) << layout << "\n" << r.out;
    const std::vector<nlohmann::json> got = read_step_metrics(run + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 2u) << layout << ": one writer";
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(got[s]["reward_mean"].get<double>(), one[s]["reward_mean"].get<double>()) << layout << " step " << s;
      for (const char* k : {"loss", "grad_norm"})
        EXPECT_NEAR(got[s][k].get<double>(), one[s][k].get<double>(), 1e-4 * (1 + std::abs(one[s][k].get<double>())))
            << layout << " step " << s << " " << k;
    }
    EXPECT_NE(r.out.find("[rank 0] grpo: 2 steps done"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("[rank 1] grpo: 2 steps done"), std::string::npos) << r.out;
    EXPECT_TRUE(std::filesystem::exists(run + "/checkpoint-2/manifest.json")) << layout;
    EXPECT_TRUE(std::filesystem::exists(run + "/checkpoint-2/model.safetensors")) << layout;
  }
}

// MoE routers in RL, through `_selftest rl` on one process: --freeze-router leaves every
// router's weights exactly as loaded (AdamW's weight decay included) with zero gradients while the rest
// trains; the load-balancing loss (a model with output_router_logits) and the router z-loss are off by
// default and, when given a coefficient, add coefficient x term to the loss. Under dp_shard 2 and ep 2 the
// frozen update equals one process's.
TEST(RlRouter, FrozenRoutersKeepTheirWeightsAndTheRestTrains) {
  const std::string out = tmp_path("rl_router", "frozen.safetensors");
  const ShellRun r = sh(kMoetrainBin + " _selftest rl --model " + kGoldens + "/tiny --mini-batches 1 --freeze-router --out " +
                        out + " --params-out " + out + ".params");
  ASSERT_EQ(r.code, 0) << r.out;
  SafetensorsFile init(kGoldens + "/tiny/model.safetensors"), grads(out), after(out + ".params");
  int routers = 0, moved = 0;
  const std::vector<std::string> hf = init.names();
  for (const std::string& pname : after.names()) {
    const std::string name = pname.substr(6);  // "param." + the table's name
    if (std::find(hf.begin(), hf.end(), name) == hf.end()) continue;  // fused experts: named otherwise in HF
    const Tensor before = init.read_f32(name), now = after.read_f32(pname);
    const bool same = std::memcmp(before.raw(), now.raw(), before.nbytes()) == 0;
    if (name.find(".mlp.gate.weight") != std::string::npos) {
      ++routers;
      EXPECT_TRUE(same) << name << " moved although frozen";
      const Tensor g = grads.read_f32("grad." + name);
      for (int64_t i = 0; i < g.numel(); ++i) ASSERT_EQ(g.data<float>()[i], 0.0f) << name;
    } else {
      moved += same ? 0 : 1;
    }
  }
  EXPECT_GT(routers, 0);
  EXPECT_GT(moved, 10) << "the other weights train";
}

TEST(RlRouter, AuxAndZLossAreOffByDefaultAndAddTheirTermsWhenGiven) {
  auto loss_of = [](const std::string& model, const std::string& args, const std::string& tag) {
    const std::string out = tmp_path("rl_router", tag + ".safetensors");
    const ShellRun r =
        sh(kMoetrainBin + " _selftest rl --model " + kGoldens + "/" + model + " --mini-batches 1 " + args + " --out " + out);
    EXPECT_EQ(r.code, 0) << r.out;
    return double(SafetensorsFile(out).read_f32("loss").data<float>()[0]);
  };
  const double base = loss_of("aux", "", "base"), aux = loss_of("aux", "--aux-loss-coef 0.01", "aux"),
               z = loss_of("tiny", "--router-z-loss-coef 0.01", "z"), z0 = loss_of("tiny", "", "z0");
  EXPECT_GT(aux - base, 0.005) << "0.01 x a load-balancing loss of about 1-2";
  EXPECT_LT(aux - base, 0.05);
  EXPECT_GT(z - z0, 1e-4) << "0.01 x the router z-loss";
}

TEST(RlRouter, FrozenUpdateEqualsOneProcessUnderDpShardAndEp) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layout_equal("--freeze-router --mini-batches 1", "--dp-shard 2", "frozen");
  expect_layout_equal("--freeze-router --mini-batches 1", "--ep 2", "frozen");
}

// Multi-turn GRPO under launch: `grpo --env program:` (tests/assets/env/env_modes.py twoturn: a shared initial
// observation, a first turn rewarded by its length and answered "again", a second turn rewarded by its length
// plus 0.5 for an odd episode id) on a tiny text model. Each data-parallel rank runs its own environment
// program on its share of the episodes (the ids one process gives them: n = 3 makes rank 1's first id odd), and
// the exchange carries the episodes (init-extended prompts, model masks, turn starts, turn rewards, metadata):
// under dp_shard 2, ep 2, tp 2 and sp 2 every step's reward, turn count, observation tokens and the
// environment's metadata equal one process's, and the loss and grad norm follow, with the final reward and with
// per-turn credit.
TEST(RlRanks, GrpoEnvCommandUnderLaunchFollowsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dir = tmp_path("rl_ranks", "env");
  const std::string src = MT_SOURCE_DIR;
  ShellRun r = sh(kMoetrainBin + " sft --device cpu --model tiny --tokenizer " + src +
                  "/tests/assets/tokenizer/trained/tokenizer.json --data " + src +
                  "/examples/chat_small.jsonl --steps 1 --warmup-steps 0 --seq-len 64 --out-dir " + dir + "/sft");
  ASSERT_EQ(r.code, 0) << r.out;
  {
    std::ofstream f(dir + "/p.jsonl");
    f << "{\"prompt\": \"What is 2 + 2?\"}\n{\"prompt\": \"Say hi\"}\n{\"prompt\": \"Name a color\"}\n"
         "{\"prompt\": \"Count to three\"}\n";
  }
  const std::string args = " grpo --device cpu --model " + dir + "/sft/checkpoint-1 --prompts " + dir +
                           "/p.jsonl --env 'program:python3 " + src +
                           "/tests/assets/env/env_modes.py twoturn' --prompts-per-step 2 --n 3 --steps 2 "
                           "--max-new-tokens 48 --max-turn-tokens 8 --temperature 1 --dynamic-sampling off ";
  for (const std::string credit : {"final", "per-turn"}) {
    const std::string base = dir + "/" + credit;
    r = sh(kMoetrainBin + args + "--turn-credit " + credit + " --run-dir " + base + "_one");
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<nlohmann::json> one = read_step_metrics(base + "_one/metrics.jsonl");
    ASSERT_EQ(one.size(), 2u);
    for (const auto& j : one) {
      EXPECT_EQ(j["turns_mean"].get<double>(), 2.0) << "every episode has two turns: " << j.dump();
      EXPECT_GT(j["grad_norm"].get<double>(), 0) << "the groups' rewards differ: " << j.dump();
    }
    const std::vector<std::string> layouts =
        credit == "final" ? std::vector<std::string>{"--dp-shard 2", "--ep 2", "--tp 2", "--sp 2"}
                          : std::vector<std::string>{"--dp-shard 2", "--tp 2"};
    for (const std::string& layout : layouts) {
      const std::string run = base + "_" + layout.substr(2, 2);
      r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + args + "--turn-credit " + credit + " --run-dir " + run +
             " " + layout);
      ASSERT_EQ(r.code, 0) << layout << "\n" << r.out;
      const std::vector<nlohmann::json> got = read_step_metrics(run + "/metrics.jsonl");
      ASSERT_EQ(got.size(), 2u) << layout << ": one writer";
      for (size_t s = 0; s < 2; ++s) {
        for (const char* k : {"reward_mean", "turns_mean", "observation_tokens_mean", "env_errors"})
          EXPECT_EQ(got[s][k], one[s][k]) << credit << " " << layout << " step " << s << " " << k;
        EXPECT_EQ(got[s]["env"], one[s]["env"]) << credit << " " << layout << " step " << s;
        for (const char* k : {"loss", "grad_norm"})
          EXPECT_NEAR(got[s][k].get<double>(), one[s][k].get<double>(), 1e-4 * (1 + std::abs(one[s][k].get<double>())))
              << credit << " " << layout << " step " << s << " " << k;
      }
    }
  }
}
