// The rollout engine against the model's full forward (fp32 CPU): tokens decoded over the paged KV
// cache (prompts of different lengths in one batch, blocks of 4 tokens so boundaries are crossed,
// few running slots so sequences finish while others start, n samples sharing a prompt's blocks with
// copy-on-write) have the log-probabilities of a full forward over the same sequence (within 1e-5), and
// greedy tokens are its argmax; the routing recorded during generation is the routing of that forward;
// a request's tokens do not depend on what else is batched; bad requests are errors naming the value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "model/qwen3_moe.h"
#include "core/rng.h"
#include "rollout/engine.h"

using namespace mt;

namespace {

ModelConfig config(bool tied) {
  ModelConfig c = preset_model_config("tiny");
  c.tie_word_embeddings = tied;
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  c.eos_token_id = -1;
  return c;
}

std::vector<int32_t> prompt(int64_t len, int64_t seed, int64_t V) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < len; ++i) p.push_back(int32_t((seed * 131 + i * 17 + 3) % V));
  return p;
}

// Full forward over prompt + generated tokens: log_softmax(logits / T) at each generated position.
void check_against_forward(Qwen3MoeModel& m, const GenerateRequest& r, const GeneratedSample& s) {
  const int64_t L = int64_t(r.prompt.size()), G = int64_t(s.tokens.size()), S = L + G - 1, V = m.config().vocab_size;
  Tensor ids = Tensor::empty({1, S}, DType::I64);
  for (int64_t i = 0; i < S; ++i) ids.data<int64_t>()[i] = i < L ? r.prompt[size_t(i)] : s.tokens[size_t(i - L)];
  Tensor logits;
  m.forward(MicroBatch{ids, Tensor()}, &logits);
  const double T = r.sampling.temperature > 0 ? r.sampling.temperature : 1.0;
  for (int64_t g = 0; g < G; ++g) {
    const float* x = logits.data<float>() + (L - 1 + g) * V;
    double mx = -INFINITY;
    int64_t arg = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (x[v] > x[arg]) arg = v;  // the lowest id wins ties
      mx = std::max(mx, double(x[v]) / T);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(x[v]) / T - mx);
    const double want = double(x[s.tokens[size_t(g)]]) / T - mx - std::log(sum);
    EXPECT_NEAR(s.logprobs[size_t(g)], want, 1e-5) << "prompt " << s.prompt_index << " sample " << s.sample_index
                                                   << " token " << g;
    if (r.sampling.temperature == 0) EXPECT_EQ(s.tokens[size_t(g)], arg) << "greedy token " << g;
  }
  // The routing recorded while generating is that of the forward over every token the model read.
  const std::vector<Tensor> want_routing = m.last_routing(), got = s.routing.tensors();
  ASSERT_EQ(got.size(), want_routing.size());
  EXPECT_EQ(s.routing.bytes_per_id(), 1) << "8 experts: one byte per id";
  for (size_t l = 0; l < want_routing.size(); ++l) {
    ASSERT_EQ(got[l].shape(), want_routing[l].shape()) << "layer " << l;
    EXPECT_EQ(std::memcmp(got[l].raw(), want_routing[l].raw(), want_routing[l].nbytes()), 0) << "layer " << l;
  }
}

}  // namespace

TEST(RolloutEngine, CachedDecodingEqualsTheFullForward) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const ModelConfig c = config(tied);
    Qwen3MoeModel m(c);
    init_weights(c, m.table(), m.params(), 5);
    std::vector<GenerateRequest> reqs;
    for (int64_t i = 0; i < 5; ++i) {
      GenerateRequest r;
      r.prompt = prompt(3 + 4 * i + i % 2, i, c.vocab_size);  // 3, 8, 11, 16, 19 tokens
      r.max_new_tokens = 6 + 3 * i;
      r.sampling.temperature = i % 2 ? 0.8f : 0.0f;
      r.sampling.seed = uint64_t(100 + i);
      r.n = i == 1 || i == 2 ? 3 : 1;  // samples sharing a prompt: a partial last block is copied on write
      reqs.push_back(r);
    }
    EngineOptions eo;
    eo.block_size = 4;
    eo.max_running = 4;  // sequences finish while others wait
    eo.kv_cache_bytes = 64 << 20;
    eo.record_routing = true;
    RolloutEngine engine(m, eo);
    const std::vector<GeneratedSample> out = engine.generate(reqs);
    ASSERT_EQ(out.size(), 9u);
    EXPECT_GT(engine.stats().block_copies, 0);
    EXPECT_GT(engine.stats().steps, 20);
    for (const GeneratedSample& s : out) {
      const GenerateRequest& r = reqs[size_t(s.prompt_index)];
      EXPECT_EQ(int64_t(s.tokens.size()), r.max_new_tokens);
      EXPECT_EQ(s.finish_reason, "length");
      check_against_forward(m, r, s);
    }
    // Sampled siblings differ (temperature 0.8), greedy siblings agree.
    EXPECT_NE(out[1].tokens, out[2].tokens);
    EXPECT_EQ(out[4].tokens, out[5].tokens);
  }
}

TEST(RolloutEngine, TokensDoNotDependOnTheBatch) {
  const ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 6);
  GenerateRequest a;
  a.prompt = prompt(7, 1, c.vocab_size);
  a.max_new_tokens = 10;
  a.sampling.temperature = 1.0f;
  a.sampling.top_p = 0.9f;
  a.sampling.seed = 42;
  a.n = 2;
  GenerateRequest other = a;
  other.prompt = prompt(12, 2, c.vocab_size);
  other.sampling.seed = 7;
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_cache_bytes = 64 << 20;
  RolloutEngine e1(m, eo), e2(m, eo);
  const auto alone = e1.generate({a});
  const auto mixed = e2.generate({other, a, other});
  ASSERT_EQ(alone.size(), 2u);
  ASSERT_EQ(mixed.size(), 6u);
  for (int j = 0; j < 2; ++j) {
    EXPECT_EQ(alone[size_t(j)].tokens, mixed[size_t(2 + j)].tokens) << "sample " << j;
    for (size_t g = 0; g < alone[size_t(j)].logprobs.size(); ++g)
      EXPECT_NEAR(alone[size_t(j)].logprobs[g], mixed[size_t(2 + j)].logprobs[g], 1e-5);
  }
  GenerateRequest reseeded = a;
  reseeded.sampling.seed = 43;
  EXPECT_NE(e1.generate({reseeded})[0].tokens, alone[0].tokens);
}

TEST(RolloutEngine, StopTokensAndEos) {
  ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 7);
  GenerateRequest r;
  r.prompt = prompt(5, 3, c.vocab_size);
  r.max_new_tokens = 8;
  r.sampling.temperature = 0;
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  RolloutEngine e(m, eo);
  const auto free_run = e.generate({r});
  ASSERT_EQ(free_run[0].tokens.size(), 8u);
  // Stopping at the third greedy token: it is included, the reason is "stop".
  r.stop_token_ids = {free_run[0].tokens[2]};
  const auto stopped = e.generate({r});
  ASSERT_LE(stopped[0].tokens.size(), 3u);
  EXPECT_EQ(stopped[0].tokens.back(), free_run[0].tokens[2]);
  EXPECT_EQ(stopped[0].finish_reason, "stop");
}

TEST(RolloutEngine, ManySampledPromptsInACacheForOneAtATime) {
  // A KV budget that holds the n samples of about one prompt: the engine admits the prompts one after
  // another (every prompt's forks reserved at admission) and never runs out of blocks mid-step.
  ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 7);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    GenerateRequest r;
    r.prompt = prompt(11, 20 + i, c.vocab_size);
    r.n = 8;
    r.max_new_tokens = 6;
    r.ignore_eos = true;
    r.sampling.seed = uint64_t(i);
    reqs.push_back(r);
  }
  EngineOptions eo;
  eo.block_size = 16;
  eo.kv_cache_bytes = RolloutEngine::kv_bytes_needed(m, {reqs[0]}, eo.block_size) * 5 / 4;
  RolloutEngine e(m, eo);
  const auto out = e.generate(reqs);
  ASSERT_EQ(out.size(), 48u);
  for (const auto& g : out) EXPECT_EQ(g.tokens.size(), 6u);
}

