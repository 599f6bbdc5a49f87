// CPU token sampling: ops::sample_tokens over the reference sampler of ops/sampling.h (fp64).
#include "backend/cpu/cpu_ops.h"
#include "ops/sampling.h"

namespace mt::cpu {

void sample_tokens(const Tensor& logits_RV, const Tensor& rows_R5, Tensor& tokens_R, Tensor& logprobs_R) {
  check_dtype(logits_RV, DType::F32, "sample_tokens logits_RV");
  check_dtype(rows_R5, DType::I64, "sample_tokens rows_R5");
  check_dtype(tokens_R, DType::I32, "sample_tokens tokens_R");
  check_dtype(logprobs_R, DType::F32, "sample_tokens logprobs_R");
  const int64_t R = logits_RV.size(0), V = logits_RV.size(1);
  for (int64_t r = 0; r < R; ++r) {
    SamplingParams p;
    DrawCounter c;
    unpack_sample_row(rows_R5.data<int64_t>() + r * kSampleRowWords, &p, &c);
    SampledToken t;
    try {
      t = sample_row(logits_RV.data<float>() + r * V, V, p, c);
    } catch (const Error& e) {
      MT_THROW("sample_tokens row ", r, ": ", e.what());
    }
    tokens_R.data<int32_t>()[r] = t.token;
    logprobs_R.data<float>()[r] = t.logprob;
  }
}

}  // namespace mt::cpu
