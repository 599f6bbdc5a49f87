// Ulysses sequence parallelism on the CPU through the real launcher: `moetrain grads --sp N` under
// `moetrain launch` writes the same loss, logits and every gradient as one process (≤ 1e-6
// relative, fp32) for sp 2, sp 2 × dp_shard 2, sp 4 (the models have 2 kv heads: replicated over
// the 4 ranks) and ep 2 × sp 2 on 4 ranks, with recompute none, full and selective, on the plain,
// aux-loss and tied models, with a sequence length divisible by sp and one that is not (padded
// internally); a 20-step training run (z-loss and aux-loss-free bias on) has the same loss curve,
// z-loss, expert load and final weights as one process; an sp that does not divide the heads is an
// error naming both numbers; greedy evaluation under sp equals one process. The sequence planning
// (plan_micro_batch) is checked on its own.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "comm/communicator.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/micro_batch.h"
#include "moe/ulysses.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string& kBin = test::kMoetrainBin;
using test::kGoldens;

using test::sh;
using test::ShellRun;
std::string tmp(const std::string& name) {
  return test::tmp_path("sp", name);
}

}  // namespace

// Chunks of [B 2, S 5] over sp 2 (S' 6, C 3) and sp 4 (S' 8, C 2): positions are global, labels
// are shifted over the whole sequence (a chunk's last target comes from the next chunk), padding
// has id 0 and label -100, and `valid` counts the real tokens at the start of each chunk.
TEST(SpShard, PositionsLabelsAndPaddingComeFromTheWholeSequence) {
  Tensor ids = Tensor::empty({2, 5}, DType::I64), labels = Tensor::empty({2, 5}, DType::I64);
  for (int64_t i = 0; i < 10; ++i) {
    ids.data<int64_t>()[i] = 10 + i;
    labels.data<int64_t>()[i] = i == 2 ? -100 : 100 + i;
  }
  // sp 1 plans the whole sequences: the ids themselves (no copy), positions 0..S-1, labels shifted.
  MicroBatch whole = plan_micro_batch(MicroBatch{ids, labels});
  ASSERT_NE(whole.plan, nullptr);
  EXPECT_EQ(whole.input_ids.raw(), ids.raw());
  EXPECT_EQ(whole.plan->chunk, 5);
  EXPECT_EQ(whole.plan->valid, 5);
  for (int64_t t = 0; t < 10; ++t) {
    EXPECT_EQ(whole.plan->positions.data<int32_t>()[t], int32_t(t % 5));
    EXPECT_EQ(whole.plan->shifted_labels.data<int64_t>()[t], t % 5 == 4 ? -100 : labels.data<int64_t>()[t + 1]);
  }

  struct Want {
    int sp, rank;
    int64_t valid;
    std::vector<int64_t> ids, lab;
  };
  for (const Want& w : std::vector<Want>{{2, 0, 3, {10, 11, 12, 15, 16, 17}, {101, -100, 103, 106, 107, 108}},
                                         {2, 1, 2, {13, 14, 0, 18, 19, 0}, {104, -100, -100, 109, -100, -100}},
                                         {4, 1, 2, {12, 13, 17, 18}, {103, 104, 108, 109}},
                                         {4, 2, 1, {14, 0, 19, 0}, {-100, -100, -100, -100}},
                                         {4, 3, 0, {0, 0, 0, 0}, {-100, -100, -100, -100}}}) {
    SCOPED_TRACE("sp " + std::to_string(w.sp) + " rank " + std::to_string(w.rank));
    MicroBatch mb = plan_micro_batch(MicroBatch{ids, labels}, w.sp, w.rank);
    ASSERT_NE(mb.plan, nullptr);
    const BatchPlan& s = *mb.plan;
    const int64_t C = int64_t(w.ids.size()) / 2;
    EXPECT_EQ(s.seq_len, 5);
    EXPECT_EQ(s.padded_len, C * w.sp);
    EXPECT_EQ(s.chunk, C);
    EXPECT_EQ(s.valid, w.valid);
    ASSERT_EQ(mb.input_ids.shape(), Shape({2, C}));
    EXPECT_FALSE(mb.labels.defined());
    for (size_t t = 0; t < w.ids.size(); ++t) {
      EXPECT_EQ(mb.input_ids.data<int64_t>()[t], w.ids[t]) << "token " << t;
      // Positions count within each sequence: every row starts at rank × C.
      EXPECT_EQ(s.positions.data<int32_t>()[t], int32_t(w.rank * C + int64_t(t) % C)) << "token " << t;
      EXPECT_EQ(s.shifted_labels.data<int64_t>()[t], w.lab[t]) << "token " << t;
    }
  }
}

