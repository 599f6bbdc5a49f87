// LoRA under the layouts it runs in: FSDP, HSDP, expert, sequence and tensor parallelism (the base sharded or
// split, the adapters whole on every rank with their gradients summed over the ranks; under tp each rank uses
// the adapters' slice of its base slice) give one process's curve and adapters; grpo under FSDP, EP, TP and SP
// likewise; adapted experts under expert tensor parallelism are refused by name. (CPU, Gloo, `moetrain launch`.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "parallel/launch_test_util.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

std::vector<nlohmann::json> steps_of(const std::string& dir) {
  std::vector<nlohmann::json> out;
  for (const nlohmann::json& j : read_json_lines(dir + "/metrics.jsonl"))
    if (j.contains("loss") && j.contains("step")) out.push_back(j);
  return out;
}

// Every adapter tensor of two checkpoints, within `tol` relative L2.
void expect_same_adapters(const std::string& a, const std::string& b, double tol, const std::string& what) {
  SafetensorsFile fa(a + "/adapter/adapter_model.safetensors"), fb(b + "/adapter/adapter_model.safetensors");
  ASSERT_EQ(fa.names(), fb.names()) << what;
  for (const std::string& n : fa.names()) {
    const Tensor x = fa.read_f32(n), y = fb.read_f32(n);
    double num = 0, den = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double d = double(x.data<float>()[i]) - double(y.data<float>()[i]);
      num += d * d;
      den += double(y.data<float>()[i]) * double(y.data<float>()[i]);
    }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), tol) << what << ": " << n;
  }
}

const std::string kTrainArgs =
    " --steps 10 --lora-rank 4 --lr 3e-3 --warmup-steps 2 --eval-every 0 --eval-problems 0 --micro-batch-size 4";
const std::string kTrain = " train --device cpu --model tiny" + kTrainArgs + " --out-dir ";

// `train_args` (ending in --out-dir) in one process, then under each layout {ranks, flags}: the losses within
// 1e-6 and the gradient norms within 1e-5 of one process's at every step, the adapters within 1e-5 at the end.
void expect_layouts_as_one_process(const std::string& tag, const std::string& train_args,
                                   const std::vector<std::pair<int, std::string>>& layouts) {
  const std::string ref = tmp_path(tag, "ref");
  fs::remove_all(ref);
  ShellRun r = sh(kMoetrainBin + train_args + ref);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto want = steps_of(ref);
  ASSERT_EQ(want.size(), 10u);
  for (size_t k = 0; k < layouts.size(); ++k) {
    const auto& [n, flags] = layouts[k];
    const std::string dir = tmp_path(tag, "layout" + std::to_string(k));
    fs::remove_all(dir);
    r = sh(kMoetrainBin + " launch --nproc-per-node " + std::to_string(n) + " --" + train_args + dir + flags);
    ASSERT_EQ(r.code, 0) << flags << "\n" << r.out;
    const auto got = steps_of(dir);
    ASSERT_EQ(got.size(), 10u) << flags;
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_NEAR(got[i]["loss"].get<double>(), want[i]["loss"].get<double>(), 1e-6 * want[i]["loss"].get<double>())
          << flags << " step " << i + 1;
      EXPECT_NEAR(got[i]["grad_norm"].get<double>(), want[i]["grad_norm"].get<double>(),
                  1e-5 * want[i]["grad_norm"].get<double>())
          << flags << " step " << i + 1;
    }
    expect_same_adapters(dir + "/checkpoint-10", ref + "/checkpoint-10", 1e-5, flags);
  }
}

}  // namespace

TEST(LoraParallel, FsdpHsdpEpAndSpTrainAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layouts_as_one_process("lorapar", kTrain,
                                {{2, " --dp-shard 2"},
                                 {4, " --dp-replicate 2 --dp-shard 2"},
                                 {2, " --sp 2"},
                                 {2, " --ep 2"},
                                 {4, " --dp-shard 4 --ep 2 --recompute full"}});
}

// Tensor parallelism on the tiny MoE (4 heads, 2 kv heads; attention and the experts adapted): tp 4 replicates
// each kv head over 2 ranks, so k and v use the rows of B of the rank's kv head on two ranks at once.
TEST(LoraParallel, TpTrainsAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  expect_layouts_as_one_process("loraparTp", kTrain,
                                {{2, " --tp 2"},
                                 {4, " --tp 4"},
                                 {4, " --tp 2 --dp-shard 2"},
                                 {4, " --tp 2 --sp 2"},
                                 {4, " --tp 2 --ep 2 --recompute full"}});
}

