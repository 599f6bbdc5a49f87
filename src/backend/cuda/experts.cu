// CUDA experts. Same contracts as backend/cpu/experts.cpp.
//
// Grouped form (experts_fwd / experts_bwd) has two paths (grouped_gemm.cuh says how one is chosen):
//   - grouped (the default): CUTLASS grouped GEMMs whose per-expert sizes are read from offsets_E1 on
//     the device, one launch per product for all experts, no host synchronisation;
//   - reference: offsets_E1 copied to the host (one stream synchronisation per call) and one cuBLASLt
//     GEMM per expert and product. Taken when MOETRAIN_EXPERTS=reference, or when the grouped path
//     cannot run the arguments (no CUTLASS build or sm_90 GPU, D or F not a multiple of 8, unaligned
//     tensors); that fallback is logged once.
// In both, SwiGLU runs once over all R rows (mt::cuda::swiglu_fwd/bwd). Intermediates that the CPU
// keeps in f32 (dh, dgu) are bf16 here, as is every activation on this backend; the GEMMs accumulate
// in f32. The reference path checks the offsets on the host at once; the grouped path checks them on
// the device and reports bad ones at a later call (grouped_gemm.cuh).
//
// Reference form (experts_ref_fwd / experts_ref_bwd): the device-side reference, built from the
// grouped pieces (plan, permute, experts_fwd/bwd, unpermute) with per-call temporaries. Unlike on
// the CPU it shares code with the grouped form, so CUDA-vs-CPU tests, not ref-vs-grouped on the GPU,
// are what check it.
//
// The grouped backward's two weight-gradient GEMMs may run on the side stream, beside whatever the
// caller queues next on the compute stream (core/streams.h, WgradScope; ModelOptions::wgrad_stream).
// Their inputs and outputs are then the caller's to order, except this file's own scratch: a later
// experts_bwd waits for the side GEMMs before it writes dh / dgu again.
//
// Shapes are checked by the dispatch (ops/op_checks.h); device, dtypes and offsets here.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/grouped_gemm.cuh"
#include "backend/cuda/invariant.h"
#include "backend/cuda/moe_dispatch.cuh"
#include "core/determinism.h"
#include "core/log.h"
#include "core/streams.h"

