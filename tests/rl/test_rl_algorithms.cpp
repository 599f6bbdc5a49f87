// The RL algorithms against hand-computed cases (the numbers in the comments were worked out by hand
// and checked in Python): GRPO (std on and off: Dr. GRPO), RLOO, REINFORCE++'s batch normalisation, GAE,
// PPO clip with separate low/high ranges, dual clip, plain PG, the three KL estimators and their
// gradients, the mismatch corrections (TIS at token and sequence level, token and sequence masks), the
// loss aggregations, the policy objective's loss and coefficients (finite differences, GSPO), and the
// engine → trainer hand-off (packed rollouts give the engine's log-probs in the trainer's forward).
#include <gtest/gtest.h>

#include <bit>

#include <cmath>
#include <functional>
#include <string>

#include "core/error.h"
#include "model/qwen3_moe.h"
#include "core/determinism.h"
#include "rl/advantages.h"
#include "rl/grpo.h"
#include "rl/policy_loss.h"
#include "rl/rollout_batch.h"
#include "rl/shaping.h"
#include "rl/rl_test_util.h"
#include "rollout/engine.h"

using namespace mt;
using namespace mt::rl;

namespace {

void expect_vec(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " [" << i << "]";
}

// Expects f to throw an mt::Error with `needle` in its message.
void expect_mt_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

const std::vector<double> kRewards = {1, 0, 0, 1, 1, 1, 1, 0};  // two groups of 4

}  // namespace

TEST(RlAdvantages, GrpoDrGrpoRlooAndBatchNormalisedByHand) {
  // Group 1: mean 0.5, unbiased std sqrt(1/3) = 0.577350 -> +-0.866025. Group 2: mean 0.75, std 0.5.
  expect_vec(grpo_advantages(kRewards, 4, true, 0.0), {0.866025, -0.866025, -0.866025, 0.866025, 0.5, 0.5, 0.5, -1.5},
             1e-6, "grpo");
  expect_vec(grpo_advantages(kRewards, 4, false), {0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75}, 1e-12, "dr grpo");
  // r_i minus the mean of the other three.
  expect_vec(rloo_advantages(kRewards, 4), {2.0 / 3, -2.0 / 3, -2.0 / 3, 2.0 / 3, 1.0 / 3, 1.0 / 3, 1.0 / 3, -1.0},
             1e-12, "rloo");
  // Whole batch: mean 0.625, unbiased std sqrt(1.875 / 7) = 0.517549.
  const double s = std::sqrt(1.875 / 7);
  expect_vec(batch_normalized_advantages(kRewards, 0.0),
             {0.375 / s, -0.625 / s, -0.625 / s, 0.375 / s, 0.375 / s, 0.375 / s, 0.375 / s, -0.625 / s}, 1e-12,
             "reinforce++");
  EXPECT_EQ(constant_groups(std::vector<double>{1, 1, 1, 1, 0, 1, 0, 1}, 4), (std::vector<bool>{true, false}));
  // A constant group has zero advantages under every group estimator (eps keeps GRPO finite).
  expect_vec(grpo_advantages(std::vector<double>{3, 3}, 2, true), {0, 0}, 0, "constant group");
  expect_mt_error([] { grpo_advantages(kRewards, 1, true); }, "group size 1 < 2");
  expect_mt_error([] { rloo_advantages(std::vector<double>(7, 0.0), 4); },
               "7 rewards are not a whole number of groups of 4");
  expect_mt_error([] { grpo_advantages(std::vector<double>{1, NAN}, 2, true); }, "reward 1 is nan");
}

TEST(RlAdvantages, GaeByHand) {
  // gamma 1, lambda 0.95: deltas 0.1, 0.1, 0.3; A = 0.46575, 0.385, 0.3; returns A + V.
  Gae g = gae(std::vector<double>{0, 0, 1}, std::vector<double>{0.5, 0.6, 0.7}, 1.0, 0.95);
  expect_vec(g.advantages, {0.46575, 0.385, 0.3}, 1e-12, "gae advantages");
  expect_vec(g.returns, {0.96575, 0.985, 1.0}, 1e-12, "gae returns");
  // gamma 0.9, lambda 1: deltas 0.04, 0.03, 0.3; A = 0.31, 0.3, 0.3.
  g = gae(std::vector<double>{0, 0, 1}, std::vector<double>{0.5, 0.6, 0.7}, 0.9, 1.0);
  expect_vec(g.advantages, {0.31, 0.3, 0.3}, 1e-12, "gae gamma 0.9");
  expect_mt_error([] { gae(std::vector<double>{0}, std::vector<double>{0}, 1.5, 1); }, "gamma 1.5 must be in [0, 1]");
  expect_mt_error([] { gae(std::vector<double>{0, 1}, std::vector<double>{0}, 1, 1); }, "2 token rewards but 1 values");
}

