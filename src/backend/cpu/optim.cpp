// CPU AdamW and the gradient utilities the trainer needs (global norm, scaling, finiteness).
//
// adamw_step reproduces torch.optim.AdamW's single-tensor path operation by operation, so that a
// run can be compared with PyTorch to the last bits where the hyper-parameters are representable:
//   p = p * f32(1 - lr*wd)                    (decoupled decay first; the scalar in double, as Python does)
//   m = lerp(m, g, 1 - b1)                     (torch's lerp: m + w*(g - m) for w < 0.5, else g - (g-m)*(1-w))
//   v = v * b2 + (1 - b2) * g * g
//   denom = sqrt(v) / f32(sqrt(1 - b2^step)) + eps
//   p = p + f32(-lr / (1 - b1^step)) * m / denom
// with all per-element arithmetic in f32 and the bias corrections in double (Python floats).
// lerp equals b1*m + (1-b1)*g mathematically; the formula only changes the f32 rounding.
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

static void check_f32(const Tensor& t, const char* what) {
  check_dtype(t, DType::F32, what);
}

// Shapes and hyper-parameters are checked once by the dispatch (ops/op_checks.h), dtypes here.
void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const AdamWHyper& h, float grad_scale,
                Tensor* p_compute) {
  check_f32(p, "adamw_step p");
  check_f32(g, "adamw_step g");
  check_f32(m, "adamw_step m");
  check_f32(v, "adamw_step v");
  if (p_compute) check_dtype(*p_compute, DType::BF16, "adamw_step p_compute");

  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2;
  const float decay = float(1.0 - lr * double(h.weight_decay));
  const float w1 = float(1.0 - b1);  // lerp weight
  const float fb2 = float(b2), w2 = float(1.0 - b2);
  const double bc1 = 1.0 - std::pow(b1, double(h.step));
  const double bc2 = 1.0 - std::pow(b2, double(h.step));
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float neg_step_size = float(-(lr / bc1));
  const float eps = h.eps;

  float* pp = p.data<float>();
  const float* pg = g.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    const float gi = grad_scale * pg[i];
    const float pi = pp[i] * decay;
    const float mi = w1 < 0.5f ? pm[i] + w1 * (gi - pm[i]) : gi - (gi - pm[i]) * (1.0f - w1);
    const float vi = pv[i] * fb2 + w2 * gi * gi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    pm[i] = mi;
    pv[i] = vi;
    pp[i] = pi + neg_step_size * mi / denom;
  }
  if (p_compute) {
    uint16_t* pc = p_compute->data<uint16_t>();
    for (int64_t i = 0; i < p.numel(); ++i) pc[i] = f32_to_bf16(pp[i]);
  }
}

double sum_squares(const Tensor& x) {
  check_f32(x, "sum_squares x");
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += double(p[i]) * double(p[i]);
  return s;
}

void scale_(Tensor& x, float s) {
  check_f32(x, "scale_ x");
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= s;
}

void add_(Tensor& y, const Tensor& x, float alpha) {
  check_f32(y, "add_ y");
  check_f32(x, "add_ x");
  check_shape(x, y.shape(), "add_ x");
  float* py = y.data<float>();
  const float* px = x.data<float>();
  for (int64_t i = 0; i < y.numel(); ++i) py[i] += alpha * px[i];
}

bool all_finite(const Tensor& x) {
  check_f32(x, "all_finite x");
  const float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

void add_cols_(Tensor& y_TO, const Tensor& x_TC, int64_t col0, float alpha) {
  check_f32(y_TO, "add_cols_ y_TO");
  check_f32(x_TC, "add_cols_ x_TC");
  const int64_t T = y_TO.size(0), O = y_TO.size(1), C = x_TC.size(1);
  float* py = y_TO.data<float>();
  const float* px = x_TC.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) py[t * O + col0 + c] += alpha * px[t * C + c];
}

void copy_cols(const Tensor& x_TO, int64_t col0, Tensor& y_TC) {
  check_f32(x_TO, "copy_cols x_TO");
  check_f32(y_TC, "copy_cols y_TC");
  const int64_t T = x_TO.size(0), O = x_TO.size(1), C = y_TC.size(1);
  const float* px = x_TO.data<float>();
  float* py = y_TC.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) py[t * C + c] = px[t * O + col0 + c];
}

}  // namespace mt::cpu
