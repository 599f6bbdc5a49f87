// The batch-invariant kernels of invariant.cuh: the GEMM (bf16 on tensor cores through WMMA, f32 on CUDA cores),
// the training attention over attend_row_warp, and the log-probs over row_logprob.
//
// GEMM: a block of 128 threads computes a BM x BN tile of C from BK wide slices of A and B in shared memory, the
// next slices fetched into registers (16-byte loads where the rows allow, zeros past the edges) while the block
// computes on these. bf16: each warp holds FM x FN 16x16 fp32 accumulator fragments and runs one m16n16k16 MMA per
// fragment and 16 columns of K, in K order, none past K. f32: each thread holds 2 x 2 outputs (BM = BN = 32) and adds
// one fused multiply-add per k, in K order. Two bf16 tiles, 64 x 64 (BK 64) for many rows per group and 16 x 64
// (BK 128, more bytes in flight per block) for few (decode's experts); as the tile only decides which rows a block
// takes and how far ahead it loads, both give each element the same operations. Groups (the experts): block x
// numbers the tiles of all groups in group order, each block finds its group by walking the offsets (at most
// groups + M / BM blocks, the surplus exits). Blocks sharing B's columns are neighbours in launch order, so B's
// slice comes from HBM about once.
#include <mma.h>

#include <algorithm>
#include <climits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/invariant.cuh"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 128;
constexpr int kPad = 8;  // bf16 elements of padding per shared row (a multiple of 8: WMMA's ldm rule)

// The rows [r0, r1) of this block's tile, and its group g; false when the block has no tile.
template <int BM>
__device__ __forceinline__ bool tile_rows(int64_t M, const int64_t* __restrict__ offsets, int64_t groups, int64_t& r0,
                                          int64_t& r1, int64_t& g) {
  int64_t t = blockIdx.x;
  if (!offsets) {
    r0 = t * BM;
    r1 = min(r0 + BM, M);
    g = 0;
    return r0 < M;
  }
  for (g = 0; g < groups; ++g) {
    const int64_t a = offsets[g], b = offsets[g + 1], n = b > a ? (b - a + BM - 1) / BM : 0;
    if (t < n) {
      r0 = a + t * BM;
      r1 = min(r0 + BM, b);
      return true;
    }
    t -= n;
  }
  return false;
}

template <class T>
__device__ __forceinline__ float load_c(const void* c, int64_t i) {
  return to_f32(static_cast<const T*>(c)[i]);
}

// The epilogue of one element: alpha * acc (+ beta * C_src), explicitly rounded, written as C's dtype.
__device__ __forceinline__ void store_c(float acc, float alpha, float beta, const void* c_src, void* c, bool c_f32,
                                        int64_t i) {
  float v = alpha == 1.0f ? acc : __fmul_rn(alpha, acc);
  if (beta != 0.0f) {
    const float old = c_f32 ? load_c<float>(c_src, i) : load_c<bf16>(c_src, i);
    v = __fadd_rn(v, beta == 1.0f ? old : __fmul_rn(beta, old));
  }
  if (c_f32) static_cast<float*>(c)[i] = v;
  else static_cast<bf16*>(c)[i] = __float2bfloat16_rn(v);
}

// A ROWS x BK slice of a row-major bf16 matrix in registers, 16 bytes per piece: what a thread fetches for the next
// K step while the block computes on the current one (one slice in flight per thread, no barrier in between).
template <int ROWS, int BK>
struct Slice {
  static constexpr int kPieces = ROWS * (BK / 8), kPerThread = (kPieces + kThreads - 1) / kThreads;
  uint4 v[kPerThread];
};

// Fetches rows [row0, row0 + ROWS) x columns [k0, k0 + BK) of src (leading dim ld) into s; rows past rows_valid
// and columns past K are zeros. VEC: 16-byte loads where the 8 columns are inside K (rows 16-byte aligned).
template <int ROWS, int BK, bool VEC>
__device__ __forceinline__ void fetch(Slice<ROWS, BK>& s, const bf16* __restrict__ src, int64_t ld, int64_t row0,
                                      int64_t rows_valid, int64_t k0, int64_t K) {
#pragma unroll
  for (int i = 0; i < Slice<ROWS, BK>::kPerThread; ++i) {
    const int piece = threadIdx.x + i * kThreads;
    if (piece >= Slice<ROWS, BK>::kPieces) break;
    const int r = piece / (BK / 8), c = (piece % (BK / 8)) * 8;
    const int64_t gk = k0 + c;
    const bf16* p = src + (row0 + r) * ld + gk;
    if (VEC && r < rows_valid && gk + 8 <= K) {
      s.v[i] = *reinterpret_cast<const uint4*>(p);
    } else {
      __align__(16) bf16 e[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) e[k] = r < rows_valid && gk + k < K ? p[k] : __float2bfloat16_rn(0.0f);
      s.v[i] = *reinterpret_cast<const uint4*>(e);
    }
  }
}

