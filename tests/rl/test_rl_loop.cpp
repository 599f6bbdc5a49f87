// The GRPO loop's parts (rl/grpo.h), on the tiny model, fp32 CPU:
//   the sampling temperature in the trainer's head: log-probs of sampled tokens equal the engine's
//     log_softmax(logits / T), and the gradient at T matches finite differences;
//   dynamic sampling refills the step with informative groups (and the cap on generate rounds holds);
//     overlong filtering gives truncated samples no gradient;
//   mini-batches and epochs: 1 x 1 equals the single-update path written out by hand and, taking its own
//     log-probs as the old ones, the same step with a forward for them first; micro-batches
//     (gradient accumulation) equal one micro-batch, a second epoch sees ratios != 1 and clips;
//   the reference model: the KL to it starts at 0, grows, and a KL loss term holds it down;
//   the metrics compared against TRL and veRL: clip region and dual clip, lengths, importance ratios, tokens/s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/rng.h"
#include "model/fd_check.h"
#include "model/model_test_util.h"
#include "model/objective.h"
#include "model/qwen3_moe.h"
#include "rl/advantages.h"
#include "rl/grpo.h"
#include "rl/policy_loss.h"
#include "rl/rl_test_util.h"
#include "rl/rollout_batch.h"
#include "rollout/engine.h"
#include "train/session.h"
#include "test_util.h"

using namespace mt;
using namespace mt::rl;
using namespace mt::rltest;

namespace {

// Samples of 3 prompts x 2 at temperature T, with the routing recorded.
std::vector<RolloutSample> sample_at(Qwen3MoeModel& m, float T) {
  const ModelConfig& c = m.config();
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest r;
    for (int t = 0; t < 4 + 3 * i; ++t) r.prompt.push_back(int32_t((i * 37 + t * 11 + 5) % c.vocab_size));
    r.max_new_tokens = 5 + 2 * i;
    r.n = 2;
    r.sampling.temperature = T;
    r.sampling.seed = uint64_t(i);
    reqs.push_back(r);
  }
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.block_size = 4;
  eo.record_routing = true;
  RolloutEngine engine(m, eo);
  return rltest::rollout_samples(reqs, engine.generate(reqs), true);
}

double worst_logprob_gap(Qwen3MoeModel& m, const std::vector<RolloutSample>& samples, double T) {
  const PackedRollouts p = pack_rollouts(samples, m.config().num_experts_per_tok);
  PassOptions po;
  po.token_logprobs = true;
  po.temperature = T;
  const std::vector<std::vector<float>> trainer = response_values(p, m.forward(p.mb, po).logp);
  double worst = 0;
  for (size_t i = 0; i < samples.size(); ++i)
    for (size_t j = 0; j < samples[i].logprobs.size(); ++j)
      worst = std::max(worst, std::abs(double(trainer[i][j]) - double(samples[i].logprobs[j])));
  return worst;
}

// -sum of log p_T(target) over the targets, from a forward (finite differences).
double tempered_nll(Qwen3MoeModel& m, const MicroBatch& mb, double T) {
  PassOptions po;
  po.token_logprobs = true;
  po.temperature = T;
  return -host_sum(m.forward(mb, po).logp);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::abs(double(a.data<float>()[i]) - b.data<float>()[i]));
  return d;
}

using testutil::rel_l2;

}  // namespace

// The engine samples at T = 0.7 and reports log_softmax(logits / 0.7); the trainer's head at the same T
// (PassOptions::temperature) gives the same numbers with the routing replayed; at T = 1 it does not.
TEST(RlTemperature, TrainerLogprobsEqualTheEnginesAtTheSamplingTemperature) {
  const ModelConfig c = tiny();
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 21);
  const std::vector<RolloutSample> samples = sample_at(m, 0.7f);
  EXPECT_LT(worst_logprob_gap(m, samples, 0.7), 1e-5) << "engine vs trainer at T = 0.7";
  EXPECT_GT(worst_logprob_gap(m, samples, 1.0), 1e-3) << "at T = 1 the trainer's log-probs are another distribution";
  expect_error([&] { worst_logprob_gap(m, samples, 0.0); }, "temperature 0");
}

// The gradient of -sum log p_T(target) at T = 0.7 through the objective path and the fused
// cross-entropy path agree, and match finite differences of the tempered forward (parameters after the
// last router, so that a perturbation cannot flip a routing decision; model.norm.weight and the
// experts see the head's 1/T on the way back).
TEST(RlTemperature, TemperedHeadGradientMatchesFiniteDifferences) {
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {0};
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 7);
  const MicroBatch mb = test::random_batch(c, 2, 12, 8);
  const double T = 0.7;
  const CrossEntropyObjective obj(1.0);
  PassOptions po;
  po.objective = &obj;
  po.overwrite_grads = true;
  po.temperature = T;
  const LossParts lp = m.forward_backward(mb, po);
  EXPECT_NEAR(lp.objective, tempered_nll(m, mb, T), 1e-4 * std::abs(lp.objective));
  const Tensor analytic = m.grads().clone();
  PassOptions fused;
  fused.ce_scale = 1.0;
  fused.overwrite_grads = true;
  fused.temperature = T;
  m.forward_backward(mb, fused);
  EXPECT_LT(max_abs_diff(m.grads(), analytic), 1e-5) << "the fused head at T";
  PassOptions plain = fused;
  plain.temperature = 1.0;
  m.forward_backward(mb, plain);
  EXPECT_GT(max_abs_diff(m.grads(), analytic), 1e-3) << "T = 1 gives other gradients";
  const test::FdResult fd =
      test::finite_difference_check(m, analytic,
                                    {"lm_head.weight", "model.norm.weight", "model.layers.1.mlp.experts.gate_up_proj",
                                     "model.layers.1.mlp.experts.down_proj"},
                                    1e-2f, [&] { return tempered_nll(m, mb, T); });
  EXPECT_GT(fd.analytic_norm2, 0.0);
  EXPECT_LT(fd.rel_l2, 2e-2) << "relative L2 of analytic vs finite differences";
}

