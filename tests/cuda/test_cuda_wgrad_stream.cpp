// The experts' weight gradients on the side stream (ModelOptions::wgrad_stream, MOETRAIN_WGRAD_STREAM;
// core/streams.h, WgradScope) change no number: the model's losses and every gradient after 3
// micro-batches of gradient accumulation, switch on against off, under recompute none, full and
// selective, with the deterministic switch on (bit for bit) and off (bit for bit wherever two runs
// with the switch off give the same bits; within 1e-5 otherwise, the atomics' reordering). A run
// whose side GEMMs get one CTA (wgrad_sms 1: they then take far longer than the compute stream's
// next kernels) makes a missing wait visible as a wrong gradient. The CPU ignores the switch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "core/determinism.h"
#include "core/rng.h"
#include "core/streams.h"
#include "cuda_test_util.h"
#include "model/params.h"
#include "model/qwen3_moe.h"
#include "test_util.h"

#ifdef MT_HAVE_CUDA
#include "backend/cuda/grouped_gemm.cuh"
#endif

using namespace mt;
using cudatest::rel_l2;
using mt::testutil::error_of;

namespace {

struct Result {
  std::vector<LossParts> losses;  // one per micro-batch
  Tensor grads;                   // host f32, the flat gradient buffer after the last micro-batch
  size_t side_calls = 0;          // experts backward calls whose weight gradients ran on the side stream
};

// wgrad: -1 off, else on with that many CTAs (0: automatic) on the side stream of that priority.
Result run_model(const ModelConfig& c, const Tensor& host_params, Device dev, const std::vector<MicroBatch>& mbs,
                 Recompute rc, int wgrad, streams::Side priority = streams::Side::high) {
  ModelOptions mo;
  mo.wgrad_stream = wgrad >= 0;
  mo.wgrad_sms = wgrad > 0 ? wgrad : 0;
  mo.wgrad_priority = priority;
  Qwen3MoeModel m(c, dev, nullptr, Weights::Trainable, mo);
  m.params().copy_from(dev == Device::CPU ? host_params : host_params.to(dev));
  m.refresh_compute_weights();
  Result r;
  const size_t calls0 = streams::wgrad_side_calls();
  for (size_t i = 0; i < mbs.size(); ++i) {
    PassOptions po;
    po.ce_scale = 1.0 / double(mbs.size() * mbs[i].labels.numel());
    po.aux_scale = c.router_aux_loss_coef;
    po.z_loss_scale = 1e-3;
    po.recompute = rc;
    po.overwrite_grads = i == 0;  // a step's first micro-batch writes the gradients (the "=" GEMMs)
    r.losses.push_back(m.forward_backward(mbs[i], po));
  }
  r.grads = m.grads().to(Device::CPU);
  r.side_calls = streams::wgrad_side_calls() - calls0;
  return r;
}

// The first parameter whose gradient bits differ, or "".
std::string first_difference(const ModelConfig& c, const Tensor& a, const Tensor& b) {
  const ParamTable table(c);
  for (const ParamEntry& e : table.entries())
    if (std::memcmp(a.data<float>() + e.offset, b.data<float>() + e.offset, size_t(e.numel) * sizeof(float)) != 0)
      return e.name;
  return "";
}

// bitwise: losses equal and every gradient bit; otherwise losses within 1e-6 and gradients within 1e-5.
void expect_same(const ModelConfig& c, const Result& got, const Result& want, bool bitwise, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_TRUE(std::isfinite(want.losses[i].loss)) << what << " micro-batch " << i;
    if (bitwise) {
      EXPECT_EQ(got.losses[i].loss, want.losses[i].loss) << what << " micro-batch " << i;
      EXPECT_EQ(got.losses[i].aux, want.losses[i].aux) << what << " micro-batch " << i;
      EXPECT_EQ(got.losses[i].z, want.losses[i].z) << what << " micro-batch " << i;
    } else {
      EXPECT_NEAR(got.losses[i].loss, want.losses[i].loss, 1e-6 * std::abs(want.losses[i].loss))
          << what << " micro-batch " << i;
    }
  }
  const std::string diff = first_difference(c, got.grads, want.grads);
  const double e = rel_l2(got.grads, want.grads);
  std::printf("[wgrad stream] %s: gradients rel L2 %.3g%s\n", what.c_str(), e,
              diff.empty() ? " (bit-equal)" : (", first difference in " + diff).c_str());
  if (bitwise)
    EXPECT_EQ(diff, "") << what << ": gradient bits differ (rel L2 " << e << ")";
  else
    EXPECT_LE(e, 1e-5) << what << ": first difference in " << diff;
}

