// The critic's scalar head (ModelConfig::value_head) and the clipped value loss (rl/value_loss.h):
// score.weight is [1, D] and v_t equals the LM head's logit of a head row copied into it; a value
// objective's gradients match central differences (head, final norm, last layer's experts); the
// clipped value loss against numbers worked by hand, with the clipped side's zero gradient; mixing a
// value objective with an LM head (or cross-entropy with a value head) is an error. fp32 CPU.
#include <gtest/gtest.h>

#include <cmath>

#include "model/model_test_util.h"
#include "model/objective.h"
#include "model/qwen3_moe.h"
#include "rl/value_loss.h"
#include "model/fd_check.h"

using namespace mt;

namespace {

ModelConfig lm_config() {
  ModelConfig c = preset_model_config("tiny");
  c.tie_word_embeddings = false;
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  return c;
}

ModelConfig value_config() {
  ModelConfig c = lm_config();
  c.value_head = true;
  return c;
}

// Returns, old values and weights as the value loss reads them (token values 0, 1, 2).
MicroBatch value_batch(const ModelConfig& c, uint64_t seed) {
  MicroBatch mb = test::random_batch(c, 2, 12, seed);
  Tensor ret = Tensor::empty({2, 12}), old = Tensor::empty({2, 12}), w = Tensor::empty({2, 12});
  for (int64_t i = 0; i < 24; ++i) {
    ret.data<float>()[i] = float(std::sin(0.7 * double(i)));
    old.data<float>()[i] = float(0.3 * std::cos(1.3 * double(i)));
    w.data<float>()[i] = float(1.0 / 24 * (1 + i % 3));
  }
  mb.token_values = {ret, old, w};
  return mb;
}

// The loss from a forward's values (for finite differences).
double loss_value(Qwen3MoeModel& m, const MicroBatch& mb, double eps) {
  const LossParts lp = m.forward(mb, PassOptions{});
  const MicroBatch planned = plan_micro_batch(mb);
  double L = 0;
  for (int64_t t = 0; t < lp.value.numel(); ++t) {
    if (planned.plan->shifted_labels.data<int64_t>()[t] == -100) continue;
    const auto& v = planned.plan->shifted_values;
    L += rl::value_term(lp.value.data<float>()[t], v[0].data<float>()[t], v[1].data<float>()[t], v[2].data<float>()[t],
                        eps)
             .loss;
  }
  return L;
}

}  // namespace

TEST(ValueHead, ScoreWeightIsOneRowAndValuesAreThatRowsLogits) {
  const ModelConfig lc = lm_config(), vc = value_config();
  Qwen3MoeModel lm(lc), critic(vc);
  const ParamEntry* score = critic.table().find("score.weight");
  ASSERT_NE(score, nullptr);
  EXPECT_EQ(score->shape, (Shape{1, vc.hidden_size}));
  EXPECT_EQ(critic.table().find("lm_head.weight"), nullptr);
  EXPECT_EQ(vc.num_parameters(), critic.table().total());
  init_weights(lc, lm.table(), lm.params(), 3);
  // The same body; the score row = the LM head's row k.
  const ParamEntry* head = lm.table().find("lm_head.weight");
  ASSERT_EQ(head->offset, score->offset);
  const int64_t k = 5, D = vc.hidden_size;
  std::copy_n(lm.params().data<float>(), score->offset, critic.params().data<float>());
  std::copy_n(lm.params().data<float>() + head->offset + k * D, D, critic.params().data<float>() + score->offset);
  const MicroBatch mb = test::random_batch(lc, 2, 12, 4);
  Tensor logits;
  lm.forward(mb, &logits);
  const LossParts lp = critic.forward(mb, PassOptions{});
  ASSERT_EQ(lp.value.numel(), logits.size(0));
  for (int64_t t = 0; t < lp.value.numel(); ++t)
    EXPECT_NEAR(lp.value.data<float>()[t], logits.data<float>()[t * logits.size(1) + k], 1e-5) << "row " << t;
  EXPECT_EQ(lp.ce_sum, 0.0);
}

