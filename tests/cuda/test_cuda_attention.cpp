// CUDA causal GQA attention against the CPU reference: the reference kernels (attention_ref.cu)
// and the cuDNN path that mt::cuda::attention_fwd/bwd take, forward and backward, plus the
// statistics contract between them (each backward reads what its forward wrote, in either order).
//
// Inputs are bf16-exact, so both sides see the same numbers. Tolerances (relative L2), with what
// an H200 measured (cuDNN 9.14 and 9.19):
//   out (bf16): 1e-2. One bf16 rounding of the output is at most 2^-9 = 2e-3 relative per element;
//     cuDNN also rounds P to bf16 before P.V. Measured 1.6e-3 (reference), 2.0e-3 (cuDNN).
//   lse (f32): 1e-5. Both paths compute it in f32 from the same inputs, so it differs from the
//     CPU's fp64 softmax only by f32 rounding in the dot products and the sum of exponentials
//     (~1e-7 per operation). Measured 3e-8..7e-8 on both paths.
//   dq, dk, dv (bf16): 2e-2 (docs/design.md's bf16 budget). They are built from the bf16 forward output
//     (D = dO . O carries its rounding into dS) and rounded to bf16 once more; cuDNN also rounds P
//     and dS to bf16 in its products. Measured 1.7e-3..2.2e-3 (reference), 2.3e-3..3.2e-3 (cuDNN).
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_ops.h"
#include "cuda_test_util.h"

using namespace mt;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

constexpr double kOutTol = 1e-2;
constexpr double kLseTol = 1e-5;
constexpr double kGradTol = 2e-2;

struct Dims {
  int64_t B, S, H, G, Hd;
  int64_t T() const { return B * S; }
};

// CUDA tensor (bf16 unless dt) of shape s filled with NaN: an op that leaves any element unwritten fails.
Tensor cuda_nan(const Shape& s, DType dt = DType::BF16) {
  Tensor t = Tensor::empty(s);
  t.fill_(std::numeric_limits<float>::quiet_NaN());
  return to_cuda(t, dt);
}

// One problem: bf16-exact inputs, the CPU's forward and backward, and the same inputs on the GPU.
struct Problem {
  Dims d;
  Tensor q, k, v, dout;          // CPU f32
  Tensor out, lse, dq, dk, dv;   // CPU results
  Tensor q_g, k_g, v_g, dout_g;  // CUDA bf16

  explicit Problem(Dims dims, uint64_t seed = 1) : d(dims) {
    Rng rng(seed);
    const int64_t T = d.T();
    q = cudatest::rand_bf16_exact({T, d.H, d.Hd}, rng);
    k = cudatest::rand_bf16_exact({T, d.G, d.Hd}, rng);
    v = cudatest::rand_bf16_exact({T, d.G, d.Hd}, rng);
    dout = cudatest::rand_bf16_exact({T, d.H, d.Hd}, rng);
    out = Tensor::empty({T, d.H, d.Hd});
    lse = Tensor::empty({T, d.H});
    dq = Tensor::empty({T, d.H, d.Hd});
    dk = Tensor::empty({T, d.G, d.Hd});
    dv = Tensor::empty({T, d.G, d.Hd});
    cpu::attention_fwd(q, k, v, d.B, d.S, out, lse);
    cpu::attention_bwd(dout, q, k, v, out, lse, d.B, d.S, dq, dk, dv);
    q_g = to_cuda(q, DType::BF16);
    k_g = to_cuda(k, DType::BF16);
    v_g = to_cuda(v, DType::BF16);
    dout_g = to_cuda(dout, DType::BF16);
  }
};

// GPU results of one path.
struct Result {
  Tensor out, lse, dq, dk, dv;
  explicit Result(const Dims& d)
      : out(cuda_nan({d.T(), d.H, d.Hd})),
        lse(cuda_nan({d.T(), d.H}, DType::F32)),
        dq(cuda_nan({d.T(), d.H, d.Hd})),
        dk(cuda_nan({d.T(), d.G, d.Hd})),
        dv(cuda_nan({d.T(), d.G, d.Hd})) {}
};

// The CPU's [T, H] statistics reordered to `layout`.
Tensor lse_in_layout(const Tensor& lse_TH, const Dims& d, cuda::StatsLayout layout) {
  if (layout == cuda::StatsLayout::TH) return lse_TH;
  Tensor r = Tensor::empty({d.T(), d.H});
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t s = 0; s < d.S; ++s)
      for (int64_t h = 0; h < d.H; ++h)
        r.data<float>()[(b * d.H + h) * d.S + s] = lse_TH.data<float>()[(b * d.S + s) * d.H + h];
  return r;
}

