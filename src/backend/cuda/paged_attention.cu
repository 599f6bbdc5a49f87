// CUDA paged KV cache. kv_cache_write: one thread per element.
// paged_attention_fwd, two kernels (bench/NOTES.md "P9 v1" has their numbers):
//  - split-K (head_dim a multiple of 8, at most 256): a block of 128 threads per (token, group of HPC
//    query heads sharing one KV head, split of the token's positions). The block walks its split in
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
//    walking the positions with an online softmax (the first version).
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <cmath>
#include <initializer_list>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"

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

template <int PER_LANE>
__global__ void paged_attention_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                       const bf16* __restrict__ vc, const int32_t* __restrict__ table, int64_t M,
                                       int64_t block_size, const int32_t* __restrict__ seq,
                                       const int32_t* __restrict__ pos, int64_t N, int64_t H, int64_t G, int64_t Hd,
                                       float scale, bf16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;  // (token, head)
  if (item >= N * H) return;
  const int64_t n = item / H, h = item - n * H, g = h / (H / G);
  float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int64_t j = lane + 32 * i;  // lanes past Hd (Hd < 32 * PER_LANE) hold zeros
    qv[i] = j < Hd ? __bfloat162float(q[(n * H + h) * Hd + j]) : 0.0f;
    acc[i] = 0.0f;
  }
  const int32_t* row = table + int64_t(seq[n]) * M;
  const int64_t last = pos[n];
  float m = -INFINITY, sum = 0.0f;
  for (int64_t p = 0; p <= last; ++p) {
    const int64_t s = int64_t(row[p / block_size]) * block_size + p % block_size;
    const bf16* kp = kc + (s * G + g) * Hd;
    float d = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) d += qv[i] * __bfloat162float(kp[lane + 32 * i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    const float x = d * scale, mn = fmaxf(m, x), corr = expf(m - mn), e = expf(x - mn);
    sum = sum * corr + e;
    const bf16* vp = vc + (s * G + g) * Hd;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
      if (lane + 32 * i < Hd) acc[i] = acc[i] * corr + e * __bfloat162float(vp[lane + 32 * i]);
    m = mn;
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i)
    if (lane + 32 * i < Hd) out[(n * H + h) * Hd + lane + 32 * i] = __float2bfloat16_rn(acc[i] / sum);
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

enum class PagedKernel { automatic, serial, split };

// MOETRAIN_PAGED_ATTENTION (auto | serial | split), read at every call so a test or a benchmark can
// switch kernels.
PagedKernel paged_kernel_from_env() {
  const char* e = std::getenv("MOETRAIN_PAGED_ATTENTION");
  const std::string m = e ? e : "";
  if (m.empty() || m == "auto") return PagedKernel::automatic;
  if (m == "serial") return PagedKernel::serial;
  if (m == "split") return PagedKernel::split;
  MT_THROW("MOETRAIN_PAGED_ATTENTION (", m, ") must be one of auto, serial, split");
}

bool split_supported(int64_t Hd) { return Hd == 16 || Hd == 32 || Hd == 64 || Hd == 128 || Hd == 256; }

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
  const PagedKernel which = paged_kernel_from_env();
  if (which == PagedKernel::split && !split_supported(Hd))
    MT_THROW(op, ": MOETRAIN_PAGED_ATTENTION=split but head_dim ", Hd, " is not one of 16, 32, 64, 128, 256");
  if (N == 0) return;
  const float scale = float(1.0 / std::sqrt(double(Hd)));
  const auto* q = static_cast<const bf16*>(q_NHD.raw());
  const auto* kc = static_cast<const bf16*>(k_cache_SGD.raw());
  const auto* vc = static_cast<const bf16*>(v_cache_SGD.raw());
  auto* out = static_cast<bf16*>(out_NHD.raw());
  const int64_t M = block_table_BM.size(1);
  if (which != PagedKernel::serial && split_supported(Hd)) {
    // Splits: at least 4 blocks per multiprocessor in all (up to 16 KB of shared memory and 128
    // threads each, several fit at once), a split at least one chunk; the block table's width bounds
    // the positions.
    const int hpc = heads_per_block(H, G);
    const int64_t blocks = N * (H / hpc), chunks = std::max<int64_t>(1, (M * block_size + kChunk - 1) / kChunk);
    static const int sms = [op] {
      int dev = 0, count = 0;
      MT_CUDA_CHECK(op, cudaGetDevice(&dev));
      MT_CUDA_CHECK(op, cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
      return count;
    }();
    const int64_t target = int64_t(sms) * 4;
    int64_t S = blocks >= target ? 1 : std::min<int64_t>({chunks, (target + blocks - 1) / blocks, 64});
    const int64_t span = (chunks + S - 1) / S * kChunk;
    S = (chunks * kChunk + span - 1) / span;
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