// A grpo_step at T = 0.7: the rollout/trainer mismatch stays at rounding (the head uses the same T).
TEST(RlTemperature, GrpoStepAtTemperatureHasNoMismatch) {
  Rig r = make_rig(3);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 1e-2;
  o.sampling.temperature = 0.7f;
  for (int64_t step = 0; step < 3; ++step) {
    const GrpoMetrics m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, step);
    EXPECT_LT(m.logprob_diff_max, 1e-4) << "step " << step;
    EXPECT_NEAR(m.importance_weight_mean, 1.0, 1e-4);
  }
  o.sampling.temperature = 0;
  expect_error([&] { grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 9); }, "temperature 0");
}

// Half the prompts (even first token) get the same reward for every sample: zero-variance groups.
// Dynamic sampling drops them and draws again until the step has its 4 groups; with one round allowed
// it trains on the 2 it has; without it, all 4 groups of the one round are kept.
TEST(RlDynamicSampling, RefillsWithInformativeGroupsUpToTheRoundCap) {
  Rig r = make_rig(3);
  int64_t next = 0;
  const PromptFn draw = [&](int64_t count) {
    std::vector<std::vector<int32_t>> p;
    for (int64_t i = 0; i < count; ++i, ++next) p.push_back({int32_t(100 + next), int32_t(200 + next % 7), 300});
    return p;
  };
  const RewardFn reward = [](const std::vector<GenerateRequest>& reqs, const std::vector<GeneratedSample>& g) {
    std::vector<double> r = low_token_reward(reqs, g);
    for (size_t i = 0; i < g.size(); ++i)
      if (reqs[size_t(g[i].prompt_index)].prompt[0] % 2 == 0) r[i] = 1.0;
    return r;
  };
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 1e-3;
  o.dynamic_sampling = true;
  o.max_generate_rounds = 4;
  GrpoMetrics m = grpo_step(*r.s, *r.engine, draw, 4, reward, o, 0);
  EXPECT_EQ(m.generate_rounds, 2);
  EXPECT_EQ(m.groups_generated, 8);
  EXPECT_EQ(m.groups_kept, 4);
  EXPECT_NEAR(m.groups_zero_variance, 0.5, 1e-12);
  EXPECT_NEAR(m.advantage_mean, 0.0, 1e-6);
  EXPECT_GT(m.advantage_std, 0.5) << "informative groups only: normalised advantages";
  EXPECT_EQ(m.updates, 1);
  o.max_generate_rounds = 1;
  m = grpo_step(*r.s, *r.engine, draw, 4, reward, o, 1);
  EXPECT_EQ(m.generate_rounds, 1);
  EXPECT_EQ(m.groups_kept, 2);
  o.dynamic_sampling = false;
  m = grpo_step(*r.s, *r.engine, draw, 4, reward, o, 2);
  EXPECT_EQ(m.groups_kept, 4);
  EXPECT_NEAR(m.groups_zero_variance, 0.5, 1e-12);
  // Every group constant: nothing to learn, the update is skipped.
  o.dynamic_sampling = true;
  o.max_generate_rounds = 2;
  const RewardFn ones = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
    return std::vector<double>(g.size(), 1.0);
  };
  m = grpo_step(*r.s, *r.engine, draw, 4, ones, o, 3);
  EXPECT_EQ(m.generate_rounds, 2);
  EXPECT_EQ(m.groups_kept, 0);
  EXPECT_EQ(m.updates, 0);
}

// No EOS and 4 new tokens: every sample is cut at the limit. Filtered, they carry no gradient.
TEST(RlDynamicSampling, OverlongFilteringGivesTruncatedSamplesNoGradient) {
  Rig r = make_rig(3);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 4;
  o.lr = 1e-2;
  GrpoMetrics m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 0);
  EXPECT_EQ(m.overlong_fraction, 1.0);
  EXPECT_GT(m.grad_norm, 0.0);
  o.overlong_filter = true;
  m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 1);
  EXPECT_EQ(m.grad_norm, 0.0);
  // The soft penalty needs a buffer within the limit.
  o.overlong_penalty = 1.0;
  o.overlong_buffer = 5;
  expect_error([&] { grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 2); }, "overlong_buffer 5");
}

