// Deterministic mode on CUDA (core/determinism.h): each op that sums floats with atomics in the fast
// path (RMSNorm dw, the embedding gradient, the router's probability and z-loss sums) is checked, under
// the switch, against the CPU op with the tolerances of test_cuda_elementwise.cpp and against itself:
// two calls on the same inputs give the same bits. The inputs have many rows per sum and many
// repeated ids (a hot id taking half the tokens), where the atomics' order would show. Then the whole
// path: attention's backward under the switch twice, a tiny model's forward + backward twice (with and
// without recompute), and two `moetrain train` runs of 3 steps whose losses and checkpoint files must
// be identical byte for byte.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/determinism.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "model/config.h"
#include "model/micro_batch.h"
#include "model/params.h"
#include "model/qwen3_moe.h"
#include "train/trainer.h"
#ifdef MT_HAVE_CUDA
#include "backend/cuda/attention.cuh"
#endif

using namespace mt;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::cuda_filled;
using cudatest::randn;
using cudatest::to_host_f32;
namespace fs = std::filesystem;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();



// The bytes of two tensors (any device, same dtype) are equal; names the first differing element.
void expect_same_bits(const Tensor& a_any, const Tensor& b_any, const std::string& what) {
  const Tensor a = a_any.to(Device::CPU), b = b_any.to(Device::CPU);
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const size_t n = a.nbytes(), es = dtype_size(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.raw());
  const auto* pb = static_cast<const unsigned char*>(b.raw());
  if (std::memcmp(pa, pb, n) == 0) return;
  size_t i = 0;
  while (i < n && pa[i] == pb[i]) ++i;
  ADD_FAILURE() << what << ": the bits differ, first at element " << i / es << " of " << n / es;
}

// T ids in [0, V): `hot_share` of them one id (V / 2), the rest uniform, plus a few out-of-range ids
// (-1 and V) that must contribute nothing.
Tensor skewed_ids(int64_t T, int64_t V, double hot_share, Rng& rng) {
  Tensor t = Tensor::empty({T}, DType::I64);
  for (int64_t i = 0; i < T; ++i) {
    int64_t id = rng.uniform() < hot_share ? V / 2 : rng.randint(0, V);
    if (i % 997 == 5) id = (i % 2) ? V : -1;
    t.data<int64_t>()[i] = id;
  }
  return t;
}

// The CPU reference skips no ids: it is given the same ids with the out-of-range rows' gradients zeroed
// and their ids pointed at row 0 (adding zeros changes no bits: x + 0 = x for every x but -0).
void cpu_embedding_bwd_skipping(const Tensor& ids, const Tensor& dout, Tensor& dtable, bool accumulate) {
  const int64_t T = ids.numel(), D = dout.size(1), V = dtable.size(0);
  Tensor ids2 = ids.clone(), dout2 = dout.clone();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids.data<int64_t>()[t];
    if (id >= 0 && id < V) continue;
    ids2.data<int64_t>()[t] = 0;
    for (int64_t d = 0; d < D; ++d) dout2.data<float>()[t * D + d] = 0.0f;
  }
  cpu::embedding_bwd(ids2, dout2, dtable, accumulate);
}

}  // namespace

// ---------------------------------------------------------------- embedding

