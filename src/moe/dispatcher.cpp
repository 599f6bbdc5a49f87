// The expert-parallel token dispatcher (see dispatcher.h for its promises). Local phases use ops::
// calls (make_dispatch_plan, permute, unpermute) so that they run on whichever device the
// communicator uses; the few steps no op covers (the capacity drop and the regroup indices) are host
// loops over small index arrays, kept in the helpers below.
#include "moe/dispatcher.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "ops/ops.h"
#include "ops/profile.h"

namespace mt::moe {

namespace {

std::vector<int64_t> host_i64(const Tensor& t) {
  Tensor h = t.to(Device::CPU);
  const int64_t* p = h.data<int64_t>();
  return std::vector<int64_t>(p, p + h.numel());
}

std::vector<int32_t> host_i32(const Tensor& t) {
  Tensor h = t.to(Device::CPU);
  const int32_t* p = h.data<int32_t>();
  return std::vector<int32_t>(p, p + h.numel());
}

template <class T>
Tensor device_tensor(const std::vector<T>& v, const Shape& shape, Device device) {
  Tensor h = Tensor::empty(shape, DTypeOf<T>::value, Device::CPU);
  MT_CHECK(size_t(h.numel()) == v.size(), "device_tensor: ", v.size(), " values for ", shape_str(shape));
  std::copy(v.begin(), v.end(), h.data<T>());
  return h.to(device);
}

std::vector<int64_t> scaled(const std::vector<int64_t>& counts, int64_t by) {
  std::vector<int64_t> out(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * by;
  return out;
}

// The source side of a plan after the capacity drop (host arrays).
struct KeptAssignments {
  std::vector<int64_t> offsets;        // [E+1] over kept rows
  std::vector<int32_t> assign_of_row;  // [S]
  std::vector<int32_t> row_of_assign;  // [T*K]; S for a dropped assignment
  int64_t dropped = 0;
};

// Host helper, drop policy "probs": among the rows of each expert (already sorted by assignment
// index), keep the `capacity` with the highest weight (ties: the lower assignment index) and drop
// the rest; kept rows stay in assignment order. A NaN weight ranks lowest, so the sort stays a
// strict weak order.
KeptAssignments host_apply_capacity(const std::vector<int64_t>& offsets, const std::vector<int32_t>& assign_of_row,
                                    const float* w, int64_t T, int64_t K, int64_t E, int64_t capacity) {
  const int64_t R = T * K;
  std::vector<char> keep(size_t(R), 1);
  std::vector<int32_t> rows;
  auto key = [&](int32_t a) {
    const float v = w[a];
    return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
  };
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offsets[size_t(e) + 1] - offsets[size_t(e)];
    if (n <= capacity) continue;
    rows.assign(assign_of_row.begin() + offsets[size_t(e)], assign_of_row.begin() + offsets[size_t(e) + 1]);
    std::sort(rows.begin(), rows.end(), [&](int32_t a, int32_t b) {
      const float ka = key(a), kb = key(b);
      return ka != kb ? ka > kb : a < b;
    });
    for (size_t i = size_t(capacity); i < rows.size(); ++i) keep[size_t(rows[i])] = 0;
  }
  KeptAssignments out;
  out.offsets.assign(size_t(E) + 1, 0);
  out.row_of_assign.assign(size_t(R), -1);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets[size_t(e)]; r < offsets[size_t(e) + 1]; ++r) {
      const int32_t a = assign_of_row[size_t(r)];
      if (!keep[size_t(a)]) continue;
      out.row_of_assign[size_t(a)] = int32_t(out.assign_of_row.size());
      out.assign_of_row.push_back(a);
    }
    out.offsets[size_t(e) + 1] = int64_t(out.assign_of_row.size());
  }
  const int32_t S = int32_t(out.assign_of_row.size());
  for (int32_t& r : out.row_of_assign)
    if (r < 0) r = S;  // the zero row
  out.dropped = R - S;
  return out;
}

