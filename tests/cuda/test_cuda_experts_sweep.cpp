// A seeded randomised sweep of the MoE path on CUDA against the CPU ops: the dispatch plan,
// permute/unpermute (plain and weighted) and every CUDA experts implementation (the CUTLASS grouped
// path, the per-expert cuBLASLt reference path and the composite reference form), forward and every
// gradient, over shapes that the hand-picked cases of test_cuda_gemm_moe.cpp and
// test_cuda_grouped_gemm.cpp do not reach:
//   - E in {1, 8, 12, 128}, top-k 1..min(8, E), T from 1 to 300 tokens;
//   - routings whose per-expert counts include 0 and 1, runs of empty experts, and all tokens on
//     the same K experts (OneSet; with K = 1 every row on one expert);
//   - widths that are not multiples of the CUTLASS tiles (128 x 256 x 64; the forward's 64 x 256 x 64
//     when rows per expert are few: each case also runs the grouped path on the tile that
//     grouped_gemm.cuh's automatic choice does not take, forced by MOETRAIN_GROUPED_SMALL), and
//     widths that are not multiples of 8, which the grouped path refuses with a message naming D and F;
//   - two calls that reuse the same output buffers and scratch with different routings: the first
//     writes the weight gradients with = (pre-filled with NaN: nothing may be read, experts without
//     rows must come back 0), the second adds to them with +=.
// Every output lives inside a larger buffer whose margins hold a sentinel: the model packs its
// activations side by side in arenas, so a write past an output's rows corrupts a neighbour there
// while a separately allocated test tensor would hide it. The margins must come back untouched.
// Errors are measured per expert (rows of a row output, blocks of a weight gradient), so one wrong
// expert cannot hide in the norm of the others. Tolerances as in test_cuda_grouped_gemm.cpp: bf16
// outputs and weight gradients within 2e-2 relative L2 of the CPU per expert (a wrong row range or
// transpose is of order 1); ops that only move data are exact.
#include <gtest/gtest.h>

#ifdef MT_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/grouped_gemm.cuh"
#include "cuda_test_util.h"
#include "ops/ops.h"

using namespace mt;
using cudatest::cpu_plan;
using cudatest::cuda_plan;
using cudatest::expect_equal_ints;
using cudatest::Plan;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

constexpr double kTol = 2e-2;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSentinel = 1536.0f;  // exact in bf16
constexpr int64_t kMargin = 256;      // elements before and after each output (16-byte aligned for bf16 and f32)

enum class Routing { Uniform, Sparse, OneSet };
const char* routing_name(Routing r) {
  return r == Routing::Uniform ? "uniform" : r == Routing::Sparse ? "sparse" : "one_set";
}

// Top-k ids for T tokens, K distinct experts per token.
//   Uniform: random experts.
//   Sparse: tokens choose among a random subset of max(K, E / 3) experts, and up to two experts outside
//     it get exactly one assignment each (the last choice of the first tokens), so the counts hold 0, 1
//     and runs of empty experts.
//   OneSet: every token chooses the same K experts (in its own order): K experts get T rows each.
Tensor make_topk(int64_t T, int64_t K, int64_t E, Routing routing, Rng& rng) {
  std::vector<int32_t> all(static_cast<size_t>(E));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = E - 1; i > 0; --i) std::swap(all[size_t(i)], all[size_t(rng.randint(0, i + 1))]);
  std::vector<int32_t> pool = all;
  if (routing == Routing::Sparse) pool.resize(size_t(std::max<int64_t>(K, E / 3)));
  if (routing == Routing::OneSet) pool.resize(size_t(K));
  Tensor idx = Tensor::empty({T, K}, DType::I32);
  int32_t* p = idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> c = pool;
    for (int64_t k = 0; k < K; ++k) {  // a partial shuffle: K distinct experts of the pool
      std::swap(c[size_t(k)], c[size_t(k + rng.randint(0, int64_t(c.size()) - k))]);
      p[t * K + k] = c[size_t(k)];
    }
  }
  if (routing == Routing::Sparse)
    for (int64_t j = 0; j < 2 && j < T && int64_t(pool.size()) + j < E; ++j)
      p[j * K + K - 1] = all[pool.size() + size_t(j)];  // outside the pool: distinct from the token's others
  return idx;
}