// The sorted, run-per-block backward adds a row's tokens in position order starting from the row's
// value, which is the CPU's loop: equal to it bit for bit (the +0 rows of skipped ids aside, which
// the CPU helper above adds to row 0: -0 + 0 = +0 is the only case where that changes a bit, and the
// random table gradients are never -0).
TEST(CudaDeterministic, EmbeddingBackwardEqualsCpuBitwise) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  Rng rng(31);
  struct Case {
    int64_t V, D, T;
    double hot;
  };
  // A realistic vocabulary (18-bit sort keys) with narrow rows; many repeats per id; a hot id that takes
  // half of the tokens; odd D (scalar path); a single token.
  const Case kCases[] = {
      {151936, 64, 65536, 0.05}, {50, 2048, 4096, 0.0}, {1000, 256, 8192, 0.5}, {13, 7, 257, 0.3}, {21, 6, 1, 0.0}};
  for (Case c : kCases) {
    for (DType dt : {DType::BF16, DType::F32}) {
      for (bool accumulate : {true, false}) {
        SCOPED_TRACE(str("V=", c.V, " D=", c.D, " T=", c.T, " hot ", c.hot, " dout ", dtype_name(dt),
                         accumulate ? " +=" : " ="));
        Tensor ids = skewed_ids(c.T, c.V, c.hot, rng), dtable = randn({c.V, c.D}, rng);
        Tensor dout = dt == DType::BF16 ? rand_bf16_exact({c.T, c.D}, rng) : randn({c.T, c.D}, rng);
        Tensor dtable_g = accumulate ? dtable.to(Device::CUDA) : cuda_filled({c.V, c.D}, DType::F32, kNaN);
        Tensor dtable_g2 = dtable_g.clone();
        const Tensor ids_g = ids.to(Device::CUDA), dout_g = to_cuda(dout, dt);
        cpu_embedding_bwd_skipping(ids, dout, dtable, accumulate);
        cuda::embedding_bwd(ids_g, dout_g, dtable_g, accumulate);
        cuda::embedding_bwd(ids_g, dout_g, dtable_g2, accumulate);
        expect_same_bits(dtable_g, dtable, "CUDA vs CPU");
        expect_same_bits(dtable_g2, dtable_g, "second call");
      }
    }
  }
}

// ---------------------------------------------------------------- RMSNorm

// dx comes from the fast kernel unchanged (it never used atomics): the same bits as with the switch off.
// dw: two fixed-order passes, within the fast path's tolerance of the CPU's fp64 sum, and repeatable.
TEST(CudaDeterministic, RmsNormBackwardMatchesCpuAndRepeatsBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(32);
  struct Case {
    int64_t N, D;
  };
  // bench-4L's q norm over 2k tokens (N = 2048 x 32 heads, D = 128), its hidden norm (D = 2048), the
  // demo's head norms, odd shapes (scalar path, partial parts) and fewer rows than one part.
  const Case kCases[] = {{2048 * 32, 128}, {16384, 2048}, {16384, 16}, {1001, 7}, {37, 128}, {3, 2048}};
  struct Dtypes {
    DType x, dx, dy;
  };
  const Dtypes kDtypes[] = {{DType::BF16, DType::BF16, DType::BF16},
                            {DType::F32, DType::F32, DType::F32},
                            {DType::F32, DType::F32, DType::BF16}};
  for (Case c : kCases) {
    for (Dtypes dt : kDtypes) {
      Tensor x = dt.x == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      Tensor w = randn({c.D}, rng);
      Tensor dy = dt.dy == DType::BF16 ? rand_bf16_exact({c.N, c.D}, rng) : randn({c.N, c.D}, rng);
      Tensor y = Tensor::empty({c.N, c.D}), rstd = Tensor::empty({c.N});
      cpu::rms_norm_fwd(x, w, 1e-6f, y, rstd);
      const Tensor x_g = to_cuda(x, dt.x), dy_g = to_cuda(dy, dt.dy), w_g = w.to(Device::CUDA),
                   rstd_g = rstd.to(Device::CUDA);
      for (bool accumulate : {true, false}) {
        SCOPED_TRACE(str("N=", c.N, " D=", c.D, " x ", dtype_name(dt.x), " dx ", dtype_name(dt.dx), " dy ",
                         dtype_name(dt.dy), accumulate ? " +=" : " ="));
        Tensor dx = Tensor::empty({c.N, c.D}), dw = randn({c.D}, rng);
        const Tensor dw_start = dw.clone();
        cpu::rms_norm_bwd(dy, x, w, rstd, dx, dw, accumulate);
        Tensor dx_g[3], dw_g[3];
        for (int run = 0; run < 3; ++run) {  // runs 0 and 1 deterministic, run 2 the fast path
          DeterministicScope det(run < 2);
          dx_g[run] = cuda_filled({c.N, c.D}, dt.dx, kNaN);
          dw_g[run] = accumulate ? dw_start.to(Device::CUDA) : cuda_filled({c.D}, DType::F32, kNaN);
          cuda::rms_norm_bwd(dy_g, x_g, w_g, rstd_g, dx_g[run], dw_g[run], accumulate);
        }
        EXPECT_LT(rel_l2(dx_g[0], dx), dt.dx == DType::BF16 ? 5e-3 : 1e-5);
        // Parts of 32..64 rows summed in f32, the parts in fp64, against the CPU's fp64 sum.
        EXPECT_LT(rel_l2(dw_g[0], dw), 1e-4);
        expect_same_bits(dx_g[1], dx_g[0], "dx, second call");
        expect_same_bits(dw_g[1], dw_g[0], "dw, second call");
        expect_same_bits(dx_g[2], dx_g[0], "dx, fast path");
      }
    }
  }
}

