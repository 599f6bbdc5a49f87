// The residual-stream fusions on CUDA (ops.h: add_rms_norm_fwd/bwd, linear_fwd_add; ModelOptions::
// fuse_norm_add, fuse_gemm_add), against the CPU ops and against the CUDA op sequences they replace.
// Tolerances:
//   - against the CPU: as the unfused ops' tests (test_cuda_elementwise.cpp, test_cuda_gemm_moe.cpp):
//     bf16 outputs one rounding (kBf16Out 5e-3), rstd 1e-5, an f32 dx 1e-5, dw 1e-4 (f32 sums of many
//     rows against fp64), an f32 GEMM output 1e-4 (f32 summation order). The residual h after the f32
//     add is the same f32 operation on both: compared exactly;
//   - against the unfused CUDA sequence: the fused kernels repeat its f32 operations (same lanes, the
//     adds as __fadd_rn, the GEMM's epilogue adds r to the f32 accumulator once), so 0 is expected;
//     kSame = 1e-6 leaves room for a compiler contracting one multiply-add differently, and is far
//     below a missing or doubled term (order 1). dw with float atomics reorders between any two runs:
//     1e-5 there, and exact under the deterministic switch. Each test prints whether it was bit-equal;
//   - the model, fused vs unfused: loss within 1e-6 relative, all gradients within 1e-5 (the float
//     atomics of the aux statistics and weight-gradient reductions, as CudaModel.FullRecomputeMatches-
//     NoRecompute), and within 1e-6 under the deterministic switch.
// "=" outputs start as NaN: rel_l2 fails on an element left unwritten.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/determinism.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "model/qwen3_moe.h"
#include "test_util.h"

using namespace mt;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::cuda_filled;
using cudatest::randn;
using cudatest::to_host_f32;
using mt::testutil::error_of;
using mt::testutil::same_bits;

namespace {

constexpr double kBf16Out = 5e-3;
constexpr double kSame = 1e-6;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();



// rel_l2 within tol, and a line saying whether the two were bit-equal.
void expect_same(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const double e = rel_l2(got, want);
  EXPECT_LE(e, tol) << what;
  std::printf("[fused vs unfused] %s: rel L2 %.3g%s\n", what.c_str(), e, same_bits(got, want) ? " (bit-equal)" : "");
}

struct NormCase {
  int64_t N, D;
};
const NormCase kNormCases[] = {{4096, 2048}, {37, 128}, {1001, 7}, {3, 2048}, {0, 16}};

}  // namespace

TEST(CudaFusedResidual, AddRmsNormForwardMatchesCpuAndTheUnfusedPair) {
  MT_REQUIRE_GPU();
  Rng rng(71);
  const float eps = 1e-6f;
  for (NormCase c : kNormCases) {
    for (DType xdt : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(str("N=", c.N, " D=", c.D, " x ", dtype_name(xdt)));
      const Tensor h0 = randn({c.N, c.D}, rng);  // the residual: full-precision f32
      const Tensor x = xdt == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      const Tensor w = randn({c.D}, rng);
      Tensor h = h0.clone(), y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
      cpu::add_rms_norm_fwd(h, x, w, eps, y, rstd);

      Tensor h_g = h0.to(Device::CUDA), x_g = to_cuda(x, xdt), w_g = w.to(Device::CUDA);
      Tensor y_g = cuda_filled({c.N, c.D}, DType::BF16, kNaN), rstd_g = cuda_filled({c.N}, DType::F32, kNaN);
      cuda::add_rms_norm_fwd(h_g, x_g, w_g, eps, y_g, rstd_g);
      EXPECT_TRUE(same_bits(h_g, h)) << "h after the add (one f32 add on both)";
      EXPECT_LT(rel_l2(y_g, y), kBf16Out);
      EXPECT_LT(rel_l2(rstd_g, rstd), 1e-5);

      Tensor h_u = h0.to(Device::CUDA), y_u = cuda_filled({c.N, c.D}, DType::BF16, kNaN),
             rstd_u = cuda_filled({c.N}, DType::F32, kNaN);
      cuda::add_(h_u, x_g);
      cuda::rms_norm_fwd(h_u, w_g, eps, y_u, rstd_u);
      EXPECT_TRUE(same_bits(h_g, h_u)) << "h vs add_";
      if (c.N == 0) continue;
      expect_same(y_g, y_u, kSame, str("add_rms_norm_fwd y N=", c.N, " D=", c.D, " x ", dtype_name(xdt)));
      expect_same(rstd_g, rstd_u, kSame, str("add_rms_norm_fwd rstd N=", c.N, " D=", c.D, " x ", dtype_name(xdt)));
    }
  }
}

