// CUDA vs CPU tests of the load-balancing ops: the biased top-k selection, the router z-loss (forward
// and backward) and the balancing-bias update. Skipped without a GPU. Tolerances: probabilities,
// log-sum-exps and weights use fp64 sums on both sides, so they agree to ~1e-7 (1e-6 asserted); the
// z-loss gradient repeats the CPU's expression per element (1e-6); the bias update is integer sign
// logic plus one f32 multiply-add, compared exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/rng.h"
#include "cuda_test_util.h"

using namespace mt;
using cudatest::rel_l2;

namespace {

struct Case {
  int64_t T, E, K;
};
const Case kCases[] = {{4096, 128, 8}, {37, 8, 2}, {1000, 64, 6}};

// Scaled logits: neighbouring probabilities are far apart compared with an f32 ulp, so the top-k of
// both backends must agree exactly.
Tensor logits_for(const Case& c, Rng& rng) {
  Tensor t = Tensor::empty({c.T, c.E});
  rng.fill_normal(t, 0.0f, 4.0f);
  return t;
}

}  // namespace

TEST(CudaBalance, BiasedRouterForwardMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(21);
  for (const Case& c : kCases)
    for (bool norm : {false, true}) {
      SCOPED_TRACE(str("T=", c.T, " E=", c.E, " K=", c.K, " norm_topk=", norm));
      Tensor logits = logits_for(c, rng);
      Tensor bias = Tensor::empty({c.E});
      for (int64_t e = 0; e < c.E; ++e) bias.data<float>()[e] = float(rng.randint(-8, 9)) / 16.0f;  // exact
      Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
             w = Tensor::empty({c.T, c.K});
      cpu::router_fwd(logits, c.K, norm, probs, idx, w, &bias);
      Tensor probs_g = Tensor::empty({c.T, c.E}, DType::F32, Device::CUDA);
      Tensor idx_g = Tensor::empty({c.T, c.K}, DType::I32, Device::CUDA),
             w_g = Tensor::empty({c.T, c.K}, DType::F32, Device::CUDA);
      Tensor bias_g = bias.to(Device::CUDA);
      cuda::router_fwd(logits.to(Device::CUDA), c.K, norm, probs_g, idx_g, w_g, &bias_g);
      EXPECT_LT(rel_l2(probs_g, probs), 1e-6);
      EXPECT_LT(rel_l2(w_g, w), 1e-6);
      Tensor idx_h = idx_g.to(Device::CPU);
      int64_t differ = 0;
      for (int64_t i = 0; i < idx.numel(); ++i) differ += idx_h.data<int32_t>()[i] != idx.data<int32_t>()[i];
      EXPECT_EQ(differ, 0);
    }
}

TEST(CudaBalance, ZLossForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(22);
  for (const Case& c : kCases) {
    SCOPED_TRACE(str("T=", c.T, " E=", c.E));
    Tensor logits = logits_for(c, rng);
    Tensor lse = Tensor::empty({c.T}), zsum = Tensor::zeros({1});
    cpu::router_z_loss_fwd(logits, lse, zsum);
    Tensor lse_g = Tensor::empty({c.T}, DType::F32, Device::CUDA),
           zsum_g = Tensor::zeros({1}, DType::F32, Device::CUDA);
    Tensor logits_g = logits.to(Device::CUDA);
    cuda::router_z_loss_fwd(logits_g, lse_g, zsum_g);
    EXPECT_LT(rel_l2(lse_g, lse), 1e-6);
    // Per-block f32 atomics on the GPU, one fp64 sum on the CPU.
    EXPECT_NEAR(zsum_g.to(Device::CPU).data<float>()[0], zsum.data<float>()[0], 1e-5 * zsum.data<float>()[0]);

    Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
           w = Tensor::empty({c.T, c.K});
    cpu::router_fwd(logits, c.K, true, probs, idx, w);
    Tensor d = Tensor::empty({c.T, c.E});
    rng.fill_normal(d, 0.0f, 1e-3f);  // "+=": a random prior value
    Tensor d_g = d.to(Device::CUDA);
    cpu::router_z_loss_bwd(lse, probs, 0.01f, d);
    cuda::router_z_loss_bwd(lse.to(Device::CUDA), probs.to(Device::CUDA), 0.01f, d_g);  // the CPU's lse and probs
    EXPECT_LT(rel_l2(d_g, d), 1e-6);
  }
}

TEST(CudaBalance, BiasUpdateEqualsCpuExactly) {
  MT_REQUIRE_GPU();
  Rng rng(23);
  const int64_t L = 5, E = 300;
  Tensor counts = Tensor::empty({L, E}, DType::I64), bias = Tensor::empty({L, E});
  for (int64_t i = 0; i < L * E; ++i) counts.data<int64_t>()[i] = rng.randint(0, 7);
  for (int64_t e = 0; e < E; ++e) counts.data<int64_t>()[4 * E + e] = 3;  // a balanced row: no change
  rng.fill_normal(bias, 0.0f, 0.1f);
  Tensor bias_g = bias.to(Device::CUDA);
  cpu::router_bias_update(counts, 1e-3f, bias);
  cuda::router_bias_update(counts.to(Device::CUDA), 1e-3f, bias_g);
  Tensor h = bias_g.to(Device::CPU);
  int64_t differ = 0;
  for (int64_t i = 0; i < L * E; ++i) differ += h.data<float>()[i] != bias.data<float>()[i];
  EXPECT_EQ(differ, 0);
}