namespace mt::cuda {

namespace {

struct ExpertDims {
  int64_t E, F, D;
};

// The weights' device and dtypes; returns their dims.
ExpertDims check_expert_weights(const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const char* op) {
  check_cuda(w_gate_up_E2FD, DType::BF16, str(op, " w_gate_up_E2FD").c_str());
  check_cuda(w_down_EDF, DType::BF16, str(op, " w_down_EDF").c_str());
  return {w_gate_up_E2FD.size(0), w_gate_up_E2FD.size(1) / 2, w_gate_up_E2FD.size(2)};
}

void check_rows(const Tensor& t, DType dtype, const char* op, const char* name) {
  check_cuda(t, dtype, str(op, " ", name).c_str());
}

// Copies offsets_E1 to the host (synchronises the stream: the reference path's one host round trip)
// and checks that they describe E ordered ranges covering exactly [0, R).
std::vector<int64_t> host_offsets(const Tensor& offsets_E1, int64_t E, int64_t R, const char* op) {
  check_cuda(offsets_E1, DType::I64, str(op, " offsets_E1").c_str());
  std::vector<int64_t> off(size_t(E + 1));
  MT_CUDA_CHECK(op, cudaMemcpyAsync(off.data(), offsets_E1.raw(), off.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                    stream()));
  sync(op);
  check_dispatch_plan_errors(op);  // the stream is idle now, so a bad expert id of the plan is known
  MT_CHECK(off[0] == 0 && off[size_t(E)] == R, op, ": offsets_E1 must run from 0 to R (", R, "), got ", off[0], " .. ",
           off[size_t(E)]);
  for (int64_t e = 0; e < E; ++e)
    MT_CHECK(off[size_t(e)] <= off[size_t(e + 1)], op, ": offsets_E1 decrease at expert ", e, " (", off[size_t(e)],
             " > ", off[size_t(e + 1)], ")");
  return off;
}

const __nv_bfloat16* bf16_in(const Tensor& t) {
  return static_cast<const __nv_bfloat16*>(t.raw());
}
__nv_bfloat16* bf16_out(const Tensor& t) {
  return static_cast<__nv_bfloat16*>(t.raw());
}

// A borrowed view of scratch memory as a Tensor, for calling ops on it.
Tensor device_view(void* p, const Shape& shape, DType dtype) {
  return Tensor(nullptr, p, shape, dtype, Device::CUDA);
}

// Device and dtype checks of experts_fwd; returns R.
int64_t check_fwd(const Tensor& xp_RD, const Tensor& gu_R2F, const Tensor& h_RF, const Tensor& yp_RD, const char* op) {
  check_rows(xp_RD, DType::BF16, op, "xp_RD");
  check_rows(gu_R2F, DType::BF16, op, "gu_R2F");
  check_rows(h_RF, DType::BF16, op, "h_RF");
  check_rows(yp_RD, DType::BF16, op, "yp_RD");
  return xp_RD.size(0);
}

// Device and dtype checks of experts_bwd; returns R.
int64_t check_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& gu_R2F, const Tensor& h_RF,
                  const Tensor& dxp_RD, const Tensor& dw_gate_up_E2FD, const Tensor& dw_down_EDF, const char* op) {
  check_rows(xp_RD, DType::BF16, op, "xp_RD");
  check_rows(dyp_RD, DType::BF16, op, "dyp_RD");
  check_rows(gu_R2F, DType::BF16, op, "gu_R2F");
  check_rows(h_RF, DType::BF16, op, "h_RF");
  check_rows(dxp_RD, DType::BF16, op, "dxp_RD");
  check_cuda(dw_gate_up_E2FD, DType::F32, "experts_bwd dw_gate_up_E2FD");
  check_cuda(dw_down_EDF, DType::F32, "experts_bwd dw_down_EDF");
  return xp_RD.size(0);
}

// The side stream's weight-gradient GEMMs (WgradScope): event 0 marks the last call's, and pending
// says that no compute-stream wait has followed it yet. Never destroyed (events outlive static order).
struct SideWgrad {
  streams::EventSet done;
  bool pending = false;
};
SideWgrad& side_wgrad() {
  static SideWgrad* s = new SideWgrad;
  return *s;
}

// The compute stream waits for the side stream's weight-gradient GEMMs of an earlier call: they read
// dgu and the grouped GEMMs' argument arrays, which this call is about to rewrite.
void after_side_wgrad() {
  SideWgrad& s = side_wgrad();
  if (!s.pending) return;
  s.done.compute_waits(0);
  s.pending = false;
}

// The backward's bf16 intermediates dh [R, F] and dgu [R, 2F], reused across calls (stream-ordered;
// after an earlier call's side-stream weight gradients, which read dgu).
struct BwdScratch {
  __nv_bfloat16 *dh, *dgu;
};
BwdScratch bwd_scratch(int64_t R, int64_t F, const char* op) {
  static DeviceScratch dh_buf, dgu_buf;
  after_side_wgrad();
  return {dh_buf.as<__nv_bfloat16>(R * F, op), dgu_buf.as<__nv_bfloat16>(R * 2 * F, op)};
}

// The weight-gradient GEMMs' grid under a WgradScope: its ctas, else all SMs on the compute stream and
// half of them on the side stream (the compute stream's kernels keep the other half).
int wgrad_ctas(const streams::WgradPlacement& place, const char* op) {
  if (place.ctas > 0 || !place.side) return place.ctas;
  static const int half = [op] {
    int dev = 0, count = 0;
    MT_CUDA_CHECK(op, cudaGetDevice(&dev));
    MT_CUDA_CHECK(op, cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return std::max(1, count / 2);
  }();
  return half;
}

enum class Path { automatic, reference, grouped };

// MOETRAIN_EXPERTS, read at every call (cheap) so that a test or a run can switch paths.
Path path_from_env() {
  const char* e = std::getenv("MOETRAIN_EXPERTS");
  const std::string m = e ? e : "";
  if (m.empty() || m == "auto") return Path::automatic;
  if (m == "reference") return Path::reference;
  if (m == "grouped") return Path::grouped;
  MT_THROW("MOETRAIN_EXPERTS (", m, ") must be one of auto, reference, grouped");
}

// True when the call should take the grouped path; logs the first fallback of the process.
bool use_grouped(int64_t D, int64_t F, std::initializer_list<const Tensor*> tensors, const char* op) {
  const Path path = path_from_env();
  if (path == Path::reference) return false;
  const std::string why = experts_grouped_unsupported(D, F, tensors);
  if (why.empty()) return true;
  if (path == Path::grouped) MT_THROW(op, ": MOETRAIN_EXPERTS=grouped but ", why);
  static bool logged = false;
  if (!logged) {
    logged = true;
    log_info("experts: per-expert cuBLASLt reference path (one host synchronisation per call): ", why);
  }
  return false;
}

}  // namespace

std::string experts_grouped_unsupported(int64_t D, int64_t F, std::initializer_list<const Tensor*> tensors) {
  if (!grouped_gemm_available())
    return "no CUTLASS grouped GEMM for this build and GPU (it needs the CUTLASS headers and compute capability 9.0)";
  if (D % 8 != 0 || F % 8 != 0) return str("D (", D, ") and F (", F, ") must be multiples of 8 for the grouped GEMM");
  for (const Tensor* t : tensors)
    if (t->numel() > 0 && reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0)
      return str("a tensor (", t->desc(), ") is not 16-byte aligned");
  return "";
}

void experts_fwd(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF,
                 Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, "experts_fwd");
  if (batch_invariant()) {  // the grouped GEMMs (their tiles give the same bits: grouped_rows_tile), else invariant.cuh's
    if (experts_grouped_unsupported(d.D, d.F, {&xp_RD, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &yp_RD}).empty())
      experts_fwd_grouped(xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, yp_RD);
    else
      experts_fwd_invariant(xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, yp_RD);
    return;
  }
  if (use_grouped(d.D, d.F, {&xp_RD, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &yp_RD}, "experts_fwd"))
    experts_fwd_grouped(xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, yp_RD);
  else
    experts_fwd_reference(xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, yp_RD);
}

