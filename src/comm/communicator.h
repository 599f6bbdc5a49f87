// Communicators: one interface over NCCL (GPU tensors) and Gloo (CPU tensors). Communicators are
// passed in, never global. Every rank of a group must issue the same collectives in the same
// order; the base class enforces this instead of trusting it:
//   - each call is recorded (sequence number, op, count, dtype, root/peer) into a running hash and a
//     short history; check_schedule() compares the hashes of all ranks (through the Store, with a
//     timeout) and, on a mismatch, throws an error naming the ranks and the first differing op;
//   - with ScheduleCheck::PerOp every call is compared before it is issued (a debug mode);
//   - a watchdog (Watchdog below) sees, per communicator, the last op issued and the last completed,
//     and aborts the communicators when an op has been in flight longer than the timeout.
// Stream semantics on CUDA: a collective waits for the work queued so far on the compute stream,
// runs on the communicator's own stream, and the returned Work's wait() makes the compute stream
// wait for it (the host does not block). On the CPU every call completes before it returns.
// Tensors are contiguous, on the communicator's device, and counts are in elements.
//
// Point-to-point calls (send/recv) get a sequence number (the watchdog tracks them) but are not
// part of the collective schedule: the ranks of a group legitimately issue different ones. The
// schedule numbers collectives separately (OpRecord::coll, the "op #N" of schedule errors); the
// watchdog and the other errors number every call (OpRecord::seq). Without send/recv they agree.
//
// The Store given to make_world() must outlive every communicator made from it (split() included):
// each communicator keeps its records under its own prefix of that store.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/store.h"
#include "core/tensor.h"

namespace mt::comm {

enum class ReduceOp { Sum, Max, Min };
enum class ScheduleCheck { Off, Periodic, PerOp };

const char* reduce_op_name(ReduceOp op);  // "sum", "max", "min"

// One collective as recorded for the schedule check and the watchdog.
struct OpRecord {
  uint64_t seq = 0;   // 1, 2, ... per communicator, every call (send/recv too)
  uint64_t coll = 0;  // 1, 2, ... per communicator, collectives only; 0 for send/recv
  std::string op;     // "all_gather", "reduce_scatter", "all_reduce(max)", ...
  int64_t count = 0;  // elements per rank: all_gather in, reduce_scatter out, all_to_all_v sent
  DType dtype = DType::F32;
  int64_t peer = -1;                               // root (broadcast) or peer (send/recv); -1 otherwise
  std::chrono::steady_clock::time_point issued{};  // when the call was made (not compared)
  std::string str() const;                         // "#12 all_reduce f32 x 4096"
  std::string what() const;                        // the same without the number: "all_reduce f32 x 4096"
  // What all ranks must agree on: op, dtype, peer, and the count except for all_to_all_v (whose
  // per-rank counts legitimately differ).
  std::string signature() const;
};

class Work {
 public:
  virtual ~Work() = default;
  // CUDA: the compute stream waits for the collective. CPU: returns at once (already done).
  virtual void wait() = 0;
};

struct CommOptions {
  Millis timeout{std::chrono::minutes(5)};  // per collective and for every store wait
  ScheduleCheck schedule_check = ScheduleCheck::Periodic;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }  // "world", "dp_shard", ...
  virtual Device device() const = 0;
  virtual const char* backend() const = 0;  // "gloo", "nccl", "self"
  const CommOptions& options() const { return opt_; }

