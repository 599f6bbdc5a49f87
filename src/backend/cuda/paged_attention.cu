// CUDA paged KV cache. kv_cache_write: one thread per element.
// paged_attention_fwd, three kernels, picked by head dim (MOETRAIN_PAGED_ATTENTION=auto|serial|split|mma
// forces one; bench/paged_attention.cpp times them, bench/NOTES.md "tensor-core decode attention" has their numbers):
//  - tensor cores (head_dim 64 or 128; auto's choice there): a block of 4 warps per (token, up to 8 query
//    heads of one KV head, split of the positions). Scores^T = K q^T and out^T += V^T P^T on mma.sync
//    m16n8k16 (bf16 in, f32 accumulate), positions or head dims on the MMA's M and the 8 heads on its N, so
//    a group size of 8 (bench-4L) wastes no MMA lane. Keys and values go from global memory straight into
//    the MMA fragments (16-byte loads, the head dims visited in an order that makes each lane's loads its
//    fragments), each warp walking tiles of 16 positions with an online softmax, the next tile's keys in
//    flight while this tile's values are used; the warps are merged in shared memory, the splits (only when
//    the tokens leave multiprocessors idle) by the merge kernel. 128 registers, 4 blocks per SM.
//  - split-K (head_dim 16, 32, 64, 128, 256; auto's choice for 16, 32, 256): a block of 128 threads per
//    (token, group of HPC query heads sharing one KV head, split of the token's positions). The block walks its split in
//    chunks of 128 positions: each thread scores one position for the HPC heads (its key row read once
//    for all of them, its 16-byte loads issued together, q from shared memory), the chunk's maximum
//    per head updates a running maximum (the online softmax), and then each thread accumulates 8
//    output dims of a subset of the chunk's positions from the value rows (16-byte loads, four rows in
//    flight; the rows of one position are contiguous over the threads). The position subsets are
//    summed once at the end (shuffles, then shared memory). With one split the block writes the
//    output; with several it writes (max, sum, unnormalised output) and a second kernel merges the
//    splits. The split count is fixed by the launch (from the block table's width, not the positions,
//    which stay on the device): about 4 blocks per multiprocessor; a split beyond a token's position writes
//    an empty partial.
//  - serial (any other head_dim <= 256, and the reference in bench/): one warp per (token, query head)
//    walking the positions with an online softmax (attend_row_warp of invariant.cuh); also the kernel of the
//    batch-invariant mode (core/determinism.h), whose training attention calls the same row function.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/invariant.cuh"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 4;
constexpr int kMaxPerLane = 8;  // Hd <= 256; lanes past Hd idle (Hd not a multiple of 32)

__global__ void kv_write_kernel(const bf16* __restrict__ k, const bf16* __restrict__ v, const int32_t* __restrict__ slot,
                                int64_t N, int64_t row, bf16* __restrict__ kc, bf16* __restrict__ vc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * row; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / row, j = i - n * row, s = slot[n];
    kc[s * row + j] = k[i];
    vc[s * row + j] = v[i];
  }
}

// One warp per (token, query head), through attend_row_warp (invariant.cuh): the training attention of the
// batch-invariant mode runs the same function, so the two agree bit for bit.
template <int PER_LANE>
__global__ void paged_attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                       const bf16* __restrict__ vc, const int32_t* __restrict__ table, int64_t M,
                                       int64_t block_size, const int32_t* __restrict__ seq,
                                       const int32_t* __restrict__ pos, int64_t N, int64_t H, int64_t G, int64_t Hd,
                                       float scale, bf16* __restrict__ out) {
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // (token, head)
  if (item >= N * H) return;
  const int64_t n = item / H, h = item - n * H, g = h / (H / G);
  const int32_t* row = table + int64_t(seq[n]) * M;
  attend_row_warp<PER_LANE>(
      q + item * Hd, int64_t(pos[n]) + 1, Hd, scale, kc, vc,
      [=](int64_t p) { return (int64_t(row[p / block_size]) * block_size + p % block_size) * G + g; },
      out + item * Hd);
}


constexpr int kThreads = 128;  // split-K block
constexpr int kChunk = 128;    // positions per chunk: one per thread when scoring

