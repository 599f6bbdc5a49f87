#include "backend/cuda/common.cuh"

namespace mt::cuda {

namespace {
struct Context {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;
  Context() {
    MT_CUDA_CHECK("cuda context", cudaStreamCreate(&stream));
    MT_CUBLAS_CHECK("cuda context", cublasLtCreate(&lt));
    MT_CUDA_CHECK("cuda context", cudaMalloc(&workspace, workspace_bytes));
  }
};
Context& ctx() {
  static Context c;
  return c;
}
}  // namespace

cudaStream_t stream() { return ctx().stream; }
cublasLtHandle_t cublaslt() { return ctx().lt; }
void* cublaslt_workspace() { return ctx().workspace; }
size_t cublaslt_workspace_bytes() { return ctx().workspace_bytes; }

void sync(const char* op) { MT_CUDA_CHECK(op, cudaStreamSynchronize(stream())); }

void check_cuda(const Tensor& t, const char* what) {
  MT_CHECK(t.device() == Device::CUDA, what, " must be on cuda, got ", t.desc());
}
void check_cuda(const Tensor& t, DType dtype, const char* what) {
  check_cuda(t, what);
  check_dtype(t, dtype, what);
}
void check_cuda(const Tensor& t, DType dtype, const Shape& shape, const char* what) {
  check_cuda(t, dtype, what);
  check_shape(t, shape, what);
}

}  // namespace mt::cuda