// A model with a dense layer (layer 0) whose MLP is adapted too: gate/up column-parallel in one fused GEMM,
// down_proj row-parallel, the router's adapter on each rank's own rows.
TEST(LoraParallel, TpTrainsDenseMlpAndRouterAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dense = " train --device cpu --model " + kGoldens + "/dense_layer" + kTrainArgs;
  expect_layouts_as_one_process(
      "loraparTpDense", dense + " --lora-targets attn,mlp,experts,router --out-dir ",
      {{2, " --tp 2"}, {4, " --tp 4 --recompute selective"}, {4, " --tp 2 --dp-shard 2 --recompute full"}});
  // Expert tensor parallelism with the experts unadapted: attention and the MLP as above.
  expect_layouts_as_one_process("loraparTpEtp", dense + " --lora-targets attn,mlp --out-dir ",
                                {{2, " --tp 2 --etp 2"}});
}

TEST(LoraParallel, AdaptedExpertsUnderExpertTpAreRefused) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dir = tmp_path("loraparEtp", "refused");
  const ShellRun r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + kTrain + dir + " --tp 2 --etp 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(
      r.out.find("LoRA adapters on the routed experts (attn,mlp,experts) under expert tensor parallelism (--etp 2) "
                 "are not supported; use --etp 1"),
      std::string::npos)
      << r.out;
}

TEST(LoraParallel, GrpoUnderFsdpEpTpAndSpAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string prompts = tmp_path("loraparg", "prompts.jsonl"), reward = tmp_path("loraparg", "reward.py");
  {
    std::ofstream f(prompts);
    for (int i = 0; i < 8; ++i)
      f << nlohmann::json{{"prompt_ids", {1 + i, 2 + i, 3 + i}}, {"answer", std::to_string(i % 3)}}.dump() << "\n";
    std::ofstream(reward) << "import sys, json\nfor line in sys.stdin:\n"
                             "    print(len(json.loads(line)['response']) % 2, flush=True)\n";
  }
  const std::string args = " grpo --device cpu --model " + kGoldens + "/tiny --prompts " + prompts +
                           " --reward 'program:python3 " + reward +
                           "' --max-new-tokens 4 --n 4 --prompts-per-step 2 --steps 4 --lora-rank 4 --run-dir ";
  const std::string one = tmp_path("loraparg", "one"), two = tmp_path("loraparg", "two");
  fs::remove_all(one);
  fs::remove_all(two);
  ShellRun r = sh(kMoetrainBin + args + one);
  ASSERT_EQ(r.code, 0) << r.out;
  r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + args + two + " --dp-shard 2");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_adapters(two + "/checkpoint-4", one + "/checkpoint-4", 1e-5, "grpo --dp-shard 2");
  // Expert parallelism: generation in lockstep and the update, each rank's experts' adapters its own.
  const std::string ep = tmp_path("loraparg", "ep");
  fs::remove_all(ep);
  r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + args + ep + " --ep 2");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_adapters(ep + "/checkpoint-4", one + "/checkpoint-4", 1e-5, "grpo --ep 2");
  // Tensor and sequence parallelism: generation on each rank's one-device copy, which must carry the adapters: the
  // rollouts' log-probs then differ from the trainer's as little as one process's do (the base alone: ~1e-3 by
  // step 4).
  const auto want = read_json_lines(one + "/metrics.jsonl");
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{{2, " --tp 2"}, {4, " --tp 4"}, {2, " --sp 2"}}) {
    const std::string dir = tmp_path("loraparg", "copy" + std::to_string(n) + std::to_string(flags.size()));
    fs::remove_all(dir);
    r = sh(kMoetrainBin + " launch --nproc-per-node " + std::to_string(n) + " --" + args + dir + flags);
    ASSERT_EQ(r.code, 0) << flags << "\n" << r.out;
    expect_same_adapters(dir + "/checkpoint-4", one + "/checkpoint-4", 1e-5, "grpo" + flags);
    const auto got = read_json_lines(dir + "/metrics.jsonl");
    ASSERT_EQ(got.size(), want.size()) << "grpo" << flags;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!want[i].contains("logprob_diff_mean")) continue;
      EXPECT_NEAR(got[i]["logprob_diff_mean"].get<double>(), want[i]["logprob_diff_mean"].get<double>(), 1e-5)
          << "grpo" << flags << " record " << i;
    }
  }
}
