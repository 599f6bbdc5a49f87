// CPU rotary position embedding, rotate-half form, in place on [T, heads, Hd].
//
// Precision choice: the frequencies and angles are computed in float32, exactly as transformers
// does (inv_freq = 1 / theta^(arange(0, Hd, 2).float() / Hd) in f32; freqs = inv_freq * pos in f32;
// cos/sin of that f32 angle). At positions in the thousands an f32 angle is off from the true one by
// up to ~2e-4 rad, so a "more exact" fp64 angle would disagree with the reference model by far more
// than our 1e-5 logits tolerance; matching its rounding is what makes checkpoints interchangeable.
// The rotation itself is also done in transformers' order: x*cos + rotate_half(x)*sin.
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

// Shapes and dtypes as documented in ops.h, Hd even, theta a positive number.
static void check_rope_args(const Tensor& x_TNHd, const Tensor& pos_T, float theta, const char* op) {
  check_dtype(x_TNHd, DType::F32, str(op, " x_TNHd").c_str());
  if (x_TNHd.dim() != 3) MT_THROW(op, " x_TNHd must be 3-D [T, heads, Hd], got shape ", shape_str(x_TNHd.shape()));
  const int64_t T = x_TNHd.size(0), Hd = x_TNHd.size(2);
  if (Hd % 2 != 0) MT_THROW(op, ": head dim Hd (", Hd, ") must be even for rotate-half RoPE");
  check_shape(pos_T, {T}, str(op, " pos_T").c_str());
  check_dtype(pos_T, DType::I32, str(op, " pos_T").c_str());
  if (!(theta > 0.0f) || !std::isfinite(theta)) MT_THROW(op, ": rope theta (", theta, ") must be a positive number");
}

// direction +1 rotates by +angle (forward); -1 by -angle, the transpose, which is the backward.
static void rope_apply(Tensor& x_TNHd, const Tensor& pos_T, float theta, int direction) {
  const int64_t T = x_TNHd.size(0), N = x_TNHd.size(1), Hd = x_TNHd.size(2), half = Hd / 2;
  const size_t nh = static_cast<size_t>(half);
  std::vector<float> inv_freq(nh), cos_h(nh), sin_h(nh);
  for (int64_t i = 0; i < half; ++i) inv_freq[size_t(i)] = 1.0f / std::pow(theta, float(2 * i) / float(Hd));
  const int32_t* pos = pos_T.data<int32_t>();
  float* x = x_TNHd.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(pos[t]) * inv_freq[size_t(i)];
      cos_h[size_t(i)] = std::cos(angle);
      sin_h[size_t(i)] = direction > 0 ? std::sin(angle) : -std::sin(angle);
    }
    for (int64_t n = 0; n < N; ++n) {
      float* v = x + (t * N + n) * Hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half], c = cos_h[size_t(i)], s = sin_h[size_t(i)];
        v[i] = a * c + (-b) * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

void rope_fwd(Tensor& x_TNHd, const Tensor& pos_T, float theta) {
  check_rope_args(x_TNHd, pos_T, theta, "rope_fwd");
  rope_apply(x_TNHd, pos_T, theta, +1);
}

void rope_bwd(Tensor& dx_TNHd, const Tensor& pos_T, float theta) {
  check_rope_args(dx_TNHd, pos_T, theta, "rope_bwd");
  rope_apply(dx_TNHd, pos_T, theta, -1);
}

}  // namespace mt::cpu
