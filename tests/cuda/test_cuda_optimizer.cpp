// The overlapped AdamW step on CUDA (train/optimizer.h): the updates run on the side stream and a
// reader that waits for a unit's event (as LocalParams::acquire_weights does) sees exactly the bits
// of the in-line step, read straight after the call, while later units may still be updating.
#include <gtest/gtest.h>


#include "cuda_test_util.h"
#include "model/config.h"
#include "model/param_source.h"
#include "model/params.h"
#include "test_util.h"
#include "train/optimizer.h"

namespace mt {
namespace {

using testutil::same_bits;

Tensor randn_cuda(int64_t n, Rng& rng, float std) {
  Tensor t = Tensor::empty({n});
  rng.fill_normal(t, 0.0f, std);
  return t.to(Device::CUDA);
}

TEST(CudaOptimizer, OverlappedStepReadsThroughTheEventsEqualTheInLineStep) {
  MT_REQUIRE_GPU();
  // Large units (the whole update takes milliseconds), the last not a multiple of 4 elements.
  const std::vector<std::pair<int64_t, int64_t>> units{{0, 16 << 20}, {16 << 20, 40 << 20}, {40 << 20, (48 << 20) + 3}};
  const int64_t n = units.back().second;
  Rng rng(9);
  Tensor p0 = randn_cuda(n, rng, 0.02f);
  Tensor pa = p0.clone(), pb = p0.clone();
  Tensor ca = Tensor::zeros({n}, DType::BF16, Device::CUDA), cb = Tensor::zeros({n}, DType::BF16, Device::CUDA);
  AdamWConfig oc;
  oc.max_grad_norm = 1.0;
  AdamW a(n, Device::CUDA, oc), b(n, Device::CUDA, oc);
  for (int step = 0; step < 3; ++step) {
    Tensor g = randn_cuda(n, rng, 1e-3f);
    OptimStepResult ra = a.step(pa, g, 1e-3, &ca);
    device_mem::synchronize(Device::CUDA);
    OptimStepResult rb = b.step_overlapped(pb, g, 1e-3, &cb, units);
    EXPECT_EQ(ra.grad_norm, rb.grad_norm);
    // Last unit first: its event is the latest, so the earlier reads would race without the waits.
    for (size_t i = units.size(); i-- > 0;) {
      const int64_t lo = units[i].first, len = units[i].second - lo;
      b.ready().compute_waits(i);
      EXPECT_TRUE(same_bits(cb.rows(lo, len), ca.rows(lo, len))) << "step " << step << " unit " << i << " (bf16)";
      EXPECT_TRUE(same_bits(pb.rows(lo, len), pa.rows(lo, len))) << "step " << step << " unit " << i;
    }
    b.join();
    EXPECT_TRUE(same_bits(b.exp_avg(), a.exp_avg())) << "step " << step;
    EXPECT_TRUE(same_bits(b.exp_avg_sq(), a.exp_avg_sq())) << "step " << step;
  }
}

TEST(CudaOptimizer, LocalParamsWaitsForEachUnitsUpdate) {
  MT_REQUIRE_GPU();
  ModelConfig c = preset_model_config("demo");
  ParamTable t(c);
  LocalParams ref(c, t, Device::CUDA), got(c, t, Device::CUDA);
  Tensor host = Tensor::zeros({t.total()});
  init_weights(c, t, host, 1);
  for (LocalParams* lp : {&ref, &got}) {
    lp->params().copy_from(host.to(Device::CUDA));
    lp->refresh_compute_weights();
  }
  Rng rng(4);
  Tensor g = randn_cuda(t.total(), rng, 1e-2f);
  AdamW a(t.total(), Device::CUDA, AdamWConfig{}), b(t.total(), Device::CUDA, AdamWConfig{});
  got.wait_for(&b.ready());
  a.step(ref.params(), g, 1e-3, &ref.compute());
  device_mem::synchronize(Device::CUDA);
  b.step_overlapped(got.params(), g, 1e-3, &got.compute(), got.unit_ranges());
  for (size_t u = got.plan().units.size(); u-- > 0;)
    EXPECT_TRUE(same_bits(got.acquire_weights(int(u)), ref.acquire_weights(int(u)))) << "unit " << u;
}

}  // namespace
}  // namespace mt
