// mt::cuda::attention_fwd/bwd: causal grouped-query attention through cuDNN's fused SDPA (the
// cudnn-frontend graph API), with the reference kernels of attention_ref.cu as the fallback.
//
// Per shape (B, S, H, G, Hd) the first call decides the path and keeps it (attention.cuh):
//   - MOETRAIN_ATTENTION=ref: the reference kernels;
//   - otherwise the forward and backward cuDNN graphs are built together, first with the
//     statistics in the CPU's [T, H] order (only from cuDNN 9.26 on: before, the frontend's
//     validate refuses any Stats but packed [B, H, S] in the backward), then in cuDNN's natural
//     [B, H, S] order; the first layout for which both graphs pass check_support and build is kept;
//   - when neither does (or no cuDNN handle can be made), the reference kernels, unless
//     MOETRAIN_ATTENTION=cudnn, which makes that an error.
// Both graphs are decided together so that attention_bwd always reads statistics laid out as
// attention_fwd wrote them (the reference kernels read either layout, so a call that must take
// them, e.g. for an unaligned view, stays consistent). The decision is logged once per shape.
//
// Layouts: q [T, H, Hd] is (B, H, S, Hd) with strides (S*H*Hd, Hd, H*Hd, 1); k, v [T, G, Hd]
// likewise with G; the statistics are (B, H, S, 1) with strides (S*H, 1, H, 1) in [T, H] order,
// (H*S, S, 1, 1) in [B, H, S] order.
// One cuDNN handle per process, bound to mt::cuda::stream(); one workspace buffer that grows to
// the largest graph's need (growing synchronises the stream once, when a new shape is decided).
// Packed rows (doc_start_T, several documents per row) run the reference kernels with the document
// mask, statistics [T, H]; cuDNN's ragged (THD) layout would make them fast and is not wired up yet.
// Deterministic mode (core/determinism.h) is part of the plan's key: its backward graph asks for
// cuDNN's deterministic algorithm (SDPA_backward_attributes::set_deterministic_algorithm; on Hopper a
// dP workspace of B*H*S*S*2 bytes, or from cuDNN 9.25 the ordered-dQ engine when that would pass
// CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT, which we set to 1 GiB unless it is set already); when cuDNN
// refuses, the reference kernels (deterministic: no atomics) take the shape, and the log line says so.
// The forward is deterministic either way.
#include <cudnn.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

// The frontend's headers trip a few of nvcc's and GCC's warnings; they are not ours to fix.
#pragma nv_diag_suppress 128   // loop is not reachable
#pragma nv_diag_suppress 2810  // ignoring return value type with "nodiscard" attribute
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop
#pragma nv_diag_default 128
#pragma nv_diag_default 2810

#include "backend/cuda/attention.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/invariant.h"
#include "core/determinism.h"
#include "core/log.h"

