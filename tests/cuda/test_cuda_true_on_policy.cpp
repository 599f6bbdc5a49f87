// The batch-invariant mode on the GPU (core/determinism.h, backend/cuda/invariant.cuh): the rollout engine's
// log-probs equal the trainer's forward on the same tokens bit for bit, with the routing the trainer chooses
// itself; a sample's tokens and log-probs do not depend on the requests around it (alone, or among 1 to 255
// others), on the KV-cache block size or on CUDA graphs; the trainer's log-probs of a sample alone equal those in
// a batch. Without the mode the rollout and the trainer differ (checked too, so that test can fail).
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <memory>
#include <vector>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/invariant.h"
#include "core/determinism.h"
#include "cuda_session_util.h"
#include "cuda_test_util.h"
#include "model/qwen3_moe.h"
#include "rl/rl_test_util.h"
#include "rl/rollout_batch.h"
#include "rollout/engine.h"
#include "train/session.h"

using namespace mt;
using namespace mt::rl;

namespace {

// tiny (head_dim 16, a dense layer and a sparse one), and a wider one with head_dim 128 and 4 of 16 experts.
ModelConfig config(int which) {
  ModelConfig c = preset_model_config("tiny");
  c.eos_token_id = -1;
  c.mlp_only_layers = {0};
  if (which == 1) {
    c.vocab_size = 2048;
    c.hidden_size = 256;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 128;
    c.num_experts = 16;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 128;
    c.intermediate_size = 512;
    c.num_hidden_layers = 3;
  }
  return c;
}

GenerateRequest request(const ModelConfig& c, int64_t i, int64_t n = 1) {
  GenerateRequest r;
  for (int64_t p = 0; p < 3 + (i * 7) % 23; ++p) r.prompt.push_back(int32_t((i * 131 + p * 17 + 3) % c.vocab_size));
  r.max_new_tokens = 6 + (i * 5) % 11;
  r.n = n;
  r.sampling.temperature = 1.0f;
  r.sampling.seed = uint64_t(100 + i);
  return r;
}

// Tokens whose log-probs differ in any bit (the samples' tokens must match).
int64_t differing(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, int64_t* total) {
  int64_t d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) {
      ++*total;
      d += std::bit_cast<uint32_t>(a[i][j]) != std::bit_cast<uint32_t>(b[i][j]);
    }
  return d;
}

// Rollout (12 samples of 6 prompts, graphs on) against the trainer's forward of the same tokens: the count of
// tokens whose log-probs differ in any bit, and of all tokens.
std::pair<int64_t, int64_t> rollout_vs_trainer(const ModelConfig& c, TrainSession& s) {
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 6; ++i) reqs.push_back(request(c, i, 2));
  EngineOptions eo;
  eo.kv_cache_bytes = 64 << 20;
  eo.block_size = 4;
  RolloutEngine engine(s.model(), eo);
  const std::vector<RolloutSample> samples = rltest::rollout_samples(reqs, engine.generate(reqs), false);
  std::vector<std::vector<float>> engine_lp;
  for (const RolloutSample& x : samples) engine_lp.push_back(x.logprobs);
  int64_t total = 0;
  const int64_t d = differing(rltest::trainer_logprobs(s.model(), samples), engine_lp, &total);
  return {d, total};
}

#ifdef MT_HAVE_CUDA
// C = A B_g^T by invariant_gemm_nt on the device (groups by `off`, host i64 [G + 1]; empty: one group) with
// A [M, K] and B [G, N, K] of dtype dt, C f32.
Tensor device_gemm(const Tensor& a, const Tensor& b, DType dt, const std::vector<int64_t>& off) {
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  const Tensor da = cudatest::to_cuda(a, dt), db = cudatest::to_cuda(b, dt);
  Tensor c = Tensor::empty({M, N}, DType::F32, Device::CUDA), doff;
  if (!off.empty()) {
    doff = Tensor::empty({G + 1}, DType::I64);
    for (int64_t g = 0; g <= G; ++g) doff.data<int64_t>()[g] = off[size_t(g)];
    doff = doff.to(Device::CUDA);
  }
  cuda::invariant_gemm_nt("test", M, N, K, da.raw(), K, db.raw(), K, dt, 1.0f, 0.0f, nullptr, c.raw(), DType::F32, N,
                          G, off.empty() ? nullptr : doff.data<int64_t>(), N * K);
  return c.to(Device::CPU);
}
#endif  // MT_HAVE_CUDA

}  // namespace

