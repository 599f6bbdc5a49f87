// FSDP (ZeRO-3) and HSDP: the model's parameters, gradients and optimizer states sharded over the
// dp_shard ranks, unit by unit (embedding, each block, head; see model/param_source.h).
//
// Layout. Unit u (n_u elements of the flat layout) is padded to W × chunk_u elements, W = dp_shard
// size, chunk_u a multiple of 64; rank r holds unit elements [r × chunk_u, (r + 1) × chunk_u) (the
// padding is zero and stays zero). The local buffers (f32 master, f32 grads, the optimizer's f32
// moments, and on CUDA the bf16 compute copy) are the concatenation of the rank's chunks, so the
// optimizer is one elementwise call over the local shard. Nothing full-size is ever allocated:
// parameters are sharded from the start.
//
// Per micro-batch: acquire_weights(u) all-gathers the unit's compute-dtype shard into a pooled
// buffer (already in flight when prefetch(u) came first: on CUDA the gather runs on the
// communicator's stream while the previous unit computes); unit_grads(u) hands out a zeroed f32
// buffer of the full unit; grads_done(u) reduce-scatters it (fp32 sum) into this rank's chunk, then,
// under HSDP, all-reduces the chunk over dp_replicate, and adds it to the local gradient shard. The
// add of unit u is deferred until the next grads_done, so that on CUDA the reduce-scatter overlaps
// the next block's backward (it runs on a second communicator over the same ranks, so it does not
// queue behind the prefetch all-gathers); the embedding (the last unit of every backward) flushes everything.
// With grad_sync = LastMicroBatch, unit gradients stay full-size and unsynchronised across
// micro-batches and are reduced once, in the last one (less communication, full-size f32 grads).
//
// Every rank issues the same collectives in the same order because the model calls the hooks in a
// fixed order (recompute happens inside acquire/release of the same unit) and the trainer makes
// every decision (clip, skip, last micro-batch) from values all ranks share.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/param_source.h"

namespace mt {

enum class GradSync { EveryMicroBatch, LastMicroBatch };

struct FsdpOptions {
  GradSync grad_sync = GradSync::EveryMicroBatch;
  // F32: reduce-scatter in fp32. BF16: the gradients travel as bf16 (half the bytes) through an
  // all-to-all and each rank sums the W pieces of its chunk in fp32 (no bf16 partial sums).
  DType reduce_dtype = DType::F32;
  // true: a unit's gathered weights are freed when the forward releases it and gathered again for
  // its backward (least memory). false: they stay gathered from the forward until the unit's
  // backward releases them (FSDP2's reshard_after_forward=False): no all-gather in the backward,
  // at the cost of holding every unit's full compute-dtype weights between forward and backward.
  bool reshard_after_forward = true;
  // Frozen: the weights only (a reference model): no gradient shard, no unit gradients.
  Weights weights = Weights::Trainable;
};

// Expert parallelism: the ep group (its rank order is the experts' order) and the ranks that hold
// the same experts (expert data parallelism) within this rank's dp_replicate replica, over which
// expert units are sharded. Under HSDP the expert units are all-reduced over dp_replicate like every
// unit: the ranks holding the same expert shard in other replicas are the dp_replicate group
// (parallel/mesh.h). Null: no EP.
struct ExpertGroups {
  comm::Communicator* ep = nullptr;
  comm::Communicator* expert_shard = nullptr;
};

// Communicators over the same ranks as the shard groups (dp_shard, and expert data parallelism),
// used only for the gradient reductions so that on CUDA they run on a stream of their own beside
// the weight all-gathers. Null: the reductions share the shard group's communicator.
struct ReduceComms {
  comm::Communicator* shard = nullptr;
  comm::Communicator* expert_shard = nullptr;
};

// Tensor parallelism (parallel/tensor_parallel.h): which parameters are tp slices, and the groups
// their units are sharded over: `split` the ranks with the same tp coordinate (dp_shard × sp), `kv`
// the ranks holding the same replicated kv head (dp_shard × sp × tp / G); the *_reduce twins are over
// the same ranks, for the gradient reductions. The shard communicator is then the dense group
// (dp_shard × sp × tp), over which the tp-replicated units are sharded.
struct TpGroups {
  TpPlacement placement;
  comm::Communicator* split = nullptr;
  comm::Communicator* kv = nullptr;
  comm::Communicator* split_reduce = nullptr;
  comm::Communicator* kv_reduce = nullptr;
};

class FsdpParams final : public ParamSource {
 public:
  // shard: the dp_shard communicator; replicate: the dp_replicate communicator (null or size 1: FSDP).
  FsdpParams(const ModelConfig& c, const ParamTable& t, Device device, comm::Communicator& shard,
             comm::Communicator* replicate, FsdpOptions opt = {}, const ExpertGroups& eg = {},
             const ReduceComms& rc = {}, const TpGroups& tg = {});
  ~FsdpParams() override;
  const UnitPlan& plan() const override { return plan_; }

