// FSDP / HSDP / expert-parallel equivalence on the CPU through the real launcher: `moetrain grads`
// under `moetrain launch` with 2 and 4 ranks (dp_shard, dp_replicate × dp_shard, ep 2, ep 4, ep 2
// over 4 ranks) writes the same loss, logits and every gradient as one process
// (≤ 1e-6 relative, fp32), for plain, aux-loss and tied-embedding models, with and without
// recompute; a 20-step training run has the same loss curve under every layout; a non-finite
// gradient on one rank makes every rank skip the step; a killed rank stops the run with the launcher
// naming it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string& kBin = test::kMoetrainBin;
using test::kGoldens;

using test::sh;
using test::ShellRun;
std::string tmp(const std::string& name) { return test::tmp_path("fsdp", name); }

std::string make_batch(const std::string& dir) {
  return test::make_batch(dir, tmp(fs::path(dir).filename().string() + "_batch.safetensors"));
}
using test::expect_same;
using test::rel_l2;

}  // namespace

class FsdpGrads : public ::testing::TestWithParam<std::string> {};

TEST_P(FsdpGrads, EveryLayoutEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/" + GetParam();
  const std::string batch = make_batch(model);
  for (const char* rc : {"none", "full", "selective", "moe"}) {
    const std::string ref = tmp(GetParam() + "_ref_" + rc + ".safetensors");
    ShellRun r = sh(kBin + " grads --model " + model + " --batch " + batch + " --out " + ref + " --recompute " + rc);
    ASSERT_EQ(r.code, 0) << r.out;
    struct Layout {
      int nproc;
      std::string flags, name;
    };
    for (const Layout& l : {Layout{2, "--dp-shard 2", "dp_shard 2"}, Layout{4, "--dp-shard 4", "dp_shard 4"},
                            Layout{4, "--dp-replicate 2 --dp-shard 2", "dp_replicate 2 x dp_shard 2"},
                            Layout{2, "--ep 2", "ep 2"}, Layout{4, "--ep 4", "ep 4"},
                            Layout{4, "--ep 2", "ep 2 on 4 ranks (expert_dp 2)"}}) {
      const std::string out = tmp(GetParam() + "_" + std::to_string(l.nproc) + rc + ".safetensors");
      ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(l.nproc) + " -- grads --model " + model +
                 " --batch " + batch + " --out " + out + " --recompute " + rc + " " + l.flags);
      ASSERT_EQ(p.code, 0) << l.name << "\n" << p.out;
      expect_same(out, ref, GetParam() + ", " + l.name + ", recompute " + rc);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, FsdpGrads, ::testing::Values("tiny", "aux", "tied"));

namespace {
std::string train_cmd(const std::string& out_dir, int steps) {
  return " train --device cpu --model tiny --steps " + std::to_string(steps) +
         " --micro-batch-size 4 --grad-accum 2 --seq-len 32 --lr 3e-3 --warmup-steps 2 --eval-problems 0"
         " --log-every 5 --out-dir " + out_dir;
}
}  // namespace

TEST(FsdpTrain, TwentyStepCurveIsTheSameUnderEveryLayout) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string ref_dir = tmp("curve_ref");
  ShellRun r = sh(kBin + train_cmd(ref_dir, 20));
  ASSERT_EQ(r.code, 0) << r.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl");
  ASSERT_EQ(ref.size(), 20u);
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{
           {2, ""}, {4, ""}, {4, " --dp-replicate 2"}, {2, " --grad-sync last"}, {2, " --recompute full"},
           {2, " --ep 2"}, {4, " --ep 2 --recompute full"}, {2, " --reshard-after-forward 0"},
           {4, " --ep 2 --reshard-after-forward 0 --recompute full"}}) {
    const std::string dir = tmp("curve_" + std::to_string(n) + std::to_string(std::hash<std::string>{}(flags)));
    ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(n) + " --" + train_cmd(dir, 20) + flags);
    ASSERT_EQ(p.code, 0) << flags << "\n" << p.out;
    auto got = test::read_step_metrics(dir + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 20u) << flags;
    for (size_t i = 0; i < 20; ++i) {
      const double a = got[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
      EXPECT_NEAR(a, b, 1e-6 * std::abs(b)) << n << " ranks" << flags << ", step " << i + 1;
      const double ga = got[i]["grad_norm"].get<double>(), gb = ref[i]["grad_norm"].get<double>();
      EXPECT_NEAR(ga, gb, 1e-5 * std::abs(gb)) << n << " ranks" << flags << ", step " << i + 1;
    }
    EXPECT_EQ(got[0]["world_size"].get<int>(), n);
    // The checkpoint rank 0 streamed from the shards holds the same parameters as the one-process
    // run's (after 20 AdamW steps: all together within 1e-6, each tensor within 1e-5).
    test::expect_same_checkpoint(dir + "/checkpoint-20", ref_dir + "/checkpoint-20", flags);
  }
}

// bf16 on the wire: the gradients are rounded to bf16 before they travel, so the curve follows the
// fp32 one within bf16 tolerance (DESIGN: 1e-2), not exactly.
TEST(FsdpTrain, Bf16GradientReductionFollowsTheCurve) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string ref_dir = tmp("bf16_ref"), dir = tmp("bf16");
  ShellRun r = sh(kBin + train_cmd(ref_dir, 10));
  ASSERT_EQ(r.code, 0) << r.out;
  ShellRun p = sh(kBin + " launch --nproc-per-node 2 --" + train_cmd(dir, 10) + " --grad-reduce-dtype bf16");
  ASSERT_EQ(p.code, 0) << p.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl"), got = test::read_step_metrics(dir + "/metrics.jsonl");
  ASSERT_EQ(got.size(), 10u);
  double worst = 0;
  for (size_t i = 0; i < 10; ++i) {
    const double a = got[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
    worst = std::max(worst, std::abs(a - b) / std::abs(b));
  }
  EXPECT_LE(worst, 1e-2);
  EXPECT_GT(worst, 0.0) << "bf16 transport should not be bit-identical to fp32";
}

// Loading from a checkpoint: every rank mapping its own slices and rank 0 broadcasting buckets (4 KiB
// here, so that buckets straddle shards and parameters) give exactly the same weights, hence the
// same losses; both equal one process.
TEST(FsdpTrain, BroadcastLoadingEqualsMappedLoading) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/tiny";
  auto cmd = [&](const std::string& dir) {
    return " train --device cpu --model " + model + " --init-from " + model +
           " --steps 3 --warmup-steps 1 --micro-batch-size 4 --seq-len 32 --eval-problems 0 --out-dir " + dir;
  };
  const std::string ref = tmp("load_ref"), mm = tmp("load_mmap"), bc = tmp("load_bcast");
  ShellRun r = sh(kBin + cmd(ref));
  ASSERT_EQ(r.code, 0) << r.out;
  ShellRun a = sh(kBin + " launch --nproc-per-node 2 --" + cmd(mm) + " --load-mode mmap");
  ASSERT_EQ(a.code, 0) << a.out;
  ShellRun b = sh("MOETRAIN_BROADCAST_BUCKET_BYTES=4096 " + kBin + " launch --nproc-per-node 2 --" + cmd(bc) +
                  " --load-mode broadcast");
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("buckets"), std::string::npos) << b.out;
  auto m0 = test::read_step_metrics(ref + "/metrics.jsonl"), m1 = test::read_step_metrics(mm + "/metrics.jsonl"),
       m2 = test::read_step_metrics(bc + "/metrics.jsonl");
  ASSERT_EQ(m1.size(), 3u);
  ASSERT_EQ(m2.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(m1[i]["loss"].get<double>(), m2[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_NEAR(m1[i]["loss"].get<double>(), m0[i]["loss"].get<double>(), 1e-6 * m0[i]["loss"].get<double>());
  }
}

// Greedy evaluation runs forwards (with their gathers) until every sequence ends: the ranks agree on
// when to stop, and the exact-match result is the one-process result.
TEST(FsdpTrain, EvaluationUnderLaunchEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  auto cmd = [&](const std::string& dir) {
    return " train --device cpu --model tiny --steps 4 --warmup-steps 1 --micro-batch-size 4 --seq-len 32"
           " --eval-problems 12 --out-dir " + dir;
  };
  ShellRun one = sh(kBin + cmd(tmp("eval1")));
  ASSERT_EQ(one.code, 0) << one.out;
  ShellRun two = sh(kBin + " launch --nproc-per-node 2 --" + cmd(tmp("eval2")));
  ASSERT_EQ(two.code, 0) << two.out;
  // Gathers kept from a forward for its backward must not outlive the step: evaluation after the
  // optimizer sees the new weights.
  ShellRun kept = sh(kBin + " launch --nproc-per-node 2 --" + cmd(tmp("eval3")) + " --reshard-after-forward 0");
  ASSERT_EQ(kept.code, 0) << kept.out;
  ASSERT_FALSE(test::eval_summary(one.out).empty()) << one.out;
  EXPECT_EQ(test::eval_summary(two.out), test::eval_summary(one.out)) << two.out;
  EXPECT_EQ(test::eval_summary(kept.out), test::eval_summary(one.out)) << kept.out;
}

// The capacity factor: a capacity no expert reaches changes nothing (bit-identical losses, nothing
// dropped); a tight one drops assignments (counted) and still trains, in one process and under ep 2.
TEST(MoeCapacity, LargeCapacityIsDroplessTightCapacityDrops) {
  MT_SKIP_WITHOUT_GLOO();
  auto cmd = [&](const std::string& dir) {
    return " train --device cpu --model tiny --steps 3 --warmup-steps 1 --micro-batch-size 4 --seq-len 32"
           " --eval-problems 0 --out-dir " + dir;
  };
  const std::string a = tmp("cap_none"), b = tmp("cap_large"), c = tmp("cap_tight"), d = tmp("cap_ep"),
                    bs = tmp("cap_large_selective"), bf = tmp("cap_large_full"), bm = tmp("cap_large_moe");
  // A capacity in one process goes through the dispatcher with ep = 1, whose combined rows alias the
  // expert outputs: under every recompute policy the losses stay those of the plain path (moe re-runs
  // the local dispatch and combine there, as its exchanged rows are not kept).
  for (auto [dir, extra] :
       std::vector<std::pair<std::string, std::string>>{{a, ""},
                                                        {b, " --moe-capacity-factor 1000"},
                                                        {bs, " --moe-capacity-factor 1000 --recompute selective"},
                                                        {bf, " --moe-capacity-factor 1000 --recompute full"},
                                                        {bm, " --moe-capacity-factor 1000 --recompute moe"},
                                                        {c, " --moe-capacity-factor 0.5"}}) {
    ShellRun r = sh(kBin + cmd(dir) + extra);
    ASSERT_EQ(r.code, 0) << r.out;
  }
  ShellRun e = sh(kBin + " launch --nproc-per-node 2 --" + cmd(d) + " --ep 2 --moe-capacity-factor 0.5");
  ASSERT_EQ(e.code, 0) << e.out;
  auto ma = test::read_step_metrics(a + "/metrics.jsonl"), mb = test::read_step_metrics(b + "/metrics.jsonl"),
       mc = test::read_step_metrics(c + "/metrics.jsonl"), md = test::read_step_metrics(d + "/metrics.jsonl");
  ASSERT_EQ(mb.size(), 3u);
  ASSERT_EQ(mc.size(), 3u);
  ASSERT_EQ(md.size(), 3u);
  auto ms = test::read_step_metrics(bs + "/metrics.jsonl"), mf = test::read_step_metrics(bf + "/metrics.jsonl"),
       mm = test::read_step_metrics(bm + "/metrics.jsonl");
  ASSERT_EQ(ms.size(), 3u);
  ASSERT_EQ(mf.size(), 3u);
  ASSERT_EQ(mm.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(ma[i]["loss"].get<double>(), ms[i]["loss"].get<double>()) << "selective, step " << i + 1;
    EXPECT_EQ(ma[i]["loss"].get<double>(), mf[i]["loss"].get<double>()) << "full, step " << i + 1;
    EXPECT_EQ(ma[i]["loss"].get<double>(), mm[i]["loss"].get<double>()) << "moe, step " << i + 1;
    EXPECT_EQ(mb[i]["moe_dropped_rank0"].get<int64_t>(), 0);
    EXPECT_GT(mc[i]["moe_dropped_rank0"].get<int64_t>(), 0) << "step " << i + 1;
    EXPECT_GT(md[i]["moe_dropped_rank0"].get<int64_t>(), 0) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(mc[i]["loss"].get<double>()));
  }
  EXPECT_NE(ma[0]["loss"].get<double>(), mc[0]["loss"].get<double>());
}