template <int ROWS, int BK>
__device__ __forceinline__ void commit(bf16 (*dst)[BK + kPad], const Slice<ROWS, BK>& s) {
#pragma unroll
  for (int i = 0; i < Slice<ROWS, BK>::kPerThread; ++i) {
    const int piece = threadIdx.x + i * kThreads;
    if (piece >= Slice<ROWS, BK>::kPieces) break;
    *reinterpret_cast<uint4*>(&dst[piece / (BK / 8)][(piece % (BK / 8)) * 8]) = s.v[i];
  }
}

// The bf16 GEMM: a BM x BN tile per block of 4 warps, K in steps of BK through shared memory (the next step's
// slices fetched into registers during this step's MMAs). Every tile shape runs, for each C element, one 16x16x16
// MMA per 16 columns of K in order and none past K, so the shapes give the same bits.
template <int BM, int BN, int BK, int WARPS_M, bool VEC>
__global__ void __launch_bounds__(kThreads)
    gemm_bf16_kernel(int64_t M, int64_t N, int64_t K, const bf16* __restrict__ A, int64_t lda,
                     const bf16* __restrict__ B, int64_t ldb, int64_t b_stride, const int64_t* __restrict__ offsets,
                     int64_t groups, float alpha, float beta, const void* c_src, void* C, bool c_f32, int64_t ldc) {
  using namespace nvcuda;
  constexpr int WARPS_N = (kThreads / 32) / WARPS_M, FM = BM / (16 * WARPS_M), FN = BN / (16 * WARPS_N);
  static_assert(FM >= 1 && FN >= 1 && FM * 16 * WARPS_M == BM && FN * 16 * WARPS_N == BN, "tile shape");
  __shared__ __align__(128) bf16 As[BM][BK + kPad];
  __shared__ __align__(128) bf16 Bs[BN][BK + kPad];
  __shared__ __align__(128) float Cs[BM][BN + 4];
  int64_t r0, r1, g;
  if (!tile_rows<BM>(M, offsets, groups, r0, r1, g)) return;
  const int64_t n0 = int64_t(blockIdx.y) * BN, n_valid = min(int64_t(BN), N - n0);
  const bf16* Bg = B + g * b_stride;
  const int warp = threadIdx.x / 32, wm = warp % WARPS_M, wn = warp / WARPS_M;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  Slice<BM, BK> sa;
  Slice<BN, BK> sb;
  fetch<BM, BK, VEC>(sa, A, lda, r0, r1 - r0, 0, K);
  fetch<BN, BK, VEC>(sb, Bg, ldb, n0, n_valid, 0, K);
  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    commit<BM, BK>(As, sa);
    commit<BN, BK>(Bs, sb);
    __syncthreads();
    if (k0 + BK < K) {
      fetch<BM, BK, VEC>(sa, A, lda, r0, r1 - r0, k0 + BK, K);
      fetch<BN, BK, VEC>(sb, Bg, ldb, n0, n_valid, k0 + BK, K);
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      if (k0 + kk >= K) break;  // the same for the whole block
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[FN];
#pragma unroll
      for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &As[(wm * FM + i) * 16][kk], BK + kPad);
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], &Bs[(wn * FN + j) * 16][kk], BK + kPad);
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
      wmma::store_matrix_sync(&Cs[(wm * FM + i) * 16][(wn * FN + j) * 16], acc[i][j], BN + 4, wmma::mem_row_major);
  __syncthreads();
  for (int e = threadIdx.x; e < BM * BN; e += kThreads) {
    const int r = e / BN, c = e % BN;
    const int64_t gr = r0 + r, gc = n0 + c;
    if (gr < r1 && gc < N) store_c(Cs[r][c], alpha, beta, c_src, C, c_f32, gr * ldc + gc);
  }
}

constexpr int kF32Tile = 32;  // the f32 kernel's BM = BN = BK; 16 x 16 threads of 2 x 2 outputs

