// Model-level tests that need no golden files: recompute is bit-identical, micro-batches add up,
// the parameter table matches the config's count, HF checkpoints round-trip in both expert
// layouts and bad checkpoints fail with messages naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <unistd.h>
#include <filesystem>

#include "core/rng.h"
#include "model/hf_checkpoint.h"
#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"

using namespace mt;
using test::random_batch;
namespace fs = std::filesystem;

namespace {

ModelConfig tiny_config(bool aux, bool dense_layer0) {
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = aux;
  c.router_aux_loss_coef = 0.1;
  if (dense_layer0) c.mlp_only_layers = {0};
  return c;
}

void init_random(Qwen3MoeModel& m, uint64_t seed) {
  Tensor& p = m.params();
  init_weights(m.config(), m.table(), p, seed);
  // Norm weights away from 1 so their gradients matter.
  Rng rng(seed + 1);
  for (const ParamEntry& e : m.table().entries())
    if (e.shape.size() == 1) {
      Tensor v = view_at(p, e.offset, e.shape);
      for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = 1.0f + 0.2f * float(rng.normal());
    }
}

std::string temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("moetrain_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

}  // namespace

TEST(Model, ParameterTableMatchesConfigCount) {
  for (bool dense : {false, true}) {
    ModelConfig c = tiny_config(false, dense);
    ParamTable t(c);
    EXPECT_EQ(t.total(), c.num_parameters());
  }
  ModelConfig tied = tiny_config(false, false);
  tied.tie_word_embeddings = true;
  EXPECT_EQ(ParamTable(tied).total(), tied.num_parameters());
  EXPECT_EQ(ParamTable(tied).find("lm_head.weight"), nullptr);
}

TEST(Model, FullSelectiveAndMoeRecomputeAreBitIdentical) {
  for (Recompute policy : {Recompute::Full, Recompute::Selective, Recompute::Moe})
  for (bool dense : {false, true}) {
    ModelConfig c = tiny_config(true, dense);
    MicroBatch mb = random_batch(c, 2, 12, 5);
    Tensor grads[2], logits[2];
    LossParts lp[2];
    for (int r = 0; r < 2; ++r) {
      Qwen3MoeModel m(c);
      init_random(m, 11);
      PassOptions po;
      po.ce_scale = 1.0 / 19.0;
      po.aux_scale = 0.1;
      po.recompute = r == 0 ? Recompute::None : policy;
      po.logits_out = &logits[r];
      lp[r] = m.forward_backward(mb, po);
      grads[r] = m.grads().clone();
    }
    EXPECT_EQ(lp[0].loss, lp[1].loss);
    EXPECT_EQ(lp[0].aux, lp[1].aux);
    EXPECT_GT(lp[0].aux, 0.0);
    ASSERT_EQ(grads[0].nbytes(), grads[1].nbytes());
    EXPECT_EQ(std::memcmp(grads[0].raw(), grads[1].raw(), grads[0].nbytes()), 0)
        << recompute_name(policy) << ", dense layer 0: " << dense;
    EXPECT_EQ(std::memcmp(logits[0].raw(), logits[1].raw(), logits[0].nbytes()), 0);
    EXPECT_GT(ops::sum_squares(grads[0]), 0.0);
  }
}

TEST(Model, RecomputeNeedsLessActivationMemory) {
  ModelConfig c = tiny_config(false, false);
  c.num_hidden_layers = 4;
  MicroBatch mb = random_batch(c, 2, 32, 6);
  size_t peak[4];
  const Recompute policies[4] = {Recompute::None, Recompute::Moe, Recompute::Selective, Recompute::Full};
  for (int r = 0; r < 4; ++r) {
    Qwen3MoeModel m(c);
    init_random(m, 3);
    PassOptions po;
    po.ce_scale = 0.01;
    po.recompute = policies[r];
    m.forward_backward(mb, po);
    peak[r] = m.activation_peak_bytes();
  }
  // Moe drops the experts' R = T K rows (xp, gu, hh, yp: here 1,792 of a block's ~4,100 f32 bytes per
  // token) but keeps attention's inputs, which selective rebuilds.
  EXPECT_LT(peak[1], peak[0]);  // moe keeps less than none
  EXPECT_LT(peak[2], peak[1]);  // selective keeps less than moe
  EXPECT_LT(peak[3], peak[2]);  // full keeps less than selective
}

// The arenas grow by chaining blocks on the first micro-batch and merge them at the next reset; the
// model drops its activations first, so the merge frees the chain instead of holding it beside the new
// block (on a GPU that was the whole kept set twice at the second micro-batch's start).
TEST(Model, ArenaMergesFreeTheChainTheyReplace) {
  ModelConfig c = tiny_config(false, false);
  MicroBatch mb = random_batch(c, 4, 128, 8);  // 512 tokens: more than the arenas' first 1 MiB block
  for (Recompute policy : {Recompute::None, Recompute::Moe, Recompute::Full}) {
    Qwen3MoeModel m(c);
    init_random(m, 4);
    PassOptions po;
    po.ce_scale = 1e-3;
    po.recompute = policy;
    for (int i = 0; i < 3; ++i) m.forward_backward(mb, po);
    EXPECT_EQ(m.arena_held_at_merge_bytes(false), 0u) << recompute_name(policy);
    // Under none nothing the model holds lives in the work arena (under recompute the first forward's
    // layer-0 tensors still do when layer 1 merges it).
    if (policy == Recompute::None) EXPECT_EQ(m.arena_held_at_merge_bytes(true), 0u);
  }
}

TEST(Model, MicroBatchesAddUpToTheWholeBatch) {
  ModelConfig c = tiny_config(false, true);
  MicroBatch whole = random_batch(c, 2, 10, 9);
  int64_t targets = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 1; s < 10; ++s) targets += whole.labels.data<int64_t>()[b * 10 + s] != -100;
  Qwen3MoeModel a(c), b(c);
  init_random(a, 2);
  init_random(b, 2);
  LossParts la = a.forward_backward(whole, 1.0 / double(targets), 0);
  double lb = 0;
  for (int64_t i = 0; i < 2; ++i) {
    MicroBatch part{whole.input_ids.rows(i, 1).clone(), whole.labels.rows(i, 1).clone()};
    lb += b.forward_backward(part, 1.0 / double(targets), 0).loss;
  }
  EXPECT_NEAR(la.loss, lb, 1e-6 * std::abs(la.loss));
  Tensor diff = a.grads().clone();
  ops::add_(diff, b.grads(), -1.0f);
  EXPECT_LT(std::sqrt(ops::sum_squares(diff) / ops::sum_squares(a.grads())), 1e-6);
}

