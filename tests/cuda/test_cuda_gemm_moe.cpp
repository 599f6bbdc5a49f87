// CUDA vs CPU tests of the GEMM-based ops: linear layers (cuBLASLt), the MoE dispatch plan and
// (un)permutation, the experts (grouped and reference forms) and the fused LM head: with cross-entropy,
// and the per-token log-probabilities, entropies and objective gradients.
// Inputs are bf16-exact, so both backends see the same values. Tolerances, with their reasons:
//   - kBf16Out = 1e-2 for bf16 outputs: one bf16 rounding of the output is up to 2^-8 relative per
//     element (about 1.1e-3..1.5e-3 relative L2 over many elements); chains that also round an
//     intermediate to bf16 (experts: h, dh, dgu; LM head: dlogits) carry 2-4 such roundings in
//     quadrature, still below 5e-3. 1e-2 leaves 2x or more over that.
//   - f32 outputs of GEMMs on bf16-exact inputs: every product of two bf16 values is exact in f32, so
//     GPU and CPU differ only in the f32 summation order (about 1e-6 relative); kF32Gemm = 1e-4 is
//     far below what a wrong transpose or a missing term gives (order 1).
//   - exact comparisons where the op only moves data (plan, permute_fwd).
//   - unpermute's token side in f32 (the f32 residual stream): y f32 repeats the CPU's f32 operations
//     (no FMA), kF32Same = 1e-6 (0 expected); with a full-precision f32 dy, dyp is one bf16 rounding
//     (kBf16Out) and dw an f32 dot product against the CPU's fp64 one (1e-5, as with bf16 dy). Measured on
//     an H200: y f32 exactly 0, dyp 1.6e-3..1.7e-3, dw <= 1.1e-7.
// Measured on an H200 (each test records its errors as rel_l2_* properties, see expect_rel): bf16
// outputs 1.4e-3..2.7e-3 with one rounding, 2.8e-3..4.7e-3 for the experts chains; f32 GEMM outputs
// <= 4e-6; LM-head loss below 1e-6.
// "=" outputs are pre-filled with NaN (rel_l2 fails on any NaN left behind); "+=" outputs with nonzero
// values. Realistic sizes (T = 4096, D = 2048, E = 128, K = 8, F = 768, V = 151936) exercise the
// launch configurations; odd sizes the scalar paths and tails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "ops/ops.h"

using namespace mt;
using cudatest::cpu_plan;
using cudatest::cuda_plan;
using cudatest::expect_equal_ints;
using cudatest::Plan;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

using cudatest::random_topk;

constexpr double kBf16Out = 1e-2;
constexpr double kF32Gemm = 1e-4;
constexpr double kF32Same = 1e-6;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor filled(const Shape& s, float v) {
  Tensor t = Tensor::empty(s);
  t.fill_(v);
  return t;
}

Tensor cuda_filled(const Shape& s, DType dt, float v) {
  return to_cuda(filled(s, v), dt);
}

Tensor plus(const Tensor& a, const Tensor& b) {
  Tensor c = a.clone();
  for (int64_t i = 0; i < c.numel(); ++i) c.data<float>()[i] += b.data<float>()[i];
  return c;
}

// Checks rel_l2(got, want) <= tol and records the measured error as a test property (visible with
// --gtest_output=xml), so that the margin under each tolerance can be read from a GPU run.
void expect_rel(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const double err = rel_l2(got, want);
  ::testing::Test::RecordProperty("rel_l2_" + what, str(err));
  EXPECT_LE(err, tol) << what;
}

// Integer tensors travel as they are (no f32 round trip).
Tensor to_dev(const Tensor& t) {
  return t.to(Device::CUDA);
}
Tensor to_cpu(const Tensor& t) {
  return t.to(Device::CPU);
}

// Full-precision f32 N(0, 1) values (not bf16-exact), as an f32 residual stream carries.
Tensor rand_f32(const Shape& s, Rng& rng) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, 1.0f);
  return t;
}

Tensor random_weights(int64_t T, int64_t K, Rng& rng) {
  Tensor w = Tensor::empty({T, K});
  rng.fill_uniform(w, 0.05f, 1.0f);
  return w;
}

// ---------------------------------------------------------------------------------------------
// linear

struct LinearCase {
  int64_t T, I, O;
};

class CudaLinear : public ::testing::TestWithParam<LinearCase> {};

TEST_P(CudaLinear, ForwardMatchesCpuWithBf16AndF32Outputs) {
  MT_REQUIRE_GPU();
  const auto [T, I, O] = GetParam();
  Rng rng(11);
  const Tensor x = rand_bf16_exact({T, I}, rng), w = rand_bf16_exact({O, I}, rng, 0.05f);
  Tensor want = Tensor::empty({T, O});
  cpu::linear_fwd(x, w, want);
  for (DType dt : {DType::BF16, DType::F32}) {
    Tensor y = cuda_filled({T, O}, dt, kNaN);
    cuda::linear_fwd(to_cuda(x, DType::BF16), to_cuda(w, DType::BF16), y);
    expect_rel(y, want, dt == DType::F32 ? kF32Gemm : kBf16Out, str("y_", dtype_name(dt)));
  }
}

TEST_P(CudaLinear, BackwardMatchesCpuForBothDxContractsAndDwAccumulates) {
  MT_REQUIRE_GPU();
  const auto [T, I, O] = GetParam();
  Rng rng(12);
  const Tensor x = rand_bf16_exact({T, I}, rng), w = rand_bf16_exact({O, I}, rng, 0.05f);
  const Tensor dy = rand_bf16_exact({T, O}, rng), dx0 = rand_bf16_exact({T, I}, rng),
               dw0 = rand_bf16_exact({O, I}, rng);
  Tensor dx_want = Tensor::zeros({T, I}), dw_want = dw0.clone();
  cpu::linear_bwd(dy, x, w, &dx_want, false, dw_want);
  const Tensor xc = to_cuda(x, DType::BF16), wc = to_cuda(w, DType::BF16);
  for (DType dy_dt : {DType::BF16, DType::F32}) {
    for (DType dx_dt : {DType::BF16, DType::F32}) {  // f32 dx: several GEMMs sum into it (q, k, v)
      for (bool acc : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "dy " << dtype_name(dy_dt) << ", dx " << dtype_name(dx_dt)
                                          << (acc ? " +=" : " ="));
        Tensor dx = acc ? to_cuda(dx0, dx_dt) : cuda_filled({T, I}, dx_dt, kNaN);
        Tensor dw = to_cuda(dw0, DType::F32);
        cuda::linear_bwd(to_cuda(dy, dy_dt), xc, wc, &dx, acc, dw);
        const std::string tag = str("_dy_", dtype_name(dy_dt), "_dx_", dtype_name(dx_dt), acc ? "_acc" : "_set");
        expect_rel(dx, acc ? plus(dx_want, dx0) : dx_want, dx_dt == DType::F32 ? kF32Gemm : kBf16Out, "dx" + tag);
        expect_rel(dw, dw_want, kF32Gemm, "dw" + tag);
      }
    }
  }
  // dx may be null: only dw is computed.
  Tensor dw = to_cuda(dw0, DType::F32);
  cuda::linear_bwd(to_cuda(dy, DType::BF16), xc, wc, nullptr, false, dw);
  expect_rel(dw, dw_want, kF32Gemm, "dw_no_dx");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLinear,
                         ::testing::Values(LinearCase{4096, 2048, 768}, LinearCase{7, 64, 96}, LinearCase{7, 33, 17},
                                           LinearCase{1, 8, 1}, LinearCase{300, 128, 1000}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_I" + std::to_string(info.param.I) + "_O" +
                                  std::to_string(info.param.O);
                         });

