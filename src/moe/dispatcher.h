// The expert-parallel token dispatcher: moves each token's top-k assignments to the ranks that own
// their experts and brings the expert outputs back, weighted by the routing scores. It promises:
//   - the ranks of one `ep` communicator split the E experts in contiguous blocks: ep rank j owns
//     experts [j E/ep, (j+1) E/ep) (E not divisible by ep is an error naming both numbers);
//   - every direction has three phases, Megatron style: a local prepare (ops:: calls where an op
//     exists), communication only (one all_to_all_v), and a local finish. The composite calls
//     (dispatch, combine, ...) run the three in order; the phases are public so that a caller can
//     overlap them with other work later;
//   - `prepare` makes the only decision (routing order, capacity drops, counts; one fixed-size
//     counts exchange). Everything later, forward, backward and a recompute, reads the plan and
//     issues exactly one all_to_all_v per call, never a collective of its own choosing (docs/design.md:
//     recompute never re-decides routing);
//   - rows arrive grouped by local expert (all rows of local expert 0 from every source, source
//     rank ascending, then local expert 1, ...), within a source in assignment order (t*K + k), so the
//     grouped experts op runs on them with `plan.local_offsets`;
//   - ep = 1 is exactly the single-device path (ops::make_dispatch_plan, permute, unpermute): same
//     rows, same order, no communication, bit-identical results;
//   - dropless by default; with capacity_factor > 0 each expert takes at most
//     capacity = ceil((T*K / E) * capacity_factor) assignments from each source rank (T the source's
//     tokens; Megatron's get_capacity), keeping the highest-weight ones (policy "probs"; ties keep the
//     lower assignment index). A dropped assignment contributes zero to the output, zero to dx, and
//     its weight gradient is exactly zero.
// Gradient contracts as in ops.h: dispatch_bwd accumulates (+=) into dx (it sums the K copies of a
// token), combine_bwd writes (=) dyr and dw.
//
// Shape letters (docs/shapes.md): T tokens on this rank, K top-k, D hidden, E global experts,
// L = E / ep local experts, S rows this rank sends (kept assignments), Rr rows it receives.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt::moe {

struct DispatcherOptions {
  // 0: dropless. > 0: per-expert capacity per source rank (see the file comment), drop policy "probs".
  double capacity_factor = 0;
};

// Everything the dispatch, the combine, their backwards and a recompute need, decided once. The
// index tensors live on the communicator's device (the ops read them); the counts are host vectors
// (all_to_all_v takes them on the host).
struct DispatchPlan {
  int64_t T = 0, K = 0, E = 0;
  int64_t ep = 1, ep_rank = 0, local_experts = 0;  // local_experts = E / ep
  int64_t capacity = -1;                           // per expert per source rank; -1 when dropless
  int64_t n_dropped = 0;                           // assignments of this rank dropped by the capacity
  int64_t rows_sent = 0;                           // S: kept assignments of this rank
  int64_t rows_received = 0;                       // Rr: rows the local experts receive, from all sources

  // Source side. Sent rows are this rank's kept assignments sorted by global expert, stably (so
  // within an expert by assignment a = t*K + k); since experts are owned in contiguous blocks this
  // is also destination-rank order.
  Tensor send_offsets_E1;            // i64 [E+1]: sent rows of global expert e are [off[e], off[e+1])
  Tensor send_assign_of_row_S;       // i32 [S]: the assignment a in sent row i
  Tensor row_of_assign_TK;           // i32 [T, K]: the sent row of assignment (t, k); S when it was dropped
  std::vector<int64_t> send_counts;  // [ep]: rows sent to each rank
  std::vector<int64_t> recv_counts;  // [ep]: rows received from each rank

  // Expert side. "recv order" is the order all_to_all_v delivers: source-major, and within a source
  // by local expert. The local finish regroups it expert-major.
  std::vector<int64_t> recv_counts_SL;      // [ep * L]: rows from source s for local expert l at s*L + l
  Tensor local_offsets;                     // i64 [L+1]: received rows of local expert l are [off[l], off[l+1]) of xr
  std::vector<int64_t> local_offsets_host;  // the same on the host
  bool regroup_identity = true;             // recv order is already expert-major (ep = 1, L = 1, ...)
  Tensor xr_from_recv_R;                    // i32 [Rr]: xr row i is recv row xr_from_recv[i]; undefined when identity
  Tensor recv_from_xr_R;                    // i32 [Rr]: the inverse permutation; undefined when identity

