// Argument checks that every backend would otherwise repeat: what an op's contract in ops.h says about
// shapes and scalar arguments, whatever the device. The dispatch (ops.cpp) calls check_<op> with all of
// the op's arguments, after the device check and before the backend: tools/gen_op_dispatch.py emits
// that call for every check_<op> declared here. Dtype and device checks stay in the backends (they
// differ: CUDA takes bf16 where the CPU takes f32); so do checks that read tensor data. A backend
// called directly (tests) skips these checks. The attention shapes are shared differently: both
// backends call ops/attention_shapes.h, because the CUDA backend needs the dims it returns.
#pragma once
#include "ops/ops.h"

namespace mt::ops {

// g, m, v and p_compute (when given) have p's shape; the hyper-parameters are in their ranges.
void check_adamw_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                      float grad_scale, const Tensor* p_compute);

}  // namespace mt::ops