TEST(CudaLinearF32Dy, NonBf16DyIsRoundedOnceAndStaysClose) {
  MT_REQUIRE_GPU();
  // dy in f32 with values that are not bf16-exact: the GPU rounds dy to bf16 once (relative error
  // 2^-9 RMS per element), so dx and dw differ from the f32 CPU result by about 1e-3 relative.
  const int64_t T = 257, I = 96, O = 80;
  Rng rng(13);
  const Tensor x = rand_bf16_exact({T, I}, rng), w = rand_bf16_exact({O, I}, rng, 0.1f);
  Tensor dy = Tensor::empty({T, O});
  rng.fill_normal(dy, 0.0f, 1.0f);
  Tensor dx_want = Tensor::empty({T, I}), dw_want = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, &dx_want, false, dw_want);
  Tensor dx = cuda_filled({T, I}, DType::BF16, kNaN), dw = Tensor::zeros({O, I}, DType::F32, Device::CUDA);
  cuda::linear_bwd(to_cuda(dy, DType::F32), to_cuda(x, DType::BF16), to_cuda(w, DType::BF16), &dx, false, dw);
  expect_rel(dx, dx_want, kBf16Out, "dx");
  expect_rel(dw, dw_want, 5e-3, "dw");
}

// An f32 weight (the router) runs the whole layer in true fp32: full-precision f32 operands that no
// bf16 (or TF32, 10 mantissa bits) GEMM could reproduce to 1e-5. A bf16 x is widened exactly.
TEST_P(CudaLinear, Fp32WeightComputesInFp32) {
  MT_REQUIRE_GPU();
  const auto [T, I, O] = GetParam();
  Rng rng(14);
  Tensor x32 = Tensor::empty({T, I}), w = Tensor::empty({O, I}), dy = Tensor::empty({T, O});
  Tensor dx0 = Tensor::empty({T, I}), dw0 = Tensor::empty({O, I});
  for (Tensor* t : {&x32, &dy, &dx0, &dw0}) rng.fill_normal(*t, 0.0f, 1.0f);
  rng.fill_normal(w, 0.0f, 0.05f);
  const Tensor x16 = rand_bf16_exact({T, I}, rng);
  const Tensor wc = w.to(Device::CUDA), dyc = dy.to(Device::CUDA);
  for (DType xdt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(::testing::Message() << "x " << dtype_name(xdt));
    const Tensor& x = xdt == DType::F32 ? x32 : x16;
    const Tensor xc = to_cuda(x, xdt);
    Tensor want = Tensor::empty({T, O});
    cpu::linear_fwd(x, w, want);
    Tensor y = cuda_filled({T, O}, DType::F32, kNaN);
    cuda::linear_fwd(xc, wc, y);
    // f32 accumulation over I <= 2048 terms against the CPU's: a few 1e-7 relative.
    expect_rel(y, want, 1e-5, "y");
    for (bool acc : {false, true}) {
      Tensor dx_want = acc ? dx0.clone() : Tensor::zeros({T, I}), dw_want = dw0.clone();
      cpu::linear_bwd(dy, x, w, &dx_want, acc, dw_want, !acc);
      Tensor dx = acc ? dx0.to(Device::CUDA) : cuda_filled({T, I}, DType::F32, kNaN), dw = dw0.to(Device::CUDA);
      cuda::linear_bwd(dyc, xc, wc, &dx, acc, dw, !acc);
      // dw sums T (up to 4096) products per element in f32.
      expect_rel(dx, dx_want, 1e-5, acc ? "dx_acc" : "dx_set");
      expect_rel(dw, dw_want, 1e-5, acc ? "dw_set" : "dw_acc");
    }
  }
}

TEST(CudaLinearArgs, RejectsWrongShapesAndDtypesNamingTheTensor) {
  MT_REQUIRE_GPU();
  Tensor x = Tensor::zeros({4, 8}, DType::BF16, Device::CUDA), w = Tensor::zeros({6, 8}, DType::BF16, Device::CUDA);
  Tensor y_bad = Tensor::zeros({4, 5}, DType::BF16, Device::CUDA);
  try {
    cuda::linear_fwd(x, w, y_bad);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("linear_fwd y_TO"), std::string::npos) << e.what();
  }
  Tensor x_f32 = Tensor::zeros({4, 8}, DType::F32, Device::CUDA), y = Tensor::zeros({4, 6}, DType::BF16, Device::CUDA);
  try {
    cuda::linear_fwd(x_f32, w, y);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("linear_fwd x_TI must be bf16 with a bf16 weight"), std::string::npos)
        << e.what();
  }
  // An f32 weight gives f32 outputs only.
  Tensor w32 = Tensor::zeros({6, 8}, DType::F32, Device::CUDA);
  try {
    cuda::linear_fwd(x, w32, y);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("linear_fwd y_TO must be f32 with an f32 weight"), std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// dispatch plan and permutation

TEST(CudaDispatch, PlanEqualsCpuPlanExactly) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, K, E;
    int32_t skip;
  };
  for (const Case c : {Case{4096, 8, 128, 77}, Case{3, 2, 4, -1}, Case{1000, 1, 3, 0}, Case{513, 4, 300, 299}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.T << " K " << c.K << " E " << c.E);
    Rng rng(uint64_t(c.T * 31 + c.E));
    const Tensor idx = random_topk(c.T, c.K, c.E, rng, c.skip);
    const Plan want = cpu_plan(idx, c.E);
    const Plan got = cuda_plan(idx, c.E);
    expect_equal_ints<int64_t>(got.offsets, want.offsets, "offsets_E1");
    expect_equal_ints<int32_t>(got.assign_of_row, want.assign_of_row, "assign_of_row_R");
    expect_equal_ints<int32_t>(got.row_of_assign, want.row_of_assign, "row_of_assign_TK");
    if (c.skip >= 0) {  // the expert without tokens has an empty range
      const Tensor off = to_cpu(got.offsets);
      EXPECT_EQ(off.data<int64_t>()[c.skip], off.data<int64_t>()[c.skip + 1]);
    }
  }
}