  // Whether any assignment of this rank was dropped (then the source side keeps a zero row at
  // index S that dropped assignments point at, so the combine's ops need no special case).
  bool has_drops() const { return n_dropped > 0; }
};

// What combine_bwd needs from the forward: the expert outputs back at the source, in sent-row
// order (S rows, plus the zero row when the plan has drops). For ep = 1 without drops this is yr
// itself (no copy).
struct Combined {
  Tensor y_TD;   // sum_k w[t,k] * expert output of (t, k)
  Tensor ys_SD;  // saved for combine_bwd
};

struct CombineGrads {
  Tensor dyr_RD;  // gradient w.r.t. the expert outputs, expert side (=)
  Tensor dw_TK;   // gradient w.r.t. the routing weights, f32 (=); exactly 0 for dropped assignments
};

// combine_bwd between its two halves: the weight gradient is done and the gradient rows are on their
// way (the all_to_all_v issued, not yet waited for).
struct CombineBwdPending {
  Tensor dyb_RD;                      // arriving in recv order
  Tensor dw_TK;                       // as in CombineGrads
  std::shared_ptr<comm::Work> work;   // null when nothing travels (ep = 1)
};

// dispatch_bwd between its two halves: the gradient rows on their way back to their sources (the
// all_to_all_v issued, not yet waited for).
struct DispatchBwdPending {
  Tensor dxs_SD;                      // arriving in sent order
  std::shared_ptr<comm::Work> work;   // null when nothing travels (ep = 1)
};

class ExpertDispatcher {
 public:
  // `ep_comm` holds the ranks of one ep group and must outlive the dispatcher.
  ExpertDispatcher(comm::Communicator& ep_comm, int64_t num_experts, DispatcherOptions opt = {});

  int64_t num_experts() const { return E_; }
  int64_t local_experts() const { return L_; }
  int64_t first_local_expert() const { return int64_t(comm_.rank()) * L_; }
  const DispatcherOptions& options() const { return opt_; }

  // topk_idx_TK i32 [T, K] with ids in [0, E); topk_w_TK f32 [T, K] (the routing weights) is needed
  // only with a capacity (the drop policy reads it) and may be undefined otherwise. Collective:
  // one all_to_all_v of ep * L counts (equal sizes), which every rank of the group must call.
  DispatchPlan prepare(const Tensor& topk_idx_TK, const Tensor& topk_w_TK = Tensor()) const;

  // x_TD -> xr_RD (Rr rows, grouped by local expert). One all_to_all_v.
  Tensor dispatch(const DispatchPlan& plan, const Tensor& x_TD);
  // yr_RD (expert outputs, rows as dispatch delivered them) -> y_TD = sum_k w * yr. One all_to_all_v.
  Combined combine(const DispatchPlan& plan, const Tensor& yr_RD, const Tensor& w_TK);
  // dx_TD += the reverse of dispatch (the K copies of a token summed). One all_to_all_v.
  void dispatch_bwd(const DispatchPlan& plan, const Tensor& dxr_RD, Tensor& dx_TD);
  Tensor dispatch_bwd(const DispatchPlan& plan, const Tensor& dxr_RD);  // dx = (fresh zeros, then +=)
  // The same in two halves, so that the experts' weight gradients run while the rows travel
  // (ops::experts_bwd's after_dx starts it): start issues the all_to_all_v, finish makes the compute
  // stream wait for it and adds the rows into dx_TD. The same ordering rule as combine_bwd_start.
  DispatchBwdPending dispatch_bwd_start(const DispatchPlan& plan, const Tensor& dxr_RD);
  void dispatch_bwd_finish(const DispatchPlan& plan, DispatchBwdPending& pending, Tensor& dx_TD);
  // Routing weights applied before the experts (score_before_experts): each sent row is w[t,k] x[t];
  // combine then takes unit weights. The backward writes dx_TD (=) and returns dw_TK (f32 [T, K],
  // = <x[t], dx of the row>; exactly 0 for dropped assignments). One all_to_all_v each.
  Tensor dispatch_weighted(const DispatchPlan& plan, const Tensor& x_TD, const Tensor& w_TK);
  Tensor dispatch_weighted_bwd(const DispatchPlan& plan, const Tensor& dxr_RD, const Tensor& x_TD, const Tensor& w_TK,
                               Tensor& dx_TD);
  // dy_TD -> dyr_RD and dw_TK, from the ys_SD that combine saved. One all_to_all_v.
  CombineGrads combine_bwd(const DispatchPlan& plan, const Tensor& dy_TD, const Tensor& ys_SD, const Tensor& w_TK);
  // The same in two halves, so that other compute (the block's recompute) runs while the rows travel:
  // start issues the all_to_all_v, finish makes the compute stream wait for it and regroups. Every
  // rank must start and finish in the same order relative to its other collectives on this group.
  CombineBwdPending combine_bwd_start(const DispatchPlan& plan, const Tensor& dy_TD, const Tensor& ys_SD,
                                      const Tensor& w_TK);
  CombineGrads combine_bwd_finish(const DispatchPlan& plan, CombineBwdPending& pending);