// One mini-batch, one epoch: the same weights as the single update written out by hand (generate,
// rewards, GRPO advantages, old log-probs, token-mean weights, one train_step on one micro-batch).
// Micro-batches of 3 samples (gradient accumulation) give the same weights as one micro-batch.
TEST(RlUpdate, OneMiniBatchOneEpochEqualsTheSingleUpdateAndMicroBatchesAccumulate) {
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 1e-2;
  o.seed = 5;
  const std::vector<std::vector<int32_t>> prompts = fixed_prompts(3);
  Rig a = make_rig(11), b = make_rig(11), c = make_rig(11);
  grpo_step(*a.s, *a.engine, prompts, low_token_reward, o, 0);
  // By hand, on b.
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest q;
    q.prompt = prompts[i];
    q.n = o.n;
    q.max_new_tokens = o.max_new_tokens;
    q.sampling.seed = mix64(o.seed ^ mix64(uint64_t(0) * 1000003 + i));
    reqs.push_back(q);
  }
  const std::vector<GeneratedSample> gen = b.engine->generate(reqs);
  const std::vector<double> rewards = low_token_reward(reqs, gen);
  const std::vector<double> adv = grpo_advantages(rewards, o.n, true);
  std::vector<RolloutSample> samples;
  int64_t tokens = 0;
  for (const GeneratedSample& g : gen) {
    samples.push_back({reqs[size_t(g.prompt_index)].prompt, g.tokens, g.logprobs, g.routing, {}});
    tokens += int64_t(g.tokens.size());
  }
  PackedRollouts p = pack_rollouts(samples, b.s->model().config().num_experts_per_tok);
  PassOptions po;
  po.token_logprobs = true;
  const std::vector<std::vector<float>> old = response_values(p, b.s->model().forward(p.mb, po).logp);
  std::vector<std::vector<float>> adv_t, w_t;
  for (size_t i = 0; i < samples.size(); ++i) {
    adv_t.emplace_back(samples[i].response.size(), float(adv[i]));
    w_t.emplace_back(samples[i].response.size(), float(1.0 / double(tokens)));
  }
  set_token_values(p, PolicyObjective::kAdvantage, adv_t);
  set_token_values(p, PolicyObjective::kOldLogp, old);
  set_token_values(p, PolicyObjective::kWeight, w_t);
  PolicyObjective obj(o.loss);
  StepOptions so;
  so.lr = o.lr;
  so.objective = &obj;
  b.s->train_step({p.mb}, so);
  EXPECT_LT(max_abs_diff(a.s->master(), b.s->master()), 1e-6) << "grpo_step vs the update by hand";
  EXPECT_GT(max_abs_diff(a.s->master(), make_rig(11).s->master()), 1e-4) << "the update moved the weights";
  // Gradient accumulation over micro-batches of 3 samples.
  GrpoOptions oc = o;
  oc.micro_batch_samples = 3;
  const GrpoMetrics mc = grpo_step(*c.s, *c.engine, prompts, low_token_reward, oc, 0);
  EXPECT_EQ(mc.micro_batches, 4);
  EXPECT_EQ(mc.updates, 1);
  // The gradients (Adam's first step, lr sign(g), would magnify rounding where g is near 0).
  EXPECT_LT(rel_l2(c.s->grads(), a.s->grads()), 1e-5) << "micro-batches vs one micro-batch";
}

// On-policy (one epoch, one mini-batch) the update takes its own log-probs, detached, as the old ones: no
// forward before it (logprob_s 0), and the same step as with that forward (old_logprob_forward): equal
// weights after three steps, equal loss and gradient norm, and the metrics the forward measured (entropy,
// rollout/trainer |d logp| and importance ratios, KL to the reference) measured by the objective instead.
TEST(RlUpdate, OnPolicyTakesTheUpdatesOwnLogprobsAndEqualsTheSeparateForward) {
  auto run = [](bool forward) {
    Rig r = make_rig(7), ref = make_rig(7, true);
    GrpoOptions o;
    o.n = 4;
    o.max_new_tokens = 6;
    o.lr = 1e-2;
    o.mismatch_every = 0;
    o.old_logprob_forward = forward;
    std::vector<GrpoMetrics> m;
    for (int64_t step = 0; step < 3; ++step)
      m.push_back(grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, step, ref.s.get()));
    return std::make_pair(std::move(r), m);
  };
  const auto [fr, fm] = run(true);
  const auto [orig, om] = run(false);
  EXPECT_EQ(max_abs_diff(fr.s->master(), orig.s->master()), 0.0) << "the same three steps, bit for bit";
  for (size_t k = 0; k < 3; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    EXPECT_GT(fm[k].logprob_s, 0.0);
    EXPECT_EQ(om[k].logprob_s, 0.0) << "no forward before the update";
    EXPECT_EQ(om[k].logprob_tokens_per_s, 0.0);
    EXPECT_EQ(om[k].loss, fm[k].loss);
    EXPECT_EQ(om[k].grad_norm, fm[k].grad_norm);
    EXPECT_EQ(om[k].clip_region, 0.0);
    for (auto [a, b, what] : {std::tuple{om[k].entropy, fm[k].entropy, "entropy"},
                              {om[k].logprob_diff_mean, fm[k].logprob_diff_mean, "|d logp| mean"},
                              {om[k].logprob_diff_max, fm[k].logprob_diff_max, "|d logp| max"},
                              {om[k].importance_weight_mean, fm[k].importance_weight_mean, "ratio mean"},
                              {om[k].importance_weight_min, fm[k].importance_weight_min, "ratio min"},
                              {om[k].importance_weight_max, fm[k].importance_weight_max, "ratio max"},
                              {om[k].ref_kl, fm[k].ref_kl, "KL to the reference"}})
      EXPECT_NEAR(a, b, 1e-12 + 1e-9 * std::abs(b)) << what;
    EXPECT_GT(om[k].entropy, 0.1);
    EXPECT_GT(om[k].logprob_diff_max, 0.0) << "the engine's and the trainer's log-probs differ by rounding";
  }
  EXPECT_GT(om[2].ref_kl, 1e-6) << "the policy moved from the reference";
}

