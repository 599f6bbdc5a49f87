// Multi-turn rollouts (RolloutEngine::generate with a turn callback, fp32 CPU, the tiny model with random
// weights): an episode generated turn by turn over its cached prefix, with the caller's tokens appended between
// turns, equals generating each turn from scratch with the whole history as the prompt (tokens, log-probs and
// routing bit for bit); the limits (max_turns, max_turn_tokens, the response budget dropping an append,
// max_observation_tokens), the masks and turn starts, chunked appends under a small step budget, batch
// independence, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>

#include "backend/cpu/gemm.h"
#include "model/qwen3_moe.h"
#include "rollout/engine.h"

using namespace mt;

namespace {

ModelConfig config() {
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  c.eos_token_id = -1;
  return c;
}

std::vector<int32_t> prompt(int64_t len, int64_t seed, int64_t V) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < len; ++i) p.push_back(int32_t((seed * 131 + i * 17 + 3) % V));
  return p;
}

// The deterministic environment's observation after turn t of (prompt, sample): `len` tokens.
std::vector<int32_t> observation(const TurnEnd& e, int64_t len, int64_t V) {
  std::vector<int32_t> o;
  for (int64_t i = 0; i < len; ++i)
    o.push_back(int32_t((7 + 13 * e.prompt_index + 5 * e.sample_index + 11 * e.turn + 3 * i) % V));
  return o;
}

// Appends `obs_len` tokens after each turn and ends the episode after `turns` turns; logs every TurnEnd.
struct FixedEnv {
  FixedEnv(int64_t turns_, int64_t obs_len_, int64_t V_) : turns(turns_), obs_len(obs_len_), V(V_) {}
  int64_t turns, obs_len, V;
  std::vector<TurnEnd> log;
  int64_t calls = 0;
  TurnFn fn() {
    return [this](const std::vector<TurnEnd>& ends) {
      ++calls;
      std::vector<TurnReply> out;
      for (const TurnEnd& e : ends) {
        log.push_back(e);
        TurnReply r;
        r.done = e.turn + 1 >= turns;
        if (!r.done) r.append = observation(e, obs_len, V);
        out.push_back(r);
      }
      return out;
    };
  }
};

// Whether the CPU sgemm computes a row the same whatever the other rows (then the engine's log-probs are equal bit for
// bit whichever way tokens are batched). OpenBLAS is not: it takes another kernel for products of one or two rows, so
// a decode step's row differs from the same row in a prefill in the last bits (0.3.21, SkylakeX: 415 of 512 outputs
// of row 0 differ between M = 1 and M = 3). With a row-independent sgemm (the loops of gemm_noblas.cpp, or OpenBLAS's
// cblas_sgemm replaced by such loops through LD_PRELOAD) every comparison below holds bit for bit.
// Probed at the tiny model's shapes (K, N among 32, 64, 128, 512) for M = 1 to 4 and 9 rows.
bool gemm_rows_independent() {
  for (int64_t K : {32, 64, 128})
    for (int64_t N : {32, 64, 128, 512}) {
      std::vector<float> A(9 * K), B(N * K), one(N), many(9 * N);
      for (size_t i = 0; i < A.size(); ++i) A[i] = float(std::sin(0.37 * double(i)));
      for (size_t i = 0; i < B.size(); ++i) B[i] = float(std::cos(0.11 * double(i)));
      cpu::sgemm(false, true, 1, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, one.data(), N);
      for (int64_t M : {2, 3, 4, 9}) {
        cpu::sgemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, many.data(), N);
        if (std::memcmp(one.data(), many.data(), size_t(N) * sizeof(float)) != 0) return false;
      }
    }
  return true;
}

// Log-probs equal bit for bit where the sgemm's rows are independent; else within kLogprobTol.
constexpr double kLogprobTol = 1e-5;  // what RolloutEngine's tests allow between cached decoding and a full forward
double max_logprob_diff = 0;          // the largest seen, printed
bool same_logprobs(const std::vector<float>& a, const std::vector<float>& b) {
  static const bool exact = gemm_rows_independent();
  if (a.size() != b.size()) return false;
  if (exact) return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    max_logprob_diff = std::max(max_logprob_diff, d);
    if (!(d <= kLogprobTol)) return false;
  }
  return true;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool same_routing(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l)
    if (a[l].shape() != b[l].shape() || std::memcmp(a[l].raw(), b[l].raw(), a[l].nbytes()) != 0) return false;
  return true;
}

