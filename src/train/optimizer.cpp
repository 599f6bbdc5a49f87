#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

namespace mt {

double clip_factor(double grad_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  // torch computes the coefficient in fp32: max_norm / (total_norm + 1e-6), clamped to 1.
  float coef = float(max_norm) / (float(grad_norm) + 1e-6f);
  return coef < 1.0f ? double(coef) : 1.0;
}

AdamW::AdamW(int64_t numel, Device device, const AdamWConfig& cfg) : cfg_(cfg), device_(device) {
  m_ = Tensor::zeros({numel}, DType::F32, device);
  v_ = Tensor::zeros({numel}, DType::F32, device);
}

bool AdamW::decide(const Tensor& params, const Tensor& grads, double lr, const std::function<double()>& global_grad_sq,
                   OptimStepResult& r, ops::AdamWHyper& h) {
  MT_CHECK(params.numel() == m_.numel() && grads.numel() == m_.numel(), "AdamW sized for ", m_.numel(),
           " elements, got params ", params.desc(), " grads ", grads.desc());
  r.grad_norm = std::sqrt(global_grad_sq ? global_grad_sq() : ops::sum_squares(grads));
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.clip_scale = 0;
    ++skipped_;
    return false;
  }
  r.clip_scale = clip_factor(r.grad_norm, cfg_.max_grad_norm);
  ++step_;
  h.lr = float(lr);
  h.beta1 = float(cfg_.beta1);
  h.beta2 = float(cfg_.beta2);
  h.eps = float(cfg_.eps);
  h.weight_decay = float(cfg_.weight_decay);
  h.step = step_;
  return true;
}

OptimStepResult AdamW::step(Tensor& params, const Tensor& grads, double lr, Tensor* compute,
                            const std::function<double()>& global_grad_sq) {
  if (!units_.empty()) return step_overlapped(params, grads, lr, compute, units_, global_grad_sq);
  OptimStepResult r;
  ops::AdamWHyper h;
  if (!decide(params, grads, lr, global_grad_sq, r, h)) return r;
  Tensor p = params.view({-1}), g = grads.view({-1});
  Tensor compute_flat = compute ? compute->view({-1}) : Tensor();
  ops::adamw_step(p, g, m_, v_, h, float(r.clip_scale), compute ? &compute_flat : nullptr);
  return r;
}

OptimStepResult AdamW::step_overlapped(Tensor& params, const Tensor& grads, double lr, Tensor* compute,
                                       const std::vector<std::pair<int64_t, int64_t>>& units,
                                       const std::function<double()>& global_grad_sq) {
  std::vector<std::pair<int64_t, int64_t>> sorted = units;
  std::sort(sorted.begin(), sorted.end());
  int64_t covered = 0;
  for (const auto& [b, e] : sorted) {
    MT_CHECK(b == covered && e > b, "AdamW::step_overlapped: unit ranges must tile the ", m_.numel(),
             " elements; got [", b, ", ", e, ") after ", covered);
    covered = e;
  }
  MT_CHECK(covered == m_.numel(), "AdamW::step_overlapped: unit ranges must tile the ", m_.numel(),
           " elements; they end at ", covered);
  ready_.resize(units.size(), device_);
  OptimStepResult r;
  ops::AdamWHyper h;
  const bool update = decide(params, grads, lr, global_grad_sq, r, h);
  // The side stream starts after everything queued so far (the backward, the norm): the gradients are final.
  ready_.side_waits_compute();
  Tensor p = params.view({-1}), g = grads.view({-1});
  Tensor compute_flat = compute ? compute->view({-1}) : Tensor();
  streams::SideScope side(device_);
  for (size_t i = 0; i < units.size(); ++i) {
    if (update) {
      const int64_t b = units[i].first, n = units[i].second - b;
      Tensor pu = p.rows(b, n), gu = g.rows(b, n), mu = m_.rows(b, n), vu = v_.rows(b, n);
      Tensor cu = compute ? compute_flat.rows(b, n) : Tensor();
      ops::adamw_step(pu, gu, mu, vu, h, float(r.clip_scale), compute ? &cu : nullptr);
    }
    ready_.record_side(i);
  }
  return r;
}

}  // namespace mt
