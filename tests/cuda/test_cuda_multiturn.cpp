// Multi-turn rollouts on the GPU: decode steps replayed from CUDA graphs between eager steps that run appended
// tokens over a sequence's cached prefix give the tokens of the same episodes with graphs off (log-probs within
// bf16 noise: the eager steps run at the unpadded batch, so their GEMMs may pick other algorithms; routing bit for
// bit).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "cuda_session_util.h"
#include "cuda_test_util.h"
#include "model/qwen3_moe.h"
#include "rollout/engine.h"
#include "train/session.h"

using namespace mt;

namespace {

ModelConfig multiturn_config() {
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  c.eos_token_id = -1;
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

}  // namespace

TEST(CudaMultiTurn, GraphsOnGiveTheTokensOfGraphsOff) {
  MT_REQUIRE_GPU();
  const ModelConfig c = multiturn_config();
  const std::unique_ptr<TrainSession> session = cudatest::frozen_cuda_session(c, 21);
  TrainSession& s = *session;
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 6; ++i) {
    GenerateRequest r;
    for (int64_t p = 0; p < 3 + 2 * i; ++p) r.prompt.push_back(int32_t((i * 131 + p * 17 + 3) % c.vocab_size));
    r.n = i == 1 ? 3 : 1;
    r.max_new_tokens = 48;
    r.max_turn_tokens = 4 + i;  // turns end at different steps: appends and decodes share steps
    r.sampling.temperature = i % 2 ? 1.0f : 0.0f;
    r.sampling.seed = uint64_t(30 + i);
    if (i == 3) {
      r.sampling.top_k = 20;
      r.sampling.top_p = 0.9f;
    }
    r.stop_token_ids = {7, 77, 177, 277};
    reqs.push_back(r);
  }
  // Three turns; after each, 2 + turn tokens of a deterministic observation.
  const TurnFn env = [V = c.vocab_size](const std::vector<TurnEnd>& ends) {
    std::vector<TurnReply> out;
    for (const TurnEnd& e : ends) {
      TurnReply r;
      r.done = e.turn >= 2;
      for (int64_t k = 0; k < 2 + e.turn; ++k)
        r.append.push_back(int32_t((5 + 13 * e.prompt_index + 7 * e.sample_index + 11 * e.turn + k) % V));
      out.push_back(r);
    }
    return out;
  };
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_cache_bytes = 16 << 20;
  eo.record_routing = true;
  eo.cuda_graphs = false;
  RolloutEngine eager(s.model(), eo);
  eo.cuda_graphs = true;
  RolloutEngine graphs(s.model(), eo);
  const std::vector<GeneratedSample> a = eager.generate(reqs, env), b = graphs.generate(reqs, env);
  EXPECT_EQ(eager.stats().graph_steps, 0);
  EXPECT_GT(graphs.stats().graph_steps, 10);
  EXPECT_GT(graphs.stats().append_tokens, 0);
  std::printf("multi-turn graphs: %lld of %lld steps replayed, %lld appended tokens, %lld captures\n",
              (long long)graphs.stats().graph_steps, (long long)graphs.stats().steps,
              (long long)graphs.stats().append_tokens, (long long)graphs.stats().graph_captures);
  ASSERT_EQ(a.size(), b.size());
  double max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "sample " << i;
    EXPECT_EQ(a[i].model_mask, b[i].model_mask) << "sample " << i;
    EXPECT_EQ(a[i].turn_starts, b[i].turn_starts) << "sample " << i;
    EXPECT_GT(a[i].turn_starts.size(), 1u) << "sample " << i << ": the episodes should take several turns";
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    for (size_t t = 0; t < a[i].logprobs.size(); ++t)
      max_diff = std::max(max_diff, double(std::fabs(a[i].logprobs[t] - b[i].logprobs[t])));
    const std::vector<Tensor> ra = a[i].routing.tensors(), rb = b[i].routing.tensors();
    ASSERT_EQ(ra.size(), rb.size());
    EXPECT_EQ(a[i].routing.tokens(), int64_t(reqs[size_t(a[i].prompt_index)].prompt.size() + a[i].tokens.size()) - 1);
    for (size_t l = 0; l < ra.size(); ++l) EXPECT_TRUE(same_bits(ra[l], rb[l])) << "sample " << i << " layer " << l;
  }
  EXPECT_LT(max_diff, 2e-3);
  std::printf("multi-turn graphs vs eager: max |dlogprob| %.2e\n", max_diff);
}
