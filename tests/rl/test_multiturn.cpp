// Multi-turn GRPO (rl/multiturn.h, docs/rl.md "Multi-turn GRPO"), fp32 CPU on the tiny model:
//   observation tokens (model_mask 0) are labelled -100 and get weight 0, in no denominator: an update on
//     rollouts with appended tokens equals the same update written out by hand with those tokens' weights
//     zeroed, and the observations' rollout log-probs (wildly off) change nothing;
//   per-turn credit: returns from each turn on, normalised over the group's turns, by hand;
//   run_episodes with a scripted environment: init's observations after the prompt, each turn's reply
//     appended (mask and turn starts), per-turn rewards, close for every episode, the error policy;
//   grpo_step against an environment: the episodes' rewards train, the metrics count turns;
//   the built-in environments on the demo's problems (retry's rewards 1 / 0.5 / 0, its "try again", the
//     calculator's call) and the demo codec.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <fstream>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "model/hf_checkpoint.h"
#include "rl/tasks/addition.h"
#include "train/session.h"
#include "rl/advantages.h"
#include "rl/env/builtin_envs.h"
#include "rl/grpo.h"
#include "rl/multiturn.h"
#include "rl/policy_loss.h"
#include "rl/rl_test_util.h"
#include "rl/rollout_batch.h"
#include "test_util.h"

using namespace mt;
using namespace mt::rl;
using namespace mt::rltest;
namespace fs = std::filesystem;

namespace {

using testutil::rel_l2;

// Ids as text "5 6 7" and back: a codec for the tiny model's vocabulary.
TurnCodec number_codec() {
  TurnCodec c;
  c.decode = [](const std::vector<int32_t>& ids) {
    std::string s;
    for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
    return s;
  };
  c.encode = [](const std::vector<EnvObservation>& obs) {
    std::vector<int32_t> ids;
    for (const EnvObservation& o : obs) {
      size_t i = 0;
      while (i < o.content.size()) {
        size_t j = o.content.find(' ', i);
        if (j == std::string::npos) j = o.content.size();
        if (j > i) ids.push_back(std::stoi(o.content.substr(i, j - i)));
        i = j + 1;
      }
    }
    return ids;
  };
  return c;
}

// A scripted environment: init appends "9 9" (when asked); turn 0 earns 0.25 plus 0.5 when its first token
// is even, then "7 8 9" is appended; turn 1 earns 1 and ends. Episodes listed in fail_step fail their step.
class ScriptEnv : public Environment {
 public:
  bool init_obs = true;
  std::set<int64_t> fail_step;
  std::vector<int64_t> closed;
  std::vector<EnvTurn> seen;
  std::vector<EnvEpisode> inited;
  std::string name() const override { return "script"; }
  std::vector<EnvInitResult> init(const std::vector<EnvEpisode>& eps) override {
    inited.insert(inited.end(), eps.begin(), eps.end());
    std::vector<EnvInitResult> out(eps.size());
    for (EnvInitResult& r : out)
      if (init_obs) r.observations.push_back({"user", "9 9"});
    return out;
  }
  std::vector<EnvStepResult> step(const std::vector<EnvTurn>& turns) override {
    std::vector<EnvStepResult> out(turns.size());
    for (size_t i = 0; i < turns.size(); ++i) {
      seen.push_back(turns[i]);
      if (fail_step.count(turns[i].id)) {
        out[i].error = "scripted failure";
        continue;
      }
      if (turns[i].turn == 0) {
        out[i].reward = 0.25 + (turns[i].ids.at(0) % 2 == 0 ? 0.5 : 0.0);
        out[i].done = false;
        out[i].observations.push_back({"user", "7 8 9"});
        out[i].metadata["even"] = turns[i].ids.at(0) % 2 == 0;
      } else {
        out[i].reward = 1;
      }
    }
    return out;
  }
  void close(const std::vector<int64_t>& ids) override { closed.insert(closed.end(), ids.begin(), ids.end()); }
};

std::vector<int32_t> addition_ids(const Problem& p) {
  return std::vector<int32_t>(p.prompt_ids.begin(), p.prompt_ids.end());
}

std::vector<GenerateRequest> requests(int prompts, int64_t n, int64_t max_new) {
  std::vector<GenerateRequest> reqs;
  for (const std::vector<int32_t>& p : fixed_prompts(prompts)) {
    GenerateRequest q;
    q.prompt = p;
    q.n = n;
    q.max_new_tokens = max_new;
    q.sampling.temperature = 1.0f;
    q.sampling.seed = uint64_t(reqs.size()) + 3;
    reqs.push_back(q);
  }
  return reqs;
}

MultiTurnOptions two_turns() {
  MultiTurnOptions o;
  o.max_turns = 2;
  o.max_turn_tokens = 3;
  o.max_observation_tokens = 8;
  return o;
}

}  // namespace