TEST(RlPolicyLoss, PpoClipDualClipClipHigherAndPlainPgByHand) {
  PolicyLossConfig c;  // eps 0.2 both sides
  // r = e^0.2 = 1.221403, A = 1: the clipped term -1.2 wins, no gradient, clipped high.
  TokenTerm t = policy_term(c, 0.2, 1.0);
  EXPECT_NEAR(t.loss, -1.2, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.clipped_high);
  // Same ratio, A = -1: unclipped 1.221403 is the larger; gradient -A r.
  t = policy_term(c, 0.2, -1.0);
  EXPECT_NEAR(t.loss, std::exp(0.2), 1e-12);
  EXPECT_NEAR(t.dlogp, std::exp(0.2), 1e-12);
  EXPECT_FALSE(t.clipped_high || t.clipped_low);
  // r = 0.5, A = -1: clipped 0.8 > 0.5, clipped low; A = +1: unclipped -0.5.
  t = policy_term(c, std::log(0.5), -1.0);
  EXPECT_NEAR(t.loss, 0.8, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.clipped_low);
  t = policy_term(c, std::log(0.5), 1.0);
  EXPECT_NEAR(t.loss, -0.5, 1e-12);
  EXPECT_NEAR(t.dlogp, -0.5, 1e-12);
  // Dual clip c = 3: r = 4, A = -1: PPO gives 4, dual clip caps it at 3, no gradient.
  c.dual_clip = 3;
  t = policy_term(c, std::log(4.0), -1.0);
  EXPECT_NEAR(t.loss, 3.0, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.dual_clipped);
  // The dual clip bounds negative advantages only: r = 4 with A = +1 is PPO's clipped -1.2 (clipped high),
  // not -3; and with A = -1 but r = 2 (PPO loss 2 < 3) it does not engage: gradient -A r = 2.
  t = policy_term(c, std::log(4.0), 1.0);
  EXPECT_NEAR(t.loss, -1.2, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.clipped_high);
  EXPECT_FALSE(t.dual_clipped);
  t = policy_term(c, std::log(2.0), -1.0);
  EXPECT_NEAR(t.loss, 2.0, 1e-12);
  EXPECT_NEAR(t.dlogp, 2.0, 1e-12);
  EXPECT_FALSE(t.dual_clipped);
  // Clip-higher (0.2 low, 0.28 high): r = 1.25 with A = 1 is inside the range.
  c = PolicyLossConfig{};
  c.clip_high = 0.28;
  t = policy_term(c, std::log(1.25), 1.0);
  EXPECT_NEAR(t.loss, -1.25, 1e-12);
  EXPECT_NEAR(t.dlogp, -1.25, 1e-12);
  // ... r = 1.3 is above 1.28: -1.28, no gradient; the low bound stays 0.8: r = 0.75 with A = -1 gives 0.8.
  t = policy_term(c, std::log(1.3), 1.0);
  EXPECT_NEAR(t.loss, -1.28, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.clipped_high);
  t = policy_term(c, std::log(0.75), -1.0);
  EXPECT_NEAR(t.loss, 0.8, 1e-12);
  EXPECT_EQ(t.dlogp, 0.0);
  EXPECT_TRUE(t.clipped_low);
  // The pessimistic side: r = 0.75 with A = +1 and r = 1.3 with A = -1 are not clipped (gradient -A r).
  EXPECT_NEAR(policy_term(c, std::log(0.75), 1.0).dlogp, -0.75, 1e-12);
  EXPECT_NEAR(policy_term(c, std::log(1.3), -1.0).dlogp, 1.3, 1e-12);
  // Plain PG: -A r, never clipped.
  c.kind = PolicyLoss::PolicyGradient;
  t = policy_term(c, 0.7, 2.0);
  EXPECT_NEAR(t.loss, -2.0 * std::exp(0.7), 1e-12);
  EXPECT_NEAR(t.dlogp, -2.0 * std::exp(0.7), 1e-12);
  expect_mt_error([] { validate(PolicyLossConfig{.dual_clip = 0.5}); }, "dual_clip (0.5) must be > 1");
  // Infinite coefficients would turn the loss into inf or nan: refused.
  expect_mt_error([] { validate(PolicyLossConfig{.kl_coef = INFINITY}); }, "kl_coef (inf) must be finite");
  expect_mt_error([] { validate(PolicyLossConfig{.clip_high = INFINITY}); }, "clip_high (inf) must be finite");
  expect_mt_error([] { validate(PolicyLossConfig{.dual_clip = INFINITY}); }, "dual_clip (inf) must be > 1 and finite");
  expect_mt_error([] { parse_policy_loss("ppo2"); }, "unknown policy loss 'ppo2'; allowed: ppo, gspo, pg");
}

