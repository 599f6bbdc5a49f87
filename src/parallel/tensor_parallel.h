// Tensor parallelism (Megatron, with sequence-parallel norms) and expert tensor parallelism: the
// tp-local model of a tp rank and how its parameters map to the global Hugging Face tensors.
//
// A tp rank runs the model with a tp-local config (H / tp q heads, max(1, G / tp) kv heads, dense
// intermediate I / tp, expert intermediate F / etp) whose ParamTable is the rank's *local* flat
// layout; every local parameter is a slice of the global tensor of the same name:
//   q_proj rows of heads [r H/tp, (r+1) H/tp); k/v_proj rows of kv heads [r G/tp, ...) (when G < tp the
//   one kv head r G / tp that its q heads use, replicated over tp / G ranks); o_proj the matching input
//   columns; gate_proj / up_proj rows [r I/tp, ...) and down_proj those input columns; with etp = tp the
//   experts' gate rows [r F/etp, ...) and up rows [F + r F/etp, ...) of gate_up_proj and those columns of
//   down_proj; everything else (embedding, norms, router, head, experts with etp = 1) whole.
// Promises: to_global maps any local pieces to the global flat ranges they hold (so init and loading
// give element-for-element the values of one process), gather_global rebuilds one global tensor at a
// time from every tp rank's local one (no rank ever holds the whole model), and the sizes that do not
// divide are errors naming both numbers.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "model/param_source.h"
#include "model/params.h"

namespace mt {

class DistContext;

// The tp-local config (tp = 1 and etp = 1: the config itself). Throws naming both numbers when
// heads, kv heads, intermediate sizes do not divide.
ModelConfig tp_local_config(const ModelConfig& c, int tp, int etp);

class TpLayout {
 public:
  TpLayout(const ModelConfig& global, int tp, int etp);
  int tp() const { return tp_; }
  int etp() const { return etp_; }
  const ModelConfig& global_config() const { return g_; }
  const ModelConfig& local_config() const { return l_; }
  const ParamTable& global_table() const { return *gt_; }
  const ParamTable& local_table() const { return *lt_; }
  // kv heads fewer than tp: each kv head's k/v slices are held by tp / G ranks.
  bool kv_replicated() const { return g_.num_key_value_heads < tp_; }
  int kv_head_of(int tp_rank) const { return int(tp_rank * g_.num_key_value_heads / tp_); }
  TpPlacement placement() const;
  // Whether the local parameter is the whole global tensor (the same on every tp rank).
  bool replicated(const ParamEntry& local) const;
  // The global flat ranges that tp rank `tp_rank`'s local flat pieces hold: each local piece
  // [begin, end) -> dst_offset becomes the global ranges of its elements, with the dst offsets of
  // the same elements (adjacent runs merged).
  std::vector<FlatRange> to_global(int tp_rank, const std::vector<FlatRange>& local) const;
  // One global parameter (host f32, its global shape) from `local_param(local entry)` (this rank's
  // local parameter, host f32, its local shape; may be collective, called once on every rank) and the
  // same of every tp rank, all-gathered over `tp` (skipped for replicated parameters). Collective.
  Tensor gather_global(const ParamEntry& global, comm::Communicator* tp,
                       const std::function<Tensor(const ParamEntry&)>& local_param) const;

 private:
  ModelConfig g_, l_;
  int tp_, etp_;
  std::unique_ptr<ParamTable> gt_, lt_;
};

// The communicators of tensor parallelism, split from the world (collective over every rank) and
// owned by the DistContext (watched like the others): tp (the ranks sharing samples, in tp order),
// dense (dp_shard × sp × tp of one dp_replicate index: the tp-replicated units), split (dp_shard × sp
// with the same tp coordinate: the tp-slice units), kv (the ranks with the same replicated kv head;
// null unless G < tp), and the reduction twins of dense, split and kv. Every rank holds rows of its
// own under tp, so batch-wide sums (aux statistics, losses, logits) go over the world.
struct TpComms {
  comm::Communicator *tp = nullptr, *dense = nullptr, *split = nullptr, *kv = nullptr;
  comm::Communicator *dense_reduce = nullptr, *split_reduce = nullptr, *kv_reduce = nullptr;
  int tp_rank = 0;
};
TpComms make_tp_comms(DistContext& dist, const TpLayout& layout);

}  // namespace mt