TEST(MultiTurnBatch, ObservationTokensAreLabelledLikePromptTokens) {
  RolloutSample s{{5, 6}, {10, 11, 12, 13}, {-1, 0, 0, -1}, {}, {1, 0, 0, 1}};
  const PackedRollouts p = pack_rollouts({s}, 2);
  const int64_t* lab = p.mb.labels.data<int64_t>();
  const int64_t* ids = p.mb.input_ids.data<int64_t>();
  EXPECT_EQ(std::vector<int64_t>(lab, lab + 6), (std::vector<int64_t>{-100, -100, 10, -100, -100, 13}));
  EXPECT_EQ(std::vector<int64_t>(ids, ids + 6), (std::vector<int64_t>{5, 6, 10, 11, 12, 13})) << "read all the same";
  s.model_mask = {1, 0};
  expect_error([&] { pack_rollouts({s}, 2); }, "model mask of 2 entries for 4 response tokens");
}

// An observation token counts in no denominator and no mismatch correction: the weights of a sample with
// observations equal those of the same sample with them cut out, and 0 on them.
TEST(MultiTurnBatch, MiniBatchWeightsLeaveObservationsOut) {
  const std::vector<std::vector<double>> old = {{-1, -2, -30, -3}, {-1, -1}}, roll = {{-1.1, -2, 0, -3.2}, {-1, -1.5}};
  const std::vector<std::vector<uint8_t>> mask = {{1, 1, 0, 1}, {}};
  MismatchConfig m;
  m.tis_cap = 2;
  m.tis_sequence = true;
  m.token_mask_low = 0.5;
  m.token_mask_high = 2;
  for (LossAggregation a : {LossAggregation::TokenMean, LossAggregation::SeqMeanTokenMean}) {
    const MiniBatchWeights w = minibatch_weights(old, roll, {false, false}, a, 8, m, mask);
    const MiniBatchWeights cut =
        minibatch_weights({{-1, -2, -3}, {-1, -1}}, {{-1.1, -2, -3.2}, {-1, -1.5}}, {false, false}, a, 8, m);
    EXPECT_EQ(w.w[0][2], 0) << int(a);
    EXPECT_DOUBLE_EQ(w.w[0][0], cut.w[0][0]) << int(a);
    EXPECT_DOUBLE_EQ(w.w[0][1], cut.w[0][1]) << int(a);
    EXPECT_DOUBLE_EQ(w.w[0][3], cut.w[0][2]) << int(a);
    EXPECT_EQ(w.w[1], cut.w[1]) << int(a);
    EXPECT_EQ(w.tokens, cut.tokens) << int(a);
    EXPECT_EQ(w.masked, cut.masked) << "the observation's wild ratio masks nothing";
  }
  expect_error(
      [&] {
        minibatch_weights(old, roll, {false, false}, LossAggregation::TokenMean, 8, m, {{1}});
      },
      "1 model masks for 2 samples");
}