TEST(RlPolicyLoss, KlEstimatorsAndTheirGradients) {
  // logp -1, ref -1.5 (d = ref - logp = -0.5): k1 0.5, k2 0.125, k3 e^-0.5 + 0.5 - 1 = 0.106531.
  EXPECT_NEAR(kl_value(KlEstimator::K1, -1, -1.5), 0.5, 1e-12);
  EXPECT_NEAR(kl_value(KlEstimator::K2, -1, -1.5), 0.125, 1e-12);
  EXPECT_NEAR(kl_value(KlEstimator::K3, -1, -1.5), std::exp(-0.5) - 0.5, 1e-12);
  for (KlEstimator k : {KlEstimator::K1, KlEstimator::K2, KlEstimator::K3}) {
    const double h = 1e-6, fd = (kl_value(k, -1 + h, -1.5) - kl_value(k, -1 - h, -1.5)) / (2 * h);
    EXPECT_NEAR(kl_grad(k, -1, -1.5), fd, 1e-8) << int(k);
    EXPECT_NEAR(kl_value(k, -2, -2), 0.0, 1e-15) << "no divergence from itself";
  }
}

// What each estimator does as a loss term, on policy, exactly (a categorical policy pi = softmax(theta) over 5
// outcomes, a reference softmax(phi), expectations summed over the outcomes): the gradient of the term is
// E_pi[dk/dlogp (e_y - pi)] (the score e_y - pi = d log pi(y) / d theta). k1's is 0 (E_pi of a score: no
// regularisation in expectation); k2's is the gradient of the reverse KL(pi || ref), the one its value
// estimates (biased); k3's is the gradient of the forward KL(ref || pi), though its value is an unbiased
// estimate of the reverse KL (as k1's is). Checked against central differences of the two KLs in theta.
TEST(RlPolicyLoss, KlEstimatorsAsLossTermsOnPolicyHaveTheseGradients) {
  const std::vector<double> theta = {0.3, -1.2, 0.8, 0.0, -0.4}, phi = {-0.5, 0.4, 1.1, -0.2, 0.3};
  auto log_softmax = [](const std::vector<double>& x) {
    double m = -1e300, z = 0;
    for (double v : x) m = std::max(m, v);
    for (double v : x) z += std::exp(v - m);
    std::vector<double> out;
    for (double v : x) out.push_back(v - m - std::log(z));
    return out;
  };
  const std::vector<double> lr = log_softmax(phi);
  auto kl = [&](const std::vector<double>& th, bool reverse) {  // reverse: KL(pi || ref); else KL(ref || pi)
    const std::vector<double> lp = log_softmax(th);
    double s = 0;
    for (size_t y = 0; y < lp.size(); ++y)
      s += reverse ? std::exp(lp[y]) * (lp[y] - lr[y]) : std::exp(lr[y]) * (lr[y] - lp[y]);
    return s;
  };
  const std::vector<double> lp = log_softmax(theta);
  const size_t V = theta.size();
  for (KlEstimator k : {KlEstimator::K1, KlEstimator::K2, KlEstimator::K3}) {
    double value = 0;
    std::vector<double> grad(V, 0.0);
    for (size_t y = 0; y < V; ++y) {
      const double p = std::exp(lp[y]), d = kl_grad(k, lp[y], lr[y]);
      value += p * kl_value(k, lp[y], lr[y]);
      for (size_t j = 0; j < V; ++j) grad[j] += p * d * ((j == y ? 1.0 : 0.0) - std::exp(lp[j]));
    }
    if (k != KlEstimator::K2) {
      EXPECT_NEAR(value, kl(theta, true), 1e-12) << "k" << int(k) + 1 << " is unbiased";
    }
    for (size_t j = 0; j < V; ++j) {
      std::vector<double> up = theta, dn = theta;
      up[j] += 1e-5;
      dn[j] -= 1e-5;
      const double want = k == KlEstimator::K1   ? 0.0
                          : k == KlEstimator::K2 ? (kl(up, true) - kl(dn, true)) / 2e-5
                                                 : (kl(up, false) - kl(dn, false)) / 2e-5;
      EXPECT_NEAR(grad[j], want, 1e-8) << "k" << int(k) + 1 << ", d theta_" << j;
    }
  }
}