void experts_bwd(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                 const Tensor& w_down_EDF, const Tensor& gu_R2F, const Tensor& h_RF, Tensor& dxp_RD,
                 Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw,
                 const std::function<void()>& after_dx) {
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, "experts_bwd");
  if (use_grouped(
          d.D, d.F,
          {&dyp_RD, &xp_RD, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &dxp_RD, &dw_gate_up_E2FD, &dw_down_EDF},
          "experts_bwd"))
    experts_bwd_grouped(dyp_RD, xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, dxp_RD, dw_gate_up_E2FD,
                        dw_down_EDF, accumulate_dw, after_dx);
  else {
    experts_bwd_reference(dyp_RD, xp_RD, offsets_E1, w_gate_up_E2FD, w_down_EDF, gu_R2F, h_RF, dxp_RD, dw_gate_up_E2FD,
                          dw_down_EDF, accumulate_dw);
    if (after_dx) after_dx();
  }
}

// The batch-invariant mode's experts (invariant.cuh): both products on invariant_gemm_nt, grouped by the offsets.
void experts_fwd_invariant(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                           const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  const char* op = "experts_fwd (batch-invariant)";
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const int64_t R = check_fwd(xp_RD, gu_R2F, h_RF, yp_RD, op);
  check_cuda(offsets_E1, DType::I64, "experts_fwd offsets_E1");
  check_dispatch_plan_errors(op);
  if (R == 0) return;
  const int64_t* off = offsets_E1.data<int64_t>();
  invariant_gemm_nt(op, R, 2 * F, D, xp_RD.raw(), D, w_gate_up_E2FD.raw(), D, DType::BF16, 1.0f, 0.0f, nullptr,
                    gu_R2F.raw(), DType::BF16, 2 * F, E, off, 2 * F * D);
  swiglu_fwd(gu_R2F, h_RF);
  invariant_gemm_nt(op, R, D, F, h_RF.raw(), F, w_down_EDF.raw(), F, DType::BF16, 1.0f, 0.0f, nullptr, yp_RD.raw(),
                    DType::BF16, D, E, off, D * F);
}

void experts_fwd_grouped(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                         const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  const char* op = "experts_fwd";
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const auto [E, F, D] = d;
  const int64_t R = check_fwd(xp_RD, gu_R2F, h_RF, yp_RD, op);
  check_cuda(offsets_E1, DType::I64, "experts_fwd offsets_E1");
  const std::string why =
      experts_grouped_unsupported(D, F, {&xp_RD, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &yp_RD});
  MT_CHECK(why.empty(), op, ": the grouped path cannot run: ", why);
  check_dispatch_plan_errors(op);  // an earlier plan's bad expert ids, if their record has landed
  if (R == 0) return;
  const int64_t* off = offsets_E1.data<int64_t>();
  // gu = xp @ w_gate_up[e]^T; h = swiglu(gu) over all rows; yp = h @ w_down[e]^T
  grouped_gemm_rows("experts_fwd gate_up", E, off, R, 2 * F, D, bf16_in(xp_RD), bf16_in(w_gate_up_E2FD), true,
                    bf16_out(gu_R2F));
  swiglu_fwd(gu_R2F, h_RF);
  grouped_gemm_rows("experts_fwd down", E, off, R, D, F, bf16_in(h_RF), bf16_in(w_down_EDF), true, bf16_out(yp_RD));
}

