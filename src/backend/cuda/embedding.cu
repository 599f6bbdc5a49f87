// CUDA token embedding: a row gather forward (bf16 table -> bf16 rows, bit-exact copies) and a
// scatter-add backward from bf16 row gradients into the f32 table gradient (+=) with float atomics.
//
// Repeated ids accumulate in an unspecified order, so the table gradient can differ in its last bits
// from run to run. Ids are not range-checked on the host, which would cost a device-to-host copy and a
// synchronisation per call: an id outside [0, V) gives a zero output row and contributes no gradient.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"

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

// One block per token row (grid-stride over rows), VEC bf16 per access.
template <int VEC>
__global__ void embedding_fwd_kernel(const int64_t* ids, const __nv_bfloat16* table, __nv_bfloat16* out, int64_t T,
                                     int64_t V, int64_t D) {
  using P = Pack<__nv_bfloat16, VEC>;
  const int64_t chunks = D / VEC;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t];
    P* dst = reinterpret_cast<P*>(out + t * D);
    if (id < 0 || id >= V) {
      P zero;
#pragma unroll
      for (int j = 0; j < VEC; ++j) zero.v[j] = __float2bfloat16_rn(0.0f);
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = zero;
      continue;
    }
    const P* src = reinterpret_cast<const P*>(table + id * D);
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src[c];
  }
}

template <int VEC>
__global__ void embedding_bwd_kernel(const int64_t* ids, const __nv_bfloat16* dout, float* dtable, int64_t T, int64_t V,
                                     int64_t D) {
  using P = Pack<__nv_bfloat16, VEC>;
  const int64_t chunks = D / VEC;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t id = ids[t];
    if (id < 0 || id >= V) continue;
    const P* src = reinterpret_cast<const P*>(dout + t * D);
    float* row = dtable + id * D;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const P g = src[c];
#pragma unroll
      for (int j = 0; j < VEC; ++j) atomicAdd(row + c * VEC + j, __bfloat162float(g.v[j]));
    }
  }
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
  check_cuda(out_TD, DType::BF16, {T, D}, "embedding_fwd out_TD");
  if (T == 0 || D == 0) return;
  const auto* table = static_cast<const __nv_bfloat16*>(table_VD.raw());
  auto* out = static_cast<__nv_bfloat16*>(out_TD.raw());
  const unsigned grid = unsigned(std::min(T, kMaxGrid));
  if (D % 8 == 0 && aligned16(table) && aligned16(out))
    embedding_fwd_kernel<8><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), table, out, T, V, D);
  else
    embedding_fwd_kernel<1><<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), table, out, T, V, D);
  MT_CUDA_LAUNCH_CHECK("embedding_fwd");
}

void embedding_bwd(const Tensor& ids_T, const Tensor& dout_TD, Tensor& dtable_VD) {
  check_cuda(dtable_VD, DType::F32, "embedding_bwd dtable_VD");
  MT_CHECK(dtable_VD.dim() == 2, "embedding_bwd dtable_VD must be 2-D, got ", dtable_VD.desc());
  const int64_t V = dtable_VD.size(0), D = dtable_VD.size(1);
  const int64_t T = check_ids(ids_T, "embedding_bwd ids_T");
  check_cuda(dout_TD, DType::BF16, {T, D}, "embedding_bwd dout_TD");
  if (T == 0 || D == 0) return;
  const auto* dout = static_cast<const __nv_bfloat16*>(dout_TD.raw());
  const unsigned grid = unsigned(std::min(T, kMaxGrid));
  if (D % 8 == 0 && aligned16(dout))
    embedding_bwd_kernel<8>
        <<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), dout, dtable_VD.data<float>(), T, V, D);
  else
    embedding_bwd_kernel<1>
        <<<grid, kThreads, 0, stream()>>>(ids_T.data<int64_t>(), dout, dtable_VD.data<float>(), T, V, D);
  MT_CUDA_LAUNCH_CHECK("embedding_bwd");
}

}  // namespace mt::cuda
