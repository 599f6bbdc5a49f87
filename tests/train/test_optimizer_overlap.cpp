// AdamW::step_overlapped (train/optimizer.h) on the CPU, where it runs in line: the same bits as
// step for any tiling of the flat buffer into units, the tiling checked with a clear error, and the
// model's unit ranges (the order its forward uses them) tile its flat buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "model/config.h"
#include "model/param_source.h"
#include "model/params.h"
#include "test_util.h"
#include "train/optimizer.h"

namespace mt {
namespace {

using testutil::error_of;
using testutil::same_bits;

Tensor randn(int64_t n, Rng& rng, float std) {
  Tensor t = Tensor::empty({n});
  rng.fill_normal(t, 0.0f, std);
  return t;
}

TEST(OptimizerOverlap, SameBitsAsTheInLineStepForAnyTiling) {
  const int64_t n = 1003;
  Rng rng(3);
  const Tensor p0 = randn(n, rng, 0.02f);
  AdamWConfig oc;
  oc.max_grad_norm = 0.5;  // the gradients below have a larger norm: the clip factor is exercised
  for (const std::vector<std::pair<int64_t, int64_t>>& units :
       {std::vector<std::pair<int64_t, int64_t>>{{0, n}}, {{0, 1}, {1, 500}, {500, n}},
        {{700, n}, {0, 3}, {3, 700}}}) {  // any order: events follow the given order
    Tensor pa = p0.clone(), pb = p0.clone();
    AdamW a(n, Device::CPU, oc), b(n, Device::CPU, oc);
    Rng grng(11);
    for (int step = 0; step < 3; ++step) {
      Tensor g = randn(n, grng, 1.0f);
      OptimStepResult ra = a.step(pa, g, 1e-3);
      OptimStepResult rb = b.step_overlapped(pb, g, 1e-3, nullptr, units);
      b.join();
      EXPECT_EQ(ra.grad_norm, rb.grad_norm);
      EXPECT_EQ(ra.clip_scale, rb.clip_scale);
      EXPECT_LT(ra.clip_scale, 1.0);
      EXPECT_TRUE(same_bits(pa, pb)) << "step " << step;
      EXPECT_TRUE(same_bits(a.exp_avg(), b.exp_avg()));
      EXPECT_TRUE(same_bits(a.exp_avg_sq(), b.exp_avg_sq()));
    }
    EXPECT_EQ(b.ready().size(), units.size());
  }
}

// overlap_units (what the trainer and train_step set for optimizer_overlap): step() is then the
// overlapped step over those units, with its events and its tiling check.
TEST(OptimizerOverlap, OverlapUnitsMakesStepTheOverlappedStep) {
  const int64_t n = 301;
  const std::vector<std::pair<int64_t, int64_t>> units{{0, 100}, {100, n}};
  Rng rng(4);
  const Tensor p0 = randn(n, rng, 0.02f);
  Tensor pa = p0.clone(), pb = p0.clone();
  AdamW a(n, Device::CPU, AdamWConfig{}), b(n, Device::CPU, AdamWConfig{});
  b.overlap_units(units);
  for (int step = 0; step < 2; ++step) {
    Tensor g = randn(n, rng, 1.0f);
    a.step_overlapped(pa, g, 1e-3, nullptr, units);
    b.step(pb, g, 1e-3);
    EXPECT_TRUE(same_bits(pa, pb)) << "step " << step;
  }
  EXPECT_EQ(b.ready().size(), units.size());  // the overlapped step's events: one per unit
  // Ranges that do not tile the buffer fail in step() as they do in step_overlapped.
  b.overlap_units({{0, 100}});
  Tensor g = randn(n, rng, 1.0f);
  const std::string m = error_of([&] { b.step(pb, g, 1e-3); });
  EXPECT_NE(m.find("must tile the 301 elements"), std::string::npos) << m;
}

TEST(OptimizerOverlap, ANonFiniteNormSkipsLikeTheInLineStep) {
  const int64_t n = 64;
  Rng rng(5);
  Tensor p = randn(n, rng, 0.02f), before = p.clone(), g = randn(n, rng, 1.0f);
  g.data<float>()[17] = INFINITY;
  AdamW opt(n, Device::CPU, AdamWConfig{});
  OptimStepResult r = opt.step_overlapped(p, g, 1e-3, nullptr, {{0, 10}, {10, n}});
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(opt.steps_skipped(), 1);
  EXPECT_EQ(opt.steps_taken(), 0);
  EXPECT_TRUE(same_bits(p, before));
}

TEST(OptimizerOverlap, RangesThatDoNotTileTheBufferAreAnError) {
  const int64_t n = 100;
  Rng rng(1);
  Tensor p = randn(n, rng, 0.02f), g = randn(n, rng, 1.0f);
  AdamW opt(n, Device::CPU, AdamWConfig{});
  for (const std::vector<std::pair<int64_t, int64_t>>& bad :
       {std::vector<std::pair<int64_t, int64_t>>{{0, 50}}, {{0, 50}, {40, n}}, {{0, 50}, {51, n}}, {{0, 0}, {0, n}}}) {
    const std::string m = error_of([&] { opt.step_overlapped(p, g, 1e-3, nullptr, bad); });
    EXPECT_NE(m.find("must tile the 100 elements"), std::string::npos) << m;
  }
  EXPECT_EQ(opt.steps_taken(), 0);  // refused before anything changed
}

TEST(OptimizerOverlap, ModelUnitRangesTileTheFlatBuffersInForwardOrder) {
  for (const char* name : {"tiny", "demo"}) {
    ModelConfig c = preset_model_config(name);
    ParamTable t(c);
    LocalParams lp(c, t, Device::CPU);
    std::vector<std::pair<int64_t, int64_t>> r = lp.unit_ranges();
    ASSERT_EQ(r.size(), lp.plan().units.size());
    std::vector<std::pair<int64_t, int64_t>> sorted = r;
    std::sort(sorted.begin(), sorted.end());
    int64_t covered = 0;
    for (const auto& [b, e] : sorted) {
      EXPECT_EQ(b, covered) << name;
      covered = e;
    }
    EXPECT_EQ(covered, t.total()) << name;
    EXPECT_EQ(r.front().first, 0) << name << ": the embedding comes first";
  }
}

}  // namespace
}  // namespace mt