// Three micro-batches of B x S random tokens.
std::vector<MicroBatch> micro_batches(const ModelConfig& c, int64_t B, int64_t S, uint64_t seed) {
  Rng rng(seed);
  std::vector<MicroBatch> mbs;
  for (int i = 0; i < 3; ++i) {
    MicroBatch mb{Tensor::empty({B, S}, DType::I64), Tensor::empty({B, S}, DType::I64)};
    for (int64_t t = 0; t < B * S; ++t)
      mb.input_ids.data<int64_t>()[t] = mb.labels.data<int64_t>()[t] = rng.randint(0, c.vocab_size);
    mbs.push_back(mb);
  }
  return mbs;
}

ModelConfig tiny_with_aux() {
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = true;
  if (c.router_aux_loss_coef == 0) c.router_aux_loss_coef = 0.01;
  return c;
}

// Wider experts (D 256, F 128, 16 experts top-4), so that a side GEMM on one CTA runs long.
ModelConfig wide() {
  ModelConfig c = tiny_with_aux();
  c.hidden_size = 256;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.moe_intermediate_size = 128;
  c.intermediate_size = 256;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  return c;
}

Tensor init_host(const ModelConfig& c, uint64_t seed) {
  Tensor host = Tensor::zeros({ParamTable(c).total()});
  init_weights(c, ParamTable(c), host, seed);
  return host;
}

}  // namespace

#ifdef MT_HAVE_CUDA  // (the CPU-only build has no grouped GEMM to ask about)
TEST(CudaWgradStream, LossAndGradientsEqualTheSingleStreamOrder) {
  MT_REQUIRE_GPU();
  if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM here (the switch needs it)";
  struct Case {
    const char* name;
    ModelConfig c;
    int64_t B, S;
  };
  const Case cases[] = {{"tiny", tiny_with_aux(), 4, 64}, {"wide", wide(), 2, 256}};
  for (const Case& k : cases) {
    const Tensor host = init_host(k.c, 17);
    const std::vector<MicroBatch> mbs = micro_batches(k.c, k.B, k.S, 23);
    const size_t want_calls = size_t(3 * k.c.num_sparse_layers());
    for (bool det : {true, false}) {
      const DeterministicScope scope(det);
      for (Recompute rc : {Recompute::None, Recompute::Full, Recompute::Selective}) {
        const std::string name = str(k.name, " recompute ", recompute_name(rc), det ? " deterministic" : "");
        SCOPED_TRACE(name);
        const Result off = run_model(k.c, host, Device::CUDA, mbs, rc, -1);
        EXPECT_EQ(off.side_calls, 0u) << "the switch off put weight gradients on the side stream";
        // Without the deterministic switch, bitwise only where the single-stream order repeats itself.
        bool bitwise = det;
        if (!det) {
          const Result again = run_model(k.c, host, Device::CUDA, mbs, rc, -1);
          bitwise = first_difference(k.c, again.grads, off.grads).empty() &&
                    again.losses.back().loss == off.losses.back().loss;
          std::printf("[wgrad stream] %s: two single-stream runs %s\n", name.c_str(),
                      bitwise ? "equal bit for bit" : "differ (atomics): compared within 1e-5");
        }
        const std::pair<int, streams::Side> modes[] = {
            {0, streams::Side::high}, {0, streams::Side::low}, {1, streams::Side::high}};
        for (const auto& [ctas, side] : modes) {
          const Result on = run_model(k.c, host, Device::CUDA, mbs, rc, ctas, side);
          const std::string what = name + (side == streams::Side::high ? ", urgent side stream" : ", low side stream") +
                                   (ctas ? ", side GEMMs on 1 CTA" : ", side GEMMs on half the SMs");
          EXPECT_EQ(on.side_calls, want_calls) << what << ": the weight gradients did not take the side stream";
          expect_same(k.c, on, off, bitwise, what);
        }
      }
    }
  }
}

