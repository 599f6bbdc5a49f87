// Reference CUDA kernels for causal grouped-query attention: plain, correct, deterministic; the
// fallback of attention_fwd/bwd and the yardstick for the cuDNN path in tests.
//
// bf16 inputs and outputs, f32 math. Query head h reads kv head h / (H/G); scale = 1/sqrt(Hd).
// Forward, one block per (b, h, query i): pass 1 computes max and sum of exp of the scaled scores
// over keys j <= i (online, per warp, then merged), lse = max + log(sum); pass 2 recomputes the
// scores, p = exp(s - lse), and accumulates out = sum_j p_j v_j.
// Backward (flash-attention identities, P recomputed from the saved lse):
//   D_i = dO_i . O_i;  dS_ij = P_ij (dO_i . V_j - D_i)
//   dQ_i = scale sum_j dS_ij K_j          one block per (b, h, query i)
//   dK_j = scale sum_{h in group, i >= j} dS_ij Q_i,  dV_j = sum_{h, i >= j} P_ij dO_i
//                                          one block per (b, kv head g, key j)
// Every output element is written by exactly one thread (no atomics), so results are bit-for-bit
// reproducible and dk/dv need no f32 temporaries. Scores are computed by one warp per key (lanes
// over Hd, coalesced); the value/query sums by threads over Hd with the tile's weights in shared
// memory. Any Hd works (shared memory holds a few rows of Hd floats).
// Packed rows: with `first` (i32 [T], the document start of each token, ops.h's doc_start_T) query i
// sees keys first[i] .. i, and key j is seen by the queries of its document from j on (starts are
// non-decreasing along a row, so the first query past j whose start exceeds j ends the scan).
#include <cmath>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;  // keys (or queries) whose weights sit in shared memory at a time

using bf16 = __nv_bfloat16;

// Where the statistic of (b, s, h) lives in the lse buffer.
struct LseIndex {
  int64_t sb, ss, sh;
  __device__ int64_t at(int64_t b, int64_t s, int64_t h) const { return b * sb + s * ss + h * sh; }
};

LseIndex lse_index(StatsLayout layout, int64_t S, int64_t H) {
  return layout == StatsLayout::TH ? LseIndex{S * H, H, 1} : LseIndex{H * S, 1, S};
}

// x . y over Hd with the lanes of one warp; every lane returns the sum. Must be called by a whole warp.
__device__ __forceinline__ float warp_dot(const float* x, const bf16* y, int Hd, int lane) {
  float s = 0.0f;
  for (int d = lane; d < Hd; d += 32) s = fmaf(x[d], __bfloat162float(y[d]), s);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// Grid: B*S*H blocks, block (t = b*S + i, h). Shared: q[Hd], acc[Hd], p[kTile], red[2*kWarps].
__global__ void __launch_bounds__(kThreads)
    attn_ref_fwd_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                        bf16* __restrict__ out, float* __restrict__ lse, int64_t S, int H, int G, int Hd, float scale,
                        LseIndex li, const int32_t* __restrict__ first) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* acc = qs + Hd;
  float* p = acc + Hd;
  float* red = p + kTile;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int h = int(row % H);
  const int64_t t = row / H, b = t / S, i = t % S;
  const int g = h / (H / G);
  const int64_t ldk = int64_t(G) * Hd;
  const bf16* qrow = q + (t * H + h) * Hd;
  const bf16* kb = k + b * S * ldk + int64_t(g) * Hd;  // key j of this sequence and kv head: kb + j * ldk
  const bf16* vb = v + b * S * ldk + int64_t(g) * Hd;
  const int64_t j_lo = first ? int64_t(first[t]) : 0;  // the first key this query sees
  for (int d = tid; d < Hd; d += kThreads) {
    qs[d] = __bfloat162float(qrow[d]);
    acc[d] = 0.0f;
  }
  __syncthreads();

  // Pass 1: running max m and sum l of exp(s - m) per warp, then merged across warps.
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = j_lo + warp; j <= i; j += kWarps) {
    const float s = warp_dot(qs, kb + j * ldk, Hd, lane) * scale;
    if (s > m) {
      l = l * expf(m - s) + 1.0f;
      m = s;
    } else {
      l += expf(s - m);
    }
  }
  if (lane == 0) {
    red[warp] = m;
    red[kWarps + warp] = l;
  }
  __syncthreads();
  float mx = red[0];  // finite: warp 0 saw key j_lo
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  float sum = 0.0f;
  for (int w = 0; w < kWarps; ++w) sum += red[kWarps + w] * expf(red[w] - mx);  // empty warps: 0 * 0
  const float lse_i = mx + logf(sum);

  // Pass 2: out = sum_j exp(s_j - lse) v_j, a tile of keys at a time.
  for (int64_t j0 = j_lo; j0 <= i; j0 += kTile) {
    for (int jj = warp; jj < kTile; jj += kWarps) {
      const int64_t j = j0 + jj;
      float pj = 0.0f;
      if (j <= i) pj = expf(warp_dot(qs, kb + j * ldk, Hd, lane) * scale - lse_i);
      if (lane == 0) p[jj] = pj;
    }
    __syncthreads();
    const int n = int(i - j0 + 1 < kTile ? i - j0 + 1 : kTile);
    for (int d = tid; d < Hd; d += kThreads) {
      float a = acc[d];
      for (int jj = 0; jj < n; ++jj) a = fmaf(p[jj], __bfloat162float(vb[(j0 + jj) * ldk + d]), a);
      acc[d] = a;
    }
    __syncthreads();
  }
  bf16* orow = out + (t * H + h) * Hd;
  for (int d = tid; d < Hd; d += kThreads) orow[d] = __float2bfloat16_rn(acc[d]);
  if (tid == 0) lse[li.at(b, i, h)] = lse_i;
}