TEST(RolloutEngine, BadRequestsAreErrorsNamingTheValue) {
  ModelConfig c = config(false);
  c.max_position_embeddings = 64;
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 8);
  EngineOptions eo;
  eo.kv_cache_bytes = 1 << 20;
  eo.block_size = 4;
  RolloutEngine e(m, eo);
  auto expect_error = [&](GenerateRequest r, const std::string& needle) {
    try {
      e.generate({r});
      ADD_FAILURE() << "no error; expected '" << needle << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  GenerateRequest ok;
  ok.prompt = {1, 2, 3};
  GenerateRequest r = ok;
  r.prompt = {};
  expect_error(r, "the prompt is empty");
  r = ok;
  r.prompt = {1, int32_t(c.vocab_size)};
  expect_error(r, "token " + std::to_string(c.vocab_size) + " at index 1 is outside the vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
  r = ok;
  r.max_new_tokens = 62;
  expect_error(r, "exceeds the model's max_position_embeddings (64)");
  r = ok;
  r.sampling.top_p = 0;
  expect_error(r, "top_p");
  r = ok;
  r.n = 0;
  expect_error(r, "n = 0 samples");
  r = ok;
  r.n = 200;
  r.max_new_tokens = 60;
  expect_error(r, "KV blocks; the cache holds");
}

// R3 routing replay on the engine's record: after generation the router weights change (as an update
// would); a trainer forward without replay then routes some tokens elsewhere (mismatch > 0), and with
// the record replayed (MicroBatch::routing) it uses exactly the recorded experts (mismatch 0).
TEST(RolloutEngine, RecordedRoutingReplaysInTheTrainerAfterTheRouterMoves) {
  const ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 9);
  GenerateRequest r;
  r.prompt = prompt(9, 4, c.vocab_size);
  r.max_new_tokens = 12;
  r.sampling.temperature = 0.7f;
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.record_routing = true;
  RolloutEngine e(m, eo);
  const GeneratedSample s = e.generate({r})[0];
  const int64_t S = int64_t(r.prompt.size() + s.tokens.size()) - 1;
  ASSERT_EQ(s.routing.tokens(), S);
  Tensor ids = Tensor::empty({1, S}, DType::I64);
  for (int64_t i = 0; i < S; ++i)
    ids.data<int64_t>()[i] = i < int64_t(r.prompt.size()) ? r.prompt[size_t(i)] : s.tokens[size_t(i) - r.prompt.size()];
  // Move every router (an update's effect).
  Rng rng(3);
  for (const ParamEntry& pe : m.table().entries())
    if (pe.name.find("mlp.gate.weight") != std::string::npos) {
      Tensor noise = Tensor::empty({pe.numel});
      rng.fill_normal(noise, 0, 0.5f);
      Tensor w = m.params().rows(pe.offset, pe.numel);
      for (int64_t i = 0; i < pe.numel; ++i) w.data<float>()[i] += noise.data<float>()[i];
    }
  m.refresh_compute_weights();
  m.forward(MicroBatch{ids, Tensor()}, nullptr);
  const double free_mismatch = routing_mismatch(s.routing.tensors(), m.last_routing());
  EXPECT_GT(free_mismatch, 0.05) << "the moved router should route some tokens elsewhere";
  MicroBatch replay{ids, Tensor()};
  replay.routing = s.routing.tensors();
  m.forward(replay, nullptr);
  EXPECT_EQ(routing_mismatch(s.routing.tensors(), m.last_routing()), 0.0);
  std::printf("routing mismatch after the router moved: %.3f without replay, 0 with\n", free_mismatch);
}