// The masks, log-probs and turn starts of a multi-turn sample against the TurnEnds its episode produced.
void check_layout(const GenerateRequest& r, const GeneratedSample& s, const std::vector<TurnEnd>& turns) {
  ASSERT_EQ(s.model_mask.size(), s.tokens.size());
  ASSERT_EQ(s.logprobs.size(), s.tokens.size());
  ASSERT_EQ(s.turn_starts.size(), turns.size());
  for (size_t k = 0; k < turns.size(); ++k) {
    const int64_t b = s.turn_starts[k], len = int64_t(turns[k].tokens.size());
    const int64_t end = k + 1 < turns.size() ? s.turn_starts[k + 1] : int64_t(s.tokens.size());
    ASSERT_LE(b + len, end);
    EXPECT_EQ(std::vector<int32_t>(s.tokens.begin() + b, s.tokens.begin() + b + len), turns[k].tokens) << "turn " << k;
    for (int64_t i = b; i < end; ++i) {
      EXPECT_EQ(s.model_mask[size_t(i)], i < b + len ? 1 : 0) << "token " << i;
      if (i >= b + len) {
        EXPECT_EQ(s.logprobs[size_t(i)], 0.0f) << "appended token " << i;
      }
    }
  }
  EXPECT_EQ(s.turn_starts[0], 0);
  EXPECT_LE(int64_t(s.tokens.size()), r.max_new_tokens);
  if (!s.routing.empty()) {
    EXPECT_EQ(s.routing.tokens(), int64_t(r.prompt.size() + s.tokens.size()) - 1);
  }
}

// The TurnEnds of one episode, in turn order.
std::vector<TurnEnd> episode(const std::vector<TurnEnd>& log, int64_t p, int64_t j) {
  std::vector<TurnEnd> out;
  for (const TurnEnd& e : log)
    if (e.prompt_index == p && e.sample_index == j) out.push_back(e);
  return out;
}

EngineOptions engine_options() {
  EngineOptions eo;
  eo.block_size = 4;  // turns and appends cross block boundaries; forks copy on write
  eo.kv_cache_bytes = 64 << 20;
  eo.record_routing = true;
  return eo;
}

}  // namespace

// THE equivalence: each turn of each episode equals plain generate over the history up to that turn (prompt,
// earlier turns, appended tokens) with the same seed and sample index: tokens, log-probs and routing bit for bit.
TEST(RolloutMultiTurn, EachTurnEqualsGeneratingFromScratchOverItsHistory) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 11);
  for (float T : {1.0f, 0.0f}) {
    SCOPED_TRACE(T == 0 ? "greedy" : "temperature 1");
    std::vector<GenerateRequest> reqs;
    for (int64_t i = 0; i < 4; ++i) {
      GenerateRequest r;
      r.prompt = prompt(3 + 5 * i, i, c.vocab_size);  // 3, 8, 13, 18 tokens
      r.n = i % 2 ? 3 : 2;
      r.max_new_tokens = 40;
      r.max_turn_tokens = 4 + i;
      r.sampling.temperature = T;
      r.sampling.seed = uint64_t(50 + i);
      for (int32_t t = 0; t < 48; ++t) r.stop_token_ids.push_back(t * 7 % int32_t(c.vocab_size));  // some turns stop
      reqs.push_back(r);
    }
    EngineOptions eo = engine_options();
    eo.max_running = 5;  // episodes finish while others wait
    RolloutEngine engine(m, eo);
    FixedEnv env{3, 3, c.vocab_size};
    const std::vector<GeneratedSample> out = engine.generate(reqs, env.fn());
    ASSERT_EQ(out.size(), 10u);
    EXPECT_GT(engine.stats().append_tokens, 0);
    EXPECT_GT(engine.stats().block_copies, 0);
    // From scratch: for each episode and turn, the history as the prompt, n = sample + 1 (the same sample index),
    // the turn's length as max_new_tokens; all in one plain generate call.
    std::vector<GenerateRequest> refs;
    std::vector<std::tuple<size_t, size_t, int64_t>> ref_of;  // (sample row, turn, history length)
    int64_t stops = 0;
    for (size_t si = 0; si < out.size(); ++si) {
      const GeneratedSample& s = out[si];
      const GenerateRequest& r = reqs[size_t(s.prompt_index)];
      const std::vector<TurnEnd> turns = episode(env.log, s.prompt_index, s.sample_index);
      ASSERT_EQ(turns.size(), 3u) << "sample " << si;
      check_layout(r, s, turns);
      EXPECT_EQ(s.finish_reason, "stop") << "the environment ended every episode";
      for (size_t k = 0; k < turns.size(); ++k) {
        stops += turns[k].finish_reason == "stop";
        EXPECT_EQ(turns[k].turn, int64_t(k));
        if (k > 0) {
          EXPECT_EQ(std::vector<int32_t>(s.tokens.begin() + s.turn_starts[k] - 3, s.tokens.begin() + s.turn_starts[k]),
                    observation(turns[k - 1], 3, c.vocab_size));
        }
        GenerateRequest ref = r;
        ref.max_turn_tokens = 0;
        ref.prompt.insert(ref.prompt.end(), s.tokens.begin(), s.tokens.begin() + s.turn_starts[k]);
        ref.n = s.sample_index + 1;
        ref.max_new_tokens = int64_t(turns[k].tokens.size());
        refs.push_back(ref);
        ref_of.emplace_back(si, k, int64_t(ref.prompt.size()));
      }
    }
    EXPECT_GT(stops, 0) << "some turns should end at a stop token";
    EXPECT_LT(stops, 30) << "some turns should end at max_turn_tokens";
    RolloutEngine plain(m, engine_options());
    const std::vector<GeneratedSample> want = plain.generate(refs);
    size_t row = 0;
    for (size_t q = 0; q < refs.size(); ++q) {
      const auto [si, k, hist] = ref_of[q];
      const GeneratedSample& s = out[si];
      const GeneratedSample& w = want[row + size_t(s.sample_index)];
      row += size_t(refs[q].n);
      ASSERT_EQ(w.prompt_index, int64_t(q));
      const int64_t b = s.turn_starts[k], len = int64_t(w.tokens.size());
      SCOPED_TRACE("prompt " + std::to_string(s.prompt_index) + " sample " + std::to_string(s.sample_index) + " turn " +
                   std::to_string(k));
      EXPECT_EQ(std::vector<int32_t>(s.tokens.begin() + b, s.tokens.begin() + b + len), w.tokens);
      EXPECT_TRUE(same_logprobs(std::vector<float>(s.logprobs.begin() + b, s.logprobs.begin() + b + len), w.logprobs))
          << "log-probs differ";
      // The routing of every token the from-scratch run read: the history, then the turn's tokens but the last.
      EXPECT_TRUE(same_routing(s.routing.tensors(0, hist + len - 1), w.routing.tensors())) << "routing differs";
    }
  }
  std::printf("multi-turn vs from scratch: %s; max |dlogprob| %.2e\n",
              gemm_rows_independent() ? "row-independent sgemm, bit for bit" : "sgemm rows depend on the batch",
              max_logprob_diff);
}

// With max_turns 1 the callback sees the one turn and the sample is plain generate's.
TEST(RolloutMultiTurn, OneTurnIsPlainGenerate) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 12);
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 3; ++i) {
    GenerateRequest r;
    r.prompt = prompt(4 + 3 * i, i, c.vocab_size);
    r.n = 2;
    r.max_new_tokens = 9;
    r.sampling.temperature = 0.9f;
    r.sampling.seed = uint64_t(i);
    r.stop_token_ids = {5, 17, 200, 301};
    reqs.push_back(r);
  }
  RolloutEngine plain_e(m, engine_options()), turn_e(m, engine_options());
  const auto plain = plain_e.generate(reqs);
  std::vector<GenerateRequest> one = reqs;
  for (auto& r : one) r.max_turns = 1;
  FixedEnv env{5, 3, c.vocab_size};  // would continue: max_turns ends the episodes
  const auto turned = turn_e.generate(one, env.fn());
  ASSERT_EQ(plain.size(), turned.size());
  EXPECT_EQ(env.log.size(), plain.size());
  for (const TurnEnd& e : env.log) EXPECT_TRUE(e.last);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(plain[i].tokens, turned[i].tokens);
    EXPECT_TRUE(same_bits(plain[i].logprobs, turned[i].logprobs));
    EXPECT_EQ(turned[i].finish_reason, "length") << "max_turns ended an episode the environment would continue";
    EXPECT_EQ(plain[i].model_mask, std::vector<uint8_t>(plain[i].tokens.size(), 1));
    EXPECT_EQ(plain[i].turn_starts, std::vector<int64_t>{0});
    EXPECT_EQ(turned[i].turn_starts, std::vector<int64_t>{0});
  }
}

