// Tensor parallelism (and expert tensor parallelism) equivalence on the CPU: `moetrain grads` under
// `moetrain launch` with tp 2, tp 2 + etp 2, dp_shard 2 × tp 2, dp_replicate 2 × tp 2, tp 4 (kv heads
// replicated over 2 ranks) and ep 2 × tp 2 on 8 ranks writes the same loss, logits and every gathered gradient as one
// process (≤ 1e-6 relative, fp32), with recompute none and full, on the plain, aux-loss and
// dense-layer models; a 20-step training curve under tp 2 equals one process; sizes that do not
// divide are errors naming both numbers (a token count that does not divide by tp is padded:
// test_layouts.cpp); the tp-local layout maps onto the global tensors exactly.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "comm/communicator.h"
#include "model/params.h"
#include "parallel/equivalence_util.h"
#include "parallel/launch_test_util.h"
#include "parallel/tensor_parallel.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

const std::string& kBin = test::kMoetrainBin;
using test::kGoldens;

using test::sh;
using test::ShellRun;
std::string tmp(const std::string& name) {
  return test::tmp_path("tp", name);
}

struct Layout {
  int nproc;
  std::string flags, name;
};

// Runs the one-process reference and each layout for a model, both recompute modes.
void check_layouts(const std::string& model_name, const std::vector<Layout>& layouts,
                   const std::vector<std::string>& recomputes) {
  const std::string model = kGoldens + "/" + model_name;
  const std::string batch = test::make_batch(model, tmp(model_name + "_batch.safetensors"));
  for (const std::string& rc : recomputes) {
    const std::string ref = tmp(model_name + "_ref_" + rc + ".safetensors");
    ShellRun r = sh(kBin + " grads --model " + model + " --batch " + batch + " --out " + ref + " --recompute " + rc);
    ASSERT_EQ(r.code, 0) << r.out;
    for (const Layout& l : layouts) {
      const std::string out = tmp(model_name + "_" + std::to_string(l.nproc) + "_" +
                                  std::to_string(std::hash<std::string>{}(l.flags)) + rc + ".safetensors");
      ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(l.nproc) + " -- grads --model " + model +
                      " --batch " + batch + " --out " + out + " --recompute " + rc + " " + l.flags);
      ASSERT_EQ(p.code, 0) << l.name << "\n" << p.out;
      double worst = 0, all = 0;
      const std::string what = model_name + ", " + l.name + ", recompute " + rc;
      test::expect_same(out, ref, what, &worst, &all);
      std::printf("[ measured ] %s: worst tensor %.3g, all gradients %.3g (relative)\n", what.c_str(), worst, all);
    }
  }
}

}  // namespace

class TpGrads : public ::testing::TestWithParam<std::string> {};

TEST_P(TpGrads, EveryLayoutEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  check_layouts(GetParam(),
                {Layout{2, "--tp 2", "tp 2"}, Layout{2, "--tp 2 --etp 2", "tp 2 etp 2"},
                 Layout{4, "--dp-shard 2 --tp 2", "dp_shard 2 x tp 2"},
                 Layout{4, "--dp-replicate 2 --tp 2 --etp 2", "dp_replicate 2 x tp 2 etp 2"},
                 Layout{4, "--tp 4 --etp 4", "tp 4 etp 4 (kv heads replicated over 2 ranks)"}},
                {"none", "full"});
}

// The models: plain MoE, aux loss (3 layers, its own vocab), tied embeddings, and one with dense MLP
// layers (mlp_only_layers), so the dense column/row-parallel path runs.
INSTANTIATE_TEST_SUITE_P(Models, TpGrads, ::testing::Values("tiny", "aux", "tied", "dense_layer"));

// Selective recompute keeps attention and rebuilds the rest, re-issuing the tp collectives.
TEST(TpGradsSelective, SelectiveRecomputeEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  check_layouts("dense_layer", {Layout{2, "--tp 2 --etp 2", "tp 2 etp 2"}}, {"selective"});
}

