#include "train/optimizer.h"

#include <cmath>

namespace mt {

double clip_factor(double grad_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  // torch computes the coefficient in fp32: max_norm / (total_norm + 1e-6), clamped to 1.
  float coef = float(max_norm) / (float(grad_norm) + 1e-6f);
  return coef < 1.0f ? double(coef) : 1.0;
}

AdamW::AdamW(int64_t numel, Device device, const AdamWConfig& cfg) : cfg_(cfg) {
  m_ = Tensor::zeros({numel}, DType::F32, device);
  v_ = Tensor::zeros({numel}, DType::F32, device);
}

OptimStepResult AdamW::step(Tensor& params, const Tensor& grads, double lr, Tensor* compute,
                            const std::function<double()>& global_grad_sq) {
  MT_CHECK(params.numel() == m_.numel() && grads.numel() == m_.numel(), "AdamW sized for ", m_.numel(),
           " elements, got params ", params.desc(), " grads ", grads.desc());
  OptimStepResult r;
  r.grad_norm = std::sqrt(global_grad_sq ? global_grad_sq() : ops::sum_squares(grads));
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.clip_scale = 0;
    ++skipped_;
    return r;
  }
  r.clip_scale = clip_factor(r.grad_norm, cfg_.max_grad_norm);
  ++step_;
  ops::AdamWHyper h;
  h.lr = float(lr);
  h.beta1 = float(cfg_.beta1);
  h.beta2 = float(cfg_.beta2);
  h.eps = float(cfg_.eps);
  h.weight_decay = float(cfg_.weight_decay);
  h.step = step_;
  Tensor p = params.view({-1}), g = grads.view({-1});
  Tensor compute_flat = compute ? compute->view({-1}) : Tensor();
  ops::adamw_step(p, g, m_, v_, h, float(r.clip_scale), compute ? &compute_flat : nullptr);
  return r;
}

}  // namespace mt