// Eight bf16 (one 16-byte load) to floats.
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// grid (x: token × head group, y: split). Partials (splits > 1): acc [N, H, S, HD] f32, ml [N, H, S, 2].
template <int HPC, int HD>
__global__ void __launch_bounds__(kThreads)
    paged_attention_split_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                 const int32_t* __restrict__ table, int64_t M, int64_t block_size,
                                 const int32_t* __restrict__ seq, const int32_t* __restrict__ pos, int64_t H,
                                 int64_t G, float scale, int64_t span, bf16* __restrict__ out,
                                 float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr int kCols = HD / 8, kPlanes = kThreads / kCols;  // value layout: plane × 8-dim column
  constexpr int kWarpsPerBlock = kThreads / 32;
  static_assert(HD % 8 == 0 && kThreads % kCols == 0 && kCols <= 32, "head_dim: a multiple of 8 dividing 1024, <= 256");
  // The loop's q and weights, then (aliased) the per-warp sums of the value accumulators.
  constexpr int kLoopFloats = HPC * HD + HPC * kChunk, kRedFloats = kWarpsPerBlock * HPC * HD;
  __shared__ __align__(16) float smem[kLoopFloats > kRedFloats ? kLoopFloats : kRedFloats];
  __shared__ int64_t slot_s[kChunk];
  __shared__ float wmax_s[kWarpsPerBlock][HPC];
  __shared__ float l_s[kWarpsPerBlock][HPC];
  auto q_s = reinterpret_cast<float (*)[HD]>(smem);
  auto e_s = reinterpret_cast<float (*)[kChunk]>(smem + HPC * HD);
  auto red_s = reinterpret_cast<float (*)[HPC][HD]>(smem);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t groups = H / HPC, n = blockIdx.x / groups, h0 = (blockIdx.x % groups) * HPC;
  const int64_t g = h0 / (H / G), split = blockIdx.y, S = gridDim.y;
  const int64_t last = pos[n], begin = split * span, end = min(begin + span, last + 1);
  const int32_t* row = table + int64_t(seq[n]) * M;

  for (int i = tid; i < HPC * HD; i += kThreads)
    q_s[i / HD][i % HD] = __bfloat162float(q[(n * H + h0 + i / HD) * HD + i % HD]);
  const int plane = tid / kCols, col = tid % kCols;
  float m_run[HPC], l[HPC], acc[HPC][8];
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
    m_run[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }
  __syncthreads();

  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    // Scores: thread tid takes position c0 + tid; its key row's loads are issued together.
    const int64_t p = c0 + tid;
    float sc[HPC];
#pragma unroll
    for (int h = 0; h < HPC; ++h) sc[h] = 0.0f;
    if (p < end) {
      const int64_t slot = int64_t(row[p / block_size]) * block_size + p % block_size;
      slot_s[tid] = slot;
      const uint4* kp = reinterpret_cast<const uint4*>(kc + (slot * G + g) * HD);
      constexpr int kBatch = kCols < 16 ? kCols : 16;
#pragma unroll
      for (int jb = 0; jb < kCols; jb += kBatch) {
        uint4 kv[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) kv[j] = kp[jb + j];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          float kf[8];
          unpack8(kv[j], kf);
#pragma unroll
          for (int h = 0; h < HPC; ++h) {
            const float4 a = *reinterpret_cast<const float4*>(&q_s[h][8 * (jb + j)]);
            const float4 b = *reinterpret_cast<const float4*>(&q_s[h][8 * (jb + j) + 4]);
            sc[h] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] +
                     b.z * kf[6] + b.w * kf[7];
          }
        }
      }
    }
    // The chunk's maximum per head (a block reduction), the running maximum, the weights e = exp(s - m).
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      sc[h] = p < end ? sc[h] * scale : -INFINITY;
      float x = sc[h];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
      if (lane == 0) wmax_s[warp][h] = x;
    }
    __syncthreads();
    float corr[HPC];
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      float cm = wmax_s[0][h];
#pragma unroll
      for (int w = 1; w < kWarpsPerBlock; ++w) cm = fmaxf(cm, wmax_s[w][h]);
      const float mn = fmaxf(m_run[h], cm);  // finite: position c0 is in the split
      corr[h] = __expf(m_run[h] - mn);
      m_run[h] = mn;
      e_s[h][tid] = p < end ? __expf(sc[h] - mn) : 0.0f;
    }
    __syncthreads();
    // Values: plane `plane` takes positions c0 + plane, c0 + plane + kPlanes, ..., four rows' loads
    // in flight at a time; column `col` 8 dims.
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
      l[h] *= corr[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= corr[h];
    }
    const int cend = int(min(end - c0, int64_t(kChunk)));
    constexpr int kUnroll = 4;
    for (int j0 = plane; j0 < cend; j0 += kUnroll * kPlanes) {
      uint4 vv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * kPlanes;
        if (j < cend) vv[u] = *reinterpret_cast<const uint4*>(vc + (slot_s[j] * G + g) * HD + 8 * col);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * kPlanes;
        if (j >= cend) break;
        float vf[8];
        unpack8(vv[u], vf);
#pragma unroll
        for (int h = 0; h < HPC; ++h) {
          const float w = e_s[h][j];
          l[h] += w;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[h][i] += w * vf[i];
        }
      }
    }
    __syncthreads();  // e_s, slot_s and wmax_s are rewritten by the next chunk
  }

  // Sum the planes: within a warp by shuffles (the lanes of one column), then the warps in shared
  // memory (which the loop no longer uses).