  // out holds size() * in.numel() elements, rank r's input at [r * n, (r+1) * n).
  std::shared_ptr<Work> all_gather(const Tensor& in, Tensor& out);
  // in holds size() * out.numel() elements; rank r receives the reduction of block r.
  std::shared_ptr<Work> reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum);
  std::shared_ptr<Work> all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
  std::shared_ptr<Work> broadcast(Tensor& t, int root);
  // Variable counts: in is the concatenation of the blocks for ranks 0..size-1 (send_counts[r]
  // elements each), out receives recv_counts[r] elements from each rank r, in rank order. Both
  // sides must already agree on the counts (exchange them first with a fixed-size all_to_all).
  std::shared_ptr<Work> all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                     const std::vector<int64_t>& recv_counts);
  void send(const Tensor& t, int peer);
  void recv(Tensor& t, int peer);
  void barrier();

  // A new communicator over the ranks that pass the same color, ordered by key (ties by rank).
  // Collective over this communicator: every rank calls it. A negative color joins no group and
  // returns nullptr.
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);

  // Compares the schedule hash of every rank (a no-op when the check is Off). Throws an error
  // naming the ranks that differ and the first differing op. Called every N steps and on errors.
  void check_schedule();
  // Aborts outstanding work; afterwards every call throws. Safe from another thread.
  void abort(const std::string& why);
  bool aborted() const { return aborted_.load(); }

  // For the watchdog and error messages.
  OpRecord last_issued() const;
  uint64_t completed_seq() const { return completed_.load(); }
  std::vector<OpRecord> history() const;  // the last kHistory ops, oldest first
  // The op whose backend call threw (seq 0: none) and what it threw; the communicator is aborted then.
  uint64_t failed_seq() const { return failed_.load(); }
  std::string failure() const;
  // Brings completed_seq() up to date where completion is asynchronous (CUDA events); the watchdog
  // calls it before reading completed_seq(). Safe from another thread.
  virtual void poll_completion() {}

  static constexpr size_t kHistory = 64;

 protected:
  // `root` is the store given to make_world; this communicator keeps its keys under `prefix` there.
  Communicator(int rank, int size, std::string name, Store& root, std::string prefix, CommOptions opt);

  // What split() hands a backend: the group this rank joins, already agreed on by every rank.
  struct SplitPlan {
    int color = 0, key = 0;
    int new_rank = 0, new_size = 0;
    std::vector<int> members;  // parent ranks, in new-rank order; empty for a negative color
    std::string name;
    Store* root = nullptr;  // the store given to make_world
    std::string prefix;     // the new communicator's namespace in it
  };

  // Backends implement these; the public calls check arguments, record, check the schedule and
  // then dispatch here. An exception thrown here is reported with the communicator, rank, op and
  // seq by the caller.
  virtual std::shared_ptr<Work> do_all_gather(const Tensor& in, Tensor& out, const OpRecord& rec) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, const OpRecord& rec) = 0;
  virtual std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op, const OpRecord& rec) = 0;
  virtual std::shared_ptr<Work> do_broadcast(Tensor& t, int root, const OpRecord& rec) = 0;
  virtual std::shared_ptr<Work> do_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                                const std::vector<int64_t>& recv_counts, const OpRecord& rec) = 0;
  virtual void do_send(const Tensor& t, int peer, const OpRecord& rec) = 0;
  virtual void do_recv(Tensor& t, int peer, const OpRecord& rec) = 0;
  virtual void do_barrier(const OpRecord& rec) = 0;
  virtual std::unique_ptr<Communicator> do_split(SplitPlan plan) = 0;
  // Called once, by abort(), after the flag is set: cancel what can be cancelled.
  virtual void do_abort(const std::string& why) = 0;
  // Backends call this when op `seq` is known complete (CPU: at return; CUDA: event polled).
  void mark_completed(uint64_t seq);

  Store& root_;
  const std::string prefix_;
  std::unique_ptr<Store> store_owned_;
  Store& store_;  // root_ under prefix_
  CommOptions opt_;

 private:
  OpRecord record(std::string op, int64_t count, DType dtype, int64_t peer, bool collective);
  // PerOp mode: every rank publishes `rec` (and, for all_to_all_v, its counts) and compares.
  void check_op(const OpRecord& rec, const std::vector<int64_t>* send_counts = nullptr,
                const std::vector<int64_t>* recv_counts = nullptr);
  void throw_if_aborted(const char* op) const;
  [[noreturn]] void fail_op(const OpRecord& rec, const std::exception& e);
  std::string where() const;  // "communicator 'world' (rank 1 of 4, gloo)"
  // Waits for the keys "<stem><r>" of every rank r; on timeout names the ranks that never wrote.
  void wait_ranks(const std::string& stem, const std::string& what, Millis timeout);
  int rank_, size_;
  std::string name_;
  mutable std::mutex mu_;
  uint64_t hash_ = 1469598103934665603ull;
  uint64_t seq_ = 0, coll_ = 0;
  std::vector<OpRecord> ring_;       // circular, kHistory entries at most
  std::vector<uint64_t> ring_hash_;  // the schedule hash before each entry of ring_
  std::vector<std::pair<OpRecord, uint64_t>> history_with_hashes() const;
  std::atomic<uint64_t> completed_{0};
  uint64_t checks_ = 0, splits_ = 0;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;  // written once, before aborted_ is set
  std::atomic<uint64_t> failed_{0};
  std::string failure_;  // written once, before failed_ is set
};

// World communicator for this process. CPU: Gloo over TCP with the store for rendezvous (a world of
// size 1 needs no Gloo). CUDA: NCCL (non-blocking communicator, so the watchdog can abort it), the
// unique id shared through the store. `cuda_device` is the local GPU this rank uses.
std::unique_ptr<Communicator> make_world(Device device, int rank, int size, Store& store, CommOptions opt,
                                         int cuda_device = 0);
// Whether this build has the multi-rank CPU backend (Gloo).
bool have_gloo();

// Every rank's `mine` (the same count on every rank), exactly: each double travels as two floats (its
// value and the rounding remainder) in one f32 all_gather on the communicator's device. Returns
// size() × mine.size() doubles, rank-major, identical on every rank, so that sums taken from it in
// rank order are the same value everywhere (a NaN or inf on one rank reaches all). Collective.
std::vector<double> all_gather_doubles(Communicator& c, const std::vector<double>& mine);

// Aborts every registered communicator when one collective stays in flight longer than the
// timeout, and reports per rank (stderr and the store, key "watchdog/<rank>") the last collective
// issued and completed. After the abort the main thread has `grace` to react (throw, unwind and
// destroy the watchdog or unwatch the communicators); otherwise the process exits with
// kWatchdogExitCode, so that a rank stuck outside any collective cannot hang the job.
constexpr int kWatchdogExitCode = 70;
class Watchdog {
 public:
  Watchdog(Store& store, int rank, Millis timeout, Millis grace = std::chrono::seconds(30),
           Millis poll = std::chrono::milliseconds(100));
  ~Watchdog();  // stops the thread
  void watch(Communicator* c);
  void unwatch(Communicator* c);
  bool fired() const;  // whether it has reported and aborted

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt::comm
