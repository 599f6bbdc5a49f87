// CPU reference for the MoE router (softmax, top-k, optional renormalisation, and their backward)
// and for the load-balancing aux loss, matching transformers' Qwen3MoeSparseMoeBlock and
// load_balancing_loss_func in fp32. Reductions (softmax sums, dot products, column sums) run in fp64
// so that this file can serve as the reference the CUDA kernels and parallel layouts are held to.
// Also the load-balancing options beside the aux loss: the biased top-k selection and its bias update
// (aux-loss-free balancing, DeepSeek-V3) and the router z-loss (ST-MoE).
// Shapes and scalar arguments are checked by the dispatch (ops/op_checks.h); dtypes and expert ids here.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace mt::cpu {

namespace {

void check_expert_id(int32_t e, int64_t E, int64_t t, int64_t k, const char* op) {
  if (e < 0 || e >= E)
    MT_THROW(op, ": token ", t, " choice ", k, " has expert id ", e, ", expected a value in [0, ", E, ")");
}

}  // namespace

void router_fwd(const Tensor& logits_TE, int64_t K, bool norm_topk, Tensor& probs_TE, Tensor& topk_idx_TK,
                Tensor& topk_w_TK, const Tensor* bias_E) {
  check_dtype(logits_TE, DType::F32, "router_fwd logits_TE");
  check_dtype(probs_TE, DType::F32, "router_fwd probs_TE");
  check_dtype(topk_idx_TK, DType::I32, "router_fwd topk_idx_TK");
  check_dtype(topk_w_TK, DType::F32, "router_fwd topk_w_TK");
  if (bias_E) check_dtype(*bias_E, DType::F32, "router_fwd bias_E");
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1);

  const float* logits = logits_TE.data<float>();
  float* probs = probs_TE.data<float>();
  int32_t* idx = topk_idx_TK.data<int32_t>();
  float* w = topk_w_TK.data<float>();
  std::vector<double> ex(static_cast<size_t>(E));
  std::vector<char> taken(static_cast<size_t>(E));
  std::vector<float> score(static_cast<size_t>(E));
  const float* bias = bias_E ? bias_E->data<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    float* p = probs + t * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::fmax(mx, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += ex[size_t(e)] = std::exp(double(l[e]) - double(mx));
    for (int64_t e = 0; e < E; ++e) p[e] = float(ex[size_t(e)] / sum);
    // The selection score: the probability, plus the balancing bias when given (one f32 add, as CUDA).
    for (int64_t e = 0; e < E; ++e) score[size_t(e)] = bias ? p[e] + bias[e] : p[e];

    // Selection by repeated scans rather than std::sort: K is small, and a NaN row must not make the
    // comparator inconsistent. Strict '>' keeps the lower expert index on ties.
    std::fill(taken.begin(), taken.end(), 0);
    double wsum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[size_t(e)] && (best < 0 || score[size_t(e)] > score[size_t(best)])) best = e;
      taken[size_t(best)] = 1;
      idx[t * K + k] = int32_t(best);
      w[t * K + k] = p[best];
      wsum += p[best];
    }
    if (norm_topk)
      for (int64_t k = 0; k < K; ++k) w[t * K + k] = float(double(w[t * K + k]) / wsum);
  }
}

void router_bwd(const Tensor& dtopk_w_TK, const Tensor* dprobs_TE, const Tensor& probs_TE, const Tensor& topk_idx_TK,
                bool norm_topk, Tensor& dlogits_TE) {
  check_dtype(probs_TE, DType::F32, "router_bwd probs_TE");
  check_dtype(dtopk_w_TK, DType::F32, "router_bwd dtopk_w_TK");
  check_dtype(topk_idx_TK, DType::I32, "router_bwd topk_idx_TK");
  if (dprobs_TE) check_dtype(*dprobs_TE, DType::F32, "router_bwd dprobs_TE");
  check_dtype(dlogits_TE, DType::F32, "router_bwd dlogits_TE");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1), K = dtopk_w_TK.size(1);

  const float* dw = dtopk_w_TK.data<float>();
  const float* dprobs = dprobs_TE ? dprobs_TE->data<float>() : nullptr;
  const float* probs = probs_TE.data<float>();
  const int32_t* idx = topk_idx_TK.data<int32_t>();
  float* dlogits = dlogits_TE.data<float>();
  std::vector<double> dP(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs + t * E;
    const float* dwt = dw + t * K;
    const int32_t* it = idx + t * K;
    for (int64_t e = 0; e < E; ++e) dP[size_t(e)] = dprobs ? double(dprobs[t * E + e]) : 0.0;
    for (int64_t k = 0; k < K; ++k) check_expert_id(it[k], E, t, k, "router_bwd");

    if (norm_topk) {
      // w_k = p_k / s with s = sum_j p_j, so dL/dp_k = (dW_k - sum_j dW_j w_j) / s.
      double s = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) s += p[it[k]];
      for (int64_t k = 0; k < K; ++k) dot += double(dwt[k]) * (double(p[it[k]]) / s);
      for (int64_t k = 0; k < K; ++k) dP[size_t(it[k])] += (double(dwt[k]) - dot) / s;
    } else {
      for (int64_t k = 0; k < K; ++k) dP[size_t(it[k])] += double(dwt[k]);
    }

    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(p[e]) * dP[size_t(e)];
    for (int64_t e = 0; e < E; ++e) dlogits[t * E + e] = float(double(p[e]) * (dP[size_t(e)] - dot));
  }
}