namespace mt::cuda {

namespace {

namespace fe = cudnn_frontend;

// Tensor UIDs of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct ShapeKey {
  int64_t B, S, H, G, Hd;
  bool deterministic;
  auto operator<=>(const ShapeKey&) const = default;
};

std::string key_str(const ShapeKey& k) {
  return str("B=", k.B, " S=", k.S, " H=", k.H, " G=", k.G, " Hd=", k.Hd, k.deterministic ? " deterministic" : "");
}

const char* layout_str(StatsLayout l) {
  return l == StatsLayout::TH ? "[T, H]" : "[B, H, S]";
}

struct Plan {
  AttentionBackend backend = AttentionBackend::reference;
  StatsLayout stats = StatsLayout::TH;
  std::string reason;
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
};

struct State {
  std::mutex mu;
  std::map<ShapeKey, Plan> plans;
  bool handle_tried = false;
  cudnnHandle_t handle = nullptr;
  std::string handle_error;
  Tensor workspace;  // a Tensor so that device-memory accounting sees it
  bool warned_unaligned = false;
};

// Never destroyed: tearing down cuDNN or freeing device memory after the CUDA runtime has shut
// down at exit can crash, and the OS reclaims both anyway.
State& state() {
  static State* s = new State;
  return *s;
}

void fe_check(fe::error_t e, const char* step, const ShapeKey& key) {
  if (e.is_bad()) MT_THROW("attention: cuDNN ", step, " failed for ", key_str(key), ": ", e.get_message());
}

// The process's cuDNN handle, made on first use and bound to stream(); null (with handle_error
// set) when cuDNN cannot be used here.
cudnnHandle_t handle(State& st) {
  if (st.handle_tried) return st.handle;
  st.handle_tried = true;
  cudnnHandle_t h = nullptr;
  cudnnStatus_t s = cudnnCreate(&h);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnSetStream(h, stream());
  if (s != CUDNN_STATUS_SUCCESS) {
    st.handle_error = str("cudnnCreate/cudnnSetStream failed: ", cudnnGetErrorString(s));
    return nullptr;
  }
  st.handle = h;
  log_info("attention: cuDNN ", cudnnGetVersion(), " (built with ", CUDNN_VERSION, "), cudnn-frontend ",
           CUDNN_FRONTEND_MAJOR_VERSION, ".", CUDNN_FRONTEND_MINOR_VERSION, ".", CUDNN_FRONTEND_PATCH_VERSION);
  return h;
}

std::vector<int64_t> q_dims(const ShapeKey& k) {
  return {k.B, k.H, k.S, k.Hd};
}
std::vector<int64_t> q_strides(const ShapeKey& k) {
  return {k.S * k.H * k.Hd, k.Hd, k.H * k.Hd, 1};
}
std::vector<int64_t> kv_dims(const ShapeKey& k) {
  return {k.B, k.G, k.S, k.Hd};
}
std::vector<int64_t> kv_strides(const ShapeKey& k) {
  return {k.S * k.G * k.Hd, k.Hd, k.G * k.Hd, 1};
}
std::vector<int64_t> stats_dims(const ShapeKey& k) {
  return {k.B, k.H, k.S, 1};
}
std::vector<int64_t> stats_strides(const ShapeKey& k, StatsLayout l) {
  if (l == StatsLayout::TH) return {k.S * k.H, 1, k.H, 1};
  return {k.H * k.S, k.S, 1, 1};
}

float attention_scale(int64_t Hd) {
  return float(1.0 / std::sqrt(double(Hd)));
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, int64_t uid,
                                                    std::vector<int64_t> dims, std::vector<int64_t> strides) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

// Lowers, picks an engine (heuristics mode A), checks support and builds; returns the workspace size.
int64_t finish_graph(fe::graph::Graph& g, cudnnHandle_t h, const ShapeKey& key, const char* which) {
  const std::string w = which;
  fe_check(g.validate(), (w + " validate").c_str(), key);
  fe_check(g.build_operation_graph(h), (w + " build_operation_graph").c_str(), key);
  fe_check(g.create_execution_plans({fe::HeurMode_t::A}), (w + " create_execution_plans").c_str(), key);
  fe_check(g.check_support(), (w + " check_support").c_str(), key);
  fe_check(g.build_plans(), (w + " build_plans").c_str(), key);
  int64_t ws = 0;
  fe_check(g.get_workspace_size(ws), (w + " get_workspace_size").c_str(), key);
  return ws;
}

std::shared_ptr<fe::graph::Graph> build_fwd(cudnnHandle_t h, const ShapeKey& key, StatsLayout layout, int64_t& ws) {
  auto g = new_graph();
  auto Q = input(*g, "Q", kQ, q_dims(key), q_strides(key));
  auto K = input(*g, "K", kK, kv_dims(key), kv_strides(key));
  auto V = input(*g, "V", kV, kv_dims(key), kv_strides(key));
  auto opts = fe::graph::SDPA_attributes()
                  .set_name("attention_fwd")
                  .set_generate_stats(true)
                  .set_attn_scale(attention_scale(key.Hd))
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                  .set_diagonal_band_right_bound(0);
  auto [O, Stats] = g->sdpa(Q, K, V, opts);
  O->set_output(true).set_uid(kO).set_dim(q_dims(key)).set_stride(q_strides(key));
  Stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dims(key))
      .set_stride(stats_strides(key, layout));
  ws = finish_graph(*g, h, key, "forward");
  return g;
}

std::shared_ptr<fe::graph::Graph> build_bwd(cudnnHandle_t h, const ShapeKey& key, StatsLayout layout, int64_t& ws) {
  auto g = new_graph();
  auto Q = input(*g, "Q", kQ, q_dims(key), q_strides(key));
  auto K = input(*g, "K", kK, kv_dims(key), kv_strides(key));
  auto V = input(*g, "V", kV, kv_dims(key), kv_strides(key));
  auto O = input(*g, "O", kO, q_dims(key), q_strides(key));
  auto dO = input(*g, "dO", kdO, q_dims(key), q_strides(key));
  auto Stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("Stats")
                             .set_uid(kStats)
                             .set_data_type(fe::DataType_t::FLOAT)
                             .set_dim(stats_dims(key))
                             .set_stride(stats_strides(key, layout)));
  auto opts = fe::graph::SDPA_backward_attributes()
                  .set_name("attention_bwd")
                  .set_attn_scale(attention_scale(key.Hd))
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                  .set_diagonal_band_right_bound(0);
  if (key.deterministic) {
    // From cuDNN 9.25 on Hopper, a dP workspace above this limit takes the ordered-dQ engine (linear
    // workspace) instead; earlier versions ignore it. A value the user set is kept.
    setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", "1073741824", 0);
    opts.set_deterministic_algorithm(true);
  }
  auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
  dQ->set_output(true).set_uid(kdQ).set_dim(q_dims(key)).set_stride(q_strides(key));
  dK->set_output(true).set_uid(kdK).set_dim(kv_dims(key)).set_stride(kv_strides(key));
  dV->set_output(true).set_uid(kdV).set_dim(kv_dims(key)).set_stride(kv_strides(key));
  ws = finish_graph(*g, h, key, "backward");
  return g;
}