  Tensor acquire_weights(int u) override;
  void release_weights(int u) override;
  void prefetch(int u) override;
  Tensor unit_grads(int u) override;
  void grads_done(int u) override;
  void begin_pass(bool backward) override;
  // The f32 masters of the RMSNorm gains and routers (fp32_compute_param), whole on every rank: with a
  // bf16 compute copy, each pass starts by copying this rank's elements of them into a zeroed buffer
  // and summing it over dp_shard (every element has exactly one owner there, so the sum is exact).
  Tensor fp32_param(const ParamEntry& e) override;

  // Local shards (1-D, local_numel() elements). A frozen source on CUDA keeps its f32 master shard in
  // host memory (2 device bytes a parameter per shard instead of 6); refresh_compute_weights() after
  // writing it, as always.
  Tensor& params() { return params_; }
  Tensor& grads();  // an error when frozen
  bool trainable() const override { return grads_.defined(); }
  Tensor* compute_params() { return compute_.raw() == params_.raw() ? nullptr : &compute_; }
  void refresh_compute_weights();
  // Starts a step's gradients: the first reduction of each unit overwrites its shard (no pass over
  // the shard). Every unit must then receive a gradient before the shard is read.
  void zero_grads();
  void check_grads_complete() const;
  // The trainer says whether the coming micro-batch is the last of the step (GradSync::LastMicroBatch).
  void set_last_micro_batch(bool last) { last_micro_ = last; }

  int64_t local_numel() const { return local_numel_; }
  int num_units() const { return int(units_.size()); }
  // The unit elements [lo, hi) this rank holds of unit u (empty for pure padding).
  std::pair<int64_t, int64_t> owned_elements(int u) const;

  // This rank's pieces of the flat layout and where they sit in the local buffers (for sharded init
  // and sharded loading).
  std::vector<FlatRange> owned_pieces() const;
  // Host seconds spent issuing and waiting for collectives since the last call (then reset).
  double take_comm_seconds();
  // Elements [begin, end) of the flat layout (inside one piece of one of this rank's units), values
  // or gradients, as a host f32 copy on every rank of the unit's shard group; moves only that range.
  // Collective over that group.
  Tensor gather_range_host(int64_t begin, int64_t end, bool grads);
  // One whole parameter (its values or gradient), host f32 in its shape, on every rank; under expert
  // parallelism the experts of every ep group. Collective over the shard (and ep) ranks.
  Tensor gather_param_host(const ParamEntry& e, bool grads);
  // Sum of squares of the local gradient shard, reduced over the shard ranks (the replicas hold the
  // same values and are not counted twice): the global squared gradient norm. Collective.
  double global_grad_sq();

  // Replica check (HSDP). The ranks that hold the same gradient (and parameter) elements are exactly
  // the dp_replicate replicas of a shard: the shard groups (dp_shard, tp slices, kv slices, expert
  // data parallelism) never hold an element twice. These elements must be bitwise equal on every
  // replica, since the reduction over dp_replicate hands every replica the same sum and the
  // optimizer then does the same arithmetic.
  //
  // This rank's elements of unit u (owned_elements(u)) in the local buffer: gradients or f32 masters.
  Tensor local_shard(int u, bool grads);
  // What the unit is, for messages: "embedding", "block 3", "tp slices of block 3", "kv slices of
  // block 3", "experts 0..3 of block 3", "head".
  std::string unit_name(int u) const;
  // Per unit, a 64-bit digest (shard_digest) of this rank's elements of it.
  std::vector<uint64_t> replica_digests(bool grads);
  struct ReplicaReport {
    int units = 0;     // units compared (0: there are no replicas, nothing was compared)
    int replicas = 1;  // dp_replicate size
  };
  // Compares every unit's digest across the dp_replicate ranks: one all-gather over dp_replicate, then,
  // when `world` is given, one of each group's verdict over it, so that all ranks stop together (a
  // no-op returning an empty report without replicas; collective over dp_replicate and `world`).
  // Throws on every replica alike (every rank of the world with `world`), naming the first unit that
  // differs, the global ranks (world_rank: this rank's, gathered with the digests), both digests and
  // how many units differ.
  ReplicaReport check_replicas(bool grads, int world_rank, comm::Communicator* world = nullptr);

