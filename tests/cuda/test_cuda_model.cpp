// The whole model on CUDA (bf16 compute, fp32 masters) against the transformers goldens and the CPU
// training curve, within docs/design.md's bf16 tolerance (relative L2 <= 2e-2).
//
// The golden comparison replays the routing of the fp32 CPU model (which matches transformers): bf16
// rounding moves router logits by ~1e-3, enough to flip a near-tie top-k choice of a few of the 32
// tokens, and one flipped token changes the gradient of a rarely used expert completely. Replaying
// the routing makes the test measure the numerics of the kernels, not the luck of the ties.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "cuda_test_util.h"
#ifdef MT_HAVE_CUDA
#include "backend/cuda/grouped_gemm.cuh"
#endif
#include "comm/communicator.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "parallel/fsdp.h"
#include "train/trainer.h"

using namespace mt;
using cudatest::rel_l2;
namespace fs = std::filesystem;

namespace {

const std::string kGoldens = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/";

bool grouped_experts_available() {
#ifdef MT_HAVE_CUDA
  return cuda::grouped_gemm_available();
#else
  return false;
#endif
}

class CudaGolden : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(CudaGolden, LossLogitsAndGradientsWithinBf16Tolerance) {
  MT_REQUIRE_GPU();
  const std::string dir = kGoldens + GetParam();
  ModelConfig cfg = load_model_config(dir);
  SafetensorsFile bf(dir + "/batch.safetensors"), exp(dir + "/expected.safetensors");
  MicroBatch mb{bf.view("input_ids").clone(), bf.view("labels").clone()};
  int64_t n = count_target_tokens(mb.labels);
  std::vector<Tensor> cpu_routing;
  {
    Qwen3MoeModel cpu(cfg);
    load_hf_weights(dir, cfg, cpu.table(), cpu.params());
    cpu.forward(mb, nullptr);
    cpu_routing = cpu.last_routing();
  }
  for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Selective, Recompute::Moe}) {
    Qwen3MoeModel m(cfg, Device::CUDA);
    LoadReport rep = load_hf_weights(dir, cfg, m.table(), m.params());
    m.refresh_compute_weights();
    MicroBatch replayed = mb;
    replayed.routing = cpu_routing;
    Tensor logits;
    PassOptions po;
    po.ce_scale = 1.0 / double(n);
    po.aux_scale = m.aux_enabled() ? cfg.router_aux_loss_coef : 0.0;
    po.recompute = rc;
    po.logits_out = &logits;
    LossParts lp = m.forward_backward(replayed, po);
    double want = exp.read_f32("loss").data<float>()[0];
    EXPECT_LE(std::abs(lp.loss - want), 2e-2 * want) << lp.loss << " vs " << want;
    EXPECT_LE(rel_l2(logits, exp.read_f32("logits").view({-1, cfg.vocab_size})), 2e-2);
    // The gradient as a whole within docs/design.md's 2e-2; each tensor within 5e-2, because the small
    // ones (RMSNorm weights, the router) sum bf16 products over every token with cancellation, and
    // sit near 3e-2 (measured 2.2e-2 to 3.5e-2 on an H200 over the six goldens).
    double worst = 0, num = 0, den = 0;
    std::string worst_name;
    // The worst tensor of each kind: the fp32-read parameters (RMSNorm gains, router) and the rest.
    double worst_norm = 0, worst_router = 0, worst_other = 0;
    for (auto& [name, g] : export_hf_tensors(cfg, m.table(), m.grads(), rep.layout)) {
      Tensor want_g = exp.read_f32("grad." + name);
      double e = rel_l2(g, want_g), sq = 0;
      for (int64_t i = 0; i < want_g.numel(); ++i) sq += double(want_g.data<float>()[i]) * want_g.data<float>()[i];
      num += e * e * sq;
      den += sq;
      EXPECT_LE(e, 5e-2) << "grad." << name << " (recompute " << recompute_name(rc) << ")";
      if (e > worst) worst = e, worst_name = name;
      double& kind = name.find("mlp.gate.weight") != std::string::npos ? worst_router
                     : fp32_compute_param(name)                         ? worst_norm
                                                                        : worst_other;
      kind = std::max(kind, e);
    }
    double global = std::sqrt(num / den);
    EXPECT_LE(global, 2e-2) << "all gradients together (recompute " << recompute_name(rc) << ")";
    RecordProperty("worst_grad_" + std::string(recompute_name(rc)), worst_name + " " + std::to_string(worst));
    std::printf("[cuda golden %s, recompute %s] loss %.6f vs %.6f, all gradients rel L2 %.3g, worst tensor %.3g (%s); "
                "worst norm gain %.3g, router %.3g, other %.3g\n",
                GetParam().c_str(), recompute_name(rc), lp.loss, want, global, worst, worst_name.c_str(), worst_norm,
                worst_router, worst_other);
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, CudaGolden,
                         ::testing::Values("tiny", "tied", "no_norm_topk", "dense_layer", "aux", "dense_qwen3"));