TEST(Model, HfCheckpointRoundTripsInBothExpertLayouts) {
  ModelConfig c = tiny_config(false, true);
  Qwen3MoeModel m(c);
  init_random(m, 4);
  for (ExpertLayout layout : {ExpertLayout::PerExpert, ExpertLayout::Fused}) {
    std::string dir = temp_dir(expert_layout_name(layout));
    save_hf_checkpoint(dir, c, m.table(), m.params(), layout);
    CheckpointReader r(dir);
    EXPECT_EQ(detect_expert_layout(r), layout);
    EXPECT_EQ(r.has("model.layers.1.mlp.experts.3.up_proj.weight"), layout == ExpertLayout::PerExpert);
    EXPECT_EQ(r.has("model.layers.1.mlp.experts.gate_up_proj"), layout == ExpertLayout::Fused);
    ModelConfig c2 = load_model_config(dir);
    Qwen3MoeModel m2(c2);
    LoadReport rep = load_hf_weights(dir, c2, m2.table(), m2.params());
    EXPECT_EQ(rep.layout, layout);
    ASSERT_EQ(m2.params().nbytes(), m.params().nbytes());
    EXPECT_EQ(std::memcmp(m2.params().raw(), m.params().raw(), m.params().nbytes()), 0);
    // per-expert slices land in the right rows of the fused parameter
    if (layout == ExpertLayout::PerExpert) {
      Tensor up3 = r.read_f32("model.layers.1.mlp.experts.3.up_proj.weight");
      const ParamEntry& e = m.table().at("model.layers.1.mlp.experts.gate_up_proj");
      const int64_t F = c.moe_intermediate_size, D = c.hidden_size;
      const float* want = m.params().data<float>() + e.offset + 3 * 2 * F * D + F * D;
      EXPECT_EQ(std::memcmp(up3.raw(), want, size_t(F * D) * 4), 0);
    }
    fs::remove_all(dir);
  }
}