// Recompute moe keeps the gathered FFN inputs (etp 2, and the dense MLP under tp) and rebuilds only
// the FFN's hidden activations.
TEST(TpGradsMoe, MoeRecomputeEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  check_layouts("dense_layer", {Layout{2, "--tp 2 --etp 2", "tp 2 etp 2"}, Layout{2, "--tp 2", "tp 2 etp 1"}}, {"moe"});
}

// Expert parallelism beside tensor parallelism on 8 ranks (dp_shard 4 × tp 2; experts in 2 groups):
// etp 1 (the tp ranks are expert-data-parallel / ep ranks) and etp 2 (experts F-sliced over tp).
TEST(TpGrads8, ExpertParallelTimesTensorParallel) {
  MT_SKIP_WITHOUT_GLOO();
  check_layouts("tiny",
                {Layout{8, "--ep 2 --tp 2", "ep 2 x tp 2 (etp 1) on 8 ranks"},
                 Layout{8, "--ep 2 --tp 2 --etp 2", "ep 2 x tp 2 x etp 2 on 8 ranks"}},
                {"none", "full"});
}

TEST(TpErrors, IndivisibleSizesAreNamed) {
  ModelConfig c = preset_model_config("tiny");  // 4 q heads, 2 kv heads, moe_intermediate 32
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { tp_local_config(c, 3, 1); }).find("num_attention_heads (4) must be divisible by tp (3)"),
            std::string::npos);
  ModelConfig g = c;
  g.num_attention_heads = 12;
  g.num_key_value_heads = 3;
  EXPECT_NE(message([&] { tp_local_config(g, 4, 1); }).find("num_key_value_heads (3) and tp (4)"), std::string::npos);
  ModelConfig f = c;
  f.moe_intermediate_size = 30;
  EXPECT_NE(message([&] { tp_local_config(f, 4, 4); }).find("moe_intermediate_size (30) must be divisible by etp (4)"),
            std::string::npos);
  EXPECT_EQ(message([&] { tp_local_config(f, 4, 1); }), "no error");  // etp 1: the experts stay whole
  ModelConfig d = c;
  d.mlp_only_layers = {0};
  d.intermediate_size = 6;
  EXPECT_NE(message([&] { tp_local_config(d, 4, 1); }).find("intermediate_size (6) must be divisible by tp (4)"),
            std::string::npos);
  EXPECT_NE(message([&] { tp_local_config(c, 2, 3); }).find("etp 3 must be 1 or equal to tp 2"), std::string::npos);
}

// Every tp rank's local parameters, mapped through to_global, are exactly the global init's values at
// those positions, and together the tp ranks cover every global element (kv heads replicated when
// G < tp are covered tp / G times).
TEST(TpLayout, LocalSlicesCoverTheGlobalTensors) {
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {1};
  c.intermediate_size = 48;
  for (auto [tp, etp] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}, {4, 4}}) {
    TpLayout lay(c, tp, etp);
    const ParamTable& gt = lay.global_table();
    Tensor global = Tensor::empty({gt.total()});
    init_weights(c, gt, global, 7);
    std::vector<int> hits(size_t(gt.total()), 0);
    for (int r = 0; r < tp; ++r) {
      const ParamTable& lt = lay.local_table();
      const std::vector<FlatRange> g = lay.to_global(r, {{0, lt.total(), 0}});
      Tensor local = Tensor::zeros({lt.total()});
      init_weights_ranges(c, gt, g, local, 7);
      int64_t covered = 0;
      for (const FlatRange& fr : g) {
        covered += fr.end - fr.begin;
        for (int64_t i = fr.begin; i < fr.end; ++i) {
          ++hits[size_t(i)];
          ASSERT_EQ(local.data<float>()[fr.dst_offset + (i - fr.begin)], global.data<float>()[i]) << "tp " << tp;
        }
      }
      EXPECT_EQ(covered, lt.total()) << "tp " << tp << " rank " << r;
    }
    const int kv_copies = int(std::max<int64_t>(1, tp / c.num_key_value_heads));
    for (const ParamEntry& e : gt.entries()) {
      const bool split = lay.local_table().at(e.name).shape != e.shape;
      const bool kv = e.name.ends_with("k_proj.weight") || e.name.ends_with("v_proj.weight");
      const int want = !split ? tp : kv ? kv_copies : 1;
      for (int64_t i = e.offset; i < e.offset + e.numel; ++i)
        ASSERT_EQ(hits[size_t(i)], want) << e.name << " tp " << tp << " etp " << etp;
    }
  }
}