// Recompute on CUDA: the loss is identical and the gradients agree to float-atomic reordering.
TEST(CudaModel, FullRecomputeMatchesNoRecompute) {
  MT_REQUIRE_GPU();
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = true;
  Tensor host = Tensor::zeros({ParamTable(c).total()});
  init_weights(c, ParamTable(c), host, 5);
  Rng rng(3);
  MicroBatch mb{Tensor::empty({2, 64}, DType::I64), Tensor::empty({2, 64}, DType::I64)};
  for (int64_t i = 0; i < 128; ++i)
    mb.input_ids.data<int64_t>()[i] = mb.labels.data<int64_t>()[i] = rng.randint(0, c.vocab_size);
  LossParts lp[2];
  Tensor g[2];
  for (int r = 0; r < 2; ++r) {
    Qwen3MoeModel m(c, Device::CUDA);
    m.params().copy_from(host.to(Device::CUDA));
    m.refresh_compute_weights();
    PassOptions po;
    po.ce_scale = 1.0 / 126.0;
    po.aux_scale = c.router_aux_loss_coef;
    po.recompute = r ? Recompute::Full : Recompute::None;
    lp[r] = m.forward_backward(mb, po);
    g[r] = m.grads().to(Device::CPU);
  }
  // Float atomics (aux-loss statistics, weight-gradient reductions) reorder sums between runs.
  EXPECT_NEAR(lp[0].loss, lp[1].loss, 1e-7 * lp[0].loss);
  EXPECT_LE(rel_l2(g[1], g[0]), 1e-5);
}

TEST(CudaTrain, DemoFollowsTheCpuCurve) {
  MT_REQUIRE_GPU();
  std::ifstream f(std::string(MT_SOURCE_DIR) + "/tests/assets/curves/demo_cpu_100.json");
  std::vector<double> want = nlohmann::json::parse(f)["losses"].get<std::vector<double>>();
  TrainConfig c;
  c.device = "cuda";
  c.steps = 100;
  c.micro_batch_size = 8;
  c.lr = 1e-3;  // the committed curve's settings (tools/make_demo_curve.sh)
  c.min_lr = 1e-4;
  c.warmup_steps = 20;
  c.eval_problems = 0;
  c.log_every = 25;
  c.out_dir = (fs::temp_directory_path() / ("moetrain_cuda_curve_" + std::to_string(getpid()))).string();
  run_training(c);
  std::vector<double> got;
  std::ifstream mf(c.out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(mf, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) got.push_back(j["loss"]);
  }
  fs::remove_all(c.out_dir);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0, sum = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double e = std::abs(got[i] - want[i]) / want[i];
    worst = std::max(worst, e);
    sum += e;
  }
  std::printf("[cuda demo curve] step 1 %.4f vs %.4f, step 100 %.4f vs %.4f, mean rel diff %.3g, max %.3g\n", got[0],
              want[0], got.back(), want.back(), sum / double(want.size()), worst);
  // Within bf16 tolerance on average; single steps where the curve is steep may differ more.
  EXPECT_LE(sum / double(want.size()), 2e-2);
  EXPECT_LE(worst, 1e-1);
}

