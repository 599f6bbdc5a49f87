// Comparing `moetrain grads` outputs across parallel layouts: a batch for a model directory, the
// relative L2 error, and expect_same (loss, logits and every gradient of a layout against one
// process, at DESIGN's fp32 layout tolerance), shared by the FSDP/EP and the TP equivalence tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/rng.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"

namespace mt::test {

// A batch file (input_ids, labels i64 [B, S], every fifth label -100) for the model in `dir`, written
// to `path`. The default 4 × 12 divides over 1, 2 and 4 data-parallel ranks.
inline std::string make_batch(const std::string& dir, const std::string& path, int64_t B = 4, int64_t S = 12,
                              uint64_t seed = 42) {
  std::ifstream f(dir + "/config.json");
  const int64_t V = nlohmann::json::parse(f)["vocab_size"].get<int64_t>();
  Tensor ids = Tensor::empty({B, S}, DType::I64), labels = Tensor::empty({B, S}, DType::I64);
  Rng rng(seed);
  for (int64_t i = 0; i < B * S; ++i) {
    ids.data<int64_t>()[i] = rng.randint(0, V);
    labels.data<int64_t>()[i] = i % 5 == 3 ? -100 : ids.data<int64_t>()[i];
  }
  write_safetensors(path, {{"input_ids", ids}, {"labels", labels}});
  return path;
}

inline double rel_l2(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  const float* x = a.data<float>();
  const float* y = b.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    den += double(y[i]) * y[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Loss, logits and all gradients together within 1e-6 (DESIGN's fp32 tolerance for layouts). Each
// gradient tensor within 2e-6: a data-parallel gradient is the sum of per-rank partial sums that the
// ops round to f32, and where those partials cancel (norm weights, rarely routed experts) the
// rounding shows up to ~1.1e-6 relative in single tensors (measured: aux model, 4 ranks).
// With MT_REPORT_ABOVE_1E6 set, every tensor above 1e-6 is printed (measured: only the q_norm / k_norm
// weight gradients, 16-element sums over every token and head whose partial sums cancel ~30-fold,
// and rarely an expert's up_proj at 1.0e-6).
// `worst`, when given, receives the largest relative error of any single tensor (loss, logits, a
// gradient); `all_grads` the error of all gradients together.
inline void expect_same(const std::string& got_path, const std::string& ref_path, const std::string& what,
                        double* worst = nullptr, double* all_grads = nullptr) {
  SafetensorsFile got(got_path), ref(ref_path);
  ASSERT_EQ(got.names().size(), ref.names().size()) << what;
  double num = 0, den = 0;
  for (const std::string& n : ref.names()) {
    ASSERT_TRUE(got.has(n)) << what << ": missing " << n;
    Tensor g = got.read_f32(n), r = ref.read_f32(n);
    ASSERT_EQ(g.shape(), r.shape()) << what << ": " << n;
    for (int64_t i = 0; i < g.numel(); ++i) ASSERT_FALSE(std::isnan(g.data<float>()[i])) << what << ": NaN in " << n;
    const bool grad = n.rfind("grad.", 0) == 0;
    const double err = rel_l2(g, r);
    if (worst) *worst = std::max(*worst, err);
    if (err > 1e-6 && std::getenv("MT_REPORT_ABOVE_1E6")) std::printf("[ above 1e-6 ] %s: %s %.3g\n", what.c_str(), n.c_str(), err);
    EXPECT_LE(err, grad ? 2e-6 : 1e-6) << what << ": " << n;
    if (grad)
      for (int64_t i = 0; i < g.numel(); ++i) {
        const double d = double(g.data<float>()[i]) - r.data<float>()[i];
        num += d * d;
        den += double(r.data<float>()[i]) * r.data<float>()[i];
      }
  }
  if (all_grads) *all_grads = std::sqrt(num / den);
  EXPECT_LE(std::sqrt(num / den), 1e-6) << what << ": all gradients together";
}

// The checkpoint a layout's run wrote from its shards (got_dir) holds the same parameters as the one-
// process run's (ref_dir): after many AdamW steps each tensor within 1e-5, all together within 1e-6.
inline void expect_same_checkpoint(const std::string& got_dir, const std::string& ref_dir, const std::string& what) {
  CheckpointReader a(got_dir), b(ref_dir);
  ASSERT_EQ(a.names(), b.names()) << what;
  double num = 0, den = 0;
  for (const std::string& name : b.names()) {
    Tensor x = a.read_f32(name), y = b.read_f32(name);
    ASSERT_EQ(x.shape(), y.shape()) << what << ": " << name;
    EXPECT_LE(rel_l2(x, y), 1e-5) << what << ": " << name;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double d = double(x.data<float>()[i]) - y.data<float>()[i];
      num += d * d;
      den += double(y.data<float>()[i]) * y.data<float>()[i];
    }
  }
  EXPECT_LE(std::sqrt(num / den), 1e-6) << what << ": all parameters together";
}

}  // namespace mt::test