// The update on rollouts with appended observation tokens equals the update by hand on the same packed rows
// with those tokens' weight set to 0 (and the token-mean over the model's tokens); the observations' rollout
// log-probs, far off, mask nothing and change nothing.
TEST(MultiTurnUpdate, ObservationTokensTrainNothing) {
  Rig a = make_rig(41), b = make_rig(41);
  std::vector<GenerateRequest> reqs = requests(2, 4, 7);
  const std::vector<GeneratedSample> gen = a.engine->generate(reqs);
  RolloutGroups g;
  int64_t model_tokens = 0;
  for (const GeneratedSample& x : gen) {
    RolloutSample s{reqs[size_t(x.prompt_index)].prompt, x.tokens, x.logprobs, x.routing, {}};
    // Tokens 2 and 3 of every response stand for an observation the environment appended.
    s.model_mask.assign(s.response.size(), 1);
    s.model_mask[2] = s.model_mask[3] = 0;
    for (uint8_t k : s.model_mask) model_tokens += k;
    g.samples.push_back(s);
    g.rewards.push_back(double(x.tokens[0] % 3));
  }
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 7;
  o.lr = 0;
  o.mismatch.token_mask_low = 1e-3;  // the trainer and engine agree to rounding: only a wild ratio masks
  o.mismatch.token_mask_high = 1e3;
  const GrpoMetrics m1 = grpo_update(*a.s, g, o, 1);
  EXPECT_EQ(m1.masked_fraction, 0);
  const Tensor grads1 = a.s->grads().clone();
  RolloutGroups wild = g;
  for (RolloutSample& s : wild.samples) s.logprobs[2] = s.logprobs[3] = -50;
  const GrpoMetrics m2 = grpo_update(*a.s, wild, o, 1);
  EXPECT_EQ(m2.masked_fraction, 0);
  EXPECT_EQ(m2.loss, m1.loss);
  EXPECT_LT(rel_l2(a.s->grads(), grads1), 1e-6);
  // By hand: every response token a target, the observations' weight 0.
  std::vector<RolloutSample> plain = g.samples;
  for (RolloutSample& s : plain) s.model_mask.clear();
  PackedRollouts p = pack_rollouts(plain, b.s->model().config().num_experts_per_tok);
  PassOptions po;
  po.token_logprobs = true;
  const std::vector<std::vector<float>> old = response_values(p, b.s->model().forward(p.mb, po).logp);
  const std::vector<double> adv = grpo_advantages(g.rewards, o.n, true);
  std::vector<std::vector<float>> adv_t, w_t;
  for (size_t i = 0; i < plain.size(); ++i) {
    adv_t.emplace_back(plain[i].response.size(), float(adv[i]));
    w_t.emplace_back(plain[i].response.size(), float(1.0 / double(model_tokens)));
    w_t.back()[2] = w_t.back()[3] = 0;
    adv_t.back()[2] = adv_t.back()[3] = 123.0f;  // an observation's advantage: weight 0, no effect
  }
  set_token_values(p, PolicyObjective::kAdvantage, adv_t);
  set_token_values(p, PolicyObjective::kOldLogp, old);
  set_token_values(p, PolicyObjective::kWeight, w_t);
  PolicyObjective obj(o.loss);
  StepOptions so;
  so.lr = 0;
  so.objective = &obj;
  const StepResult r = b.s->train_step({p.mb}, so);
  EXPECT_NEAR(r.loss, m1.loss, 1e-6 * std::max(1.0, std::abs(m1.loss)));
  EXPECT_GT(m1.grad_norm, 0);
  EXPECT_LT(rel_l2(a.s->grads(), b.s->grads()), 1e-5) << "masked update vs weights zeroed by hand";
}

TEST(MultiTurnAdvantages, PerTurnReturnsNormalisedOverTheGroupsTurns) {
  // Group of 2: sample 0 right at once (1), sample 1 wrong then right (0, 0.5).
  const std::vector<std::vector<double>> r = {{1}, {0, 0.5}};
  const std::vector<std::vector<double>> a = turn_advantages(r, 2, true);
  // Returns 1 | 0.5, 0.5: mean 2/3, unbiased std sqrt(((1/3)^2 + 2 (1/6)^2) / 2) = sqrt(1/12).
  const double m = 2.0 / 3, s = std::sqrt(1.0 / 12) + 1e-6;
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(a[1].size(), 2u);
  EXPECT_NEAR(a[0][0], (1 - m) / s, 1e-9);
  EXPECT_NEAR(a[1][0], (0.5 - m) / s, 1e-9);
  EXPECT_NEAR(a[1][1], (0.5 - m) / s, 1e-9);
  const std::vector<std::vector<double>> d = turn_advantages({{0.25, 1}, {0, 0}}, 2, false);
  EXPECT_DOUBLE_EQ(d[0][0], 1.25 - 0.5625);  // returns 1.25, 1 | 0, 0: mean 0.5625
  EXPECT_DOUBLE_EQ(d[0][1], 1 - 0.5625);
  expect_error([] { turn_advantages({{1}, {}}, 2, true); }, "sample 1 has no step reward");
}