// The demo model's gradients through the CUTLASS grouped experts path against the per-expert
// cuBLASLt reference path, over two micro-batches (= then +=) whose replayed routing leaves runs of
// experts empty and gives one expert a single token in every layer. The two paths compute each
// expert product the same way (test_cuda_grouped_gemm.cpp measures them bit for bit), so the whole
// model's gradients may differ only by the float atomics of other ops.
TEST(CudaModel, DemoGradientsAreTheSameThroughBothExpertsPaths) {
  MT_REQUIRE_GPU();
  const ModelConfig c = preset_model_config("demo");
  const int64_t B = 16, S = 64, T = B * S, K = c.num_experts_per_tok;
  Tensor host = Tensor::zeros({ParamTable(c).total()});
  init_weights(c, ParamTable(c), host, 11);
  Rng rng(12);
  std::vector<MicroBatch> mbs;
  std::vector<std::vector<Tensor>> routing;
  for (int m = 0; m < 2; ++m) {
    MicroBatch mb{Tensor::empty({B, S}, DType::I64), Tensor::empty({B, S}, DType::I64)};
    for (int64_t i = 0; i < T; ++i)
      mb.input_ids.data<int64_t>()[i] = mb.labels.data<int64_t>()[i] = rng.randint(0, c.vocab_size);
    mbs.push_back(mb);
    std::vector<Tensor> layers;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      // Layer l: tokens choose among experts {l % 2, l % 2 + 2, l % 2 + 4} (so 3 or 4 in a row stay
      // empty), token 0's second choice is expert 7 - l % 2 (its only row).
      Tensor idx = Tensor::empty({T, K}, DType::I32);
      for (int64_t t = 0; t < T; ++t) {
        const int32_t a = int32_t(l % 2 + 2 * rng.randint(0, 3));
        int32_t b = int32_t(l % 2 + 2 * rng.randint(0, 3));
        while (b == a) b = int32_t(l % 2 + 2 * rng.randint(0, 3));
        idx.data<int32_t>()[t * K] = a;
        idx.data<int32_t>()[t * K + 1] = t == 0 ? int32_t(7 - l % 2) : b;
      }
      layers.push_back(idx);
    }
    routing.push_back(layers);
  }
  Tensor g[2];
  double loss[2] = {0, 0};
  const char* paths[2] = {"reference", "grouped"};
  for (int p = 0; p < 2; ++p) {
    if (p == 1 && !grouped_experts_available())
      GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM for this build and GPU";
    ::setenv("MOETRAIN_EXPERTS", paths[p], 1);
    Qwen3MoeModel m(c, Device::CUDA);
    m.params().copy_from(host.to(Device::CUDA));
    m.refresh_compute_weights();
    for (int mb = 0; mb < 2; ++mb) {
      PassOptions po;
      po.ce_scale = 1.0 / double(2 * (T - B));
      po.aux_scale = c.router_aux_loss_coef;
      po.overwrite_grads = mb == 0;
      MicroBatch replayed = mbs[size_t(mb)];
      replayed.routing = routing[size_t(mb)];
      loss[p] += m.forward_backward(replayed, po).loss;
    }
    g[p] = m.grads().to(Device::CPU);
  }
  ::unsetenv("MOETRAIN_EXPERTS");
  const ParamTable table(c);
  double worst = 0;
  std::string worst_name;
  for (const auto& e : table.entries()) {
    const double err = rel_l2(g[1].rows(e.offset, e.numel), g[0].rows(e.offset, e.numel));
    if (err > worst) worst = err, worst_name = e.name;
  }
  std::printf("[demo, grouped vs reference experts] loss %.7f vs %.7f, gradients rel L2 %.3g, worst tensor %.3g (%s)\n",
              loss[1], loss[0], rel_l2(g[1], g[0]), worst, worst_name.c_str());
  EXPECT_NEAR(loss[1], loss[0], 1e-5 * loss[0]);
  EXPECT_LE(worst, 1e-3) << worst_name;
}

// The user's command on the GPU: the default demo (`moetrain train`, 1,500 steps) must learn the
// task, not only follow the first 100 steps of the CPU curve. A learning test: it asserts on the
// held-out exact match the run itself measures.
TEST(CudaTrain, DefaultDemoReachesEightyFivePercentExactMatch) {
  MT_REQUIRE_GPU();
  TrainConfig c;
  c.device = "cuda";
  c.log_every = 100;
  c.out_dir = (fs::temp_directory_path() / ("moetrain_cuda_demo_" + std::to_string(getpid()))).string();
  const TrainSummary s = run_training(c);
  fs::remove_all(c.out_dir);
  std::printf("[cuda demo] %s\n", s.summary_line.c_str());
  ASSERT_TRUE(s.evaluated);
  EXPECT_GE(s.eval.exact_match(), 85.0) << s.summary_line;
}

