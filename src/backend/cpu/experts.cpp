// CPU experts in two forms.
//  - Grouped: the dispatched rows of each expert are contiguous, so each expert is one GEMM chain
//    (gate/up, SwiGLU, down) through the OpenBLAS wrapper. This is what the CPU model runs.
//  - Reference: a plain loop over experts and, for each, the tokens that chose it, written with
//    scalar loops and fp64 accumulation and sharing no code with the grouped form (not even the
//    SwiGLU), so that comparing the two checks the plan, the permutation and every GEMM transpose.
// Weights: w_gate_up_E2FD [E, 2F, D] (rows [0,F) gate, [F,2F) up), w_down_EDF [E, D, F].
// Shapes are checked by the dispatch (ops/op_checks.h); dtypes, offsets and expert ids here.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm.h"

namespace mt::cpu {

namespace {

struct ExpertDims {
  int64_t E, F, D;
};

// The weights' dtypes; returns their dims.
ExpertDims check_expert_weights(const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF) {
  check_dtype(w_gate_up_E2FD, DType::F32, "w_gate_up_E2FD");
  check_dtype(w_down_EDF, DType::F32, "w_down_EDF");
  return {w_gate_up_E2FD.size(0), w_gate_up_E2FD.size(1) / 2, w_gate_up_E2FD.size(2)};
}

// offsets_E1 must describe E contiguous, ordered row ranges that cover exactly [0, R).
const int64_t* check_offsets(const Tensor& offsets_E1, int64_t E, int64_t R, const char* op) {
  check_dtype(offsets_E1, DType::I64, "offsets_E1");
  const int64_t* off = offsets_E1.data<int64_t>();
  MT_CHECK(off[0] == 0 && off[E] == R, op, ": offsets_E1 must run from 0 to R (", R, "), got ", off[0], " .. ", off[E]);
  for (int64_t e = 0; e < E; ++e)
    MT_CHECK(off[e] <= off[e + 1], op, ": offsets_E1 decrease at expert ", e, " (", off[e], " > ", off[e + 1], ")");
  return off;
}

// Routing arguments of the reference form: dtypes and expert ids; returns K.
int64_t check_routing(const Tensor& topk_idx_TK, const Tensor& topk_w_TK, int64_t T, int64_t E, const char* op) {
  check_dtype(topk_idx_TK, DType::I32, "topk_idx_TK");
  check_dtype(topk_w_TK, DType::F32, "topk_w_TK");
  const int64_t K = topk_idx_TK.size(1);
  const int32_t* idx = topk_idx_TK.data<int32_t>();
  for (int64_t a = 0; a < T * K; ++a)
    if (idx[a] < 0 || idx[a] >= E)
      MT_THROW(op, ": token ", a / K, " choice ", a % K, " has expert id ", idx[a], ", expected a value in [0, ", E,
               ")");
  return K;
}

// The assignments a = t*K + k that chose expert e, in increasing a (token order).
std::vector<int64_t> assignments_of(const int32_t* idx, int64_t TK, int32_t e) {
  std::vector<int64_t> out;
  for (int64_t a = 0; a < TK; ++a)
    if (idx[a] == e) out.push_back(a);
  return out;
}

// One token through expert weights wgu [2F, D], wd [D, F] in fp64: fills gu [2F], h [F], out [D].
void expert_mlp_ref(const float* x, const float* wgu, const float* wd, int64_t F, int64_t D, double* gu, double* h,
                    double* out) {
  for (int64_t j = 0; j < 2 * F; ++j) {
    double s = 0;
    for (int64_t i = 0; i < D; ++i) s += double(wgu[j * D + i]) * double(x[i]);
    gu[j] = s;
  }
  for (int64_t f = 0; f < F; ++f) h[f] = gu[f] / (1.0 + std::exp(-gu[f])) * gu[F + f];
  for (int64_t i = 0; i < D; ++i) {
    double s = 0;
    for (int64_t f = 0; f < F; ++f) s += double(wd[i * F + f]) * h[f];
    out[i] = s;
  }
}

}  // namespace

void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF,
                 Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF);
  check_dtype(xp_RD, DType::F32, "experts_fwd xp_RD");
  check_dtype(gu_R2F, DType::F32, "experts_fwd gu_R2F");
  check_dtype(h_RF, DType::F32, "experts_fwd h_RF");
  check_dtype(yp_RD, DType::F32, "experts_fwd yp_RD");
  const int64_t R = xp_RD.size(0);
  const int64_t* off = check_offsets(offsets_E1, E, R, "experts_fwd");

  const float* xp = xp_RD.data<float>();
  const float* wgu = w_gate_up_E2FD.data<float>();
  const float* wd = w_down_EDF.data<float>();
  float* gu = gu_R2F.data<float>();
  float* h = h_RF.data<float>();
  float* yp = yp_RD.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    // gu = xp @ w_gate_up[e]^T ; h = swiglu(gu) ; yp = h @ w_down[e]^T
    sgemm(false, true, n, 2 * F, D, 1.0f, xp + r0 * D, D, wgu + e * 2 * F * D, D, 0.0f, gu + r0 * 2 * F, 2 * F);
    Tensor gu_rows = gu_R2F.rows(r0, n), h_rows = h_RF.rows(r0, n);
    swiglu_fwd(gu_rows, h_rows);
    sgemm(false, true, n, D, F, 1.0f, h + r0 * F, F, wd + e * D * F, F, 0.0f, yp + r0 * D, D);
  }
}

