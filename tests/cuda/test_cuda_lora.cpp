// LoRA on CUDA against the CPU: the same frozen base (bf16 compute copy on the GPU) and the same random
// adapters (f32 on both): logits, loss and every adapter gradient within bf16's tolerance of the CPU's, and
// the cached pass (generation) equal to the training forward on the GPU; decode steps beside adapted experts
// captured as CUDA graphs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cuda_test_util.h"
#include "data/batch.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/lora.h"
#include "model/lora_peft.h"
#include "model/qwen3_moe.h"
#include "rollout/engine.h"
#include "train/session.h"

using namespace mt;

namespace {

const std::string kGoldens = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens/";

double rel_l2(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = a_any.to(Device::CPU).to(DType::F32), b = b_any.to(Device::CPU).to(DType::F32);
  EXPECT_EQ(a.numel(), b.numel());
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.data<float>()[i]) - double(b.data<float>()[i]);
    if (std::isnan(d)) return INFINITY;
    num += d * d;
    den += double(b.data<float>()[i]) * double(b.data<float>()[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct LoraRun {
  LossParts lp;
  Tensor logits, grads;
};

// The PEFT golden's adapter on its base, on `device`: one forward_backward.
LoraRun run_on(Device device, const std::string& name, Recompute rc) {
  const std::string dir = kGoldens + "lora/" + name;
  const std::string base = kGoldens + (name == "moe" ? "tiny" : "dense_layer");
  const ModelConfig c = load_model_config(base);
  Qwen3MoeModel m(c, device, nullptr, Weights::Frozen);
  load_hf_weights(base, c, m.table(), m.params());
  m.refresh_compute_weights();
  const LoraSpec spec = read_peft_config(dir + "/adapter");
  LoraAdapters a(c, spec, device, 0);
  a.load(read_peft_adapter(dir + "/adapter", c, spec));
  m.attach_lora(&a);
  SafetensorsFile f(dir + "/batch.safetensors");
  const MicroBatch mb{f.view("input_ids").clone(), f.view("labels").clone()};
  PassOptions po;
  po.ce_scale = 1.0 / double(count_target_tokens(mb.labels));
  po.recompute = rc;
  po.overwrite_grads = true;
  LoraRun r;
  po.logits_out = &r.logits;
  r.lp = m.forward_backward(mb, po);
  r.grads = a.grads().to(Device::CPU);
  r.logits = r.logits.to(Device::CPU).to(DType::F32);
  return r;
}

}  // namespace

TEST(CudaLora, MatchesTheCpuOnThePeftGoldens) {
  MT_REQUIRE_GPU();
  for (const char* name : {"moe", "dense"})
    for (Recompute rc : {Recompute::None, Recompute::Full}) {
      SCOPED_TRACE(std::string(name) + " recompute " + recompute_name(rc));
      const LoraRun cpu = run_on(Device::CPU, name, rc), gpu = run_on(Device::CUDA, name, rc);
      EXPECT_LE(std::abs(gpu.lp.loss - cpu.lp.loss), 2e-2 * std::abs(cpu.lp.loss));
      EXPECT_LE(rel_l2(gpu.logits, cpu.logits), 2e-2);
      EXPECT_LE(rel_l2(gpu.grads, cpu.grads), 5e-2);
      EXPECT_GT(rel_l2(cpu.grads, Tensor::zeros({cpu.grads.numel()})), 0);
    }
}

// A LoRA session on one GPU keeps no f32 masters (LocalParams::fill_from_host writes the bf16 copy chunk by
// chunk, init or load): its forward equals a frozen model's with host masters, bit for bit.
TEST(CudaLora, BaseWithoutMastersEqualsTheBaseWithThem) {
  MT_REQUIRE_GPU();
  const std::string base = kGoldens + "dense_layer";
  const ModelConfig c = load_model_config(base);
  SafetensorsFile f(base + "/batch.safetensors");
  const MicroBatch mb{f.view("input_ids").clone(), f.view("labels").clone()};
  for (bool from_dir : {false, true}) {
    SCOPED_TRACE(from_dir ? "load" : "init");
    SessionOptions so;
    so.device = Device::CUDA;
    so.lora.rank = 4;
    so.lora.targets = parse_lora_targets("attn,mlp,experts");
    TrainSession s(c, so);
    ASSERT_FALSE(s.model().local().has_masters());
    Qwen3MoeModel ref(c, Device::CUDA, nullptr, Weights::Frozen);
    if (from_dir) {
      s.load(base);
      load_hf_weights(base, c, ref.table(), ref.params());
    } else {
      s.init_weights(7);
      init_weights(c, ref.table(), ref.params(), 7);
    }
    ref.refresh_compute_weights();
    PassOptions po;
    po.adapters = false;
    Tensor a, b;
    po.logits_out = &a;
    s.model().forward(mb, po);
    ref.forward(mb, &b);
    const Tensor x = a.to(Device::CPU).to(DType::F32), y = b.to(Device::CPU).to(DType::F32);
    ASSERT_EQ(x.numel(), y.numel());
    EXPECT_EQ(0, std::memcmp(x.data<float>(), y.data<float>(), size_t(x.numel()) * 4));
  }
}

// Generation beside adapters on every target, the routed experts' included (grouped, no host synchronisation):
// decode steps run as CUDA graphs and give the eager steps' tokens; the adapters are read where they live, so a
// change of their values (an update) reaches the captured graphs with no weight sync, and the adapters change
// what is generated.
TEST(CudaLora, AdaptedExpertsDecodeAsGraphsAndSeeUpdates) {
  MT_REQUIRE_GPU();
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {0};  // a dense MLP and a sparse layer
  c.eos_token_id = -1;
  SessionOptions so;
  so.device = Device::CUDA;
  so.lora.rank = 4;
  so.lora.targets = parse_lora_targets("attn,mlp,experts");
  TrainSession s(c, so);
  s.init_weights(3);
  const int64_t n = s.lora()->table().total();
  auto set_adapters = [&](uint64_t seed) {
    Rng rng(seed);
    Tensor v = Tensor::empty({n});
    rng.fill_normal(v, 0.0f, 0.3f);
    s.lora()->load(v.to(Device::CUDA));
  };
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 5; ++i) {
    GenerateRequest r;
    for (int64_t p = 0; p < 4 + i; ++p) r.prompt.push_back(int32_t((i * 97 + p * 13 + 5) % c.vocab_size));
    r.max_new_tokens = 16;
    r.sampling.temperature = 0.0f;
    reqs.push_back(r);
  }
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_cache_bytes = 16 << 20;
  eo.cuda_graphs = false;
  RolloutEngine eager(s.model(), eo);
  eo.cuda_graphs = true;
  RolloutEngine graphs(s.model(), eo);
  std::vector<std::vector<int32_t>> first;
  for (uint64_t seed : {1, 2}) {  // the second values replace the first in place, after the graphs were captured
    SCOPED_TRACE(testing::Message() << "adapters " << seed);
    set_adapters(seed);
    const std::vector<GeneratedSample> a = eager.generate(reqs), b = graphs.generate(reqs);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].tokens, b[i].tokens) << "sample " << i;
    if (seed == 1)
      for (const GeneratedSample& g : b) first.push_back(g.tokens);
    else {
      int64_t changed = 0;
      for (size_t i = 0; i < b.size(); ++i) changed += b[i].tokens != first[i];
      EXPECT_GT(changed, 0) << "other adapters, the same tokens everywhere: the graphs kept the old adapters";
    }
  }
  EXPECT_EQ(eager.stats().graph_steps, 0);
  EXPECT_GT(graphs.stats().graph_steps, 20);
}