TEST(MultiTurnAdvantages, PerTurnIndexNormalisesEachTurnOverTheGroupsSameTurn) {
  // Group of 3 under retry's rewards: right at once (1), right at the second try (0, 0.5), wrong twice (0, 0);
  // and a second group of 3 where only one sample reached a second turn.
  const std::vector<std::vector<double>> r = {{1}, {0, 0.5}, {0, 0}, {0, 1}, {1}, {1}};
  const std::vector<std::vector<double>> a = turn_advantages(r, 3, true, 1e-6, true);
  // Turn 0 returns 1, 0.5, 0: mean 0.5, unbiased std 0.5; turn 1 returns 0.5, 0: mean 0.25, std sqrt(0.125).
  const double s0 = 0.5 + 1e-6, s1 = std::sqrt(0.125) + 1e-6;
  EXPECT_NEAR(a[0][0], 0.5 / s0, 1e-9);
  EXPECT_NEAR(a[1][0], 0.0, 1e-9);
  EXPECT_NEAR(a[2][0], -0.5 / s0, 1e-9);
  EXPECT_NEAR(a[1][1], 0.25 / s1, 1e-9);  // the right second try against the other second try only
  EXPECT_NEAR(a[2][1], -0.25 / s1, 1e-9);
  // Second group, turn 0 returns 1, 1, 1: equal, so 0; its one turn 1 has no other to compare with: 0.
  EXPECT_NEAR(a[3][0], 0.0, 1e-9);
  EXPECT_NEAR(a[4][0], 0.0, 1e-9);
  EXPECT_NEAR(a[5][0], 0.0, 1e-9);
  EXPECT_EQ(a[3][1], 0.0);
  // The pooled form differs: there the right second try's turns are compared with every turn of the group.
  const std::vector<std::vector<double>> pooled = turn_advantages({{1}, {0, 0.5}, {0, 0}}, 3, true);
  EXPECT_GT(std::abs(pooled[1][1] - a[1][1]), 0.1);
  EXPECT_EQ(parse_turn_credit("per-turn-index"), TurnCredit::PerTurnIndex);
  EXPECT_STREQ(turn_credit_name(TurnCredit::PerTurnIndex), "per-turn-index");
}

// run_episodes on the tiny model (no EOS: a turn ends at max_turn_tokens) against the scripted environment.
TEST(MultiTurnEpisodes, TurnsObservationsRewardsAndClose) {
  Rig r = make_rig(7);
  ScriptEnv env;
  std::vector<GenerateRequest> reqs = requests(2, 3, 12);
  const std::vector<int32_t> prompt0 = reqs[0].prompt;
  const MultiTurnRound round = run_episodes(*r.engine, reqs, env, number_codec(), two_turns(), 100,
                                            {nlohmann::json{{"answer", 3}},
                                             nlohmann::json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}});
  ASSERT_EQ(round.samples.size(), 6u);
  ASSERT_EQ(env.inited.size(), 6u);
  EXPECT_EQ(env.inited[2].metadata, (nlohmann::json{{"answer", 3}})) << "the prompt's metadata, every sample";
  EXPECT_EQ(env.inited[2].messages, nlohmann::json::array());
  EXPECT_EQ(env.inited[3].metadata, nlohmann::json::object()) << "a chat's messages go to messages, not metadata";
  EXPECT_EQ(env.inited[3].messages, (nlohmann::json{{{"role", "user"}, {"content", "hi"}}}));
  EXPECT_EQ(env.inited[0].prompt, number_codec().decode(prompt0));
  std::vector<int32_t> want_prompt = prompt0;
  want_prompt.insert(want_prompt.end(), {9, 9});
  EXPECT_EQ(reqs[0].prompt, want_prompt) << "init's observations after the prompt";
  int64_t evens = 0;
  for (size_t i = 0; i < 6; ++i) {
    const GeneratedSample& g = round.samples[i];
    const EpisodeResult& e = round.episodes[i];
    ASSERT_EQ(g.tokens.size(), 9u) << i;
    EXPECT_EQ(g.model_mask, (std::vector<uint8_t>{1, 1, 1, 0, 0, 0, 1, 1, 1}));
    EXPECT_EQ(std::vector<int32_t>(g.tokens.begin() + 3, g.tokens.begin() + 6), (std::vector<int32_t>{7, 8, 9}));
    EXPECT_EQ(g.turn_starts, (std::vector<int64_t>{0, 6}));
    EXPECT_EQ(e.id, 100 + int64_t(i));
    const bool even = g.tokens[0] % 2 == 0;
    evens += even;
    EXPECT_EQ(e.turn_rewards, (std::vector<double>{even ? 0.75 : 0.25, 1.0}));
    EXPECT_TRUE(e.done);
    EXPECT_EQ(e.observation_tokens, 5);
    EXPECT_EQ(token_turns(g), (std::vector<int64_t>{0, 0, 0, 0, 0, 0, 1, 1, 1}));
  }
  EXPECT_DOUBLE_EQ(round.env_metrics.at("even").first, double(evens));
  EXPECT_EQ(round.env_metrics.at("even").second, 6);
  EXPECT_EQ(env.closed.size(), 6u);
  // The turn's text and ids as the environment saw them.
  ASSERT_FALSE(env.seen.empty());
  EXPECT_EQ(env.seen[0].text, number_codec().decode(env.seen[0].ids));
  EXPECT_EQ(env.seen[0].finish_reason, "length");
}

