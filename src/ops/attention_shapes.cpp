// Shared attention shape checks (attention_shapes.h).
#include "ops/attention_shapes.h"

#include "core/error.h"

namespace mt::ops {

AttentionDims check_attention_shapes(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B,
                                     int64_t S, const char* op) {
  if (q_THHd.dim() != 3) MT_THROW(op, " q_THHd must be 3-D [T, H, Hd], got shape ", shape_str(q_THHd.shape()));
  if (k_TGHd.dim() != 3) MT_THROW(op, " k_TGHd must be 3-D [T, G, Hd], got shape ", shape_str(k_TGHd.shape()));
  const AttentionDims d{q_THHd.size(0), q_THHd.size(1), k_TGHd.size(1), q_THHd.size(2)};
  if (B < 0 || S < 0 || B * S != d.T)
    MT_THROW(op, ": B (", B, ") * S (", S, ") must equal the number of tokens T (", d.T, ")");
  if (d.G <= 0 || d.H % d.G != 0)
    MT_THROW(op, ": query heads H (", d.H, ") must be a multiple of key/value heads G (", d.G, ")");
  if (d.Hd <= 0) MT_THROW(op, ": head dim Hd (", d.Hd, ") must be positive");
  check_shape(k_TGHd, {d.T, d.G, d.Hd}, str(op, " k_TGHd").c_str());
  check_shape(v_TGHd, {d.T, d.G, d.Hd}, str(op, " v_TGHd").c_str());
  return d;
}

}  // namespace mt::ops