// The compute stream waits for a started exchange (if any) that delivers into `arriving`; when
// profiling, the wait is timed as comm_ep_all_to_all: the part of the transfer nothing overlapped.
void wait_exposed(std::shared_ptr<comm::Work>& work, const Tensor& arriving) {
  if (!work) return;
  ops::OpScope scope("comm_ep_all_to_all", arriving.device() == Device::CUDA);
  work->wait();
  work.reset();
}

// Host helper: the regroup from recv order (source-major, then local expert) to expert-major
// order (local expert, then source). xr_from_recv[i] is the recv row that xr row i takes.
std::vector<int32_t> host_regroup(const std::vector<int64_t>& counts_SL, int64_t P, int64_t L) {
  std::vector<int64_t> start(size_t(P * L));  // recv row where block (s, l) begins
  int64_t pos = 0;
  for (int64_t i = 0; i < P * L; ++i) {
    start[size_t(i)] = pos;
    pos += counts_SL[size_t(i)];
  }
  std::vector<int32_t> xr_from_recv;
  xr_from_recv.reserve(size_t(pos));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t s = 0; s < P; ++s)
      for (int64_t j = 0; j < counts_SL[size_t(s * L + l)]; ++j)
        xr_from_recv.push_back(int32_t(start[size_t(s * L + l)] + j));
  return xr_from_recv;
}

}  // namespace

int64_t expert_capacity(int64_t T, int64_t K, int64_t E, double capacity_factor) {
  if (!(capacity_factor > 0) || !std::isfinite(capacity_factor))
    MT_THROW("capacity_factor (", capacity_factor, ") must be a finite number > 0 (0 means dropless)");
  if (E < 1) MT_THROW("expert_capacity: num_experts (", E, ") must be at least 1");
  return int64_t(std::ceil((double(T * K) / double(E)) * capacity_factor));
}

ExpertDispatcher::ExpertDispatcher(comm::Communicator& ep_comm, int64_t num_experts, DispatcherOptions opt)
    : comm_(ep_comm), E_(num_experts), L_(0), opt_(opt) {
  const int64_t P = ep_comm.size();
  if (num_experts < 1) MT_THROW("num_experts (", num_experts, ") must be at least 1");
  if (num_experts % P != 0) MT_THROW("num_experts (", num_experts, ") must be divisible by ep (", P, ")");
  if (!(opt.capacity_factor >= 0) || !std::isfinite(opt.capacity_factor))
    MT_THROW("capacity_factor (", opt.capacity_factor, ") must be >= 0 (0 means dropless)");
  L_ = num_experts / P;
}

void ExpertDispatcher::check_plan(const DispatchPlan& plan, const char* what) const {
  if (plan.ep != comm_.size() || plan.ep_rank != comm_.rank() || plan.E != E_)
    MT_THROW("ExpertDispatcher::", what, ": the plan was made for ep rank ", plan.ep_rank, " of ", plan.ep, " with ",
             plan.E, " experts; this dispatcher is ep rank ", comm_.rank(), " of ", comm_.size(), " with ", E_,
             " experts");
}