// An output tensor inside a buffer with sentinel margins on both sides.
struct Guarded {
  Tensor buf, t;
  Guarded(const Shape& shape, DType dtype, float fill) {
    const int64_t n = shape_numel(shape);
    Tensor host = Tensor::empty({n + 2 * kMargin});
    host.fill_(kSentinel);
    for (int64_t i = 0; i < n; ++i) host.data<float>()[kMargin + i] = fill;
    buf = to_cuda(host, dtype);
    t = buf.rows(kMargin, n).view(shape);
  }
  Guarded(const Tensor& init_f32, DType dtype) : Guarded(init_f32.shape(), dtype, 0.0f) { t.copy_from(to_cuda(init_f32, dtype)); }
  // Elements of the margins that changed.
  int64_t margin_damage() const {
    const Tensor h = to_host_f32(buf);
    const int64_t n = h.numel();
    int64_t bad = 0;
    for (int64_t i = 0; i < kMargin; ++i) bad += (h.data<float>()[i] != kSentinel) + (h.data<float>()[n - 1 - i] != kSentinel);
    return bad;
  }
};

void expect_margins(const Guarded& g, const std::string& what) {
  EXPECT_EQ(g.margin_damage(), 0) << what << ": written outside its " << g.t.desc();
}

// Per expert: rows [off[e], off[e+1]) of a row output [R, C], or block e of a weight gradient [E, ...].
// An expert whose expected values are all zero must come back exactly zero.
void expect_by_expert(const Tensor& got_any, const Tensor& want, const Tensor& offsets, bool weight_blocks,
                      const std::string& what) {
  const Tensor got = to_host_f32(got_any);
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const int64_t E = offsets.numel() - 1;
  const int64_t per = weight_blocks ? want.numel() / E : want.numel() / std::max<int64_t>(want.size(0), 1);
  double worst = 0;
  int64_t worst_e = -1;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t* off = offsets.data<int64_t>();
    const int64_t b = weight_blocks ? e * per : off[e] * per, n = weight_blocks ? per : (off[e + 1] - off[e]) * per;
    double num = 0, den = 0;
    bool finite = true;
    for (int64_t i = b; i < b + n; ++i) {
      const double g = got.data<float>()[i], w = want.data<float>()[i];
      finite = finite && std::isfinite(g);
      num += (g - w) * (g - w);
      den += w * w;
    }
    const double err = !finite ? INFINITY : den == 0 ? (num == 0 ? 0.0 : INFINITY) : std::sqrt(num / den);
    if (err > worst || !std::isfinite(err)) worst = err, worst_e = e;
  }
  EXPECT_LE(worst, kTol) << what << ": worst expert " << worst_e << " (rows " << offsets.data<int64_t>()[std::max<int64_t>(worst_e, 0)]
                         << ".." << offsets.data<int64_t>()[std::max<int64_t>(worst_e, 0) + 1] << ")";
}

struct SweepCase {
  int64_t E, K, D, F, T;
  Routing routing;
  uint64_t seed;
  std::string name() const {
    return "E" + std::to_string(E) + "_K" + std::to_string(K) + "_D" + std::to_string(D) + "_F" + std::to_string(F) +
           "_T" + std::to_string(T) + "_" + routing_name(routing);
  }
};

// Every (E, K) with E in {1, 8, 12, 128} and K in 1..min(8, E), each under the three routings, with T,
// D and F drawn from lists that hold tile tails, one-token batches and the demo's shape; then the
// demo's micro-batch (T = 1024, D = F = 128) and a realistic wide case.
std::vector<SweepCase> sweep_cases() {
  const int64_t Ts[] = {1, 2, 3, 17, 64, 300};
  const int64_t DFs[][2] = {{128, 128}, {72, 40}, {64, 32}, {136, 264}, {256, 128}, {8, 8}, {200, 96}};
  std::vector<SweepCase> cases;
  Rng rng(20261125);
  for (int64_t E : {1, 8, 12, 128})
    for (int64_t K = 1; K <= std::min<int64_t>(8, E); ++K)
      for (Routing r : {Routing::Uniform, Routing::Sparse, Routing::OneSet}) {
        const auto& df = DFs[rng.randint(0, 7)];
        cases.push_back({E, K, df[0], df[1], Ts[rng.randint(0, 6)], r, uint64_t(cases.size()) + 1});
      }
  cases.push_back({8, 2, 128, 128, 1024, Routing::Sparse, 9001});
  cases.push_back({8, 2, 128, 128, 1024, Routing::Uniform, 9002});
  cases.push_back({128, 8, 2048, 768, 96, Routing::Sparse, 9003});
  return cases;
}