TEST(CudaFusedResidual, AddRmsNormBackwardMatchesCpuAndTheUnfusedPair) {
  MT_REQUIRE_GPU();
  Rng rng(72);
  const float eps = 1e-6f;
  for (NormCase c : kNormCases) {
    for (DType dt : {DType::F32, DType::BF16}) {  // dy and x: f32 (the residual stream's norms) or bf16
      for (bool det : {false, true}) {
        const DeterministicScope scope(det);
        const std::string name = str("N=", c.N, " D=", c.D, " dy,x ", dtype_name(dt), det ? " deterministic" : "");
        SCOPED_TRACE(name);
        const Tensor x = dt == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
        const Tensor dy = dt == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
        const Tensor w = randn({c.D}, rng), dres = randn({c.N, c.D}, rng), dw0 = randn({c.D}, rng);
        Tensor y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
        cpu::rms_norm_fwd(x, w, eps, y, rstd);
        Tensor dx = Tensor::empty({c.N, c.D}), dw = dw0.clone();
        cpu::add_rms_norm_bwd(dy, x, w, rstd, dres, dx, dw);

        const Tensor dy_g = to_cuda(dy, dt), x_g = to_cuda(x, dt), w_g = w.to(Device::CUDA),
                     rstd_g = rstd.to(Device::CUDA), dres_g = dres.to(Device::CUDA);
        Tensor dx_g = cuda_filled({c.N, c.D}, DType::F32, kNaN), dw_g = dw0.to(Device::CUDA);
        cuda::add_rms_norm_bwd(dy_g, x_g, w_g, rstd_g, dres_g, dx_g, dw_g);
        EXPECT_LT(rel_l2(dx_g, dx), 1e-5);
        EXPECT_LT(rel_l2(dw_g, dw), 1e-4);

        Tensor dx_u = cuda_filled({c.N, c.D}, DType::F32, kNaN), dw_u = dw0.to(Device::CUDA);
        cuda::rms_norm_bwd(dy_g, x_g, w_g, rstd_g, dx_u, dw_u);
        cuda::add_(dx_u, dres_g);
        if (c.N == 0) continue;
        expect_same(dx_g, dx_u, kSame, "add_rms_norm_bwd dx " + name);
        expect_same(dw_g, dw_u, det ? 0.0 : 1e-5, "add_rms_norm_bwd dw " + name);

        // accumulate_dw false writes dw (=) from a NaN-filled buffer.
        Tensor dw_set = cuda_filled({c.D}, DType::F32, kNaN), dw_zero = Tensor::zeros({c.D}, DType::F32, Device::CUDA);
        cuda::add_rms_norm_bwd(dy_g, x_g, w_g, rstd_g, dres_g, dx_g, dw_set, false);
        cuda::add_rms_norm_bwd(dy_g, x_g, w_g, rstd_g, dres_g, dx_g, dw_zero, true);
        EXPECT_LE(rel_l2(dw_set, dw_zero), det ? 0.0 : 1e-5) << "accumulate_dw false";
      }
    }
  }
}

