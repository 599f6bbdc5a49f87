#include "backend/cuda/common.cuh"

namespace mt::cuda {

namespace {
struct Context {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;
  Context() {
    // One step above the least priority: the side stream (streams.cu) takes the least, so that the
    // compute stream's kernels go first when both have work; the NCCL streams take the greatest.
    int least = 0, greatest = 0;
    MT_CUDA_CHECK("cuda context", cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MT_CUDA_CHECK("cuda context", cudaStreamCreateWithPriority(&stream, cudaStreamDefault, greatest < least ? least - 1 : least));
    MT_CUBLAS_CHECK("cuda context", cublasLtCreate(&lt));
    MT_CUDA_CHECK("cuda context", cudaMalloc(&workspace, workspace_bytes));
  }
};
Context& ctx() {
  static Context c;
  return c;
}
}  // namespace

// streams::SideScope points this thread's ops at the side stream (core/streams.h).
thread_local cudaStream_t t_override = nullptr;

cudaStream_t stream() { return t_override ? t_override : ctx().stream; }
void set_stream_override(cudaStream_t s) { t_override = s; }
cudaStream_t compute_stream() { return ctx().stream; }

namespace {
// A non-blocking stream of the device's lowest or highest priority.
cudaStream_t make_side_stream(bool highest, const char* what) {
  int least = 0, greatest = 0;
  MT_CUDA_CHECK(what, cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  MT_CUDA_CHECK(what, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, highest ? greatest : least));
  return s;
}
}  // namespace

cudaStream_t side_stream() {
  static cudaStream_t side = make_side_stream(false, "side stream");
  return side;
}
cudaStream_t urgent_stream() {
  static cudaStream_t urgent = make_side_stream(true, "urgent side stream");
  return urgent;
}
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
void check_cuda_bf16_or_f32(const Tensor& t, const char* what) {
  check_cuda(t, what);
  MT_CHECK(t.dtype() == DType::BF16 || t.dtype() == DType::F32, what, " has dtype ", dtype_name(t.dtype()),
           ", expected bf16 or f32");
}
void check_cuda_bf16_or_f32(const Tensor& t, const Shape& shape, const char* what) {
  check_cuda_bf16_or_f32(t, what);
  check_shape(t, shape, what);
}

}  // namespace mt::cuda