DispatchPlan ExpertDispatcher::prepare(const Tensor& topk_idx_TK, const Tensor& topk_w_TK) const {
  ops::OpScope scope("ep_prepare", comm_.device() == Device::CUDA);  // host syncs and the counts exchange
  const Device dev = comm_.device();
  if (topk_idx_TK.dim() != 2 || topk_idx_TK.dtype() != DType::I32)
    MT_THROW("ExpertDispatcher::prepare: topk_idx_TK must be i32 [T, K], got ", topk_idx_TK.desc());
  if (topk_idx_TK.device() != dev)
    MT_THROW("ExpertDispatcher::prepare: topk_idx_TK is ", topk_idx_TK.desc(), " but the ep communicator '",
             comm_.name(), "' works on ", device_name(dev));
  const int64_t T = topk_idx_TK.size(0), K = topk_idx_TK.size(1), P = comm_.size();
  if (K < 1) MT_THROW("ExpertDispatcher::prepare: topk_idx_TK ", topk_idx_TK.desc(), " has K = ", K, "; need K >= 1");
  const bool capped = opt_.capacity_factor > 0;
  if (topk_w_TK.defined()) {
    if (topk_w_TK.dtype() != DType::F32 || topk_w_TK.shape() != Shape{T, K})
      MT_THROW("ExpertDispatcher::prepare: topk_w_TK is ", topk_w_TK.desc(), "; expected f32 [", T, ", ", K,
               "] like topk_idx_TK");
  } else if (capped) {
    MT_THROW("ExpertDispatcher::prepare: capacity_factor ", opt_.capacity_factor,
             " needs the routing weights topk_w_TK (the drop policy keeps the highest-weight assignments)");
  }

  DispatchPlan plan;
  plan.T = T, plan.K = K, plan.E = E_, plan.ep = P, plan.ep_rank = comm_.rank(), plan.local_experts = L_;

  // Local: sort this rank's assignments by global expert (= by destination rank).
  plan.send_offsets_E1 = Tensor::empty({E_ + 1}, DType::I64, dev);
  plan.send_assign_of_row_S = Tensor::empty({T * K}, DType::I32, dev);
  plan.row_of_assign_TK = Tensor::empty({T, K}, DType::I32, dev);
  ops::make_dispatch_plan(topk_idx_TK, E_, plan.send_offsets_E1, plan.send_assign_of_row_S, plan.row_of_assign_TK);
  std::vector<int64_t> off = host_i64(plan.send_offsets_E1);
  if (capped) {
    plan.capacity = expert_capacity(T, K, E_, opt_.capacity_factor);
    Tensor w_h = topk_w_TK.to(Device::CPU);
    KeptAssignments kept =
        host_apply_capacity(off, host_i32(plan.send_assign_of_row_S), w_h.data<float>(), T, K, E_, plan.capacity);
    plan.n_dropped = kept.dropped;
    if (kept.dropped > 0) {
      off = kept.offsets;
      plan.send_offsets_E1 = device_tensor(off, {E_ + 1}, dev);
      plan.send_assign_of_row_S = device_tensor(kept.assign_of_row, {int64_t(kept.assign_of_row.size())}, dev);
      plan.row_of_assign_TK = device_tensor(kept.row_of_assign, {T, K}, dev);
    }
  }
  plan.rows_sent = off[size_t(E_)];
  plan.send_counts.assign(size_t(P), 0);
  for (int64_t j = 0; j < P; ++j) plan.send_counts[size_t(j)] = off[size_t((j + 1) * L_)] - off[size_t(j * L_)];

  // The counts exchange: rows per global expert e = j*L + l go to rank j as its local expert l, so
  // the per-expert counts are exactly the fixed-size (L per rank) all_to_all payload.
  Tensor counts_E = Tensor::empty({E_}, DType::I64, Device::CPU);
  for (int64_t e = 0; e < E_; ++e) counts_E.data<int64_t>()[e] = off[size_t(e) + 1] - off[size_t(e)];
  if (P == 1) {
    plan.recv_counts_SL = host_i64(counts_E);
  } else {
    Tensor send = counts_E.to(dev), recv = Tensor::empty({E_}, DType::I64, dev);
    const std::vector<int64_t> equal(size_t(P), L_);
    comm_.all_to_all_v(send, equal, recv, equal)->wait();
    plan.recv_counts_SL = host_i64(recv);
  }

  // Local: what arrives, from whom, and its expert-major order.
  plan.recv_counts.assign(size_t(P), 0);
  plan.local_offsets_host.assign(size_t(L_) + 1, 0);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t l = 0; l < L_; ++l) {
      const int64_t c = plan.recv_counts_SL[size_t(s * L_ + l)];
      if (c < 0)
        MT_THROW("ExpertDispatcher::prepare: ep rank ", s, " announced ", c, " rows for local expert ", l,
                 " of ep rank ", comm_.rank(), "; counts must be >= 0");
      plan.recv_counts[size_t(s)] += c;
      plan.local_offsets_host[size_t(l) + 1] += c;
    }
  }
  for (int64_t l = 0; l < L_; ++l) plan.local_offsets_host[size_t(l) + 1] += plan.local_offsets_host[size_t(l)];
  plan.rows_received = plan.local_offsets_host[size_t(L_)];
  if (plan.rows_received > std::numeric_limits<int32_t>::max())
    MT_THROW("ExpertDispatcher::prepare: ep rank ", comm_.rank(), " would receive ", plan.rows_received,
             " rows, beyond the i32 row index range");
  plan.local_offsets = device_tensor(plan.local_offsets_host, {L_ + 1}, dev);
  std::vector<int32_t> g = host_regroup(plan.recv_counts_SL, P, L_);
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] != int32_t(i)) {
      plan.regroup_identity = false;
      break;
    }
  }
  if (!plan.regroup_identity) {
    std::vector<int32_t> h(g.size());
    for (size_t i = 0; i < g.size(); ++i) h[size_t(g[i])] = int32_t(i);
    plan.xr_from_recv_R = device_tensor(g, {int64_t(g.size())}, dev);
    plan.recv_from_xr_R = device_tensor(h, {int64_t(h.size())}, dev);
  }
  return plan;
}