void experts_bwd_grouped(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                         const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F,
                         const Tensor& h_RF, Tensor& dxp_RD, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF,
                         bool accumulate_dw, const std::function<void()>& after_dx) {
  const char* op = "experts_bwd";
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const auto [E, F, D] = d;
  const int64_t R = check_bwd(dyp_RD, xp_RD, gu_R2F, h_RF, dxp_RD, dw_gate_up_E2FD, dw_down_EDF, op);
  check_cuda(offsets_E1, DType::I64, "experts_bwd offsets_E1");
  const std::string why = experts_grouped_unsupported(
      D, F, {&dyp_RD, &xp_RD, &w_gate_up_E2FD, &w_down_EDF, &gu_R2F, &h_RF, &dxp_RD, &dw_gate_up_E2FD, &dw_down_EDF});
  MT_CHECK(why.empty(), op, ": the grouped path cannot run: ", why);
  check_dispatch_plan_errors(op);
  if (R == 0) {
    if (!accumulate_dw) {
      after_side_wgrad();  // an earlier side-stream GEMM may still write them (the caller's to order; cheap)
      dw_gate_up_E2FD.zero_();
      dw_down_EDF.zero_();
    }
    if (after_dx) after_dx();
    return;
  }
  const int64_t* off = offsets_E1.data<int64_t>();
  const BwdScratch t = bwd_scratch(R, F, op);
  const __nv_bfloat16* dyp = bf16_in(dyp_RD);
  // The input gradient first, so that after_dx can send it while the weight gradients run.
  // dh = dyp @ w_down[e] (w_down[e] is [D, F] = [K, N]); dgu = swiglu_bwd(dh);
  // dxp = dgu @ w_gate_up[e] (w_gate_up[e] is [2F, D] = [K, N])
  grouped_gemm_rows("experts_bwd dh", E, off, R, F, D, dyp, bf16_in(w_down_EDF), false, t.dh);
  const Tensor dh_RF = device_view(t.dh, {R, F}, DType::BF16);
  Tensor dgu_R2F = device_view(t.dgu, {R, 2 * F}, DType::BF16);
  swiglu_bwd(dh_RF, gu_R2F, dgu_R2F);
  grouped_gemm_rows("experts_bwd dxp", E, off, R, D, 2 * F, t.dgu, bf16_in(w_gate_up_E2FD), false, bf16_out(dxp_RD));
  if (after_dx) after_dx();
  // dw_down[e] += dyp^T @ h; dw_gate_up[e] += dgu^T @ xp. Under a WgradScope with side, on the side
  // stream once it has caught up with the compute stream (dyp, h, dgu, xp are final there).
  const streams::WgradPlacement place = streams::wgrad_placement();
  const int ctas = wgrad_ctas(place, op);
  auto weight_grads = [&] {
    grouped_gemm_wgrad("experts_bwd dw_down", E, off, R, D, F, dyp, bf16_in(h_RF), dw_down_EDF.data<float>(),
                       accumulate_dw, ctas);
    grouped_gemm_wgrad("experts_bwd dw_gate_up", E, off, R, 2 * F, D, t.dgu, bf16_in(xp_RD),
                       dw_gate_up_E2FD.data<float>(), accumulate_dw, ctas);
  };
  if (!place.side) {
    weight_grads();
    return;
  }
  SideWgrad& s = side_wgrad();
  s.done.resize(1, Device::CUDA, place.stream);
  s.done.side_waits_compute();
  {
    const streams::SideScope on_side(Device::CUDA, place.stream);
    weight_grads();
  }
  s.done.record_side(0);
  s.pending = true;
  streams::count_wgrad_side_call();
}

