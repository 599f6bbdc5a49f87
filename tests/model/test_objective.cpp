// The loss out of the model (model/objective.h): per-token log-probabilities and entropies from the
// chunked head equal those of the materialised logits; cross-entropy through the general objective
// path equals the fused path; a per-token objective that reads the micro-batch's token values and the
// entropy gets the gradients of its own value (finite differences); and
// PassOptions that contradict each other are errors. fp32 CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "model/model_test_util.h"
#include "model/objective.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "model/fd_check.h"
#include "test_util.h"

using namespace mt;

namespace {

ModelConfig config(bool tied) {
  ModelConfig c = preset_model_config("tiny");
  c.tie_word_embeddings = tied;
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  return c;
}

void init(Qwen3MoeModel& m, uint64_t seed) {
  init_weights(m.config(), m.table(), m.params(), seed);
}

using testutil::rel_l2;

// L = sum_t v_t logp_t + beta H_t over targets, v from the micro-batch's first token value: the form of
// a policy-gradient loss with an entropy bonus.
class WeightedLogProb : public TokenObjective {
 public:
  explicit WeightedLogProb(double beta) : beta_(beta) {}
  bool needs_entropy() const override { return beta_ != 0; }
  double coefficients(const TokenRows& rows, Tensor& dlogp, Tensor* dentropy) const override {
    Tensor g = Tensor::zeros({rows.rows}), h = Tensor::zeros({rows.rows});
    const Tensor logp = rows.logp.to(Device::CPU);
    const Tensor ent = beta_ != 0 ? rows.entropy.to(Device::CPU) : Tensor();
    double value = 0;
    for (int64_t t = 0; t < rows.rows; ++t) {
      if (rows.labels.data<int64_t>()[t] == -100) continue;
      const double v = rows.values.at(0).data<float>()[t];
      g.data<float>()[t] = float(v);
      value += v * logp.data<float>()[t];
      if (beta_ != 0) {
        h.data<float>()[t] = float(beta_);
        value += beta_ * ent.data<float>()[t];
      }
    }
    dlogp.copy_from(g);
    if (dentropy) dentropy->copy_from(h);
    return value;
  }

 private:
  double beta_;
};

// The same objective's value from a forward's per-token outputs (for finite differences).
double objective_value(Qwen3MoeModel& m, const MicroBatch& mb, double beta) {
  PassOptions po;
  po.token_logprobs = true;
  po.token_entropy = true;
  const LossParts lp = m.forward(mb, po);
  const MicroBatch planned = plan_micro_batch(mb);
  double v = 0;
  for (int64_t t = 0; t < lp.logp.numel(); ++t) {
    if (planned.plan->shifted_labels.data<int64_t>()[t] == -100) continue;
    v += double(planned.plan->shifted_values[0].data<float>()[t]) * lp.logp.data<float>()[t] +
         beta * lp.entropy.data<float>()[t];
  }
  return v;
}

MicroBatch batch_with_values(const ModelConfig& c, uint64_t seed) {
  MicroBatch mb = test::random_batch(c, 2, 12, seed);
  Tensor v = Tensor::empty({2, 12});
  for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = float(std::sin(0.7 * double(i)));
  mb.token_values = {v};
  return mb;
}

}  // namespace