#pragma unroll
  for (int h = 0; h < HPC; ++h) {
#pragma unroll
    for (int o = kCols; o < 32; o <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] += __shfl_xor_sync(0xffffffffu, acc[h][i], o);
    }
  }
  __syncthreads();
  if (lane < kCols) {
#pragma unroll
    for (int h = 0; h < HPC; ++h) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red_s[warp][h][8 * col + i] = acc[h][i];
      if (col == 0) l_s[warp][h] = l[h];
    }
  }
  __syncthreads();
  for (int i = tid; i < HPC * HD; i += kThreads) {
    const int h = i / HD, d = i % HD;
    float a = 0.0f, ls = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      a += red_s[w][h][d];
      ls += l_s[w][h];
    }
    const int64_t nh = n * H + h0 + h;
    if (S == 1) {
      out[nh * HD + d] = __float2bfloat16_rn(a / ls);
    } else {
      part_acc[(nh * S + split) * HD + d] = a;  // an empty split (begin > last) writes 0, m -inf, l 0
      if (d == 0) {
        part_ml[(nh * S + split) * 2] = m_run[h];
        part_ml[(nh * S + split) * 2 + 1] = ls;
      }
    }
  }
}

// grid N × H, block HD threads (<= 256): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
__global__ void paged_attention_merge_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                             int64_t S, int64_t HD, bf16* __restrict__ out) {
  const int64_t nh = blockIdx.x;
  const float* ml = part_ml + nh * S * 2;
  float M = -INFINITY;
  for (int64_t s = 0; s < S; ++s) M = fmaxf(M, ml[2 * s]);
  float a = 0.0f, L = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    if (ml[2 * s] == -INFINITY) continue;  // empty split
    const float w = __expf(ml[2 * s] - M);
    L += w * ml[2 * s + 1];
    a += w * part_acc[(nh * S + s) * HD + threadIdx.x];
  }
  out[nh * HD + threadIdx.x] = __float2bfloat16_rn(a / L);
}

// ---- The tensor-core kernel (mma.sync m16n8k16, bf16 in, f32 accumulate) ----
// A block of kMmaWarps warps per (token, up to 8 query heads of one KV head, split). Each warp takes
// tiles of 16 positions (tile i of the split goes to warp i % kMmaWarps) and keeps its own online
// softmax; the block merges its warps at the end. Both products put the positions or head dims on the
// MMA's M side and the (up to) 8 query heads on its N side, so no lane of the MMA is wasted at a group
// size of 8:
//   scores^T [16 pos, 8 heads] = K [16 pos, Hd] · q^T [Hd, 8 heads]   (HD / 16 MMAs)
//   out^T [Hd, 8 heads]       += V^T [Hd, 16 pos] · P^T [16 pos, 8 heads]   (HD / 16 MMAs)
// Operands come straight from global memory into registers, 16 bytes per load, in layouts chosen so
// that no shuffle or shared memory is needed: a dot product may visit the head dims in any order (the
// same for q and K), so lane (g, t) loads 16-byte chunk 4r + t of key rows g and g + 8 and of q's head g
// (r = 0..HD/32-1), which is exactly its A and B fragments of k-steps 2r and 2r + 1 under that order.
// Values: lane (g, t) loads chunks g + 8i (i < HD/64) of value rows 2t, 2t+1, 2t+8, 2t+9 and pairs the
// rows' bf16 with byte permutes into the A fragments of V^T (each M-tile j then covers head dims
// 64(j/4) + 8g + 2(j%4) and + 1, which is where its output goes). The scores' C fragment becomes the B
// fragment of P^T by one movmatrix (an 8×8 transpose in registers) per 8 positions.
// Pipelining: K of the next tile is loaded while this tile's softmax and PV run, V of this tile while its
// scores are computed (so every warp has ~8 KB in flight); the block-table entry of the next tile is read
// before waiting on this tile's K. Positions past the end of the split or the sequence load the last valid
// row (never an unwritten slot) and get weight 0.
constexpr int kMmaWarps = 4;
constexpr int kMmaTile = 16;   // positions per warp iteration (the scores' M)
constexpr int kMmaHeads = 8;   // query heads per block (the MMA's N)
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 8×8 bf16 matrix held one row pair per lane (lane 4r + c: row r, columns 2c, 2c + 1), transposed.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t word(const uint4& u, int w) {
  return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}