TEST(RolloutMultiTurn, LimitsEndTurnsAndEpisodes) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 13);
  RolloutEngine e(m, engine_options());
  GenerateRequest base;
  base.prompt = prompt(6, 1, c.vocab_size);
  base.sampling.temperature = 1.0f;
  base.sampling.seed = 9;
  base.max_turn_tokens = 4;
  base.max_new_tokens = 100;
  {  // max_turns: the environment never ends the episode.
    GenerateRequest r = base;
    r.max_turns = 3;
    FixedEnv env{100, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 3u);
    EXPECT_FALSE(env.log[0].last);
    EXPECT_FALSE(env.log[1].last);
    EXPECT_TRUE(env.log[2].last);
    for (const TurnEnd& t : env.log) {
      EXPECT_EQ(t.tokens.size(), 4u) << "max_turn_tokens";
      EXPECT_EQ(t.finish_reason, "length");
    }
    EXPECT_EQ(out[0].turn_starts, (std::vector<int64_t>{0, 7, 14}));
    EXPECT_EQ(out[0].tokens.size(), 18u);
    EXPECT_EQ(out[0].finish_reason, "length");
    EXPECT_EQ(env.log[0].tokens_left, 96);
    check_layout(r, out[0], env.log);
  }
  {  // The response budget drops an append that would leave the model no token: 4 + 3 + 4 = 11, 2 left < 3.
    GenerateRequest r = base;
    r.max_new_tokens = 13;
    FixedEnv env{100, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 2u);
    EXPECT_EQ(env.log[1].tokens_left, 2);
    EXPECT_FALSE(env.log[1].last);
    EXPECT_EQ(out[0].tokens.size(), 11u);
    EXPECT_EQ(out[0].append_tokens_cut, 3);
    EXPECT_EQ(out[0].finish_reason, "length");
    check_layout(r, out[0], env.log);
  }
  {  // At the boundary: an append of exactly the tokens left is dropped (it would leave the model none) ...
    GenerateRequest r = base;
    r.max_new_tokens = 14;  // 4 + 3 + 4, then 3 left for an append of 3
    FixedEnv env{100, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 2u);
    EXPECT_EQ(env.log[1].tokens_left, 3);
    EXPECT_EQ(out[0].tokens.size(), 11u);
    EXPECT_EQ(out[0].append_tokens_cut, 3);
    EXPECT_EQ(out[0].finish_reason, "length");
    check_layout(r, out[0], env.log);
  }
  {  // ... and one token shorter it is kept: the model's next turn gets the one token left.
    GenerateRequest r = base;
    r.max_new_tokens = 15;
    FixedEnv env{100, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 3u);
    EXPECT_EQ(env.log[2].tokens.size(), 1u);
    EXPECT_TRUE(env.log[2].last);
    EXPECT_EQ(out[0].tokens.size(), 15u);
    EXPECT_EQ(out[0].append_tokens_cut, 0);
    EXPECT_EQ(out[0].finish_reason, "length");
    check_layout(r, out[0], env.log);
  }
  {  // The budget ends a turn mid-way: the turn is the last one, whatever the reply; "length" even when done.
    GenerateRequest r = base;
    r.max_new_tokens = 9;  // 4 + 3 + 2
    FixedEnv env{2, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 2u);
    EXPECT_EQ(env.log[1].tokens.size(), 2u);
    EXPECT_TRUE(env.log[1].last);
    EXPECT_EQ(env.log[1].tokens_left, 0);
    EXPECT_EQ(out[0].tokens.size(), 9u);
    EXPECT_EQ(out[0].append_tokens_cut, 0);
    EXPECT_EQ(out[0].finish_reason, "length");
    check_layout(r, out[0], env.log);
  }
  {  // max_observation_tokens cuts long appends to their first tokens.
    GenerateRequest r = base;
    r.max_observation_tokens = 2;
    FixedEnv env{3, 5, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 3u);
    EXPECT_EQ(out[0].observation_tokens_cut, 6);
    EXPECT_EQ(out[0].turn_starts, (std::vector<int64_t>{0, 6, 12}));
    const std::vector<int32_t> first2(observation(env.log[0], 5, c.vocab_size));
    EXPECT_EQ(std::vector<int32_t>(out[0].tokens.begin() + 4, out[0].tokens.begin() + 6),
              std::vector<int32_t>(first2.begin(), first2.begin() + 2));
    EXPECT_EQ(out[0].finish_reason, "stop");
    check_layout(r, out[0], env.log);
  }
  {  // An empty append continues the episode right after the model's own last token.
    GenerateRequest r = base;
    FixedEnv env{2, 0, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    EXPECT_EQ(out[0].turn_starts, (std::vector<int64_t>{0, 4}));
    EXPECT_EQ(out[0].model_mask, std::vector<uint8_t>(8, 1));
  }
  {  // A stop token ends a turn ("stop"), and the next turn follows the append.
    GenerateRequest r = base;
    r.max_turn_tokens = 0;
    r.max_new_tokens = 60;
    for (int32_t t = 0; t < int32_t(c.vocab_size); t += 5) r.stop_token_ids.push_back(t);
    FixedEnv env{3, 3, c.vocab_size};
    const auto out = e.generate({r}, env.fn());
    ASSERT_EQ(env.log.size(), 3u);
    for (const TurnEnd& t : env.log) {
      EXPECT_EQ(t.finish_reason, "stop");
      EXPECT_EQ(t.tokens.back() % 5, 0);
    }
    check_layout(r, out[0], env.log);
  }
}

