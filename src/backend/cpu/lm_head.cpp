// CPU LM head, chunked over tokens: fused with cross-entropy (built from the CPU ops themselves), and
// the per-token log-probabilities, entropies and objective gradient that RL losses use (the logits
// GEMMs from the CPU ops, the per-row softmax statistics in fp64). The reference for the CUDA kernels,
// which must give the same values and gradients. Shapes are checked by the dispatch (op_checks.h);
// labels are checked here, before anything is written.
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

namespace {

constexpr int64_t kIgnoreIndex = -100;

int64_t default_chunk_rows(int64_t V) {
  return std::max<int64_t>(1, (int64_t(64) << 20) / (4 * std::max<int64_t>(V, 1)));
}

// Every label is in [0, V) or -100; the first one that is not is an error naming its row and value.
void check_labels(const Tensor& labels_T, int64_t V, const char* op) {
  check_dtype(labels_T, DType::I64, str(op, " labels_T").c_str());
  const int64_t* labels = labels_T.data<int64_t>();
  for (int64_t t = 0; t < labels_T.numel(); ++t)
    if (labels[t] != kIgnoreIndex && (labels[t] < 0 || labels[t] >= V))
      MT_THROW(op, ": label ", labels[t], " at row ", t, " is out of range: labels must be in [0, ", V, ") or ",
               kIgnoreIndex, " (ignored)");
}

// Softmax statistics of one row of logits, in fp64: lse = log sum_v exp(x_v) and, when wanted, the
// entropy H = -sum_v p_v log p_v = sum_v p_v (lse - x_v) (a sum of non-negative terms).
struct RowStats {
  double lse, entropy;
};
RowStats row_stats(const float* x, int64_t V, bool want_entropy) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(x[v]));
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(x[v]) - mx);
  RowStats s{mx + std::log(sum), 0.0};
  if (want_entropy)
    for (int64_t v = 0; v < V; ++v) s.entropy += std::exp(double(x[v]) - s.lse) * (s.lse - double(x[v]));
  return s;
}

}  // namespace

void lm_head_cross_entropy(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, float scale,
                           int64_t chunk_rows, Tensor& loss_sum, Tensor& dhn_TD, Tensor& dw_VD, bool accumulate_dw) {
  const int64_t T = hn_TD.size(0), V = w_VD.size(0);
  check_dtype(loss_sum, DType::F32, "lm_head_cross_entropy loss_sum");
  if (chunk_rows <= 0) chunk_rows = default_chunk_rows(V);
  if (!accumulate_dw && T == 0) dw_VD.zero_();  // no chunk writes it
  double total = 0;
  for (int64_t t0 = 0; t0 < T; t0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, T - t0);
    Tensor hn = hn_TD.rows(t0, n), labels = labels_T.rows(t0, n), dhn = dhn_TD.rows(t0, n);
    Tensor logits = Tensor::empty({n, V}), lse = Tensor::empty({n}), dlogits = Tensor::empty({n, V});
    linear_fwd(hn, w_VD, logits);
    int64_t valid = 0;
    total += cross_entropy_fwd(logits, labels, lse, &valid);
    cross_entropy_bwd(logits, labels, lse, scale, dlogits);
    linear_bwd(dlogits, hn, w_VD, &dhn, false, dw_VD, accumulate_dw || t0 > 0);
  }
  loss_sum.data<float>()[0] += float(total);
}

