// LoRA under the layouts it runs in: FSDP, HSDP, expert and sequence parallelism (the base sharded or split,
// the adapters whole on every rank with their gradients summed over the ranks) give one process's curve and
// adapters; grpo under FSDP and EP likewise; tensor parallelism is refused by name. (CPU, Gloo, `moetrain launch`.)
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

const std::string kTrain =
    " train --device cpu --model tiny --steps 10 --lora-rank 4 --lr 3e-3 --warmup-steps 2 --eval-every 0 "
    "--eval-problems 0 --micro-batch-size 4 --out-dir ";

}  // namespace

TEST(LoraParallel, FsdpHsdpEpAndSpTrainAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string ref = tmp_path("lorapar", "ref");
  fs::remove_all(ref);
  ShellRun r = sh(kMoetrainBin + kTrain + ref);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto want = steps_of(ref);
  ASSERT_EQ(want.size(), 10u);
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --dp-shard 2"}, {4, " --dp-replicate 2 --dp-shard 2"}, {2, " --sp 2"}, {2, " --ep 2"},
           {4, " --dp-shard 4 --ep 2 --recompute full"}}) {
    const std::string dir = tmp_path("lorapar", "n" + std::to_string(n) + std::to_string(flags.size()));
    fs::remove_all(dir);
    r = sh(kMoetrainBin + " launch --nproc-per-node " + std::to_string(n) + " --" + kTrain + dir + flags);
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
  const std::string tp = tmp_path("lorapar", "tp");
  r = sh(kMoetrainBin + " launch --nproc-per-node 2 --" + kTrain + tp + " --tp 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("LoRA adapters under tensor parallelism are not supported yet"), std::string::npos) << r.out;
}

TEST(LoraParallel, GrpoUnderFsdpAndEpAsOneProcess) {
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
}