// delta[t*H + h] = dO . O over Hd, one warp per (t, h).
__global__ void __launch_bounds__(kThreads)
    attn_ref_delta_kernel(const bf16* __restrict__ dout, const bf16* __restrict__ out, float* __restrict__ delta,
                          int64_t rows, int Hd) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float s = 0.0f;
  for (int d = lane; d < Hd; d += 32)
    s = fmaf(__bfloat162float(dout[r * Hd + d]), __bfloat162float(out[r * Hd + d]), s);
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) delta[r] = s;
}

// dQ. Grid: B*S*H blocks, block (t = b*S + i, h). Shared: q[Hd], dO[Hd], acc[Hd], ds[kTile].
__global__ void __launch_bounds__(kThreads)
    attn_ref_dq_kernel(const bf16* __restrict__ dout, const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ delta,
                       bf16* __restrict__ dq, int64_t S, int H, int G, int Hd, float scale, LseIndex li,
                       const int32_t* __restrict__ first) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = qs + Hd;
  float* acc = dos + Hd;
  float* ds = acc + Hd;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int h = int(row % H);
  const int64_t t = row / H, b = t / S, i = t % S;
  const int g = h / (H / G);
  const int64_t ldk = int64_t(G) * Hd;
  const bf16* kb = k + b * S * ldk + int64_t(g) * Hd;
  const bf16* vb = v + b * S * ldk + int64_t(g) * Hd;
  for (int d = tid; d < Hd; d += kThreads) {
    qs[d] = __bfloat162float(q[(t * H + h) * Hd + d]);
    dos[d] = __bfloat162float(dout[(t * H + h) * Hd + d]);
    acc[d] = 0.0f;
  }
  __syncthreads();
  const float lse_i = lse[li.at(b, i, h)];
  const float D = delta[t * H + h];
  for (int64_t j0 = first ? int64_t(first[t]) : 0; j0 <= i; j0 += kTile) {
    for (int jj = warp; jj < kTile; jj += kWarps) {
      const int64_t j = j0 + jj;
      float dsj = 0.0f;
      if (j <= i) {
        const float pj = expf(warp_dot(qs, kb + j * ldk, Hd, lane) * scale - lse_i);
        dsj = pj * (warp_dot(dos, vb + j * ldk, Hd, lane) - D);
      }
      if (lane == 0) ds[jj] = dsj;
    }
    __syncthreads();
    const int n = int(i - j0 + 1 < kTile ? i - j0 + 1 : kTile);
    for (int d = tid; d < Hd; d += kThreads) {
      float a = acc[d];
      for (int jj = 0; jj < n; ++jj) a = fmaf(ds[jj], __bfloat162float(kb[(j0 + jj) * ldk + d]), a);
      acc[d] = a;
    }
    __syncthreads();
  }
  for (int d = tid; d < Hd; d += kThreads) dq[(t * H + h) * Hd + d] = __float2bfloat16_rn(scale * acc[d]);
}