// ---- shared pieces ----

Tensor ExpertDispatcher::to_expert_order(const DispatchPlan& plan, const Tensor& recv_RD, const char* what) const {
  if (recv_RD.dim() != 2 || recv_RD.size(0) != plan.rows_received)
    MT_THROW("ExpertDispatcher::", what, ": rows in recv order are ", recv_RD.desc(), "; expected [",
             plan.rows_received, ", D] (the rows this rank receives)");
  if (plan.regroup_identity) return recv_RD;
  Tensor xr = Tensor::empty(recv_RD.shape(), recv_RD.dtype(), recv_RD.device());
  ops::permute_fwd(recv_RD, plan.xr_from_recv_R, 1, xr);
  return xr;
}

Tensor ExpertDispatcher::to_recv_order(const DispatchPlan& plan, const Tensor& r_RD, const char* what) const {
  if (r_RD.dim() != 2 || r_RD.size(0) != plan.rows_received)
    MT_THROW("ExpertDispatcher::", what, ": expert-side rows are ", r_RD.desc(), "; expected [", plan.rows_received,
             ", D] (the rows dispatch delivered to this rank)");
  if (plan.regroup_identity) return r_RD;
  Tensor out = Tensor::empty(r_RD.shape(), r_RD.dtype(), r_RD.device());
  ops::permute_fwd(r_RD, plan.recv_from_xr_R, 1, out);
  return out;
}

std::shared_ptr<comm::Work> ExpertDispatcher::exchange_start(const DispatchPlan& plan, const Tensor& in,
                                                             const std::vector<int64_t>& in_counts, int64_t out_rows,
                                                             const std::vector<int64_t>& out_counts, Tensor& out) {
  if (plan.ep == 1) {
    out = in;
    return nullptr;
  }
  const int64_t D = in.size(1);
  out = Tensor::empty({out_rows, D}, in.dtype(), in.device());
  return comm_.all_to_all_v(in, scaled(in_counts, D), out, scaled(out_counts, D));
}

std::shared_ptr<comm::Work> ExpertDispatcher::sources_to_experts_start(const DispatchPlan& plan, const Tensor& s_SD,
                                                                       Tensor& out, const char* what) {
  if (s_SD.dim() != 2 || s_SD.size(0) != plan.rows_sent)
    MT_THROW("ExpertDispatcher::", what, ": source-side rows are ", s_SD.desc(), "; expected [", plan.rows_sent,
             ", D] (the rows this rank sends)");
  return exchange_start(plan, s_SD, plan.send_counts, plan.rows_received, plan.recv_counts, out);
}

Tensor ExpertDispatcher::sources_to_experts(const DispatchPlan& plan, const Tensor& s_SD, const char* what) {
  Tensor out;
  ops::OpScope scope("comm_ep_all_to_all", s_SD.device() == Device::CUDA);  // its time, when profiling
  std::shared_ptr<comm::Work> w = sources_to_experts_start(plan, s_SD, out, what);
  if (w) w->wait();
  return out;
}

std::shared_ptr<comm::Work> ExpertDispatcher::experts_to_sources_start(const DispatchPlan& plan, const Tensor& r_RD,
                                                                       Tensor& out, const char* what) {
  if (r_RD.dim() != 2 || r_RD.size(0) != plan.rows_received)
    MT_THROW("ExpertDispatcher::", what, ": rows in recv order are ", r_RD.desc(), "; expected [", plan.rows_received,
             ", D]");
  return exchange_start(plan, r_RD, plan.recv_counts, plan.rows_sent, plan.send_counts, out);
}