class SpGrads : public ::testing::TestWithParam<std::string> {};

TEST_P(SpGrads, EveryLayoutEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/" + GetParam();
  double worst = 0, worst_all = 0;
  for (int64_t S : {12, 13}) {  // 13: padded to 14 under sp 2 and to 16 under sp 4
    const std::string batch = tmp(GetParam() + "_batch" + std::to_string(S) + ".safetensors");
    test::make_batch(model, batch, 4, S);
    for (const char* rc : {"none", "full", "selective"}) {
      const std::string ref = tmp(GetParam() + "_ref.safetensors");
      ShellRun r = sh(kBin + " grads --model " + model + " --batch " + batch + " --out " + ref + " --recompute " + rc);
      ASSERT_EQ(r.code, 0) << r.out;
      struct Layout {
        int nproc;
        std::string flags, name;
      };
      for (const Layout& l :
           {Layout{2, "--sp 2", "sp 2"}, Layout{4, "--sp 2", "dp_shard 2 x sp 2"},
            Layout{4, "--sp 4", "sp 4 (kv heads replicated)"}, Layout{4, "--ep 2 --sp 2", "ep 2 x sp 2 on 4 ranks"},
            Layout{4, "--tp 2 --sp 2", "tp 2 x sp 2 (kv heads replicated over sp)"},
            Layout{8, "--tp 2 --etp 2 --sp 2 --ep 2", "tp 2 etp 2 x sp 2 x ep 2 on 8 ranks"}}) {
        const std::string what = GetParam() + ", S " + std::to_string(S) + ", " + l.name + ", recompute " + rc;
        const std::string out = tmp(GetParam() + "_got.safetensors");
        ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(l.nproc) + " -- grads --model " + model +
                        " --batch " + batch + " --out " + out + " --recompute " + rc + " " + l.flags);
        ASSERT_EQ(p.code, 0) << what << "\n" << p.out;
        double w = 0, a = 0;
        test::expect_same(out, ref, what, &w, &a);
        worst = std::max(worst, w);
        worst_all = std::max(worst_all, a);
      }
    }
  }
  std::printf("[ measured ] %s: worst single tensor %.3g, worst all-gradients %.3g\n", GetParam().c_str(), worst,
              worst_all);
}

INSTANTIATE_TEST_SUITE_P(Models, SpGrads, ::testing::Values("tiny", "aux", "tied"));

namespace {
// `moetrain grads` on the tiny model over nproc ranks with `flags` fails and says `message`.
void expect_grads_error(int nproc, int64_t B, int64_t S, const std::string& flags, const std::string& message) {
  const std::string model = kGoldens + "/tiny", tag = std::to_string(nproc);
  const std::string batch = tmp("err_batch" + tag + ".safetensors");
  test::make_batch(model, batch, B, S);
  ShellRun p = sh(kBin + " launch --nproc-per-node " + tag + " -- grads --model " + model + " --batch " + batch +
                  " --out " + tmp("err" + tag + ".safetensors") + " " + flags);
  EXPECT_NE(p.code, 0) << p.out;
  EXPECT_NE(p.out.find(message), std::string::npos) << p.out;
}
}  // namespace

TEST(SpGradsErrors, SpMustDivideTheHeads) {
  MT_SKIP_WITHOUT_GLOO();
  expect_grads_error(3, 3, 12, "--sp 3", "num_attention_heads (4) must be divisible by sp (3)");
}

