// The residual-stream fusions (ModelOptions::fuse_norm_add, fuse_gemm_add) change no number: on the CPU
// (fp32) the loss, the logits and every gradient with each switch on equal those with both off, bit for
// bit, under every recompute policy, for sparse layers, a dense layer (whose down projection takes the
// GEMM-epilogue add), tied embeddings with the aux and z losses, and the forward-only pass.
// The op profile proves the switches reach the ops: with a switch on its fused ops run, with it off they
// do not, and with both on under recompute none the model issues no separate add_ at all.
//
// What a failure looks like: a fused path that reads the residual before the add (or adds it twice)
// changes the loss and names the gradient tensors that differ with their relative L2 errors; a switch
// that does nothing fails the op-profile expectations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>

#include "model/model_test_util.h"
#include "model/qwen3_moe.h"
#include "ops/ops.h"
#include "ops/profile.h"

using namespace mt;
using test::random_batch;

namespace {

struct Variant {
  std::string name;
  bool dense_layer0 = false, tied_aux = false;
};

ModelConfig config_of(const Variant& v) {
  ModelConfig c = preset_model_config("tiny");
  if (v.dense_layer0) c.mlp_only_layers = {0};
  if (v.tied_aux) {
    c.tie_word_embeddings = true;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.1;
  }
  return c;
}

struct Fuse {
  bool norm = false, gemm = false;
};
std::string fuse_name(Fuse f) {
  return std::string("fuse_norm_add ") + (f.norm ? "1" : "0") + ", fuse_gemm_add " + (f.gemm ? "1" : "0");
}

struct PassRun {
  LossParts lp;
  Tensor grads, logits;
  std::map<std::string, double> ops;  // op name -> seconds (only which ops ran matters here)
};

PassRun run(const ModelConfig& c, Fuse f, Recompute rc, const MicroBatch& mb, bool backward) {
  ModelOptions mo;
  mo.fuse_norm_add = f.norm;
  mo.fuse_gemm_add = f.gemm;
  Qwen3MoeModel m(c, Device::CPU, nullptr, Weights::Trainable, mo);
  init_weights(c, m.table(), m.params(), 31);
  m.grads().zero_();
  PassRun r;
  ops::reset_op_seconds();
  ops::set_op_profiling(true);
  if (backward) {
    PassOptions po;
    po.ce_scale = 1.0 / 20.0;
    po.aux_scale = c.output_router_logits ? 0.1 : 0.0;
    po.z_loss_scale = c.output_router_logits ? 1e-3 : 0.0;
    po.recompute = rc;
    r.lp = m.forward_backward(mb, po);
  } else {
    r.lp = m.forward(mb, &r.logits);
  }
  ops::set_op_profiling(false);
  r.ops = ops::op_seconds();
  r.grads = m.grads().clone();
  return r;
}

// Empty when the flat gradients are bit-equal; else each differing tensor with its relative L2 error.
std::string grad_diff(const ModelConfig& c, const Tensor& got, const Tensor& want) {
  if (std::memcmp(got.raw(), want.raw(), got.nbytes()) == 0) return "";
  std::string report;
  const ParamTable table(c);
  for (const ParamEntry& e : table.entries()) {
    double num = 0, den = 0;
    for (int64_t j = e.offset; j < e.offset + e.numel; ++j) {
      const double d = double(got.data<float>()[j]) - want.data<float>()[j];
      num += d * d;
      den += double(want.data<float>()[j]) * want.data<float>()[j];
    }
    if (num > 0) report += "\n  " + e.name + ": relative L2 " + std::to_string(std::sqrt(num / std::max(den, 1e-300)));
  }
  return report;
}

bool ran(const PassRun& r, const char* op) {
  return r.ops.count(op) > 0;
}

class FusedResidual : public ::testing::TestWithParam<Variant> {};

}  // namespace

TEST_P(FusedResidual, LossAndEveryGradientEqualTheUnfusedModel) {
  const Variant v = GetParam();
  const ModelConfig c = config_of(v);
  const MicroBatch mb = random_batch(c, 2, 12, 41);
  for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Selective, Recompute::Moe}) {
    const PassRun base = run(c, {}, rc, mb, true);
    ASSERT_TRUE(std::isfinite(base.lp.loss));
    EXPECT_FALSE(ran(base, "add_rms_norm_fwd") || ran(base, "add_rms_norm_bwd") || ran(base, "linear_fwd_add"))
        << "a fused op ran with both switches off";
    for (Fuse f : {Fuse{true, false}, Fuse{false, true}, Fuse{true, true}}) {
      SCOPED_TRACE(v.name + ", recompute " + recompute_name(rc) + ", " + fuse_name(f));
      const PassRun r = run(c, f, rc, mb, true);
      EXPECT_EQ(r.lp.loss, base.lp.loss);
      EXPECT_EQ(r.lp.ce_sum, base.lp.ce_sum);
      EXPECT_EQ(r.lp.aux, base.lp.aux);
      EXPECT_EQ(r.lp.z, base.lp.z);
      const std::string diff = grad_diff(c, r.grads, base.grads);
      EXPECT_TRUE(diff.empty()) << "gradients differ from the unfused model in:" << diff;
      // The switches reach the ops.
      // The forward's fused norm: the post-attention add when the GEMM does not take it, and the
      // deferred block-output adds (recompute none and moe, which keep h1; the last block here is
      // sparse, so it always defers).
      const bool defers = rc == Recompute::None || rc == Recompute::Moe;
      EXPECT_EQ(ran(r, "add_rms_norm_fwd"), f.norm && (!f.gemm || defers));
      EXPECT_EQ(ran(r, "add_rms_norm_bwd"), f.norm);
      EXPECT_EQ(ran(r, "linear_fwd_add"), f.gemm);
      // Both on, recompute none or moe: every residual add is inside a norm or a GEMM epilogue.
      if (f.norm && f.gemm && defers) {
        EXPECT_FALSE(ran(r, "add_")) << "a separate add_ remained";
      }
    }
  }
}

TEST_P(FusedResidual, ForwardLogitsEqualTheUnfusedModel) {
  const Variant v = GetParam();
  const ModelConfig c = config_of(v);
  const MicroBatch mb = random_batch(c, 2, 12, 43);
  const PassRun base = run(c, {}, Recompute::None, mb, false);
  const PassRun both = run(c, {true, true}, Recompute::None, mb, false);
  ASSERT_EQ(base.logits.shape(), both.logits.shape());
  EXPECT_EQ(std::memcmp(base.logits.raw(), both.logits.raw(), base.logits.nbytes()), 0) << "logits differ";
  EXPECT_EQ(base.lp.ce_sum, both.lp.ce_sum);
  EXPECT_TRUE(ran(both, "add_rms_norm_fwd"));
}

INSTANTIATE_TEST_SUITE_P(Variants, FusedResidual,
                         ::testing::Values(Variant{"sparse"}, Variant{"dense_layer0", true},
                                           Variant{"tied_aux_z", false, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });
