// Shared pieces of the CUDA backend: error checks that name the op, the stream every op runs on,
// the cuBLASLt handle and workspace, bf16 helpers and tensor argument checks.
//
// Every op runs on mt::cuda::stream(), a blocking stream (created without cudaStreamNonBlocking),
// so that the legacy-default-stream copies in core/tensor.cpp stay ordered with the kernels.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/tensor.h"

#define MT_CUDA_CHECK(op, call)                                                                          \
  do {                                                                                                   \
    cudaError_t err_ = (call);                                                                           \
    if (err_ != cudaSuccess)                                                                             \
      ::mt::fail_at(__FILE__, __LINE__,                                                                  \
                    ::mt::str(op, ": ", #call, " failed: ", cudaGetErrorName(err_), " (", cudaGetErrorString(err_), ")")); \
  } while (0)

// After a kernel launch: reports launch errors (bad configuration, no kernel image for this GPU).
#define MT_CUDA_LAUNCH_CHECK(op) MT_CUDA_CHECK(op, cudaGetLastError())

#define MT_CUBLAS_CHECK(op, call)                                                                        \
  do {                                                                                                   \
    cublasStatus_t st_ = (call);                                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      ::mt::fail_at(__FILE__, __LINE__, ::mt::str(op, ": ", #call, " failed: cublas status ", int(st_))); \
  } while (0)

namespace mt::cuda {

// The stream ops run on: the compute stream, or the side stream inside a streams::SideScope.
cudaStream_t stream();
cudaStream_t compute_stream();  // the compute stream, also inside a SideScope
cudaStream_t side_stream();     // the side stream (core/streams.h), of the lowest priority
cudaStream_t urgent_stream();   // the urgent side stream: non-blocking, of the highest priority (the NCCL streams' too)
void set_stream_override(cudaStream_t s);  // what SideScope sets (null: back to the compute stream)
cublasLtHandle_t cublaslt();
// Scratch for cuBLASLt (32 MiB), valid on stream().
void* cublaslt_workspace();
size_t cublaslt_workspace_bytes();
// Waits for stream() and reports any asynchronous error with the op's name.
void sync(const char* op);

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// Argument checks for CUDA ops: device, dtype and shape with the tensor's role in the message.
void check_cuda(const Tensor& t, const char* what);
void check_cuda(const Tensor& t, DType dtype, const char* what);
void check_cuda(const Tensor& t, DType dtype, const Shape& shape, const char* what);
// A CUDA tensor of bf16 or f32 (the ops whose activations may be either): "<what> has dtype i32,
// expected bf16 or f32"; with shape, also of that shape.
void check_cuda_bf16_or_f32(const Tensor& t, const char* what);
void check_cuda_bf16_or_f32(const Tensor& t, const Shape& shape, const char* what);

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace mt::cuda