__global__ void __launch_bounds__(256)
    gemm_f32_kernel(int64_t M, int64_t N, int64_t K, const float* __restrict__ A, int64_t lda,
                    const float* __restrict__ B, int64_t ldb, int64_t b_stride, const int64_t* __restrict__ offsets,
                    int64_t groups, float alpha, float beta, const void* c_src, void* C, bool c_f32, int64_t ldc) {
  __shared__ float As[kF32Tile][kF32Tile + 1], Bs[kF32Tile][kF32Tile + 1];
  int64_t r0, r1, g;
  if (!tile_rows<kF32Tile>(M, offsets, groups, r0, r1, g)) return;
  const int64_t n0 = int64_t(blockIdx.y) * kF32Tile;
  const float* Bg = B + g * b_stride;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (int64_t k0 = 0; k0 < K; k0 += kF32Tile) {
    for (int e = threadIdx.x; e < kF32Tile * kF32Tile; e += 256) {
      const int r = e / kF32Tile, c = e % kF32Tile;
      const int64_t gk = k0 + c;
      As[r][c] = r0 + r < r1 && gk < K ? A[(r0 + r) * lda + gk] : 0.0f;
      Bs[r][c] = n0 + r < N && gk < K ? Bg[(n0 + r) * ldb + gk] : 0.0f;
    }
    __syncthreads();
    const int64_t kn = K - k0 < kF32Tile ? K - k0 : int64_t(kF32Tile);  // the zeros past K are not added: the same ops for any K
    for (int k = 0; k < kn; ++k)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[i][j] = __fmaf_rn(As[ty + 16 * i][k], Bs[tx + 16 * j][k], acc[i][j]);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t gr = r0 + ty + 16 * i, gc = n0 + tx + 16 * j;
      if (gr < r1 && gc < N) store_c(acc[i][j], alpha, beta, c_src, C, c_f32, gr * ldc + gc);
    }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int BM, int BN, int BK, int WARPS_M>
void launch_bf16(dim3 grid, bool vec, int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B,
                 int64_t ldb, int64_t b_stride, const int64_t* offsets, int64_t groups, float alpha, float beta,
                 const void* c_src, void* C, bool c_f32, int64_t ldc) {
  if (vec)
    gemm_bf16_kernel<BM, BN, BK, WARPS_M, true><<<grid, kThreads, 0, stream()>>>(M, N, K, A, lda, B, ldb, b_stride, offsets,
                                                                              groups, alpha, beta, c_src, C, c_f32, ldc);
  else
    gemm_bf16_kernel<BM, BN, BK, WARPS_M, false><<<grid, kThreads, 0, stream()>>>(
        M, N, K, A, lda, B, ldb, b_stride, offsets, groups, alpha, beta, c_src, C, c_f32, ldc);
}

}  // namespace

void invariant_gemm_nt(const char* op, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                       int64_t ldb, DType ab_dtype, float alpha, float beta, const void* C_src, void* C, DType c_dtype,
                       int64_t ldc, int64_t groups, const int64_t* offsets, int64_t b_group_stride) {
  MT_CHECK(ab_dtype == DType::BF16 || ab_dtype == DType::F32, op, ": batch-invariant GEMM operands must be bf16 or f32, got ",
           dtype_name(ab_dtype));
  MT_CHECK(c_dtype == DType::BF16 || c_dtype == DType::F32, op, ": batch-invariant GEMM output must be bf16 or f32, got ",
           dtype_name(c_dtype));
  MT_CHECK(groups >= 1 && (offsets || groups == 1), op, ": batch-invariant GEMM: ", groups, " groups ",
           offsets ? "with" : "without", " offsets");
  if (M == 0 || N == 0) return;
  MT_CHECK(lda >= K && ldb >= K && ldc >= N, op, ": batch-invariant GEMM C[", M, ", ", N, "] with K = ", K, ": lda ",
           lda, ", ldb ", ldb, ", ldc ", ldc, " (each must be at least its row)");
  if (!C_src) C_src = C;
  const bool c_f32 = c_dtype == DType::F32;
  if (ab_dtype == DType::F32) {
    const int64_t tiles = (M + kF32Tile - 1) / kF32Tile + (offsets ? groups : 0);
    const int64_t ny = (N + kF32Tile - 1) / kF32Tile;
    MT_CHECK(tiles <= INT_MAX && ny <= 65535, op, ": batch-invariant GEMM C[", M, ", ", N, "] exceeds the grid");
    gemm_f32_kernel<<<dim3(unsigned(tiles), unsigned(ny)), 256, 0, stream()>>>(
        M, N, K, static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, b_group_stride, offsets, groups,
        alpha, beta, C_src, C, c_f32, ldc);
    MT_CUDA_LAUNCH_CHECK(op);
    return;
  }
  const auto* a = static_cast<const bf16*>(A);
  const auto* b = static_cast<const bf16*>(B);
  const bool vec = aligned16(a) && aligned16(b) && lda % 8 == 0 && ldb % 8 == 0 && (!offsets || b_group_stride % 8 == 0);
  // Few rows per group (decode, or the experts' rows at decode): 16-row tiles; else 64 x 64.
  const bool small = M <= 32 * groups;
  const int64_t BM = small ? 16 : 64, BN = 64;
  const int64_t tiles = (M + BM - 1) / BM + (offsets ? groups : 0), ny = (N + BN - 1) / BN;
  MT_CHECK(tiles <= INT_MAX && ny <= 65535, op, ": batch-invariant GEMM C[", M, ", ", N, "] exceeds the grid");
  const dim3 grid{unsigned(tiles), unsigned(ny)};
  if (small)
    launch_bf16<16, 64, 128, 1>(grid, vec, M, N, K, a, lda, b, ldb, b_group_stride, offsets, groups, alpha, beta, C_src, C,
                           c_f32, ldc);
  else
    launch_bf16<64, 64, 64, 2>(grid, vec, M, N, K, a, lda, b, ldb, b_group_stride, offsets, groups, alpha, beta, C_src, C,
                           c_f32, ldc);
  MT_CUDA_LAUNCH_CHECK(op);
}

