// CUDA vs CPU tests of the row-wise and elementwise ops: embedding, RMSNorm, RoPE, SwiGLU, router and
// aux loss, cross-entropy, AdamW and the gradient utilities. Inputs are bf16-exact, so both backends
// see the same values; each test names its tolerance and why:
//   - bf16 outputs computed in f32 from identical inputs carry one bf16 rounding: relative error up to
//     2^-8 per element, a relative L2 of about 1.5e-3 over many elements; kBf16Out = 5e-3 leaves 3x;
//   - f32 outputs whose GPU arithmetic is f32 where the CPU's is fp64: 1e-6..1e-4 by the length of the
//     sums involved (stated at each use);
//   - ops written to repeat the CPU's f32 operations (AdamW, scale_, add_, copy_cast) are compared exactly.
// The ops that an f32 residual stream touches (embedding, RMSNorm's x and dx, add_ of a bf16 branch into
// f32) are tested with bf16 and f32 on the residual side; there the f32 inputs are full-precision f32
// (not bf16-exact), as the residual is, and CudaF32Residual chains them as the model does.
// Realistic sizes (T = 4096 rows, D = 2048, E = 128, V = 151936) exercise the launch configurations;
// odd sizes exercise the scalar paths and tails. Outputs with "=" contracts are pre-filled with NaN
// (rel_l2 fails on any NaN left behind); "+=" outputs are pre-filled with random values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::cuda_filled;
using cudatest::randn;
using cudatest::to_host_f32;

namespace {

constexpr double kBf16Out = 5e-3;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();



Tensor random_ids(int64_t T, int64_t V, Rng& rng) {
  Tensor t = Tensor::empty({T}, DType::I64);
  for (int64_t i = 0; i < T; ++i) t.data<int64_t>()[i] = rng.randint(0, V);
  return t;
}

// The f32 values of t rounded to bf16 (what a bf16 output of an exact f32 computation must equal).
Tensor bf16_rounded(const Tensor& cpu_f32) {
  return cpu_f32.to(DType::BF16).to(DType::F32);
}

}  // namespace

// ---------------------------------------------------------------- embedding

TEST(CudaEmbedding, ForwardIsAnExactGather) {
  MT_REQUIRE_GPU();
  Rng rng(1);
  struct Case {
    int64_t V, D, T;
  };
  for (Case c : {Case{1000, 2048, 4096}, Case{37, 7, 101}, Case{50, 64, 33}}) {
    SCOPED_TRACE(str("V=", c.V, " D=", c.D, " T=", c.T));
    Tensor table = rand_bf16_exact({c.V, c.D}, rng), ids = random_ids(c.T, c.V, rng), out = Tensor::empty({c.T, c.D});
    cpu::embedding_fwd(ids, table, out);
    // A bf16 value is exactly an f32 one, so both output dtypes are exact copies of the table rows.
    for (DType dt : {DType::BF16, DType::F32}) {
      Tensor out_g = cuda_filled({c.T, c.D}, dt, kNaN);
      cuda::embedding_fwd(ids.to(Device::CUDA), to_cuda(table, DType::BF16), out_g);
      EXPECT_EQ(rel_l2(out_g, out), 0.0) << dtype_name(dt);
    }
  }
}

TEST(CudaEmbedding, BackwardAccumulatesRepeatedIds) {
  MT_REQUIRE_GPU();
  Rng rng(2);
  struct Case {
    int64_t V, D, T;
  };
  // Few ids for many tokens, so each table row sums ~80 token rows in an order the atomics choose:
  // f32 sums of that length differ from the CPU's sequential f32 sums by ~1e-7 relative; 1e-5 allows it.
  // The same holds for f32 row gradients (full-precision values, as an f32 residual gradient is).
  for (Case c : {Case{50, 2048, 4096}, Case{13, 7, 257}, Case{21, 6, 99}}) {
    for (DType dt : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(str("V=", c.V, " D=", c.D, " T=", c.T, " dout ", dtype_name(dt)));
      Tensor ids = random_ids(c.T, c.V, rng), dtable = randn({c.V, c.D}, rng);
      Tensor dout = dt == DType::BF16 ? rand_bf16_exact({c.T, c.D}, rng) : randn({c.T, c.D}, rng);
      Tensor dtable_g = dtable.to(Device::CUDA);
      cpu::embedding_bwd(ids, dout, dtable);
      cuda::embedding_bwd(ids.to(Device::CUDA), to_cuda(dout, dt), dtable_g);
      EXPECT_LT(rel_l2(dtable_g, dtable), 1e-5);
    }
  }
}