TEST(RlPolicyLoss, MismatchCorrectionsAndAggregationByHand) {
  // Ratios old/rollout: e^0.1 = 1.105171, e^-0.5 = 0.606531, 1.
  const std::vector<double> old = {-1, -2, -0.5}, roll = {-1.1, -1.5, -0.5};
  expect_vec(token_weights(old, roll, 0.1, {}), {0.1, 0.1, 0.1}, 1e-15, "no correction");
  expect_vec(token_weights(old, roll, 0.1, {.tis_cap = 1.05}), {0.105, 0.1 * std::exp(-0.5), 0.1}, 1e-12, "token TIS");
  expect_vec(token_weights(old, roll, 0.1, {.tis_cap = 2, .tis_sequence = true}),
             {0.1 * std::exp(-0.4), 0.1 * std::exp(-0.4), 0.1 * std::exp(-0.4)}, 1e-12, "sequence TIS");
  int64_t masked = -1;
  expect_vec(token_weights(old, roll, 0.1, {.token_mask_low = 0.7, .token_mask_high = 1.2}, &masked), {0.1, 0, 0.1},
             1e-15, "token mask");
  EXPECT_EQ(masked, 1);
  // Geometric mean e^(-0.4 / 3) = 0.875 is outside [0.9, 1.1]: the whole sample is masked.
  expect_vec(token_weights(old, roll, 0.1, {.seq_mask_low = 0.9, .seq_mask_high = 1.1}, &masked), {0, 0, 0}, 0,
             "sequence mask");
  EXPECT_EQ(masked, 3);
  EXPECT_DOUBLE_EQ(aggregation_norm(LossAggregation::TokenMean, 10, 100, 4, 0), 0.01);
  EXPECT_DOUBLE_EQ(aggregation_norm(LossAggregation::SeqMeanTokenSum, 10, 100, 4, 0), 0.25);
  EXPECT_DOUBLE_EQ(aggregation_norm(LossAggregation::SeqMeanTokenMean, 10, 100, 4, 0), 0.025);
  EXPECT_DOUBLE_EQ(aggregation_norm(LossAggregation::Constant, 10, 100, 4, 512), 1.0 / 2048);
  expect_mt_error([] { aggregation_norm(LossAggregation::Constant, 10, 100, 4, 0); }, "constant normaliser 0 must be > 0");
}

// The mini-batch's weights: the masks decide the normalisers. Four samples; sample 2 overlong-filtered.
// Ratios e^(old - rollout): sample 0 {1, e = 2.718, 1}, sample 1 {e^0.1 = 1.105, e^-0.1 = 0.905, 1},
// sample 3 {e^-1 = 0.368, e}. The token band [0.5, 2] masks sample 0's middle token and both of sample 3's,
// so 2 + 3 = 5 tokens of 2 samples are trained (sample 3, wholly masked, is no sample of the normaliser):
// token-mean 1/5; seq-mean-token-sum 1/2; seq-mean-token-mean 1/(2 x 2) for sample 0 (2 unmasked
// tokens), 1/(2 x 3) for sample 1; constant 1/(2 x 10). Counting the masked tokens (7 tokens of 3 samples,
// sample 0 of length 3) would give 1/7, 1/3, 1/9, 1/6 and 1/30: the bug this test was written for.
TEST(RlPolicyLoss, MiniBatchWeightsLeaveMaskedTokensOutOfTheDenominators) {
  const std::vector<std::vector<double>> old = {{-1, -1, -1}, {-1, -1, -1}, {-2, -2}, {-1, -1}},
                                         roll = {{-1, -2, -1}, {-1.1, -0.9, -1}, {-2, -2}, {0, -2}};
  const std::vector<bool> filtered = {false, false, true, false};
  const MismatchConfig band{.token_mask_low = 0.5, .token_mask_high = 2};
  struct Case {
    LossAggregation a;
    double w0, w1;  // sample 0's and sample 1's normaliser
  };
  for (const Case& c :
       {Case{LossAggregation::TokenMean, 1.0 / 5, 1.0 / 5}, Case{LossAggregation::SeqMeanTokenSum, 0.5, 0.5},
        Case{LossAggregation::SeqMeanTokenMean, 1.0 / 4, 1.0 / 6},
        Case{LossAggregation::Constant, 1.0 / 20, 1.0 / 20}}) {
    const MiniBatchWeights mw = minibatch_weights(old, roll, filtered, c.a, 10, band);
    const std::string what = "aggregation " + std::to_string(int(c.a));
    EXPECT_EQ(mw.tokens, 5) << what;
    EXPECT_EQ(mw.samples, 2) << what;
    EXPECT_EQ(mw.masked, 3) << what << ": sample 0's one and sample 3's two (the filtered sample's are not masks')";
    expect_vec(mw.w[0], {c.w0, 0, c.w0}, 1e-15, what + " sample 0");
    expect_vec(mw.w[1], {c.w1, c.w1, c.w1}, 1e-15, what + " sample 1");
    expect_vec(mw.w[2], {0, 0}, 0, what + " filtered");
    expect_vec(mw.w[3], {0, 0}, 0, what + " masked");
  }
  // With truncated importance sampling (cap 1.05) on top: the TIS weight times the same normaliser.
  MismatchConfig tis = band;
  tis.tis_cap = 1.05;
  const MiniBatchWeights t = minibatch_weights(old, roll, filtered, LossAggregation::TokenMean, 0, tis);
  expect_vec(t.w[1], {0.2 * 1.05, 0.2 * std::exp(-0.1), 0.2}, 1e-15, "tis");
  // The sequence band [0.9, 1.1] masks sample 0 (geometric mean e^(1/3) = 1.396) and keeps 1 and 3
  // (e^0 = 1): 3 + 2 = 5 tokens, token-mean 1/5.
  const MiniBatchWeights q = minibatch_weights(old, roll, filtered, LossAggregation::TokenMean, 0,
                                               {.seq_mask_low = 0.9, .seq_mask_high = 1.1});
  EXPECT_EQ(q.tokens, 5);
  EXPECT_EQ(q.masked, 3);
  expect_vec(q.w[0], {0, 0, 0}, 0, "sequence-masked");
  expect_vec(q.w[3], {0.2, 0.2}, 1e-15, "sample 3 under the sequence band");
  // Everything masked or filtered: all weights 0, no division by zero.
  const MiniBatchWeights none = minibatch_weights({{-1}}, {{-9}}, {false}, LossAggregation::TokenMean, 0, band);
  EXPECT_EQ(none.tokens, 0);
  expect_vec(none.w[0], {0}, 0, "all masked");
  expect_mt_error([&] { minibatch_weights(old, roll, {false}, LossAggregation::TokenMean, 0, {}); }, "1 filter flags");
}

