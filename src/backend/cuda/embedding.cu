// CUDA token embedding: a row gather forward (bf16 table -> bf16 or f32 rows, exact: a bf16 value is
// exactly an f32 one) and a scatter-add backward from bf16 or f32 row gradients into the f32 table
// gradient (+=) with float atomics. The f32 forms serve a model that keeps its residual stream in f32.
//
// Repeated ids accumulate in an unspecified order, so the table gradient can differ in its last bits
// from run to run. Ids are not range-checked on the host, which would cost a device-to-host copy and a
// synchronisation per call: an id outside [0, V) gives a zero output row and contributes no gradient.
//
// Deterministic mode (core/determinism.h): no atomics. The token positions are sorted by id (CUB's
// stable radix sort, so equal ids keep position order), then block (sorted index i, column chunk) does
// the work only when i starts a run of equal ids: it adds the run's rows to the table row in position
// order, in f32, starting from the row's value, which is exactly the CPU's sequential loop, so the
// result equals the CPU's bit for bit. Cost at T = 65,536 tokens, D = 2048: a sort of T 32-bit keys and
// one pass over dout; an id that takes a large share of the tokens is summed by D / 256 warps alone
// (all 65,536 tokens on one id: 268 MB through 8 warps, a few ms).
#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "core/determinism.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t(1) << 20;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Elements per 16-byte access of a row of T.
template <class T>
constexpr int kVec = int(16 / sizeof(T));

// One block per token row (grid-stride over rows), VEC elements per access (16 bytes of out when VEC > 1).
template <class TO, int VEC>
__global__ void embedding_fwd_kernel(const int64_t* ids, const __nv_bfloat16* table, TO* out, int64_t T, int64_t V,
                                     int64_t D) {
  using PI = Pack<__nv_bfloat16, VEC>;
  using PO = Pack<TO, VEC>;
  const int64_t chunks = D / VEC;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t];
    PO* dst = reinterpret_cast<PO*>(out + t * D);
    if (id < 0 || id >= V) {
      PO zero;
#pragma unroll
      for (int j = 0; j < VEC; ++j) zero.v[j] = from_f32<TO>(0.0f);
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = zero;
      continue;
    }
    const PI* src = reinterpret_cast<const PI*>(table + id * D);
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      if constexpr (std::is_same_v<TO, __nv_bfloat16>) {
        dst[c] = src[c];  // a bit copy
      } else {
        const PI a = src[c];
        PO b;
#pragma unroll
        for (int j = 0; j < VEC; ++j) b.v[j] = to_f32(a.v[j]);
        dst[c] = b;
      }
    }
  }
}

template <class TG, int VEC>
__global__ void embedding_bwd_kernel(const int64_t* ids, const TG* dout, float* dtable, int64_t T, int64_t V,
                                     int64_t D) {
  using P = Pack<TG, VEC>;
  const int64_t chunks = D / VEC;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t];
    if (id < 0 || id >= V) continue;
    const P* src = reinterpret_cast<const P*>(dout + t * D);
    float* row = dtable + id * D;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const P g = src[c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) atomicAdd(row + c * VEC + j, to_f32(g.v[j]));
    }
  }
}

// Sort keys: the id when it is in [0, V), else V (sorted last and skipped); values: the positions.
__global__ void embedding_sort_prepare_kernel(const int64_t* __restrict__ ids, int64_t T, int64_t V,
                                              uint32_t* __restrict__ keys, int32_t* __restrict__ pos) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < T; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = ids[t];
    keys[t] = uint32_t(id >= 0 && id < V ? id : V);
    pos[t] = int32_t(t);
  }
}

constexpr int kSortedThreads = 32;  // one warp per (run, column chunk): a hot id still spreads over D / 256 warps

// Block (i, chunk): when sorted index i starts a run of one valid id, row[id] += the run's dout rows in
// position order (f32, starting from the row's value: the CPU's sequential sum).
template <class TG, int VEC>
__global__ void embedding_bwd_sorted_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ pos,
                                            const TG* __restrict__ dout, float* __restrict__ dtable, int64_t T,
                                            int64_t V, int64_t D) {
  using P = Pack<TG, VEC>;
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  if (int64_t(key) >= V || (i > 0 && keys[i - 1] == key)) return;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= D / VEC) return;
  // The run's end: the first sorted index past i with a larger key (keys are sorted).
  int64_t lo = i + 1, hi = T;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (keys[mid] == key)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int64_t end = lo;
  float* row = dtable + int64_t(key) * D + c * VEC;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = row[j];
#pragma unroll 4
  for (int64_t k = i; k < end; ++k) {
    const P g = reinterpret_cast<const P*>(dout + int64_t(pos[k]) * D)[c];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += to_f32(g.v[j]);
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) row[j] = acc[j];
}

