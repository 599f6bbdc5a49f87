// The MoE experts' grouped GEMM path (CUTLASS, group sizes read on the device) against the per-expert
// cuBLASLt reference path and the CPU op, forward and backward; that the grouped path never waits for
// the host (it captures into a CUDA graph); and the deferred report of bad offsets.
//
// Inputs are bf16-exact, so all three see the same values. Tolerances (relative L2), with reasons:
//   - bf16 outputs (gu, h, yp, dxp) vs the CPU: 1e-2, as in test_cuda_gemm_moe.cpp: one bf16 rounding
//     of the output is up to 2^-8 relative per element (~1.5e-3 relative L2); the chains also round
//     h, dh and dgu to bf16, 2-4 such roundings in quadrature stay below 5e-3.
//   - weight gradients (f32 +=) vs the CPU: 1e-2: f32 GEMMs, but of dgu (dw_gate_up) and of h (dw_down)
//     that carry bf16 roundings the CPU's f32 intermediates do not.
//   - grouped vs reference: both paths are fed the same saved gu and h, so dw_down's inputs are
//     identical and only the f32 summation order could differ: kSameInputs = 1e-4, far below what
//     a wrong row range or transpose gives (order 1). Everything else: 1e-2 (a bf16 intermediate may
//     round the other way when the f32 sums differ in the last bits).
// Measured on an H200 (CUTLASS 4.2, CUDA 13.0): vs the CPU, bf16 outputs 1.6e-3..3.5e-3 and weight
// gradients 2.7e-3..3.1e-3; grouped vs reference exactly 0 for every output at every size (both run
// each output's K loop in order with the same wgmma steps and no split-K, so the sums are identical).
// Sizes: E=8, D=64, F=32 with one expert left without rows; tails of every tile dimension (D=72,
// F=40, the first expert empty); experts of several M tiles and K-grouped weight gradients of
// several K steps (E=4, about 470 rows each, the last expert empty); the realistic E=128, K=8,
// D=2048, F=768, T=512. "=" outputs start as NaN, "+=" outputs with nonzero values.
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/grouped_gemm.cuh"
#include "core/cuda_graph.h"
#include "cuda_test_util.h"

namespace mt::cuda {
cudaStream_t stream();  // common.cuh, which holds device code, is not for plain C++
}

using namespace mt;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

using cudatest::random_topk;

constexpr double kBf16Out = 1e-2;
constexpr double kWeightGrad = 1e-2;
constexpr double kSameInputs = 1e-4;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor filled(const Shape& s, float v) {
  Tensor t = Tensor::empty(s);
  t.fill_(v);
  return t;
}

Tensor cuda_filled(const Shape& s, DType dt, float v) {
  return to_cuda(filled(s, v), dt);
}

void expect_rel(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const double err = rel_l2(got, want);
  ::testing::Test::RecordProperty("rel_l2_" + what, str(err));
  EXPECT_LE(err, tol) << what;
}

Tensor cpu_offsets(const Tensor& idx, int64_t E) {
  return cudatest::cpu_plan(idx, E).offsets;
}

const __nv_bfloat16* bf16_ptr(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}
__nv_bfloat16* bf16_mut(const Tensor& t) {
  return static_cast<__nv_bfloat16*>(t.raw());
}

// The pre-filled weight gradient of expert e must come back bit for bit (an expert without rows).
void expect_expert_untouched(const Tensor& got_dev, const Tensor& init, int64_t e, const char* what) {
  const Tensor got = to_host_f32(got_dev);
  const int64_t per = init.numel() / init.size(0);
  int64_t diff = 0;
  for (int64_t i = 0; i < per; ++i) diff += got.data<float>()[e * per + i] != init.data<float>()[e * per + i];
  EXPECT_EQ(diff, 0) << what << ": expert " << e << " has no rows but its gradient changed";
}

struct Case {
  int64_t E, K, D, F, T;
  int32_t skip;  // the expert that gets no rows
};

class CudaGroupedGemm : public ::testing::TestWithParam<Case> {};