void ensure_workspace(State& st, int64_t bytes) {
  if (bytes <= 0 || (st.workspace.defined() && int64_t(st.workspace.nbytes()) >= bytes)) return;
  // The old buffer may still be read by work queued on the stream.
  if (st.workspace.defined()) MT_CUDA_CHECK("attention workspace", cudaStreamSynchronize(stream()));
  st.workspace = Tensor();
  st.workspace = Tensor::empty({(bytes + 3) / 4}, DType::F32, Device::CUDA);
}

enum class Mode { automatic, reference, cudnn };

Mode mode_from_env() {
  const char* e = std::getenv("MOETRAIN_ATTENTION");
  const std::string m = e ? e : "";
  if (m.empty() || m == "auto") return Mode::automatic;
  if (m == "ref") return Mode::reference;
  if (m == "cudnn") return Mode::cudnn;
  MT_THROW("MOETRAIN_ATTENTION (", m, ") must be one of auto, ref, cudnn");
}

Plan decide(State& st, const ShapeKey& key) {
  Plan p;
  const Mode mode = mode_from_env();
  if (mode == Mode::reference) {
    p.reason = "MOETRAIN_ATTENTION=ref";
    return p;
  }
  cudnnHandle_t h = handle(st);
  std::string why = h ? "" : st.handle_error;
  if (h) {
    // cuDNN before 9.26 reads the backward's statistics only in [B, H, S] order (the frontend's
    // validate says so); later versions get the CPU's order.
    const bool try_th = cudnnGetVersion() >= 92600;
    if (!try_th) why = str("cuDNN ", cudnnGetVersion(), " < 9.26 reads no other order in the backward");
    for (StatsLayout layout : {StatsLayout::TH, StatsLayout::BHS}) {
      if (layout == StatsLayout::TH && !try_th) continue;
      try {
        int64_t ws_fwd = 0, ws_bwd = 0;
        auto fwd = build_fwd(h, key, layout, ws_fwd);
        auto bwd = build_bwd(h, key, layout, ws_bwd);
        ensure_workspace(st, std::max(ws_fwd, ws_bwd));
        p.backend = AttentionBackend::cudnn;
        p.stats = layout;
        p.fwd = std::move(fwd);
        p.bwd = std::move(bwd);
        p.reason = str("statistics in ", layout_str(layout), " order", why.empty() ? "" : ": ", why);
        return p;
      } catch (const std::exception& e) {
        why += str(why.empty() ? "" : "; ", layout_str(layout), " refused: ", e.what());
      }
    }
  }
  if (mode == Mode::cudnn) MT_THROW("attention ", key_str(key), ": MOETRAIN_ATTENTION=cudnn but ", why);
  p.reason = "cuDNN unavailable: " + why;
  return p;
}

// The plan of this shape, decided on first use. Call with st.mu held.
const Plan& plan_for(State& st, const ShapeKey& key) {
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return it->second;
  Plan p = decide(st, key);
  log_info("attention ", key_str(key), ": ", p.backend == AttentionBackend::cudnn ? "cuDNN SDPA" : "reference kernels",
           " (", p.reason, ")");
  return st.plans.emplace(key, std::move(p)).first->second;
}

bool aligned16(const Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.raw()) & 15) == 0;
}

// cuDNN wants 16-byte aligned pointers; a view starting mid-allocation may not be.
bool all_aligned(State& st, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!aligned16(*t)) {
      if (!st.warned_unaligned)
        log_info("attention: a tensor is not 16-byte aligned; such calls run the reference kernels");
      st.warned_unaligned = true;
      return false;
    }
  }
  return true;
}

}  // namespace

AttentionPlanInfo attention_plan_info(int64_t B, int64_t S, int64_t H, int64_t G, int64_t Hd) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const Plan& p = plan_for(st, ShapeKey{B, S, H, G, Hd, deterministic()});
  return {p.backend, p.stats, p.reason};
}