TEST(MultiTurnEpisodes, AnEnvironmentErrorZeroesTheEpisodeOrStops) {
  Rig r = make_rig(7);
  ScriptEnv env;
  env.init_obs = false;
  env.fail_step = {101};
  std::vector<GenerateRequest> reqs = requests(1, 3, 12);
  const MultiTurnRound round = run_episodes(*r.engine, reqs, env, number_codec(), two_turns(), 100);
  EXPECT_EQ(round.errors, 1);
  EXPECT_NE(round.first_error.find("episode 101: step 0: scripted failure"), std::string::npos) << round.first_error;
  EXPECT_EQ(round.episodes[1].turn_rewards, std::vector<double>{0});
  EXPECT_EQ(round.episodes[1].final_reward(), 0);
  EXPECT_EQ(round.samples[1].tokens.size(), 3u) << "the failed episode stopped after its turn";
  EXPECT_EQ(round.episodes[0].turn_rewards.size(), 2u);
  MultiTurnOptions stop = two_turns();
  stop.stop_on_error = true;
  env.closed.clear();
  env.fail_step = {201};
  std::vector<GenerateRequest> again = requests(1, 3, 12);
  expect_error([&] { run_episodes(*r.engine, again, env, number_codec(), stop, 200); },
               "episode 201: step 0: scripted failure (--reward-on-error stop)");
  EXPECT_EQ(env.closed.size(), 3u) << "closed on the way out";
}

// grpo_step with an environment: its rewards train (the weights move), the metrics count two turns and five
// observation tokens per episode; per-turn credit trains as well. A reward function is not called.
TEST(MultiTurnGrpo, StepAgainstAnEnvironment) {
  for (TurnCredit credit : {TurnCredit::Final, TurnCredit::PerTurn}) {
    Rig r = make_rig(9);
    ScriptEnv env;
    GrpoOptions o;
    o.n = 4;
    o.max_new_tokens = 12;
    o.lr = 1e-2;
    o.env = &env;
    o.codec = number_codec();
    o.multi_turn = two_turns();
    o.multi_turn.credit = credit;
    bool called = false;
    const RewardFn never = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      called = true;
      return std::vector<double>(g.size(), 0.0);
    };
    const GrpoMetrics m = grpo_step(*r.s, *r.engine, fixed_prompts(3), never, o, 1);
    EXPECT_FALSE(called);
    EXPECT_DOUBLE_EQ(m.turns_mean, 2);
    EXPECT_DOUBLE_EQ(m.observation_tokens_mean, 5);
    EXPECT_EQ(m.env_errors, 0);
    EXPECT_DOUBLE_EQ(m.reward_mean, 1) << "final credit's reward is the last turn's";
    EXPECT_TRUE(m.env_metrics.count("even"));
    // Final credit: every episode ends at 1, no group differs (dynamic sampling keeps none); per-turn credit
    // sees the first turn's rewards differ.
    if (credit == TurnCredit::PerTurn) {
      EXPECT_GT(m.groups_kept, 0);
    } else {
      EXPECT_EQ(m.groups_kept, 0);
    }
  }
}

