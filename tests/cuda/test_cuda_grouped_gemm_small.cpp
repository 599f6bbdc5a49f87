// The rows-grouped TN GEMM's small tiles (64x256 and 64x128 pingpong: grouped_gemm.cuh's RowsTile, the
// experts' forward at decode) against a CPU reference and against the large 128x256 tile, and the
// choice between them (R <= 64 * E, MOETRAIN_GROUPED_SMALL).
//
// Inputs are bf16-exact, so the CPU sees the same values; its f64 sums are the reference. Tolerance:
// 1e-2 relative L2 per expert (one bf16 rounding of C is ~1.5e-3; a wrong row range, column tile or
// transpose is of order 1), as test_cuda_grouped_gemm.cpp; small tile vs large tile: the same 1e-2
// (both accumulate in f32 over K in 64-wide steps with no split-K, so they are expected to agree to
// the last bit; the measured value is recorded as a test property). C sits inside a larger buffer
// whose margins hold a sentinel and its rows start as NaN: every row must be written, nothing past it.
// Row counts: every count from 0 to 64 once (one M tile or none), counts past 64 (several M tiles of
// the small tile) between runs of empty experts, every expert but the last empty; N and K not
// multiples of the tiles. The bench-4L decode shape (E 128, top-8 of 256 tokens: 16 rows per expert on
// average, uneven, one expert empty, D 2048, F 768) runs through experts_fwd_grouped with each tile
// forced by MOETRAIN_GROUPED_SMALL against cpu::experts_fwd.
#include <gtest/gtest.h>

#include <bit>

#ifdef MT_HAVE_CUDA

#include <cuda_runtime.h>

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
#include "core/cuda_graph.h"
#include "cuda_test_util.h"

namespace mt::cuda {
cudaStream_t stream();  // common.cuh, which holds device code, is not for plain C++
}

using namespace mt;
using cuda::RowsTile;
using cudatest::EnvGuard;
using cudatest::rand_bf16_exact;
using cudatest::rel_l2;
using cudatest::to_cuda;
using cudatest::to_host_f32;

namespace {

constexpr double kTol = 1e-2;
constexpr float kSentinel = 1536.0f;  // exact in bf16
constexpr int64_t kMargin = 256;      // bf16 elements before and after C (512 bytes: keeps C 16-byte aligned)

const __nv_bfloat16* bf16_ptr(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}

Tensor offsets_of(const std::vector<int64_t>& counts) {
  Tensor off = Tensor::empty({int64_t(counts.size()) + 1}, DType::I64);
  int64_t* p = off.data<int64_t>();
  p[0] = 0;
  for (size_t e = 0; e < counts.size(); ++e) p[e + 1] = p[e] + counts[e];
  return off;
}

// C[r, n] = sum_k A[r, k] * B_e[n, k] over expert e's rows, in f64.
Tensor cpu_rows_tn(const Tensor& a_RK, const Tensor& b_ENK, const Tensor& off) {
  const int64_t R = a_RK.size(0), K = a_RK.size(1), E = b_ENK.size(0), N = b_ENK.size(1);
  Tensor c = Tensor::empty({R, N});
  const float* a = a_RK.data<float>();
  const float* b = b_ENK.data<float>();
  float* o = c.data<float>();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off.data<int64_t>()[e]; r < off.data<int64_t>()[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(a[r * K + k]) * double(b[(e * N + n) * K + k]);
        o[r * N + n] = float(s);
      }
  return c;
}

// Relative L2 error of each expert's rows; the worst one is checked and named.
void expect_per_expert(const Tensor& got_RN, const Tensor& want_RN, const Tensor& off, const std::string& what) {
  const int64_t E = off.numel() - 1, N = want_RN.size(1);
  const Tensor got = to_host_f32(got_RN);
  double worst = 0;
  int64_t worst_e = -1;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off.data<int64_t>()[e], r1 = off.data<int64_t>()[e + 1];
    double num = 0, den = 0;
    for (int64_t i = r0 * N; i < r1 * N; ++i) {
      const double p = got.data<float>()[i], q = want_RN.data<float>()[i];
      if (!std::isfinite(p)) {
        num = INFINITY;
        break;
      }
      num += (p - q) * (p - q);
      den += q * q;
    }
    const double err = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
    if (!(err <= worst)) {
      worst = err;
      worst_e = e;
    }
  }
  ::testing::Test::RecordProperty("worst_expert_rel_l2_" + what, str(worst));
  EXPECT_LE(worst, kTol) << what << ": expert " << worst_e << " (of " << E << ")";
}