// ---------------------------------------------------------------- router sums

TEST(CudaDeterministic, RouterSumsMatchCpuAndRepeatBitwise) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  Rng rng(33);
  struct Case {
    int64_t T, E, K;
  };
  const Case kCases[] = {{32768, 128, 8}, {1001, 60, 4}, {5, 8, 2}};
  for (Case c : kCases) {
    SCOPED_TRACE(str("T=", c.T, " E=", c.E));
    Tensor logits = randn({c.T, c.E}, rng, 2.0f);
    Tensor probs = Tensor::empty({c.T, c.E}), idx = Tensor::empty({c.T, c.K}, DType::I32),
           w = Tensor::empty({c.T, c.K});
    cpu::router_fwd(logits, c.K, true, probs, idx, w);
    const Tensor probs_g = probs.to(Device::CUDA), logits_g = logits.to(Device::CUDA);

    Tensor sums = randn({c.E}, rng);  // += onto earlier layers' sums
    Tensor sums_g[2] = {sums.to(Device::CUDA), sums.to(Device::CUDA)};
    cpu::prob_column_sums(probs, sums);
    for (Tensor& s : sums_g) cuda::prob_column_sums(probs_g, s);
    // fp64 per block of 32 rows and fp64 across blocks, one f32 rounding of the total: as the CPU, but
    // for the order of the fp64 additions.
    EXPECT_LT(rel_l2(sums_g[0], sums), 1e-6);
    expect_same_bits(sums_g[1], sums_g[0], "prob_column_sums, second call");

    Tensor lse = Tensor::empty({c.T}), zsum = Tensor::empty({1});
    zsum.data<float>()[0] = 0.75f;  // += onto an earlier layer's sum
    Tensor lse_g[2], zsum_g[2];
    for (int r = 0; r < 2; ++r) {
      lse_g[r] = cuda_filled({c.T}, DType::F32, kNaN);
      zsum_g[r] = zsum.to(Device::CUDA);
      cuda::router_z_loss_fwd(logits_g, lse_g[r], zsum_g[r]);
    }
    cpu::router_z_loss_fwd(logits, lse, zsum);
    EXPECT_LT(rel_l2(lse_g[0], lse), 1e-6);
    EXPECT_NEAR(zsum_g[0].to(Device::CPU).data<float>()[0], zsum.data<float>()[0], 1e-6 * zsum.data<float>()[0]);
    expect_same_bits(zsum_g[1], zsum_g[0], "z-loss sum, second call");
    expect_same_bits(lse_g[1], lse_g[0], "lse, second call");
  }
}

// ---------------------------------------------------------------- attention

