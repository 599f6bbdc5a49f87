// Model-level tests of the load-balancing options: the router z-loss gradient against finite
// differences on the tiny model, the options at zero are bit-identical to the plain model, the
// balancing bias steers the top-k (also under recompute, and not under routing replay), and the
// per-expert step load adds up the micro-batches' routing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/rng.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"

using namespace mt;

namespace {

ModelConfig tiny(bool aux) {
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = aux;
  c.router_aux_loss_coef = 0.1;
  return c;
}

void init(Qwen3MoeModel& m, uint64_t seed) {
  init_weights(m.config(), m.table(), m.params(), seed);
}

bool same(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

// forward_backward with ce_scale 0 and aux off differentiates only z_loss_scale * z. z is smooth in
// every parameter as long as no routing decision upstream of a router flips, so the finite
// differences perturb the second sparse layer's parameters (nothing after them routes into a z
// term) and the first layer's router (skipping an element whose perturbation flips a layer-0 choice).
TEST(ModelBalance, ZLossGradientMatchesFiniteDifferences) {
  ModelConfig c = tiny(false);
  Qwen3MoeModel m(c);
  init(m, 5);
  const MicroBatch mb = test::random_batch(c, 2, 16, 3, 4, 1);
  const double scale = 0.01;
  PassOptions po;
  po.z_loss_scale = scale;
  m.zero_grads();
  LossParts lp = m.forward_backward(mb, po);
  EXPECT_NEAR(lp.loss, scale * lp.z, 1e-12 * lp.z);
  EXPECT_GT(lp.z, 0.0);
  Tensor analytic = m.grads().clone();
  const std::vector<Tensor> routing0 = m.last_routing();

  const ParamTable& t = m.table();
  int checked = 0, skipped = 0;
  double num2 = 0, den2 = 0;
  for (const char* name : {"model.layers.1.mlp.gate.weight", "model.layers.1.post_attention_layernorm.weight",
                           "model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.gate.weight"}) {
    const ParamEntry* e = t.find(name);
    ASSERT_NE(e, nullptr) << name;
    const int64_t n = std::min<int64_t>(e->numel, 40);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = e->offset + (j * 7919) % e->numel;
      float* p = m.params().data<float>() + i;
      // Only a flip in layer 0 changes what reaches a z term (layer 1's input); its choices matter not.
      const bool layer0 = std::string(name).find("layers.0") != std::string::npos;
      const float orig = *p, eps = layer0 ? 2e-3f : 1e-2f;
      *p = orig + eps;
      double zp = m.forward(mb, nullptr).z;
      bool flipped = !same(m.last_routing()[0], routing0[0]);
      *p = orig - eps;
      double zm = m.forward(mb, nullptr).z;
      flipped = flipped || !same(m.last_routing()[0], routing0[0]);
      *p = orig;
      if (flipped && layer0) {
        ++skipped;
        continue;
      }
      const double fd = scale * (zp - zm) / (2.0 * eps), an = analytic.data<float>()[i];
      num2 += (an - fd) * (an - fd);
      den2 += fd * fd;
      ++checked;
    }
  }
  std::printf("z-loss vs finite differences: %d elements, %d skipped (layer-0 flip), relative L2 %.2e\n", checked,
              skipped, std::sqrt(num2 / den2));
  EXPECT_GT(checked, 100);
  EXPECT_LT(skipped, 10);
  EXPECT_GT(den2, 0.0);
  EXPECT_LT(std::sqrt(num2 / den2), 5e-3) << checked << " elements";
}

// The options at their "off" values (z_loss_scale 0, a bias of zeros) give exactly the plain model's
// loss and gradients, with the aux loss on and with recompute.
TEST(ModelBalance, OptionsAtZeroAreBitIdenticalToThePlainModel) {
  for (Recompute policy : {Recompute::None, Recompute::Full}) {
    ModelConfig c = tiny(true);
    const MicroBatch mb = test::random_batch(c, 2, 12, 4, 4, 1);
    Qwen3MoeModel a(c), b(c);
    init(a, 6);
    init(b, 6);
    b.enable_router_bias();
    PassOptions po;
    po.ce_scale = 1.0 / 18;
    po.aux_scale = 0.1;
    po.recompute = policy;
    a.zero_grads();
    b.zero_grads();
    LossParts la = a.forward_backward(mb, po), lb = b.forward_backward(mb, po);
    EXPECT_EQ(la.loss, lb.loss);
    EXPECT_EQ(la.z, lb.z);  // reported either way
    EXPECT_TRUE(same(a.grads(), b.grads()));
  }
}

TEST(ModelBalance, BiasSteersTheTopKUnderRecomputeButNotUnderReplay) {
  ModelConfig c = tiny(false);
  const MicroBatch mb = test::random_batch(c, 2, 12, 7, 4, 1);
  const int64_t E = c.num_experts, favoured = 6;
  std::vector<Tensor> grads;
  std::vector<double> losses;
  for (Recompute policy : {Recompute::None, Recompute::Full, Recompute::Selective, Recompute::Moe}) {
    Qwen3MoeModel m(c);
    init(m, 8);
    m.enable_router_bias();
    ASSERT_EQ(m.router_bias().shape(), (Shape{2, E}));
    m.router_bias().data<float>()[favoured] = 10.0f;  // sparse layer 0 only
    m.zero_grads();
    PassOptions po;
    po.ce_scale = 1.0 / 18;
    po.recompute = policy;
    losses.push_back(m.forward_backward(mb, po).loss);
    grads.push_back(m.grads().clone());
    const Tensor r0 = m.last_routing()[0];
    for (int64_t t = 0; t < r0.size(0); ++t) ASSERT_EQ(r0.data<int32_t>()[t * c.num_experts_per_tok], favoured) << t;
  }
  // Recompute reuses the biased routing: bit-identical to no recompute.
  for (size_t i = 1; i < grads.size(); ++i) {
    EXPECT_EQ(losses[i], losses[0]);
    EXPECT_TRUE(same(grads[i], grads[0])) << "policy " << i;
  }
  // Routing replay ignores the bias: replaying the plain model's routing gives the plain model.
  Qwen3MoeModel plain(c), replay(c);
  init(plain, 8);
  init(replay, 8);
  const double lp = plain.forward_backward(mb, 1.0 / 18, 0.0).loss;
  EXPECT_NE(lp, losses[0]);
  replay.enable_router_bias();
  replay.router_bias().data<float>()[favoured] = 10.0f;
  MicroBatch replayed = mb;
  replayed.routing = plain.last_routing();
  EXPECT_EQ(replay.forward_backward(replayed, 1.0 / 18, 0.0).loss, lp);
}

TEST(ModelBalance, ExpertLoadAddsUpTheMicroBatchesOfAStep) {
  ModelConfig c = tiny(false);
  Qwen3MoeModel m(c);
  init(m, 9);
  const int64_t E = c.num_experts;
  Tensor want = Tensor::zeros({2, E}, DType::I64);
  for (uint64_t s : {11u, 12u}) {
    m.forward_backward(test::random_batch(c, 1, 10, s, 4, 1), 0.1, 0.0);
    std::vector<Tensor> r = m.last_routing();
    for (int64_t l = 0; l < 2; ++l) {
      Tensor row = want.rows(l, 1).view({E});
      ops::expert_counts(r[size_t(l)], E, row);
    }
  }
  m.forward(test::random_batch(c, 1, 10, 13, 4, 1), nullptr);  // evaluation does not count
  ASSERT_TRUE(m.expert_load().defined());
  EXPECT_TRUE(same(m.expert_load(), want));
  int64_t total = 0;
  for (int64_t i = 0; i < 2 * E; ++i) total += m.expert_load().data<int64_t>()[i];
  EXPECT_EQ(total, 2 * 2 * 10 * c.num_experts_per_tok);  // 2 layers x 2 micro-batches x 10 tokens x K
  m.reset_expert_load();
  for (int64_t i = 0; i < 2 * E; ++i) EXPECT_EQ(m.expert_load().data<int64_t>()[i], 0);
}
