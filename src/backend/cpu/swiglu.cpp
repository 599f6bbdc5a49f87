// CPU reference for SwiGLU on a fused [gate | up] tensor: h = silu(gate) * up with
// silu(g) = g / (1 + exp(-g)), as torch.nn.functional.silu computes it. The element math runs in
// fp64 and rounds once to fp32, so this is the accurate side of any comparison.
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

namespace {

// Returns F and checks that gu_N2F is [N, 2F] and other_NF is [N, F], both f32.
int64_t check_swiglu_shapes(const Tensor& gu_N2F, const Tensor& other_NF, const char* op, const char* other_name) {
  MT_CHECK(gu_N2F.dim() == 2, op, " gu_N2F must be 2-D, got ", gu_N2F.desc());
  check_dtype(gu_N2F, DType::F32, "swiglu gu_N2F");
  MT_CHECK(gu_N2F.size(1) % 2 == 0, op, " gu_N2F last dim must be even ([gate | up]), got ", gu_N2F.desc());
  const int64_t F = gu_N2F.size(1) / 2;
  check_shape(other_NF, {gu_N2F.size(0), F}, other_name);
  check_dtype(other_NF, DType::F32, other_name);
  return F;
}

}  // namespace

void swiglu_fwd(const Tensor& gu_N2F, Tensor& h_NF) {
  const int64_t F = check_swiglu_shapes(gu_N2F, h_NF, "swiglu_fwd", "swiglu_fwd h_NF");
  const int64_t N = gu_N2F.size(0);
  const float* gu = gu_N2F.data<float>();
  float* h = h_NF.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * F;
    const float* u = g + F;
    float* hn = h + n * F;
    for (int64_t f = 0; f < F; ++f) {
      const double gd = g[f];
      hn[f] = float(gd / (1.0 + std::exp(-gd)) * double(u[f]));
    }
  }
}

void swiglu_bwd(const Tensor& dh_NF, const Tensor& gu_N2F, Tensor& dgu_N2F) {
  const int64_t F = check_swiglu_shapes(gu_N2F, dh_NF, "swiglu_bwd", "swiglu_bwd dh_NF");
  check_shape(dgu_N2F, gu_N2F.shape(), "swiglu_bwd dgu_N2F");
  check_dtype(dgu_N2F, DType::F32, "swiglu_bwd dgu_N2F");
  const int64_t N = gu_N2F.size(0);
  const float* gu = gu_N2F.data<float>();
  const float* dh = dh_NF.data<float>();
  float* dgu = dgu_N2F.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * F;
    const float* u = g + F;
    const float* dhn = dh + n * F;
    float* dg = dgu + n * 2 * F;
    float* du = dg + F;
    for (int64_t f = 0; f < F; ++f) {
      const double gd = g[f];
      const double sig = 1.0 / (1.0 + std::exp(-gd));
      // d silu/dg = sig + g * sig * (1 - sig)
      dg[f] = float(double(dhn[f]) * double(u[f]) * sig * (1.0 + gd * (1.0 - sig)));
      du[f] = float(double(dhn[f]) * gd * sig);
    }
  }
}

}  // namespace mt::cpu