// Training under tp: the 20-step loss curve and grad norms of one process, and the checkpoint rank 0
// streamed from the tp slices holds the same parameters (reassembled into the global tensors).
TEST(TpTrain, TwentyStepCurveEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  auto cmd = [](const std::string& dir) {
    return " train --device cpu --model tiny --steps 20 --micro-batch-size 4 --grad-accum 2 --seq-len 32 --lr 3e-3"
           " --warmup-steps 2 --eval-problems 0 --log-every 5 --out-dir " +
           dir;
  };
  const std::string ref_dir = tmp("curve_ref");
  ShellRun r = sh(kBin + cmd(ref_dir));
  ASSERT_EQ(r.code, 0) << r.out;
  auto ref = test::read_step_metrics(ref_dir + "/metrics.jsonl");
  ASSERT_EQ(ref.size(), 20u);
  for (auto [n, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --tp 2"}, {2, " --tp 2 --etp 2 --recompute full"}, {4, " --tp 2 --ep 2"},
           {4, " --tp 2 --sp 2 --reshard-after-forward 0 --recompute full"}}) {
    const std::string dir = tmp("curve_" + std::to_string(n) + std::to_string(std::hash<std::string>{}(flags)));
    ShellRun p = sh(kBin + " launch --nproc-per-node " + std::to_string(n) + " --" + cmd(dir) + flags);
    ASSERT_EQ(p.code, 0) << flags << "\n" << p.out;
    auto got = test::read_step_metrics(dir + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 20u) << flags;
    double worst = 0;
    for (size_t i = 0; i < 20; ++i) {
      const double a = got[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
      worst = std::max(worst, std::abs(a - b) / std::abs(b));
      EXPECT_NEAR(a, b, 1e-6 * std::abs(b)) << flags << ", step " << i + 1;
      const double ga = got[i]["grad_norm"].get<double>(), gb = ref[i]["grad_norm"].get<double>();
      EXPECT_NEAR(ga, gb, 1e-5 * std::abs(gb)) << flags << ", step " << i + 1;
    }
    std::printf("[ measured ] 20-step curve%s: max relative loss difference %.3g\n", flags.c_str(), worst);
    test::expect_same_checkpoint(dir + "/checkpoint-20", ref_dir + "/checkpoint-20", flags);
  }
}

// Loading a checkpoint under tp reads each rank's slices (strided o/down columns, gate/up row pairs)
// from the files, or keeps them from rank 0's broadcast buckets: the first steps' losses equal one
// process loading the same files.
TEST(TpTrain, LoadingSlicesEqualsOneProcess) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string model = kGoldens + "/dense_layer";
  auto cmd = [&](const std::string& dir) {
    return " train --device cpu --model " + model + " --init-from " + model +
           " --steps 3 --warmup-steps 1 --micro-batch-size 4 --seq-len 32 --eval-problems 0 --out-dir " + dir;
  };
  const std::string ref = tmp("load_ref"), got = tmp("load_tp");
  ShellRun r = sh(kBin + cmd(ref));
  ASSERT_EQ(r.code, 0) << r.out;
  auto m0 = test::read_step_metrics(ref + "/metrics.jsonl");
  for (const char* mode : {"mmap", "broadcast"}) {
    ShellRun p = sh(kBin + " launch --nproc-per-node 2 --" + cmd(got + mode) + " --tp 2 --etp 2 --load-mode " + mode);
    ASSERT_EQ(p.code, 0) << p.out;
    auto m1 = test::read_step_metrics(got + mode + "/metrics.jsonl");
    ASSERT_EQ(m1.size(), 3u) << mode;
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(m1[i]["loss"].get<double>(), m0[i]["loss"].get<double>(), 1e-6 * m0[i]["loss"].get<double>())
          << mode << ", step " << i + 1;
  }
}