// Options under which the clip engages once the ratios leave 1: a large lr on the tiny model and a narrow
// range (1 +- 0.05), so updates after the first see ratios beyond it; one on-policy epoch clips nothing.
namespace {
GrpoOptions clip_engaging_options() {
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 5e-2;
  o.loss.clip_low = o.loss.clip_high = 0.05;
  return o;
}
}  // namespace

// Two epochs over two mini-batches: four optimizer steps; after the first, the old log-probs (fixed
// before the first epoch) no longer equal the current ones, so ratios move off 1 and the clip engages.
// One epoch on one mini-batch is on-policy: ratios are 1, nothing clips.
TEST(RlUpdate, SecondEpochSeesRatiosOffOneAndClips) {
  Rig r = make_rig(3);
  GrpoOptions o = clip_engaging_options();
  GrpoMetrics m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 0);
  EXPECT_EQ(m.updates, 1);
  EXPECT_EQ(m.clip_low + m.clip_high, 0.0);
  EXPECT_LT(std::abs(m.approx_kl), 1e-6);
  o.epochs = 2;
  o.mini_batches = 2;
  m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 1);
  EXPECT_EQ(m.updates, 4);
  EXPECT_EQ(m.micro_batches, 4);
  EXPECT_GT(m.clip_low + m.clip_high, 0.0) << "later updates see ratios beyond 1 +- 0.05";
  EXPECT_GT(std::abs(m.approx_kl), 1e-5);
  o.mini_batches = 5;
  expect_error([&] { grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 2); }, "mini_batches = 5");
  o.mini_batches = 1;
  o.epochs = 0;
  expect_error([&] { grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 2); }, "epochs = 0");
}

// The reference: a frozen copy of the initial weights. Before any update the KL to it is 0; updates
// move the policy away; a KL loss term (k3, coefficient 1) keeps it closer than no KL term does over
// the same steps. kl_coef without a reference is an error.
TEST(RlReference, KlToTheFrozenCopyStartsAtZeroGrowsAndTheKlTermHoldsItDown) {
  auto run = [&](double kl_coef) {
    Rig r = make_rig(3), ref = make_rig(3, true);
    GrpoOptions o;
    o.n = 4;
    o.max_new_tokens = 8;
    o.lr = 2e-2;
    o.loss.kl_coef = kl_coef;
    o.loss.kl = KlEstimator::K3;
    std::vector<double> kl;
    for (int64_t step = 0; step < 8; ++step)
      kl.push_back(grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, step, ref.s.get()).ref_kl);
    return kl;
  };
  const std::vector<double> free = run(0), held = run(1.0);
  EXPECT_LT(std::abs(free[0]), 1e-6) << "the policy is the reference before the first update";
  EXPECT_GT(free.back(), 1e-3) << "the policy moved";
  EXPECT_LT(held.back(), 0.7 * free.back()) << "the KL term holds the policy near the reference";
  Rig r = make_rig(3);
  GrpoOptions o;
  o.loss.kl_coef = 0.1;
  expect_error([&] { grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 0); },
               "needs a reference model");
}

// Process-supervised GRPO advantages (DeepSeekMath 4.1.3) and the per-position ones by hand: a group of 2 samples with
// step rewards [1, 0] and [1, 1, 0]: pooled mean 0.6, unbiased std sqrt(0.3); a token's advantage is the sum of the
// normalised rewards of its step and the later ones.
TEST(RlProcess, ProcessAdvantagesByHand) {
  const std::vector<std::vector<double>> r = {{1, 0}, {1, 1, 0}};
  const double s = std::sqrt(0.3) + 1e-6, hi = 0.4 / s, lo = -0.6 / s;
  const std::vector<std::vector<double>> a = process_advantages(r, 2, true);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(a[1].size(), 3u);
  EXPECT_NEAR(a[0][1], lo, 1e-9);
  EXPECT_NEAR(a[0][0], hi + lo, 1e-9);
  EXPECT_NEAR(a[1][2], lo, 1e-9);
  EXPECT_NEAR(a[1][1], hi + lo, 1e-9);
  EXPECT_NEAR(a[1][0], 2 * hi + lo, 1e-9);
  const std::vector<std::vector<double>> d = process_advantages(r, 2, false);  // no std division
  EXPECT_NEAR(d[0][0], -0.2, 1e-12);
  EXPECT_NEAR(d[1][0], 0.2, 1e-12);
  EXPECT_EQ(constant_step_groups({{1, 1}, {1}, {1, 0}, {1}}, 2), (std::vector<bool>{true, false}));
  // Per position: step 0 is [1, 1] (no spread: 0), step 1 is [0, 1] (mean 0.5, std sqrt(0.5)), step 2 has
  // one sample (0).
  const std::vector<std::vector<double>> p = position_advantages(r, 2, true);
  EXPECT_NEAR(p[0][0], 0.0, 1e-12);
  EXPECT_NEAR(p[1][0], 0.0, 1e-12);
  EXPECT_NEAR(p[0][1], -0.5 / (std::sqrt(0.5) + 1e-6), 1e-9);
  EXPECT_NEAR(p[1][1], 0.5 / (std::sqrt(0.5) + 1e-6), 1e-9);
  EXPECT_EQ(p[1][2], 0.0);
  expect_error([] { process_advantages({{1.0}, {}}, 2, true); }, "sample 1 has no step reward");
  expect_error([] { process_advantages({{1.0}}, 1, true); }, "group size 1");
}