Tensor ExpertDispatcher::experts_to_sources(const DispatchPlan& plan, const Tensor& r_RD, int64_t extra_rows,
                                            const char* what) {
  if (r_RD.dim() != 2 || r_RD.size(0) != plan.rows_received)
    MT_THROW("ExpertDispatcher::", what, ": rows in recv order are ", r_RD.desc(), "; expected [", plan.rows_received,
             ", D]");
  const int64_t D = r_RD.size(1), S = plan.rows_sent;
  if (plan.ep == 1 && extra_rows == 0) return r_RD;
  Tensor out = Tensor::empty({S + extra_rows, D}, r_RD.dtype(), r_RD.device());
  Tensor body = out.rows(0, S);
  if (plan.ep == 1)
    body.copy_from(r_RD);
  else {
    ops::OpScope scope("comm_ep_all_to_all", r_RD.device() == Device::CUDA);
    comm_.all_to_all_v(r_RD, scaled(plan.recv_counts, D), body, scaled(plan.send_counts, D))->wait();
  }
  if (extra_rows > 0) out.rows(S, extra_rows).zero_();
  return out;
}

// ---- dispatch ----

Tensor ExpertDispatcher::dispatch_prepare(const DispatchPlan& plan, const Tensor& x_TD) const {
  check_plan(plan, "dispatch");
  if (x_TD.dim() != 2 || x_TD.size(0) != plan.T)
    MT_THROW("ExpertDispatcher::dispatch: x_TD is ", x_TD.desc(), "; expected [", plan.T,
             ", D] (T from the plan's topk_idx_TK)");
  Tensor xs = Tensor::empty({plan.rows_sent, x_TD.size(1)}, x_TD.dtype(), x_TD.device());
  ops::permute_fwd(x_TD, plan.send_assign_of_row_S, plan.K, xs);
  return xs;
}

Tensor ExpertDispatcher::dispatch_comm(const DispatchPlan& plan, const Tensor& xs_SD) {
  return sources_to_experts(plan, xs_SD, "dispatch");
}

Tensor ExpertDispatcher::dispatch_finish(const DispatchPlan& plan, const Tensor& recv_RD) const {
  return to_expert_order(plan, recv_RD, "dispatch");
}

Tensor ExpertDispatcher::dispatch(const DispatchPlan& plan, const Tensor& x_TD) {
  Tensor xs = dispatch_prepare(plan, x_TD);
  Tensor recv = dispatch_comm(plan, xs);
  return dispatch_finish(plan, recv);
}

void ExpertDispatcher::dispatch_bwd(const DispatchPlan& plan, const Tensor& dxr_RD, Tensor& dx_TD) {
  DispatchBwdPending p = dispatch_bwd_start(plan, dxr_RD);
  dispatch_bwd_finish(plan, p, dx_TD);
}

DispatchBwdPending ExpertDispatcher::dispatch_bwd_start(const DispatchPlan& plan, const Tensor& dxr_RD) {
  check_plan(plan, "dispatch_bwd");
  DispatchBwdPending p;
  Tensor dxb = to_recv_order(plan, dxr_RD, "dispatch_bwd");
  p.work = experts_to_sources_start(plan, dxb, p.dxs_SD, "dispatch_bwd");
  return p;
}

void ExpertDispatcher::dispatch_bwd_finish(const DispatchPlan& plan, DispatchBwdPending& pending, Tensor& dx_TD) {
  check_plan(plan, "dispatch_bwd");
  if (dx_TD.dim() != 2 || dx_TD.size(0) != plan.T || dx_TD.size(1) != pending.dxs_SD.size(1))
    MT_THROW("ExpertDispatcher::dispatch_bwd: dx_TD is ", dx_TD.desc(), " and the returning rows ",
             pending.dxs_SD.desc(), "; expected dx [", plan.T, ", D] with the D of dxr");
  wait_exposed(pending.work, pending.dxs_SD);
  ops::permute_bwd(pending.dxs_SD, plan.send_assign_of_row_S, plan.K, dx_TD);
}