TEST(CudaDispatch, EmptyBatchGivesZeroOffsets) {
  MT_REQUIRE_GPU();
  const Tensor idx = Tensor::empty({0, 2}, DType::I32);
  const Plan got = cuda_plan(idx, 5);
  expect_equal_ints<int64_t>(got.offsets, Tensor::zeros({6}, DType::I64), "offsets_E1");
}

TEST(CudaDispatch, ExpertIdOutOfRangeSurfacesAtTheNextPlanNamingTokenChoiceAndId) {
  MT_REQUIRE_GPU();
  const int64_t E = 8;
  Tensor bad = Tensor::empty({3, 2}, DType::I32);
  const int32_t ids[] = {0, 1, 9, 2, 3, -1};  // first bad: token 1, choice 0, id 9
  for (int i = 0; i < 6; ++i) bad.data<int32_t>()[i] = ids[i];
  Plan p = cuda_plan(bad, E);  // does not synchronise, so it may not throw yet
  // Reading a result waits for the device; the clamped plan is still a valid permutation.
  const Tensor off = to_cpu(p.offsets);
  EXPECT_EQ(off.data<int64_t>()[E], 6);
  Rng rng(3);
  const Tensor good = random_topk(3, 2, E, rng);
  try {
    cuda_plan(good, E);
    FAIL() << "expected the earlier bad expert id to be reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 1 choice 0 with expert id 9, expected a value in [0, 8)"),
              std::string::npos)
        << e.what();
  }
  // The record is reset once reported.
  const Plan again = cuda_plan(good, E);
  expect_equal_ints<int32_t>(again.assign_of_row, cpu_plan(good, E).assign_of_row, "assign_of_row_R");
}

class CudaPermute : public ::testing::TestWithParam<int64_t> {};  // D

TEST_P(CudaPermute, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  const int64_t D = GetParam(), T = 300, K = 4, E = 16;
  Rng rng(21 + uint64_t(D));
  const Tensor idx = random_topk(T, K, E, rng, 5);
  const Plan plan = cpu_plan(idx, E);
  const Plan dplan{to_dev(plan.offsets), to_dev(plan.assign_of_row), to_dev(plan.row_of_assign)};
  const int64_t R = T * K;

  // permute_fwd is a copy: exact.
  const Tensor x = rand_bf16_exact({T, D}, rng);
  Tensor xp_want = Tensor::empty({R, D});
  cpu::permute_fwd(x, plan.assign_of_row, K, xp_want);
  Tensor xp = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::permute_fwd(to_cuda(x, DType::BF16), dplan.assign_of_row, K, xp);
  EXPECT_EQ(rel_l2(xp, xp_want), 0.0);

  // permute_bwd: dx += sum of the token's K rows (f32 sum, one bf16 rounding).
  const Tensor dxp = rand_bf16_exact({R, D}, rng), dx0 = rand_bf16_exact({T, D}, rng);
  Tensor dx_want = dx0.clone();
  cpu::permute_bwd(dxp, plan.assign_of_row, K, dx_want);
  Tensor dx = to_cuda(dx0, DType::BF16);
  cuda::permute_bwd(to_cuda(dxp, DType::BF16), dplan.assign_of_row, K, dx);
  expect_rel(dx, dx_want, kBf16Out, "dx");

  // unpermute_fwd: y = sum_k w * yp[row] (f32 sum, one bf16 rounding).
  const Tensor yp = rand_bf16_exact({R, D}, rng), w = random_weights(T, K, rng);
  Tensor y_want = Tensor::empty({T, D});
  cpu::unpermute_fwd(yp, plan.row_of_assign, w, y_want);
  Tensor y = cuda_filled({T, D}, DType::BF16, kNaN);
  cuda::unpermute_fwd(to_cuda(yp, DType::BF16), dplan.row_of_assign, to_cuda(w, DType::F32), y);
  expect_rel(y, y_want, kBf16Out, "y");
  Tensor y32 = cuda_filled({T, D}, DType::F32, kNaN);
  cuda::unpermute_fwd(to_cuda(yp, DType::BF16), dplan.row_of_assign, to_cuda(w, DType::F32), y32);
  expect_rel(y32, y_want, kF32Same, "y_f32");

  // unpermute_bwd: dyp = w * dy (one bf16 rounding); dw = <dy, yp> in f32 vs fp64 on the CPU (a sum of
  // D exact products: about 1e-7 relative).
  const Tensor dy = rand_bf16_exact({T, D}, rng);
  Tensor dyp_want = Tensor::empty({R, D}), dw_want = Tensor::empty({T, K});
  cpu::unpermute_bwd(dy, yp, plan.row_of_assign, w, dyp_want, dw_want);
  Tensor dyp = cuda_filled({R, D}, DType::BF16, kNaN), dw = cuda_filled({T, K}, DType::F32, kNaN);
  cuda::unpermute_bwd(to_cuda(dy, DType::BF16), to_cuda(yp, DType::BF16), dplan.row_of_assign, to_cuda(w, DType::F32),
                      dyp, dw);
  expect_rel(dyp, dyp_want, kBf16Out, "dyp");
  expect_rel(dw, dw_want, 1e-5, "dw");

  // The same with an f32 dy of full precision (the residual stream's gradient): the products dy*yp are
  // no longer exact in f32, one rounding each (2^-24), which leaves dw's error at ~1e-7.
  const Tensor dy32 = rand_f32({T, D}, rng);
  cpu::unpermute_bwd(dy32, yp, plan.row_of_assign, w, dyp_want, dw_want);
  dyp = cuda_filled({R, D}, DType::BF16, kNaN);
  dw = cuda_filled({T, K}, DType::F32, kNaN);
  cuda::unpermute_bwd(dy32.to(Device::CUDA), to_cuda(yp, DType::BF16), dplan.row_of_assign, to_cuda(w, DType::F32), dyp,
                      dw);
  expect_rel(dyp, dyp_want, kBf16Out, "dyp_dy_f32");
  expect_rel(dw, dw_want, 1e-5, "dw_dy_f32");

  // The weighted permute of score_before_experts (each half of unpermute_bwd alone): xp[row] = w x[t]
  // (one bf16 rounding); dx = sum_k w dxp[row] (f32 sum, one rounding), dw = <x[t], dxp[row]> (f32).
  Tensor xpw_want = Tensor::empty({R, D}), xs_dw = Tensor::empty({T, K});
  cpu::unpermute_bwd(x, yp, plan.row_of_assign, w, xpw_want, xs_dw);
  Tensor xpw = cuda_filled({R, D}, DType::BF16, kNaN);
  ops::permute_weighted_fwd(to_cuda(x, DType::BF16), dplan.row_of_assign, to_cuda(w, DType::F32), xpw);
  expect_rel(xpw, xpw_want, kBf16Out, "xp weighted");
  Tensor dxw_want = Tensor::empty({T, D}), dww_want = Tensor::empty({T, K}), scratch = Tensor::empty({R, D});
  cpu::unpermute_fwd(dxp, plan.row_of_assign, w, dxw_want);
  cpu::unpermute_bwd(x, dxp, plan.row_of_assign, w, scratch, dww_want);
  Tensor dxw = cuda_filled({T, D}, DType::BF16, kNaN), dww = cuda_filled({T, K}, DType::F32, kNaN);
  ops::permute_weighted_bwd(to_cuda(dxp, DType::BF16), to_cuda(x, DType::BF16), dplan.row_of_assign,
                            to_cuda(w, DType::F32), dxw, dww);
  expect_rel(dxw, dxw_want, kBf16Out, "dx weighted");
  expect_rel(dww, dww_want, 1e-5, "dw weighted");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaPermute, ::testing::Values(int64_t(2048), int64_t(64), int64_t(70), int64_t(1)),
                         [](const auto& info) { return "D" + std::to_string(info.param); });

