// Set-up the RL loop tests share (tests/rl): the tiny model without EOS, a policy session with its AdamW
// (no weight decay) and a rollout engine on its weights (routing recorded), a PPO critic started from the
// policy, fixed prompts, and a reward that varies inside a group.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/qwen3_moe.h"
#include "rl/grpo.h"
#include "rl/rewards/rewards.h"
#include "rl/rollout_batch.h"
#include "rollout/engine.h"
#include "train/session.h"

namespace mt::rltest {

// A reward program's options: its command, the deadline, the error policy.
inline rl::RewardProgramOptions program_options(const std::string& command, double timeout_s, bool stop_on_error) {
  rl::RewardProgramOptions o;
  o.command = command;
  o.timeout_s = timeout_s;
  o.stop_on_error = stop_on_error;
  return o;
}

inline ModelConfig tiny() {
  ModelConfig c = preset_model_config("tiny");
  c.eos_token_id = -1;
  return c;
}

struct Rig {
  std::unique_ptr<TrainSession> s;
  std::unique_ptr<RolloutEngine> engine;
};
// frozen: a reference-style session (weights only: no optimizer, no engine).
inline Rig make_rig(uint64_t init_seed, bool frozen = false) {
  Rig r;
  SessionOptions so;
  if (frozen) so.weights = Weights::Frozen;
  r.s = std::make_unique<TrainSession>(tiny(), so);
  r.s->init_weights(init_seed);
  if (frozen) return r;
  AdamWConfig ac;
  ac.weight_decay = 0;
  r.s->make_optimizer(ac, false);
  EngineOptions eo;
  eo.kv_cache_bytes = 32 << 20;
  eo.block_size = 8;
  eo.record_routing = true;
  r.engine = std::make_unique<RolloutEngine>(r.s->model(), eo);
  return r;
}

// PPO's critic: the policy's architecture with a value head, initialised from the policy, with its AdamW.
inline std::unique_ptr<TrainSession> make_critic(TrainSession& policy, uint64_t init_seed) {
  ModelConfig cc = tiny();
  cc.value_head = true;
  auto critic = std::make_unique<TrainSession>(cc, SessionOptions{});
  critic->init_weights(init_seed);
  rl::init_critic_from_policy(*critic, policy);
  AdamWConfig ac;
  ac.weight_decay = 0;
  critic->make_optimizer(ac, false);
  return critic;
}

// The fraction of a sample's tokens in the low eighth of the vocabulary: a reward that varies inside a group.
inline std::vector<double> low_token_reward(const std::vector<GenerateRequest>&,
                                            const std::vector<GeneratedSample>& g) {
  std::vector<double> r;
  for (const GeneratedSample& x : g) {
    double low = 0;
    for (int32_t t : x.tokens) low += t < 64 ? 1 : 0;
    r.push_back(low / double(x.tokens.size()));
  }
  return r;
}

inline std::vector<std::vector<int32_t>> fixed_prompts(int count) {
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < count; ++i) p.push_back({int32_t(100 + 7 * i), int32_t(200 + i), int32_t(300 + 3 * i)});
  return p;
}

// Expects f to throw (any std::exception) with `needle` in its message.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The engine's samples as the trainer takes them: each with its request's prompt, its routing record kept (replay)
// or dropped (the trainer routes itself).
inline std::vector<rl::RolloutSample> rollout_samples(const std::vector<GenerateRequest>& reqs,
                                                      const std::vector<GeneratedSample>& gen, bool keep_routing) {
  std::vector<rl::RolloutSample> out;
  for (const GeneratedSample& g : gen)
    out.push_back({reqs[size_t(g.prompt_index)].prompt, g.tokens, g.logprobs,
                   keep_routing ? g.routing : RoutingRecord(), {}});
  return out;
}

// The trainer's log-probs of the samples' response tokens: one forward of them packed into one micro-batch.
inline std::vector<std::vector<float>> trainer_logprobs(Qwen3MoeModel& m, const std::vector<rl::RolloutSample>& samples) {
  const rl::PackedRollouts p = rl::pack_rollouts(samples, m.config().num_experts_per_tok);
  PassOptions po;
  po.token_logprobs = true;
  return rl::response_values(p, m.forward(p.mb, po).logp);
}

}  // namespace mt::rltest