// logp and entropy of the chunked head against log_softmax of the materialised logits; ignored rows 0;
// ce_sum = -sum logp.
TEST(Objective, TokenLogprobsAndEntropyMatchTheLogits) {
  for (bool tied : {false, true}) {
    const ModelConfig c = config(tied);
    Qwen3MoeModel m(c);
    init(m, 3);
    const MicroBatch mb = test::random_batch(c, 2, 12, 4);
    Tensor logits;
    const LossParts full = m.forward(mb, &logits);
    PassOptions po;
    po.token_logprobs = true;
    po.token_entropy = true;
    const LossParts lp = m.forward(mb, po);
    const MicroBatch planned = plan_micro_batch(mb);
    const int64_t T = logits.size(0), V = logits.size(1);
    ASSERT_EQ(lp.logp.numel(), T);
    ASSERT_EQ(lp.entropy.numel(), T);
    for (int64_t t = 0; t < T; ++t) {
      const float* x = logits.data<float>() + t * V;
      double mx = x[0], s = 0, px = 0;
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(x[v]));
      for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - mx);
      const double lse = mx + std::log(s);
      for (int64_t v = 0; v < V; ++v) px += std::exp(double(x[v]) - lse) * double(x[v]);
      const int64_t label = planned.plan->shifted_labels.data<int64_t>()[t];
      const double want_logp = label == -100 ? 0.0 : double(x[label]) - lse;
      const double want_h = label == -100 ? 0.0 : lse - px;
      EXPECT_NEAR(lp.logp.data<float>()[t], want_logp, 1e-5) << "row " << t;
      EXPECT_NEAR(lp.entropy.data<float>()[t], want_h, 1e-5) << "row " << t;
    }
    EXPECT_NEAR(lp.ce_sum, full.ce_sum, 1e-5 * full.ce_sum);
  }
}

// Cross-entropy through the objective path (logprobs, coefficients, the general backward) equals the
// fused LM head + loss: loss and every gradient.
TEST(Objective, CrossEntropyObjectiveEqualsTheFusedPath) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const ModelConfig c = config(tied);
    const MicroBatch mb = test::random_batch(c, 2, 12, 5);
    Qwen3MoeModel a(c), b(c);
    init(a, 6);
    init(b, 6);
    const double scale = 1.0 / 17;
    PassOptions fused;
    fused.ce_scale = scale;
    fused.overwrite_grads = true;
    const LossParts la = a.forward_backward(mb, fused);
    const CrossEntropyObjective ce(scale);
    PassOptions general;
    general.objective = &ce;
    general.overwrite_grads = true;
    const LossParts lb = b.forward_backward(mb, general);
    EXPECT_NEAR(lb.objective, la.ce_sum * scale, 1e-6 * la.loss);
    EXPECT_NEAR(lb.loss, la.loss, 1e-6 * la.loss);
    EXPECT_NEAR(lb.ce_sum, la.ce_sum, 1e-6 * la.ce_sum);
    EXPECT_LT(rel_l2(b.grads(), a.grads()), 1e-6);
    EXPECT_GT(ops::sum_squares(a.grads()), 0.0);
  }
}

// A per-token objective with token values and an entropy term: the gradient of its value, checked by
// central differences on elements of the head, the final norm and the last layer's experts.
TEST(Objective, PerTokenObjectiveGradientMatchesFiniteDifferences) {
  const ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init(m, 7);
  const MicroBatch mb = batch_with_values(c, 8);
  const double beta = 0.3;
  const WeightedLogProb obj(beta);
  PassOptions po;
  po.objective = &obj;
  po.overwrite_grads = true;
  const LossParts lp = m.forward_backward(mb, po);
  EXPECT_NEAR(lp.objective, objective_value(m, mb, beta), 1e-4 * std::abs(lp.objective));
  const Tensor analytic = m.grads().clone();
  // Parameters after the last router (a perturbation cannot flip a routing decision); the CE test
  // above covers the rest of the backward, which the objective does not change (it only sets dhn).
  const test::FdResult fd = test::finite_difference_check(
      m, analytic,
      {"lm_head.weight", "model.norm.weight", "model.layers.1.mlp.experts.gate_up_proj",
       "model.layers.1.mlp.experts.down_proj"},
      1e-2f, [&] { return objective_value(m, mb, beta); });
  EXPECT_EQ(fd.checked, 24);
  EXPECT_GT(fd.analytic_norm2, 0.0);
  EXPECT_LT(fd.rel_l2, 2e-2) << "relative L2 of analytic vs finite differences";
}