void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD,
                 Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw) {
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF);
  check_dtype(xp_RD, DType::F32, "experts_bwd xp_RD");
  check_dtype(dyp_RD, DType::F32, "experts_bwd dyp_RD");
  check_dtype(gu_R2F, DType::F32, "experts_bwd gu_R2F");
  check_dtype(h_RF, DType::F32, "experts_bwd h_RF");
  check_dtype(dxp_RD, DType::F32, "experts_bwd dxp_RD");
  check_dtype(dw_gate_up_E2FD, DType::F32, "experts_bwd dw_gate_up_E2FD");
  check_dtype(dw_down_EDF, DType::F32, "experts_bwd dw_down_EDF");
  const int64_t R = xp_RD.size(0);
  const int64_t* off = check_offsets(offsets_E1, E, R, "experts_bwd");

  const float* dyp = dyp_RD.data<float>();
  const float* xp = xp_RD.data<float>();
  const float* wgu = w_gate_up_E2FD.data<float>();
  const float* wd = w_down_EDF.data<float>();
  const float* h = h_RF.data<float>();
  float* dxp = dxp_RD.data<float>();
  float* dwgu = dw_gate_up_E2FD.data<float>();
  float* dwd = dw_down_EDF.data<float>();

  // Experts without rows get no GEMM, so with = their gradients are cleared here.
  if (!accumulate_dw) {
    dw_gate_up_E2FD.zero_();
    dw_down_EDF.zero_();
  }
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) max_rows = std::max(max_rows, off[e + 1] - off[e]);
  Tensor dh = Tensor::empty({max_rows, F}), dgu = Tensor::empty({max_rows, 2 * F});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    Tensor dh_rows = dh.rows(0, n), dgu_rows = dgu.rows(0, n);
    float* pdh = dh_rows.data<float>();
    float* pdgu = dgu_rows.data<float>();
    // dh = dyp @ w_down[e] ; dw_down[e] += dyp^T @ h
    sgemm(false, false, n, F, D, 1.0f, dyp + r0 * D, D, wd + e * D * F, F, 0.0f, pdh, F);
    sgemm(true, false, D, F, n, 1.0f, dyp + r0 * D, D, h + r0 * F, F, 1.0f, dwd + e * D * F, F);
    swiglu_bwd(dh_rows, gu_R2F.rows(r0, n), dgu_rows);
    // dw_gate_up[e] += dgu^T @ xp ; dxp = dgu @ w_gate_up[e]
    sgemm(true, false, 2 * F, D, n, 1.0f, pdgu, 2 * F, xp + r0 * D, D, 1.0f, dwgu + e * 2 * F * D, D);
    sgemm(false, false, n, D, 2 * F, 1.0f, pdgu, 2 * F, wgu + e * 2 * F * D, D, 0.0f, dxp + r0 * D, D);
  }
}

void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD) {
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF);
  check_dtype(x_TD, DType::F32, "experts_ref_fwd x_TD");
  check_dtype(y_TD, DType::F32, "experts_ref_fwd y_TD");
  const int64_t T = x_TD.size(0);
  const int64_t K = check_routing(topk_idx_TK, topk_w_TK, T, E, "experts_ref_fwd");

  const float* x = x_TD.data<float>();
  const int32_t* idx = topk_idx_TK.data<int32_t>();
  const float* w = topk_w_TK.data<float>();
  const float* wgu = w_gate_up_E2FD.data<float>();
  const float* wd = w_down_EDF.data<float>();
  std::vector<double> y(static_cast<size_t>(T * D), 0.0), gu(static_cast<size_t>(2 * F)), h(static_cast<size_t>(F)),
      out(static_cast<size_t>(D));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t a : assignments_of(idx, T * K, int32_t(e))) {
      const int64_t t = a / K;
      expert_mlp_ref(x + t * D, wgu + e * 2 * F * D, wd + e * D * F, F, D, gu.data(), h.data(), out.data());
      for (int64_t i = 0; i < D; ++i) y[size_t(t * D + i)] += double(w[a]) * out[size_t(i)];
    }
  }
  float* py = y_TD.data<float>();
  for (int64_t i = 0; i < T * D; ++i) py[i] = float(y[size_t(i)]);
}