// Appended tokens longer than the step budget run as chunks over several steps; the tokens are those of a
// large budget, bit for bit.
TEST(RolloutMultiTurn, LongAppendsRunInChunksWithinTheStepBudget) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 14);
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 3; ++i) {
    GenerateRequest r;
    r.prompt = prompt(3, i, c.vocab_size);
    r.n = 2;
    r.max_new_tokens = 60;
    r.max_turn_tokens = 3 + i;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = uint64_t(70 + i);
    reqs.push_back(r);
  }
  EngineOptions big = engine_options(), small = engine_options();
  small.max_step_tokens = 5;  // 6 decodes at once leave no room: one chunk token per step, then more
  RolloutEngine eb(m, big), es(m, small);
  FixedEnv env_b{3, 11, c.vocab_size}, env_s{3, 11, c.vocab_size};
  const auto a = eb.generate(reqs, env_b.fn()), b = es.generate(reqs, env_s.fn());
  ASSERT_EQ(a.size(), b.size());
  EXPECT_GT(es.stats().steps, eb.stats().steps);
  EXPECT_GT(es.stats().append_tokens, 0);
  // A chunk's last token may run alone, as a decode does: the tokens run are the same in all.
  EXPECT_EQ(es.stats().append_tokens + es.stats().decode_tokens, eb.stats().append_tokens + eb.stats().decode_tokens);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "sample " << i;
    EXPECT_TRUE(same_logprobs(a[i].logprobs, b[i].logprobs)) << "sample " << i;
    EXPECT_TRUE(same_routing(a[i].routing.tensors(), b[i].routing.tensors())) << "sample " << i;
    EXPECT_EQ(a[i].turn_starts.size(), 3u);
  }
}