// GRPO with process rewards (1 per low token) raises the share of low tokens, like the outcome version.
TEST(RlProcess, ProcessRewardStepsRaiseTheReward) {
  Rig r = make_rig(3);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 2e-2;
  o.token_reward = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
    std::vector<std::vector<double>> r;
    for (const GeneratedSample& x : g) {
      r.emplace_back();
      for (int32_t t : x.tokens) r.back().push_back(t < 64 ? 1.0 : 0.0);
    }
    return r;
  };
  std::vector<double> curve;
  for (int64_t step = 0; step < 16; ++step)
    curve.push_back(grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, step).reward_mean);
  EXPECT_GT((curve[13] + curve[14] + curve[15]) / 3, (curve[0] + curve[1] + curve[2]) / 3 + 0.3);
}

// Token-level credit lands on its own token: only the first response token is rewarded (a low id: 1),
// every later step gets 0. The first token's share of low ids must rise under both token-level
// advantages; were the advantages shifted by a token, the first token would get no credit.
TEST(RlProcess, TokenCreditLandsOnItsOwnToken) {
  for (bool per_position : {true, false}) {
    Rig r = make_rig(3);
    GrpoOptions o;
    o.n = 4;
    o.max_new_tokens = 6;
    o.lr = 2e-2;
    o.per_position = per_position;
    o.token_reward = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      std::vector<std::vector<double>> r;
      for (const GeneratedSample& x : g) {
        r.emplace_back(x.tokens.size(), 0.0);
        r.back()[0] = x.tokens[0] < 128 ? 1.0 : 0.0;
      }
      return r;
    };
    const RewardFn first_low = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      std::vector<double> out;
      for (const GeneratedSample& x : g) out.push_back(x.tokens[0] < 128 ? 1.0 : 0.0);
      return out;
    };
    double first = 0, last = 0;
    for (int64_t step = 0; step < 30; ++step) {
      const double m = grpo_step(*r.s, *r.engine, fixed_prompts(4), first_low, o, step).reward_mean;
      (step < 5 ? first : last) += step < 5 ? m / 5 : step >= 25 ? m / 5 : 0;
    }
    std::printf("%s: first token low %.3f -> %.3f\n", per_position ? "position" : "process", first, last);
    EXPECT_GT(last, first + 0.3) << (per_position ? "position" : "process");
  }
}

// StepOptions::frozen (what grpo's freeze_router uses): with AdamW's weight decay on, a frozen parameter's
// values come through the step bit for bit (its gradient zeroed, the decay undone) while the others move.
TEST(RlRouter, FrozenParametersSurviveTheStepWithWeightDecay) {
  SessionOptions so;
  TrainSession s(tiny(), so);
  s.init_weights(3);
  AdamWConfig ac;
  ac.weight_decay = 0.1;
  s.make_optimizer(ac, false);
  const Tensor before = s.master().clone();
  Rng rng(4);
  Tensor ids = Tensor::empty({2, 9}, DType::I64);
  for (int64_t i = 0; i < ids.numel(); ++i) ids.data<int64_t>()[i] = int64_t(rng.randint(0, tiny().vocab_size));
  StepOptions st;
  st.lr = 1e-2;
  st.frozen = is_router_weight;
  s.train_step({MicroBatch{ids, ids.clone()}}, st);
  int routers = 0, moved = 0;
  for (const ParamEntry& e : s.table().entries()) {
    const Tensor a = before.rows(e.offset, e.numel), b = s.master().rows(e.offset, e.numel);
    const bool same = std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
    if (is_router_weight(e.name)) {
      ++routers;
      EXPECT_TRUE(same) << e.name;
    } else {
      moved += same ? 0 : 1;
    }
  }
  EXPECT_GT(routers, 0);
  EXPECT_GT(moved, 5);
  EXPECT_FALSE(is_router_weight("model.layers.0.mlp.gate_proj.weight")) << "a dense MLP's gate is not a router";
  EXPECT_TRUE(is_router_weight("model.layers.3.mlp.gate.weight"));
}

namespace {

// `prompts` of the fixed prompts x 4 samples of up to `new_tokens` at temperature 1 from the rig's engine
// (routing recorded), as the update takes them; reward: the first token's id mod 3.
RolloutGroups engine_rollouts(Rig& r, int prompts, int64_t new_tokens) {
  std::vector<GenerateRequest> reqs;
  for (const std::vector<int32_t>& p : fixed_prompts(prompts)) {
    GenerateRequest q;
    q.prompt = p;
    q.n = 4;
    q.max_new_tokens = new_tokens;
    q.sampling.temperature = 1.0f;
    q.sampling.seed = uint64_t(reqs.size());
    reqs.push_back(q);
  }
  const std::vector<GeneratedSample> gen = r.engine->generate(reqs);
  RolloutGroups groups;
  for (const GeneratedSample& g : gen) {
    groups.samples.push_back({reqs[size_t(g.prompt_index)].prompt, g.tokens, g.logprobs, g.routing, {}});
    groups.rewards.push_back(double(g.tokens.empty() ? 0 : g.tokens[0] % 3));
  }
  return groups;
}

}  // namespace

