// Helpers the benchmark programs share: wall-clock seconds, and the device's bf16 GEMM rate and copy
// bandwidth measured in the same process (the ceilings MFU and the memory floors are stated against).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/rng.h"
#include "model/config.h"
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

// Bytes one decode step must read for B sequences at the given total context (tokens in their caches): the
// weights it touches (attention, routers, the experts B tokens reach in expectation under uniform routing,
// the LM head) and every sequence's KV cache. The decode floors of generate and rl_step divide it by the
// measured copy bandwidth.
inline double decode_step_bytes(const ModelConfig& c, int64_t B, double context_tokens, int64_t w_bytes, int64_t kv_bytes) {
  const double D = double(c.hidden_size), H = double(c.num_attention_heads), G = double(c.num_key_value_heads),
               Hd = double(c.head_dim), E = double(c.num_experts), K = double(c.num_experts_per_tok);
  double params = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    params += D * H * Hd * 2 + D * G * Hd * 2 + 2 * Hd + 2 * D;  // q, o, k, v, q/k norms, the two norms
    const bool dense = std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), l) != c.mlp_only_layers.end() ||
                       c.num_experts == 0;
    if (dense) {
      params += 3 * D * double(c.intermediate_size);
    } else {
      const double touched = E * (1 - std::pow(1 - K / E, double(B)));  // expected distinct experts
      params += E * D + touched * 3 * D * double(c.moe_intermediate_size);
    }
  }
  params += D + double(c.vocab_size) * D + double(B) * D;  // final norm, LM head, embedding rows
  const double kv = context_tokens * double(c.num_hidden_layers) * 2 * G * Hd * double(kv_bytes);
  return params * double(w_bytes) + kv;
}

}  // namespace mt::bench
