// From rollouts to a training micro-batch (rollout_batch.h).
#include "rl/rollout_batch.h"

#include <algorithm>

#include "core/error.h"

namespace mt::rl {

PackedRollouts pack_rollouts(const std::vector<RolloutSample>& samples, int64_t K) {
  if (samples.empty()) MT_THROW("pack_rollouts: no samples");
  PackedRollouts p;
  const int64_t B = int64_t(samples.size());
  size_t with_routing = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const RolloutSample& s = samples[i];
    if (s.prompt.empty() || s.response.empty())
      MT_THROW("pack_rollouts: sample ", i, " has a prompt of ", s.prompt.size(), " and a response of ",
               s.response.size(), " tokens; both must be non-empty");
    if (!s.model_mask.empty() && s.model_mask.size() != s.response.size())
      MT_THROW("pack_rollouts: sample ", i, " has a model mask of ", s.model_mask.size(), " entries for ",
               s.response.size(), " response tokens; need one per token (or none)");
    p.prompt_len.push_back(int64_t(s.prompt.size()));
    p.response_len.push_back(int64_t(s.response.size()));
    p.S = std::max(p.S, int64_t(s.prompt.size() + s.response.size()));
    if (!s.routing.empty()) {
      ++with_routing;
      const int64_t want = int64_t(s.prompt.size() + s.response.size()) - 1;
      if (s.routing.tokens() != want)
        MT_THROW("pack_rollouts: sample ", i, "'s routing record covers ", s.routing.tokens(),
                 " tokens; its prompt and ", "response need ", want);
    }
  }
  if (with_routing != 0 && with_routing != samples.size())
    MT_THROW("pack_rollouts: ", with_routing, " of ", samples.size(), " samples have a routing record; all or none");
  const int64_t S = p.S;
  Tensor ids = Tensor::zeros({B, S}, DType::I64), labels = Tensor::empty({B, S}, DType::I64);
  for (int64_t i = 0; i < B * S; ++i) labels.data<int64_t>()[i] = -100;
  for (int64_t b = 0; b < B; ++b) {
    const RolloutSample& s = samples[size_t(b)];
    int64_t* id = ids.data<int64_t>() + b * S;
    int64_t* lab = labels.data<int64_t>() + b * S;
    const int64_t L = p.prompt_len[size_t(b)];
    for (int64_t t = 0; t < L; ++t) id[t] = s.prompt[size_t(t)];
    for (int64_t j = 0; j < p.response_len[size_t(b)]; ++j) {
      id[L + j] = s.response[size_t(j)];
      const bool model = s.model_mask.empty() || s.model_mask[size_t(j)] != 0;
      if (model) lab[L + j] = s.response[size_t(j)];  // an observation token stays -100, as the prompt's
    }
  }
  p.mb = MicroBatch{ids, labels};
  if (with_routing) {
    const int64_t layers = samples[0].routing.layers();
    for (int64_t l = 0; l < layers; ++l) {
      Tensor r = Tensor::empty({B * S, K}, DType::I32);
      for (int64_t i = 0; i < B * S; ++i)
        for (int64_t k = 0; k < K; ++k) r.data<int32_t>()[i * K + k] = int32_t(k);  // padding: experts 0..K-1
      p.mb.routing.push_back(r);
    }
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<Tensor> rec = samples[size_t(b)].routing.tensors();
      for (int64_t l = 0; l < layers; ++l) {
        if (rec[size_t(l)].size(1) != K)
          MT_THROW("pack_rollouts: sample ", b, "'s routing has top-", rec[size_t(l)].size(1), ", the model top-", K);
        std::copy_n(rec[size_t(l)].data<int32_t>(), rec[size_t(l)].numel(),
                    p.mb.routing[size_t(l)].data<int32_t>() + b * S * K);
      }
    }
  }
  return p;
}

void set_token_values(PackedRollouts& p, size_t k, const std::vector<std::vector<float>>& v) {
  const int64_t B = int64_t(p.prompt_len.size()), S = p.S;
  if (int64_t(v.size()) != B) MT_THROW("set_token_values: ", v.size(), " samples of values for ", B, " samples");
  while (p.mb.token_values.size() <= k) p.mb.token_values.push_back(Tensor::zeros({B, S}));
  Tensor& t = p.mb.token_values[k];
  for (int64_t b = 0; b < B; ++b) {
    if (int64_t(v[size_t(b)].size()) != p.response_len[size_t(b)])
      MT_THROW("set_token_values: sample ", b, " has ", v[size_t(b)].size(), " values for ", p.response_len[size_t(b)],
               " response tokens");
    std::copy(v[size_t(b)].begin(), v[size_t(b)].end(), t.data<float>() + b * S + p.prompt_len[size_t(b)]);
  }
}

std::vector<std::vector<float>> response_values(const PackedRollouts& p, const Tensor& rows_BS) {
  const int64_t B = int64_t(p.prompt_len.size()), S = p.S;
  const Tensor h = rows_BS.to(Device::CPU);
  if (h.numel() != B * S || h.dtype() != DType::F32)
    MT_THROW("response_values: ", h.desc(), "; expected f32 [", B * S, "] (one value per target row)");
  std::vector<std::vector<float>> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < p.response_len[size_t(b)]; ++j)
      out[size_t(b)].push_back(h.data<float>()[b * S + p.prompt_len[size_t(b)] + j - 1]);
  return out;
}

}  // namespace mt::rl