namespace {

// Rows of one micro-batch: 6 tokens, the first a prompt token (label -100), two samples (ids 0 and 1).
struct Rows {
  std::vector<float> logp = {0, -1.0f, -0.7f, -2.0f, -0.3f, -1.5f};
  std::vector<float> adv = {0, 1.0f, 1.0f, -0.5f, -0.5f, -0.5f}, old = {0, -1.1f, -0.9f, -1.6f, -0.3f, -1.4f},
                     w = {0, 0.2f, 0.2f, 0.1f, 0.1f, 0.1f}, ref = {0, -1.2f, -0.6f, -2.1f, -0.5f, -1.5f},
                     sample = {0, 0, 0, 1, 1, 1}, ent = {0, 2.0f, 1.5f, 1.0f, 0.5f, 3.0f};
  TokenRows make(const std::vector<float>& lp) const {
    TokenRows r;
    r.rows = 6;
    r.labels = Tensor::empty({6}, DType::I64);
    for (int64_t t = 0; t < 6; ++t) r.labels.data<int64_t>()[t] = t == 0 ? -100 : 7;
    auto f = [](const std::vector<float>& v) {
      Tensor x = Tensor::empty({int64_t(v.size())});
      std::copy(v.begin(), v.end(), x.data<float>());
      return x;
    };
    r.logp = f(lp);
    r.entropy = f(ent);
    r.values = {f(adv), f(old), f(w), f(ref), f(sample)};
    return r;
  }
};

double loss_of(const PolicyObjective& o, const Rows& R, const std::vector<float>& lp, std::vector<float>* g) {
  TokenRows rows = R.make(lp);
  Tensor dlogp = Tensor::zeros({6}), dent = Tensor::zeros({6});
  const double l = o.coefficients(rows, dlogp, &dent);
  if (g) g->assign(dlogp.data<float>(), dlogp.data<float>() + 6);
  return l;
}

// The coefficients `g` (dL/dlogp of tokens 1..5; token 0 is the prompt) against central differences of the
// loss, step 1e-3, within 2e-4.
void expect_matches_central_differences(const PolicyObjective& o, const Rows& R, const std::vector<float>& g,
                                        const std::string& label) {
  for (size_t t = 1; t < 6; ++t) {
    const float h = 1e-3f;
    std::vector<float> up = R.logp, dn = R.logp;
    up[t] += h;
    dn[t] -= h;
    const double fd = (loss_of(o, R, up, nullptr) - loss_of(o, R, dn, nullptr)) / (2 * double(h));
    EXPECT_NEAR(g[t], fd, 2e-4) << label << " token " << t;
  }
}

}  // namespace