// rel_l2(a, b) <= tol, with the measured value kept as a test property (--gtest_output=xml shows it).
void expect_close(const Tensor& a, const Tensor& b, double tol, const std::string& what) {
  const double e = rel_l2(a, b);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", e);
  ::testing::Test::RecordProperty(what, buf);
  EXPECT_LE(e, tol) << what;
}

void expect_grads_close(const Problem& p, const Result& r, const std::string& what) {
  expect_close(r.dq, p.dq, kGradTol, what + " dq");
  expect_close(r.dk, p.dk, kGradTol, what + " dk");
  expect_close(r.dv, p.dv, kGradTol, what + " dv");
}

void check_ref_vs_cpu(const Dims& d) {
  Problem p(d);
  Result r(d);
  cuda::attention_ref_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, r.out, r.lse);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
  expect_close(r.out, p.out, kOutTol, "reference out");
  expect_close(r.lse, p.lse, kLseTol, "reference lse");
  expect_grads_close(p, r, "reference");
}

bool ref_forced() {
  const char* e = std::getenv("MOETRAIN_ATTENTION");
  return e && std::string(e) == "ref";
}

// attention_fwd/bwd (the cuDNN path, required here) against the CPU, including the statistics.
void check_cudnn_vs_cpu(const Dims& d) {
  if (ref_forced()) GTEST_SKIP() << "MOETRAIN_ATTENTION=ref";
  const cuda::AttentionPlanInfo info = cuda::attention_plan_info(d.B, d.S, d.H, d.G, d.Hd);
  ::testing::Test::RecordProperty("plan", info.reason);
  ASSERT_EQ(info.backend, cuda::AttentionBackend::cudnn) << info.reason;
  Problem p(d);
  Result r(d);
  cuda::attention_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, r.out, r.lse);
  cuda::attention_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
  expect_close(r.out, p.out, kOutTol, "cuDNN out");
  expect_close(r.lse, lse_in_layout(p.lse, d, info.stats), kLseTol, "cuDNN lse");
  expect_grads_close(p, r, "cuDNN");
}

// attention_fwd/bwd through whichever path their plan picks for these dims (recorded), against the CPU.
void check_dispatched_vs_cpu(const Dims& d) {
  const cuda::AttentionPlanInfo info = cuda::attention_plan_info(d.B, d.S, d.H, d.G, d.Hd);
  ::testing::Test::RecordProperty(str("plan_B", d.B, "_S", d.S), info.reason);
  Problem p(d);
  Result r(d);
  cuda::attention_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, r.out, r.lse);
  cuda::attention_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
  const std::string what = info.backend == cuda::AttentionBackend::cudnn ? "cuDNN" : "reference";
  expect_close(r.out, p.out, kOutTol, what + " out");
  expect_close(r.lse, lse_in_layout(p.lse, d, info.stats), kLseTol, what + " lse");
  if (d.S > 1) {
    expect_grads_close(p, r, what);
    return;
  }
  // One key per query: the softmax is the constant 1, so dq = dk = 0 exactly; the CPU's fp64 sums
  // leave ~1e-17 there, which makes a relative error meaningless. dv = dout.
  for (const Tensor* g : {&r.dq, &r.dk}) {
    const Tensor h = to_host_f32(*g);
    for (int64_t i = 0; i < h.numel(); ++i) ASSERT_LE(std::abs(h.data<float>()[i]), 1e-6f) << what << " at " << i;
  }
  expect_close(r.dv, p.dv, kGradTol, what + " dv");
}

}  // namespace

// The demo's head dim 32 at the shapes its evaluation runs (greedy decoding re-runs the whole prefix:
// S = 1..17 with a batch per prompt length) and at its training micro-batch (16 x 64).
TEST(CudaAttention, DemoHeadDim32AtEvaluationAndTrainingShapes) {
  MT_REQUIRE_GPU();
  for (int64_t S = 1; S <= 17; ++S) {
    SCOPED_TRACE("S " + std::to_string(S));
    check_dispatched_vs_cpu({1 + (S * 5) % 7, S, 4, 2, 32});
  }
  check_dispatched_vs_cpu({16, 64, 4, 2, 32});
}

TEST(CudaAttention, RefMatchesCpuOddLength) {
  MT_REQUIRE_GPU();
  check_ref_vs_cpu({2, 37, 4, 2, 16});
}

TEST(CudaAttention, RefMatchesCpuHd128) {
  MT_REQUIRE_GPU();
  check_ref_vs_cpu({1, 256, 8, 2, 128});
}