// grid (x: token × KV head × head block of 8, y: split). Partials (splits > 1) as the split-K kernel's:
// acc [N, H, S, HD] f32 (unnormalised), ml [N, H, S, 2] (max in natural-log units, sum).
template <int HD>
__global__ void __launch_bounds__(kMmaWarps * 32, 4)  // 4 blocks per SM: 128 registers
    paged_attention_mma_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                               const int32_t* __restrict__ table, int64_t M, int block_size,
                               const int32_t* __restrict__ seq, const int32_t* __restrict__ pos, int64_t H, int64_t G,
                               float scale_log2, int64_t span, bf16* __restrict__ out, float* __restrict__ part_acc,
                               float* __restrict__ part_ml) {
  constexpr int kRounds = HD / 32, kVChunks = HD / 64, kMTiles = HD / 16;
  static_assert(HD % 64 == 0, "head_dim: a multiple of 64");
  // + 32: a row is 64 bytes past a multiple of 128, so the 8 lanes of one 16-byte load phase hit distinct banks
  __shared__ __align__(16) bf16 q_s[kMmaHeads][HD + 32];
  __shared__ float o_s[kMmaWarps][kMmaHeads][HD + 1];  // + 1: the fragment stores spread over banks
  __shared__ float m_s[kMmaWarps][kMmaHeads], l_s[kMmaWarps][kMmaHeads];

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gi = lane / 4, ti = lane % 4;
  const int64_t gq = H / G, per_kv = (gq + kMmaHeads - 1) / kMmaHeads;
  const int64_t n = blockIdx.x / (G * per_kv), rest = blockIdx.x % (G * per_kv), g = rest / per_kv;
  const int64_t h0 = g * gq + (rest % per_kv) * kMmaHeads;
  const int nh = int(min(int64_t(kMmaHeads), g * gq + gq - h0));  // real heads in this block
  const int64_t split = blockIdx.y, S = gridDim.y;
  const int last = pos[n], begin = int(split * span), end = int(min(int64_t(begin) + span, int64_t(last) + 1));
  const int32_t* trow = table + int64_t(seq[n]) * M;
  const int64_t stride = G * HD;  // elements from one slot to the next
  const bf16* kbase = kc + g * HD;
  const bf16* vbase = vc + g * HD;

  // q in shared memory (zero rows for padding heads), read per k-step: registers are what limits the
  // blocks per multiprocessor.
  for (int i = threadIdx.x; i < kMmaHeads * HD / 8; i += kMmaWarps * 32) {
    const int h = i / (HD / 8), c = i % (HD / 8);
    *reinterpret_cast<uint4*>(&q_s[h][8 * c]) =
        h < nh ? __ldg(reinterpret_cast<const uint4*>(q + (n * H + h0 + h) * HD + 8 * c)) : make_uint4(0, 0, 0, 0);
  }
  __syncthreads();
  float o[kMTiles][4];
#pragma unroll
  for (int j = 0; j < kMTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // heads 2t and 2t + 1

  // Lane l's slot: position tile + l % 16, clamped to the last valid one.
  auto slot_of = [&](int tile) -> int32_t {
    const int p = min(tile + (lane & 15), end - 1);
    return trow[p / block_size] * block_size + p % block_size;
  };
  auto load_k = [&](int32_t slot, uint4 (&kf)[kRounds][2]) {
    const bf16* ka = kbase + int64_t(__shfl_sync(0xffffffffu, slot, gi)) * stride;
    const bf16* kb = kbase + int64_t(__shfl_sync(0xffffffffu, slot, gi + 8)) * stride;
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      kf[r][0] = __ldg(reinterpret_cast<const uint4*>(ka + 8 * (4 * r + ti)));
      kf[r][1] = __ldg(reinterpret_cast<const uint4*>(kb + 8 * (4 * r + ti)));
    }
  };

  int t0 = begin + warp * kMmaTile;
  uint4 kf[kRounds][2];
  int32_t slot = 0;
  if (t0 < end) {
    slot = slot_of(t0);
    load_k(slot, kf);
  }
  for (; t0 < end; t0 += kMmaWarps * kMmaTile) {
    uint4 vf[4][kVChunks];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * ti + (i & 1) + 8 * (i >> 1);
      const bf16* vp = vbase + int64_t(__shfl_sync(0xffffffffu, slot, row)) * stride;
#pragma unroll
      for (int c = 0; c < kVChunks; ++c) vf[i][c] = __ldg(reinterpret_cast<const uint4*>(vp + 8 * (gi + 8 * c)));
    }
    const int t1 = t0 + kMmaWarps * kMmaTile;
    const int32_t slot_next = t1 < end ? slot_of(t1) : 0;

    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // scores^T: (position gi, heads 2t, 2t+1), (gi + 8, same)
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const uint4 qv = *reinterpret_cast<const uint4*>(&q_s[gi][8 * (4 * r + ti)]);
      mma_16816(s, kf[r][0].x, kf[r][1].x, kf[r][0].y, kf[r][1].y, qv.x, qv.y);
      mma_16816(s, kf[r][0].z, kf[r][1].z, kf[r][0].w, kf[r][1].w, qv.z, qv.w);
    }
    if (t1 < end) load_k(slot_next, kf);

    // Online softmax in base 2; heads 2t and 2t + 1 of this lane, reduced over the 8 lanes of a column.
    const bool va = t0 + gi < end, vb = t0 + gi + 8 < end;
    const float s0 = va ? s[0] * scale_log2 : -INFINITY, s1 = va ? s[1] * scale_log2 : -INFINITY;
    const float s2 = vb ? s[2] * scale_log2 : -INFINITY, s3 = vb ? s[3] * scale_log2 : -INFINITY;
    float x0 = fmaxf(s0, s2), x1 = fmaxf(s1, s3);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    const float mn0 = fmaxf(m0, x0), mn1 = fmaxf(m1, x1);  // finite: position t0 is valid
    const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = exp2f(s0 - mn0), p1 = exp2f(s1 - mn1), p2 = exp2f(s2 - mn0), p3 = exp2f(s3 - mn1);
    l0 = l0 * c0 + p0 + p2;
    l1 = l1 * c1 + p1 + p3;
    const uint32_t b0 = transpose8x8(pack_bf16(p0, p1)), b1 = transpose8x8(pack_bf16(p2, p3));