void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK,
                     Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw) {
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF);
  check_dtype(x_TD, DType::F32, "experts_ref_bwd x_TD");
  check_dtype(dy_TD, DType::F32, "experts_ref_bwd dy_TD");
  check_dtype(dx_TD, DType::F32, "experts_ref_bwd dx_TD");
  check_dtype(dtopk_w_TK, DType::F32, "experts_ref_bwd dtopk_w_TK");
  check_dtype(dw_gate_up_E2FD, DType::F32, "experts_ref_bwd dw_gate_up_E2FD");
  check_dtype(dw_down_EDF, DType::F32, "experts_ref_bwd dw_down_EDF");
  const int64_t T = x_TD.size(0);
  const int64_t K = check_routing(topk_idx_TK, topk_w_TK, T, E, "experts_ref_bwd");

  const float* dy = dy_TD.data<float>();
  const float* x = x_TD.data<float>();
  const int32_t* idx = topk_idx_TK.data<int32_t>();
  const float* w = topk_w_TK.data<float>();
  const float* wgu_all = w_gate_up_E2FD.data<float>();
  const float* wd_all = w_down_EDF.data<float>();
  float* pdtw = dtopk_w_TK.data<float>();
  float* pdwgu = dw_gate_up_E2FD.data<float>();
  float* pdwd = dw_down_EDF.data<float>();

  std::vector<double> dx(static_cast<size_t>(T * D), 0.0), gu(static_cast<size_t>(2 * F)), h(static_cast<size_t>(F)),
      out(static_cast<size_t>(D));
  std::vector<double> dout(static_cast<size_t>(D)), dh(static_cast<size_t>(F)), dgu(static_cast<size_t>(2 * F));
  std::vector<double> dwgu(static_cast<size_t>(2 * F * D)), dwd(static_cast<size_t>(D * F));
  for (int64_t e = 0; e < E; ++e) {
    const float* wgu = wgu_all + e * 2 * F * D;
    const float* wd = wd_all + e * D * F;
    std::fill(dwgu.begin(), dwgu.end(), 0.0);
    std::fill(dwd.begin(), dwd.end(), 0.0);
    for (int64_t a : assignments_of(idx, T * K, int32_t(e))) {
      const int64_t t = a / K;
      const float* xt = x + t * D;
      const float* dyt = dy + t * D;
      expert_mlp_ref(xt, wgu, wd, F, D, gu.data(), h.data(), out.data());
      // y[t] += w * out, so dw = <dy, out> and d(out) = w * dy.
      double dw = 0;
      for (int64_t i = 0; i < D; ++i) {
        dw += double(dyt[i]) * out[size_t(i)];
        dout[size_t(i)] = double(w[a]) * double(dyt[i]);
      }
      pdtw[a] = float(dw);
      // out = wd @ h
      for (int64_t f = 0; f < F; ++f) dh[size_t(f)] = 0;
      for (int64_t i = 0; i < D; ++i)
        for (int64_t f = 0; f < F; ++f) {
          dh[size_t(f)] += double(wd[i * F + f]) * dout[size_t(i)];
          dwd[size_t(i * F + f)] += dout[size_t(i)] * h[size_t(f)];
        }
      // h = silu(g) * u
      for (int64_t f = 0; f < F; ++f) {
        const double g = gu[size_t(f)], u = gu[size_t(F + f)];
        const double sig = 1.0 / (1.0 + std::exp(-g));
        dgu[size_t(f)] = dh[size_t(f)] * u * (sig + g * sig * (1.0 - sig));
        dgu[size_t(F + f)] = dh[size_t(f)] * g * sig;
      }
      // gu = wgu @ x
      for (int64_t j = 0; j < 2 * F; ++j)
        for (int64_t i = 0; i < D; ++i) {
          dx[size_t(t * D + i)] += double(wgu[j * D + i]) * dgu[size_t(j)];
          dwgu[size_t(j * D + i)] += dgu[size_t(j)] * double(xt[i]);
        }
    }
    // = must not read the old value (it may be anything, NaN included).
    for (int64_t i = 0; i < 2 * F * D; ++i)
      pdwgu[e * 2 * F * D + i] = float(dwgu[size_t(i)]) + (accumulate_dw ? pdwgu[e * 2 * F * D + i] : 0.0f);
    for (int64_t i = 0; i < D * F; ++i)
      pdwd[e * D * F + i] = float(dwd[size_t(i)]) + (accumulate_dw ? pdwd[e * D * F + i] : 0.0f);
  }
  float* pdx = dx_TD.data<float>();
  for (int64_t i = 0; i < T * D; ++i) pdx[i] = float(dx[size_t(i)]);
}

}  // namespace mt::cpu