TEST(CudaFusedResidual, AddRmsNormArgumentErrors) {
  MT_REQUIRE_GPU();
  const Device d = Device::CUDA;
  Tensor h16 = Tensor::zeros({2, 16}, DType::BF16, d), h = Tensor::zeros({2, 16}, DType::F32, d);
  Tensor w = Tensor::zeros({16}, DType::F32, d), y = Tensor::zeros({2, 16}, DType::BF16, d),
         rstd = Tensor::zeros({2}, DType::F32, d);
  std::string msg = error_of([&] { cuda::add_rms_norm_fwd(h16, h, w, 1e-6f, y, rstd); });
  EXPECT_NE(msg.find("add_rms_norm_fwd h_ND must be f32"), std::string::npos) << msg;
  Tensor x8 = Tensor::zeros({2, 8}, DType::F32, d);
  msg = error_of([&] { cuda::add_rms_norm_fwd(h, x8, w, 1e-6f, y, rstd); });
  EXPECT_NE(msg.find("add_rms_norm_fwd x_ND has shape [2, 8], expected [2, 16]"), std::string::npos) << msg;
  Tensor dx16 = Tensor::zeros({2, 16}, DType::BF16, d), dw = Tensor::zeros({16}, DType::F32, d);
  msg = error_of([&] { cuda::add_rms_norm_bwd(h, h, w, rstd, h, dx16, dw); });
  EXPECT_NE(msg.find("add_rms_norm_bwd dx_ND must be f32"), std::string::npos) << msg;
  msg = error_of([&] { cuda::add_rms_norm_bwd(h, h, w, rstd, h16, h, dw); });
  EXPECT_NE(msg.find("add_rms_norm_bwd dres_ND has dtype bf16, expected f32"), std::string::npos) << msg;
}

TEST(CudaFusedResidual, LinearForwardAddMatchesCpuAndLinearThenAdd) {
  MT_REQUIRE_GPU();
  struct L {
    int64_t T, I, O;
  };
  Rng rng(73);
  // o_proj of bench-4L (4096 tokens, 32 x 128 -> 2048), a dense down projection, odd shapes.
  for (L c : {L{4096, 4096, 2048}, L{512, 768, 2048}, L{7, 64, 96}, L{7, 33, 17}}) {
    SCOPED_TRACE(str("T=", c.T, " I=", c.I, " O=", c.O));
    const Tensor x = rand_bf16_exact({c.T, c.I}, rng), w = rand_bf16_exact({c.O, c.I}, rng, 0.05f);
    const Tensor r = randn({c.T, c.O}, rng);
    Tensor want = Tensor::empty({c.T, c.O});
    cpu::linear_fwd_add(x, w, r, want);
    const Tensor x_g = to_cuda(x, DType::BF16), w_g = to_cuda(w, DType::BF16);
    for (DType dt : {DType::F32, DType::BF16}) {
      const std::string name = str("linear_fwd_add T=", c.T, " I=", c.I, " O=", c.O, " y ", dtype_name(dt));
      const Tensor r_g = to_cuda(r, dt);
      Tensor y_g = cuda_filled({c.T, c.O}, dt, kNaN);
      cuda::linear_fwd_add(x_g, w_g, r_g, y_g);
      // bf16: r is rounded to bf16 on the way in and y on the way out (2 roundings of |r|-sized values).
      EXPECT_LE(rel_l2(y_g, want), dt == DType::F32 ? 1e-4 : 2 * kBf16Out) << name;
      if (dt == DType::F32) {
        Tensor y_u = cuda_filled({c.T, c.O}, dt, kNaN);
        cuda::linear_fwd(x_g, w_g, y_u);
        cuda::add_(y_u, r_g);
        expect_same(y_g, y_u, kSame, name);
      }
      Tensor acc = r_g.clone();  // r being y itself: y += x w^T
      cuda::linear_fwd_add(x_g, w_g, acc, acc);
      // f32 (the model's residual stream): the same bits as the separate output. bf16 (no model use): cuBLASLt
      // may pick another algorithm when C is D (measured on an H100: rel L2 0.002-0.003 between the two, one
      // bf16 rounding), so both are held to the CPU's bf16 tolerance instead.
      if (dt == DType::F32)
        expect_same(acc, y_g, kSame, name + " in place");
      else
        EXPECT_LE(rel_l2(acc, want), 2 * kBf16Out) << name << " in place";
    }
  }
}