TEST(CudaPermuteRealistic, T4096K8D2048MatchesCpu) {
  MT_REQUIRE_GPU();
  const int64_t T = 4096, K = 8, E = 128, D = 2048, R = T * K;
  Rng rng(31);
  const Tensor idx = random_topk(T, K, E, rng);
  const Plan plan = cpu_plan(idx, E);
  const Plan dplan = cuda_plan(idx, E);
  const Tensor x = rand_bf16_exact({T, D}, rng);
  Tensor xp_want = Tensor::empty({R, D});
  cpu::permute_fwd(x, plan.assign_of_row, K, xp_want);
  Tensor xp = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::permute_fwd(to_cuda(x, DType::BF16), dplan.assign_of_row, K, xp);
  EXPECT_EQ(rel_l2(xp, xp_want), 0.0);
  const Tensor w = random_weights(T, K, rng);
  Tensor y_want = Tensor::empty({T, D});
  cpu::unpermute_fwd(xp_want, plan.row_of_assign, w, y_want);
  Tensor y = cuda_filled({T, D}, DType::BF16, kNaN);
  cuda::unpermute_fwd(xp, dplan.row_of_assign, to_cuda(w, DType::F32), y);
  expect_rel(y, y_want, kBf16Out, "y");
  Tensor y32 = cuda_filled({T, D}, DType::F32, kNaN);
  cuda::unpermute_fwd(xp, dplan.row_of_assign, to_cuda(w, DType::F32), y32);
  expect_rel(y32, y_want, kF32Same, "y_f32");
  // unpermute_bwd with the f32 residual gradient at this size.
  const Tensor dy32 = rand_f32({T, D}, rng);
  Tensor dyp_want = Tensor::empty({R, D}), dw_want = Tensor::empty({T, K});
  cpu::unpermute_bwd(dy32, xp_want, plan.row_of_assign, w, dyp_want, dw_want);
  Tensor dyp = cuda_filled({R, D}, DType::BF16, kNaN), dw = cuda_filled({T, K}, DType::F32, kNaN);
  cuda::unpermute_bwd(dy32.to(Device::CUDA), xp, dplan.row_of_assign, to_cuda(w, DType::F32), dyp, dw);
  expect_rel(dyp, dyp_want, kBf16Out, "dyp_dy_f32");
  expect_rel(dw, dw_want, 1e-5, "dw_dy_f32");
  Tensor dx_want = Tensor::zeros({T, D});
  cpu::permute_bwd(xp_want, plan.assign_of_row, K, dx_want);
  Tensor dx = Tensor::zeros({T, D}, DType::BF16, Device::CUDA);
  cuda::permute_bwd(xp, dplan.assign_of_row, K, dx);
  expect_rel(dx, dx_want, kBf16Out, "dx");
}

TEST(CudaPermuteUnreferencedRows, UnpermuteBwdZeroesRowsNoAssignmentPointsAt) {
  MT_REQUIRE_GPU();
  // R = T*K + 3 rows; row_of_assign uses T*K of them, so 3 rows must come back as zero.
  const int64_t T = 10, K = 2, D = 24, R = T * K + 3;
  Rng rng(41);
  Tensor row = Tensor::empty({T, K}, DType::I32);
  for (int64_t a = 0; a < T * K; ++a) row.data<int32_t>()[a] = int32_t(R - 1 - a);  // rows 3..R-1, reversed
  const Tensor yp = rand_bf16_exact({R, D}, rng), dy = rand_bf16_exact({T, D}, rng), w = random_weights(T, K, rng);
  Tensor dyp_want = Tensor::empty({R, D}), dw_want = Tensor::empty({T, K});
  cpu::unpermute_bwd(dy, yp, row, w, dyp_want, dw_want);
  Tensor dyp = cuda_filled({R, D}, DType::BF16, kNaN), dw = cuda_filled({T, K}, DType::F32, kNaN);
  cuda::unpermute_bwd(to_cuda(dy, DType::BF16), to_cuda(yp, DType::BF16), to_dev(row), to_cuda(w, DType::F32), dyp, dw);
  expect_rel(dyp, dyp_want, kBf16Out, "dyp");
  expect_rel(dw, dw_want, 1e-5, "dw");
  Tensor dyp2 = cuda_filled({R, D}, DType::BF16, kNaN), dw2 = cuda_filled({T, K}, DType::F32, kNaN);
  cuda::unpermute_bwd(to_cuda(dy, DType::F32), to_cuda(yp, DType::BF16), to_dev(row), to_cuda(w, DType::F32), dyp2,
                      dw2);
  expect_rel(dyp2, dyp_want, kBf16Out, "dyp_dy_f32");
  expect_rel(dw2, dw_want, 1e-5, "dw_dy_f32");
}