class CudaExpertsSweep : public ::testing::TestWithParam<SweepCase> {};

// The dispatch plan is exact; permute_fwd and the weighted permute's forward move or scale data the same
// way on both backends; the sums (permute_bwd, unpermute) agree within bf16 rounding.
TEST_P(CudaExpertsSweep, PlanAndPermutationsMatchCpu) {
  MT_REQUIRE_GPU();
  const SweepCase c = GetParam();
  const int64_t T = c.T, K = c.K, E = c.E, D = c.D, R = T * K;
  Rng rng(c.seed);
  for (int call = 0; call < 2; ++call) {  // the second call reuses the first's buffers
    SCOPED_TRACE("call " + std::to_string(call));
    const Tensor idx = make_topk(T, K, E, c.routing, rng);
    const Plan want = cpu_plan(idx, E);
    const Plan got = cuda_plan(idx, E);
    const Tensor &d_aor = got.assign_of_row, &d_roa = got.row_of_assign;
    expect_equal_ints<int64_t>(got.offsets, want.offsets, "offsets_E1");
    expect_equal_ints<int32_t>(d_aor, want.assign_of_row, "assign_of_row_R");
    expect_equal_ints<int32_t>(d_roa, want.row_of_assign, "row_of_assign_TK");
    ASSERT_FALSE(::testing::Test::HasFailure()) << "the permutations below use this plan";

    const Tensor x = rand_bf16_exact({T, D}, rng), dxp = rand_bf16_exact({R, D}, rng), yp = rand_bf16_exact({R, D}, rng),
                 dy = rand_bf16_exact({T, D}, rng), dx0 = rand_bf16_exact({T, D}, rng);
    Tensor w = Tensor::empty({T, K});
    rng.fill_uniform(w, 0.05f, 1.0f);
    const Tensor xc = to_cuda(x, DType::BF16), wc = to_cuda(w, DType::F32), dxpc = to_cuda(dxp, DType::BF16),
                 ypc = to_cuda(yp, DType::BF16);

    Tensor xp_want = Tensor::empty({R, D});
    cpu::permute_fwd(x, want.assign_of_row, K, xp_want);
    Guarded xp({R, D}, DType::BF16, kNaN);
    cuda::permute_fwd(xc, d_aor, K, xp.t);
    EXPECT_EQ(rel_l2(xp.t, xp_want), 0.0) << "permute_fwd";
    expect_margins(xp, "permute_fwd");

    Tensor dx_want = dx0.clone();
    cpu::permute_bwd(dxp, want.assign_of_row, K, dx_want);
    for (DType dxd : {DType::BF16, DType::F32}) {  // f32: the FFN norm's input gradient
      Guarded dx(dx0, dxd);
      cuda::permute_bwd(dxpc, d_aor, K, dx.t);
      EXPECT_LE(rel_l2(dx.t, dx_want), kTol) << "permute_bwd, dx " << dtype_name(dxd);
      expect_margins(dx, "permute_bwd");
    }

    Tensor y_want = Tensor::empty({T, D});
    cpu::unpermute_fwd(yp, want.row_of_assign, w, y_want);
    for (DType yd : {DType::F32, DType::BF16}) {
      Guarded y({T, D}, yd, kNaN);
      cuda::unpermute_fwd(ypc, d_roa, wc, y.t);
      EXPECT_LE(rel_l2(y.t, y_want), kTol) << "unpermute_fwd " << dtype_name(yd);
      expect_margins(y, "unpermute_fwd");
    }

    Tensor dyp_want = Tensor::empty({R, D}), dw_want = Tensor::empty({T, K});
    cpu::unpermute_bwd(dy, yp, want.row_of_assign, w, dyp_want, dw_want);
    Guarded dyp({R, D}, DType::BF16, kNaN), dw({T, K}, DType::F32, kNaN);
    cuda::unpermute_bwd(to_cuda(dy, DType::BF16), ypc, d_roa, wc, dyp.t, dw.t);
    EXPECT_LE(rel_l2(dyp.t, dyp_want), kTol) << "unpermute_bwd dyp";
    EXPECT_LE(rel_l2(dw.t, dw_want), kTol) << "unpermute_bwd dw";
    expect_margins(dyp, "unpermute_bwd dyp");
    expect_margins(dw, "unpermute_bwd dw");

    // The weighted permute of score_before_experts is the transpose pair of unpermute.
    Tensor xpw_want = Tensor::empty({R, D}), unused = Tensor::empty({T, K});
    cpu::unpermute_bwd(x, yp, want.row_of_assign, w, xpw_want, unused);
    Guarded xpw({R, D}, DType::BF16, kNaN);
    ops::permute_weighted_fwd(xc, d_roa, wc, xpw.t);
    EXPECT_LE(rel_l2(xpw.t, xpw_want), kTol) << "permute_weighted_fwd";
    expect_margins(xpw, "permute_weighted_fwd");
    Tensor dxw_want = Tensor::empty({T, D}), dww_want = Tensor::empty({T, K}), scratch = Tensor::empty({R, D});
    cpu::unpermute_fwd(dxp, want.row_of_assign, w, dxw_want);
    cpu::unpermute_bwd(x, dxp, want.row_of_assign, w, scratch, dww_want);
    Guarded dxw({T, D}, DType::BF16, kNaN), dww({T, K}, DType::F32, kNaN);
    ops::permute_weighted_bwd(dxpc, xc, d_roa, wc, dxw.t, dww.t);
    EXPECT_LE(rel_l2(dxw.t, dxw_want), kTol) << "permute_weighted_bwd dx";
    EXPECT_LE(rel_l2(dww.t, dww_want), kTol) << "permute_weighted_bwd dw";
    expect_margins(dxw, "permute_weighted_bwd dx");
    expect_margins(dww, "permute_weighted_bwd dw");
  }
}