void experts_fwd_reference(const Tensor& xp_RD, const Tensor& offsets_E1, const Tensor& w_gate_up_E2FD,
                           const Tensor& w_down_EDF, Tensor& gu_R2F, Tensor& h_RF, Tensor& yp_RD) {
  const char* op = "experts_fwd";
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const auto [E, F, D] = d;
  const int64_t R = check_fwd(xp_RD, gu_R2F, h_RF, yp_RD, op);
  const std::vector<int64_t> off = host_offsets(offsets_E1, E, R, op);
  if (R == 0) return;

  const __nv_bfloat16* xp = bf16_in(xp_RD);
  const __nv_bfloat16* wgu = bf16_in(w_gate_up_E2FD);
  const __nv_bfloat16* wd = bf16_in(w_down_EDF);
  __nv_bfloat16* gu = bf16_out(gu_R2F);
  const __nv_bfloat16* h = bf16_in(h_RF);
  __nv_bfloat16* yp = bf16_out(yp_RD);
  // gu = xp @ w_gate_up[e]^T per expert; h = swiglu(gu) over all rows; yp = h @ w_down[e]^T per expert
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[size_t(e)], n = off[size_t(e + 1)] - r0;
    if (n == 0) continue;
    gemm("experts_fwd gate_up", false, true, n, 2 * F, D, xp + r0 * D, D, wgu + e * 2 * F * D, D, 0.0f, gu + r0 * 2 * F,
         DType::BF16, 2 * F);
  }
  swiglu_fwd(gu_R2F, h_RF);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[size_t(e)], n = off[size_t(e + 1)] - r0;
    if (n == 0) continue;
    gemm("experts_fwd down", false, true, n, D, F, h + r0 * F, F, wd + e * D * F, F, 0.0f, yp + r0 * D, DType::BF16, D);
  }
}

void experts_bwd_reference(const Tensor& dyp_RD, const Tensor& xp_RD, const Tensor& offsets_E1,
                           const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, const Tensor& gu_R2F,
                           const Tensor& h_RF, Tensor& dxp_RD, Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF,
                           bool accumulate_dw) {
  const char* op = "experts_bwd";
  const auto d = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  const auto [E, F, D] = d;
  const int64_t R = check_bwd(dyp_RD, xp_RD, gu_R2F, h_RF, dxp_RD, dw_gate_up_E2FD, dw_down_EDF, op);
  const std::vector<int64_t> off = host_offsets(offsets_E1, E, R, op);
  // The reference path keeps +=: = is a clear first (experts without rows must read 0 too).
  if (!accumulate_dw) {
    dw_gate_up_E2FD.zero_();
    dw_down_EDF.zero_();
  }
  if (R == 0) return;

  const BwdScratch t = bwd_scratch(R, F, op);
  __nv_bfloat16* dh = t.dh;
  __nv_bfloat16* dgu = t.dgu;
  const __nv_bfloat16* dyp = bf16_in(dyp_RD);
  const __nv_bfloat16* xp = bf16_in(xp_RD);
  const __nv_bfloat16* wgu = bf16_in(w_gate_up_E2FD);
  const __nv_bfloat16* wd = bf16_in(w_down_EDF);
  const __nv_bfloat16* h = bf16_in(h_RF);
  __nv_bfloat16* dxp = bf16_out(dxp_RD);
  float* dwgu = dw_gate_up_E2FD.data<float>();
  float* dwd = dw_down_EDF.data<float>();
  // dh = dyp @ w_down[e]; dw_down[e] += dyp^T @ h
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[size_t(e)], n = off[size_t(e + 1)] - r0;
    if (n == 0) continue;
    gemm("experts_bwd dh", false, false, n, F, D, dyp + r0 * D, D, wd + e * D * F, F, 0.0f, dh + r0 * F, DType::BF16,
         F);
    gemm("experts_bwd dw_down", true, false, D, F, n, dyp + r0 * D, D, h + r0 * F, F, 1.0f, dwd + e * D * F, DType::F32,
         F);
  }
  const Tensor dh_RF = device_view(dh, {R, F}, DType::BF16);
  Tensor dgu_R2F = device_view(dgu, {R, 2 * F}, DType::BF16);
  swiglu_bwd(dh_RF, gu_R2F, dgu_R2F);
  // dw_gate_up[e] += dgu^T @ xp; dxp = dgu @ w_gate_up[e]
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[size_t(e)], n = off[size_t(e + 1)] - r0;
    if (n == 0) continue;
    gemm("experts_bwd dw_gate_up", true, false, 2 * F, D, n, dgu + r0 * 2 * F, 2 * F, xp + r0 * D, D, 1.0f,
         dwgu + e * 2 * F * D, DType::F32, D);
    gemm("experts_bwd dxp", false, false, n, D, 2 * F, dgu + r0 * 2 * F, 2 * F, wgu + e * 2 * F * D, D, 0.0f,
         dxp + r0 * D, DType::BF16, D);
  }
}