TEST(CudaPermuteArgs, UnpermuteTokenSideTakesBf16OrF32Only) {
  MT_REQUIRE_GPU();
  const int64_t T = 2, K = 1, D = 8;
  Tensor yp = Tensor::zeros({T, D}, DType::BF16, Device::CUDA), row = Tensor::zeros({T, K}, DType::I32, Device::CUDA);
  Tensor w = Tensor::zeros({T, K}, DType::F32, Device::CUDA), y = Tensor::zeros({T, D}, DType::I32, Device::CUDA);
  try {
    cuda::unpermute_fwd(yp, row, w, y);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unpermute_fwd y_TD has dtype i32, expected bf16 or f32"), std::string::npos)
        << e.what();
  }
  Tensor dyp32 = Tensor::zeros({T, D}, DType::F32, Device::CUDA), dw = Tensor::zeros({T, K}, DType::F32, Device::CUDA);
  try {  // dyp (the expert side) stays bf16
    cuda::unpermute_bwd(dyp32, yp, row, w, dyp32, dw);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unpermute_bwd dyp_RD has dtype f32, expected bf16"), std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// experts

struct ExpertsCase {
  int64_t E, K, D, F, T;
};

class CudaExperts : public ::testing::TestWithParam<ExpertsCase> {};

TEST_P(CudaExperts, GroupedForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  const auto [E, K, D, F, T] = GetParam();
  const int64_t R = T * K;
  Rng rng(51 + uint64_t(E));
  const Tensor idx = random_topk(T, K, E, rng, int32_t(E / 2));  // one expert gets no rows
  const Plan plan = cpu_plan(idx, E);
  const Tensor doff = to_dev(plan.offsets);
  const Tensor xp = rand_bf16_exact({R, D}, rng);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));

  Tensor gu_want = Tensor::empty({R, 2 * F}), h_want = Tensor::empty({R, F}), yp_want = Tensor::empty({R, D});
  cpu::experts_fwd(xp, plan.offsets, wgu, wd, gu_want, h_want, yp_want);
  const Tensor xpc = to_cuda(xp, DType::BF16), wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);
  Tensor gu = cuda_filled({R, 2 * F}, DType::BF16, kNaN), h = cuda_filled({R, F}, DType::BF16, kNaN),
         yp = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::experts_fwd(xpc, doff, wguc, wdc, gu, h, yp);
  expect_rel(gu, gu_want, kBf16Out, "gu");
  expect_rel(h, h_want, kBf16Out, "h");
  expect_rel(yp, yp_want, kBf16Out, "yp");

  // Each backend's backward gets its own saved gu and h (as in training).
  const Tensor dyp = rand_bf16_exact({R, D}, rng);
  // Constant pre-fills (random ones of 400M elements would dominate the realistic case's run time).
  const Tensor dwgu0 = filled({E, 2 * F, D}, 0.01f), dwd0 = filled({E, D, F}, -0.01f);
  Tensor dxp_want = Tensor::empty({R, D}), dwgu_want = dwgu0.clone(), dwd_want = dwd0.clone();
  cpu::experts_bwd(dyp, xp, plan.offsets, wgu, wd, gu_want, h_want, dxp_want, dwgu_want, dwd_want);
  Tensor dxp = cuda_filled({R, D}, DType::BF16, kNaN), dwgu = to_cuda(dwgu0, DType::F32),
         dwd = to_cuda(dwd0, DType::F32);
  cuda::experts_bwd(to_cuda(dyp, DType::BF16), xpc, doff, wguc, wdc, gu, h, dxp, dwgu, dwd);
  expect_rel(dxp, dxp_want, kBf16Out, "dxp");
  expect_rel(dwgu, dwgu_want, kBf16Out, "dwgu");
  expect_rel(dwd, dwd_want, kBf16Out, "dwd");
  // The expert without rows keeps its pre-filled gradient exactly.
  const int64_t e0 = E / 2;
  const Tensor dwd_host = to_host_f32(dwd);
  for (int64_t i = 0; i < D * F; ++i)
    ASSERT_EQ(dwd_host.data<float>()[e0 * D * F + i], dwd0.data<float>()[e0 * D * F + i]) << i;
}

TEST_P(CudaExperts, ReferenceFormMatchesCpuReference) {
  MT_REQUIRE_GPU();
  const auto [E, K, D, F, T] = GetParam();
  if (D * F * E > 8 * 64 * 64) GTEST_SKIP() << "the CPU reference form is scalar fp64; small sizes only";
  Rng rng(61 + uint64_t(E));
  const Tensor idx = random_topk(T, K, E, rng, int32_t(E / 2));
  const Tensor w = random_weights(T, K, rng);
  const Tensor x = rand_bf16_exact({T, D}, rng);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));
  Tensor y_want = Tensor::empty({T, D});
  cpu::experts_ref_fwd(x, idx, w, wgu, wd, y_want);
  const Tensor xc = to_cuda(x, DType::BF16), idxc = to_dev(idx), wc = to_cuda(w, DType::F32),
               wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);
  Tensor y = cuda_filled({T, D}, DType::BF16, kNaN);
  cuda::experts_ref_fwd(xc, idxc, wc, wguc, wdc, y);
  expect_rel(y, y_want, kBf16Out, "y");

  const Tensor dy = rand_bf16_exact({T, D}, rng);
  Tensor dx_want = Tensor::empty({T, D}), dtw_want = Tensor::empty({T, K}), dwgu_want = Tensor::zeros(wgu.shape()),
         dwd_want = Tensor::zeros(wd.shape());
  cpu::experts_ref_bwd(dy, x, idx, w, wgu, wd, dx_want, dtw_want, dwgu_want, dwd_want);
  Tensor dx = cuda_filled({T, D}, DType::BF16, kNaN), dtw = cuda_filled({T, K}, DType::F32, kNaN),
         dwgu = Tensor::zeros(wgu.shape(), DType::F32, Device::CUDA),
         dwd = Tensor::zeros(wd.shape(), DType::F32, Device::CUDA);
  cuda::experts_ref_bwd(to_cuda(dy, DType::BF16), xc, idxc, wc, wguc, wdc, dx, dtw, dwgu, dwd);
  expect_rel(dx, dx_want, kBf16Out, "dx");
  expect_rel(dtw, dtw_want, kBf16Out, "dtw");  // <dy, yp> with yp rounded to bf16
  expect_rel(dwgu, dwgu_want, kBf16Out, "dwgu");
  expect_rel(dwd, dwd_want, kBf16Out, "dwd");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaExperts,
                         ::testing::Values(ExpertsCase{8, 2, 64, 32, 64}, ExpertsCase{8, 2, 40, 12, 37},
                                           ExpertsCase{128, 8, 2048, 768, 512}),
                         [](const auto& info) {
                           return "E" + std::to_string(info.param.E) + "_D" + std::to_string(info.param.D) + "_F" +
                                  std::to_string(info.param.F) + "_T" + std::to_string(info.param.T);
                         });

// ---------------------------------------------------------------------------------------------
// LM head + cross-entropy

struct LmHeadCase {
  int64_t T, D, V, chunk;
};

class CudaLmHead : public ::testing::TestWithParam<LmHeadCase> {};