// The mismatch metric with and without the replay: rollouts generated, then the routers moved a
// little (the drift between engine and trainer that R3 is for: near-ties flip); with the recorded experts
// replayed the trainer's log-probs stay closer to the engine's than with its own routing, which chooses
// other experts for some tokens. Measured on steps that are multiples of mismatch_every only (-1 elsewhere).
TEST(RlRouter, MismatchWithAndWithoutReplayIsMeasured) {
  Rig r = make_rig(21);
  const RolloutGroups groups = engine_rollouts(r, 4, 8);
  Rng rng(8);
  for (const ParamEntry& e : r.s->table().entries())
    if (is_router_weight(e.name)) {
      Tensor w = r.s->master().rows(e.offset, e.numel);
      for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] += float(0.05 * rng.normal());
    }
  r.s->refresh_compute_weights();
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.mismatch_every = 2;
  o.lr = 0;  // both measurements on the same weights
  const GrpoMetrics odd = grpo_update(*r.s, groups, o, 1);
  EXPECT_EQ(odd.logprob_diff_mean_no_replay, -1) << "not a multiple of mismatch_every";
  const GrpoMetrics m = grpo_update(*r.s, groups, o, 2);
  EXPECT_GT(m.logprob_diff_mean, 0);
  EXPECT_GT(m.logprob_diff_mean_no_replay, 1.2 * m.logprob_diff_mean)
      << "replayed " << m.logprob_diff_mean << " vs own routing " << m.logprob_diff_mean_no_replay;
  EXPECT_GE(m.logprob_diff_max_no_replay, 0);
  std::printf("rollout/trainer mean |dlogp|: replayed %.4f, own routing %.4f\n", m.logprob_diff_mean,
              m.logprob_diff_mean_no_replay);
}

// The rollout/trainer mismatch corrections in the loop (policy_loss.h token_weights): the engine's
// log-probs moved by noise; token and sequence masks give some tokens weight 0 (masked_fraction), TIS changes
// the update; all off by default (nothing masked, the plain update).
TEST(RlMismatch, MasksAndTruncatedImportanceSamplingEnterTheUpdate) {
  auto run = [](const MismatchConfig& mc) {
    Rig r = make_rig(31);
    RolloutGroups groups = engine_rollouts(r, 4, 8);
    Rng rng(3);
    for (RolloutSample& x : groups.samples)
      for (float& lp : x.logprobs) lp += float(0.3 * rng.normal());  // an engine that disagrees with the trainer
    GrpoOptions o;
    o.n = 4;
    o.max_new_tokens = 8;
    o.mismatch = mc;
    return grpo_update(*r.s, groups, o, 1);
  };
  const GrpoMetrics off = run({});
  EXPECT_EQ(off.masked_fraction, 0);
  MismatchConfig tok;
  tok.token_mask_low = 0.8;
  tok.token_mask_high = 1.25;
  const GrpoMetrics t = run(tok);
  EXPECT_GT(t.masked_fraction, 0.1);
  EXPECT_LT(t.masked_fraction, 0.9);
  MismatchConfig seq;
  seq.seq_mask_low = 0.9;
  seq.seq_mask_high = 1.1;
  EXPECT_GT(run(seq).masked_fraction, 0.05) << "whole samples outside the band";
  MismatchConfig tis;
  tis.tis_cap = 0.5;
  const GrpoMetrics c = run(tis);
  EXPECT_EQ(c.masked_fraction, 0);
  EXPECT_GT(std::abs(c.grad_norm - off.grad_norm), 1e-3 * off.grad_norm) << "the truncated weights change the update";
  MismatchConfig bad;
  bad.token_mask_low = 2;
  bad.token_mask_high = 1;
  expect_error([&] { run(bad); }, "token mask [2, 1]");
}

// A mask leaves its tokens out of the aggregation's denominators, as overlong filtering does: masking every
// token of one sample (its engine log-probs moved by +20, a ratio e^-20 outside the token band) trains the
// same update as filtering that sample. The old loop counted masked tokens (and wholly masked samples) in
// the normaliser, so the masked run's gradient was the filtered run's times (trained tokens / all tokens)
// under token-mean (here 90 / 96) and the loss differed likewise.
TEST(RlMismatch, MaskingASampleTrainsTheSameUpdateAsFilteringIt) {
  Rig r = make_rig(31);
  const RolloutGroups base = engine_rollouts(r, 4, 6);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 0;  // every run on the same weights
  // The trainer and the engine agree to rounding on the CPU: nothing else is masked.
  o.mismatch.token_mask_low = 1e-3;
  o.mismatch.token_mask_high = 1e3;
  for (LossAggregation a : {LossAggregation::TokenMean, LossAggregation::SeqMeanTokenMean}) {
    o.aggregation = a;
    RolloutGroups filtered = base;
    filtered.truncated.assign(base.samples.size(), false);
    filtered.truncated[1] = true;
    o.overlong_filter = true;
    const GrpoMetrics f = grpo_update(*r.s, filtered, o, 1);
    RolloutGroups masked = base;
    for (float& lp : masked.samples[1].logprobs) lp += 20;
    o.overlong_filter = false;
    const GrpoMetrics m = grpo_update(*r.s, masked, o, 1);
    EXPECT_NEAR(m.masked_fraction, 6.0 / 96, 1e-12) << int(a);
    EXPECT_EQ(f.masked_fraction, 0) << int(a);
    EXPECT_GT(f.grad_norm, 0) << int(a);
    EXPECT_NEAR(m.grad_norm, f.grad_norm, 1e-6 * f.grad_norm) << int(a);
    EXPECT_NEAR(m.loss, f.loss, 1e-6 * std::abs(f.loss)) << int(a);
    EXPECT_NE(f.loss, 0) << int(a);
  }
}

