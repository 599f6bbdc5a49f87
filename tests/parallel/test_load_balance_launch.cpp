// Load balancing under data parallelism, on the CPU through the real launcher: with the router
// z-loss and the aux-loss-free bias on, `moetrain train` under `moetrain launch` with 2 ranks reports
// the same per-step loss, z-loss and per-expert load (min / max / mean / imbalance / unused, counted
// over the global batch) as one process on the same global batch, and its balancing bias after 5
// steps (router_bias.safetensors beside the checkpoint) equals the one-process bias exactly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "io/safetensors.h"
#include "parallel/launch_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string& kBin = test::kMoetrainBin;
using test::sh;
using test::ShellRun;

std::string tmp(const std::string& name) { return test::tmp_path("lb", name); }

std::string train_cmd(const std::string& out_dir) {
  return " train --device cpu --model tiny --steps 5 --micro-batch-size 4 --grad-accum 2 --seq-len 32 --lr 3e-3"
         " --warmup-steps 1 --eval-problems 0 --log-every 1 --router-z-loss-coef 1e-3"
         " --router-bias-update-rate 1e-2 --out-dir " +
         out_dir;
}

}  // namespace

TEST(LoadBalanceLaunch, TwoRanksEqualOneProcess) {
  // CPU ranks talk through Gloo; builds without it (the GPU machines) cannot run this test.
  MT_SKIP_WITHOUT_GLOO();
  const std::string ref_dir = tmp("one"), dir = tmp("two");
  ShellRun r = sh(kBin + train_cmd(ref_dir));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("experts max/mean"), std::string::npos) << r.out;
  ShellRun p = sh(kBin + " launch --nproc-per-node 2 --" + train_cmd(dir));
  ASSERT_EQ(p.code, 0) << p.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl"), got = test::read_step_metrics(dir + "/metrics.jsonl");
  ASSERT_EQ(ref.size(), 5u);
  ASSERT_EQ(got.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(got[i]["dp_size"].get<int>(), 2);
    const double la = got[i]["loss"].get<double>(), lb = ref[i]["loss"].get<double>();
    EXPECT_NEAR(la, lb, 1e-6 * std::abs(lb));
    const double za = got[i]["z_loss"].get<double>(), zb = ref[i]["z_loss"].get<double>();
    EXPECT_GT(zb, 0.0);
    EXPECT_NEAR(za, zb, 1e-6 * zb);
    // The global batch: 2 micro-batches x 4 x 32 tokens, top-2 over 8 experts = 64 per expert.
    EXPECT_EQ(ref[i]["experts"]["mean"].get<double>(), 64.0);
    for (const char* k : {"min", "max", "mean", "imbalance", "unused", "imbalance_per_layer"})
      EXPECT_EQ(got[i]["experts"][k], ref[i]["experts"][k]) << k;
    EXPECT_EQ(got[i]["router_bias"], ref[i]["router_bias"]);
  }
  SafetensorsFile a(dir + "/checkpoint-5/router_bias.safetensors"),
      b(ref_dir + "/checkpoint-5/router_bias.safetensors");
  ASSERT_EQ(a.names(), b.names());
  ASSERT_EQ(b.names().size(), 2u);  // tiny: 2 sparse layers
  double range = 0;
  for (const std::string& n : b.names()) {
    Tensor x = a.read_f32(n), y = b.read_f32(n);
    ASSERT_EQ(x.shape(), y.shape()) << n;
    for (int64_t e = 0; e < y.numel(); ++e) {
      EXPECT_EQ(x.data<float>()[e], y.data<float>()[e]) << n << " expert " << e;
      range = std::max(range, double(std::abs(y.data<float>()[e])));
    }
  }
  EXPECT_GT(range, 0.0) << "the bias should have moved in 5 steps";
  EXPECT_LE(range, 5 * 1e-2 + 1e-6) << "each step moves a bias by at most the rate";
  // The HF checkpoint itself does not carry the bias (transformers reads model*.safetensors only).
  CheckpointReader ck(ref_dir + "/checkpoint-5");
  for (const std::string& n : ck.names()) EXPECT_EQ(n.find("e_score_correction_bias"), std::string::npos) << n;
}