TEST_P(CudaLmHead, LossAndGradientsMatchCpu) {
  MT_REQUIRE_GPU();
  const auto [T, D, V, chunk] = GetParam();
  Rng rng(71 + uint64_t(V));
  const Tensor hn = rand_bf16_exact({T, D}, rng), w = rand_bf16_exact({V, D}, rng, 1.0f / std::sqrt(float(D)));
  Tensor labels = Tensor::empty({T}, DType::I64);
  int64_t valid = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool ignore = t % 7 == 3;
    labels.data<int64_t>()[t] = ignore ? -100 : rng.randint(0, V);
    valid += !ignore;
  }
  const float scale = 1.0f / float(valid);
  const Tensor dw0 = rand_bf16_exact({V, D}, rng, 1e-3f);
  Tensor loss_want = filled({1}, 1.5f), dhn_want = Tensor::empty({T, D}), dw_want = dw0.clone();
  cpu::lm_head_cross_entropy(hn, w, labels, scale, chunk, loss_want, dhn_want, dw_want);

  Tensor loss = cuda_filled({1}, DType::F32, 1.5f), dhn = cuda_filled({T, D}, DType::BF16, kNaN),
         dw = to_cuda(dw0, DType::F32);
  cuda::lm_head_cross_entropy(to_cuda(hn, DType::BF16), to_cuda(w, DType::BF16), to_dev(labels), scale, chunk, loss,
                              dhn, dw);
  // Loss: the same f32 logits up to summation order, lse in f32 vs fp64: about 1e-6 relative.
  expect_rel(loss, loss_want, 1e-4, "loss");
  expect_rel(dhn, dhn_want, kBf16Out, "dhn");  // dlogits and dhn each rounded to bf16 once
  expect_rel(dw, dw_want, kBf16Out, "dw");     // dlogits rounded to bf16
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLmHead,
                         ::testing::Values(LmHeadCase{300, 64, 1000, 128},   // 2 full chunks and a partial one
                                           LmHeadCase{300, 64, 1000, 0},     // default chunk: one chunk
                                           LmHeadCase{33, 40, 999, 5},       // odd V and D
                                           LmHeadCase{64, 256, 151936, 0}),  // the real vocabulary
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_V" + std::to_string(info.param.V) + "_chunk" +
                                  std::to_string(info.param.chunk);
                         });

TEST(CudaLmHeadLabels, OutOfRangeLabelPoisonsTheLossAndIsReportedByTheNextCall) {
  MT_REQUIRE_GPU();
  const int64_t T = 20, D = 16, V = 1000;
  Rng rng(81);
  const Tensor hn = to_cuda(rand_bf16_exact({T, D}, rng), DType::BF16);
  const Tensor w = to_cuda(rand_bf16_exact({V, D}, rng, 0.25f), DType::BF16);
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t;
  labels.data<int64_t>()[5] = V;  // out of range
  Tensor loss = Tensor::zeros({1}, DType::F32, Device::CUDA), dhn = Tensor::empty({T, D}, DType::BF16, Device::CUDA),
         dw = Tensor::zeros({V, D}, DType::F32, Device::CUDA);
  cuda::lm_head_cross_entropy(hn, w, to_dev(labels), 1.0f, 0, loss, dhn, dw);
  EXPECT_TRUE(std::isnan(to_host_f32(loss).data<float>()[0]));  // reading it also waits for the device
  labels.data<int64_t>()[5] = 5;
  try {
    cuda::lm_head_cross_entropy(hn, w, to_dev(labels), 1.0f, 0, loss, dhn, dw);
    FAIL() << "expected the earlier bad label to be reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 1000 at row 5"), std::string::npos) << e.what();
  }
  Tensor loss2 = Tensor::zeros({1}, DType::F32, Device::CUDA);
  cuda::lm_head_cross_entropy(hn, w, to_dev(labels), 1.0f, 0, loss2, dhn, dw);
  EXPECT_TRUE(std::isfinite(to_host_f32(loss2).data<float>()[0]));
}

// ---------------------------------------------------------------------------------------------
// LM head for per-token objectives: lm_head_logprobs and lm_head_objective_bwd

struct LmHeadObjectiveCase {
  int64_t T, D, V, chunk, group_rows;
};

class CudaLmHeadObjective : public ::testing::TestWithParam<LmHeadObjectiveCase> {};