// Constant token values v = -s make L = s × CE: the same gradients as the fused path with ce_scale s.
TEST(Objective, ConstantValuesGiveTheCrossEntropyGradients) {
  const ModelConfig c = config(true);
  MicroBatch mb = test::random_batch(c, 2, 12, 9);
  const double s = 0.05;
  Tensor v = Tensor::empty({2, 12});
  v.fill_(float(-s));
  mb.token_values = {v};
  Qwen3MoeModel a(c), b(c);
  init(a, 10);
  init(b, 10);
  a.zero_grads();
  b.zero_grads();
  const LossParts la = a.forward_backward(mb, s, 0.0);
  const WeightedLogProb obj(0.0);
  PassOptions po;
  po.objective = &obj;
  const LossParts lb = b.forward_backward(mb, po);
  EXPECT_NEAR(lb.objective, la.loss, 1e-6 * la.loss);
  EXPECT_LT(rel_l2(b.grads(), a.grads()), 1e-6);
}

TEST(Objective, ContradictoryPassOptionsAreErrors) {
  const ModelConfig c = config(false);
  Qwen3MoeModel m(c);
  init(m, 11);
  const MicroBatch mb = test::random_batch(c, 1, 8, 12);
  const CrossEntropyObjective ce(1.0);
  Tensor logits;
  auto expect_error = [&](PassOptions po, bool backward, const std::string& needle) {
    try {
      if (backward)
        m.forward_backward(mb, po);
      else
        m.forward(mb, po);
      ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  PassOptions both;
  both.ce_scale = 0.5;
  both.objective = &ce;
  expect_error(both, true, "ce_scale 0.5 and a per-token objective");
  PassOptions with_logits;
  with_logits.objective = &ce;
  with_logits.logits_out = &logits;
  expect_error(with_logits, true, "logits_out materialises the logits");
  PassOptions entropy_only;
  entropy_only.token_entropy = true;
  expect_error(entropy_only, false, "token_entropy needs token_logprobs");
  PassOptions fwd_obj;
  fwd_obj.objective = &ce;
  expect_error(fwd_obj, false, "a per-token objective applies to forward_backward");
}

// Token values and replayed routing are planned with the ids: shifted like the labels (0 at a
// sequence's end and on padding), and sliced to the sequence chunk under sp.
TEST(Objective, TokenValuesAndRoutingArePlannedWithTheIds) {
  Tensor ids = Tensor::empty({1, 5}, DType::I64), labels = Tensor::empty({1, 5}, DType::I64);
  Tensor vals = Tensor::empty({1, 5}), route = Tensor::empty({5, 2}, DType::I32);
  for (int64_t i = 0; i < 5; ++i) {
    ids.data<int64_t>()[i] = labels.data<int64_t>()[i] = 10 + i;
    vals.data<float>()[i] = float(i) + 0.5f;
    route.data<int32_t>()[2 * i] = int32_t(i);
    route.data<int32_t>()[2 * i + 1] = int32_t(i + 1);
  }
  MicroBatch mb{ids, labels};
  mb.token_values = {vals};
  mb.routing = {route};
  // sp 2: S' 6, C 3; rank 1 holds positions 3, 4 and one padded token.
  const MicroBatch r1 = plan_micro_batch(mb, 2, 1);
  const BatchPlan& p = *r1.plan;
  ASSERT_EQ(p.shifted_values.size(), 1u);
  EXPECT_EQ(p.shifted_values[0].data<float>()[0], 4.5f);  // position 3's target is position 4
  EXPECT_EQ(p.shifted_values[0].data<float>()[1], 0.0f);  // the sequence's last token has no target
  EXPECT_EQ(p.shifted_values[0].data<float>()[2], 0.0f);  // padding
  ASSERT_EQ(p.routing.size(), 1u);
  EXPECT_EQ(p.routing[0].data<int32_t>()[0], 3);
  EXPECT_EQ(p.routing[0].data<int32_t>()[3], 5);
  EXPECT_EQ(p.routing[0].data<int32_t>()[4], 0);  // padding names experts 0..K-1
  EXPECT_EQ(p.routing[0].data<int32_t>()[5], 1);
  // A value tensor of another shape is an error naming it.
  MicroBatch bad = mb;
  bad.token_values = {Tensor::empty({1, 4})};
  try {
    plan_micro_batch(bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token_values[0] must be f32 with the shape of input_ids"), std::string::npos)
        << e.what();
  }
}