#ifdef MT_HAVE_CUDA
// Under the switch, attention_bwd runs cuDNN's deterministic backward or the reference kernels (the
// plan says which, recorded as a test property): two calls give the same bits, and the gradients stay
// within the bf16 budget of the reference kernels' (which the CPU is checked against elsewhere).
TEST(CudaDeterministic, AttentionBackwardRepeatsBitwise) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  struct Dims {
    int64_t B, S, H, G, Hd;
  };
  // A bench-4L layer at 2 x 2048 tokens, and the demo's head dim.
  for (Dims d : {Dims{2, 2048, 32, 4, 128}, Dims{16, 64, 4, 2, 32}}) {
    SCOPED_TRACE(str("B=", d.B, " S=", d.S, " H=", d.H, " G=", d.G, " Hd=", d.Hd));
    const cuda::AttentionPlanInfo info = cuda::attention_plan_info(d.B, d.S, d.H, d.G, d.Hd);
    ::testing::Test::RecordProperty(str("plan_S", d.S), info.reason);
    std::printf("[deterministic attention] B=%lld S=%lld: %s (%s)\n", (long long)d.B, (long long)d.S,
                info.backend == cuda::AttentionBackend::cudnn ? "cuDNN" : "reference kernels", info.reason.c_str());
    Rng rng(34);
    const int64_t T = d.B * d.S;
    const Tensor q = to_cuda(rand_bf16_exact({T, d.H, d.Hd}, rng), DType::BF16);
    const Tensor k = to_cuda(rand_bf16_exact({T, d.G, d.Hd}, rng), DType::BF16);
    const Tensor v = to_cuda(rand_bf16_exact({T, d.G, d.Hd}, rng), DType::BF16);
    const Tensor dout = to_cuda(rand_bf16_exact({T, d.H, d.Hd}, rng), DType::BF16);
    Tensor out = cuda_filled({T, d.H, d.Hd}, DType::BF16, kNaN), lse = cuda_filled({T, d.H}, DType::F32, kNaN);
    cuda::attention_fwd(q, k, v, d.B, d.S, out, lse);
    Tensor dq[2], dk[2], dv[2];
    for (int r = 0; r < 2; ++r) {
      dq[r] = cuda_filled({T, d.H, d.Hd}, DType::BF16, kNaN);
      dk[r] = cuda_filled({T, d.G, d.Hd}, DType::BF16, kNaN);
      dv[r] = cuda_filled({T, d.G, d.Hd}, DType::BF16, kNaN);
      cuda::attention_bwd(dout, q, k, v, out, lse, d.B, d.S, dq[r], dk[r], dv[r]);
    }
    expect_same_bits(dq[1], dq[0], "dq");
    expect_same_bits(dk[1], dk[0], "dk");
    expect_same_bits(dv[1], dv[0], "dv");
    // Against the reference kernels on the same forward (their statistics layout is the plan's).
    Tensor out_r = cuda_filled({T, d.H, d.Hd}, DType::BF16, kNaN), lse_r = cuda_filled({T, d.H}, DType::F32, kNaN);
    Tensor dq_r = dq[0].clone(), dk_r = dk[0].clone(), dv_r = dv[0].clone();
    cuda::attention_ref_fwd(q, k, v, d.B, d.S, out_r, lse_r, info.stats);
    cuda::attention_ref_bwd(dout, q, k, v, out_r, lse_r, d.B, d.S, dq_r, dk_r, dv_r, info.stats);
    EXPECT_LE(rel_l2(dq[0], dq_r), 2e-2);
    EXPECT_LE(rel_l2(dk[0], dk_r), 2e-2);
    EXPECT_LE(rel_l2(dv[0], dv_r), 2e-2);
  }
}
#endif

// ---------------------------------------------------------------- the model and the trainer