struct RowsCase {
  const char* name;
  std::vector<int64_t> counts;
  int64_t N, K;
};

std::vector<int64_t> counts_0_to_64() {
  std::vector<int64_t> c(65);
  std::iota(c.begin(), c.end(), 0);
  Rng rng(5);
  for (int64_t i = 64; i > 0; --i) std::swap(c[size_t(i)], c[size_t(rng.randint(0, i + 1))]);
  return c;
}

class CudaGroupedGemmSmall : public ::testing::TestWithParam<RowsCase> {};

TEST_P(CudaGroupedGemmSmall, RowsTilesMatchCpuAndLargeTile) {
  MT_REQUIRE_GROUPED();
  const RowsCase& c = GetParam();
  const int64_t E = int64_t(c.counts.size()), N = c.N, K = c.K;
  const Tensor off = offsets_of(c.counts);
  const int64_t R = off.data<int64_t>()[E];
  Rng rng(17 + uint64_t(E) + uint64_t(N));
  const Tensor a = rand_bf16_exact({R, K}, rng), b = rand_bf16_exact({E, N, K}, rng, 1.0f / std::sqrt(float(K)));
  const Tensor want = cpu_rows_tn(a, b, off);
  const Tensor ad = to_cuda(a, DType::BF16), bd = to_cuda(b, DType::BF16), offd = off.to(Device::CUDA);

  Tensor large;
  for (RowsTile tile : {RowsTile::large, RowsTile::m64n256, RowsTile::m64n128}) {
    const std::string name = cuda::rows_tile_name(tile);
    // [margin | C (R x N) | margin]: the margins hold the sentinel, C starts as NaN.
    Tensor buf_h = Tensor::empty({2 * kMargin + R * N});
    std::fill_n(buf_h.data<float>(), buf_h.numel(), kSentinel);
    std::fill_n(buf_h.data<float>() + kMargin, R * N, std::numeric_limits<float>::quiet_NaN());
    Tensor buf = to_cuda(buf_h, DType::BF16);
    __nv_bfloat16* cp = static_cast<__nv_bfloat16*>(buf.raw()) + kMargin;
    cuda::grouped_gemm_rows("test rows small", E, offd.data<int64_t>(), R, N, K, bf16_ptr(ad), bf16_ptr(bd), true, cp,
                            tile);
    const Tensor got_buf = to_host_f32(buf);
    int64_t margin_hits = 0;
    for (int64_t i = 0; i < kMargin; ++i)
      margin_hits +=
          (got_buf.data<float>()[i] != kSentinel) + (got_buf.data<float>()[kMargin + R * N + i] != kSentinel);
    EXPECT_EQ(margin_hits, 0) << name << ": wrote outside C";
    Tensor got = Tensor::empty({R, N});
    std::copy_n(got_buf.data<float>() + kMargin, R * N, got.data<float>());
    expect_per_expert(got, want, off, name);
    if (tile == RowsTile::large) {
      large = got;
    } else if (R > 0) {
      const double vs_large = rel_l2(got, large);
      ::testing::Test::RecordProperty("rel_l2_" + name + "_vs_large", str(vs_large));
      EXPECT_LE(vs_large, kTol) << name << " vs large";
      // Every tile sums each element over K in the same order (BK 64, wgmma k16 steps, no split): the same bits.
      int64_t bits = 0;
      for (int64_t i = 0; i < R * N; ++i)
        bits += std::bit_cast<uint32_t>(got.data<float>()[i]) != std::bit_cast<uint32_t>(large.data<float>()[i]);
      EXPECT_EQ(bits, 0) << name << " vs large: elements that differ in any bit, of " << R * N;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaGroupedGemmSmall,
    ::testing::Values(RowsCase{"counts_0_to_64", counts_0_to_64(), 264, 136},  // N, K tails of every tile
                      RowsCase{"uneven", {0, 0, 1, 63, 64, 65, 128, 130, 7, 0, 0, 200, 3}, 512, 256},
                      RowsCase{"only_last", {0, 0, 0, 0, 0, 0, 0, 5}, 64, 64},
                      RowsCase{"sixteen_each", std::vector<int64_t>(32, 16), 1536, 512}),
    [](const auto& info) { return std::string(info.param.name); });

// The bench-4L decode shape through the experts' forward with each tile forced, against the CPU op.
TEST(CudaGroupedGemmSmallDecode, ExpertsForwardAtBench4LDecodeShape) {
  MT_REQUIRE_GROUPED();
  const int64_t E = 128, K = 8, T = 256, D = 2048, F = 768, R = T * K;
  Rng rng(23);
  const Tensor off = cudatest::cpu_plan(cudatest::random_topk(T, K, E, rng, 77), E).offsets;
  ASSERT_EQ(off.data<int64_t>()[77], off.data<int64_t>()[78]);
  const Tensor xp = rand_bf16_exact({R, D}, rng);
  const Tensor wgu = rand_bf16_exact({E, 2 * F, D}, rng, 1.0f / std::sqrt(float(D)));
  const Tensor wd = rand_bf16_exact({E, D, F}, rng, 1.0f / std::sqrt(float(F)));
  Tensor gu_want = Tensor::empty({R, 2 * F}), h_want = Tensor::empty({R, F}), yp_want = Tensor::empty({R, D});
  cpu::experts_fwd(xp, off, wgu, wd, gu_want, h_want, yp_want);
  const Tensor xpc = to_cuda(xp, DType::BF16), wguc = to_cuda(wgu, DType::BF16), wdc = to_cuda(wd, DType::BF16),
               offd = off.to(Device::CUDA);
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", nullptr);
    EXPECT_EQ(cuda::grouped_rows_tile(E, R, true), RowsTile::m64n256) << "16 rows per expert must take a small tile";
  }
  Tensor yp_large;
  for (const char* forced : {"0", "1", "64x128", "auto"}) {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", forced);
    Tensor gu = Tensor::empty({R, 2 * F}, DType::BF16, Device::CUDA),
           h = Tensor::empty({R, F}, DType::BF16, Device::CUDA), yp = Tensor::empty({R, D}, DType::BF16, Device::CUDA);
    cuda::experts_fwd_grouped(xpc, offd, wguc, wdc, gu, h, yp);
    const std::string what = std::string("MOETRAIN_GROUPED_SMALL_") + forced;
    expect_per_expert(gu, gu_want, off, what + "_gu");
    expect_per_expert(yp, yp_want, off, what + "_yp");
    if (std::string(forced) == "0") {
      yp_large = to_host_f32(yp);
    } else {
      const double vs_large = rel_l2(yp, yp_large);
      ::testing::Test::RecordProperty("rel_l2_yp_" + what + "_vs_large", str(vs_large));
      EXPECT_LE(vs_large, kTol) << what;
    }
  }
}

// A small-tile call is captured into a CUDA graph (no host sync) and its replay equals the direct call.
TEST(CudaGroupedGemmSmallDecode, SmallTileCapturesIntoAGraph) {
  MT_REQUIRE_GROUPED();
  const int64_t E = 16, N = 256, K = 128;
  std::vector<int64_t> counts(size_t(E), 16);
  counts[3] = 0;
  counts[4] = 32;
  const Tensor off = offsets_of(counts);
  const int64_t R = off.data<int64_t>()[E];
  Rng rng(29);
  const Tensor a = to_cuda(rand_bf16_exact({R, K}, rng), DType::BF16);
  const Tensor b = to_cuda(rand_bf16_exact({E, N, K}, rng, 0.1f), DType::BF16);
  const Tensor offd = off.to(Device::CUDA);
  Tensor c = Tensor::empty({R, N}, DType::BF16, Device::CUDA);
  auto call = [&] {
    cuda::grouped_gemm_rows("test rows small graph", E, offd.data<int64_t>(), R, N, K, bf16_ptr(a), bf16_ptr(b), true,
                            static_cast<__nv_bfloat16*>(c.raw()), RowsTile::automatic);
  };
  EnvGuard env("MOETRAIN_GROUPED_SMALL", nullptr);
  ASSERT_EQ(cuda::grouped_rows_tile(E, R, true), RowsTile::m64n256);
  call();  // grows the scratch and initialises the kernel outside the capture
  const Tensor direct = to_host_f32(c);
  ASSERT_EQ(cudaMemset(c.raw(), 0xff, c.nbytes()), cudaSuccess);  // bf16 0xffff is a NaN
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cuda_graph::Graph g;
  std::string why;
  ASSERT_TRUE(g.capture(call, &why)) << "the small tile did something a stream capture refuses: " << why;
  g.replay();
  ASSERT_EQ(cudaStreamSynchronize(cuda::stream()), cudaSuccess);
  EXPECT_EQ(rel_l2(c, direct), 0.0);
}

// The choice: R <= 64 * E takes the small tile for TN, NN always large, the variable overrides TN
// only, and bad values / a small tile for NN are refused with what is allowed. Host code: no GPU needed.
TEST(CudaGroupedGemmSmallChoice, RowsPerExpertAndTheEnvironmentPickTheTile) {
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", nullptr);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 2048, true), RowsTile::m64n256);  // decode: 16 per expert
    EXPECT_EQ(cuda::grouped_rows_tile(128, 64 * 128, true), RowsTile::m64n256);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 64 * 128 + 1, true), RowsTile::large);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 32768, true), RowsTile::large);  // bench-4L training
    EXPECT_EQ(cuda::grouped_rows_tile(128, 2048, false), RowsTile::large);  // NN: the backward
    EXPECT_EQ(cuda::grouped_rows_tile(128, 0, true), RowsTile::m64n256);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 32768, true, RowsTile::m64n128), RowsTile::m64n128);
  }
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", "auto");
    EXPECT_EQ(cuda::grouped_rows_tile(8, 4096, true), RowsTile::large);
  }
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", "0");
    EXPECT_EQ(cuda::grouped_rows_tile(128, 2048, true), RowsTile::large);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 2048, true, RowsTile::m64n256), RowsTile::m64n256);  // explicit wins
  }
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", "1");
    EXPECT_EQ(cuda::grouped_rows_tile(128, 32768, true), RowsTile::m64n256);
    EXPECT_EQ(cuda::grouped_rows_tile(128, 32768, false), RowsTile::large);
  }
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", "64x128");
    EXPECT_EQ(cuda::grouped_rows_tile(128, 2048, true), RowsTile::m64n128);
  }
  {
    EnvGuard env("MOETRAIN_GROUPED_SMALL", "yes");
    try {
      cuda::grouped_rows_tile(128, 2048, true);
      ADD_FAILURE() << "MOETRAIN_GROUPED_SMALL=yes was accepted";
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("MOETRAIN_GROUPED_SMALL (yes) must be one of auto, 0"), std::string::npos) << msg;
    }
  }
  try {
    cuda::grouped_rows_tile(128, 2048, false, RowsTile::m64n128);
    ADD_FAILURE() << "a small tile was accepted for the NN product";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("m64n128 tile runs only the TN product"), std::string::npos) << msg;
  }
}

}  // namespace

#endif  // MT_HAVE_CUDA
