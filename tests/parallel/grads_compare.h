// Comparing what `moetrain grads` writes under a parallel layout with what one process writes: the
// checks every layout-equivalence test shares (DESIGN: ≤ 1e-6 relative in fp32), and the batch
// files they feed it.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/rng.h"
#include "io/safetensors.h"

namespace mt::test {

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

// A batch file (input_ids, labels i64 [B, S], every fifth label -100) for the model in `model_dir`.
inline void write_grads_batch(const std::string& model_dir, int64_t B, int64_t S, const std::string& path,
                              uint64_t seed = 42) {
  std::ifstream f(model_dir + "/config.json");
  const int64_t V = nlohmann::json::parse(f)["vocab_size"].get<int64_t>();
  Tensor ids = Tensor::empty({B, S}, DType::I64), labels = Tensor::empty({B, S}, DType::I64);
  Rng rng(seed);
  for (int64_t i = 0; i < B * S; ++i) {
    ids.data<int64_t>()[i] = rng.randint(0, V);
    labels.data<int64_t>()[i] = i % 5 == 3 ? -100 : ids.data<int64_t>()[i];
  }
  write_safetensors(path, {{"input_ids", ids}, {"labels", labels}});
}

// Loss, logits and all gradients together within 1e-6 (DESIGN's fp32 tolerance for layouts). Each
// gradient tensor within 2e-6: a parallel gradient is the sum of per-rank partial sums that the ops
// round to f32, and where those partials cancel (norm weights, rarely routed experts) the rounding
// shows up to ~1.2e-6 relative in single tensors. Returns the largest per-tensor error and the error
// of all gradients together (for reports).
inline std::pair<double, double> expect_same(const std::string& got_path, const std::string& ref_path,
                                             const std::string& what) {
  SafetensorsFile got(got_path), ref(ref_path);
  EXPECT_EQ(got.names().size(), ref.names().size()) << what;
  double num = 0, den = 0, worst = 0;
  for (const std::string& n : ref.names()) {
    if (!got.has(n)) {
      ADD_FAILURE() << what << ": missing " << n;
      continue;
    }
    Tensor g = got.read_f32(n), r = ref.read_f32(n);
    if (g.shape() != r.shape()) {
      ADD_FAILURE() << what << ": " << n << " is " << shape_str(g.shape()) << ", expected " << shape_str(r.shape());
      continue;
    }
    bool nan = false;
    for (int64_t i = 0; i < g.numel(); ++i) nan = nan || std::isnan(g.data<float>()[i]);
    EXPECT_FALSE(nan) << what << ": NaN in " << n;
    const bool grad = n.rfind("grad.", 0) == 0;
    const double e = rel_l2(g, r);
    worst = std::max(worst, e);
    EXPECT_LE(e, grad ? 2e-6 : 1e-6) << what << ": " << n;
    if (grad)
      for (int64_t i = 0; i < g.numel(); ++i) {
        const double d = double(g.data<float>()[i]) - r.data<float>()[i];
        num += d * d;
        den += double(r.data<float>()[i]) * r.data<float>()[i];
      }
  }
  const double all = den > 0 ? std::sqrt(num / den) : 0;
  EXPECT_LE(all, 1e-6) << what << ": all gradients together";
  return {worst, all};
}

}  // namespace mt::test
