// The shape checks of attention_fwd / attention_bwd (ops.h), shared by every backend so that the
// rules and their messages are written once; each backend checks only its own dtypes and device.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt::ops {

struct AttentionDims {
  int64_t T, H, G, Hd;
};

// q_THHd [T, H, Hd], k_TGHd and v_TGHd [T, G, Hd], B * S == T, H % G == 0, Hd > 0; throws naming
// `op`, the tensor and the values otherwise. Returns the dims.
AttentionDims check_attention_shapes(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B,
                                     int64_t S, const char* op);

}  // namespace mt::ops