// No input features (K = 0): y = r, copied by the GEMM's K = 0 path.
TEST(CudaFusedResidual, LinearForwardAddWithoutInputFeaturesCopiesR) {
  MT_REQUIRE_GPU();
  Rng rng(75);
  const Device d = Device::CUDA;
  const Tensor r = randn({5, 8}, rng).to(d);
  Tensor x = Tensor::zeros({5, 0}, DType::BF16, d), w = Tensor::zeros({8, 0}, DType::BF16, d);
  Tensor y = cuda_filled({5, 8}, DType::F32, kNaN);
  cuda::linear_fwd_add(x, w, r, y);
  EXPECT_TRUE(same_bits(y, r));
}

TEST(CudaFusedResidual, LinearForwardAddArgumentErrors) {
  MT_REQUIRE_GPU();
  const Device d = Device::CUDA;
  Tensor x = Tensor::zeros({4, 8}, DType::BF16, d), w = Tensor::zeros({6, 8}, DType::BF16, d);
  Tensor y = Tensor::zeros({4, 6}, DType::F32, d), r16 = Tensor::zeros({4, 6}, DType::BF16, d);
  std::string msg = error_of([&] { cuda::linear_fwd_add(x, w, r16, y); });
  EXPECT_NE(msg.find("linear_fwd_add r_TO has dtype bf16, expected f32"), std::string::npos) << msg;
  Tensor buf = Tensor::zeros({5, 6}, DType::F32, d);
  Tensor r_view = buf.rows(0, 4), y_view = buf.rows(1, 4);
  msg = error_of([&] { cuda::linear_fwd_add(x, w, r_view, y_view); });
  EXPECT_NE(msg.find("overlaps y_TO without being it"), std::string::npos) << msg;
  Tensor w32 = Tensor::zeros({6, 8}, DType::F32, d);
  msg = error_of([&] { cuda::linear_fwd_add(x, w32, y, y); });
  EXPECT_NE(msg.find("linear_fwd_add w_OI has dtype f32, expected bf16"), std::string::npos) << msg;
}

// The model on CUDA with both fusions against both off: same loss and gradients within the atomics'
// reordering, under recompute none (the deferred block-output adds) and full, with a dense layer (its
// down projection takes the epilogue add) and the aux loss.
TEST(CudaFusedResidual, ModelLossAndGradientsMatchTheUnfusedModel) {
  MT_REQUIRE_GPU();
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = true;
  c.mlp_only_layers = {0};
  Tensor host = Tensor::zeros({ParamTable(c).total()});
  init_weights(c, ParamTable(c), host, 9);
  Rng rng(74);
  MicroBatch mb{Tensor::empty({2, 64}, DType::I64), Tensor::empty({2, 64}, DType::I64)};
  for (int64_t i = 0; i < 128; ++i)
    mb.input_ids.data<int64_t>()[i] = mb.labels.data<int64_t>()[i] = rng.randint(0, c.vocab_size);
  for (bool det : {false, true}) {
    const DeterministicScope scope(det);
    for (Recompute rc : {Recompute::None, Recompute::Full}) {
      LossParts lp[2];
      Tensor g[2];
      for (int fused = 0; fused < 2; ++fused) {
        ModelOptions mo;
        mo.fuse_norm_add = mo.fuse_gemm_add = fused == 1;
        Qwen3MoeModel m(c, Device::CUDA, nullptr, Weights::Trainable, mo);
        m.params().copy_from(host.to(Device::CUDA));
        m.refresh_compute_weights();
        PassOptions po;
        po.ce_scale = 1.0 / 126.0;
        po.aux_scale = c.router_aux_loss_coef;
        po.recompute = rc;
        lp[fused] = m.forward_backward(mb, po);
        g[fused] = m.grads().to(Device::CPU);
      }
      const std::string name = str("model recompute ", recompute_name(rc), det ? " deterministic" : "");
      SCOPED_TRACE(name);
      EXPECT_TRUE(std::isfinite(lp[0].loss));
      EXPECT_NEAR(lp[1].loss, lp[0].loss, 1e-6 * lp[0].loss);
      expect_same(g[1], g[0], det ? 1e-6 : 1e-5, name + " gradients");
      std::printf("[fused vs unfused] %s: loss %.9g vs %.9g\n", name.c_str(), lp[1].loss, lp[0].loss);
    }
  }
}
