// CPU causal grouped-query attention, the reference for the CUDA (cuDNN/flash) kernels.
// Per sequence b and query head h (kv head g = h / (H/G)): scores = scale * Q K^T over the causal
// triangle, P = softmax(scores), out = P V, and lse = log-sum-exp of the scaled scores is saved.
// The score and value products go through sgemm on strided views of the [T, heads, Hd] tensors
// (leading dims H*Hd and G*Hd), so nothing is gathered; the softmax statistics are kept in fp64.
// The backward recomputes P from the saved lse (bit-identical to the forward's scores), then uses
// the flash-attention identities D_i = sum(dO_i * O_i), dS = P * (dP - D).
// Packed rows (doc_start_T): query i of a row sees keys start[i] .. i only; the products are still
// computed over the whole row (the masked ones are ignored), which keeps the code one path.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/attention_row.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"
#include "core/determinism.h"
#include "ops/attention_shapes.h"

namespace mt::cpu {

namespace {

using AttnDims = ops::AttentionDims;

// Dtypes here; the shapes by the check all backends share.
AttnDims check_attention_args(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                              const char* op) {
  check_dtype(q_THHd, DType::F32, str(op, " q_THHd").c_str());
  check_dtype(k_TGHd, DType::F32, str(op, " k_TGHd").c_str());
  check_dtype(v_TGHd, DType::F32, str(op, " v_TGHd").c_str());
  return ops::check_attention_shapes(q_THHd, k_TGHd, v_TGHd, B, S, op);
}

// The first key each query of a row sees: 0 (plain causal) or its document's start (packed rows).
// Checks that every start lies in [0, i] and that a query's start is also its predecessor's when the
// predecessor lies in its document (starts are non-decreasing and constant within a document).
std::vector<int32_t> first_keys(const Tensor* doc_start_T, int64_t B, int64_t S, const char* op) {
  std::vector<int32_t> first(size_t(B * S), 0);
  if (!doc_start_T) return first;
  check_dtype(*doc_start_T, DType::I32, str(op, " doc_start_T").c_str());
  check_shape(*doc_start_T, {B * S}, str(op, " doc_start_T").c_str());
  const int32_t* ds = doc_start_T->data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      const int32_t st = ds[b * S + i];
      const bool ok = st >= 0 && st <= i && (st == i || (i > 0 && ds[b * S + i - 1] == st));
      if (!ok)
        MT_THROW(op, ": doc_start_T row ", b, " position ", i, " is ", st,
                 "; each token's document start must lie in [0, ", i,
                 "] and be its predecessor's too unless it starts a document there");
      first[size_t(b * S + i)] = st;
    }
  return first;
}

// P[i, j] = exp(scores[i, j] - lse[i]) for first[i] <= j <= i, else 0. scores holds the scaled
// scores on entry (row stride S) and P on exit.
void probs_from_lse(float* scores, const float* lse_rows, int64_t lse_stride, int64_t S, const int32_t* first) {
  for (int64_t i = 0; i < S; ++i) {
    float* row = scores + i * S;
    const double lse = lse_rows[i * lse_stride];
    for (int64_t j = 0; j < first[i]; ++j) row[j] = 0.0f;
    for (int64_t j = first[i]; j <= i; ++j) row[j] = float(std::exp(double(row[j]) - lse));
    for (int64_t j = i + 1; j < S; ++j) row[j] = 0.0f;
  }
}

}  // namespace

void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                   Tensor& out_THHd, Tensor& lse_TH, const Tensor* doc_start_T) {
  const AttnDims d = check_attention_args(q_THHd, k_TGHd, v_TGHd, B, S, "attention_fwd");
  const std::vector<int32_t> first = first_keys(doc_start_T, B, S, "attention_fwd");
  check_shape(out_THHd, {d.T, d.H, d.Hd}, "attention_fwd out_THHd");
  check_dtype(out_THHd, DType::F32, "attention_fwd out_THHd");
  check_shape(lse_TH, {d.T, d.H}, "attention_fwd lse_TH");
  check_dtype(lse_TH, DType::F32, "attention_fwd lse_TH");
  const int64_t H = d.H, G = d.G, Hd = d.Hd, group = H / G;
  const int64_t ldq = H * Hd, ldk = G * Hd;
  const float scale = float(1.0 / std::sqrt(double(Hd)));
  const float* q = q_THHd.data<float>();
  const float* k = k_TGHd.data<float>();
  const float* v = v_TGHd.data<float>();
  float* out = out_THHd.data<float>();
  float* lse = lse_TH.data<float>();
  if (batch_invariant()) {
    // Each query row through paged_attention_fwd's own function (attend_row): the training forward equals the
    // rollout engine's, bit for bit (core/determinism.h).
    std::vector<double> w, acc;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < S; ++i) {
          const int64_t g = h / group, j0 = first[size_t(b * S + i)];
          lse[(b * S + i) * H + h] = float(attend_row(
              q + (b * S + i) * ldq + h * Hd, i - j0 + 1, Hd, [&](int64_t j) { return k + (b * S + j0 + j) * ldk + g * Hd; },
              [&](int64_t j) { return v + (b * S + j0 + j) * ldk + g * Hd; }, w, acc, out + (b * S + i) * ldq + h * Hd));
        }
    return;
  }
  std::vector<float> scores(size_t(S * S));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const float* qh = q + b * S * ldq + h * Hd;
      const float* kg = k + b * S * ldk + g * Hd;
      const float* vg = v + b * S * ldk + g * Hd;
      float* lse_h = lse + b * S * H + h;
      // scores[S, S] = scale * Q_h K_g^T (the upper triangle is computed and ignored).
      sgemm(false, true, S, S, Hd, scale, qh, ldq, kg, ldk, 0.0f, scores.data(), S);
      for (int64_t i = 0; i < S; ++i) {
        const float* row = scores.data() + i * S;
        const int64_t j0 = first[size_t(b * S + i)];
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = j0; j <= i; ++j) mx = std::max(mx, double(row[j]));
        double sum = 0;
        for (int64_t j = j0; j <= i; ++j) sum += std::exp(double(row[j]) - mx);
        lse_h[i * H] = float(mx + std::log(sum));
      }
      probs_from_lse(scores.data(), lse_h, H, S, first.data() + b * S);
      sgemm(false, false, S, Hd, S, 1.0f, scores.data(), S, vg, ldk, 0.0f, out + b * S * ldq + h * Hd, ldq);
    }
  }
}