 private:
  Tensor take(int64_t numel, DType dt);
  void give(Tensor t);
  void finish_pending(bool all);

  comm::Communicator& comm_of(int u) const;  // the ranks unit u is sharded over
  comm::Communicator& reduce_comm_of(int u) const;  // the same ranks, for its gradient reductions

  Device device_;
  comm::Communicator& shard_;
  comm::Communicator* replicate_;
  comm::Communicator* expert_shard_;
  comm::Communicator* ep_comm_;
  ReduceComms reduce_;
  TpGroups tp_;
  FsdpOptions opt_;
  UnitPlan plan_;
  std::vector<ParamUnit>& units_ = plan_.units;
  std::vector<int64_t> chunk_, offset_;
  int64_t local_numel_ = 0;
  Tensor params_, grads_, compute_;
  DType compute_dt_;
  struct Gather {
    Tensor buf;
    std::shared_ptr<comm::Work> work;
    int users = 0;
  };
  void drop_kept();  // frees the gathers kept from a forward (reshard_after_forward = false)
  void plan_fp32_params(const ParamTable& t);
  void refresh_fp32_params();
  Tensor fp32_;  // fp32_param's values (undefined when the compute copy is the f32 masters)
  std::map<std::string, int64_t> fp32_offset_;
  struct Fp32Copy {
    int64_t src, dst, n;  // local master elements [src, src + n) -> fp32_ [dst, dst + n)
  };
  std::vector<Fp32Copy> fp32_copies_;
  std::vector<char> in_backward_;  // per unit: its gradient was requested in this micro-batch
  bool keep_after_forward_ = false;  // this pass: !reshard_after_forward and a backward follows
  std::map<int, Gather> gathered_;
  std::map<int, Tensor> unit_grads_;
  struct Pending {
    int unit;
    Tensor full, part, send, wire;  // send / wire: the bf16 pieces sent / received (reduce_dtype BF16)
    bool direct = false;            // part is the local shard itself (first reduction, f32)
    bool fresh = false;             // the first reduction of this unit in the step
    std::shared_ptr<comm::Work> work;
  };
  std::vector<Pending> pending_;
  std::multimap<std::pair<int64_t, int>, Tensor> pool_;  // free buffers by (numel, dtype)
  bool last_micro_ = true;
  std::vector<char> written_;  // per unit: its shard holds a gradient of this step
  double comm_s_ = 0;
};

// A 64-bit digest of a tensor's raw bytes (copied to the host when on CUDA): FNV-1a-style multiply and
// xor-shift steps over 8-byte words in four interleaved lanes, mixed at the end with the byte count.
// Each step is a bijection of the lane state for a fixed word, so a change to any single word (one
// ulp of one element) always changes the digest; not a cryptographic hash.
uint64_t shard_digest(const Tensor& t);

// Each rank's share of a global micro-batch of B rows: rows [rank × B / n, (rank + 1) × B / n).
// B must be divisible by n (the error names both).
std::pair<int64_t, int64_t> dp_rows(int64_t batch_rows, int dp_rank, int dp_size);

}  // namespace mt

namespace mt {
// Writes an HF checkpoint (config.json + safetensors) of a sharded model from rank 0 (`writer`).
// Collective over the dp_shard ranks: units are gathered one at a time.
void save_sharded_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& t, FsdpParams& p,
                                bool writer);
// The same with each parameter (global table t) produced by `fetch` (e.g. ParallelModel::gather_param_host,
// which also reassembles tensor-parallel slices); every rank calls fetch in the same order.
void save_sharded_hf_checkpoint(const std::string& dir, const ModelConfig& c, const ParamTable& t,
                                const std::function<Tensor(const ParamEntry&)>& fetch, bool writer);
}  // namespace mt