enum class Impl { Grouped, Reference };

// The grouped experts form (experts_fwd / experts_bwd) through one implementation, two calls reusing
// the outputs: = then +=.
void run_grouped_form(const SweepCase& c, Impl impl) {
  const int64_t T = c.T, K = c.K, E = c.E, D = c.D, F = c.F, R = T * K;
  Rng rng(c.seed * 7919);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));
  const Tensor wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);
  Guarded gu({R, 2 * F}, DType::BF16, kNaN), h({R, F}, DType::BF16, kNaN), yp({R, D}, DType::BF16, kNaN),
      dxp({R, D}, DType::BF16, kNaN), dwgu({E, 2 * F, D}, DType::F32, kNaN), dwd({E, D, F}, DType::F32, kNaN);
  Tensor dwgu_want = Tensor::zeros({E, 2 * F, D}), dwd_want = Tensor::zeros({E, D, F});
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE(std::string(impl == Impl::Grouped ? "grouped" : "reference") + " call " + std::to_string(call));
    const bool acc = call == 1;
    const Plan plan = cpu_plan(make_topk(T, K, E, c.routing, rng), E);
    const Tensor doff = plan.offsets.to(Device::CUDA);
    const Tensor xp = rand_bf16_exact({R, D}, rng), dyp = rand_bf16_exact({R, D}, rng);
    const Tensor xpc = to_cuda(xp, DType::BF16), dypc = to_cuda(dyp, DType::BF16);

    Tensor gu_want = Tensor::empty({R, 2 * F}), h_want = Tensor::empty({R, F}), yp_want = Tensor::empty({R, D});
    cpu::experts_fwd(xp, plan.offsets, wgu, wd, gu_want, h_want, yp_want);
    if (impl == Impl::Grouped)
      cuda::experts_fwd_grouped(xpc, doff, wguc, wdc, gu.t, h.t, yp.t);
    else
      cuda::experts_fwd_reference(xpc, doff, wguc, wdc, gu.t, h.t, yp.t);
    expect_by_expert(gu.t, gu_want, plan.offsets, false, "gu");
    expect_by_expert(h.t, h_want, plan.offsets, false, "h");
    expect_by_expert(yp.t, yp_want, plan.offsets, false, "yp");

    Tensor dxp_want = Tensor::empty({R, D});
    cpu::experts_bwd(dyp, xp, plan.offsets, wgu, wd, gu_want, h_want, dxp_want, dwgu_want, dwd_want);  // +=
    int hooks = 0;
    if (impl == Impl::Grouped)
      cuda::experts_bwd_grouped(dypc, xpc, doff, wguc, wdc, gu.t, h.t, dxp.t, dwgu.t, dwd.t, acc, [&] { ++hooks; });
    else
      cuda::experts_bwd_reference(dypc, xpc, doff, wguc, wdc, gu.t, h.t, dxp.t, dwgu.t, dwd.t, acc);
    if (impl == Impl::Grouped) {
      EXPECT_EQ(hooks, 1) << "after_dx";
    }
    expect_by_expert(dxp.t, dxp_want, plan.offsets, false, "dxp");
    // The weight gradients of both calls added up: an expert empty in both must read exactly 0.
    expect_by_expert(dwgu.t, dwgu_want, plan.offsets, true, "dw_gate_up");
    expect_by_expert(dwd.t, dwd_want, plan.offsets, true, "dw_down");
    for (const Guarded* g : {&gu, &h, &yp, &dxp, &dwgu, &dwd}) expect_margins(*g, "an experts output");
  }
}