// The RMSNorm gains and the router are read from the fp32 masters, not from the bf16 compute copy.
// Each of them is moved by less than its bf16 rounding interval (so the bf16 copy stays bit for bit
// the same): the logits must change, through a model that holds its own weights and through FSDP (one
// rank over NCCL, whose per-pass f32 copy must follow the masters the optimizer changed in place),
// and FSDP must give the single-device logits.
TEST(CudaModel, NormGainsAndRouterAreReadFromTheFp32Masters) {
  MT_REQUIRE_GPU();
  const ModelConfig c = preset_model_config("demo");
  const ParamTable table(c);
  Tensor host = Tensor::zeros({table.total()});
  init_weights(c, table, host, 21);
  Tensor moved = host.clone();
  const Tensor rounded = host.to(DType::BF16).to(DType::F32);
  int64_t n_moved = 0;
  for (const ParamEntry& e : table.entries()) {
    if (!fp32_compute_param(e.name)) continue;
    for (int64_t i = e.offset; i < e.offset + e.numel; ++i) {
      const float w = host.data<float>()[i], r = rounded.data<float>()[i];
      // Halfway to its bf16 value, or 2^-10 of itself when it is one (below half a bf16 ulp).
      const float m = w != r ? r + (w - r) / 2 : w * (1.0f + 1.0f / 1024.0f);
      moved.data<float>()[i] = m;
      n_moved += m != w;
    }
  }
  ASSERT_GT(n_moved, 1000);
  ASSERT_EQ(rel_l2(moved.to(DType::BF16).to(DType::F32), rounded), 0.0) << "every move stays below bf16 resolution";
  Rng rng(22);
  const int64_t B = 4, S = 64;
  MicroBatch mb{Tensor::empty({B, S}, DType::I64), Tensor()};
  for (int64_t i = 0; i < B * S; ++i) mb.input_ids.data<int64_t>()[i] = rng.randint(0, 22);

  auto logits_of = [&](Qwen3MoeModel& m) {
    Tensor logits;
    m.forward(mb, &logits);
    return logits.to(Device::CPU).to(DType::F32);
  };
  Qwen3MoeModel local(c, Device::CUDA);
  local.params().copy_from(host.to(Device::CUDA));
  local.refresh_compute_weights();
  const Tensor l0 = logits_of(local), l0_again = logits_of(local);
  local.params().copy_from(moved.to(Device::CUDA));
  local.refresh_compute_weights();
  EXPECT_EQ(rel_l2(local.compute_params()->to(Device::CPU).to(DType::F32), rounded), 0.0)
      << "the bf16 copy must not see the move";
  const Tensor l1 = logits_of(local);
  const double noise = rel_l2(l0_again, l0), moved_by = rel_l2(l1, l0);
  std::printf("[fp32 reads] repeat %.3g, gains and router moved below bf16 resolution: logits moved %.3g\n", noise,
              moved_by);
  EXPECT_GT(moved_by, 1e-5);
  EXPECT_GT(moved_by, 100 * noise);

  auto store = comm::make_memory_store();
  auto world = comm::make_world(Device::CUDA, 0, 1, *store, {});
  FsdpParams fsdp(c, table, Device::CUDA, *world, nullptr);
  auto load = [&](const Tensor& flat) {
    for (const FlatRange& p : fsdp.owned_pieces()) {
      Tensor dst = fsdp.params().rows(p.dst_offset, p.end - p.begin);
      dst.copy_from(flat.rows(p.begin, p.end - p.begin).to(Device::CUDA));
    }
    fsdp.refresh_compute_weights();
  };
  Qwen3MoeModel sharded(c, Device::CUDA, &fsdp);
  load(host);
  const Tensor f0 = logits_of(sharded);
  load(moved);  // the masters change between passes, as an optimizer step changes them
  const Tensor f1 = logits_of(sharded);
  EXPECT_LE(rel_l2(f0, l0), 1e-6) << "FSDP's fp32 copy holds the masters";
  EXPECT_LE(rel_l2(f1, l1), 1e-6) << "FSDP refreshes its fp32 copy each pass";
}