TEST(RlPolicyLoss, ObjectiveLossAndCoefficientsMatchFiniteDifferences) {
  const Rows R;
  for (PolicyLoss kind : {PolicyLoss::PpoClip, PolicyLoss::Gspo, PolicyLoss::PolicyGradient}) {
    PolicyLossConfig c;
    c.kind = kind;
    c.kl_coef = 0.05;
    c.kl = KlEstimator::K3;
    c.entropy_coef = 0.01;
    const PolicyObjective o(c);
    std::vector<float> g;
    const double L = loss_of(o, R, R.logp, &g);
    // The loss by hand from the per-token pieces.
    double want = 0;
    for (size_t t = 1; t < 6; ++t) {
      double lr = double(R.logp[t]) - double(R.old[t]);
      if (kind == PolicyLoss::Gspo) {
        const size_t b = t < 3 ? 1 : 3, e = t < 3 ? 3 : 6;
        lr = 0;
        for (size_t u = b; u < e; ++u) lr += double(R.logp[u]) - double(R.old[u]);
        lr /= double(e - b);
      }
      want += double(R.w[t]) * (policy_term(c, lr, R.adv[t]).loss +
                                0.05 * kl_value(KlEstimator::K3, R.logp[t], R.ref[t]) - 0.01 * double(R.ent[t]));
    }
    EXPECT_NEAR(L, want, 1e-6) << int(kind);
    EXPECT_EQ(g[0], 0.0f) << "the prompt token";
    if (kind == PolicyLoss::Gspo) continue;  // GspoGradientIsTheSequenceObjectivesGradient (below) checks it
    expect_matches_central_differences(o, R, g, "kind " + std::to_string(int(kind)));
  }
}

// GSPO's gradient is the gradient of its sequence-level objective: with weights uniform within a sample (every
// aggregation gives that; token-level TIS does not), sum_t w_t l_t = sum_i W_i (-A_i s_i) with W_i the sample's
// weight sum, and d/dlogp_t of it is W_i (-A_i s_i) / |y_i| = w_t (-A_i s_i): what the objective writes
// (veRL's sg(s_i) exp(logp - sg(logp)) form). Checked against central differences of the loss value, the KL
// term included, ratios inside the clip range (s = 1.16 and 0.85) and one sample clipped (s > 1 + 0.1, A > 0:
// no gradient from the policy term). A per-token ratio r_t or a gradient of s_i / |y_i| per token would fail.
TEST(RlPolicyLoss, GspoGradientIsTheSequenceObjectivesGradient) {
  const Rows R;
  for (double clip : {0.2, 0.1}) {
    PolicyLossConfig c;
    c.kind = PolicyLoss::Gspo;
    c.clip_low = c.clip_high = clip;
    c.kl_coef = 0.05;
    const PolicyObjective o(c);
    std::vector<float> g;
    loss_of(o, R, R.logp, &g);
    expect_matches_central_differences(o, R, g, "clip " + std::to_string(clip));
    if (clip == 0.1) {
      EXPECT_GT(o.metrics().clipped_high, 0) << "sample 0 clipped";
    }
  }
}

TEST(RlPolicyLoss, GspoUsesTheSequenceRatioForEveryToken) {
  const Rows R;
  PolicyLossConfig c;
  c.kind = PolicyLoss::Gspo;
  c.clip_low = 0.99;  // nothing clipped (ratios 1.16 and 0.85): g_t = -w_t A s_i
  c.clip_high = 10;
  const PolicyObjective o(c);
  std::vector<float> g;
  loss_of(o, R, R.logp, &g);
  const double s0 = std::exp(((-1.0 + 1.1) + (-0.7 + 0.9)) / 2), s1 = std::exp(((-2.0 + 1.6) + 0.0 + (-1.5 + 1.4)) / 3);
  EXPECT_NEAR(g[1], -0.2 * 1.0 * s0, 1e-6);
  EXPECT_NEAR(g[2], -0.2 * 1.0 * s0, 1e-6);
  for (size_t t = 3; t < 6; ++t) EXPECT_NEAR(g[t], -0.1 * -0.5 * s1, 1e-6) << t;
  EXPECT_EQ(o.metrics().tokens, 5);
  // A token of weight 0 (a mismatch mask took it) is left out of its sample's ratio, as of the denominators:
  // with token 4 masked, s1 = exp(((-2.0 + 1.6) + (-1.5 + 1.4)) / 2) = exp(-0.25) = 0.778801 (with it,
  // exp(-0.5 / 3) = 0.846482); token 4 itself gets no gradient.
  Rows M;
  M.w[4] = 0;
  const PolicyObjective om(c);
  loss_of(om, M, M.logp, &g);
  const double s1m = std::exp(((-2.0 + 1.6) + (-1.5 + 1.4)) / 2);
  EXPECT_NEAR(g[3], -0.1 * -0.5 * s1m, 1e-6);
  EXPECT_NEAR(g[5], -0.1 * -0.5 * s1m, 1e-6);
  EXPECT_EQ(g[4], 0.0f);
  EXPECT_NEAR(g[1], -0.2 * 1.0 * s0, 1e-6) << "the other sample unchanged";
  EXPECT_EQ(om.metrics().tokens, 4) << "a token of weight 0 is not a trained token of the metrics";
}

