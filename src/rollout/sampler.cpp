// The rollout sampler step (sampler.h).
#include "rollout/sampler.h"

#include <algorithm>

#include "ops/ops.h"

namespace mt {

SamplingBatch sampling_batch(const StepPlan& plan, const std::vector<GenerateRequest>& requests) {
  SamplingBatch b;
  b.params.resize(size_t(plan.num_draws));
  b.counters.resize(size_t(plan.num_draws));
  for (const ScheduledSeq& e : plan.seqs) {
    const GenerateRequest& r = requests[size_t(e.seq->req)];
    for (int64_t j = 0; j < e.num_draws; ++j) {
      b.params[size_t(e.first_draw + j)] = r.sampling;
      b.counters[size_t(e.first_draw + j)] = {uint64_t(e.prefill ? j : e.seq->sample), uint64_t(e.seq->tokens.size())};
    }
  }
  return b;
}

Tensor pack_padded_sample_rows(const SamplingBatch& batch, int64_t rows) {
  std::vector<SamplingParams> params(batch.params);
  std::vector<DrawCounter> counters(batch.counters);
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  params.resize(size_t(rows), greedy);
  counters.resize(size_t(rows), DrawCounter{});
  return pack_sample_rows(params, counters);
}

StepDraws sample_step(const Tensor& logits_RV, const SamplingBatch& batch) {
  const int64_t R = batch.rows();
  const Device dev = logits_RV.device();
  const Tensor rows = pack_sample_rows(batch.params, batch.counters);
  Tensor tokens = Tensor::empty({R}, DType::I32, dev), logprobs = Tensor::empty({R}, DType::F32, dev);
  ops::sample_tokens(logits_RV, dev == Device::CPU ? rows : rows.to(dev), tokens, logprobs);
  const Tensor tokens_h = tokens.to(Device::CPU), logprobs_h = logprobs.to(Device::CPU);
  StepDraws out;
  out.tokens.assign(tokens_h.data<int32_t>(), tokens_h.data<int32_t>() + R);
  out.logprobs.assign(logprobs_h.data<float>(), logprobs_h.data<float>() + R);
  return out;
}

}  // namespace mt
