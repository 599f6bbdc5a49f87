// Recompute never re-decides routing (DESIGN), proven with weights under which re-deciding WOULD
// route differently. A ParamSource serves the original weights on the forward's acquire of each block
// and weights whose router gates are negated on the backward's acquire (the recompute runs between that
// acquire and its release). A plain forward with the negated gates routes (nearly) every token to other
// experts (the control), yet the loss and every gradient under full and selective recompute are
// bit-identical to recompute none, whose backward reuses the forward's activations by construction.
//
// What a failure looks like: if forward_layer ran the router again in the recompute pass (routing_known),
// the recompute would take the negated gates' top-k experts, so the experts' inputs, the dispatch plan
// and the routing weights would all change; the memcmp of the gradient buffers then fails and the
// per-tensor report names the expert and router tensors (relative L2 errors of order 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"

using namespace mt;
using test::random_batch;

namespace {

// Serves `forward_w` on the first acquire of each unit in a pass and `backward_w` on the second
// (the backward's, for a block); gradients all go to forward_w's buffer. The embedding of a tied model
// is acquired twice in the forward (embedding, then with the head): it then gets backward_w's copy of
// the embedding, which is the same bytes, since only router gates differ between the two.
class SwitchingSource final : public ParamSource {
 public:
  SwitchingSource(LocalParams& forward_w, LocalParams& backward_w)
      : fwd_(forward_w), bwd_(backward_w), acquires_(forward_w.plan().units.size(), 0) {}
  const UnitPlan& plan() const override { return fwd_.plan(); }
  Tensor acquire_weights(int u) override {
    const int n = ++acquires_[size_t(u)];
    EXPECT_LE(n, 2) << "unit " << u << " acquired more than twice in one micro-batch";
    return (n == 1 ? fwd_ : bwd_).acquire_weights(u);
  }
  void release_weights(int) override {}
  Tensor unit_grads(int u) override { return fwd_.unit_grads(u); }
  void grads_done(int) override {}
  // The model starts every forward (and forward_backward) with this: the counts are per pass.
  void begin_pass(bool) override { std::fill(acquires_.begin(), acquires_.end(), 0); }
  int acquires(int u) const { return acquires_[size_t(u)]; }

 private:
  LocalParams& fwd_;
  LocalParams& bwd_;
  std::vector<int> acquires_;
};

struct Variant {
  std::string name;
  bool score_before = false, aux = false, tied = false, dense_layer0 = false;
};
void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.name;
}

ModelConfig config_of(const Variant& v) {
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = v.aux;
  c.router_aux_loss_coef = 0.1;
  c.tie_word_embeddings = v.tied;
  if (v.dense_layer0) c.mlp_only_layers = {0};
  c.score_before_experts = v.score_before;
  return c;
}

// The router gate [E, D] of every sparse layer, checked to lie inside that layer's block unit (the unit
// the backward acquires again).
std::vector<const ParamEntry*> router_gates(const ModelConfig& c, const ParamTable& t, const UnitPlan& plan) {
  std::vector<const ParamEntry*> r;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_sparse_layer(l)) continue;
    const ParamEntry& e = t.at("model.layers." + std::to_string(l) + ".mlp.gate.weight");
    const ParamUnit& u = plan.units[size_t(plan.block[size_t(l)])];
    bool inside = false;
    for (const FlatRange& p : u.pieces) inside |= e.offset >= p.begin && e.offset + e.numel <= p.end;
    EXPECT_TRUE(inside) << e.name << " is not in block " << l << "'s unit";
    r.push_back(&e);
  }
  return r;
}

// Fraction of the (token, k) expert ids that differ between two routings (per sparse layer, i32 [T, K]).
double routing_difference(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  int64_t diff = 0, n = 0;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].shape(), b[i].shape());
    for (int64_t j = 0; j < a[i].numel(); ++j, ++n) diff += a[i].data<int32_t>()[j] != b[i].data<int32_t>()[j];
  }
  return n == 0 ? 0.0 : double(diff) / double(n);
}

struct RunResult {
  LossParts lp;
  Tensor grads;
};

class RecomputeRouting : public ::testing::TestWithParam<Variant> {};

}  // namespace

