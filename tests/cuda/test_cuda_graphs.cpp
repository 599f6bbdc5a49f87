// Decode steps as CUDA graphs (core/cuda_graph.h, rollout/engine.cpp): a captured forward_cached_into
// replayed over new inputs gives the eager pass's logits and routing bit for bit; a graph goes stale when
// an arena moves; the engine with graphs (the forward and the sampler captured, greedy, plain, top-k +
// top-p and min-p rows) generates what it generates without them (tokens equal, log-probs within bf16
// noise: the eager steps run at the unpadded batch, so their GEMMs may pick other algorithms).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "core/cuda_graph.h"
#include "cuda_session_util.h"
#include "cuda_test_util.h"
#include "model/qwen3_moe.h"
#include "rollout/engine.h"
#include "train/session.h"

using namespace mt;

namespace {

ModelConfig graph_config() {
  ModelConfig c = preset_model_config("tiny");
  c.mlp_only_layers = {0};  // a dense layer and a sparse one
  c.eos_token_id = -1;
  return c;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// One decode step of B rows (the first `real` of 3 cached sequences, the rest padding on block 7).
void fill_step(const CachedBatch& in, int64_t B, int64_t step, int64_t width) {
  Tensor tok = Tensor::empty({B}, DType::I64), pos = Tensor::empty({B}, DType::I32), seq = Tensor::empty({B}, DType::I32),
         slot = Tensor::empty({B}, DType::I32), table = Tensor::empty({B, width}, DType::I32),
         rows = Tensor::empty({B}, DType::I64);
  const int64_t lens[3] = {5, 7, 3};
  for (int64_t i = 0; i < B; ++i) {
    const bool real = i < 3;
    const int64_t p = real ? lens[i] + step : 0;
    tok.data<int64_t>()[i] = real ? 11 + 5 * i + step : 0;
    pos.data<int32_t>()[i] = int32_t(p);
    seq.data<int32_t>()[i] = int32_t(i);
    // Sequence i owns blocks 2i, 2i+1 (8 tokens each); padding writes and reads block 7.
    slot.data<int32_t>()[i] = int32_t(real ? (2 * i + p / 8) * 8 + p % 8 : 7 * 8);
    for (int64_t w = 0; w < width; ++w) table.data<int32_t>()[i * width + w] = int32_t(real ? 2 * i + std::min<int64_t>(w, 1) : 7);
    rows.data<int64_t>()[i] = i;
  }
  CachedBatch h{tok, pos, seq, slot, table, rows};
  const_cast<Tensor&>(in.tokens).copy_from(h.tokens);
  const_cast<Tensor&>(in.positions).copy_from(h.positions);
  const_cast<Tensor&>(in.seq).copy_from(h.seq);
  const_cast<Tensor&>(in.slots).copy_from(h.slots);
  const_cast<Tensor&>(in.block_table).copy_from(h.block_table);
  const_cast<Tensor&>(in.logit_rows).copy_from(h.logit_rows);
}

}  // namespace

TEST(CudaGraphs, DecodeReplayEqualsTheEagerPassBitwise) {
  MT_REQUIRE_GPU();
  const ModelConfig c = graph_config();
  const std::unique_ptr<TrainSession> s = cudatest::frozen_cuda_session(c, 3);
  Qwen3MoeModel& m = s->model();
  ASSERT_TRUE(m.capturable_cached());
  m.begin_inference();
  KvCache cache = KvCache::allocate(c, Device::CUDA, 8, 8);
  // Prefill three prompts (lengths 5, 7, 3) eagerly into blocks 0/1, 2/3, 4/5.
  {
    const int64_t lens[3] = {5, 7, 3}, N = 15;
    CachedBatch b{Tensor::empty({N}, DType::I64), Tensor::empty({N}, DType::I32), Tensor::empty({N}, DType::I32),
                  Tensor::empty({N}, DType::I32), Tensor::empty({3, 2}, DType::I32), Tensor::empty({3}, DType::I64)};
    int64_t t = 0;
    for (int64_t i = 0; i < 3; ++i) {
      b.block_table.data<int32_t>()[2 * i] = int32_t(2 * i);
      b.block_table.data<int32_t>()[2 * i + 1] = int32_t(2 * i + 1);
      for (int64_t p = 0; p < lens[i]; ++p, ++t) {
        b.tokens.data<int64_t>()[t] = (i * 37 + p * 13 + 1) % c.vocab_size;
        b.positions.data<int32_t>()[t] = int32_t(p);
        b.seq.data<int32_t>()[t] = int32_t(i);
        b.slots.data<int32_t>()[t] = int32_t(2 * i * 8 + p);
      }
      b.logit_rows.data<int64_t>()[i] = t - 1;
    }
    m.forward_cached(b, cache);
  }
  const int64_t B = 4, W = 2, K = c.num_experts_per_tok;
  CachedBatch in{Tensor::empty({B}, DType::I64, Device::CUDA),    Tensor::empty({B}, DType::I32, Device::CUDA),
                 Tensor::empty({B}, DType::I32, Device::CUDA),    Tensor::empty({B}, DType::I32, Device::CUDA),
                 Tensor::empty({B, W}, DType::I32, Device::CUDA), Tensor::empty({B}, DType::I64, Device::CUDA)};
  Tensor logits = Tensor::empty({B, c.vocab_size}, DType::F32, Device::CUDA);
  std::vector<Tensor> routing{Tensor::empty({B, K}, DType::I32, Device::CUDA)};
  fill_step(in, B, 0, W);
  m.forward_cached_into(in, cache, logits, &routing);
  const Tensor eager0 = logits.to(Device::CPU), eager0_r = routing[0].to(Device::CPU);
  m.settle_arenas();
  cuda_graph::Graph g;
  std::string why;
  ASSERT_TRUE(g.capture([&] { m.forward_cached_into(in, cache, logits, &routing); }, &why)) << why;
  logits.zero_();
  routing[0].zero_();
  g.replay();
  EXPECT_TRUE(same_bits(logits, eager0)) << "replay of the captured step";
  EXPECT_TRUE(same_bits(routing[0], eager0_r));
  // The next two steps: new inputs in the same buffers, replayed, vs the eager pass on the same inputs.
  for (int64_t step = 1; step <= 2; ++step) {
    fill_step(in, B, step, W);
    m.forward_cached_into(in, cache, logits, &routing);
    const Tensor eager = logits.to(Device::CPU), eager_r = routing[0].to(Device::CPU);
    EXPECT_FALSE(same_bits(eager, eager0)) << "the inputs changed the logits";
    logits.zero_();
    ASSERT_EQ(g.captured_epoch(), cuda_graph::epoch());
    g.replay();
    EXPECT_TRUE(same_bits(logits, eager)) << "step " << step;
    EXPECT_TRUE(same_bits(routing[0], eager_r)) << "step " << step;
  }
  // A larger pass grows the arenas: every graph captured before is stale from then on.
  {
    const int64_t N = 4096;  // 3 MB of residual stream: more than the arenas hold
    CachedBatch b{Tensor::zeros({N}, DType::I64), Tensor::zeros({N}, DType::I32), Tensor::zeros({N}, DType::I32),
                  Tensor::empty({N}, DType::I32), Tensor::zeros({1, 8}, DType::I32), Tensor::zeros({1}, DType::I64)};
    for (int64_t t = 0; t < N; ++t) {
      b.positions.data<int32_t>()[t] = int32_t(t % 8);
      b.slots.data<int32_t>()[t] = int32_t(7 * 8 + t % 8);
    }
    for (int64_t w = 0; w < 8; ++w) b.block_table.data<int32_t>()[w] = 7;
    m.forward_cached(b, cache);
  }
  EXPECT_NE(g.captured_epoch(), cuda_graph::epoch());
  m.end_inference();
}

// An expert-parallel rank with nothing to decode still steps with its ep group: forward_cached over zero
// tokens. Every op of that pass gets only empty tensors; it must run on the CUDA backend (the tensors'
// device), not fall through to the CPU ops, whose dtype rules refuse bf16 activations (the GPU `grpo --ep 2`
// failure: "rope_fwd x_TNHd has dtype bf16, expected f32"). The model then decodes as before.
TEST(CudaGraphs, AnEmptyDecodeStepRunsOnTheGpu) {
  MT_REQUIRE_GPU();
  const ModelConfig c = graph_config();
  const std::unique_ptr<TrainSession> s = cudatest::frozen_cuda_session(c, 5);
  Qwen3MoeModel& m = s->model();
  m.begin_inference();
  KvCache cache = KvCache::allocate(c, Device::CUDA, 8, 8);
  const int64_t K = c.num_experts_per_tok;
  CachedBatch none{Tensor::empty({0}, DType::I64), Tensor::empty({0}, DType::I32), Tensor::empty({0}, DType::I32),
                   Tensor::empty({0}, DType::I32), Tensor::empty({0, 2}, DType::I32), Tensor::empty({0}, DType::I64)};
  std::vector<Tensor> routing;
  Tensor logits = m.forward_cached(none, cache, &routing);
  EXPECT_EQ(logits.shape(), (Shape{0, c.vocab_size}));
  ASSERT_EQ(routing.size(), 1u);  // one sparse layer
  EXPECT_EQ(routing[0].shape(), (Shape{0, K}));
  // A one-token step after the empty one: finite logits, expert ids in range.
  CachedBatch one{Tensor::empty({1}, DType::I64), Tensor::empty({1}, DType::I32), Tensor::empty({1}, DType::I32),
                  Tensor::empty({1}, DType::I32), Tensor::empty({1, 2}, DType::I32), Tensor::empty({1}, DType::I64)};
  one.tokens.data<int64_t>()[0] = 7;
  one.positions.data<int32_t>()[0] = 0;
  one.seq.data<int32_t>()[0] = 0;
  one.slots.data<int32_t>()[0] = 0;
  one.block_table.data<int32_t>()[0] = 0;
  one.block_table.data<int32_t>()[1] = 1;
  one.logit_rows.data<int64_t>()[0] = 0;
  routing.clear();
  const Tensor l1 = m.forward_cached(one, cache, &routing).to(Device::CPU);
  ASSERT_EQ(l1.shape(), (Shape{1, c.vocab_size}));
  for (int64_t v = 0; v < c.vocab_size; ++v) ASSERT_TRUE(std::isfinite(l1.data<float>()[v])) << v;
  const Tensor r1 = routing.at(0).to(Device::CPU);
  for (int64_t k = 0; k < K; ++k) EXPECT_TRUE(r1.data<int32_t>()[k] >= 0 && r1.data<int32_t>()[k] < c.num_experts);
  m.end_inference();
}

TEST(CudaGraphs, EngineWithGraphsGeneratesWhatItDoesWithout) {
  MT_REQUIRE_GPU();
  const ModelConfig c = graph_config();
  const std::unique_ptr<TrainSession> s = cudatest::frozen_cuda_session(c, 4);
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 6; ++i) {
    GenerateRequest r;
    for (int64_t p = 0; p < 3 + 2 * i; ++p) r.prompt.push_back(int32_t((i * 131 + p * 17 + 3) % c.vocab_size));
    r.max_new_tokens = 12 + 4 * i;  // sequences finish at different steps: the batch shrinks through buckets
    r.sampling.temperature = i % 2 ? 1.0f : 0.0f;
    r.sampling.seed = uint64_t(10 + i);
    if (i == 3) {  // the sampler's truncation path inside the graph too
      r.sampling.top_k = 20;
      r.sampling.top_p = 0.9f;
    }
    if (i == 5) r.sampling.min_p = 0.05f;
    r.n = i == 1 ? 3 : 1;
    reqs.push_back(r);
  }
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_cache_bytes = 16 << 20;
  eo.record_routing = true;
  eo.cuda_graphs = false;
  RolloutEngine eager(s->model(), eo);
  eo.cuda_graphs = true;
  RolloutEngine graphs(s->model(), eo);
  const std::vector<GeneratedSample> a = eager.generate(reqs), b = graphs.generate(reqs);
  EXPECT_EQ(eager.stats().graph_steps, 0);
  EXPECT_GT(graphs.stats().graph_steps, 20);
  EXPECT_GE(graphs.stats().graph_captures, 3) << "the batch passed through several buckets";
  std::printf("graphs: %lld decode steps replayed, %lld captures in %.3f s\n", (long long)graphs.stats().graph_steps,
              (long long)graphs.stats().graph_captures, graphs.stats().graph_capture_seconds);
  ASSERT_EQ(a.size(), b.size());
  double max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "sample " << i;
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    for (size_t t = 0; t < a[i].logprobs.size(); ++t)
      max_diff = std::max(max_diff, double(std::fabs(a[i].logprobs[t] - b[i].logprobs[t])));
    const std::vector<Tensor> ra = a[i].routing.tensors(), rb = b[i].routing.tensors();
    ASSERT_EQ(ra.size(), rb.size());
    for (size_t l = 0; l < ra.size(); ++l) EXPECT_TRUE(same_bits(ra[l], rb[l])) << "sample " << i << " layer " << l;
  }
  EXPECT_LT(max_diff, 2e-3);
  std::printf("graphs vs eager: max |dlogprob| %.2e\n", max_diff);
}