namespace {

// Three prompts of the tiny model's vocabulary (4, 7, 10 tokens), two samples each at T = 1, 5-9 new tokens.
std::vector<GenerateRequest> three_requests(const ModelConfig& c) {
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest r;
    for (int t = 0; t < 4 + 3 * i; ++t) r.prompt.push_back(int32_t((i * 37 + t * 11 + 5) % c.vocab_size));
    r.max_new_tokens = 5 + 2 * i;
    r.n = 2;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = uint64_t(i);
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace

// The batch-invariant mode (core/determinism.h) on the CPU: the engine's log-probs equal the trainer's forward on
// the same tokens bit for bit, with the routing the trainer chooses itself (no replay); a sample's trainer
// log-probs alone equal those in the batch; and a request generated alone gives the same tokens and log-probs
// as among others. Without the mode the same run differs in the last bits (about 1 token in 10 by one ulp).
TEST(RlRolloutBatch, BatchInvariantModeGivesTheEnginesLogprobsBitForBit) {
  BatchInvariantScope invariant(true);
  ModelConfig c = preset_model_config("tiny");
  c.eos_token_id = -1;
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 21);
  const std::vector<GenerateRequest> reqs = three_requests(c);
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.block_size = 4;
  RolloutEngine engine(m, eo);
  const std::vector<GeneratedSample> gen = engine.generate(reqs);
  const std::vector<RolloutSample> samples = rltest::rollout_samples(reqs, gen, false);
  const std::vector<std::vector<float>> trainer = rltest::trainer_logprobs(m, samples);
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); ++i)
    for (size_t j = 0; j < samples[i].logprobs.size(); ++j, ++tokens)
      ASSERT_EQ(std::bit_cast<uint32_t>(trainer[i][j]), std::bit_cast<uint32_t>(samples[i].logprobs[j]))
          << "sample " << i << " token " << j << ": trainer " << trainer[i][j] << ", engine " << samples[i].logprobs[j];
  EXPECT_EQ(tokens, 42);
  // The trainer's log-probs of one sample alone (a batch of 1, its own length) are those it had in the batch.
  for (size_t i = 0; i < samples.size(); ++i) {
    const std::vector<float> alone = rltest::trainer_logprobs(m, {samples[i]})[0];
    for (size_t j = 0; j < alone.size(); ++j)
      ASSERT_EQ(std::bit_cast<uint32_t>(alone[j]), std::bit_cast<uint32_t>(trainer[i][j])) << "sample " << i;
  }
  // The last request generated alone: the same tokens and log-probs as among the others.
  const std::vector<GeneratedSample> solo = engine.generate({reqs[2]});
  for (size_t k = 0; k < solo.size(); ++k) {
    const GeneratedSample& a = solo[k];
    const GeneratedSample& b = gen[4 + k];
    ASSERT_EQ(a.tokens, b.tokens);
    for (size_t j = 0; j < a.logprobs.size(); ++j)
      ASSERT_EQ(std::bit_cast<uint32_t>(a.logprobs[j]), std::bit_cast<uint32_t>(b.logprobs[j]));
  }
}