#ifdef MT_HAVE_CUDA
// The GEMM of the mode against an fp64 host product (bf16 and f32 operands; K not a multiple of 8 or 16, so the
// edges and the unvectorised loads run; groups with no rows), and its row invariance: each row of a 300-row product
// equals the same row computed alone, bit for bit.
TEST(CudaTrueOnPolicy, InvariantGemmIsRightAndEachRowIsItsOwn) {
  MT_REQUIRE_GPU();
  Rng rng(7);
  for (const DType dt : {DType::BF16, DType::F32})
    for (const int64_t K : {64, 19, 200}) {
      const int64_t M = 300, N = 70, G = 4;
      const std::vector<int64_t> off = {0, 120, 120, 299, 300};  // group 1 has no rows
      const Tensor a = cudatest::rand_bf16_exact({M, K}, rng), b = cudatest::rand_bf16_exact({G, N, K}, rng);
      for (const bool grouped : {false, true}) {
        const Tensor b1 = grouped ? b : b.rows(0, 1);
        const Tensor c = device_gemm(a, b1, dt, grouped ? off : std::vector<int64_t>{});
        double worst = 0;
        for (int64_t r = 0; r < M; ++r) {
          int64_t g = 0;
          while (grouped && r >= off[size_t(g) + 1]) ++g;
          for (int64_t n = 0; n < N; ++n) {
            double want = 0;
            for (int64_t k = 0; k < K; ++k)
              want += double(a.data<float>()[r * K + k]) * double(b.data<float>()[(g * N + n) * K + k]);
            worst = std::max(worst, std::abs(double(c.data<float>()[r * N + n]) - want) / (1.0 + std::abs(want)));
          }
        }
        EXPECT_LT(worst, 1e-5) << dtype_name(dt) << " K " << K << (grouped ? " grouped" : "");
        for (const int64_t r : {int64_t(0), int64_t(37), int64_t(121), int64_t(299)}) {
          int64_t g = 0;
          while (grouped && r >= off[size_t(g) + 1]) ++g;
          const Tensor alone = device_gemm(a.rows(r, 1), b.rows(grouped ? g : 0, 1), dt, {});
          for (int64_t n = 0; n < N; ++n)
            ASSERT_EQ(std::bit_cast<uint32_t>(alone.data<float>()[n]), std::bit_cast<uint32_t>(c.data<float>()[r * N + n]))
                << dtype_name(dt) << " K " << K << (grouped ? " grouped" : "") << ": row " << r << " col " << n;
        }
      }
    }
}

// The mode's dense forward GEMM (gemm.cu: one cuBLASLt algorithm for every M of an (N, K) shape, K unsplit) at the
// shapes of bench-4L's layers (q, kv, o, router, the LM head's row group) and of a small model: right against an
// fp64 host product (f32 C), and each row of a 300-row product equal, in every bit, to the same row computed in
// calls of 1 to 299 rows starting anywhere, with an f32 and a bf16 C.
TEST(CudaTrueOnPolicy, DenseGemmOfTheModeGivesEachRowItsOwnBits) {
  MT_REQUIRE_GPU();
  const BatchInvariantScope mode(true);
  Rng rng(11);
  struct Shape2 { int64_t N, K; };
  for (const Shape2 sh : {Shape2{4096, 2048}, Shape2{512, 2048}, Shape2{2048, 4096}, Shape2{128, 2048},
                          Shape2{32768, 2048}, Shape2{96, 64}, Shape2{2048, 256}}) {
    const int64_t M = 300, N = sh.N, K = sh.K;
    const Tensor a = cudatest::rand_bf16_exact({M, K}, rng), b = cudatest::rand_bf16_exact({N, K}, rng, 0.05f);
    const Tensor da = cudatest::to_cuda(a, DType::BF16), db = cudatest::to_cuda(b, DType::BF16);
    for (const DType ct : {DType::F32, DType::BF16}) {
      const auto* A = static_cast<const __nv_bfloat16*>(da.raw());
      const auto* B = static_cast<const __nv_bfloat16*>(db.raw());
      Tensor full = Tensor::empty({M, N}, ct, Device::CUDA);
      cuda::gemm("test full", false, true, M, N, K, A, K, B, K, 0.0f, full.raw(), ct, N);
      const Tensor want = cudatest::to_host_f32(full);
      if (ct == DType::F32) {
        double worst = 0;
        for (const int64_t r : {int64_t(0), int64_t(150), int64_t(299)})
          for (int64_t n = 0; n < N; n += 7) {
            double x = 0;
            for (int64_t k = 0; k < K; ++k) x += double(a.data<float>()[r * K + k]) * double(b.data<float>()[n * K + k]);
            worst = std::max(worst, std::abs(double(want.data<float>()[r * N + n]) - x) / (1.0 + std::abs(x)));
          }
        EXPECT_LT(worst, 5e-5) << "N " << N << " K " << K;  // f32 sums of up to 4,096 products
      }
      for (const auto& [r0, m] : {std::pair<int64_t, int64_t>{0, 1}, {37, 1}, {5, 2}, {64, 16}, {1, 63}, {100, 200},
                                 {0, 299}, {299, 1}, {250, 33}}) {
        Tensor part = Tensor::empty({m, N}, ct, Device::CUDA);
        cuda::gemm("test part", false, true, m, N, K, A + r0 * K, K, B, K, 0.0f, part.raw(), ct, N);
        const Tensor got = cudatest::to_host_f32(part);
        int64_t bits = 0;
        for (int64_t i = 0; i < m * N; ++i)
          bits += std::bit_cast<uint32_t>(got.data<float>()[i]) != std::bit_cast<uint32_t>(want.data<float>()[r0 * N + i]);
        EXPECT_EQ(bits, 0) << "N " << N << " K " << K << " C " << dtype_name(ct) << ": rows [" << r0 << ", "
                           << r0 + m << ") alone differ from the same rows of the 300-row call in " << bits << " of "
                           << m * N << " elements";
      }
    }
  }
}