// The tiny model with the aux loss and z-loss on, 16 x 64 tokens of a 512-token vocabulary (every id
// repeated): forward + backward twice gives the same loss and gradients bit for bit, and full and moe
// recompute give them too (the recompute reuses the routing, and every sum now has one order).
TEST(CudaDeterministic, ModelForwardBackwardRepeatsBitwise) {
  MT_REQUIRE_GPU();
  DeterministicScope det(true);
  ModelConfig c = preset_model_config("tiny");
  c.output_router_logits = true;
  if (c.router_aux_loss_coef == 0) c.router_aux_loss_coef = 0.01;
  Tensor host = Tensor::zeros({ParamTable(c).total()});
  init_weights(c, ParamTable(c), host, 5);
  Rng rng(35);
  MicroBatch mb{Tensor::empty({16, 64}, DType::I64), Tensor::empty({16, 64}, DType::I64)};
  for (int64_t i = 0; i < 16 * 64; ++i)
    mb.input_ids.data<int64_t>()[i] = mb.labels.data<int64_t>()[i] = rng.randint(0, c.vocab_size);
  LossParts lp[4];
  Tensor g[4];
  for (int r = 0; r < 4; ++r) {
    Qwen3MoeModel m(c, Device::CUDA);
    m.params().copy_from(host.to(Device::CUDA));
    m.refresh_compute_weights();
    PassOptions po;
    po.ce_scale = 1.0 / double(16 * 63);
    po.aux_scale = c.router_aux_loss_coef;
    po.z_loss_scale = 1e-3;
    po.recompute = r == 2 ? Recompute::Full : r == 3 ? Recompute::Moe : Recompute::None;
    lp[r] = m.forward_backward(mb, po);
    g[r] = m.grads().to(Device::CPU);
  }
  for (int r : {1, 2, 3}) {
    SCOPED_TRACE(r == 1 ? "second run" : r == 2 ? "full recompute" : "moe recompute");
    EXPECT_EQ(lp[r].loss, lp[0].loss);
    EXPECT_EQ(lp[r].aux, lp[0].aux);
    EXPECT_EQ(lp[r].z, lp[0].z);
    expect_same_bits(g[r], g[0], "gradients");
  }
}

namespace {

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The loss of every step line of a metrics file, as written.
std::vector<std::string> losses_of(const fs::path& metrics) {
  std::vector<std::string> out;
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].dump());
  }
  return out;
}

}  // namespace

// `moetrain train --deterministic` twice on the GPU, 3 steps of the tiny model with the z-loss on:
// the same losses and the same weight and training-state files, byte for byte.
TEST(CudaDeterministic, TwoTrainRunsGiveTheSameBits) {
  MT_REQUIRE_GPU();
  DeterministicScope restore(deterministic());  // run_training turns the switch on for the process
  const fs::path base = fs::temp_directory_path() / ("moetrain_cuda_det_" + std::to_string(getpid()));
  std::vector<std::string> losses[2];
  for (int r = 0; r < 2; ++r) {
    TrainConfig c;
    c.model = "tiny";
    c.device = "cuda";
    c.deterministic = 1;
    c.steps = 3;
    c.warmup_steps = 1;
    c.micro_batch_size = 16;
    c.grad_accum = 2;
    c.seq_len = 64;
    c.router_z_loss_coef = 1e-3;
    c.eval_problems = 0;
    c.tensorboard = 0;
    c.out_dir = (base / ("run" + std::to_string(r))).string();
    run_training(c);
    EXPECT_TRUE(deterministic());
    losses[r] = losses_of(metrics_path(c));
    ASSERT_EQ(losses[r].size(), 3u);
  }
  EXPECT_EQ(losses[1], losses[0]);
  const fs::path ck0 = base / "run0" / "checkpoint-3", ck1 = base / "run1" / "checkpoint-3";
  int compared = 0;
  for (const auto& e : fs::recursive_directory_iterator(ck0)) {
    if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
    const fs::path rel = fs::relative(e.path(), ck0);
    EXPECT_TRUE(read_bytes(e.path()) == read_bytes(ck1 / rel)) << rel << " differs between the two runs";
    ++compared;
  }
  EXPECT_GE(compared, 2);  // the HF weights and the training state
  fs::remove_all(base);
}