// Log-probs and entropies (with and without the entropy output), then the objective's gradients with
// and without the entropy term, for both dw contracts. Ignored rows every 7th; g and h random per row.
TEST_P(CudaLmHeadObjective, LogprobsEntropiesAndGradientsMatchCpu) {
  MT_REQUIRE_GPU();
  const auto [T, D, V, chunk, group_rows] = GetParam();
  // MOETRAIN_LM_HEAD_GROUP_ROWS for this case (0: unset, the byte budget decides).
  const std::string rows_text = std::to_string(group_rows);
  const cudatest::EnvGuard env("MOETRAIN_LM_HEAD_GROUP_ROWS", group_rows > 0 ? rows_text.c_str() : nullptr);
  Rng rng(101 + uint64_t(V));
  const Tensor hn = rand_bf16_exact({T, D}, rng), w = rand_bf16_exact({V, D}, rng, 1.0f / std::sqrt(float(D)));
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t % 7 == 3 ? -100 : rng.randint(0, V);
  const Tensor hn_g = to_cuda(hn, DType::BF16), w_g = to_cuda(w, DType::BF16), labels_g = to_dev(labels);

  Tensor logp_want = filled({T}, kNaN), ent_want = filled({T}, kNaN);
  cpu::lm_head_logprobs(hn, w, labels, chunk, logp_want, &ent_want);
  Tensor logp = cuda_filled({T}, DType::F32, kNaN), ent = cuda_filled({T}, DType::F32, kNaN);
  cuda::lm_head_logprobs(hn_g, w_g, labels_g, chunk, logp, &ent);
  // The same f32 logits up to summation order; f32 softmax statistics vs fp64: about 1e-6 relative.
  expect_rel(logp, logp_want, 1e-4, "logp");
  expect_rel(ent, ent_want, 1e-4, "entropy");
  Tensor logp_only = cuda_filled({T}, DType::F32, kNaN);
  cuda::lm_head_logprobs(hn_g, w_g, labels_g, chunk, logp_only, nullptr);
  expect_rel(logp_only, logp_want, 1e-4, "logp_only");

  Tensor g = Tensor::empty({T}), h = Tensor::empty({T});
  rng.fill_uniform(g, -1.0f, 1.0f);
  rng.fill_uniform(h, -1.0f, 1.0f);
  const Tensor g_g = to_cuda(g, DType::F32), h_g = to_cuda(h, DType::F32);
  const Tensor dw0 = rand_bf16_exact({V, D}, rng, 1e-3f);
  for (bool with_h : {true, false}) {
    for (bool acc : {true, false}) {
      const std::string tag = std::string(with_h ? "gh" : "g") + (acc ? "_acc" : "_set");
      SCOPED_TRACE(tag);
      Tensor dhn_want = filled({T, D}, kNaN), dw_want = acc ? dw0.clone() : Tensor::zeros({V, D});
      cpu::lm_head_objective_bwd(hn, w, labels, g, with_h ? &h : nullptr, chunk, dhn_want, dw_want, acc);
      Tensor dhn = cuda_filled({T, D}, DType::BF16, kNaN),
             dw = acc ? to_cuda(dw0, DType::F32) : cuda_filled({V, D}, DType::F32, kNaN);
      cuda::lm_head_objective_bwd(hn_g, w_g, labels_g, g_g, with_h ? &h_g : nullptr, chunk, dhn, dw, acc);
      expect_rel(dhn, dhn_want, kBf16Out, "dhn_" + tag);  // dlogits and dhn each rounded to bf16 once
      expect_rel(dw, dw_want, kBf16Out, "dw_" + tag);     // dlogits rounded to bf16
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLmHeadObjective,
                         ::testing::Values(LmHeadObjectiveCase{300, 64, 1000, 128, 0},   // chunks 128, 128, 44
                                           LmHeadObjectiveCase{300, 64, 1000, 25, 70},   // 5 groups of 3 chunks
                                           LmHeadObjectiveCase{301, 40, 999, 25, 70},    // odd V (scalar path), groups
                                           LmHeadObjectiveCase{33, 40, 999, 5, 0},       // odd V and D, one group
                                           LmHeadObjectiveCase{64, 256, 151936, 0, 0}),  // the real vocabulary
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_V" + std::to_string(info.param.V) + "_chunk" +
                                  std::to_string(info.param.chunk) + "_group" + std::to_string(info.param.group_rows);
                         });

// With g = -scale and no entropy term the objective's gradients are lm_head_cross_entropy's: on the GPU
// the same row kernel arithmetic and the same GEMMs. Expected 0; the tolerance only allows for the
// compiler contracting the label term into an FMA differently in the two instantiations (a 1-ulp f32
// change that flips a few bf16 roundings of dlogits), far below a wrong sign or term (order 1).
TEST(CudaLmHeadObjective, MinusScaleWithoutEntropyIsTheCrossEntropyGradient) {
  MT_REQUIRE_GPU();
  const int64_t T = 100, D = 48, V = 1000;
  Rng rng(111);
  const Tensor hn = to_cuda(rand_bf16_exact({T, D}, rng), DType::BF16);
  const Tensor w = to_cuda(rand_bf16_exact({V, D}, rng, 0.15f), DType::BF16);
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t % 9 == 4 ? -100 : rng.randint(0, V);
  const float scale = 1.0f / 89.0f;
  Tensor loss = Tensor::zeros({1}, DType::F32, Device::CUDA), dhn_ce = cuda_filled({T, D}, DType::BF16, kNaN),
         dw_ce = cuda_filled({V, D}, DType::F32, kNaN);
  cuda::lm_head_cross_entropy(hn, w, to_dev(labels), scale, 30, loss, dhn_ce, dw_ce, false);
  Tensor dhn = cuda_filled({T, D}, DType::BF16, kNaN), dw = cuda_filled({V, D}, DType::F32, kNaN);
  cuda::lm_head_objective_bwd(hn, w, to_dev(labels), to_cuda(filled({T}, -scale), DType::F32), nullptr, 30, dhn, dw,
                              false);
  expect_rel(dhn, dhn_ce, 1e-3, "dhn_vs_ce");
  expect_rel(dw, dw_ce, 1e-3, "dw_vs_ce");
}

// A bad label makes its row's outputs NaN and is reported, naming the op that found it, by the next
// call of any of the LM-head ops.
TEST(CudaLmHeadObjectiveLabels, OutOfRangeLabelPoisonsItsRowAndIsReportedByTheNextCall) {
  MT_REQUIRE_GPU();
  const int64_t T = 20, D = 16, V = 1000;
  Rng rng(112);
  const Tensor hn = to_cuda(rand_bf16_exact({T, D}, rng), DType::BF16);
  const Tensor w = to_cuda(rand_bf16_exact({V, D}, rng, 0.25f), DType::BF16);
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t;
  labels.data<int64_t>()[5] = V;
  Tensor logp = cuda_filled({T}, DType::F32, 0.0f), ent = cuda_filled({T}, DType::F32, 0.0f);
  cuda::lm_head_logprobs(hn, w, to_dev(labels), 0, logp, &ent);
  const Tensor logp_h = to_host_f32(logp), ent_h = to_host_f32(ent);  // reading waits for the device
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::isnan(logp_h.data<float>()[t]), t == 5) << t;
    EXPECT_EQ(std::isnan(ent_h.data<float>()[t]), t == 5) << t;
  }
  labels.data<int64_t>()[5] = 5;
  const Tensor g = to_cuda(filled({T}, 1.0f), DType::F32);
  Tensor dhn = Tensor::empty({T, D}, DType::BF16, Device::CUDA), dw = Tensor::zeros({V, D}, DType::F32, Device::CUDA);
  std::string msg;
  try {
    cuda::lm_head_objective_bwd(hn, w, to_dev(labels), g, nullptr, 0, dhn, dw);
    ADD_FAILURE() << "expected the earlier bad label to be reported";
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("lm_head_objective_bwd: label 1000 at row 5 (of an earlier lm_head_logprobs call"),
            std::string::npos)
      << msg;

  labels.data<int64_t>()[7] = -3;
  cuda::lm_head_objective_bwd(hn, w, to_dev(labels), g, &g, 0, dhn, dw);
  const Tensor dhn_h = to_host_f32(dhn);
  for (int64_t t = 0; t < T; ++t) EXPECT_EQ(std::isnan(dhn_h.data<float>()[t * D]), t == 7) << t;
  labels.data<int64_t>()[7] = 7;
  msg.clear();
  try {
    cuda::lm_head_logprobs(hn, w, to_dev(labels), 0, logp, nullptr);
    ADD_FAILURE() << "expected the earlier bad label to be reported";
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("lm_head_logprobs: label -3 at row 7 (of an earlier lm_head_objective_bwd call"),
            std::string::npos)
      << msg;
  Tensor logp2 = cuda_filled({T}, DType::F32, kNaN);
  cuda::lm_head_logprobs(hn, w, to_dev(labels), 0, logp2, nullptr);
  EXPECT_TRUE(cpu::all_finite(to_host_f32(logp2)));
}

// ---------------------------------------------------------------------------------------------
// Parameter gradients written with = (accumulate_dw false, the first micro-batch of a step): the
// gradient buffers are pre-filled with NaN, so any element the op leaves unwritten or reads fails.

TEST(CudaOverwriteGrads, LinearRmsNormAndEmbeddingWriteTheirGradients) {
  MT_REQUIRE_GPU();
  Rng rng(91);
  const int64_t T = 300, I = 128, O = 96, V = 50;
  const Tensor x = rand_bf16_exact({T, I}, rng), w = rand_bf16_exact({O, I}, rng, 0.05f),
               dy = rand_bf16_exact({T, O}, rng);
  Tensor dx_want = Tensor::empty({T, I}), dw_want = Tensor::zeros({O, I});
  cpu::linear_bwd(dy, x, w, &dx_want, false, dw_want);
  Tensor dx = cuda_filled({T, I}, DType::BF16, kNaN), dw = cuda_filled({O, I}, DType::F32, kNaN);
  cuda::linear_bwd(to_cuda(dy, DType::BF16), to_cuda(x, DType::BF16), to_cuda(w, DType::BF16), &dx, false, dw, false);
  expect_rel(dw, dw_want, kF32Gemm, "linear_dw");

  const Tensor wn = rand_bf16_exact({I}, rng), dyn = rand_bf16_exact({T, I}, rng);
  Tensor yn = Tensor::empty({T, I}), rstd = Tensor::empty({T});
  cpu::rms_norm_fwd(x, wn, 1e-6f, yn, rstd);
  Tensor dxn_want = Tensor::empty({T, I}), dwn_want = Tensor::zeros({I});
  cpu::rms_norm_bwd(dyn, x, wn, rstd, dxn_want, dwn_want);
  Tensor dxn = cuda_filled({T, I}, DType::BF16, kNaN), dwn = cuda_filled({I}, DType::F32, kNaN);
  cuda::rms_norm_bwd(to_cuda(dyn, DType::BF16), to_cuda(x, DType::BF16), to_cuda(wn, DType::F32),
                     rstd.to(Device::CUDA), dxn, dwn, false);
  expect_rel(dwn, dwn_want, 1e-5, "rms_norm_dw");

  // Ids from [0, V/2): the other rows must come back 0, not NaN.
  Tensor ids = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) ids.data<int64_t>()[t] = rng.randint(0, V / 2);
  const Tensor dout = rand_bf16_exact({T, I}, rng);
  Tensor dtable_want = Tensor::zeros({V, I});
  cpu::embedding_bwd(ids, dout, dtable_want);
  Tensor dtable = cuda_filled({V, I}, DType::F32, kNaN);
  cuda::embedding_bwd(to_dev(ids), to_cuda(dout, DType::BF16), dtable, false);
  expect_rel(dtable, dtable_want, 1e-5, "embedding_dtable");
}