void attention_fwd(const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd, int64_t B, int64_t S,
                   Tensor& out_THHd, Tensor& lse_TH, const Tensor* doc_start_T) {
  const detail::AttnDims d = detail::check_attention_inputs(q_THHd, k_TGHd, v_TGHd, B, S, "attention_fwd");
  check_cuda(out_THHd, DType::BF16, {d.T, d.H, d.Hd}, "attention_fwd out_THHd");
  check_cuda(lse_TH, DType::F32, {d.T, d.H}, "attention_fwd lse_TH");
  if (d.T == 0) return;
  if (batch_invariant()) {  // each query row as the paged decode attention computes it (invariant.cuh), the
                            // statistics in the order this shape's backward reads
    const bool bhs = !doc_start_T && attention_plan_info(B, S, d.H, d.G, d.Hd).stats == StatsLayout::BHS;
    invariant_attention_fwd(q_THHd, k_TGHd, v_TGHd, B, S, out_THHd, lse_TH, doc_start_T, bhs);
    return;
  }
  if (doc_start_T) {  // packed rows: the reference kernels (cuDNN's ragged layout is not wired up yet)
    attention_ref_fwd(q_THHd, k_TGHd, v_TGHd, B, S, out_THHd, lse_TH, StatsLayout::TH, doc_start_T);
    return;
  }
  const ShapeKey key{B, S, d.H, d.G, d.Hd, deterministic()};
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const Plan& p = plan_for(st, key);
  if (p.backend == AttentionBackend::reference || !all_aligned(st, {&q_THHd, &k_TGHd, &v_TGHd, &out_THHd, &lse_TH})) {
    attention_ref_fwd(q_THHd, k_TGHd, v_TGHd, B, S, out_THHd, lse_TH, p.stats);
    return;
  }
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q_THHd.raw()}, {kK, k_TGHd.raw()}, {kV, v_TGHd.raw()}, {kO, out_THHd.raw()}, {kStats, lse_TH.raw()}};
  fe_check(p.fwd->execute(handle(st), pack, st.workspace.defined() ? st.workspace.raw() : nullptr), "forward execute",
           key);
}

void attention_bwd(const Tensor& dout_THHd, const Tensor& q_THHd, const Tensor& k_TGHd, const Tensor& v_TGHd,
                   const Tensor& out_THHd, const Tensor& lse_TH, int64_t B, int64_t S, Tensor& dq_THHd, Tensor& dk_TGHd,
                   Tensor& dv_TGHd, const Tensor* doc_start_T) {
  const detail::AttnDims d = detail::check_attention_inputs(q_THHd, k_TGHd, v_TGHd, B, S, "attention_bwd");
  const Shape q_shape{d.T, d.H, d.Hd}, kv_shape{d.T, d.G, d.Hd};
  check_cuda(dout_THHd, DType::BF16, q_shape, "attention_bwd dout_THHd");
  check_cuda(out_THHd, DType::BF16, q_shape, "attention_bwd out_THHd");
  check_cuda(lse_TH, DType::F32, {d.T, d.H}, "attention_bwd lse_TH");
  check_cuda(dq_THHd, DType::BF16, q_shape, "attention_bwd dq_THHd");
  check_cuda(dk_TGHd, DType::BF16, kv_shape, "attention_bwd dk_TGHd");
  check_cuda(dv_TGHd, DType::BF16, kv_shape, "attention_bwd dv_TGHd");
  if (d.T == 0) return;
  if (doc_start_T) {  // packed rows: the forward ran the reference kernels with [T, H] statistics
    attention_ref_bwd(dout_THHd, q_THHd, k_TGHd, v_TGHd, out_THHd, lse_TH, B, S, dq_THHd, dk_TGHd, dv_TGHd,
                      StatsLayout::TH, doc_start_T);
    return;
  }
  const ShapeKey key{B, S, d.H, d.G, d.Hd, deterministic()};
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const Plan& p = plan_for(st, key);
  if (p.backend == AttentionBackend::reference ||
      !all_aligned(st, {&dout_THHd, &q_THHd, &k_TGHd, &v_TGHd, &out_THHd, &lse_TH, &dq_THHd, &dk_TGHd, &dv_TGHd})) {
    attention_ref_bwd(dout_THHd, q_THHd, k_TGHd, v_TGHd, out_THHd, lse_TH, B, S, dq_THHd, dk_TGHd, dv_TGHd, p.stats);
    return;
  }
  std::unordered_map<int64_t, void*> pack = {{kQ, q_THHd.raw()},   {kK, k_TGHd.raw()},     {kV, v_TGHd.raw()},
                                             {kO, out_THHd.raw()}, {kdO, dout_THHd.raw()}, {kStats, lse_TH.raw()},
                                             {kdQ, dq_THHd.raw()}, {kdK, dk_TGHd.raw()},   {kdV, dv_TGHd.raw()}};
  fe_check(p.bwd->execute(handle(st), pack, st.workspace.defined() ? st.workspace.raw() : nullptr), "backward execute",
           key);
}

}  // namespace mt::cuda