TEST(MultiTurnBuiltin, RetryRewardsOneThenHalfAndAsksAgain) {
  std::unique_ptr<Environment> env = make_builtin_env("retry");
  const TurnCodec c = demo_codec();
  const Problem p = make_addition_problem(47, 85);  // 132, reversed "231"
  const std::string prompt = c.decode(addition_ids(p));
  EXPECT_EQ(prompt, "<bos>47+85=");
  EnvEpisode e;
  e.id = 1;
  e.prompt = prompt;
  EnvEpisode f = e;
  f.id = 2;
  EnvEpisode bad = e;
  bad.id = 3;
  bad.prompt = "<bos>47*85=";
  const std::vector<EnvInitResult> init = env->init({e, f, bad});
  EXPECT_TRUE(init[0].error.empty() && init[0].observations.empty());
  EXPECT_NE(init[2].error.find("'<bos>47*85=' is not an addition problem"), std::string::npos) << init[2].error;
  auto turn = [](int64_t id, int64_t k, const std::string& text, const std::string& finish) {
    EnvTurn t;
    t.id = id;
    t.turn = k;
    t.text = text;
    t.finish_reason = finish;
    return t;
  };
  std::vector<EnvStepResult> s = env->step({turn(1, 0, "231", "stop"), turn(2, 0, "230", "stop")});
  EXPECT_EQ(s[0].reward, 1);
  EXPECT_TRUE(s[0].done);
  EXPECT_EQ(s[0].metadata["first_try_correct"], 1);
  EXPECT_EQ(s[1].reward, 0);
  EXPECT_FALSE(s[1].done);
  ASSERT_EQ(s[1].observations.size(), 1u);
  EXPECT_EQ(s[1].observations[0].content, "<bos>47+85=");
  EXPECT_EQ(c.encode(s[1].observations), addition_ids(p));
  s = env->step({turn(2, 1, "231", "stop")});
  EXPECT_EQ(s[0].reward, kRetrySecondReward);
  EXPECT_TRUE(s[0].done);
  EXPECT_EQ(s[0].metadata["second_try_correct"], 1);
  // A first answer cut by the length limit: the problem is asked again after an <eos>, as in the demo's rows.
  EnvEpisode g = e;
  g.id = 4;
  env->init({g});
  s = env->step({turn(4, 0, "2311", "length")});
  EXPECT_EQ(s[0].observations[0].content, "<eos><bos>47+85=");
  s = env->step({turn(4, 1, "231", "length")});
  EXPECT_EQ(s[0].reward, 0) << "no <eos>: not an answer";
  env->close({1, 2, 4});
  s = env->step({turn(1, 0, "231", "stop")});
  EXPECT_NE(s[0].error.find("never initialised or is closed"), std::string::npos);
  expect_error([] { make_builtin_env("nope"); }, "builtin:nope is unknown; the built-in environments are");
}

TEST(MultiTurnBuiltin, CalculatorShowsTheSumOnACall) {
  std::unique_ptr<Environment> env = make_builtin_env("calculator");
  EnvEpisode e;
  e.id = 5;
  e.prompt = "<bos>478+85=";
  env->init({e});
  EnvTurn t;
  t.id = 5;
  t.text = "?";
  t.finish_reason = "stop";
  std::vector<EnvStepResult> s = env->step({t});
  EXPECT_FALSE(s[0].done);
  EXPECT_EQ(s[0].metadata["tool_call"], 1);
  EXPECT_EQ(s[0].observations.at(0).content, "<bos>478+85=365<eos><bos>478+85=");
  t.turn = 1;
  t.text = "365";
  s = env->step({t});
  EXPECT_EQ(s[0].reward, 1);
  EXPECT_TRUE(s[0].done);
}