template <class TG>
void embedding_bwd_deterministic(const int64_t* ids, const TG* dout, float* dtable, int64_t T, int64_t V, int64_t D) {
  const char* op = "embedding_bwd (deterministic)";
  MT_CHECK(T < (int64_t(1) << 31), op, ": T (", T, ") exceeds the grid size");
  MT_CHECK(V < (int64_t(1) << 32) - 1, op, ": V (", V, ") exceeds the 32-bit sort keys");
  static DeviceScratch keys_in_buf, keys_out_buf, pos_in_buf, pos_out_buf, cub_buf;
  uint32_t* keys_in = keys_in_buf.as<uint32_t>(T, op);
  uint32_t* keys_out = keys_out_buf.as<uint32_t>(T, op);
  int32_t* pos_in = pos_in_buf.as<int32_t>(T, op);
  int32_t* pos_out = pos_out_buf.as<int32_t>(T, op);
  const unsigned prep_grid = unsigned(std::min<int64_t>((T + 255) / 256, 1 << 16));
  embedding_sort_prepare_kernel<<<prep_grid, 256, 0, stream()>>>(ids, T, V, keys_in, pos_in);
  MT_CUDA_LAUNCH_CHECK(op);
  int end_bit = 1;
  while (end_bit < 32 && (int64_t(1) << end_bit) <= V) ++end_bit;  // keys lie in [0, V]
  size_t temp_bytes = 0;
  MT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, pos_in, pos_out, int(T), 0,
                                                    end_bit, stream()));
  void* temp = cub_buf.get(temp_bytes, op);
  MT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in, pos_out, int(T), 0,
                                                    end_bit, stream()));
  constexpr int kV = kVec<TG>;
  const bool vec = D % kV == 0 && aligned16(dout);
  const int64_t chunks = vec ? D / kV : D;
  const int64_t col_blocks = (chunks + kSortedThreads - 1) / kSortedThreads;
  MT_CHECK(col_blocks < 65536, op, ": D (", D, ") needs more than 65535 column blocks");
  const dim3 grid{unsigned(T), unsigned(col_blocks)};
  if (vec)
    embedding_bwd_sorted_kernel<TG, kV>
        <<<grid, kSortedThreads, 0, stream()>>>(keys_out, pos_out, dout, dtable, T, V, D);
  else
    embedding_bwd_sorted_kernel<TG, 1><<<grid, kSortedThreads, 0, stream()>>>(keys_out, pos_out, dout, dtable, T, V, D);
  MT_CUDA_LAUNCH_CHECK(op);
}

// Calls f(float{}) or f(__nv_bfloat16{}) for dt (bf16 or f32, checked before).
template <class F>
void dispatch_float(DType dt, F&& f) {
  if (dt == DType::F32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

// Checks ids_T (1-D i64 on CUDA) and returns T.
int64_t check_ids(const Tensor& ids_T, const char* what) {
  check_cuda(ids_T, DType::I64, what);
  MT_CHECK(ids_T.dim() == 1, what, " must be 1-D, got ", ids_T.desc());
  return ids_T.numel();
}

}  // namespace

void embedding_fwd(const Tensor& ids_T, const Tensor& table_VD, Tensor& out_TD) {
  check_cuda(table_VD, DType::BF16, "embedding_fwd table_VD");
  MT_CHECK(table_VD.dim() == 2, "embedding_fwd table_VD must be 2-D, got ", table_VD.desc());
  const int64_t V = table_VD.size(0), D = table_VD.size(1);
  const int64_t T = check_ids(ids_T, "embedding_fwd ids_T");
  check_cuda_bf16_or_f32(out_TD, {T, D}, "embedding_fwd out_TD");
  if (T == 0 || D == 0) return;
  const auto* table = static_cast<const __nv_bfloat16*>(table_VD.raw());
  const unsigned grid = unsigned(std::min(T, kMaxGrid));
  dispatch_float(out_TD.dtype(), [&](auto tag) {
    using TO = decltype(tag);
    auto* out = static_cast<TO*>(out_TD.raw());
    constexpr int kV = kVec<TO>;
    if (D % kV == 0 && aligned16(table) && aligned16(out))
      embedding_fwd_kernel<TO, kV><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), table, out, T, V, D);
    else
      embedding_fwd_kernel<TO, 1><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), table, out, T, V, D);
  });
  MT_CUDA_LAUNCH_CHECK("embedding_fwd");
}

void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD, bool accumulate_dw) {
  check_cuda(dtable_VD, DType::F32, "embedding_bwd dtable_VD");
  MT_CHECK(dtable_VD.dim() == 2, "embedding_bwd dtable_VD must be 2-D, got ", dtable_VD.desc());
  const int64_t V = dtable_VD.size(0), D = dtable_VD.size(1);
  const int64_t T = check_ids(ids_T, "embedding_bwd ids_T");
  check_cuda_bf16_or_f32(dout_TD, {T, D}, "embedding_bwd dout_TD");
  // = is a clear and the scatter-add: rows of ids that do not occur must become 0 as well.
  if (!accumulate_dw && V * D > 0)
    MT_CUDA_CHECK("embedding_bwd", cudaMemsetAsync(dtable_VD.raw(), 0, size_t(V * D) * sizeof(float), stream()));
  if (T == 0 || D == 0) return;
  const unsigned grid = unsigned(std::min(T, kMaxGrid));
  dispatch_float(dout_TD.dtype(), [&](auto tag) {
    using TG = decltype(tag);
    const auto* dout = static_cast<const TG*>(dout_TD.raw());
    float* dtable = dtable_VD.data<float>();
    if (deterministic()) {
      embedding_bwd_deterministic(ids_T.data<int64_t>(), dout, dtable, T, V, D);
      return;
    }
    constexpr int kV = kVec<TG>;
    if (D % kV == 0 && aligned16(dout))
      embedding_bwd_kernel<TG, kV><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), dout, dtable, T, V, D);
    else
      embedding_bwd_kernel<TG, 1><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), dout, dtable, T, V, D);
  });
  MT_CUDA_LAUNCH_CHECK("embedding_bwd");
}

}  // namespace mt::cuda