TEST(ValueHead, ValueLossGradientMatchesFiniteDifferences) {
  for (double eps : {0.0, 0.2}) {
    SCOPED_TRACE(eps);
    const ModelConfig c = value_config();
    Qwen3MoeModel m(c);
    init_weights(c, m.table(), m.params(), 7);
    // A larger head so that the values spread over the clip band.
    const ParamEntry* score = m.table().find("score.weight");
    for (int64_t i = 0; i < score->numel; ++i) m.params().data<float>()[score->offset + i] *= 20.0f;
    const MicroBatch mb = value_batch(c, 8);
    const rl::ValueLossObjective obj(eps);
    PassOptions po;
    po.objective = &obj;
    po.overwrite_grads = true;
    const LossParts lp = m.forward_backward(mb, po);
    EXPECT_NEAR(lp.objective, loss_value(m, mb, eps), 1e-5 * std::abs(lp.objective));
    EXPECT_GT(obj.metrics().tokens, 0);
    if (eps > 0) {
      EXPECT_GT(obj.metrics().clipped, 0) << "the test should reach the clipped side";
    }
    const Tensor analytic = m.grads().clone();
    const test::FdResult fd = test::finite_difference_check(
        m, analytic,
        {"score.weight", "model.norm.weight", "model.layers.1.mlp.experts.gate_up_proj",
         "model.layers.1.mlp.experts.down_proj"},
        1e-3f, [&] { return loss_value(m, mb, eps); });
    EXPECT_GT(fd.analytic_norm2, 0.0);
    EXPECT_LT(fd.rel_l2, 2e-2);
  }
}

TEST(ValueHead, WrongObjectiveForTheHeadIsAnError) {
  const ModelConfig vc = value_config(), lc = lm_config();
  Qwen3MoeModel critic(vc), lm(lc);
  init_weights(vc, critic.table(), critic.params(), 1);
  init_weights(lc, lm.table(), lm.params(), 1);
  const MicroBatch mb = value_batch(vc, 2);
  try {
    critic.forward_backward(mb, 1.0, 0.0);
    FAIL() << "cross-entropy on a value head";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trains on a ValueObjective"), std::string::npos) << e.what();
  }
  const rl::ValueLossObjective obj(0.2);
  PassOptions po;
  po.objective = &obj;
  try {
    lm.forward_backward(mb, po);
    FAIL() << "a value objective on an LM head";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a value-head model"), std::string::npos) << e.what();
  }
  ModelConfig tied = vc;
  tied.tie_word_embeddings = true;
  EXPECT_THROW(tied.validate(), Error);
}

// L = 0.5 w max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2), worked by hand.
TEST(ValueLoss, HandWorkedTermsAndTheClippedSidesZeroGradient) {
  // v 1.0, R 0.0, v_old 0.5, eps 0.2: unclipped 1.0, clipped (0.7)^2 = 0.49: unclipped wins.
  rl::ValueTerm a = rl::value_term(1.0, 0.0, 0.5, 2.0, 0.2);
  EXPECT_NEAR(a.loss, 0.5 * 2.0 * 1.0, 1e-12);
  EXPECT_NEAR(a.grad, 2.0 * 1.0, 1e-12);
  EXPECT_FALSE(a.clipped);
  // v 1.2, R 1.0, v_old 0.0, eps 0.2: unclipped 0.04, v_clip 0.2 -> (-0.8)^2 = 0.64: clipped side, at
  // its bound: loss 0.5 * 0.64, gradient 0.
  rl::ValueTerm b = rl::value_term(1.2, 1.0, 0.0, 1.0, 0.2);
  EXPECT_NEAR(b.loss, 0.5 * 0.64, 1e-12);
  EXPECT_EQ(b.grad, 0.0);
  EXPECT_TRUE(b.clipped);
  // Inside the band the two sides are equal (v_clip = v): unclipped, ordinary gradient.
  rl::ValueTerm c = rl::value_term(0.1, 1.0, 0.0, 0.5, 0.2);
  EXPECT_NEAR(c.loss, 0.5 * 0.5 * 0.81, 1e-12);
  EXPECT_NEAR(c.grad, 0.5 * -0.9, 1e-12);
  // eps 0: plain squared error, whatever v_old.
  rl::ValueTerm d = rl::value_term(3.0, 1.0, -5.0, 1.0, 0.0);
  EXPECT_NEAR(d.loss, 2.0, 1e-12);
  EXPECT_NEAR(d.grad, 2.0, 1e-12);
}
