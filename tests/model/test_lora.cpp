// Low-rank adapters (model/lora.h) in the model: the table, the targets, a new adapter's no-op, and the
// adapters' gradients against finite differences on a model with dense and MoE layers, under every
// recompute policy. (Against PEFT: test_lora_peft.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "data/batch.h"
#include "model/hf_checkpoint.h"
#include "model/lora.h"
#include "model/qwen3_moe.h"
#include "fd_check.h"
#include "test_util.h"

using namespace mt;

namespace {

const std::string kGoldens = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/";

LoraSpec spec(const std::string& targets, int64_t rank = 4, double alpha = 8) {
  LoraSpec s;
  s.rank = rank;
  s.alpha = alpha;
  s.targets = parse_lora_targets(targets);
  return s;
}

struct Frozen {
  ModelConfig cfg;
  std::unique_ptr<Qwen3MoeModel> model;
};

Frozen frozen(const std::string& dir) {
  Frozen f;
  f.cfg = load_model_config(dir);
  f.model = std::make_unique<Qwen3MoeModel>(f.cfg, Device::CPU, nullptr, Weights::Frozen);
  load_hf_weights(dir, f.cfg, f.model->table(), f.model->params());
  return f;
}

MicroBatch golden_batch(const std::string& dir) {
  SafetensorsFile f(dir + "/batch.safetensors");
  return MicroBatch{f.view("input_ids").clone(), f.view("labels").clone()};
}

// Every adapter value random (B too), large enough to move the outputs.
void randomize(LoraAdapters& a, uint64_t seed) {
  Rng rng(seed);
  rng.fill_normal(a.params(), 0.0f, 0.1f);
}

}  // namespace

TEST(LoraTable, NamesShapesAndTargetsFollowPeft) {
  const ModelConfig c = load_model_config(kGoldens + "dense_layer");
  ASSERT_FALSE(c.is_sparse_layer(0));
  ASSERT_TRUE(c.is_sparse_layer(1));
  LoraTable t(c, spec("attn,mlp,experts"));
  const LoraEntry* q = t.find("model.layers.0.self_attn.q_proj.lora_A.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (Shape{4, c.hidden_size}));
  const LoraEntry* up = t.find("model.layers.0.mlp.up_proj.lora_B.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->shape, (Shape{c.intermediate_size, 4}));
  const LoraEntry* ex = t.find("model.layers.1.mlp.experts.gate_up_proj.lora_B.weight");
  ASSERT_NE(ex, nullptr);
  EXPECT_EQ(ex->shape, (Shape{c.num_experts, 2 * c.moe_intermediate_size, 4}));
  EXPECT_EQ(t.find("model.layers.1.mlp.up_proj.lora_A.weight"), nullptr);  // the MoE layer has no dense MLP
  EXPECT_EQ(t.find("model.layers.0.mlp.experts.down_proj.lora_A.weight"), nullptr);
  EXPECT_EQ(t.find("model.layers.1.mlp.gate.lora_A.weight"), nullptr);  // the router only when named
  int64_t sum = 0;
  for (const LoraEntry& e : t.entries()) {
    EXPECT_EQ(e.offset, sum) << e.name;
    sum += e.numel;
  }
  EXPECT_EQ(sum, t.total());
  EXPECT_DOUBLE_EQ(spec("attn", 4, 8).scale(), 2.0);
  LoraSpec rs = spec("attn", 4, 8);
  rs.rslora = true;
  EXPECT_DOUBLE_EQ(rs.scale(), 4.0);
  EXPECT_DOUBLE_EQ(spec("attn", 16, 0).scale(), 2.0);  // alpha defaults to 2 × rank
}

TEST(LoraTable, TargetsParseAndBadOnesAreNamed) {
  LoraSpec s = spec("q_proj, experts.down_proj,router");
  EXPECT_TRUE(s[LoraTarget::Q]);
  EXPECT_FALSE(s[LoraTarget::K]);
  EXPECT_TRUE(s[LoraTarget::ExpertsDown]);
  EXPECT_FALSE(s[LoraTarget::ExpertsGateUp]);
  EXPECT_TRUE(s[LoraTarget::Router]);
  EXPECT_EQ(lora_targets_text(spec("attn,mlp,experts")), "attn,mlp,experts");
  EXPECT_EQ(lora_targets_text(s), "router,q_proj,experts.down_proj");
  EXPECT_NE(testutil::error_of([] { parse_lora_targets("attn,qproj"); }).find("unknown target 'qproj'"), std::string::npos);
  EXPECT_NE(testutil::error_of([] { parse_lora_targets(" , "); }).find("names no target"), std::string::npos);
  const ModelConfig dense_only = load_model_config(kGoldens + "dense_qwen3");
  EXPECT_NE(testutil::error_of([&] { LoraTable(dense_only, spec("experts")); }).find("adapt nothing"), std::string::npos);
  EXPECT_NE(testutil::error_of([&] { LoraTable(dense_only, spec("attn", 0)); }).find("rank must be >= 1"),
            std::string::npos);
}

TEST(Lora, NewAdaptersLeaveTheModelAsItIs) {
  const std::string dir = kGoldens + "dense_layer";
  Frozen f = frozen(dir);
  const MicroBatch mb = golden_batch(dir);
  Tensor base, adapted;
  f.model->forward(mb, &base);
  LoraAdapters a(f.cfg, spec("attn,mlp,experts,router"), Device::CPU, 7);
  f.model->attach_lora(&a);
  f.model->forward(mb, &adapted);
  ASSERT_EQ(base.numel(), adapted.numel());
  double worst = 0;
  for (int64_t i = 0; i < base.numel(); ++i)
    worst = std::max(worst, double(std::abs(base.data<float>()[i] - adapted.data<float>()[i])));
  EXPECT_LE(worst, 1e-5);  // B = 0; the experts' down projection is formed again per expert
}

// The adapters' gradients against central differences of the loss, every target, dense and MoE layers.
TEST(Lora, AdapterGradientsMatchFiniteDifferences) {
  const std::string dir = kGoldens + "dense_layer";
  for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Moe}) {
    SCOPED_TRACE(recompute_name(rc));
    Frozen f = frozen(dir);
    const MicroBatch mb = golden_batch(dir);
    LoraAdapters a(f.cfg, spec("attn,mlp,experts,router"), Device::CPU, 3);
    randomize(a, 11);
    f.model->attach_lora(&a);
    const double n = double(count_target_tokens(mb.labels));
    PassOptions po;
    po.ce_scale = 1.0 / n;
    po.recompute = rc;
    po.overwrite_grads = true;
    const LossParts lp = f.model->forward_backward(mb, po);
    ASSERT_TRUE(std::isfinite(lp.loss));
    const Tensor analytic = a.grads().clone();
    // The perturbed passes route as this one did (replay): a top-k choice that flips under a step of the
    // difference would make the loss jump, which no gradient describes.
    MicroBatch replay = mb;
    replay.routing = f.model->last_routing();
    auto loss = [&] {
      Tensor logits;
      PassOptions fo;
      fo.ce_scale = 1.0 / n;
      return f.model->forward(replay, fo).ce_sum / n;
    };
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const LoraEntry& e : a.table().entries()) ranges.emplace_back(e.offset, e.numel);
    // Absolute steps (the adapters' values are ~0.1: max(1, |p|) is 1).
    const test::FdResult r = test::finite_difference_ranges(a.params().data<float>(), analytic, ranges, 2, 13, 3e-3f, loss);
    EXPECT_GT(r.checked, 40);
    EXPECT_GT(r.analytic_norm2, 0);
    EXPECT_LE(r.rel_l2, 2e-3) << "over " << r.checked << " entries";
  }
}