// An episode's tokens do not depend on what else is batched (other episodes, their appends and turns).
TEST(RolloutMultiTurn, EpisodesDoNotDependOnTheBatch) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 15);
  GenerateRequest a;
  a.prompt = prompt(7, 1, c.vocab_size);
  a.n = 2;
  a.max_new_tokens = 30;
  a.max_turn_tokens = 5;
  a.sampling.temperature = 1.0f;
  a.sampling.top_p = 0.9f;
  a.sampling.seed = 42;
  a.stop_token_ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  GenerateRequest other = a;
  other.prompt = prompt(12, 2, c.vocab_size);
  other.max_turn_tokens = 3;
  other.sampling.seed = 7;
  RolloutEngine e1(m, engine_options()), e2(m, engine_options());
  // The environment's reply depends on (prompt row, sample, turn): the request's row in each call.
  auto env_for = [&](int64_t row_of_a) {
    return [row_of_a, V = c.vocab_size](const std::vector<TurnEnd>& ends) {
      std::vector<TurnReply> out;
      for (TurnEnd e : ends) {
        if (e.prompt_index == row_of_a) e.prompt_index = 0;
        out.push_back({observation(e, 2 + e.turn, V), e.turn >= 2});
      }
      return out;
    };
  };
  const auto alone = e1.generate({a}, env_for(0));
  const auto mixed = e2.generate({other, a, other}, env_for(1));
  ASSERT_EQ(alone.size(), 2u);
  ASSERT_EQ(mixed.size(), 6u);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_EQ(alone[j].tokens, mixed[2 + j].tokens) << "sample " << j;
    EXPECT_TRUE(same_logprobs(alone[j].logprobs, mixed[2 + j].logprobs)) << "sample " << j;
    EXPECT_EQ(alone[j].turn_starts, mixed[2 + j].turn_starts);
    EXPECT_TRUE(same_routing(alone[j].routing.tensors(), mixed[2 + j].routing.tensors()));
  }
  EXPECT_NE(alone[0].tokens, alone[1].tokens);
}

