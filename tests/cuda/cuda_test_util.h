// Helpers for CUDA-vs-CPU op tests: skip visibly without a GPU, random inputs that are exactly
// representable in bf16 (so the CPU reference sees the same values as the GPU), transfers, and the
// relative L2 error with NaN never passing.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::cudatest {

#define MT_REQUIRE_GPU()                                                   \
  do {                                                                     \
    if (!::mt::device_mem::cuda_available()) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)

// The CUTLASS grouped-GEMM tests: a GPU, and a build and GPU with the grouped GEMM (sm_90 + CUTLASS).
#define MT_REQUIRE_GROUPED()                                                                             \
  do {                                                                                                   \
    MT_REQUIRE_GPU();                                                                                    \
    if (!::mt::cuda::grouped_gemm_available())                                                           \
      GTEST_SKIP() << "skipped: no CUTLASS grouped GEMM for this build and GPU (needs sm_90 + CUTLASS)"; \
  } while (0)

// Sets an environment variable (null: unsets it) for one scope and puts the old value back, however the
// scope ends: the kernels' MOETRAIN_* switches that tests force.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~EnvGuard() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// f32 CPU tensor with N(0, std) values rounded to bf16 (exactly representable).
inline Tensor rand_bf16_exact(const Shape& s, Rng& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, std);
  return t.to(DType::BF16).to(DType::F32);
}

// CPU f32 -> CUDA tensor of dtype dt (bf16 or f32).
inline Tensor to_cuda(const Tensor& cpu_f32, DType dt) { return cpu_f32.to(dt).to(Device::CUDA); }

// A CUDA tensor of dtype dt filled with v (NaN marks "must be overwritten").
inline Tensor cuda_filled(const Shape& s, DType dt, float v) {
  Tensor t = Tensor::empty(s);
  t.fill_(v);
  return to_cuda(t, dt);
}

// A host f32 tensor of N(0, std^2) draws.
inline Tensor randn(const Shape& s, Rng& rng, float std = 1.0f) {
  Tensor t = Tensor::empty(s);
  rng.fill_normal(t, 0.0f, std);
  return t;
}
// Any CUDA/CPU tensor -> CPU f32.
inline Tensor to_host_f32(const Tensor& t) { return t.to(Device::CPU).to(DType::F32); }

// ||a - b|| / ||b|| with a, b converted to f32 on the host; NaN or Inf anywhere returns +inf.
inline double rel_l2(const Tensor& a, const Tensor& b) {
  Tensor x = to_host_f32(a), y = to_host_f32(b);
  EXPECT_EQ(x.shape(), y.shape());
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    double p = x.data<float>()[i], q = y.data<float>()[i];
    if (!std::isfinite(p) || !std::isfinite(q)) return INFINITY;
    num += (p - q) * (p - q);
    den += q * q;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Top-k expert ids for T tokens: K distinct experts per token from [0, E), never `skip` (so that
// expert is left without tokens; -1 = none skipped).
inline Tensor random_topk(int64_t T, int64_t K, int64_t E, Rng& rng, int32_t skip = -1) {
  Tensor idx = Tensor::empty({T, K}, DType::I32);
  int32_t* p = idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      int32_t e;
      bool again;
      do {
        e = int32_t(rng.randint(0, E));
        again = e == skip;
        for (int64_t j = 0; j < k; ++j) again = again || p[t * K + j] == e;
      } while (again);
      p[t * K + k] = e;
    }
  return idx;
}

// The CPU's dispatch plan of top-k ids (ops.h, make_dispatch_plan): what the CUDA plan must equal.
struct Plan {
  Tensor offsets, assign_of_row, row_of_assign;
};
inline Plan cpu_plan(const Tensor& idx, int64_t E) {
  const int64_t T = idx.size(0), K = idx.size(1);
  Plan p{Tensor::empty({E + 1}, DType::I64), Tensor::empty({T * K}, DType::I32), Tensor::empty({T, K}, DType::I32)};
  cpu::make_dispatch_plan(idx, E, p.offsets, p.assign_of_row, p.row_of_assign);
  return p;
}
// The CUDA plan of the same (host) ids, on the device.
inline Plan cuda_plan(const Tensor& idx_cpu, int64_t E) {
  const int64_t T = idx_cpu.size(0), K = idx_cpu.size(1);
  const Device d = Device::CUDA;
  Plan p{Tensor::empty({E + 1}, DType::I64, d), Tensor::empty({T * K}, DType::I32, d),
         Tensor::empty({T, K}, DType::I32, d)};
  cuda::make_dispatch_plan(idx_cpu.to(d), E, p.offsets, p.assign_of_row, p.row_of_assign);
  return p;
}

// Integer tensors equal element for element (any device; no f32 round trip), naming the first mismatch.
template <class T>
void expect_equal_ints(const Tensor& got_any, const Tensor& want, const char* what) {
  const Tensor got = got_any.to(Device::CPU);
  ASSERT_EQ(got.shape(), want.shape()) << what;
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (got.data<T>()[i] != want.data<T>()[i] && mismatches++ == 0) first = i;
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at " << first;
}

}  // namespace mt::cudatest