namespace {

constexpr int kAttnWarps = 4;

template <int PER_LANE>
__global__ void __launch_bounds__(32 * kAttnWarps)
    attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t T,
                     int64_t S, int64_t H, int64_t G, int64_t Hd, float scale, const int32_t* __restrict__ first,
                     bool lse_bhs, bf16* __restrict__ out, float* __restrict__ lse) {
  const int64_t item = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;  // (token, head)
  if (item >= T * H) return;
  const int64_t t = item / H, h = item - t * H, g = h / (H / G), b = t / S, i = t - b * S;
  const int64_t j0 = first ? int64_t(first[t]) : 0;
  const int64_t base = b * S + j0;
  const float l = attend_row_warp<PER_LANE>(q + item * Hd, i - j0 + 1, Hd, scale, k, v,
                                            [=](int64_t p) { return (base + p) * G + g; }, out + item * Hd);
  if (threadIdx.x % 32 == 0) lse[lse_bhs ? (b * H + h) * S + i : item] = l;
}

template <class L>
__global__ void __launch_bounds__(kRowLogprobThreads)
    logprobs_kernel(const float* __restrict__ x, int64_t ld, int64_t V, const L* __restrict__ labels,
                    float* __restrict__ logp) {
  const int64_t r = blockIdx.x, t = int64_t(labels[r]);
  if (t < 0 || t >= V) return;  // the whole block leaves: no barrier is split
  const float lp = row_logprob(x + r * ld, V, t);
  if (threadIdx.x == 0) logp[r] = lp;
}

template <class L>
void launch_logprobs(const float* x, int64_t ld, int64_t R, int64_t V, const L* labels, float* logp) {
  const char* op = "invariant_logprobs";
  if (R == 0) return;
  MT_CHECK(R <= INT_MAX, op, ": ", R, " rows exceed the grid");
  logprobs_kernel<L><<<unsigned(R), kRowLogprobThreads, 0, stream()>>>(x, ld, V, labels, logp);
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace

void invariant_logprobs(const float* x, int64_t ld, int64_t R, int64_t V, const int64_t* labels, float* logp) {
  launch_logprobs(x, ld, R, V, labels, logp);
}
void invariant_logprobs(const float* x, int64_t ld, int64_t R, int64_t V, const int32_t* labels, float* logp) {
  launch_logprobs(x, ld, R, V, labels, logp);
}

void invariant_attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                             Tensor& out_THHd, Tensor& lse_TH, const Tensor* doc_start_T, bool lse_bhs) {
  const char* op = "attention_fwd (batch-invariant)";
  const int64_t T = q_THHd.size(0), H = q_THHd.size(1), Hd = q_THHd.size(2), G = k_TGHd.size(1);
  MT_CHECK(T == B * S, op, ": ", T, " tokens for B = ", B, " rows of S = ", S);
  MT_CHECK(Hd >= 1 && Hd <= 256, op, ": head_dim ", Hd, " (1 to 256)");
  if (T == 0) return;
  const int32_t* first = nullptr;
  if (doc_start_T) {
    check_cuda(*doc_start_T, DType::I32, {T}, "attention_fwd doc_start_T");
    first = doc_start_T->data<int32_t>();
  }
  const float scale = float(1.0 / std::sqrt(double(Hd)));  // paged_attention_fwd's
  const unsigned grid = unsigned((T * H + kAttnWarps - 1) / kAttnWarps);
  const auto* q = static_cast<const bf16*>(q_THHd.raw());
  const auto* k = static_cast<const bf16*>(k_TGHd.raw());
  const auto* v = static_cast<const bf16*>(v_TGHd.raw());
  auto* out = static_cast<bf16*>(out_THHd.raw());
  float* lse = lse_TH.data<float>();
#define MT_INV_ATTN(PL) \
  attention_kernel<PL><<<grid, 32 * kAttnWarps, 0, stream()>>>(q, k, v, T, S, H, G, Hd, scale, first, lse_bhs, out, lse)
  const int64_t per_lane = (Hd + 31) / 32;
  if (per_lane == 1) MT_INV_ATTN(1);
  else if (per_lane == 2) MT_INV_ATTN(2);
  else if (per_lane <= 4) MT_INV_ATTN(4);
  else MT_INV_ATTN(8);
#undef MT_INV_ATTN
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