TEST(CudaOverwriteGrads, GroupedExpertsWriteEveryExpertIncludingOnesWithoutRows) {
  MT_REQUIRE_GPU();
  const int64_t E = 8, K = 2, D = 64, F = 32, T = 64, R = T * K;
  Rng rng(92);
  const Tensor idx = random_topk(T, K, E, rng, 3);  // expert 3 gets no rows
  const Plan plan = cpu_plan(idx, E);
  const Tensor xp = rand_bf16_exact({R, D}, rng), dyp = rand_bf16_exact({R, D}, rng);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 0.1f), wd = rand_bf16_exact({E, D, F}, rng, 0.1f);
  Tensor gu = Tensor::empty({R, 2 * F}), h = Tensor::empty({R, F}), yp = Tensor::empty({R, D});
  cpu::experts_fwd(xp, plan.offsets, wgu, wd, gu, h, yp);
  Tensor dxp_want = Tensor::empty({R, D}), dwgu_want = Tensor::zeros({E, 2 * F, D}),
         dwd_want = Tensor::zeros({E, D, F});
  cpu::experts_bwd(dyp, xp, plan.offsets, wgu, wd, gu, h, dxp_want, dwgu_want, dwd_want);
  const Tensor xpc = to_cuda(xp, DType::BF16), wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);
  Tensor guc = cuda_filled({R, 2 * F}, DType::BF16, kNaN), hc = cuda_filled({R, F}, DType::BF16, kNaN),
         ypc = cuda_filled({R, D}, DType::BF16, kNaN);
  cuda::experts_fwd(xpc, to_dev(plan.offsets), wguc, wdc, guc, hc, ypc);
  Tensor dxp = cuda_filled({R, D}, DType::BF16, kNaN), dwgu = cuda_filled({E, 2 * F, D}, DType::F32, kNaN),
         dwd = cuda_filled({E, D, F}, DType::F32, kNaN);
  cuda::experts_bwd(to_cuda(dyp, DType::BF16), xpc, to_dev(plan.offsets), wguc, wdc, guc, hc, dxp, dwgu, dwd, false);
  expect_rel(dwgu, dwgu_want, kBf16Out, "dwgu");
  expect_rel(dwd, dwd_want, kBf16Out, "dwd");
  const Tensor dwd_host = to_host_f32(dwd);
  for (int64_t i = 0; i < D * F; ++i) ASSERT_EQ(dwd_host.data<float>()[3 * D * F + i], 0.0f) << i;

  // No rows at all: both gradients become 0.
  Tensor off0 = Tensor::zeros({E + 1}, DType::I64);
  Tensor empty_bf16 = Tensor::empty({0, D}, DType::BF16, Device::CUDA);
  Tensor dwd2 = cuda_filled({E, D, F}, DType::F32, kNaN), dwgu2 = cuda_filled({E, 2 * F, D}, DType::F32, kNaN);
  Tensor dxp0 = Tensor::empty({0, D}, DType::BF16, Device::CUDA);
  cuda::experts_bwd(empty_bf16, empty_bf16, to_dev(off0), wguc, wdc,
                    Tensor::empty({0, 2 * F}, DType::BF16, Device::CUDA),
                    Tensor::empty({0, F}, DType::BF16, Device::CUDA), dxp0, dwgu2, dwd2, false);
  expect_rel(dwgu2, Tensor::zeros({E, 2 * F, D}), 0.0, "dwgu_no_rows");
  expect_rel(dwd2, Tensor::zeros({E, D, F}), 0.0, "dwd_no_rows");
}

// Several row groups (MOETRAIN_LM_HEAD_GROUP_ROWS), each with several chunks and a partial one, for
// both gradient contracts.
TEST(CudaOverwriteGrads, LmHeadOverSeveralGroupsMatchesCpuForBothContracts) {
  MT_REQUIRE_GPU();
  const int64_t T = 300, D = 64, V = 1000;
  Rng rng(93);
  const Tensor hn = rand_bf16_exact({T, D}, rng), w = rand_bf16_exact({V, D}, rng, 0.125f);
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = t % 5 == 1 ? -100 : rng.randint(0, V);
  const float scale = 1.0f / 240.0f;
  const Tensor dw0 = rand_bf16_exact({V, D}, rng, 1e-3f);
  const cudatest::EnvGuard env("MOETRAIN_LM_HEAD_GROUP_ROWS", "70");  // 5 groups of 60 rows, chunks of 25 (3 per group)
  for (bool acc : {true, false}) {
    SCOPED_TRACE(acc ? "dw +=" : "dw =");
    Tensor loss_want = filled({1}, 0.0f), dhn_want = Tensor::empty({T, D}),
           dw_want = acc ? dw0.clone() : Tensor::zeros({V, D});
    cpu::lm_head_cross_entropy(hn, w, labels, scale, 25, loss_want, dhn_want, dw_want);
    Tensor loss = cuda_filled({1}, DType::F32, 0.0f), dhn = cuda_filled({T, D}, DType::BF16, kNaN),
           dw = acc ? to_cuda(dw0, DType::F32) : cuda_filled({V, D}, DType::F32, kNaN);
    cuda::lm_head_cross_entropy(to_cuda(hn, DType::BF16), to_cuda(w, DType::BF16), to_dev(labels), scale, 25, loss, dhn,
                                dw, acc);
    expect_rel(loss, loss_want, 1e-4, acc ? "loss_acc" : "loss_set");
    expect_rel(dhn, dhn_want, kBf16Out, acc ? "dhn_acc" : "dhn_set");
    expect_rel(dw, dw_want, kBf16Out, acc ? "dw_acc" : "dw_set");
  }
}

}  // namespace