#pragma unroll
    for (int j = 0; j < kMTiles; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c1;
      o[j][2] *= c0;
      o[j][3] *= c1;
      const int c = j / 4, w = j % 4;
      const uint32_t w0 = word(vf[0][c], w), w1 = word(vf[1][c], w), w2 = word(vf[2][c], w), w3 = word(vf[3][c], w);
      mma_16816(o[j], __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632), __byte_perm(w2, w3, 0x5410),
                __byte_perm(w2, w3, 0x7632), b0, b1);
    }
    slot = slot_next;
  }

  // The warps' (max, sum, output) merged through shared memory.
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  if (gi == 0) {
    m_s[warp][2 * ti] = m0;
    m_s[warp][2 * ti + 1] = m1;
    l_s[warp][2 * ti] = l0;
    l_s[warp][2 * ti + 1] = l1;
  }
#pragma unroll
  for (int j = 0; j < kMTiles; ++j) {
    const int d = 64 * (j / 4) + 8 * gi + 2 * (j % 4);
    o_s[warp][2 * ti][d] = o[j][0];
    o_s[warp][2 * ti + 1][d] = o[j][1];
    o_s[warp][2 * ti][d + 1] = o[j][2];
    o_s[warp][2 * ti + 1][d + 1] = o[j][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * HD; i += kMmaWarps * 32) {
    const int h = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) mx = fmaxf(mx, m_s[w][h]);
    float a = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w)
      if (m_s[w][h] != -INFINITY) {  // a warp without positions
        const float e = exp2f(m_s[w][h] - mx);
        a += e * o_s[w][h][d];
        l += e * l_s[w][h];
      }
    const int64_t nhi = n * H + h0 + h;
    if (S == 1) {
      out[nhi * HD + d] = __float2bfloat16_rn(a / l);
    } else {
      part_acc[(nhi * S + split) * HD + d] = a;  // an empty split writes 0, m -inf, l 0
      if (d == 0) {
        part_ml[(nhi * S + split) * 2] = mx == -INFINITY ? -INFINITY : mx * kLn2;
        part_ml[(nhi * S + split) * 2 + 1] = l;
      }
    }
  }
}

}  // namespace