// PPO's GAE advantages are whitened over the step's trained tokens with their population std:
// (a - mean) / (std + 1e-6), so the advantage_std metric (their population std) is 1 - O(1e-6). veRL's
// masked_whiten uses the unbiased variance, (a - mean) / sqrt(var + 1e-8), which would give
// sqrt((N - 1) / N) = 0.994778 for these N = 96 tokens: a scale docs/rl.md states as our convention.
TEST(RlUpdate, PpoAdvantagesAreWhitenedWithThePopulationStd) {
  Rig r = make_rig(51);
  const std::unique_ptr<TrainSession> critic = make_critic(*r.s, 52);
  const RolloutGroups groups = engine_rollouts(r, 4, 6);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 0;
  o.critic_lr = 0;
  const GrpoMetrics m = grpo_update(*r.s, groups, o, 1, nullptr, critic.get());
  EXPECT_NEAR(m.advantage_mean, 0.0, 1e-12);
  EXPECT_NEAR(m.advantage_std, 1.0, 1e-5);
}

// The loss of a mini-batch split into micro-batches is the loss over the whole mini-batch under every
// aggregation: the normalisers are fixed per mini-batch (its tokens, its samples, each sample's length),
// never per micro-batch (the "token mean per micro-batch, then the mean of the means" bug). Responses cut
// to lengths 1..6 and micro-batches of 3 samples (3, 3, 3, 3, 3, 1): a per-micro-batch normaliser gives
// another loss and other gradients. GSPO too (its sequence ratio needs whole samples per micro-batch).
TEST(RlUpdate, MicroBatchesSumToTheMiniBatchLossUnderEveryAggregation) {
  Rig r = make_rig(61);
  RolloutGroups groups = engine_rollouts(r, 4, 6);
  for (size_t i = 0; i < groups.samples.size(); ++i) {
    RolloutSample& x = groups.samples[i];
    const size_t len = 1 + (i * 5) % 6;
    x.response.resize(len);
    x.logprobs.resize(len);
    x.routing = RoutingRecord();
  }
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 0;
  o.replay_routing = false;
  struct Case {
    LossAggregation a;
    PolicyLoss kind;
  };
  for (const Case& c : {Case{LossAggregation::TokenMean, PolicyLoss::PpoClip},
                        Case{LossAggregation::SeqMeanTokenSum, PolicyLoss::PpoClip},
                        Case{LossAggregation::SeqMeanTokenMean, PolicyLoss::PpoClip},
                        Case{LossAggregation::Constant, PolicyLoss::PpoClip},
                        Case{LossAggregation::SeqMeanTokenMean, PolicyLoss::Gspo}}) {
    o.aggregation = c.a;
    o.loss.kind = c.kind;
    o.micro_batch_samples = 0;
    const GrpoMetrics one = grpo_update(*r.s, groups, o, 1);
    const Tensor g_one = r.s->grads().clone();
    o.micro_batch_samples = 3;
    const GrpoMetrics split = grpo_update(*r.s, groups, o, 1);
    const std::string what = "aggregation " + std::to_string(int(c.a)) + ", loss " + std::to_string(int(c.kind));
    EXPECT_EQ(one.micro_batches, 1) << what;
    EXPECT_EQ(split.micro_batches, 6) << what;
    EXPECT_NE(one.loss, 0) << what;
    EXPECT_NEAR(split.loss, one.loss, 1e-6 * std::abs(one.loss)) << what;
    EXPECT_LT(rel_l2(r.s->grads(), g_one), 1e-5) << what;
  }
}

// KL to the reference subtracted from the reward (instead of, or besides, the loss term):
// groups whose rewards are all equal carry no GRPO gradient, but once the policy has moved from the
// reference its samples' KL differs, so -beta sum_t k(old, ref) in the reward gives them advantages; the
// kl_reward metric is the mean per-token penalty (negative). Without a reference it is an error.
TEST(RlReference, KlSubtractedFromTheRewardGivesEqualRewardGroupsAGradient) {
  Rig r = make_rig(41), ref = make_rig(42, true);  // a reference other than the policy: KL > 0
  RolloutGroups groups = engine_rollouts(r, 3, 6);
  std::fill(groups.rewards.begin(), groups.rewards.end(), 1.0);  // every group's rewards equal
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 6;
  o.lr = 0;
  const GrpoMetrics plain = grpo_update(*r.s, groups, o, 1, ref.s.get());
  EXPECT_EQ(plain.grad_norm, 0) << "equal rewards: no GRPO gradient";
  EXPECT_EQ(plain.kl_reward, 0);
  o.kl_reward_coef = 0.1;
  const GrpoMetrics kl = grpo_update(*r.s, groups, o, 1, ref.s.get());
  EXPECT_GT(kl.grad_norm, 0);
  EXPECT_LT(kl.kl_reward, 0);
  EXPECT_NEAR(kl.kl_reward, -0.1 * kl.ref_kl, 1e-6 + 1e-4 * std::abs(kl.ref_kl)) << "-beta x the mean k3";
  expect_error([&] { grpo_update(*r.s, groups, o, 1); }, "kl_reward_coef 0.1 needs a reference model");
}