// Generation's pass over the paged KV cache with adapters: a prefill of the whole sequence and a decode of
// its last token give the logits the training forward gives (every target adapted, dense and MoE layers).
TEST(Lora, CachedPassEqualsTheForward) {
  const std::string dir = kGoldens + "dense_layer";
  Frozen f = frozen(dir);
  LoraAdapters a(f.cfg, spec("attn,mlp,experts,router"), Device::CPU, 5);
  randomize(a, 17);
  f.model->attach_lora(&a);
  const MicroBatch mb = golden_batch(dir);
  const int64_t S = mb.input_ids.size(1), V = f.cfg.vocab_size, bs = 16;
  MicroBatch one{mb.input_ids.rows(0, 1).clone(), mb.labels.rows(0, 1).clone()};
  Tensor want;
  f.model->forward(one, &want);  // [S, V]
  auto step = [&](int64_t from, int64_t n, KvCache& cache) {
    CachedBatch b{Tensor::empty({n}, DType::I64), Tensor::empty({n}, DType::I32), Tensor::zeros({n}, DType::I32),
                  Tensor::empty({n}, DType::I32), Tensor::empty({1, 2}, DType::I32), Tensor::empty({n}, DType::I64)};
    for (int64_t i = 0; i < n; ++i) {
      b.tokens.data<int64_t>()[i] = one.input_ids.data<int64_t>()[from + i];
      b.positions.data<int32_t>()[i] = int32_t(from + i);
      b.slots.data<int32_t>()[i] = int32_t(from + i);
      b.logit_rows.data<int64_t>()[i] = i;
    }
    b.block_table.data<int32_t>()[0] = 0;
    b.block_table.data<int32_t>()[1] = 1;
    return f.model->forward_cached(b, cache);
  };
  f.model->begin_inference();
  KvCache cache = KvCache::allocate(f.cfg, Device::CPU, 2, bs);
  const Tensor prefill = step(0, S, cache);
  KvCache cache2 = KvCache::allocate(f.cfg, Device::CPU, 2, bs);
  step(0, S - 1, cache2);
  const Tensor last = step(S - 1, 1, cache2);
  f.model->end_inference();
  double worst = 0, worst_last = 0;
  for (int64_t i = 0; i < S * V; ++i)
    worst = std::max(worst, double(std::abs(prefill.data<float>()[i] - want.data<float>()[i])));
  for (int64_t v = 0; v < V; ++v)
    worst_last = std::max(worst_last, double(std::abs(last.data<float>()[v] - want.data<float>()[(S - 1) * V + v])));
  EXPECT_LE(worst, 1e-4);
  EXPECT_LE(worst_last, 1e-4);
  // And the adapters matter here: without them the logits differ.
  f.model->attach_lora(nullptr);
  Tensor base;
  f.model->forward(one, &base);
  double moved = 0;
  for (int64_t i = 0; i < S * V; ++i) moved = std::max(moved, double(std::abs(base.data<float>()[i] - want.data<float>()[i])));
  EXPECT_GT(moved, 0.1);
}