// Under tp the sp ranks split each tp rank's heads: tiny's 4 heads over tp 2 leave 2, which sp 4 cannot split.
TEST(SpGradsErrors, TpTimesSpMustDivideTheHeads) {
  MT_SKIP_WITHOUT_GLOO();
  expect_grads_error(8, 1, 16, "--tp 2 --sp 4", "num_attention_heads (4) must be divisible by tp × sp (2 × 4)");
}

namespace {
// seq-len 30: divisible by sp 2, padded to 32 under sp 4. z-loss and the balancing bias are on, so
// the router statistics (expert load, z) must also equal one process's.
std::string train_cmd(const std::string& out_dir) {
  return " train --device cpu --model tiny --steps 20 --micro-batch-size 4 --grad-accum 2 --seq-len 30 --lr 3e-3"
         " --warmup-steps 2 --eval-problems 0 --log-every 5 --router-z-loss-coef 1e-3"
         " --router-bias-update-rate 1e-3 --out-dir " +
         out_dir;
}
}  // namespace

TEST(SpTrain, TwentyStepCurveIsTheSameAsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string ref_dir = tmp("curve_ref");
  ShellRun r = sh(kBin + train_cmd(ref_dir));
  ASSERT_EQ(r.code, 0) << r.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl");
  ASSERT_EQ(ref.size(), 20u);
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --sp 2"}, {4, " --sp 4"}, {4, " --sp 2 --ep 2 --recompute full"}, {4, " --tp 2 --sp 2"}}) {
    const std::string dir = tmp("curve_" + std::to_string(n) + std::to_string(std::hash<std::string>{}(flags)));
    ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(n) + " --" + train_cmd(dir) + flags);
    ASSERT_EQ(p.code, 0) << flags << "\n" << p.out;
    auto got = test::read_step_metrics(dir + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 20u) << flags;
    double worst = 0;
    for (size_t i = 0; i < 20; ++i) {
      SCOPED_TRACE(flags + ", step " + std::to_string(i + 1));
      const double a = got[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
      EXPECT_NEAR(a, b, 1e-6 * std::abs(b));
      worst = std::max(worst, std::abs(a - b) / std::abs(b));
      const double za = got[i]["z_loss"].get<double>(), zb = ref[i]["z_loss"].get<double>();
      EXPECT_NEAR(za, zb, 1e-6 * zb);
      const double ga = got[i]["grad_norm"].get<double>(), gb = ref[i]["grad_norm"].get<double>();
      EXPECT_NEAR(ga, gb, 1e-5 * std::abs(gb));
      EXPECT_EQ(got[i]["experts"]["max"], ref[i]["experts"]["max"]);
      EXPECT_EQ(got[i]["experts"]["min"], ref[i]["experts"]["min"]);
    }
    std::printf("[ measured ] curve%s: worst step loss relative difference %.3g\n", flags.c_str(), worst);
    test::expect_same_checkpoint(dir + "/checkpoint-20", ref_dir + "/checkpoint-20", flags);
  }
}

// Greedy evaluation under sp runs whole sequences on every rank (no shard, no all-to-all) and must
// agree with one process; the ranks agree on when to stop.
TEST(SpTrain, EvaluationUnderSpEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  auto cmd = [&](const std::string& dir) {
    return " train --device cpu --model tiny --steps 4 --warmup-steps 1 --micro-batch-size 4 --seq-len 31"
           " --eval-problems 12 --out-dir " +
           dir;
  };
  ShellRun one = sh(kBin + cmd(tmp("eval1")));
  ASSERT_EQ(one.code, 0) << one.out;
  ShellRun two = sh(kBin + " launch --nproc-per-node 2 --" + cmd(tmp("eval2")) + " --sp 2");
  ASSERT_EQ(two.code, 0) << two.out;
  ASSERT_FALSE(test::eval_summary(one.out).empty()) << one.out;
  EXPECT_EQ(test::eval_summary(two.out), test::eval_summary(one.out)) << two.out;
}