// dK and dV. Grid: B*S*G blocks, block (b*S + j, g). Shared: k[Hd], v[Hd], dk[Hd], dv[Hd], p[kTile], ds[kTile].
__global__ void __launch_bounds__(kThreads)
    attn_ref_dkdv_kernel(const bf16* __restrict__ dout, const bf16* __restrict__ q, const bf16* __restrict__ k,
                         const bf16* __restrict__ v, const float* __restrict__ lse, const float* __restrict__ delta,
                         bf16* __restrict__ dk, bf16* __restrict__ dv, int64_t S, int H, int G, int Hd, float scale,
                         LseIndex li, const int32_t* __restrict__ first) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = ks + Hd;
  float* dka = vs + Hd;
  float* dva = dka + Hd;
  float* p = dva + Hd;
  float* ds = p + kTile;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const int g = int(row % G);
  const int64_t t = row / G, b = t / S, j = t % S;
  const int group = H / G;
  const int64_t ldq = int64_t(H) * Hd;
  for (int d = tid; d < Hd; d += kThreads) {
    ks[d] = __bfloat162float(k[(t * G + g) * Hd + d]);
    vs[d] = __bfloat162float(v[(t * G + g) * Hd + d]);
    dka[d] = 0.0f;
    dva[d] = 0.0f;
  }
  __syncthreads();
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    const bf16* qb = q + b * S * ldq + int64_t(h) * Hd;  // query i of this sequence and head: qb + i * ldq
    const bf16* dob = dout + b * S * ldq + int64_t(h) * Hd;
    // Queries of key j's document: from j while their start is <= j (past it, another document).
    for (int64_t i0 = j; i0 < S && !(first && first[b * S + i0] > j); i0 += kTile) {
      for (int ii = warp; ii < kTile; ii += kWarps) {
        const int64_t i = i0 + ii;
        float pi = 0.0f, dsi = 0.0f;
        if (i < S && !(first && first[b * S + i] > j)) {
          pi = expf(warp_dot(ks, qb + i * ldq, Hd, lane) * scale - lse[li.at(b, i, h)]);
          dsi = pi * (warp_dot(vs, dob + i * ldq, Hd, lane) - delta[(b * S + i) * H + h]);
        }
        if (lane == 0) {
          p[ii] = pi;
          ds[ii] = dsi;
        }
      }
      __syncthreads();
      const int n = int(S - i0 < kTile ? S - i0 : kTile);
      for (int d = tid; d < Hd; d += kThreads) {
        float a = dka[d], c = dva[d];
        for (int ii = 0; ii < n; ++ii) {
          a = fmaf(ds[ii], __bfloat162float(qb[(i0 + ii) * ldq + d]), a);
          c = fmaf(p[ii], __bfloat162float(dob[(i0 + ii) * ldq + d]), c);
        }
        dka[d] = a;
        dva[d] = c;
      }
      __syncthreads();
    }
  }
  for (int d = tid; d < Hd; d += kThreads) {
    dk[(t * G + g) * Hd + d] = __float2bfloat16_rn(scale * dka[d]);
    dv[(t * G + g) * Hd + d] = __float2bfloat16_rn(dva[d]);
  }
}

float attention_scale(int64_t Hd) {
  return float(1.0 / std::sqrt(double(Hd)));
}

// Dynamic shared memory of `floats` floats, checked against the default 48 KiB.
size_t smem_bytes(int64_t floats, const char* op, int64_t Hd) {
  const size_t bytes = size_t(floats) * sizeof(float);
  if (bytes > size_t(48) << 10) MT_THROW(op, ": head dim Hd (", Hd, ") is too large for the reference kernels");
  return bytes;
}

unsigned grid_of(int64_t blocks, const char* op) {
  if (blocks > int64_t(0x7fffffff)) MT_THROW(op, ": ", blocks, " blocks exceed the CUDA grid limit");
  return unsigned(blocks);
}

}  // namespace

namespace detail {
AttnDims check_attention_inputs(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                                const char* op) {
  check_cuda(q_THHd, DType::BF16, str(op, " q_THHd").c_str());
  check_cuda(k_TGHd, DType::BF16, str(op, " k_TGHd").c_str());
  check_cuda(v_TGHd, DType::BF16, str(op, " v_TGHd").c_str());
  return ops::check_attention_shapes(q_THHd, k_TGHd, v_TGHd, B, S, op);
}
}  // namespace detail

// The document starts of packed rows as a device pointer (null without), checked: i32 [T] on CUDA.
const int32_t* first_keys(const Tensor* doc_start_T, int64_t T, const char* op) {
  if (!doc_start_T || !doc_start_T->defined()) return nullptr;
  check_cuda(*doc_start_T, DType::I32, {T}, str(op, " doc_start_T").c_str());
  return doc_start_T->data<int32_t>();
}