TEST(Model, BadCheckpointsNameTheTensor) {
  ModelConfig c = tiny_config(false, false);
  Qwen3MoeModel m(c);
  init_random(m, 4);
  std::string dir = temp_dir("bad");
  NamedTensors ts = export_hf_tensors(c, m.table(), m.params(), ExpertLayout::PerExpert);
  auto expect_error = [&](const NamedTensors& tensors, const std::string& needle) {
    write_safetensors_sharded(dir, tensors, size_t(1) << 30);
    save_model_config(c, dir + "/config.json");
    Qwen3MoeModel m2(c);
    try {
      load_hf_weights(dir, c, m2.table(), m2.params());
      FAIL() << "expected an error containing " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  NamedTensors missing(ts.begin() + 1, ts.end());
  expect_error(missing, "lacks tensor 'model.embed_tokens.weight' (expected shape [512, 64]");
  NamedTensors wrong = ts;
  wrong[1].second = Tensor::zeros({3, 64});
  expect_error(wrong, "has shape [3, 64], expected [64]");
  NamedTensors extra = ts;
  extra.emplace_back("model.layers.9.foo.weight", Tensor::zeros({2}));
  expect_error(extra, "'model.layers.9.foo.weight'");
  NamedTensors ints = ts;
  ints[1].second = Tensor::zeros({64}, DType::I32);
  expect_error(ints, "has dtype i32");
  fs::remove_all(dir);
}

TEST(Model, FusedLmHeadMatchesMaterialisedLogits) {
  ModelConfig c = tiny_config(true, false);
  MicroBatch mb = random_batch(c, 2, 24, 21);
  Qwen3MoeModel a(c), b(c);
  init_random(a, 8);
  init_random(b, 8);
  Tensor logits;
  LossParts la = a.forward_backward(mb, 1.0 / 30.0, 0.1, &logits);  // logits requested: unfused head
  LossParts lb = b.forward_backward(mb, 1.0 / 30.0, 0.1);           // fused, chunked head
  EXPECT_NEAR(la.loss, lb.loss, 1e-6 * std::abs(la.loss));
  EXPECT_EQ(la.n_valid, lb.n_valid);
  Tensor diff = a.grads().clone();
  ops::add_(diff, b.grads(), -1.0f);
  EXPECT_LT(std::sqrt(ops::sum_squares(diff) / ops::sum_squares(a.grads())), 1e-6);
}

TEST(Model, RoutingReplayReproducesAndOverridesTheRouter) {
  ModelConfig c = tiny_config(true, true);
  MicroBatch mb = random_batch(c, 2, 16, 31);
  Qwen3MoeModel a(c), b(c), d(c);
  for (Qwen3MoeModel* m : {&a, &b, &d}) init_random(*m, 12);
  LossParts la = a.forward_backward(mb, 0.05, 0.1);
  std::vector<Tensor> routing = a.last_routing();
  ASSERT_EQ(routing.size(), 1u);  // layer 0 is dense
  MicroBatch replayed = mb;
  replayed.routing = routing;
  LossParts lb = b.forward_backward(replayed, 0.05, 0.1);
  EXPECT_EQ(la.loss, lb.loss);
  EXPECT_EQ(std::memcmp(a.grads().raw(), b.grads().raw(), a.grads().nbytes()), 0);
  // Another routing: every token goes to the next expert; the model must follow it.
  Tensor shifted = routing[0].clone();
  for (int64_t i = 0; i < shifted.numel(); ++i) shifted.data<int32_t>()[i] = (shifted.data<int32_t>()[i] + 1) % 8;
  MicroBatch other = mb;
  other.routing = {shifted};
  LossParts ld = d.forward_backward(other, 0.05, 0.1);
  EXPECT_NE(la.loss, ld.loss);
  EXPECT_TRUE(std::isfinite(ld.loss));
  EXPECT_EQ(std::memcmp(d.last_routing()[0].raw(), shifted.raw(), shifted.nbytes()), 0);
  Tensor bad = shifted.clone();
  bad.data<int32_t>()[3] = 99;
  // The replay travels with its micro-batch: the next forward without it routes by itself again.
  LossParts la2 = d.forward(mb, nullptr);
  EXPECT_EQ(std::memcmp(d.last_routing()[0].raw(), routing[0].raw(), routing[0].nbytes()), 0);
  EXPECT_EQ(la2.n_valid, la.n_valid);
  other.routing = {bad};
  try {
    d.forward(other, nullptr);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 99"), std::string::npos) << e.what();
  }
}

// overwrite_grads writes every gradient with = : starting from NaN gradients it gives exactly what
// zero_grads() + the default += gives, for MoE and dense layers, tied embeddings (one tensor written
// by the LM head and then added to by the embedding), each recompute policy, the materialised-logits
// path, and a following micro-batch that adds to it. A gradient left unwritten would stay NaN.
TEST(Model, FirstMicroBatchOverwritesEveryGradientExactly) {
  for (bool tied : {false, true})
    for (bool dense : {false, true})
      for (Recompute policy : {Recompute::None, Recompute::Full}) {
        SCOPED_TRACE(::testing::Message() << "tied " << tied << ", dense layer 0 " << dense << ", recompute "
                                          << recompute_name(policy));
        ModelConfig c = tiny_config(true, dense);
        c.tie_word_embeddings = tied;
        const MicroBatch mb1 = random_batch(c, 2, 12, 21), mb2 = random_batch(c, 1, 12, 22);
        Tensor want, got, want_logits, got_logits;
        for (int r = 0; r < 2; ++r) {
          Qwen3MoeModel m(c);
          init_random(m, 13);
          PassOptions po;
          po.ce_scale = 1.0 / 20.0;
          po.aux_scale = 0.1;
          po.recompute = policy;
          if (r == 0) {
            m.zero_grads();
          } else {
            m.grads().fill_(std::nanf(""));
            po.overwrite_grads = true;
          }
          m.forward_backward(mb1, po);
          po.overwrite_grads = false;
          po.logits_out = r == 0 ? &want_logits : &got_logits;
          m.forward_backward(mb2, po);
          (r == 0 ? want : got) = m.grads().clone();
        }
        ASSERT_EQ(want.nbytes(), got.nbytes());
        EXPECT_EQ(std::memcmp(want.raw(), got.raw(), want.nbytes()), 0);
        EXPECT_TRUE(ops::all_finite(got));
        EXPECT_GT(ops::sum_squares(got), 0.0);
      }
}