TEST(FsdpTrain, InfOnOneRankMakesEveryRankSkip) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dir = tmp("inf");
  ShellRun p = sh("MOETRAIN_DEBUG_INF_GRAD=1:3 " + kBin + " launch --nproc-per-node 2 --" + train_cmd(dir, 5));
  ASSERT_EQ(p.code, 0) << p.out;
  auto m = test::read_step_metrics(dir + "/metrics.jsonl");
  ASSERT_EQ(m.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(m[i]["skipped"].get<bool>(), i == 2) << "step " << i + 1;
  EXPECT_EQ(m[4]["skipped_total"].get<int>(), 1);
}

TEST(FsdpTrain, KilledRankStopsTheRunAndIsNamed) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string dir = tmp("kill");
  auto t0 = std::chrono::steady_clock::now();
  ShellRun p = sh("MOETRAIN_DEBUG_KILL=1:2 " + kBin + " launch --nproc-per-node 3 --" + train_cmd(dir, 50) +
             " --micro-batch-size 6 --comm-timeout-s 20");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(p.code, 0) << p.out;
  EXPECT_NE(p.out.find("rank 1"), std::string::npos) << p.out;
  EXPECT_NE(p.out.find("signal 9"), std::string::npos) << p.out;
  EXPECT_LT(s, 60) << p.out;
}