TEST(CudaEmbedding, OutOfRangeIdGivesZeroRowAndNoGradient) {
  MT_REQUIRE_GPU();
  Rng rng(3);
  const int64_t V = 8, D = 16;
  Tensor table = rand_bf16_exact({V, D}, rng);
  Tensor ids = Tensor::empty({3}, DType::I64);
  ids.data<int64_t>()[0] = 2;
  ids.data<int64_t>()[1] = V;
  ids.data<int64_t>()[2] = -1;
  Tensor out_g = cuda_filled({3, D}, DType::BF16, kNaN);
  cuda::embedding_fwd(ids.to(Device::CUDA), to_cuda(table, DType::BF16), out_g);
  Tensor out = to_host_f32(out_g);
  for (int64_t d = 0; d < D; ++d) {
    EXPECT_EQ(out.data<float>()[d], table.data<float>()[2 * D + d]);
    EXPECT_EQ(out.data<float>()[D + d], 0.0f);
    EXPECT_EQ(out.data<float>()[2 * D + d], 0.0f);
  }
  Tensor out32_g = cuda_filled({3, D}, DType::F32, kNaN);
  cuda::embedding_fwd(ids.to(Device::CUDA), to_cuda(table, DType::BF16), out32_g);
  EXPECT_EQ(rel_l2(out32_g, out), 0.0);
  for (DType dt : {DType::BF16, DType::F32}) {
    Tensor dtable_g = Tensor::zeros({V, D}, DType::F32, Device::CUDA);
    cuda::embedding_bwd(ids.to(Device::CUDA), cuda_filled({3, D}, dt, 1.0f), dtable_g);
    Tensor dtable = to_host_f32(dtable_g);
    double total = 0;
    for (int64_t i = 0; i < V * D; ++i) total += dtable.data<float>()[i];
    EXPECT_EQ(total, double(D)) << dtype_name(dt);  // only the valid id's row, once
  }
  Tensor bad = Tensor::zeros({3, D}, DType::I32, Device::CUDA);
  std::string msg = error_of([&] { cuda::embedding_fwd(ids.to(Device::CUDA), to_cuda(table, DType::BF16), bad); });
  EXPECT_NE(msg.find("embedding_fwd out_TD has dtype i32, expected bf16 or f32"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- RMSNorm

namespace {
struct NormCase {
  int64_t N, D;
};
// Per-head norms (D = 16 and 128 over T*H rows), the hidden norm (D = 2048), and odd shapes for the
// scalar path and partial blocks.
const NormCase kNormCases[] = {{16384, 16}, {4096 * 4, 128}, {4096, 2048}, {1001, 7}, {37, 128}, {3, 2048}};
}  // namespace

TEST(CudaRmsNorm, ForwardMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(4);
  const float eps = 1e-6f;
  for (NormCase c : kNormCases) {
    for (DType xdt : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(str("N=", c.N, " D=", c.D, " x ", dtype_name(xdt)));
      // f32 x is full-precision f32, as the residual stream is.
      Tensor x = xdt == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      // The gain is an f32 master weight: full f32 precision, not bf16-representable.
      Tensor w = randn({c.D}, rng);
      Tensor y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
      cpu::rms_norm_fwd(x, w, eps, y, rstd);
      Tensor y_g = cuda_filled({c.N, c.D}, DType::BF16, kNaN), rstd_g = cuda_filled({c.N}, DType::F32, kNaN);
      cuda::rms_norm_fwd(to_cuda(x, xdt), w.to(Device::CUDA), eps, y_g, rstd_g);
      EXPECT_LT(rel_l2(y_g, y), kBf16Out);
      // f32 sum of squares (at most 64 terms per lane, then a tree) against the CPU's fp64 sum; with f32 x
      // each square also rounds (2^-24 relative), which changes nothing at this scale.
      EXPECT_LT(rel_l2(rstd_g, rstd), 1e-5);
    }
  }
}

TEST(CudaRmsNorm, BackwardMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(5);
  const float eps = 1e-6f;
  struct Dtypes {
    DType x, dx, dy;
  };
  // x f32 with dx f32 and dy f32 is the residual stream's norm (dy summed in f32 from several GEMMs),
  // bf16 throughout the per-head norms; the mixed combinations are allowed too.
  const Dtypes kDtypes[] = {{DType::BF16, DType::BF16, DType::BF16}, {DType::F32, DType::F32, DType::F32},
                            {DType::F32, DType::F32, DType::BF16},   {DType::BF16, DType::F32, DType::BF16},
                            {DType::F32, DType::BF16, DType::BF16},  {DType::BF16, DType::BF16, DType::F32}};
  for (NormCase c : kNormCases) {
    for (Dtypes dt : kDtypes) {
      SCOPED_TRACE(str("N=", c.N, " D=", c.D, " x ", dtype_name(dt.x), " dx ", dtype_name(dt.dx), " dy ",
                       dtype_name(dt.dy)));
      Tensor x = dt.x == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      Tensor w = randn({c.D}, rng);
      Tensor dy = dt.dy == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      Tensor y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
      cpu::rms_norm_fwd(x, w, eps, y, rstd);
      Tensor dx = Tensor::empty({c.N, c.D}), dw = randn({c.D}, rng);
      Tensor dw_g = dw.to(Device::CUDA), dx_g = cuda_filled({c.N, c.D}, dt.dx, kNaN);
      cpu::rms_norm_bwd(dy, x, w, rstd, dx, dw);
      // Both backends use the CPU's rstd and the same dy and w (exactly representable in the CUDA dtypes),
      // so only the backward's arithmetic differs.
      cuda::rms_norm_bwd(to_cuda(dy, dt.dy), to_cuda(x, dt.x), w.to(Device::CUDA), rstd.to(Device::CUDA), dx_g, dw_g);
      // bf16 dx: one rounding. f32 dx: dx = r * (dy*w - xn*mean(dy*w*xn)) with dy*w exact in f32 and each
      // other step one f32 rounding (2^-24 relative); the mean is an f32 sum of D terms whose error enters
      // dx scaled by |xn| * (its 1/D share), against the CPU's fp64. That is a few 1e-7 relative; 1e-5
      // leaves more than 10x yet is far below what a wrong term gives (order 1) or a bf16 rounding (1e-3).
      EXPECT_LT(rel_l2(dx_g, dx), dt.dx == DType::BF16 ? kBf16Out : 1e-5);
      // dw sums up to 16384 rows in f32 (per block, then atomics) against the CPU's fp64 sum.
      EXPECT_LT(rel_l2(dw_g, dw), 1e-4);
    }
  }
}

TEST(CudaRmsNorm, EmptyRowsAndArgumentErrors) {
  MT_REQUIRE_GPU();
  Tensor x = Tensor::zeros({0, 16}, DType::BF16, Device::CUDA), w = Tensor::zeros({16}, DType::F32, Device::CUDA);
  Tensor y = Tensor::zeros({0, 16}, DType::BF16, Device::CUDA), rstd = Tensor::zeros({0}, DType::F32, Device::CUDA);
  cuda::rms_norm_fwd(x, w, 1e-6f, y, rstd);
  Tensor dw = Tensor::zeros({16}, DType::F32, Device::CUDA);
  cuda::rms_norm_bwd(y, x, w, rstd, y, dw);
  Tensor x0f = Tensor::zeros({0, 16}, DType::F32, Device::CUDA);
  cuda::rms_norm_fwd(x0f, w, 1e-6f, y, rstd);
  cuda::rms_norm_bwd(y, x0f, w, rstd, x0f, dw);
  Tensor xi = Tensor::zeros({2, 16}, DType::I32, Device::CUDA), rstd2 = Tensor::zeros({2}, DType::F32, Device::CUDA);
  Tensor y2 = Tensor::zeros({2, 16}, DType::BF16, Device::CUDA);
  std::string msg = error_of([&] { cuda::rms_norm_fwd(xi, w, 1e-6f, y2, rstd2); });
  EXPECT_NE(msg.find("rms_norm_fwd x_ND has dtype i32, expected bf16 or f32"), std::string::npos) << msg;
  Tensor x2 = Tensor::zeros({2, 16}, DType::BF16, Device::CUDA), w8 = Tensor::zeros({8}, DType::F32, Device::CUDA);
  Tensor y32 = Tensor::zeros({2, 16}, DType::F32, Device::CUDA), dw16 = Tensor::zeros({16}, DType::F32, Device::CUDA);
  msg = error_of([&] { cuda::rms_norm_fwd(x2, w, 1e-6f, y32, rstd2); });  // y stays bf16
  EXPECT_NE(msg.find("rms_norm_fwd y_ND has dtype f32, expected bf16"), std::string::npos) << msg;
  Tensor w16 = Tensor::zeros({16}, DType::BF16, Device::CUDA);  // a bf16 copy of the gain is refused
  msg = error_of([&] { cuda::rms_norm_fwd(x2, w16, 1e-6f, y2, rstd2); });
  EXPECT_NE(msg.find("rms_norm_fwd w_D must be f32 (the gain is read from the fp32 master weights)"),
            std::string::npos)
      << msg;
  msg = error_of([&] { cuda::rms_norm_fwd(x2, w8, 1e-6f, y2, rstd2); });
  EXPECT_NE(msg.find("rms_norm_fwd w_D has shape [8], expected [16]"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- f32 residual stream

// The residual stream as the model keeps it with fp32-master + bf16-autocast numerics: h = embed[ids] in
// f32, h += a bf16 branch output (add_ mixed), n = rms_norm(h) in bf16; backward dx = rms_norm_bwd into
// f32, plus a bf16 branch gradient, then into the embedding's f32 gradient. Every f32 step repeats the
// CPU's f32 operations or differs from its fp64 ones by ~1e-7, so h is exact, the bf16 y is the CPU's y
// within one bf16 rounding element by element, and the f32 gradients are within 1e-5.
TEST(CudaF32Residual, EmbedAddNormRoundTripMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(18);
  const float eps = 1e-6f;
  struct Case {
    int64_t V, D, T;
  };
  // D = 2048: the vector paths; D = 100: f32 rows take 4-wide accesses where bf16 rows could not take 8;
  // D = 7: the scalar paths.
  for (Case c : {Case{1000, 2048, 4096}, Case{64, 100, 300}, Case{9, 7, 33}}) {
    SCOPED_TRACE(str("V=", c.V, " D=", c.D, " T=", c.T));
    const Tensor ids = random_ids(c.T, c.V, rng), table = rand_bf16_exact({c.V, c.D}, rng, 0.5f);
    const Tensor branch = rand_bf16_exact({c.T, c.D}, rng), w = rand_bf16_exact({c.D}, rng);
    const Tensor ids_g = ids.to(Device::CUDA);

    Tensor h = Tensor::empty({c.T, c.D}), y = Tensor::empty({c.T, c.D}), rstd = Tensor::empty({c.T});
    cpu::embedding_fwd(ids, table, h);
    cpu::add_(h, branch, 1.0f);
    cpu::rms_norm_fwd(h, w, eps, y, rstd);

    Tensor h_g = cuda_filled({c.T, c.D}, DType::F32, kNaN);
    cuda::embedding_fwd(ids_g, to_cuda(table, DType::BF16), h_g);
    cuda::add_(h_g, to_cuda(branch, DType::BF16), 1.0f);
    EXPECT_EQ(rel_l2(h_g, h), 0.0) << "h";
    Tensor y_g = cuda_filled({c.T, c.D}, DType::BF16, kNaN), rstd_g = cuda_filled({c.T}, DType::F32, kNaN);
    cuda::rms_norm_fwd(h_g, to_cuda(w, DType::F32), eps, y_g, rstd_g);
    EXPECT_LT(rel_l2(rstd_g, rstd), 1e-5);
    // Round-to-nearest moves a value by at most half a bf16 ulp, 2^-8 of its magnitude; the f32 value
    // before rounding differs from the CPU's only through rstd (~1e-7 relative).
    const Tensor got = to_host_f32(y_g);
    int64_t outside = 0, first = -1;
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double want = y.data<float>()[i];
      if (!(std::abs(double(got.data<float>()[i]) - want) <= (std::ldexp(1.0, -8) + 1e-5) * std::abs(want)) &&
          outside++ == 0)
        first = i;
    }
    EXPECT_EQ(outside, 0) << "first at " << first << ": " << got.data<float>()[first] << " vs "
                          << y.data<float>()[first];

    // Backward: the norm's dx (f32, from a bf16 dy) plus a bf16 branch gradient, into the table gradient.
    const Tensor dy = rand_bf16_exact({c.T, c.D}, rng), dbranch = rand_bf16_exact({c.T, c.D}, rng);
    Tensor dh = Tensor::empty({c.T, c.D}), dw = Tensor::zeros({c.D}), dtable = Tensor::zeros({c.V, c.D});
    cpu::rms_norm_bwd(dy, h, w, rstd, dh, dw);
    cpu::add_(dh, dbranch, 1.0f);
    cpu::embedding_bwd(ids, dh, dtable);

    Tensor dh_g = cuda_filled({c.T, c.D}, DType::F32, kNaN), dw_g = Tensor::zeros({c.D}, DType::F32, Device::CUDA);
    Tensor dtable_g = Tensor::zeros({c.V, c.D}, DType::F32, Device::CUDA);
    cuda::rms_norm_bwd(to_cuda(dy, DType::BF16), h_g, to_cuda(w, DType::F32), rstd_g, dh_g, dw_g);
    cuda::add_(dh_g, to_cuda(dbranch, DType::BF16), 1.0f);
    cuda::embedding_bwd(ids_g, dh_g, dtable_g);
    // The GPU's own rstd (as in the model) adds its ~1e-7 to the backward's f32 error (see BackwardMatchesCpu).
    EXPECT_LT(rel_l2(dh_g, dh), 1e-5) << "dh";
    EXPECT_LT(rel_l2(dw_g, dw), 1e-4) << "dw";
    EXPECT_LT(rel_l2(dtable_g, dtable), 1e-5) << "dtable";
  }
}

// ---------------------------------------------------------------- RoPE

TEST(CudaRope, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(6);
  struct Case {
    int64_t T, N, Hd;
    float theta;
    bool sequential;
  };
  for (Case c : {Case{4096, 32, 128, 1e6f, true}, Case{37, 3, 16, 1e4f, false}, Case{5, 2, 6, 10.0f, false}}) {
    SCOPED_TRACE(str("T=", c.T, " N=", c.N, " Hd=", c.Hd, " theta=", c.theta));
    Tensor pos = Tensor::empty({c.T}, DType::I32);
    for (int64_t t = 0; t < c.T; ++t)
      pos.data<int32_t>()[t] = c.sequential ? int32_t(t) : int32_t(rng.randint(0, 40000));
    Tensor pos_g = pos.to(Device::CUDA);
    for (bool fwd : {true, false}) {
      Tensor x = rand_bf16_exact({c.T, c.N, c.Hd}, rng);
      Tensor x_g = to_cuda(x, DType::BF16);
      if (fwd) {
        cpu::rope_fwd(x, pos, c.theta);
        cuda::rope_fwd(x_g, pos_g, c.theta);
      } else {
        cpu::rope_bwd(x, pos, c.theta);
        cuda::rope_bwd(x_g, pos_g, c.theta);
      }
      EXPECT_LT(rel_l2(x_g, x), kBf16Out) << (fwd ? "forward" : "backward");
      // Same inv_freq, f32 angle and rotation order as the CPU: the bf16 result is the CPU's f32 result
      // rounded, except where cosf/sinf's last bit moves a value across a rounding boundary (~1e-5 of
      // elements). A differently computed angle (e.g. in fp64: ~2e-4 rad off at position 4096) would
      // move several percent of them.
      Tensor got = to_host_f32(x_g), want = bf16_rounded(x);
      int64_t differ = 0;
      for (int64_t i = 0; i < got.numel(); ++i) differ += got.data<float>()[i] != want.data<float>()[i];
      EXPECT_LE(double(differ), 1e-3 * double(got.numel())) << differ << " of " << got.numel();
    }
  }
}

// ---------------------------------------------------------------- SwiGLU

TEST(CudaSwiglu, ForwardAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(7);
  struct Case {
    int64_t N, F;
  };
  for (Case c : {Case{4096, 768}, Case{37, 13}, Case{3, 8}}) {
    SCOPED_TRACE(str("N=", c.N, " F=", c.F));
    Tensor gu = rand_bf16_exact({c.N, 2 * c.F}, rng, 2.0f), dh = rand_bf16_exact({c.N, c.F}, rng);
    Tensor h = Tensor::empty({c.N, c.F}), dgu = Tensor::empty({c.N, 2 * c.F});
    cpu::swiglu_fwd(gu, h);
    cpu::swiglu_bwd(dh, gu, dgu);
    Tensor gu_g = to_cuda(gu, DType::BF16);
    Tensor h_g = cuda_filled({c.N, c.F}, DType::BF16, kNaN), dgu_g = cuda_filled({c.N, 2 * c.F}, DType::BF16, kNaN);
    cuda::swiglu_fwd(gu_g, h_g);
    cuda::swiglu_bwd(to_cuda(dh, DType::BF16), gu_g, dgu_g);
    EXPECT_LT(rel_l2(h_g, h), kBf16Out);
    EXPECT_LT(rel_l2(dgu_g, dgu), kBf16Out);
  }
}

// ---------------------------------------------------------------- router and aux loss

namespace {
struct RouterCase {
  int64_t T, E, K;
};
const RouterCase kRouterCases[] = {{4096, 128, 8}, {37, 8, 2}, {4096, 8, 2}};

// Logits scaled by 4 so that neighbouring probabilities are far apart compared with an f32 ulp: the
// top-k must then agree exactly.
Tensor router_logits(int64_t T, int64_t E, Rng& rng) {
  return randn({T, E}, rng, 4.0f);
}
}  // namespace

TEST(CudaRouter, ForwardMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(8);
  for (RouterCase c : kRouterCases) {
    for (bool norm : {false, true}) {
      SCOPED_TRACE(str("T=", c.T, " E=", c.E, " K=", c.K, " norm_topk=", norm));
      Tensor logits = router_logits(c.T, c.E, rng);
      Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
             w = Tensor::empty({c.T, c.K});
      cpu::router_fwd(logits, c.K, norm, probs, idx, w);
      Tensor probs_g = cuda_filled({c.T, c.E}, DType::F32, kNaN), w_g = cuda_filled({c.T, c.K}, DType::F32, kNaN);
      Tensor idx_g = Tensor::empty({c.T, c.K}, DType::I32, Device::CUDA);
      cuda::router_fwd(logits.to(Device::CUDA), c.K, norm, probs_g, idx_g, w_g);
      // fp64 exponentials and sums on both sides: equal up to the order of the fp64 sum.
      EXPECT_LT(rel_l2(probs_g, probs), 1e-6);
      EXPECT_LT(rel_l2(w_g, w), 1e-6);
      Tensor idx_h = idx_g.to(Device::CPU);
      int64_t differ = 0;
      for (int64_t i = 0; i < idx.numel(); ++i) differ += idx_h.data<int32_t>()[i] != idx.data<int32_t>()[i];
      EXPECT_EQ(differ, 0);
    }
  }
}

TEST(CudaRouter, TiesGoToTheLowerExpertId) {
  MT_REQUIRE_GPU();
  const int64_t E = 40, K = 3;  // E > 32: ties across lanes and across a lane's elements
  Tensor logits = Tensor::zeros({3, E});
  float* l = logits.data<float>();
  l[E + 35] = 1.0f;  // row 1: one winner above the lane boundary, then a tie of everything else
  l[2 * E + 33] = 2.0f;
  l[2 * E + 1] = 2.0f;
  l[2 * E + 39] = 1.0f;
  l[2 * E + 7] = 1.0f;
  Tensor probs = Tensor::empty({3, E}), idx = Tensor::empty({3, K}, DType::I32), w = Tensor::empty({3, K});
  cpu::router_fwd(logits, K, true, probs, idx, w);
  Tensor probs_g = Tensor::empty({3, E}, DType::F32, Device::CUDA),
         idx_g = Tensor::empty({3, K}, DType::I32, Device::CUDA);
  Tensor w_g = Tensor::empty({3, K}, DType::F32, Device::CUDA);
  cuda::router_fwd(logits.to(Device::CUDA), K, true, probs_g, idx_g, w_g);
  Tensor idx_h = idx_g.to(Device::CPU);
  const int32_t want[3][K] = {{0, 1, 2}, {35, 0, 1}, {1, 33, 7}};
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(idx.data<int32_t>()[t * K + k], want[t][k]) << "cpu t=" << t << " k=" << k;
      EXPECT_EQ(idx_h.data<int32_t>()[t * K + k], want[t][k]) << "cuda t=" << t << " k=" << k;
    }
}

TEST(CudaRouter, BackwardMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(9);
  for (RouterCase c : kRouterCases) {
    for (bool norm : {false, true}) {
      for (bool with_dprobs : {false, true}) {
        SCOPED_TRACE(str("T=", c.T, " E=", c.E, " K=", c.K, " norm_topk=", norm, " dprobs=", with_dprobs));
        Tensor logits = router_logits(c.T, c.E, rng);
        Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
               w = Tensor::empty({c.T, c.K});
        cpu::router_fwd(logits, c.K, norm, probs, idx, w);
        Tensor dw = randn({c.T, c.K}, rng), dprobs = randn({c.T, c.E}, rng, 0.1f);
        Tensor dlogits = Tensor::empty({c.T, c.E});
        cpu::router_bwd(dw, with_dprobs ? &dprobs : nullptr, probs, idx, norm, dlogits);
        Tensor dprobs_g = dprobs.to(Device::CUDA), dlogits_g = cuda_filled({c.T, c.E}, DType::F32, kNaN);
        cuda::router_bwd(dw.to(Device::CUDA), with_dprobs ? &dprobs_g : nullptr, probs.to(Device::CUDA),
                         idx.to(Device::CUDA), norm, dlogits_g);
        EXPECT_LT(rel_l2(dlogits_g, dlogits), 1e-6);  // fp64 on both sides
      }
    }
  }
}

TEST(CudaAux, CountsSumsValueAndBackwardMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(10);
  for (RouterCase c : kRouterCases) {
    SCOPED_TRACE(str("T=", c.T, " E=", c.E, " K=", c.K));
    Tensor logits = router_logits(c.T, c.E, rng);
    Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
           w = Tensor::empty({c.T, c.K});
    cpu::router_fwd(logits, c.K, true, probs, idx, w);

    Tensor counts = Tensor::empty({c.E}, DType::I64);
    for (int64_t e = 0; e < c.E; ++e) counts.data<int64_t>()[e] = 3 * e;  // += onto earlier layers' counts
    Tensor counts_g = counts.to(Device::CUDA);
    cpu::expert_counts(idx, c.E, counts);
    cuda::expert_counts(idx.to(Device::CUDA), c.E, counts_g);
    Tensor counts_h = counts_g.to(Device::CPU);
    for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(counts_h.data<int64_t>()[e], counts.data<int64_t>()[e]) << "e=" << e;

    Tensor sums = randn({c.E}, rng), sums_g = sums.to(Device::CUDA);
    cpu::prob_column_sums(probs, sums);
    cuda::prob_column_sums(probs.to(Device::CUDA), sums_g);
    // fp64 per block of 32 rows, then f32 atomics across blocks (~128 adds) against one fp64 sum.
    EXPECT_LT(rel_l2(sums_g, sums), 1e-6);

    // Same counts and sums on both sides: the same fp64 expression in the same order.
    const int64_t N = 2 * c.T;
    const double aux = cpu::aux_loss_value(counts, sums, N);
    EXPECT_DOUBLE_EQ(cuda::aux_loss_value(counts.to(Device::CUDA), sums.to(Device::CUDA), N), aux);

    Tensor dprobs = randn({c.T, c.E}, rng), dprobs_g = dprobs.to(Device::CUDA);
    cpu::aux_loss_bwd(counts, N, 0.37f, dprobs);
    cuda::aux_loss_bwd(counts.to(Device::CUDA), N, 0.37f, dprobs_g);
    EXPECT_EQ(rel_l2(dprobs_g, dprobs), 0.0);  // the same f32 value added to the same f32 values
  }
}

// ---------------------------------------------------------------- cross-entropy

namespace {
Tensor ce_labels(int64_t T, int64_t V, Rng& rng) {
  Tensor labels = random_ids(T, V, rng);
  for (int64_t t = 0; t < T; t += 5) labels.data<int64_t>()[t] = -100;
  return labels;
}
}  // namespace

TEST(CudaCrossEntropy, ForwardAndBackwardMatchCpuWithIgnoredRows) {
  MT_REQUIRE_GPU();
  Rng rng(11);
  struct Case {
    int64_t T, V;
    DType dt;
  };
  for (Case c : {Case{256, 151936, DType::F32}, Case{37, 1001, DType::F32}, Case{64, 151936, DType::BF16},
                 Case{9, 999, DType::BF16}}) {
    SCOPED_TRACE(str("T=", c.T, " V=", c.V, " dtype=", dtype_name(c.dt)));
    Tensor logits = rand_bf16_exact({c.T, c.V}, rng, 2.0f), labels = ce_labels(c.T, c.V, rng);
    Tensor lse = Tensor::empty({c.T});
    int64_t n_valid = -1;
    const double loss = cpu::cross_entropy_fwd(logits, labels, lse, &n_valid);
    Tensor logits_g = to_cuda(logits, c.dt), labels_g = labels.to(Device::CUDA);
    Tensor lse_g = cuda_filled({c.T}, DType::F32, kNaN);
    int64_t n_valid_g = -1;
    const double loss_g = cuda::cross_entropy_fwd(logits_g, labels_g, lse_g, &n_valid_g);
    EXPECT_EQ(n_valid_g, n_valid);
    // f32 online sums of ~300 exponentials per thread against fp64: ~1e-7 relative in lse.
    EXPECT_LT(std::abs(loss_g - loss) / std::abs(loss), 1e-6) << loss_g << " vs " << loss;
    EXPECT_LT(rel_l2(lse_g, lse), 1e-6);

    const float scale = 1.0f / float(n_valid);
    Tensor dlogits = Tensor::empty({c.T, c.V});
    cpu::cross_entropy_bwd(logits, labels, lse, scale, dlogits);
    Tensor dlogits_g = cuda_filled({c.T, c.V}, c.dt, kNaN);
    cuda::cross_entropy_bwd(logits_g, labels_g, lse.to(Device::CUDA), scale, dlogits_g);
    // f32: expf of an f32 difference (within a few ulp of the CPU's fp64 exp); bf16: one rounding.
    EXPECT_LT(rel_l2(dlogits_g, dlogits), c.dt == DType::F32 ? 1e-5 : kBf16Out);
    Tensor d = to_host_f32(dlogits_g);
    for (int64_t t = 0; t < c.T; t += 5)
      for (int64_t j = 0; j < c.V; ++j) ASSERT_EQ(d.data<float>()[t * c.V + j], 0.0f) << "ignored row " << t;
  }
}

TEST(CudaCrossEntropy, AllIgnoredAndBadLabel) {
  MT_REQUIRE_GPU();
  Rng rng(12);
  const int64_t T = 6, V = 1000;
  Tensor logits_g = to_cuda(rand_bf16_exact({T, V}, rng), DType::F32);
  Tensor labels = Tensor::empty({T}, DType::I64);
  for (int64_t t = 0; t < T; ++t) labels.data<int64_t>()[t] = -100;
  Tensor lse_g = Tensor::empty({T}, DType::F32, Device::CUDA);
  int64_t n_valid = -1;
  EXPECT_EQ(cuda::cross_entropy_fwd(logits_g, labels.to(Device::CUDA), lse_g, &n_valid), 0.0);
  EXPECT_EQ(n_valid, 0);

  labels.data<int64_t>()[1] = 7;
  labels.data<int64_t>()[3] = V + 5;
  labels.data<int64_t>()[4] = -3;
  std::string msg = error_of([&] { cuda::cross_entropy_fwd(logits_g, labels.to(Device::CUDA), lse_g, &n_valid); });
  EXPECT_NE(msg.find("label 1005 at row 3 is out of range"), std::string::npos) << msg;
  // The stream is still usable after the error.
  labels.data<int64_t>()[3] = 1;
  labels.data<int64_t>()[4] = 2;
  EXPECT_GT(cuda::cross_entropy_fwd(logits_g, labels.to(Device::CUDA), lse_g, &n_valid), 0.0);
  EXPECT_EQ(n_valid, 3);
}

// ---------------------------------------------------------------- AdamW and gradient utilities

TEST(CudaAdamW, ThreeStepsEqualCpuAndComputeCopyIsTheRoundedWeight) {
  MT_REQUIRE_GPU();
  Rng rng(13);
  const int64_t n = (int64_t(1) << 20) + 3;
  struct Betas {
    float b1, b2;
  };
  // beta1 = 0.9 and 0.3 take the two branches of torch's lerp; offset 1 makes every base unaligned.
  for (Betas b : {Betas{0.9f, 0.95f}, Betas{0.3f, 0.999f}}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE(str("beta1=", b.b1, " beta2=", b.b2, " offset=", offset));
      Tensor p = randn({n}, rng), m = Tensor::zeros({n}), v = Tensor::zeros({n});
      auto on_gpu = [&](const Tensor& t) {
        Tensor big = Tensor::zeros({n + offset}, DType::F32, Device::CUDA);
        Tensor view = big.rows(offset, n);
        view.copy_from(t);
        return view;
      };
      Tensor p_g = on_gpu(p), m_g = on_gpu(m), v_g = on_gpu(v);
      Tensor pc_big = Tensor::zeros({n + offset}, DType::BF16, Device::CUDA);
      Tensor pc_g = pc_big.rows(offset, n);
      ops::AdamWHyper h;
      h.lr = 1e-3f;
      h.beta1 = b.b1;
      h.beta2 = b.b2;
      h.eps = 1e-8f;
      h.weight_decay = 0.1f;
      for (int64_t step = 1; step <= 3; ++step) {
        h.step = step;
        Tensor g = randn({n}, rng, 0.01f);
        cpu::adamw_step(p, g, m, v, h, 0.5f, nullptr);
        cuda::adamw_step(p_g, on_gpu(g), m_g, v_g, h, 0.5f, &pc_g);
        // The same f32 operations in the same order: expected bitwise equal; 1e-6 as the bound.
        EXPECT_LT(rel_l2(p_g, p), 1e-6) << "step " << step;
        EXPECT_LT(rel_l2(m_g, m), 1e-6) << "step " << step;
        EXPECT_LT(rel_l2(v_g, v), 1e-6) << "step " << step;
      }
      Tensor p_h = p_g.to(Device::CPU), pc_h = pc_g.to(Device::CPU);
      int64_t differ = 0;
      for (int64_t i = 0; i < n; ++i) differ += f32_to_bf16(p_h.data<float>()[i]) != pc_h.data<uint16_t>()[i];
      EXPECT_EQ(differ, 0);
    }
  }
}

TEST(CudaGradUtils, SumSquaresMatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(14);
  for (int64_t n : {int64_t(10'000'001), int64_t(1000), int64_t(7)}) {
    SCOPED_TRACE(str("n=", n));
    Tensor x = rand_bf16_exact({n}, rng);
    const double want = cpu::sum_squares(x);
    // fp64 on both sides, summed in different orders (the CPU's sequential sum of 1e7 terms is good to
    // ~1e-12 relative).
    EXPECT_LT(std::abs(cuda::sum_squares(to_cuda(x, DType::F32)) - want) / want, 1e-10);
    EXPECT_LT(std::abs(cuda::sum_squares(to_cuda(x, DType::BF16)) - want) / want, 1e-10);
  }
  EXPECT_EQ(cuda::sum_squares(Tensor::zeros({0}, DType::F32, Device::CUDA)), 0.0);
}

TEST(CudaGradUtils, ScaleAndAddRepeatTheCpuArithmetic) {
  MT_REQUIRE_GPU();
  Rng rng(15);
  for (int64_t n : {int64_t(1'000'003), int64_t(5)}) {
    SCOPED_TRACE(str("n=", n));
    Tensor x = rand_bf16_exact({n}, rng), y = rand_bf16_exact({n}, rng);
    for (DType dt : {DType::F32, DType::BF16}) {
      Tensor x_g = to_cuda(x, dt), y_g = to_cuda(y, dt);
      cuda::scale_(x_g, 0.3f);
      cuda::add_(y_g, x_g, -1.7f);
      // CPU in f32 on the same inputs; bf16 results must be exactly the rounding of the f32 results.
      Tensor xs = x.clone();
      cpu::scale_(xs, 0.3f);
      if (dt == DType::BF16) xs = bf16_rounded(xs);
      Tensor ys = y.clone();
      cpu::add_(ys, xs, -1.7f);
      if (dt == DType::BF16) ys = bf16_rounded(ys);
      EXPECT_EQ(rel_l2(x_g, xs), 0.0) << dtype_name(dt);
      EXPECT_EQ(rel_l2(y_g, ys), 0.0) << dtype_name(dt);
    }
    // y f32 += bf16 x (a bf16 branch into the f32 residual): the same f32 operations as the CPU on the
    // f32 value of x, so exact; y is full-precision f32.
    Tensor yf = randn({n}, rng);
    Tensor yf_g = yf.to(Device::CUDA);
    cuda::add_(yf_g, to_cuda(x, DType::BF16), 0.7f);
    cpu::add_(yf, x, 0.7f);
    EXPECT_EQ(rel_l2(yf_g, yf), 0.0) << "y f32, x bf16";
  }
  Tensor yb = Tensor::zeros({4}, DType::BF16, Device::CUDA), xf = Tensor::zeros({4}, DType::F32, Device::CUDA);
  std::string msg = error_of([&] { cuda::add_(yb, xf, 1.0f); });
  EXPECT_NE(msg.find("add_ x has dtype f32, expected bf16 (y is bf16)"), std::string::npos) << msg;
  Tensor yf = Tensor::zeros({4}, DType::F32, Device::CUDA), xb5 = Tensor::zeros({5}, DType::BF16, Device::CUDA);
  msg = error_of([&] { cuda::add_(yf, xb5, 1.0f); });
  EXPECT_NE(msg.find("add_ x has shape [5], expected [4]"), std::string::npos) << msg;
}

TEST(CudaGradUtils, AllFiniteFindsOneBadElement) {
  MT_REQUIRE_GPU();
  Rng rng(16);
  const int64_t n = 1'000'003;
  Tensor x = rand_bf16_exact({n}, rng);
  for (DType dt : {DType::F32, DType::BF16}) {
    EXPECT_TRUE(cuda::all_finite(to_cuda(x, dt))) << dtype_name(dt);
    for (int64_t at : {int64_t(5), n - 1}) {  // in the vector part and in the tail
      for (float bad : {kNaN, INFINITY, -INFINITY}) {
        Tensor y = x.clone();
        y.data<float>()[at] = bad;
        EXPECT_FALSE(cuda::all_finite(to_cuda(y, dt))) << dtype_name(dt) << " at " << at << " value " << bad;
      }
    }
  }
  EXPECT_TRUE(cuda::all_finite(Tensor::zeros({0}, DType::F32, Device::CUDA)));
}

TEST(CudaGradUtils, CopyCastConvertsAndCopies) {
  MT_REQUIRE_GPU();
  Rng rng(17);
  const int64_t n = 100'003;
  Tensor x = randn({n}, rng);
  Tensor x_g = x.to(Device::CUDA);
  Tensor b_g = Tensor::empty({n}, DType::BF16, Device::CUDA), f_g = Tensor::empty({n}, DType::F32, Device::CUDA);
  cuda::copy_cast(x_g, b_g);
  EXPECT_EQ(rel_l2(b_g, bf16_rounded(x)), 0.0);
  cuda::copy_cast(b_g, f_g);
  EXPECT_EQ(rel_l2(f_g, bf16_rounded(x)), 0.0);
  cuda::copy_cast(x_g, f_g);
  EXPECT_EQ(rel_l2(f_g, x), 0.0);
  Tensor i_g = Tensor::empty({n}, DType::I32, Device::CUDA);
  std::string msg = error_of([&] { cuda::copy_cast(x_g, i_g); });
  EXPECT_NE(msg.find("copy_cast: cannot convert"), std::string::npos) << msg;
}

// device_mem::copy_2d (the Ulysses exchange's pack and unpack) on CUDA moves exactly the bytes the
// host loop moves: odd widths, pitches larger than the width, and a destination whose gaps must stay
// untouched.
TEST(CudaCopy2d, StridedRunsMatchTheHostCopy) {
  MT_REQUIRE_GPU();
  const size_t width = 37 * 2, spitch = 128 * 2, dpitch = 96 * 2, height = 53;
  Tensor src = Tensor::empty({int64_t(spitch * height / 4)}, DType::I32);
  Tensor dst = Tensor::empty({int64_t(dpitch * height / 4)}, DType::I32);
  for (int64_t i = 0; i < src.numel(); ++i) src.data<int32_t>()[i] = int32_t(i * 2654435761u);
  for (int64_t i = 0; i < dst.numel(); ++i) dst.data<int32_t>()[i] = -int32_t(i);
  Tensor src_d = src.to(Device::CUDA), dst_d = dst.to(Device::CUDA);
  device_mem::copy_2d(dst.raw(), dpitch, static_cast<char*>(src.raw()) + 6, spitch, width, height, Device::CPU);
  device_mem::copy_2d(dst_d.raw(), dpitch, static_cast<char*>(src_d.raw()) + 6, spitch, width, height, Device::CUDA);
  Tensor got = dst_d.to(Device::CPU);
  EXPECT_EQ(std::memcmp(got.raw(), dst.raw(), dst.nbytes()), 0);
  // The host copy itself: run 5 starts at dst + 5 dpitch and equals src + 6 + 5 spitch.
  EXPECT_EQ(std::memcmp(static_cast<char*>(dst.raw()) + 5 * dpitch, static_cast<char*>(src.raw()) + 6 + 5 * spitch,
                        width),
            0);
  EXPECT_EQ(dst.data<int32_t>()[int64_t(dpitch / 4) - 1], -int32_t(dpitch / 4 - 1));  // a gap byte untouched
}