TEST(RolloutMultiTurn, BadRequestsAndRepliesAreErrorsNamingTheValue) {
  const ModelConfig c = config();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 16);
  GenerateRequest ok;
  ok.prompt = {1, 2, 3};
  ok.n = 3;
  ok.max_new_tokens = 12;
  ok.max_turn_tokens = 2;
  EngineOptions eo = engine_options();
  eo.kv_cache_bytes = RolloutEngine::kv_bytes_needed(m, {ok}, eo.block_size);  // one episode's blocks: all of them
  RolloutEngine e(m, eo);
  auto expect_error = [&](const std::vector<GenerateRequest>& reqs, const TurnFn& fn, const std::string& needle) {
    try {
      e.generate(reqs, fn);
      ADD_FAILURE() << "no error; expected '" << needle << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  FixedEnv env{3, 2, c.vocab_size};
  GenerateRequest r = ok;
  expect_error({r}, TurnFn(),
               "request 0: max_turns (0), max_turn_tokens (2) and max_observation_tokens (0) apply to multi-turn "
               "episodes; give generate a turn callback or set them to 0");
  r.max_turns = -1;
  expect_error({r}, env.fn(), "max_turns (-1), max_turn_tokens (2) and max_observation_tokens (0) must be >= 0");
  expect_error(
      {ok}, [](const std::vector<TurnEnd>& ends) { return std::vector<TurnReply>(ends.size() + 1); },
      "turn callback: 4 replies for 3 ended turns; it must return one per TurnEnd, in their order");
  expect_error(
      {ok},
      [V = c.vocab_size](const std::vector<TurnEnd>& ends) {
        std::vector<TurnReply> out(ends.size(), TurnReply{{1, 2}, false});
        out.back().append = {3, int32_t(V)};
        return out;
      },
      "turn callback: reply 2 (prompt 0, sample 2, turn 0): appended token 512 at index 1 is outside the "
      "vocabulary [0, 512)");
  EXPECT_THROW(
      e.generate({ok},
                 [](const std::vector<TurnEnd>&) -> std::vector<TurnReply> { throw Error("the environment died"); }),
      Error);
  // After the errors every block is back: the episode that needs the whole cache runs.
  const auto out = e.generate({ok}, env.fn());
  ASSERT_EQ(out.size(), 3u);
  for (const auto& s : out) EXPECT_EQ(s.turn_starts.size(), 3u);
}

// The scheduler alone (no model), in a pool of exactly the blocks the requests reserve: seeded random stops and
// appends of 0 to 9 tokens under a step budget of 6 tokens. Appended tokens take their blocks within the
// reservation (the invariants hold after every step, nothing runs out), a step stays within its budget (or runs
// one forced chunk token), the draws come only at a chunk's end, and every block is back at the end.
TEST(RolloutMultiTurn, SchedulerAppendsStayWithinTheReservationAndTheStepBudget) {
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 5; ++i) {
    GenerateRequest r;
    for (int64_t p = 0; p < 2 + 3 * i; ++p) r.prompt.push_back(int32_t(10 + p));
    r.n = 1 + i % 3;
    r.max_new_tokens = 20 + 7 * i;
    r.max_turn_tokens = 2 + i;
    r.stop_token_ids = {99};
    reqs.push_back(r);
  }
  KvBlockManager sizing(1, 4);
  int64_t pool = 0;
  for (const GenerateRequest& r : reqs) pool += sizing.blocks_needed(int64_t(r.prompt.size()), r.max_new_tokens, r.n);
  KvBlockManager blocks(pool - 4, 4);  // not all at once: some prompts wait for blocks
  SchedulerOptions so;
  so.max_step_tokens = 6;
  so.multi_turn = true;
  so.vocab_size = 128;
  uint64_t state = 12345;
  auto rnd = [&](uint64_t m) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % m;
  };
  int64_t steps = 0, chunks = 0, split_chunks = 0, turns = 0;
  {
    Scheduler s(blocks, reqs, so);
    while (s.has_work()) {
      ASSERT_LT(++steps, 2000);
      const StepPlan p = s.schedule();
      blocks.check_invariants();
      EXPECT_TRUE(p.num_tokens <= so.max_step_tokens || p.num_tokens == p.num_decodes + 1 || p.num_prefills == 1)
          << "step " << steps << ": " << p.num_tokens << " tokens";
      for (const ScheduledSeq& e : p.seqs) {
        const int64_t pending = int64_t(e.seq->tokens.size()) - e.seq->cached;
        if (!e.prefill && !e.appended) EXPECT_EQ(e.num_tokens, 1);
        if (e.appended) {
          ++chunks;
          split_chunks += e.num_draws == 0;
          EXPECT_EQ(e.num_draws, e.num_tokens == pending ? 1 : 0);
        }
        EXPECT_EQ(blocks.num_tokens(e.seq->id), e.seq->cached + e.num_tokens);
      }
      StepDraws d;
      for (const ScheduledSeq& e : p.seqs)
        for (int64_t j = 0; j < e.num_draws; ++j) {
          d.tokens.push_back(rnd(6) == 0 ? 99 : int32_t(1 + rnd(50)));
          d.logprobs.push_back(-1.0f);
        }
      s.update(p, d);
      if (s.awaiting_replies()) {
        std::vector<TurnReply> replies;
        for (const TurnEnd& t : s.turn_ends()) {
          ++turns;
          EXPECT_FALSE(t.tokens.empty());
          EXPECT_GE(t.tokens_left, 0);
          TurnReply r;
          r.done = rnd(5) == 0;
          for (uint64_t k = rnd(10); k > 0; --k) r.append.push_back(int32_t(100 + k));
          replies.push_back(r);
        }
        s.reply(replies);
      }
      blocks.check_invariants();
    }
    ASSERT_EQ(s.num_finished(), 1 + 2 + 3 + 1 + 2);
    for (const auto& sp : s.finished()) {
      const Sequence& q = *sp;
      const int64_t response = int64_t(q.tokens.size()) - q.prompt_len;
      EXPECT_LE(response, reqs[size_t(q.req)].max_new_tokens);
      EXPECT_EQ(int64_t(q.model_mask.size()), response);
      EXPECT_EQ(q.model_mask.back(), 1) << "an episode ends on a model token";
      for (size_t k = 0; k < q.turn_starts.size(); ++k) EXPECT_EQ(q.model_mask[size_t(q.turn_starts[k])], 1);
    }
  }
  EXPECT_GT(split_chunks, 0) << "some appends should run over several steps";
  EXPECT_GT(chunks, split_chunks);
  EXPECT_GT(turns, 30);
  EXPECT_EQ(blocks.stats().free_blocks, blocks.num_blocks());
  EXPECT_EQ(blocks.stats().reserved_blocks, 0);
}