namespace {

// The grouped pipeline's temporaries for one reference call (allocated per call: this is the
// reference path, kept simple rather than fast).
struct RefState {
  Tensor offsets, assign_of_row, row_of_assign, xp, gu, h, yp;
};

RefState ref_forward(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& w_gate_up_E2FD,
                     const Tensor& w_down_EDF, const char* op) {
  const auto [E, F, D] = check_expert_weights(w_gate_up_E2FD, w_down_EDF, op);
  check_cuda(x_TD, DType::BF16, str(op, " x_TD").c_str());
  check_cuda(topk_idx_TK, DType::I32, str(op, " topk_idx_TK").c_str());
  const int64_t T = x_TD.size(0), K = topk_idx_TK.size(1), R = T * K;
  const Device dev = Device::CUDA;
  RefState s{Tensor::empty({E + 1}, DType::I64, dev),     Tensor::empty({R}, DType::I32, dev),
             Tensor::empty({T, K}, DType::I32, dev),      Tensor::empty({R, D}, DType::BF16, dev),
             Tensor::empty({R, 2 * F}, DType::BF16, dev), Tensor::empty({R, F}, DType::BF16, dev),
             Tensor::empty({R, D}, DType::BF16, dev)};
  make_dispatch_plan(topk_idx_TK, E, s.offsets, s.assign_of_row, s.row_of_assign);
  permute_fwd(x_TD, s.assign_of_row, K, s.xp);
  experts_fwd(s.xp, s.offsets, w_gate_up_E2FD, w_down_EDF, s.gu, s.h, s.yp);
  return s;
}

}  // namespace

void experts_ref_fwd(const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& y_TD) {
  const char* op = "experts_ref_fwd";
  check_cuda(topk_w_TK, DType::F32, "experts_ref_fwd topk_w_TK");
  check_cuda(y_TD, DType::BF16, "experts_ref_fwd y_TD");
  const RefState s = ref_forward(x_TD, topk_idx_TK, w_gate_up_E2FD, w_down_EDF, op);
  unpermute_fwd(s.yp, s.row_of_assign, topk_w_TK, y_TD);
}

void experts_ref_bwd(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& topk_idx_TK, const Tensor& topk_w_TK,
                     const Tensor& w_gate_up_E2FD, const Tensor& w_down_EDF, Tensor& dx_TD, Tensor& dtopk_w_TK,
                     Tensor& dw_gate_up_E2FD, Tensor& dw_down_EDF, bool accumulate_dw) {
  const char* op = "experts_ref_bwd";
  check_cuda(topk_w_TK, DType::F32, "experts_ref_bwd topk_w_TK");
  check_cuda(dy_TD, DType::BF16, "experts_ref_bwd dy_TD");
  check_cuda(dx_TD, DType::BF16, "experts_ref_bwd dx_TD");
  check_cuda(dtopk_w_TK, DType::F32, "experts_ref_bwd dtopk_w_TK");
  RefState s = ref_forward(x_TD, topk_idx_TK, w_gate_up_E2FD, w_down_EDF, op);
  const int64_t K = topk_idx_TK.size(1);
  Tensor dyp = Tensor::empty(s.yp.shape(), DType::BF16, Device::CUDA);
  Tensor dxp = Tensor::empty(s.xp.shape(), DType::BF16, Device::CUDA);
  unpermute_bwd(dy_TD, s.yp, s.row_of_assign, topk_w_TK, dyp, dtopk_w_TK);
  experts_bwd(dyp, s.xp, s.offsets, w_gate_up_E2FD, w_down_EDF, s.gu, s.h, dxp, dw_gate_up_E2FD, dw_down_EDF,
              accumulate_dw);
  // dx is "=", permute_bwd accumulates.
  if (dx_TD.numel() > 0) MT_CUDA_CHECK(op, cudaMemsetAsync(dx_TD.raw(), 0, dx_TD.nbytes(), stream()));
  permute_bwd(dxp, s.assign_of_row, K, dx_TD);
}

}  // namespace mt::cuda