TEST_P(CudaGroupedGemm, ExpertsMatchReferencePathAndCpu) {
  MT_REQUIRE_GROUPED();
  const auto [E, K, D, F, T, skip] = GetParam();
  const int64_t R = T * K;
  Rng rng(91 + uint64_t(E) + uint64_t(D));
  const Tensor offsets = cpu_offsets(random_topk(T, K, E, rng, skip), E);
  ASSERT_EQ(offsets.data<int64_t>()[skip], offsets.data<int64_t>()[skip + 1]);
  const Tensor doff = offsets.to(Device::CUDA);
  const Tensor xp = rand_bf16_exact({R, D}, rng);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));
  const Tensor xpc = to_cuda(xp, DType::BF16), wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);

  // Forward.
  Tensor gu_want = Tensor::empty({R, 2 * F}), h_want = Tensor::empty({R, F}), yp_want = Tensor::empty({R, D});
  cpu::experts_fwd(xp, offsets, wgu, wd, gu_want, h_want, yp_want);
  Tensor gu = cuda_filled({R, 2 * F}, DType::BF16, kNaN), h = cuda_filled({R, F}, DType::BF16, kNaN),
         yp = cuda_filled({R, D}, DType::BF16, kNaN);
  EXPECT_EQ(cuda::experts_grouped_unsupported(D, F, {&xpc, &wguc, &wdc, &gu, &h, &yp}), "")
      << "experts_fwd would not take the grouped path for these arguments";
  cuda::experts_fwd_grouped(xpc, doff, wguc, wdc, gu, h, yp);
  Tensor gu_ref = cuda_filled({R, 2 * F}, DType::BF16, kNaN), h_ref = cuda_filled({R, F}, DType::BF16, kNaN),
         yp_ref = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::experts_fwd_reference(xpc, doff, wguc, wdc, gu_ref, h_ref, yp_ref);
  expect_rel(gu, gu_want, kBf16Out, "gu");
  expect_rel(h, h_want, kBf16Out, "h");
  expect_rel(yp, yp_want, kBf16Out, "yp");
  expect_rel(gu, gu_ref, kBf16Out, "gu_vs_reference");
  expect_rel(yp, yp_ref, kBf16Out, "yp_vs_reference");

  // Backward: both GPU paths get the grouped forward's gu and h; the CPU its own.
  const Tensor dyp = rand_bf16_exact({R, D}, rng), dypc = to_cuda(dyp, DType::BF16);
  // Random "+=" pre-fills where cheap; constants for the realistic case (400M values on the host).
  const bool big = E * D * F > 4'000'000;
  const Tensor dwgu0 = big ? filled({E, 2 * F, D}, 0.01f) : rand_bf16_exact({E, 2 * F, D}, rng, 0.05f);
  const Tensor dwd0 = big ? filled({E, D, F}, -0.01f) : rand_bf16_exact({E, D, F}, rng, 0.05f);
  Tensor dxp_want = Tensor::empty({R, D}), dwgu_want = dwgu0.clone(), dwd_want = dwd0.clone();
  cpu::experts_bwd(dyp, xp, offsets, wgu, wd, gu_want, h_want, dxp_want, dwgu_want, dwd_want);

  Tensor dxp = cuda_filled({R, D}, DType::BF16, kNaN), dwgu = to_cuda(dwgu0, DType::F32),
         dwd = to_cuda(dwd0, DType::F32);
  // after_dx runs once, with dxp final in stream order (what it queues sees the finished rows) and
  // before the weight gradients: a copy queued from it equals dxp.
  int hooks = 0;
  Tensor dxp_at_hook = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::experts_bwd_grouped(dypc, xpc, doff, wguc, wdc, gu, h, dxp, dwgu, dwd, true, [&] {
    ++hooks;
    dxp_at_hook.copy_from(dxp);
  });
  EXPECT_EQ(hooks, 1);
  expect_rel(dxp_at_hook, dxp, 0.0, "dxp_at_after_dx");
  Tensor dxp_ref = cuda_filled({R, D}, DType::BF16, kNaN), dwgu_ref = to_cuda(dwgu0, DType::F32),
         dwd_ref = to_cuda(dwd0, DType::F32);
  cuda::experts_bwd_reference(dypc, xpc, doff, wguc, wdc, gu, h, dxp_ref, dwgu_ref, dwd_ref);
  expect_rel(dxp, dxp_want, kBf16Out, "dxp");
  expect_rel(dwgu, dwgu_want, kWeightGrad, "dwgu");
  expect_rel(dwd, dwd_want, kWeightGrad, "dwd");
  expect_rel(dxp, dxp_ref, kBf16Out, "dxp_vs_reference");
  expect_rel(dwgu, dwgu_ref, kBf16Out, "dwgu_vs_reference");
  expect_rel(dwd, dwd_ref, kSameInputs, "dwd_vs_reference");
  // The "+=" contract on its own: what was added is the gradient, not a replacement of the pre-fill.
  if (!big) {
    Tensor added = to_host_f32(dwd), added_want = dwd_want.clone();
    for (int64_t i = 0; i < added.numel(); ++i) {
      added.data<float>()[i] -= dwd0.data<float>()[i];
      added_want.data<float>()[i] -= dwd0.data<float>()[i];
    }
    expect_rel(added, added_want, kWeightGrad, "dwd_added");
  }
  expect_expert_untouched(dwd, dwd0, skip, "dw_down");
  expect_expert_untouched(dwgu, dwgu0, skip, "dw_gate_up");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaGroupedGemm,
                         ::testing::Values(Case{8, 2, 64, 32, 64, 4},          // the brief's small case
                                           Case{5, 2, 72, 40, 37, 0},          // tails; the first expert empty
                                           Case{4, 2, 256, 128, 700, 3},       // many M tiles and K steps; last empty
                                           Case{128, 8, 2048, 768, 512, 64}),  // realistic
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "E" + std::to_string(c.E) + "_D" + std::to_string(c.D) + "_F" + std::to_string(c.F) +
                                  "_T" + std::to_string(c.T);
                         });