void expert_counts(const Tensor& topk_idx_TK, int64_t E, Tensor& counts_E) {
  check_dtype(topk_idx_TK, DType::I32, "expert_counts topk_idx_TK");
  check_dtype(counts_E, DType::I64, "expert_counts counts_E");
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1);
  const int32_t* idx = topk_idx_TK.data<int32_t>();
  int64_t* counts = counts_E.data<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      check_expert_id(e, E, t, k, "expert_counts");
      ++counts[e];
    }
}

void prob_column_sums(const Tensor& probs_TE, Tensor& sums_E) {
  check_dtype(probs_TE, DType::F32, "prob_column_sums probs_TE");
  check_dtype(sums_E, DType::F32, "prob_column_sums sums_E");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1);
  const float* p = probs_TE.data<float>();
  float* sums = sums_E.data<float>();
  std::vector<double> acc(static_cast<size_t>(E), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) acc[size_t(e)] += p[t * E + e];
  for (int64_t e = 0; e < E; ++e) sums[e] = float(double(sums[e]) + acc[size_t(e)]);
}

double aux_loss_value(const Tensor& counts_E, const Tensor& sums_E, int64_t N) {
  check_dtype(counts_E, DType::I64, "aux_loss_value counts_E");
  check_dtype(sums_E, DType::F32, "aux_loss_value sums_E");
  const int64_t E = counts_E.size(0);
  const int64_t* counts = counts_E.data<int64_t>();
  const float* sums = sums_E.data<float>();
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += (double(counts[e]) / double(N)) * (double(sums[e]) / double(N));
  return double(E) * acc;
}

void aux_loss_bwd(const Tensor& counts_E, int64_t N, float dloss, Tensor& dprobs_TE) {
  check_dtype(counts_E, DType::I64, "aux_loss_bwd counts_E");
  check_dtype(dprobs_TE, DType::F32, "aux_loss_bwd dprobs_TE");
  const int64_t E = counts_E.size(0), T = dprobs_TE.size(0);
  const int64_t* counts = counts_E.data<int64_t>();
  std::vector<float> g(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) g[size_t(e)] = float(double(dloss) * double(E) * double(counts[e]) / (double(N) * N));
  float* d = dprobs_TE.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) d[t * E + e] += g[size_t(e)];
}

void router_z_loss_fwd(const Tensor& logits_TE, Tensor& lse_T, Tensor& zsum) {
  check_dtype(logits_TE, DType::F32, "router_z_loss_fwd logits_TE");
  check_dtype(lse_T, DType::F32, "router_z_loss_fwd lse_T");
  check_dtype(zsum, DType::F32, "router_z_loss_fwd zsum");
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1);
  const float* logits = logits_TE.data<float>();
  float* lse = lse_T.data<float>();
  double acc = 0;
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::fmax(mx, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - double(mx));
    const double v = double(mx) + std::log(sum);
    lse[t] = float(v);
    acc += v * v;
  }
  zsum.data<float>()[0] = float(double(zsum.data<float>()[0]) + acc);
}

void router_z_loss_bwd(const Tensor& lse_T, const Tensor& probs_TE, float scale, Tensor& dlogits_TE) {
  check_dtype(probs_TE, DType::F32, "router_z_loss_bwd probs_TE");
  check_dtype(lse_T, DType::F32, "router_z_loss_bwd lse_T");
  check_dtype(dlogits_TE, DType::F32, "router_z_loss_bwd dlogits_TE");
  const int64_t T = probs_TE.size(0), E = probs_TE.size(1);
  const float* lse = lse_T.data<float>();
  const float* p = probs_TE.data<float>();
  float* d = dlogits_TE.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const double g = double(scale) * 2.0 * double(lse[t]);  // the CUDA kernel's expression
    for (int64_t e = 0; e < E; ++e) d[t * E + e] += float(g * double(p[t * E + e]));
  }
}

void router_bias_update(const Tensor& counts_LE, float rate, Tensor& bias_LE) {
  check_dtype(counts_LE, DType::I64, "router_bias_update counts_LE");
  check_dtype(bias_LE, DType::F32, "router_bias_update bias_LE");
  const int64_t L = counts_LE.size(0), E = counts_LE.size(1);
  const int64_t* c = counts_LE.data<int64_t>();
  float* b = bias_LE.data<float>();
  for (int64_t l = 0; l < L; ++l) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += c[l * E + e];
    // sign(mean - c) = sign(total - E * c): exact in integers, no rounding of the mean.
    for (int64_t e = 0; e < E; ++e) {
      const int64_t diff = total - E * c[l * E + e];
      const float s = diff > 0 ? 1.0f : diff < 0 ? -1.0f : 0.0f;
      b[l * E + e] += rate * s;
    }
  }
}

}  // namespace mt::cpu
