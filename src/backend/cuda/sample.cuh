// Launchers of the CUDA token sampler (sample.cu) beyond the op itself (ops::sample_tokens, cuda_ops.h).
#pragma once
#include "core/tensor.h"

namespace mt::cuda {

// ops::sample_tokens with every row of T > 0 drawn through the truncation path (the one of top-k / top-p /
// min-p rows), whatever its parameters; greedy rows stay greedy. For tests: with no truncation set, the
// truncation path must draw the tokens the fast path draws (same race scores, same uniform numbers).
void sample_tokens_truncation_path(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R,
                                   Tensor& logprobs_R);

}  // namespace mt::cuda