// The CTA cap alone (the switch off, MOETRAIN_WGRAD_SMS on the compute stream) gives the same bits too.
TEST(CudaWgradStream, CtaCapOnTheComputeStreamChangesNoBit) {
  MT_REQUIRE_GPU();
  if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM here";
  const DeterministicScope scope(true);
  const ModelConfig c = wide();
  const Tensor host = init_host(c, 29);
  const std::vector<MicroBatch> mbs = micro_batches(c, 2, 128, 31);
  const Result all = run_model(c, host, Device::CUDA, mbs, Recompute::None, -1);
  ModelOptions mo;
  mo.wgrad_stream = false;
  mo.wgrad_sms = 3;
  Qwen3MoeModel m(c, Device::CUDA, nullptr, Weights::Trainable, mo);
  m.params().copy_from(host.to(Device::CUDA));
  m.refresh_compute_weights();
  Result capped;
  for (size_t i = 0; i < mbs.size(); ++i) {
    PassOptions po;
    po.ce_scale = 1.0 / double(mbs.size() * mbs[i].labels.numel());
    po.aux_scale = c.router_aux_loss_coef;
    po.z_loss_scale = 1e-3;
    po.overwrite_grads = i == 0;
    capped.losses.push_back(m.forward_backward(mbs[i], po));
  }
  capped.grads = m.grads().to(Device::CPU);
  expect_same(c, capped, all, true, "3 CTAs on the compute stream");
}

// A CTA count beyond the GPU's SMs is refused, naming the value, the range and the variable.
TEST(CudaWgradStream, TooManyCtasIsAnError) {
  MT_REQUIRE_GPU();
  if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM here";
  const Device d = Device::CUDA;
  Tensor off = Tensor::empty({3}, DType::I64);
  off.data<int64_t>()[0] = 0;
  off.data<int64_t>()[1] = 8;
  off.data<int64_t>()[2] = 16;
  const Tensor off_d = off.to(d);
  const Tensor a = Tensor::zeros({16, 8}, DType::BF16, d), b = Tensor::zeros({16, 8}, DType::BF16, d);
  Tensor w = Tensor::zeros({2, 8, 8}, DType::F32, d);
  const std::string msg = error_of([&] {
    cuda::grouped_gemm_wgrad("wgrad test", 2, off_d.data<int64_t>(), 16, 8, 8,
                             static_cast<const __nv_bfloat16*>(a.raw()), static_cast<const __nv_bfloat16*>(b.raw()),
                             w.data<float>(), true, 100000);
  });
  EXPECT_NE(msg.find("wgrad test: ctas (100000) must be in [0, "), std::string::npos) << msg;
  EXPECT_NE(msg.find("MOETRAIN_WGRAD_SMS"), std::string::npos) << msg;
}

#endif  // MT_HAVE_CUDA

// On the CPU the switch is a no-op: one stream, the same bits, nothing counted as a side call.
TEST(WgradStream, CpuIgnoresTheSwitch) {
  const ModelConfig c = tiny_with_aux();
  const Tensor host = init_host(c, 41);
  const std::vector<MicroBatch> mbs = micro_batches(c, 2, 32, 43);
  for (Recompute rc : {Recompute::None, Recompute::Full}) {
    const Result off = run_model(c, host, Device::CPU, mbs, rc, -1);
    const Result on = run_model(c, host, Device::CPU, mbs, rc, 0);
    EXPECT_EQ(on.side_calls, 0u);
    expect_same(c, on, off, true, str("CPU recompute ", recompute_name(rc)));
  }
}

TEST(WgradStream, SmsKnobParsesAndNamesBadValues) {
  EXPECT_EQ(parse_wgrad_sms(""), 0);
  EXPECT_EQ(parse_wgrad_sms("66"), 66);
  for (const char* bad : {"0", "-4", "abc", "12x", "99999999"}) {
    const std::string msg = error_of([&] { parse_wgrad_sms(bad); });
    EXPECT_NE(msg.find(str("MOETRAIN_WGRAD_SMS (\"", bad, "\") must be a whole number of SMs >= 1")), std::string::npos)
        << msg;
  }
}