TEST(CudaAttention, RefMatchesCpuMhaHd256) {
  MT_REQUIRE_GPU();
  check_ref_vs_cpu({2, 70, 2, 2, 256});
}

TEST(CudaAttention, CudnnMatchesCpuGqa) {
  MT_REQUIRE_GPU();
  check_cudnn_vs_cpu({1, 512, 8, 2, 128});
}

TEST(CudaAttention, CudnnMatchesCpuMha) {
  MT_REQUIRE_GPU();
  check_cudnn_vs_cpu({2, 128, 4, 4, 64});
}

// Whatever attention_fwd chose, attention_bwd with its statistics gives the CPU's gradients; and
// the statistics of the two paths are interchangeable when written in the plan's order.
TEST(CudaAttention, ForwardStatisticsFeedTheBackward) {
  MT_REQUIRE_GPU();
  const Dims d{2, 96, 4, 2, 64};
  const cuda::AttentionPlanInfo info = cuda::attention_plan_info(d.B, d.S, d.H, d.G, d.Hd);
  ::testing::Test::RecordProperty("plan", info.reason);
  Problem p(d, 7);
  Result r(d);
  cuda::attention_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, r.out, r.lse);
  cuda::attention_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
  expect_close(r.out, p.out, kOutTol, "attention_fwd out");
  expect_grads_close(p, r, "attention_fwd -> attention_bwd");

  // The reference forward's statistics in the plan's order drive attention_bwd ...
  Result rr(d);
  cuda::attention_ref_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, rr.out, rr.lse, info.stats);
  expect_close(rr.lse, r.lse, kLseTol, "reference lse vs attention_fwd lse");
  cuda::attention_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, rr.out, rr.lse, d.B, d.S, rr.dq, rr.dk, rr.dv);
  expect_grads_close(p, rr, "reference forward -> attention_bwd");
  // ... and attention_fwd's statistics drive the reference backward.
  Result rb(d);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, r.out, r.lse, d.B, d.S, rb.dq, rb.dk, rb.dv, info.stats);
  expect_grads_close(p, rb, "attention_fwd -> reference backward");
}

// The [B, H, S] order holds the same numbers as [T, H], and the backward reads it the same way.
TEST(CudaAttention, RefStatsLayoutsAgree) {
  MT_REQUIRE_GPU();
  const Dims d{2, 33, 4, 1, 32};
  Problem p(d, 3);
  Result a(d), b(d);
  cuda::attention_ref_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, a.out, a.lse, cuda::StatsLayout::TH);
  cuda::attention_ref_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, b.out, b.lse, cuda::StatsLayout::BHS);
  EXPECT_EQ(rel_l2(b.out, a.out), 0.0);
  EXPECT_EQ(rel_l2(b.lse, lse_in_layout(to_host_f32(a.lse), d, cuda::StatsLayout::BHS)), 0.0);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, a.out, a.lse, d.B, d.S, a.dq, a.dk, a.dv,
                          cuda::StatsLayout::TH);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, b.out, b.lse, d.B, d.S, b.dq, b.dk, b.dv,
                          cuda::StatsLayout::BHS);
  EXPECT_EQ(rel_l2(b.dq, a.dq), 0.0);
  EXPECT_EQ(rel_l2(b.dk, a.dk), 0.0);
  EXPECT_EQ(rel_l2(b.dv, a.dv), 0.0);
  expect_grads_close(p, a, "reference");
}

// No atomics in the reference backward: two runs agree bit for bit.
TEST(CudaAttention, RefBackwardIsDeterministic) {
  MT_REQUIRE_GPU();
  const Dims d{1, 200, 8, 2, 64};
  Problem p(d, 5);
  Result a(d), b(d);
  cuda::attention_ref_fwd(p.q_g, p.k_g, p.v_g, d.B, d.S, a.out, a.lse);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, a.out, a.lse, d.B, d.S, a.dq, a.dk, a.dv);
  cuda::attention_ref_bwd(p.dout_g, p.q_g, p.k_g, p.v_g, a.out, a.lse, d.B, d.S, b.dq, b.dk, b.dv);
  EXPECT_EQ(rel_l2(b.dq, a.dq), 0.0);
  EXPECT_EQ(rel_l2(b.dk, a.dk), 0.0);
  EXPECT_EQ(rel_l2(b.dv, a.dv), 0.0);
}