TEST_P(CudaExpertsSweep, GroupedPathMatchesCpu) {
  MT_REQUIRE_GPU();
  const SweepCase c = GetParam();
  if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM for this build and GPU";
  run_grouped_form(c, Impl::Grouped);
}

// The grouped path on the forward tile that the automatic choice does not take for this case
// (MOETRAIN_GROUPED_SMALL forces it), so both the 128x256 and the 64x256 tile meet every sweep shape.
TEST_P(CudaExpertsSweep, GroupedPathOtherTileMatchesCpu) {
  MT_REQUIRE_GPU();
  const SweepCase c = GetParam();
  if (!cuda::grouped_gemm_available()) GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM for this build and GPU";
  bool auto_small = false;
  {
    cudatest::EnvGuard automatic("MOETRAIN_GROUPED_SMALL", nullptr);
    auto_small = cuda::grouped_rows_tile(c.E, c.T * c.K, true) != cuda::RowsTile::large;
  }
  cudatest::EnvGuard forced("MOETRAIN_GROUPED_SMALL", auto_small ? "0" : "1");
  SCOPED_TRACE(std::string("forward tile forced: MOETRAIN_GROUPED_SMALL=") + (auto_small ? "0" : "1"));
  run_grouped_form(c, Impl::Grouped);
}

TEST_P(CudaExpertsSweep, ReferencePathMatchesCpu) {
  MT_REQUIRE_GPU();
  run_grouped_form(GetParam(), Impl::Reference);
}