// The calculator's start is trained on rows that must be the tokens of a real episode: the prompt, the call, what
// the environment appends after it (through the demo codec), then the answer; the loss on the answer (and on the
// call only when asked).
TEST(MultiTurnBuiltin, CalculatorStartRowsAreAnEpisodesTokens) {
  const Problem p = make_addition_problem(4781, 8522);
  std::unique_ptr<Environment> env = make_builtin_env("calculator");
  EnvEpisode e;
  e.id = 1;
  e.prompt = demo_codec().decode(addition::ids32(p.prompt_ids));
  ASSERT_TRUE(env->init({e})[0].error.empty());
  EnvTurn t;
  t.id = 1;
  t.text = "?";
  t.finish_reason = "stop";
  const std::vector<EnvStepResult> s = env->step({t});
  ASSERT_FALSE(s[0].done);
  std::vector<int64_t> want = p.prompt_ids;
  want.push_back(CharTokenizer{}.char_id('?'));
  want.push_back(CharTokenizer::kEos);
  for (int32_t id : demo_codec().encode(s[0].observations)) want.push_back(id);
  const size_t answer_at = want.size();
  want.insert(want.end(), p.answer_ids.begin(), p.answer_ids.end());
  for (const bool call_in_loss : {false, true}) {
    const addition::SupervisedRow r = addition::calculator_call_row(p, call_in_loss);
    std::vector<int64_t> got = r.prompt;
    got.insert(got.end(), r.response.begin(), r.response.end());
    EXPECT_EQ(got, want);
    ASSERT_EQ(r.in_loss.size(), r.response.size());
    for (size_t i = 0; i < r.response.size(); ++i) {
      const size_t at = r.prompt.size() + i;
      const bool want_loss = at >= answer_at || (call_in_loss && at < r.prompt.size() + 2);
      EXPECT_EQ(bool(r.in_loss[i]), want_loss) << "response token " << i << (call_in_loss ? " (call in loss)" : "");
    }
  }
}

// The start made end to end at a few steps (the recipe's 600 + up to 300 take a minute): from a demo-sized model
// directory to a checkpoint that loads, with its record.
TEST(MultiTurnBuiltin, CalculatorStartIsMadeAndLoads) {
  const fs::path dir = fs::temp_directory_path() / ("mt_calc_start_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const ModelConfig cfg = preset_model_config("demo");
  {
    SessionOptions so;
    TrainSession s(cfg, so);
    s.init_weights(3);
    save_hf_checkpoint((dir / "base").string(), cfg, s.table(), s.master());
  }
  addition::CalculatorStartOptions o;
  o.base = (dir / "base").string();
  o.run_dir = (dir / "start").string();
  o.copy_steps = 3;
  o.max_mixture_steps = 2;
  o.call_rate = 2.0;  // never reached: the mixture runs its 2 steps
  const std::string ckpt = addition::make_calculator_start(o);
  EXPECT_EQ(fs::path(ckpt).filename(), "checkpoint-5");
  std::ifstream f(fs::path(ckpt) / "train_state.json");
  const nlohmann::json st = nlohmann::json::parse(f);
  EXPECT_EQ(st.at("format"), "moetrain-calculator-start-1");
  EXPECT_EQ(st.at("model"), o.base);
  SessionOptions so;
  TrainSession loaded(load_model_config(ckpt), so);
  loaded.load(ckpt);
  SessionOptions so0;
  TrainSession base(cfg, so0);
  base.load(o.base);
  EXPECT_GT(rel_l2(loaded.master(), base.master()), 0.0) << "the start's steps changed nothing";
  fs::remove_all(dir);
}

TEST(MultiTurnBuiltin, DemoCodecRoundTripsAndNamesABadCharacter) {
  const TurnCodec c = demo_codec();
  EXPECT_EQ(c.decode({1, 7, 13, 8, 14, 2, 25}), "<bos>4+5=<eos><id 25>");
  EXPECT_EQ(c.encode({{"user", "<eos><bos>4+5="}}), (std::vector<int32_t>{2, 1, 7, 13, 8, 14}));
  expect_error([&] { c.encode({{"user", "4x5"}}); }, "has the character 'x' at 1");
  expect_error([] { parse_turn_credit("all"); }, "--turn-credit 'all' is unknown");
}
