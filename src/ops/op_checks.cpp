// The dispatch's shared argument checks (op_checks.h).
#include "ops/op_checks.h"

namespace mt::ops {

void check_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                      float /*grad_scale: any value*/, const Tensor* p_compute) {
  check_shape(g, p.shape(), "adamw_step g");
  check_shape(m, p.shape(), "adamw_step m");
  check_shape(v, p.shape(), "adamw_step v");
  if (p_compute) check_shape(*p_compute, p.shape(), "adamw_step p_compute");
  if (h.step < 1) MT_THROW("adamw_step: step (", h.step, ") must be >= 1 (1-based count after this update)");
  if (!(h.lr >= 0.0f)) MT_THROW("adamw_step: lr (", h.lr, ") must be >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) MT_THROW("adamw_step: beta1 (", h.beta1, ") must be in [0, 1)");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) MT_THROW("adamw_step: beta2 (", h.beta2, ") must be in [0, 1)");
  if (!(h.eps >= 0.0f)) MT_THROW("adamw_step: eps (", h.eps, ") must be >= 0");
  if (!(h.weight_decay >= 0.0f)) MT_THROW("adamw_step: weight_decay (", h.weight_decay, ") must be >= 0");
}

}  // namespace mt::ops