TEST_P(RecomputeRouting, PerturbedRouterInRecomputeChangesNothing) {
  const Variant v = GetParam();
  const ModelConfig c = config_of(v);
  const ParamTable table(c);
  LocalParams original(c, table, Device::CPU), perturbed(c, table, Device::CPU);
  init_weights(c, table, original.params(), 17);
  perturbed.params().copy_from(original.params());
  const std::vector<const ParamEntry*> gates = router_gates(c, table, original.plan());
  ASSERT_FALSE(gates.empty());
  // Negated gates: each token's top-k experts become its bottom-k (disjoint for K = 2 of E = 8).
  for (const ParamEntry* e : gates)
    for (int64_t i = e->offset; i < e->offset + e->numel; ++i) perturbed.params().data<float>()[i] *= -1.0f;
  const MicroBatch mb = random_batch(c, 2, 16, 23);
  int64_t targets = 0;
  for (int64_t i = 0; i < mb.labels.numel(); ++i)
    targets += i % 16 != 0 && mb.labels.data<int64_t>()[i] != -100;  // labels after the shift by one
  const double ce_scale = 1.0 / double(targets), aux_scale = v.aux ? 0.1 : 0.0, z_scale = v.aux ? 1e-3 : 0.0;

  // Control: the perturbation matters. The same batch through the perturbed weights alone routes
  // most (token, k) pairs to other experts.
  {
    SwitchingSource only_orig(original, original), only_pert(perturbed, perturbed);
    Qwen3MoeModel a(c, Device::CPU, &only_orig, Weights::Trainable), b(c, Device::CPU, &only_pert, Weights::Trainable);
    const LossParts la = a.forward(mb, nullptr), lb = b.forward(mb, nullptr);
    const double frac = routing_difference(a.last_routing(), b.last_routing());
    std::printf("%s: negated router gates re-route %.1f%% of (token, k) expert ids\n", v.name.c_str(), 100 * frac);
    EXPECT_GT(frac, 0.3) << "the perturbed router gates do not change routing enough to prove anything";
    EXPECT_NE(la.ce_sum, lb.ce_sum);
  }

  std::vector<RunResult> runs;
  for (Recompute policy : {Recompute::None, Recompute::Full, Recompute::Selective, Recompute::Moe}) {
    original.grads().zero_();
    perturbed.grads().zero_();
    SwitchingSource src(original, perturbed);
    Qwen3MoeModel m(c, Device::CPU, &src, Weights::Trainable);
    PassOptions po;
    po.ce_scale = ce_scale;
    po.aux_scale = aux_scale;
    po.z_loss_scale = z_scale;
    po.recompute = policy;
    RunResult r;
    r.lp = m.forward_backward(mb, po);
    r.grads = original.grads().clone();
    // Every block was acquired twice (forward, backward): the backward's acquire served the
    // perturbed gates, and the recompute (full, selective, moe) ran inside it.
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) EXPECT_EQ(src.acquires(src.plan().block[size_t(l)]), 2);
    EXPECT_EQ(ops::sum_squares(perturbed.grads()), 0.0) << "gradients went to the perturbed copy";
    EXPECT_GT(ops::sum_squares(r.grads), 0.0);
    if (v.aux) {
      EXPECT_GT(r.lp.aux, 0.0);
    }
    runs.push_back(std::move(r));
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    const char* name = i == 1 ? "full" : i == 2 ? "selective" : "moe";
    EXPECT_EQ(runs[0].lp.loss, runs[i].lp.loss) << name;
    EXPECT_EQ(runs[0].lp.ce_sum, runs[i].lp.ce_sum) << name;
    EXPECT_EQ(runs[0].lp.aux, runs[i].lp.aux) << name;
    EXPECT_EQ(runs[0].lp.z, runs[i].lp.z) << name;
    const Tensor& g0 = runs[0].grads;
    const Tensor& gi = runs[i].grads;
    ASSERT_EQ(g0.nbytes(), gi.nbytes());
    if (std::memcmp(g0.raw(), gi.raw(), g0.nbytes()) == 0) continue;
    // Not bit-identical: name every tensor that differs, with its relative L2 error.
    std::string report;
    for (const ParamEntry& e : table.entries()) {
      double num = 0, den = 0;
      for (int64_t j = e.offset; j < e.offset + e.numel; ++j) {
        const double d = double(gi.data<float>()[j]) - g0.data<float>()[j];
        num += d * d;
        den += double(g0.data<float>()[j]) * g0.data<float>()[j];
      }
      if (num > 0)
        report += "\n  " + e.name + ": relative L2 " + std::to_string(std::sqrt(num / std::max(den, 1e-300)));
    }
    ADD_FAILURE() << v.name << ": recompute " << name << " gradients differ from recompute none in:" << report;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, RecomputeRouting,
                         ::testing::Values(Variant{"plain"}, Variant{"score_before_experts", true},
                                           Variant{"aux_and_z_loss", false, true},
                                           Variant{"tied_dense_layer0_aux", false, true, true, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });
