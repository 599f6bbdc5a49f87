// The whole model on CUDA (bf16 compute, fp32 masters) against the transformers goldens and the CPU
// training curve, within DESIGN.md's bf16 tolerance (relative L2 <= 2e-2).
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
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "train/trainer.h"

using namespace mt;
using cudatest::rel_l2;
namespace fs = std::filesystem;

namespace {

const std::string kGoldens = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/";

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
  for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Selective}) {
    Qwen3MoeModel m(cfg, Device::CUDA);
    m.recompute = rc;
    LoadReport rep = load_hf_weights(dir, cfg, m.table(), m.params());
    m.refresh_compute_weights();
    m.set_routing_replay(cpu_routing);
    Tensor logits;
    LossParts lp = m.forward_backward(mb, 1.0 / double(n), m.aux_enabled() ? cfg.router_aux_loss_coef : 0.0, &logits);
    double want = exp.read_f32("loss").data<float>()[0];
    EXPECT_LE(std::abs(lp.loss - want), 2e-2 * want) << lp.loss << " vs " << want;
    EXPECT_LE(rel_l2(logits, exp.read_f32("logits").view({-1, cfg.vocab_size})), 2e-2);
    // The gradient as a whole within DESIGN.md's 2e-2; each tensor within 5e-2, because the small
    // ones (RMSNorm weights, the router) sum bf16 products over every token with cancellation, and
    // sit near 3e-2 (measured 2.2e-2 to 3.5e-2 on an H200 over the six goldens).
    double worst = 0, num = 0, den = 0;
    std::string worst_name;
    for (auto& [name, g] : export_hf_tensors(cfg, m.table(), m.grads(), rep.layout)) {
      Tensor want_g = exp.read_f32("grad." + name);
      double e = rel_l2(g, want_g), sq = 0;
      for (int64_t i = 0; i < want_g.numel(); ++i) sq += double(want_g.data<float>()[i]) * want_g.data<float>()[i];
      num += e * e * sq;
      den += sq;
      EXPECT_LE(e, 5e-2) << "grad." << name << " (recompute " << recompute_name(rc) << ")";
      if (e > worst) worst = e, worst_name = name;
    }
    double global = std::sqrt(num / den);
    EXPECT_LE(global, 2e-2) << "all gradients together (recompute " << recompute_name(rc) << ")";
    RecordProperty("worst_grad_" + std::string(recompute_name(rc)), worst_name + " " + std::to_string(worst));
    std::printf("[cuda golden %s, recompute %s] loss %.6f vs %.6f, all gradients rel L2 %.3g, worst tensor %.3g (%s)\n",
                GetParam().c_str(), recompute_name(rc), lp.loss, want, global, worst, worst_name.c_str());
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
    m.recompute = r ? Recompute::Full : Recompute::None;
    lp[r] = m.forward_backward(mb, 1.0 / 126.0, c.router_aux_loss_coef);
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