void attention_ref_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                       Tensor& out_THHd, Tensor& lse_TH, StatsLayout stats, const Tensor* doc_start_T) {
  const char* op = "attention_ref_fwd";
  const detail::AttnDims d = detail::check_attention_inputs(q_THHd, k_TGHd, v_TGHd, B, S, op);
  check_cuda(out_THHd, DType::BF16, {d.T, d.H, d.Hd}, "attention_ref_fwd out_THHd");
  check_cuda(lse_TH, DType::F32, {d.T, d.H}, "attention_ref_fwd lse_TH");
  const int32_t* first = first_keys(doc_start_T, d.T, op);
  if (d.T == 0) return;
  const size_t smem = smem_bytes(2 * d.Hd + kTile + 2 * kWarps, op, d.Hd);
  attn_ref_fwd_kernel<<<grid_of(d.T * d.H, op), kThreads, smem, stream()>>>(
      static_cast<const bf16*>(q_THHd.raw()), static_cast<const bf16*>(k_TGHd.raw()),
      static_cast<const bf16*>(v_TGHd.raw()), static_cast<bf16*>(out_THHd.raw()), lse_TH.data<float>(), S, int(d.H),
      int(d.G), int(d.Hd), attention_scale(d.Hd), lse_index(stats, S, d.H), first);
  MT_CUDA_LAUNCH_CHECK(op);
}

void attention_ref_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                       const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd,
                       Tensor& dk_TGHd, Tensor& dv_TGHd, StatsLayout stats, const Tensor* doc_start_T) {
  const char* op = "attention_ref_bwd";
  const detail::AttnDims d = detail::check_attention_inputs(q_THHd, k_TGHd, v_TGHd, B, S, op);
  const Shape q_shape{d.T, d.H, d.Hd}, kv_shape{d.T, d.G, d.Hd};
  check_cuda(dout_THHd, DType::BF16, q_shape, "attention_ref_bwd dout_THHd");
  check_cuda(out_THHd, DType::BF16, q_shape, "attention_ref_bwd out_THHd");
  check_cuda(lse_TH, DType::F32, {d.T, d.H}, "attention_ref_bwd lse_TH");
  check_cuda(dq_THHd, DType::BF16, q_shape, "attention_ref_bwd dq_THHd");
  check_cuda(dk_TGHd, DType::BF16, kv_shape, "attention_ref_bwd dk_TGHd");
  check_cuda(dv_TGHd, DType::BF16, kv_shape, "attention_ref_bwd dv_TGHd");
  const int32_t* first = first_keys(doc_start_T, d.T, op);
  if (d.T == 0) return;
  const float scale = attention_scale(d.Hd);
  const LseIndex li = lse_index(stats, S, d.H);
  const auto* dout = static_cast<const bf16*>(dout_THHd.raw());
  const auto* q = static_cast<const bf16*>(q_THHd.raw());
  const auto* k = static_cast<const bf16*>(k_TGHd.raw());
  const auto* v = static_cast<const bf16*>(v_TGHd.raw());
  const float* lse = lse_TH.data<float>();
  // D = rowsum(dO * O) per (token, head), in [T, H] order whatever the stats layout.
  Tensor delta = Tensor::empty({d.T, d.H}, DType::F32, Device::CUDA);
  const int64_t rows = d.T * d.H;
  attn_ref_delta_kernel<<<grid_of((rows + kWarps - 1) / kWarps, op), kThreads, 0, stream()>>>(
      dout, static_cast<const bf16*>(out_THHd.raw()), delta.data<float>(), rows, int(d.Hd));
  MT_CUDA_LAUNCH_CHECK(op);
  const size_t smem_dq = smem_bytes(3 * d.Hd + kTile, op, d.Hd);
  attn_ref_dq_kernel<<<grid_of(d.T * d.H, op), kThreads, smem_dq, stream()>>>(
      dout, q, k, v, lse, delta.data<float>(), static_cast<bf16*>(dq_THHd.raw()), S, int(d.H), int(d.G), int(d.Hd),
      scale, li, first);
  MT_CUDA_LAUNCH_CHECK(op);
  const size_t smem_kv = smem_bytes(4 * d.Hd + 2 * kTile, op, d.Hd);
  attn_ref_dkdv_kernel<<<grid_of(d.T * d.G, op), kThreads, smem_kv, stream()>>>(
      dout, q, k, v, lse, delta.data<float>(), static_cast<bf16*>(dk_TGHd.raw()), static_cast<bf16*>(dv_TGHd.raw()), S,
      int(d.H), int(d.G), int(d.Hd), scale, li, first);
  MT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace mt::cuda