Tensor ExpertDispatcher::dispatch_bwd(const DispatchPlan& plan, const Tensor& dxr_RD) {
  if (dxr_RD.dim() != 2)
    MT_THROW("ExpertDispatcher::dispatch_bwd: dxr_RD is ", dxr_RD.desc(), "; expected [", plan.rows_received, ", D]");
  Tensor dx = Tensor::zeros({plan.T, dxr_RD.size(1)}, dxr_RD.dtype(), dxr_RD.device());
  dispatch_bwd(plan, dxr_RD, dx);
  return dx;
}

Tensor ExpertDispatcher::dispatch_weighted(const DispatchPlan& plan, const Tensor& x_TD, const Tensor& w_TK) {
  check_plan(plan, "dispatch_weighted");
  if (x_TD.dim() != 2 || x_TD.size(0) != plan.T)
    MT_THROW("ExpertDispatcher::dispatch_weighted: x_TD is ", x_TD.desc(), "; expected [", plan.T, ", D]");
  if (w_TK.shape() != Shape{plan.T, plan.K} || w_TK.dtype() != DType::F32)
    MT_THROW("ExpertDispatcher::dispatch_weighted: w_TK is ", w_TK.desc(), "; expected f32 [", plan.T, ", ", plan.K, "]");
  // Sent order, plus the row that dropped assignments point at (written, never sent).
  const int64_t S = plan.rows_sent, S1 = S + (plan.has_drops() ? 1 : 0);
  Tensor xs = Tensor::empty({S1, x_TD.size(1)}, x_TD.dtype(), x_TD.device());
  ops::permute_weighted_fwd(x_TD, plan.row_of_assign_TK, w_TK, xs);
  Tensor recv = dispatch_comm(plan, S1 == S ? xs : xs.rows(0, S));
  return dispatch_finish(plan, recv);
}

Tensor ExpertDispatcher::dispatch_weighted_bwd(const DispatchPlan& plan, const Tensor& dxr_RD, const Tensor& x_TD,
                                               const Tensor& w_TK, Tensor& dx_TD) {
  check_plan(plan, "dispatch_weighted_bwd");
  if (dx_TD.dim() != 2 || dx_TD.size(0) != plan.T || x_TD.shape() != dx_TD.shape() || dxr_RD.dim() != 2 ||
      dx_TD.size(1) != dxr_RD.size(1))
    MT_THROW("ExpertDispatcher::dispatch_weighted_bwd: dx_TD is ", dx_TD.desc(), ", x_TD ", x_TD.desc(), " and dxr_RD ",
             dxr_RD.desc(), "; expected x and dx [", plan.T, ", D] with the D of dxr");
  Tensor dxb = to_recv_order(plan, dxr_RD, "dispatch_weighted_bwd");
  // Sent order with a zero row for the dropped assignments: their dx and dw are exactly 0.
  Tensor dxs = experts_to_sources(plan, dxb, plan.has_drops() ? 1 : 0, "dispatch_weighted_bwd");
  Tensor dw = Tensor::empty({plan.T, plan.K}, DType::F32, dx_TD.device());
  ops::permute_weighted_bwd(dxs, x_TD, plan.row_of_assign_TK, w_TK, dx_TD, dw);
  return dw;
}

// ---- combine ----

Tensor ExpertDispatcher::combine_prepare(const DispatchPlan& plan, const Tensor& yr_RD) const {
  check_plan(plan, "combine");
  return to_recv_order(plan, yr_RD, "combine");
}

Tensor ExpertDispatcher::combine_comm(const DispatchPlan& plan, const Tensor& yb_RD) {
  return experts_to_sources(plan, yb_RD, plan.has_drops() ? 1 : 0, "combine");
}

Tensor ExpertDispatcher::combine_finish(const DispatchPlan& plan, const Tensor& ys_SD, const Tensor& w_TK) const {
  Tensor y = Tensor::empty({plan.T, ys_SD.size(1)}, ys_SD.dtype(), ys_SD.device());
  combine_finish(plan, ys_SD, w_TK, y);
  return y;
}