void kv_cache_write(const Tensor& k_NGD, const Tensor& v_NGD, const Tensor& slot_N, Tensor& k_cache_SGD,
                    Tensor& v_cache_SGD) {
  const char* op = "kv_cache_write";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k_NGD, &v_NGD, &k_cache_SGD, &v_cache_SGD}) check_cuda(*t, DType::BF16, op);
  check_cuda(slot_N, DType::I32, op);
  const int64_t N = k_NGD.size(0), row = k_NGD.size(1) * k_NGD.size(2);
  if (N == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>((N * row + 255) / 256, 65535));
  kv_write_kernel<<<grid, 256, 0, stream()>>>(static_cast<const bf16*>(k_NGD.raw()), static_cast<const bf16*>(v_NGD.raw()),
                                              slot_N.data<int32_t>(), N, row, static_cast<bf16*>(k_cache_SGD.raw()),
                                              static_cast<bf16*>(v_cache_SGD.raw()));
  MT_CUDA_LAUNCH_CHECK(op);
}

namespace {

enum class PagedKernel { automatic, serial, split, mma };

// MOETRAIN_PAGED_ATTENTION (auto | serial | split | mma), read at every call so a test or a benchmark
// can switch kernels.
PagedKernel paged_kernel_from_env() {
  const char* e = std::getenv("MOETRAIN_PAGED_ATTENTION");
  const std::string m = e ? e : "";
  if (m.empty() || m == "auto") return PagedKernel::automatic;
  if (m == "serial") return PagedKernel::serial;
  if (m == "split") return PagedKernel::split;
  if (m == "mma") return PagedKernel::mma;
  MT_THROW("MOETRAIN_PAGED_ATTENTION (", m, ") must be one of auto, serial, split, mma");
}

bool split_supported(int64_t Hd) { return Hd == 16 || Hd == 32 || Hd == 64 || Hd == 128 || Hd == 256; }
bool mma_supported(int64_t Hd) { return Hd == 64 || Hd == 128; }

int multiprocessors(const char* op) {
  static const int sms = [op] {
    int dev = 0, count = 0;
    MT_CUDA_CHECK(op, cudaGetDevice(&dev));
    MT_CUDA_CHECK(op, cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return sms;
}

// Splits of the positions for `blocks` blocks of `per_sm` resident per multiprocessor: one unless the
// blocks leave multiprocessors idle, then enough for about one full wave, each split a multiple of
// `granule` positions and at most 64 splits; MOETRAIN_PAGED_SPLITS (1 to 64) forces the count, for
// tuning (at most one split per granule). Taken from the block table's width (positions up to
// width × block_size), never from the positions, which stay on the device: a CUDA graph captured
// once is right for every step. Returns {splits, span of a split}.
std::pair<int64_t, int64_t> choose_splits(int64_t blocks, int64_t per_sm, int64_t width_positions, int64_t granule,
                                          const char* op) {
  const int64_t target = int64_t(multiprocessors(op)) * per_sm;
  const int64_t chunks = std::max<int64_t>(1, (width_positions + granule - 1) / granule);
  int64_t S = blocks >= target ? 1 : std::min<int64_t>({chunks, (target + blocks - 1) / blocks, 64});
  if (const char* e = std::getenv("MOETRAIN_PAGED_SPLITS"); e && *e) {
    char* tail = nullptr;
    const long v = std::strtol(e, &tail, 10);
    if (*tail != '\0' || v < 1 || v > 64) MT_THROW("MOETRAIN_PAGED_SPLITS (", e, ") must be an integer from 1 to 64");
    S = std::min<int64_t>(v, chunks);
  }
  const int64_t span = (chunks + S - 1) / S * granule;
  S = (chunks * granule + span - 1) / span;
  return {S, span};
}

template <int HD>
void launch_mma(int64_t N, const bf16* q, const bf16* kc, const bf16* vc, const int32_t* table, int64_t M,
                int64_t bs, const int32_t* seq, const int32_t* pos, int64_t H, int64_t G, float scale, bf16* out,
                const char* op) {
  static const int per_sm = [op] {
    int b = 0;
    MT_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, paged_attention_mma_kernel<HD>,
                                                                    kMmaWarps * 32, 0));
    return std::max(b, 1);
  }();
  const int64_t per_kv = (H / G + kMmaHeads - 1) / kMmaHeads, blocks = N * G * per_kv;
  MT_CHECK(blocks <= INT_MAX, op, ": ", N, " tokens x ", G * per_kv, " head blocks exceed the grid");
  MT_CHECK(M * bs <= INT_MAX, op, ": block table width ", M, " x block size ", bs, " exceeds 2^31 positions");
  const auto [S, span] = choose_splits(blocks, per_sm, M * bs, int64_t(kMmaWarps) * kMmaTile, op);
  float *acc = nullptr, *ml = nullptr;
  if (S > 1) {
    static DeviceScratch acc_buf, ml_buf;
    acc = acc_buf.as<float>(N * H * S * HD, op);
    ml = ml_buf.as<float>(N * H * S * 2, op);
  }
  paged_attention_mma_kernel<HD><<<dim3{unsigned(blocks), unsigned(S)}, kMmaWarps * 32, 0, stream()>>>(
      q, kc, vc, table, M, int(bs), seq, pos, H, G, scale * kLog2e, span, out, acc, ml);
  MT_CUDA_LAUNCH_CHECK(op);
  if (S > 1) {
    MT_CHECK(N * H <= INT_MAX, op, ": ", N * H, " (token, head) pairs exceed the grid");
    paged_attention_merge_kernel<<<unsigned(N * H), unsigned(HD), 0, stream()>>>(acc, ml, S, HD, out);
    MT_CUDA_LAUNCH_CHECK(op);
  }
}

// Query heads per block: the largest of 8, 4, 2, 1 dividing the group size H / G, at most
// MOETRAIN_PAGED_HEADS_PER_BLOCK when set (1, 2, 4 or 8: fewer heads, fewer registers, more blocks).
int heads_per_block(int64_t H, int64_t G) {
  const char* e = std::getenv("MOETRAIN_PAGED_HEADS_PER_BLOCK");
  const int cap = e ? std::atoi(e) : 8;
  if (cap != 1 && cap != 2 && cap != 4 && cap != 8)
    MT_THROW("MOETRAIN_PAGED_HEADS_PER_BLOCK (", e, ") must be 1, 2, 4 or 8");
  const int64_t gq = H / G;
  for (int h : {8, 4, 2})
    if (h <= cap && gq % h == 0) return h;
  return 1;
}

template <int HPC>
void launch_split(dim3 grid, const bf16* q, const bf16* kc, const bf16* vc, const int32_t* table, int64_t M,
                  int64_t bs, const int32_t* seq, const int32_t* pos, int64_t H, int64_t G, int64_t Hd, float scale,
                  int64_t span, bf16* out, float* acc, float* ml) {
#define MT_SPLIT(HD)                                                                                              \
  paged_attention_split_kernel<HPC, HD><<<grid, kThreads, 0, stream()>>>(q, kc, vc, table, M, bs, seq, pos, H, G, \
                                                                         scale, span, out, acc, ml)
  switch (Hd) {
    case 16: MT_SPLIT(16); break;
    case 32: MT_SPLIT(32); break;
    case 64: MT_SPLIT(64); break;
    case 128: MT_SPLIT(128); break;
    default: MT_SPLIT(256); break;
  }
#undef MT_SPLIT
}

}  // namespace