// The composite reference form (plan, permute, experts, unpermute with per-call temporaries) against
// the CPU's plain loop over tokens; scalar fp64 on the CPU, so small products only.
TEST_P(CudaExpertsSweep, ReferenceFormMatchesCpu) {
  MT_REQUIRE_GPU();
  const SweepCase c = GetParam();
  const int64_t T = c.T, K = c.K, E = c.E, D = c.D, F = c.F;
  if (T * K * D * F > 4'000'000) GTEST_SKIP() << "the CPU reference form is scalar fp64; small products only";
  Rng rng(c.seed * 104729);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));
  const Tensor wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16);
  Guarded y({T, D}, DType::BF16, kNaN), dx({T, D}, DType::BF16, kNaN), dtw({T, K}, DType::F32, kNaN),
      dwgu({E, 2 * F, D}, DType::F32, kNaN), dwd({E, D, F}, DType::F32, kNaN);
  Tensor dwgu_want = Tensor::zeros(wgu.shape()), dwd_want = Tensor::zeros(wd.shape());
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    const Tensor idx = make_topk(T, K, E, c.routing, rng);
    const Plan plan = cpu_plan(idx, E);
    Tensor w = Tensor::empty({T, K});
    rng.fill_uniform(w, 0.05f, 1.0f);
    const Tensor x = rand_bf16_exact({T, D}, rng), dy = rand_bf16_exact({T, D}, rng);
    const Tensor xc = to_cuda(x, DType::BF16), idxc = idx.to(Device::CUDA), wc = to_cuda(w, DType::F32);
    Tensor y_want = Tensor::empty({T, D});
    cpu::experts_ref_fwd(x, idx, w, wgu, wd, y_want);
    cuda::experts_ref_fwd(xc, idxc, wc, wguc, wdc, y.t);
    EXPECT_LE(rel_l2(y.t, y_want), kTol) << "y";
    Tensor dx_want = Tensor::empty({T, D}), dtw_want = Tensor::empty({T, K});
    cpu::experts_ref_bwd(dy, x, idx, w, wgu, wd, dx_want, dtw_want, dwgu_want, dwd_want);  // +=
    cuda::experts_ref_bwd(to_cuda(dy, DType::BF16), xc, idxc, wc, wguc, wdc, dx.t, dtw.t, dwgu.t, dwd.t, call == 1);
    EXPECT_LE(rel_l2(dx.t, dx_want), kTol) << "dx";
    // dtopk_w[t, k] = <dy[t], yp[row]> cancels: one such dot product can be near 0 while the bf16
    // rounding of yp moves it by up to 2^-8 ||dy[t]|| ||yp[row]||, so each is held to that scale.
    Tensor xp_want = Tensor::empty({T * K, D}), gu_want = Tensor::empty({T * K, 2 * F}), h_want = Tensor::empty({T * K, F}),
           yp_want = Tensor::empty({T * K, D});
    cpu::permute_fwd(x, plan.assign_of_row, K, xp_want);
    cpu::experts_fwd(xp_want, plan.offsets, wgu, wd, gu_want, h_want, yp_want);
    const Tensor dtw_got = to_host_f32(dtw.t);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = plan.row_of_assign.data<int32_t>()[t * K + k];
        double ndy = 0, nyp = 0;
        for (int64_t i = 0; i < D; ++i) {
          ndy += double(dy.data<float>()[t * D + i]) * dy.data<float>()[t * D + i];
          nyp += double(yp_want.data<float>()[row * D + i]) * yp_want.data<float>()[row * D + i];
        }
        EXPECT_LE(std::abs(dtw_got.data<float>()[t * K + k] - dtw_want.data<float>()[t * K + k]),
                  kTol * std::sqrt(ndy * nyp))
            << "dtopk_w[" << t << ", " << k << "]";
      }
    expect_by_expert(dwgu.t, dwgu_want, plan.offsets, true, "dw_gate_up");
    expect_by_expert(dwd.t, dwd_want, plan.offsets, true, "dw_down");
    for (const Guarded* g : {&y, &dx, &dtw, &dwgu, &dwd}) expect_margins(*g, "a reference-form output");
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaExpertsSweep, ::testing::ValuesIn(sweep_cases()),
                         [](const auto& info) { return info.param.name(); });

// Widths that are not multiples of 8 cannot go through TMA: the grouped path refuses them naming D
// and F, and the dispatching op takes the reference path, which computes them.
TEST(CudaExpertsWidths, NotMultipleOfEightIsRefusedByGroupedAndComputedByTheOp) {
  MT_REQUIRE_GPU();
  const int64_t E = 8, K = 2, D = 60, F = 20, T = 33, R = T * K;
  Rng rng(77);
  const Plan plan = cpu_plan(make_topk(T, K, E, Routing::Sparse, rng), E);
  const Tensor xp = rand_bf16_exact({R, D}, rng), wgu = rand_bf16_exact({E, 2 * F, D}, rng, 0.1f),
               wd = rand_bf16_exact({E, D, F}, rng, 0.2f);
  const Tensor xpc = to_cuda(xp, DType::BF16), doff = plan.offsets.to(Device::CUDA), wguc = to_cuda(wgu, DType::BF16),
               wdc = to_cuda(wd, DType::BF16);
  Tensor gu = Tensor::empty({R, 2 * F}, DType::BF16, Device::CUDA), h = Tensor::empty({R, F}, DType::BF16, Device::CUDA),
         yp = Tensor::empty({R, D}, DType::BF16, Device::CUDA);
  if (cuda::grouped_gemm_available()) {
    try {
      cuda::experts_fwd_grouped(xpc, doff, wguc, wdc, gu, h, yp);
      ADD_FAILURE() << "the grouped path took D = 60, F = 20";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("D (60) and F (20) must be multiples of 8"), std::string::npos) << e.what();
    }
  }
  Tensor gu_want = Tensor::empty({R, 2 * F}), h_want = Tensor::empty({R, F}), yp_want = Tensor::empty({R, D});
  cpu::experts_fwd(xp, plan.offsets, wgu, wd, gu_want, h_want, yp_want);
  cuda::experts_fwd(xpc, doff, wguc, wdc, gu, h, yp);
  expect_by_expert(yp, yp_want, plan.offsets, false, "yp");
}

}  // namespace

#endif  // MT_HAVE_CUDA