void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                   const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd, Tensor& dk_TGHd,
                   Tensor& dv_TGHd, const Tensor* doc_start_T) {
  const AttnDims d = check_attention_args(q_THHd, k_TGHd, v_TGHd, B, S, "attention_bwd");
  const std::vector<int32_t> first = first_keys(doc_start_T, B, S, "attention_bwd");
  const Shape q_shape{d.T, d.H, d.Hd}, kv_shape{d.T, d.G, d.Hd};
  check_shape(dout_THHd, q_shape, "attention_bwd dout_THHd");
  check_dtype(dout_THHd, DType::F32, "attention_bwd dout_THHd");
  check_shape(out_THHd, q_shape, "attention_bwd out_THHd");
  check_dtype(out_THHd, DType::F32, "attention_bwd out_THHd");
  check_shape(lse_TH, {d.T, d.H}, "attention_bwd lse_TH");
  check_dtype(lse_TH, DType::F32, "attention_bwd lse_TH");
  check_shape(dq_THHd, q_shape, "attention_bwd dq_THHd");
  check_dtype(dq_THHd, DType::F32, "attention_bwd dq_THHd");
  check_shape(dk_TGHd, kv_shape, "attention_bwd dk_TGHd");
  check_dtype(dk_TGHd, DType::F32, "attention_bwd dk_TGHd");
  check_shape(dv_TGHd, kv_shape, "attention_bwd dv_TGHd");
  check_dtype(dv_TGHd, DType::F32, "attention_bwd dv_TGHd");
  const int64_t H = d.H, G = d.G, Hd = d.Hd, group = H / G;
  const int64_t ldq = H * Hd, ldk = G * Hd;
  const float scale = float(1.0 / std::sqrt(double(Hd)));
  const float* dout = dout_THHd.data<float>();
  const float* q = q_THHd.data<float>();
  const float* k = k_TGHd.data<float>();
  const float* v = v_TGHd.data<float>();
  const float* out = out_THHd.data<float>();
  const float* lse = lse_TH.data<float>();
  float* dq = dq_THHd.data<float>();
  float* dk = dk_TGHd.data<float>();
  float* dv = dv_TGHd.data<float>();
  // dk and dv are sums over the query heads of each group; they start from zero (contract: =).
  dk_TGHd.zero_();
  dv_TGHd.zero_();
  std::vector<float> p(size_t(S * S)), dp(size_t(S * S));
  std::vector<double> delta(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const int64_t qoff = b * S * ldq + h * Hd, koff = b * S * ldk + g * Hd;
      sgemm(false, true, S, S, Hd, scale, q + qoff, ldq, k + koff, ldk, 0.0f, p.data(), S);
      probs_from_lse(p.data(), lse + b * S * H + h, H, S, first.data() + b * S);
      // dV_g += P^T dO_h
      sgemm(true, false, S, Hd, S, 1.0f, p.data(), S, dout + qoff, ldq, 1.0f, dv + koff, ldk);
      // dP = dO_h V_g^T
      sgemm(false, true, S, S, Hd, 1.0f, dout + qoff, ldq, v + koff, ldk, 0.0f, dp.data(), S);
      for (int64_t i = 0; i < S; ++i) {
        const float* doi = dout + qoff + i * ldq;
        const float* oi = out + qoff + i * ldq;
        double s = 0;
        for (int64_t e = 0; e < Hd; ++e) s += double(doi[e]) * double(oi[e]);
        delta[size_t(i)] = s;
      }
      // dS = P * (dP - D), stored over dp; zero outside the visible keys because P is.
      for (int64_t i = 0; i < S; ++i) {
        const float* pr = p.data() + i * S;
        float* dr = dp.data() + i * S;
        const int64_t j0 = first[size_t(b * S + i)];
        for (int64_t j = 0; j < j0; ++j) dr[j] = 0.0f;
        for (int64_t j = j0; j <= i; ++j) dr[j] = float(double(pr[j]) * (double(dr[j]) - delta[size_t(i)]));
        for (int64_t j = i + 1; j < S; ++j) dr[j] = 0.0f;
      }
      // dQ_h = scale * dS K_g; dK_g += scale * dS^T Q_h
      sgemm(false, false, S, Hd, S, scale, dp.data(), S, k + koff, ldk, 0.0f, dq + qoff, ldq);
      sgemm(true, false, S, Hd, S, scale, dp.data(), S, q + qoff, ldq, 1.0f, dk + koff, ldk);
    }
  }
}

}  // namespace mt::cpu