  // ---- the phases (what the calls above run, in this order) ----
  // dispatch: x_TD -> xs_SD (rows in sent order) -> recv_RD (recv order) -> xr_RD (expert-major)
  Tensor dispatch_prepare(const DispatchPlan& plan, const Tensor& x_TD) const;
  Tensor dispatch_comm(const DispatchPlan& plan, const Tensor& xs_SD);
  Tensor dispatch_finish(const DispatchPlan& plan, const Tensor& recv_RD) const;
  // combine: yr_RD -> yb_RD (recv order) -> ys_SD (sent order, + zero row with drops) -> y_TD
  Tensor combine_prepare(const DispatchPlan& plan, const Tensor& yr_RD) const;
  Tensor combine_comm(const DispatchPlan& plan, const Tensor& yb_RD);
  Tensor combine_finish(const DispatchPlan& plan, const Tensor& ys_SD, const Tensor& w_TK) const;
  // The same into the caller's y_TD, which may be f32 while ys is bf16 (the model's f32 residual
  // stream: the weighted sum is not rounded to bf16 first).
  void combine_finish(const DispatchPlan& plan, const Tensor& ys_SD, const Tensor& w_TK, Tensor& y_TD) const;

 private:
  // Expert-major rows -> recv order (the inverse regroup), shared by combine and dispatch_bwd.
  Tensor to_recv_order(const DispatchPlan& plan, const Tensor& r_RD, const char* what) const;
  // recv order -> expert-major rows (the regroup), shared by dispatch and combine_bwd.
  Tensor to_expert_order(const DispatchPlan& plan, const Tensor& recv_RD, const char* what) const;
  // in (in_counts rows to each rank) -> out (out_rows, out_counts from each rank): the all_to_all_v,
  // not waited for; ep = 1: out is in and the work is null. The *_start calls below check, then run it.
  std::shared_ptr<comm::Work> exchange_start(const DispatchPlan& plan, const Tensor& in,
                                             const std::vector<int64_t>& in_counts, int64_t out_rows,
                                             const std::vector<int64_t>& out_counts, Tensor& out);
  // Sent order (S rows) -> recv order on the destination ranks, and back.
  Tensor sources_to_experts(const DispatchPlan& plan, const Tensor& s_SD, const char* what);
  // The same, not waited for: out receives the rows once the returned work is waited for (null: ep = 1).
  std::shared_ptr<comm::Work> sources_to_experts_start(const DispatchPlan& plan, const Tensor& s_SD, Tensor& out,
                                                       const char* what);
  Tensor experts_to_sources(const DispatchPlan& plan, const Tensor& r_RD, int64_t extra_rows, const char* what);
  // The same without extra rows, not waited for: out receives the rows once the returned work is
  // waited for (null: ep = 1, out is r_RD).
  std::shared_ptr<comm::Work> experts_to_sources_start(const DispatchPlan& plan, const Tensor& r_RD, Tensor& out,
                                                       const char* what);
  void check_plan(const DispatchPlan& plan, const char* what) const;

  comm::Communicator& comm_;
  int64_t E_, L_;
  DispatcherOptions opt_;
};

// Megatron's get_capacity: ceil((T*K / E) * capacity_factor), computed in double in that order.
int64_t expert_capacity(int64_t T, int64_t K, int64_t E, double capacity_factor);

}  // namespace mt::moe