// The engine → trainer hand-off: samples generated with the routing record, packed into one micro-batch
// and run through the trainer's forward with the replay, have the engine's log-probs (fp32 CPU: the
// rollout/trainer mismatch is rounding only), the padding and prompts carry no target, and a policy
// update through PolicyObjective runs on the packed batch with finite, non-zero gradients.
TEST(RlRolloutBatch, PackedRolloutsGiveTheEnginesLogprobsInTheTrainer) {
  ModelConfig c = preset_model_config("tiny");
  c.eos_token_id = -1;
  Qwen3MoeModel m(c);
  init_weights(c, m.table(), m.params(), 21);
  const std::vector<GenerateRequest> reqs = three_requests(c);
  EngineOptions eo;
  eo.kv_cache_bytes = 16 << 20;
  eo.block_size = 4;
  eo.record_routing = true;
  RolloutEngine engine(m, eo);
  const std::vector<RolloutSample> samples = rltest::rollout_samples(reqs, engine.generate(reqs), true);
  PackedRollouts p = pack_rollouts(samples, c.num_experts_per_tok);
  ASSERT_EQ(p.mb.input_ids.size(0), 6);
  PassOptions po;
  po.token_logprobs = true;
  const LossParts lp = m.forward(p.mb, po);
  const std::vector<std::vector<float>> trainer = response_values(p, lp.logp);
  double worst = 0;
  for (size_t i = 0; i < samples.size(); ++i)
    for (size_t j = 0; j < samples[i].logprobs.size(); ++j)
      worst = std::max(worst, std::abs(double(trainer[i][j]) - double(samples[i].logprobs[j])));
  EXPECT_LT(worst, 1e-5) << "engine vs trainer log-probs";
  EXPECT_EQ(lp.n_valid, int64_t(5 + 5 + 7 + 7 + 9 + 9)) << "only response tokens are targets";
  // A GRPO-style update on the packed batch.
  std::vector<std::vector<float>> adv, old, w;
  int64_t tokens = 0;
  for (const RolloutSample& s : samples) tokens += int64_t(s.response.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    adv.emplace_back(samples[i].response.size(), i % 2 ? -0.5f : 0.5f);
    old.push_back(trainer[i]);
    w.emplace_back(samples[i].response.size(), float(1.0 / double(tokens)));
  }
  set_token_values(p, PolicyObjective::kAdvantage, adv);
  set_token_values(p, PolicyObjective::kOldLogp, old);
  set_token_values(p, PolicyObjective::kWeight, w);
  const PolicyObjective obj(PolicyLossConfig{});
  PassOptions up;
  up.objective = &obj;
  up.overwrite_grads = true;
  const LossParts l2 = m.forward_backward(p.mb, up);
  // On-policy (old = current): the ratio is 1, so the loss is -sum w A = 0 here (equal +- advantages).
  EXPECT_NEAR(l2.objective, 0.0, 1e-6);
  EXPECT_EQ(obj.metrics().tokens, 42);
  double norm = 0;
  const Tensor g = m.grads();
  for (int64_t i = 0; i < g.numel(); ++i) norm += double(g.data<float>()[i]) * g.data<float>()[i];
  EXPECT_TRUE(std::isfinite(norm));
  EXPECT_GT(norm, 0.0);
}

TEST(RlShaping, OverlongPenaltyDynamicSamplingAndKlInRewardByHand) {
  // max 100, buffer 20: 0 up to 80 tokens, then linear to -1 at 100; -1 beyond.
  EXPECT_EQ(soft_overlong_penalty(80, 100, 20, 1.0), 0.0);
  EXPECT_DOUBLE_EQ(soft_overlong_penalty(90, 100, 20, 1.0), -0.5);
  EXPECT_DOUBLE_EQ(soft_overlong_penalty(100, 100, 20, 1.0), -1.0);
  EXPECT_DOUBLE_EQ(soft_overlong_penalty(101, 100, 20, 0.5), -0.5);
  expect_mt_error([] { soft_overlong_penalty(10, 100, 0, 1.0); }, "buffer 0");
  // Groups of 3: all ones, mixed, all zeros, mixed.
  EXPECT_EQ(informative_groups(std::vector<double>{1, 1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 3}, 3),
            (std::vector<int64_t>{1, 3}));
  // r_t = -0.1 (logp - ref), the outcome 1 on the last token.
  expect_vec(token_rewards_with_kl(1.0, std::vector<double>{-1, -2, -0.5}, std::vector<double>{-1.5, -2, -0.25}, 0.1),
             {-0.05, 0.0, 1.025}, 1e-12, "kl in reward");
}

// GRPO end to end on one process (fp32 CPU): the session's model generates through the engine with
// the routing recorded, a reward that favours the low eighth of the vocabulary scores the samples, and
// the updates (PPO clip, routing replayed) raise that reward; the rollout and the trainer agree on the
// log-probs before each update (the mismatch is rounding only on the CPU).
TEST(RlGrpo, StepsRaiseTheRewardWithTheRolloutAndTrainerInAgreement) {
  rltest::Rig r = rltest::make_rig(3);
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 2e-2;
  std::vector<double> curve;
  for (int64_t step = 0; step < 24; ++step) {
    const GrpoMetrics m =
        grpo_step(*r.s, *r.engine, rltest::fixed_prompts(4), rltest::low_token_reward, o, step);
    curve.push_back(m.reward_mean);
    EXPECT_LT(m.logprob_diff_max, 1e-4) << "step " << step;
    EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm)) << "step " << step;
    std::printf("step %lld: reward %.3f, loss %.4f, grad norm %.3f, |dlogp| max %.1e\n", (long long)step, m.reward_mean,
                m.loss, m.grad_norm, m.logprob_diff_max);
  }
  const double first = (curve[0] + curve[1] + curve[2]) / 3, last = (curve[21] + curve[22] + curve[23]) / 3;
  EXPECT_GT(last, first + 0.3) << "the reward did not rise";
}
