// CPU cross-entropy over vocabulary rows with ignore index -100. The log-sum-exp and the loss sum
// are computed in fp64 (a vocab of 150k f32 terms would otherwise lose digits); lse is saved in f32
// for the backward. Labels are checked before anything is written.
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

namespace {

constexpr int64_t kIgnoreIndex = -100;

// Checks the dtypes of logits_TV (f32), labels_T (i64) and lse_T (f32), and that each label is in [0, V)
// or -100 (the shapes are op_checks.h's, checked by the dispatch).
void check_ce_args(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, const char* op) {
  check_dtype(logits_TV, DType::F32, str(op, " logits_TV").c_str());
  check_dtype(labels_T, DType::I64, str(op, " labels_T").c_str());
  check_dtype(lse_T, DType::F32, str(op, " lse_T").c_str());
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const int64_t* labels = labels_T.data<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    if (labels[t] != kIgnoreIndex && (labels[t] < 0 || labels[t] >= V))
      MT_THROW(op, ": label ", labels[t], " at row ", t, " is out of range: labels must be in [0, ", V, ") or ",
               kIgnoreIndex, " (ignored)");
}

}  // namespace

double cross_entropy_fwd(const Tensor& logits_TV, const Tensor& labels_T, Tensor& lse_T, int64_t* n_valid) {
  check_ce_args(logits_TV, labels_T, lse_T, "cross_entropy_fwd");
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  const float* logits = logits_TV.data<float>();
  const int64_t* labels = labels_T.data<int64_t>();
  float* lse_out = lse_T.data<float>();
  double loss = 0;
  int64_t valid = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits + t * V;
    double mx = -INFINITY;  // not row[0]: a direct call may pass V == 0 (with every label -100)
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, double(row[j]));
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(double(row[j]) - mx);
    const double lse = mx + std::log(sum);
    lse_out[t] = float(lse);
    if (labels[t] == kIgnoreIndex) continue;
    loss += lse - double(row[labels[t]]);
    ++valid;
  }
  if (n_valid) *n_valid = valid;
  return loss;
}

void cross_entropy_bwd(const Tensor& logits_TV, const Tensor& labels_T, const Tensor& lse_T, float scale,
                       Tensor& dlogits_TV) {
  check_ce_args(logits_TV, labels_T, lse_T, "cross_entropy_bwd");
  const int64_t T = logits_TV.size(0), V = logits_TV.size(1);
  check_dtype(dlogits_TV, DType::F32, "cross_entropy_bwd dlogits_TV");
  const float* logits = logits_TV.data<float>();
  const int64_t* labels = labels_T.data<int64_t>();
  const float* lse = lse_T.data<float>();
  float* dlogits = dlogits_TV.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits + t * V;
    float* drow = dlogits + t * V;
    if (labels[t] == kIgnoreIndex) {
      for (int64_t j = 0; j < V; ++j) drow[j] = 0.0f;
      continue;
    }
    const double l = lse[t];
    for (int64_t j = 0; j < V; ++j) drow[j] = float(double(scale) * std::exp(double(row[j]) - l));
    drow[labels[t]] = float(double(scale) * (std::exp(double(row[labels[t]]) - l) - 1.0));
  }
}

}  // namespace mt::cpu