#endif  // MT_HAVE_CUDA

TEST(CudaTrueOnPolicy, RolloutLogprobsEqualTheTrainersBitForBit) {
  MT_REQUIRE_GPU();
  for (int which : {0, 1}) {
    const ModelConfig c = config(which);
    const std::unique_ptr<TrainSession> s = cudatest::frozen_cuda_session(c, 21);
    const auto [off_diff, off_total] = rollout_vs_trainer(c, *s);
    std::pair<int64_t, int64_t> on;
    {
      BatchInvariantScope invariant(true);
      on = rollout_vs_trainer(c, *s);
    }
    std::printf("config %d: rollout vs trainer, tokens with any differing bit: %lld of %lld without the mode, "
                "%lld of %lld with it\n",
                which, (long long)off_diff, (long long)off_total, (long long)on.first, (long long)on.second);
    EXPECT_EQ(on.first, 0) << "config " << which;
    EXPECT_GT(on.second, 50);
    EXPECT_GT(off_diff, 0) << "config " << which << ": the default kernels should differ somewhere (else this test "
                              "shows nothing)";
  }
}

// One request's samples alone and among 1, 7, 63 and 255 others, at block sizes 1, 4 and 16, with and without CUDA
// graphs: the same tokens and log-probs, bit for bit; and the trainer's log-probs of each sample alone equal those
// of the whole batch.
TEST(CudaTrueOnPolicy, ASampleDoesNotDependOnItsBatchCacheLayoutOrGraphs) {
  MT_REQUIRE_GPU();
  BatchInvariantScope invariant(true);
  const ModelConfig c = config(1);
  const std::unique_ptr<TrainSession> s = cudatest::frozen_cuda_session(c, 5);
  const GenerateRequest probe = request(c, 1000, 2);
  std::vector<GeneratedSample> ref;
  int runs = 0;
  for (const int64_t others : {0, 1, 7, 63, 255})
    for (const int32_t bs : {1, 4, 16})
      for (const bool graphs : {false, true}) {
        if (others > 7 && bs == 1) continue;  // block size 1 with hundreds of sequences: slow, nothing new
        std::vector<GenerateRequest> reqs;
        for (int64_t i = 0; i < others; ++i) reqs.push_back(request(c, i));
        reqs.insert(reqs.begin() + others / 2, probe);  // in the middle of the batch
        EngineOptions eo;
        eo.kv_cache_bytes = 256 << 20;
        eo.block_size = bs;
        eo.cuda_graphs = graphs;
        RolloutEngine engine(s->model(), eo);
        const std::vector<GeneratedSample> gen = engine.generate(reqs);
        std::vector<GeneratedSample> mine;
        for (const GeneratedSample& g : gen)
          if (g.prompt_index == others / 2) mine.push_back(g);
        ASSERT_EQ(mine.size(), 2u);
        ++runs;
        if (ref.empty()) {
          ref = mine;
          continue;
        }
        for (size_t k = 0; k < 2; ++k) {
          ASSERT_EQ(mine[k].tokens, ref[k].tokens) << others << " others, block " << bs << ", graphs " << graphs;
          for (size_t j = 0; j < ref[k].logprobs.size(); ++j)
            ASSERT_EQ(std::bit_cast<uint32_t>(mine[k].logprobs[j]), std::bit_cast<uint32_t>(ref[k].logprobs[j]))
                << others << " others, block " << bs << ", graphs " << graphs << ": sample " << k << " token " << j;
        }
        if (others == 63 && bs == 16 && graphs) {
          // The trainer: the batch's samples together (64 prompts' samples in one micro-batch) against each of the
          // probe's samples alone.
          const std::vector<RolloutSample> all = rltest::rollout_samples(reqs, gen, false);
          const std::vector<std::vector<float>> together = rltest::trainer_logprobs(s->model(), all);
          for (size_t i = 0; i < all.size(); ++i) {
            if (gen[i].prompt_index != others / 2) continue;
            const std::vector<float> alone = rltest::trainer_logprobs(s->model(), {all[i]})[0];
            for (size_t j = 0; j < alone.size(); ++j) {
              ASSERT_EQ(std::bit_cast<uint32_t>(alone[j]), std::bit_cast<uint32_t>(together[i][j])) << "token " << j;
              ASSERT_EQ(std::bit_cast<uint32_t>(alone[j]), std::bit_cast<uint32_t>(all[i].logprobs[j]))
                  << "trainer vs rollout, token " << j;
            }
          }
        }
      }
  std::printf("true on-policy: one request's 2 samples identical over %d batches, block sizes and graph settings\n",
              runs);
  EXPECT_EQ(runs, 26);
}