void paged_attention_fwd(const Tensor& q_NHD, const Tensor& k_cache_SGD, const Tensor& v_cache_SGD,
                         const Tensor& block_table_BM, int64_t block_size, const Tensor& seq_N, const Tensor& pos_N,
                         Tensor& out_NHD) {
  const char* op = "paged_attention_fwd";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&q_NHD, &k_cache_SGD, &v_cache_SGD, &out_NHD}) check_cuda(*t, DType::BF16, op);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&block_table_BM, &seq_N, &pos_N}) check_cuda(*t, DType::I32, op);
  const int64_t N = q_NHD.size(0), H = q_NHD.size(1), Hd = q_NHD.size(2), G = k_cache_SGD.size(1);
  if (Hd < 1 || Hd > 32 * kMaxPerLane)
    MT_THROW(op, ": head_dim ", Hd, " is not supported by the CUDA kernel (1 to ", 32 * kMaxPerLane, ")");
  // The batch-invariant mode (invariant.cuh) takes the serial kernel: no split of a token's positions, whatever
  // the batch, and the training attention's own row function.
  const PagedKernel asked = paged_kernel_from_env();  // checked in either mode
  const PagedKernel which = batch_invariant() ? PagedKernel::serial : asked;
  if (which == PagedKernel::split && !split_supported(Hd))
    MT_THROW(op, ": MOETRAIN_PAGED_ATTENTION=split but head_dim ", Hd, " is not one of 16, 32, 64, 128, 256");
  if (which == PagedKernel::mma && !mma_supported(Hd))
    MT_THROW(op, ": MOETRAIN_PAGED_ATTENTION=mma but head_dim ", Hd, " is not 64 or 128");
  if (N == 0) return;
  const float scale = float(1.0 / std::sqrt(double(Hd)));
  const auto* q = static_cast<const bf16*>(q_NHD.raw());
  const auto* kc = static_cast<const bf16*>(k_cache_SGD.raw());
  const auto* vc = static_cast<const bf16*>(v_cache_SGD.raw());
  auto* out = static_cast<bf16*>(out_NHD.raw());
  const int64_t M = block_table_BM.size(1);
  if ((which == PagedKernel::automatic || which == PagedKernel::mma) && mma_supported(Hd)) {
    const int32_t *table = block_table_BM.data<int32_t>(), *seq = seq_N.data<int32_t>(), *pos = pos_N.data<int32_t>();
    if (Hd == 64) launch_mma<64>(N, q, kc, vc, table, M, block_size, seq, pos, H, G, scale, out, op);
    else launch_mma<128>(N, q, kc, vc, table, M, block_size, seq, pos, H, G, scale, out, op);
    return;
  }
  if (which != PagedKernel::serial && split_supported(Hd)) {
    // Splits: at least 4 blocks per multiprocessor in all (up to 16 KB of shared memory and 128
    // threads each, several fit at once), a split at least one chunk; the block table's width bounds
    // the positions.
    const int hpc = heads_per_block(H, G);
    const int64_t blocks = N * (H / hpc);
    const auto [S, span] = choose_splits(blocks, 4, M * block_size, kChunk, op);
    MT_CHECK(blocks <= INT_MAX, op, ": ", N, " tokens x ", H / hpc, " head groups exceed the grid");
    float *acc = nullptr, *ml = nullptr;
    if (S > 1) {
      static DeviceScratch acc_buf, ml_buf;
      acc = acc_buf.as<float>(N * H * S * Hd, op);
      ml = ml_buf.as<float>(N * H * S * 2, op);
    }
    const dim3 grid{unsigned(blocks), unsigned(S)};
    const int32_t *table = block_table_BM.data<int32_t>(), *seq = seq_N.data<int32_t>(), *pos = pos_N.data<int32_t>();
    switch (hpc) {
      case 8: launch_split<8>(grid, q, kc, vc, table, M, block_size, seq, pos, H, G, Hd, scale, span, out, acc, ml); break;
      case 4: launch_split<4>(grid, q, kc, vc, table, M, block_size, seq, pos, H, G, Hd, scale, span, out, acc, ml); break;
      case 2: launch_split<2>(grid, q, kc, vc, table, M, block_size, seq, pos, H, G, Hd, scale, span, out, acc, ml); break;
      default: launch_split<1>(grid, q, kc, vc, table, M, block_size, seq, pos, H, G, Hd, scale, span, out, acc, ml); break;
    }
    MT_CUDA_LAUNCH_CHECK(op);
    if (S > 1) {
      MT_CHECK(N * H <= INT_MAX, op, ": ", N * H, " (token, head) pairs exceed the grid");
      paged_attention_merge_kernel<<<unsigned(N * H), unsigned(Hd), 0, stream()>>>(acc, ml, S, Hd, out);
      MT_CUDA_LAUNCH_CHECK(op);
    }
    return;
  }
  const unsigned grid = unsigned((N * H + kWarps - 1) / kWarps);
#define MT_PAGED(PL)                                                                                               \
  paged_attention_kernel<PL><<<grid, 32 * kWarps, 0, stream()>>>(q, kc, vc, block_table_BM.data<int32_t>(), M,     \
                                                                 block_size, seq_N.data<int32_t>(),                \
                                                                 pos_N.data<int32_t>(), N, H, G, Hd, scale, out)
  const int64_t per_lane = (Hd + 31) / 32;
  if (per_lane == 1) MT_PAGED(1);
  else if (per_lane == 2) MT_PAGED(2);
  else if (per_lane <= 4) MT_PAGED(4);
  else MT_PAGED(8);
#undef MT_PAGED
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