// A bench-4L layer (S=4096, 32 query / 4 kv heads of 128): attention_fwd/bwd against the reference
// kernels (the CPU would take too long here), so the launch configurations of both are exercised.
TEST(CudaAttention, RealisticShapeMatchesReference) {
  MT_REQUIRE_GPU();
  const Dims d{1, 4096, 32, 4, 128};
  const cuda::AttentionPlanInfo info = cuda::attention_plan_info(d.B, d.S, d.H, d.G, d.Hd);
  ::testing::Test::RecordProperty("plan", info.reason);
  Rng rng(11);
  const int64_t T = d.T();
  Tensor q = to_cuda(cudatest::rand_bf16_exact({T, d.H, d.Hd}, rng), DType::BF16);
  Tensor k = to_cuda(cudatest::rand_bf16_exact({T, d.G, d.Hd}, rng), DType::BF16);
  Tensor v = to_cuda(cudatest::rand_bf16_exact({T, d.G, d.Hd}, rng), DType::BF16);
  Tensor dout = to_cuda(cudatest::rand_bf16_exact({T, d.H, d.Hd}, rng), DType::BF16);
  Result a(d), b(d);
  auto op_path = [&] {
    cuda::attention_fwd(q, k, v, d.B, d.S, a.out, a.lse);
    cuda::attention_bwd(dout, q, k, v, a.out, a.lse, d.B, d.S, a.dq, a.dk, a.dv);
  };
  auto ref_path = [&] {
    cuda::attention_ref_fwd(q, k, v, d.B, d.S, b.out, b.lse, info.stats);
    cuda::attention_ref_bwd(dout, q, k, v, b.out, b.lse, d.B, d.S, b.dq, b.dk, b.dv, info.stats);
  };
  // Wall time of a second (warm) run, kept as a property: what falling back would cost.
  auto time_ms = [&](auto&& run, const char* name) {
    run();
    to_host_f32(a.lse.rows(0, 1));  // waits for the stream
    const auto t0 = std::chrono::steady_clock::now();
    run();
    to_host_f32(a.lse.rows(0, 1));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ::testing::Test::RecordProperty(name, std::to_string(ms));
  };
  time_ms(op_path, "attention_fwd+bwd ms");
  time_ms(ref_path, "reference fwd+bwd ms");
  expect_close(a.out, b.out, kOutTol, "out");
  expect_close(a.lse, b.lse, kLseTol, "lse");
  expect_close(a.dq, b.dq, kGradTol, "dq");
  expect_close(a.dk, b.dk, kGradTol, "dk");
  expect_close(a.dv, b.dv, kGradTol, "dv");
}

TEST(CudaAttention, EmptyBatchIsANoOp) {
  MT_REQUIRE_GPU();
  const Dims d{0, 16, 4, 2, 64};
  Result r(d);
  Tensor q = Tensor::empty({0, 4, 64}, DType::BF16, Device::CUDA);
  Tensor kv = Tensor::empty({0, 2, 64}, DType::BF16, Device::CUDA);
  cuda::attention_fwd(q, kv, kv, d.B, d.S, r.out, r.lse);
  cuda::attention_bwd(q, q, kv, kv, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
  cuda::attention_ref_fwd(q, kv, kv, d.B, d.S, r.out, r.lse);
  cuda::attention_ref_bwd(q, q, kv, kv, r.out, r.lse, d.B, d.S, r.dq, r.dk, r.dv);
}

TEST(CudaAttention, RejectsBadArguments) {
  MT_REQUIRE_GPU();
  const Dims d{1, 8, 3, 2, 16};  // H % G != 0
  Result r(d);
  Tensor q = Tensor::zeros({8, 3, 16}, DType::BF16, Device::CUDA);
  Tensor kv = Tensor::zeros({8, 2, 16}, DType::BF16, Device::CUDA);
  try {
    cuda::attention_fwd(q, kv, kv, d.B, d.S, r.out, r.lse);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("query heads H (3) must be a multiple of key/value heads G (2)"),
              std::string::npos)
        << e.what();
  }
  Tensor q4 = Tensor::zeros({8, 4, 16}, DType::BF16, Device::CUDA);
  Tensor out4 = Tensor::zeros({8, 4, 16}, DType::BF16, Device::CUDA);
  Tensor lse_bf16 = Tensor::zeros({8, 4}, DType::BF16, Device::CUDA);
  try {
    cuda::attention_fwd(q4, kv, kv, 1, 8, out4, lse_bf16);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("attention_fwd lse_TH"), std::string::npos) << e.what();
  }
  try {
    cuda::attention_fwd(q4, kv, kv, 2, 8, out4, r.lse);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("B (2) * S (8) must equal the number of tokens T (8)"), std::string::npos)
        << e.what();
  }
}

#endif  // MT_HAVE_CUDA
