// Helpers the benchmark programs share: wall-clock seconds, and the device's bf16 GEMM rate and copy
// bandwidth measured in the same process (the ceilings MFU and the memory floors are stated against).
#pragma once
#include <chrono>

#include "core/rng.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace mt::bench {

using Clock = std::chrono::steady_clock;

inline double secs(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// Dense bf16 GEMM rate of this device through the same cuBLASLt path the model uses.
inline double measure_gemm_tflops(Device dev) {
  if (dev != Device::CUDA) return 0;
  const int64_t n = 8192;
  Rng rng(1);
  Tensor a = Tensor::empty({n, n});
  rng.fill_normal(a, 0, 1);
  Tensor x = a.to(DType::BF16).to(Device::CUDA), w = x.clone(), y = Tensor::empty({n, n}, DType::BF16, dev);
  for (int i = 0; i < 3; ++i) ops::linear_fwd(x, w, y);
  device_mem::synchronize(dev);
  const int reps = 20;
  auto t = Clock::now();
  for (int i = 0; i < reps; ++i) ops::linear_fwd(x, w, y);
  device_mem::synchronize(dev);
  return 2.0 * double(n) * n * n * reps / secs(t) / 1e12;
}

inline double measure_copy_gbps(Device dev) {
  if (dev != Device::CUDA) return 0;
  const int64_t n = int64_t(1) << 28;  // 1 GiB of f32
  Tensor a = Tensor::zeros({n}, DType::F32, dev), b = Tensor::zeros({n}, DType::F32, dev);
  b.copy_from(a);
  device_mem::synchronize(dev);
  auto t = Clock::now();
  for (int i = 0; i < 5; ++i) b.copy_from(a);
  device_mem::synchronize(dev);
  return 2.0 * double(a.nbytes()) * 5 / secs(t) / 1e9;  // read + write
}

}  // namespace mt::bench