void lm_head_logprobs(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, int64_t chunk_rows,
                      Tensor& logp_T, Tensor* entropy_T) {
  const char* op = "lm_head_logprobs";
  const int64_t T = hn_TD.size(0), V = w_VD.size(0);
  check_dtype(hn_TD, DType::F32, "lm_head_logprobs hn_TD");
  check_dtype(w_VD, DType::F32, "lm_head_logprobs w_VD");
  check_dtype(logp_T, DType::F32, "lm_head_logprobs logp_T");
  if (entropy_T) check_dtype(*entropy_T, DType::F32, "lm_head_logprobs entropy_T");
  check_labels(labels_T, V, op);
  if (chunk_rows <= 0) chunk_rows = default_chunk_rows(V);
  const int64_t* labels = labels_T.data<int64_t>();
  float* logp = logp_T.data<float>();
  float* entropy = entropy_T ? entropy_T->data<float>() : nullptr;
  for (int64_t t0 = 0; t0 < T; t0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, T - t0);
    Tensor logits = Tensor::empty({n, V});
    linear_fwd(hn_TD.rows(t0, n), w_VD, logits);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i, label = labels[t];
      if (label == kIgnoreIndex) {
        logp[t] = 0.0f;
        if (entropy) entropy[t] = 0.0f;
        continue;
      }
      const float* x = logits.data<float>() + i * V;
      const RowStats s = row_stats(x, V, entropy != nullptr);
      logp[t] = float(double(x[label]) - s.lse);
      if (entropy) entropy[t] = float(s.entropy);
    }
  }
}

void lm_head_objective_bwd(const Tensor& hn_TD, const Tensor& w_VD, const Tensor& labels_T, const Tensor& dlogp_T,
                           const Tensor* dentropy_T, int64_t chunk_rows, Tensor& dhn_TD, Tensor& dw_VD,
                           bool accumulate_dw) {
  const char* op = "lm_head_objective_bwd";
  const int64_t T = hn_TD.size(0), V = w_VD.size(0);
  check_dtype(hn_TD, DType::F32, "lm_head_objective_bwd hn_TD");
  check_dtype(w_VD, DType::F32, "lm_head_objective_bwd w_VD");
  check_dtype(dhn_TD, DType::F32, "lm_head_objective_bwd dhn_TD");
  check_dtype(dw_VD, DType::F32, "lm_head_objective_bwd dw_VD");
  check_dtype(dlogp_T, DType::F32, "lm_head_objective_bwd dlogp_T");
  if (dentropy_T) check_dtype(*dentropy_T, DType::F32, "lm_head_objective_bwd dentropy_T");
  check_labels(labels_T, V, op);
  if (chunk_rows <= 0) chunk_rows = default_chunk_rows(V);
  if (!accumulate_dw && T == 0) dw_VD.zero_();  // no chunk writes it
  const int64_t* labels = labels_T.data<int64_t>();
  const float* dlogp = dlogp_T.data<float>();
  const float* dentropy = dentropy_T ? dentropy_T->data<float>() : nullptr;
  for (int64_t t0 = 0; t0 < T; t0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, T - t0);
    Tensor hn = hn_TD.rows(t0, n), dhn = dhn_TD.rows(t0, n);
    Tensor logits = Tensor::empty({n, V}), dlogits = Tensor::empty({n, V});
    linear_fwd(hn, w_VD, logits);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i, label = labels[t];
      const float* x = logits.data<float>() + i * V;
      float* d = dlogits.data<float>() + i * V;
      if (label == kIgnoreIndex) {
        for (int64_t v = 0; v < V; ++v) d[v] = 0.0f;
        continue;
      }
      // dL/dx_v = g (onehot_v - p_v) + h dH/dx_v, with dH/dx_v = -p_v (log p_v + H).
      const double g = dlogp[t], h = dentropy ? double(dentropy[t]) : 0.0;
      const RowStats s = row_stats(x, V, dentropy != nullptr);
      for (int64_t v = 0; v < V; ++v) {
        const double logp = double(x[v]) - s.lse, p = std::exp(logp);
        d[v] = float(g * ((v == label ? 1.0 : 0.0) - p) - h * p * (logp + s.entropy));
      }
    }
    linear_bwd(dlogits, hn, w_VD, &dhn, false, dw_VD, accumulate_dw || t0 > 0);
  }
}

void copy_cast(const Tensor& src, Tensor& dst) {
  MT_CHECK(src.shape() == dst.shape(), "copy_cast ", src.desc(), " into ", dst.desc());
  dst.copy_from(src.to(dst.dtype()));
}

}  // namespace mt::cpu