void ExpertDispatcher::combine_finish(const DispatchPlan& plan, const Tensor& ys_SD, const Tensor& w_TK,
                                      Tensor& y_TD) const {
  const int64_t S1 = plan.rows_sent + (plan.has_drops() ? 1 : 0);
  if (ys_SD.dim() != 2 || ys_SD.size(0) != S1)
    MT_THROW("ExpertDispatcher::combine: ys_SD is ", ys_SD.desc(), "; expected [", S1, ", D]");
  if (w_TK.shape() != Shape{plan.T, plan.K} || w_TK.dtype() != DType::F32)
    MT_THROW("ExpertDispatcher::combine: w_TK is ", w_TK.desc(), "; expected f32 [", plan.T, ", ", plan.K, "]");
  ops::unpermute_fwd(ys_SD, plan.row_of_assign_TK, w_TK, y_TD);
}

Combined ExpertDispatcher::combine(const DispatchPlan& plan, const Tensor& yr_RD, const Tensor& w_TK) {
  if (w_TK.shape() != Shape{plan.T, plan.K} || w_TK.dtype() != DType::F32)
    MT_THROW("ExpertDispatcher::combine: w_TK is ", w_TK.desc(), "; expected f32 [", plan.T, ", ", plan.K, "]");
  Tensor yb = combine_prepare(plan, yr_RD);
  Combined out;
  out.ys_SD = combine_comm(plan, yb);
  out.y_TD = combine_finish(plan, out.ys_SD, w_TK);
  return out;
}

CombineBwdPending ExpertDispatcher::combine_bwd_start(const DispatchPlan& plan, const Tensor& dy_TD,
                                                     const Tensor& ys_SD, const Tensor& w_TK) {
  check_plan(plan, "combine_bwd");
  const int64_t S = plan.rows_sent, S1 = S + (plan.has_drops() ? 1 : 0);
  if (dy_TD.dim() != 2 || dy_TD.size(0) != plan.T)
    MT_THROW("ExpertDispatcher::combine_bwd: dy_TD is ", dy_TD.desc(), "; expected [", plan.T, ", D]");
  if (ys_SD.dim() != 2 || ys_SD.size(0) != S1 || ys_SD.size(1) != dy_TD.size(1))
    MT_THROW("ExpertDispatcher::combine_bwd: ys_SD is ", ys_SD.desc(), "; expected [", S1, ", ", dy_TD.size(1),
             "] (what combine saved)");
  if (w_TK.shape() != Shape{plan.T, plan.K} || w_TK.dtype() != DType::F32)
    MT_THROW("ExpertDispatcher::combine_bwd: w_TK is ", w_TK.desc(), "; expected f32 [", plan.T, ", ", plan.K, "]");
  CombineBwdPending p;
  Tensor dys = Tensor::empty(ys_SD.shape(), ys_SD.dtype(), ys_SD.device());
  p.dw_TK = Tensor::empty({plan.T, plan.K}, DType::F32, w_TK.device());
  // Dropped assignments point at the zero row, so their weight gradient <dy, 0> is exactly 0.
  ops::unpermute_bwd(dy_TD, ys_SD, plan.row_of_assign_TK, w_TK, dys, p.dw_TK);
  p.work = sources_to_experts_start(plan, S1 == S ? dys : dys.rows(0, S), p.dyb_RD, "combine_bwd");
  return p;
}

CombineGrads ExpertDispatcher::combine_bwd_finish(const DispatchPlan& plan, CombineBwdPending& pending) {
  wait_exposed(pending.work, pending.dyb_RD);
  CombineGrads g;
  g.dw_TK = pending.dw_TK;
  g.dyr_RD = to_expert_order(plan, pending.dyb_RD, "combine_bwd");
  return g;
}

CombineGrads ExpertDispatcher::combine_bwd(const DispatchPlan& plan, const Tensor& dy_TD, const Tensor& ys_SD,
                                           const Tensor& w_TK) {
  CombineBwdPending p = combine_bwd_start(plan, dy_TD, ys_SD, w_TK);
  return combine_bwd_finish(plan, p);
}

}  // namespace mt::moe