// The metrics compared against TRL's and veRL's (docs/rl.md "Metric names against TRL and veRL"), on steps
// whose values can be worked out. One on-policy epoch clips nothing. Three epochs over two mini-batches at a
// large lr move the ratios past 1 +- 0.05 on both sides: the region, counted by the objective on its own,
// is low + high (a token is clipped on one side at most). A dual clip c = 1.01 (below 1 + eps_high) takes
// the tokens with A < 0 and a ratio above c: counted apart, in none of the three.
TEST(RlMetrics, ClipRegionIsLowPlusHighAndTheDualClipApart) {
  Rig r = make_rig(3);
  GrpoOptions o = clip_engaging_options();
  GrpoMetrics m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 0);
  EXPECT_EQ(m.clip_region + m.clip_dual, 0.0) << "one on-policy epoch";
  o.epochs = 3;
  o.mini_batches = 2;
  m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 1);
  EXPECT_GT(m.clip_low, 0.0);
  EXPECT_GT(m.clip_high, 0.0);
  EXPECT_NEAR(m.clip_region, m.clip_low + m.clip_high, 1e-12);
  EXPECT_EQ(m.clip_dual, 0.0) << "no dual clip";
  o.loss.dual_clip = 1.01;
  m = grpo_step(*r.s, *r.engine, fixed_prompts(4), low_token_reward, o, 2);
  EXPECT_GT(m.clip_dual, 0.0);
  EXPECT_GT(m.clip_region, 0.0);
  EXPECT_NEAR(m.clip_region, m.clip_low + m.clip_high, 1e-12);
  EXPECT_LE(m.clip_region + m.clip_dual, 1.0);
}

// Stop tokens (ids below 40) end samples at different lengths: min <= mean <= max, and the mean splits into
// the samples cut at the limit (max_new_tokens each) and those that stopped. The trainer's log-probs equal
// the engine's on the fp32 CPU path: every importance ratio is 1 within rounding. Each phase's tokens/s
// times its seconds gives back the tokens it moved (generate: the responses; the old log-prob, reference and
// critic-value forwards: prompt + response once; the updates: once per epoch), and a phase that did not run
// reports 0. With one mini-batch, token-mean and a KL loss term, the KL loss is beta x ref_kl_update.
TEST(RlMetrics, LengthsImportanceRatiosAndTokensPerSecondAddUp) {
  Rig r = make_rig(3), ref = make_rig(3, true);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 1e-2;
  o.epochs = 2;
  o.mismatch_every = 0;  // no extra forward without the replay
  for (int32_t t = 0; t < 40; ++t) o.stop_token_ids.push_back(t);
  const std::vector<std::vector<int32_t>> prompts = fixed_prompts(4);
  double prompt_tokens = 0;
  for (const std::vector<int32_t>& p : prompts) prompt_tokens += double(p.size() * size_t(o.n));
  auto check = [&](const GrpoMetrics& m, bool with_ref, bool with_critic, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_LE(m.response_len_min, m.response_len_mean);
    EXPECT_LE(m.response_len_mean, m.response_len_max);
    EXPECT_LT(m.response_len_min, m.response_len_max) << "the stop tokens vary the lengths";
    EXPECT_GT(m.overlong_fraction, 0.0);
    EXPECT_LT(m.overlong_fraction, 1.0);
    EXPECT_NEAR(
        m.response_len_mean,
        m.overlong_fraction * double(o.max_new_tokens) + (1 - m.overlong_fraction) * m.response_len_terminated_mean,
        1e-9);
    EXPECT_LE(m.importance_weight_min, m.importance_weight_mean);
    EXPECT_LE(m.importance_weight_mean, m.importance_weight_max);
    EXPECT_GT(m.importance_weight_min, 1 - 1e-4);
    EXPECT_LT(m.importance_weight_max, 1 + 1e-4);
    const double response = m.response_len_mean * double(prompts.size() * size_t(o.n));
    const double seqs = response + prompt_tokens, epochs = double(o.epochs);
    auto expect_moved = [](double per_s, double s, double tokens, const char* phase) {
      EXPECT_GT(s, 0.0) << phase;
      EXPECT_NEAR(per_s * s, tokens, 1e-9 * tokens) << phase;
    };
    expect_moved(m.rollout_tokens_per_s, m.generate_s, response, "generate");
    expect_moved(m.logprob_tokens_per_s, m.logprob_s, seqs, "old log-probs");
    expect_moved(m.train_tokens_per_s, m.update_s, epochs * seqs, "update");
    if (with_ref)
      expect_moved(m.ref_logprob_tokens_per_s, m.ref_logprob_s, seqs, "reference");
    else
      EXPECT_EQ(m.ref_logprob_tokens_per_s, 0.0);
    if (with_critic) {
      expect_moved(m.critic_values_tokens_per_s, m.critic_value_s, seqs, "critic values");
      expect_moved(m.critic_update_tokens_per_s, m.critic_update_s, epochs * seqs, "critic update");
    } else {
      EXPECT_EQ(m.critic_values_tokens_per_s, 0.0);
      EXPECT_EQ(m.critic_update_tokens_per_s, 0.0);
    }
  };
  GrpoMetrics m = grpo_step(*r.s, *r.engine, prompts, low_token_reward, o, 1);
  check(m, false, false, "policy only");
  EXPECT_EQ(m.ref_kl_update, 0.0);
  m = grpo_step(*r.s, *r.engine, prompts, low_token_reward, o, 2, ref.s.get());
  check(m, true, false, "with the reference");
  EXPECT_GT(m.ref_kl, 0.0) << "the first step moved the policy";
  EXPECT_EQ(m.ref_kl_update, 0.0) << "no KL loss term";
  o.loss.kl_coef = 0.1;
  std::unique_ptr<TrainSession> critic = make_critic(*r.s, 5);
  m = grpo_step(*r.s, *r.engine, prompts, low_token_reward, o, 3, ref.s.get(), critic.get());
  check(m, true, true, "PPO with the reference and a KL loss term");
  EXPECT_GT(m.ref_kl_update, 0.0);
  EXPECT_NEAR(m.kl_loss, 0.1 * m.ref_kl_update, 1e-5 * m.kl_loss);
}