// A CUDA graph capture fails on any stream synchronisation or synchronous copy, so a capture of the
// whole grouped forward and backward shows that they never wait for the host. The replayed graph
// must then compute what the direct calls did (same kernels, same inputs: bit for bit).
TEST(CudaGroupedGemmNoSync, ExpertsForwardAndBackwardCaptureIntoAGraph) {
  MT_REQUIRE_GROUPED();
  const int64_t E = 8, K = 2, D = 64, F = 32, T = 100, R = T * K;
  Rng rng(7);
  const Tensor doff = cpu_offsets(random_topk(T, K, E, rng, 2), E).to(Device::CUDA);
  const Tensor xp = to_cuda(rand_bf16_exact({R, D}, rng), DType::BF16);
  const Tensor wgu = to_cuda(rand_bf16_exact({E, 2 * F, D}, rng, 0.1f), DType::BF16);
  const Tensor wd = to_cuda(rand_bf16_exact({E, D, F}, rng, 0.1f), DType::BF16);
  const Tensor dyp = to_cuda(rand_bf16_exact({R, D}, rng), DType::BF16);
  Tensor gu = Tensor::empty({R, 2 * F}, DType::BF16, Device::CUDA),
         h = Tensor::empty({R, F}, DType::BF16, Device::CUDA), yp = Tensor::empty({R, D}, DType::BF16, Device::CUDA),
         dxp = Tensor::empty({R, D}, DType::BF16, Device::CUDA);
  Tensor dwgu = Tensor::zeros({E, 2 * F, D}, DType::F32, Device::CUDA),
         dwd = Tensor::zeros({E, D, F}, DType::F32, Device::CUDA);
  // Direct calls first: they also grow every scratch buffer to its size (cudaMalloc is no stream work).
  cuda::experts_fwd_grouped(xp, doff, wgu, wd, gu, h, yp);
  cuda::experts_bwd_grouped(dyp, xp, doff, wgu, wd, gu, h, dxp, dwgu, dwd);
  const Tensor yp_direct = to_host_f32(yp), dxp_direct = to_host_f32(dxp);
  ASSERT_EQ(cudaMemset(yp.raw(), 0xff, yp.nbytes()), cudaSuccess);  // bf16 0xffff is a NaN
  ASSERT_EQ(cudaMemset(dxp.raw(), 0xff, dxp.nbytes()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  cuda_graph::Graph g;
  std::string why;
  ASSERT_TRUE(g.capture([&] {
        cuda::experts_fwd_grouped(xp, doff, wgu, wd, gu, h, yp);
        cuda::experts_bwd_grouped(dyp, xp, doff, wgu, wd, gu, h, dxp, dwgu, dwd);
      }, &why)) << "the grouped path did something a stream capture refuses (a host synchronisation?): " << why;
  g.replay();
  ASSERT_EQ(cudaStreamSynchronize(cuda::stream()), cudaSuccess);
  EXPECT_EQ(rel_l2(yp, yp_direct), 0.0);
  EXPECT_EQ(rel_l2(dxp, dxp_direct), 0.0);
}

// Offsets that are not non-decreasing from 0 to R: the call computes nothing for the bad expert and
// a later call reports it, naming the expert; the call after that runs normally again.
TEST(CudaGroupedGemmOffsets, BadOffsetsAreReportedByALaterCall) {
  MT_REQUIRE_GROUPED();
  const int64_t E = 3, R = 8, N = 16, K = 8;
  Rng rng(3);
  const Tensor a = to_cuda(rand_bf16_exact({R, K}, rng), DType::BF16);
  const Tensor b = to_cuda(rand_bf16_exact({E, N, K}, rng), DType::BF16);
  Tensor c = Tensor::zeros({R, N}, DType::BF16, Device::CUDA);
  Tensor bad = Tensor::empty({E + 1}, DType::I64), good = Tensor::empty({E + 1}, DType::I64);
  const int64_t bad_v[] = {0, 5, 3, 8}, good_v[] = {0, 3, 5, 8};
  for (int64_t i = 0; i <= E; ++i) {
    bad.data<int64_t>()[i] = bad_v[i];
    good.data<int64_t>()[i] = good_v[i];
  }
  const Tensor bad_d = bad.to(Device::CUDA), good_d = good.to(Device::CUDA);
  auto call = [&](const Tensor& off) {
    cuda::grouped_gemm_rows("test rows", E, off.data<int64_t>(), R, N, K, bf16_ptr(a), bf16_ptr(b), true, bf16_mut(c));
  };
  call(bad_d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the error record has reached the host now
  try {
    call(good_d);
    ADD_FAILURE() << "the bad offsets of the previous call were not reported";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("offsets_E1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expert 1 got -2 rows"), std::string::npos) << msg;
  }
  call(good_d);  // reported once, then gone
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_NO_THROW(call(good_d));
}

}  // namespace

#endif  // MT_HAVE_CUDA
