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
#pragma once
#include <atomic>
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

// One collective as recorded for the schedule check and the watchdog.
struct OpRecord {
  uint64_t seq = 0;  // 1, 2, ... per communicator
  std::string op;    // "all_gather", "reduce_scatter", ...
  int64_t count = 0;
  DType dtype = DType::F32;
  int64_t peer = -1;  // root (broadcast) or peer (send/recv); -1 otherwise
  std::string str() const;  // "#12 all_reduce f32 x 4096"
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

  // A new communicator over the ranks that pass the same color, ordered by key (collective over
  // this communicator: every rank calls it).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name);

  // Compares the schedule hash of every rank (a no-op when the check is Off). Throws an error
  // naming the ranks that differ and the first differing op. Called every N steps and on errors.
  void check_schedule();
  // Aborts outstanding work; afterwards every call throws. Safe from another thread.
  virtual void abort(const std::string& why) = 0;

  // For the watchdog and error messages.
  OpRecord last_issued() const;
  uint64_t completed_seq() const { return completed_.load(); }
  std::vector<OpRecord> history() const;  // the last kHistory ops, oldest first

 protected:
  Communicator(int rank, int size, std::string name, Store& store, CommOptions opt);
  // Backends implement these; the public calls record, check and then dispatch here.
  virtual std::shared_ptr<Work> do_all_gather(const Tensor& in, Tensor& out) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_broadcast(Tensor& t, int root) = 0;
  virtual std::shared_ptr<Work> do_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts,
                                                Tensor& out, const std::vector<int64_t>& recv_counts) = 0;
  virtual void do_send(const Tensor& t, int peer) = 0;
  virtual void do_recv(Tensor& t, int peer) = 0;
  virtual void do_barrier() = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key, const std::string& name) = 0;
  // Backends call this when op `seq` is known complete (CPU: at return; CUDA: event polled).
  void mark_completed(uint64_t seq);

  Store& store_;
  CommOptions opt_;

 private:
  uint64_t record(const char* op, int64_t count, DType dtype, int64_t peer);
  static constexpr size_t kHistory = 64;
  int rank_, size_;
  std::string name_;
  mutable std::mutex mu_;
  uint64_t hash_ = 1469598103934665603ull;
  uint64_t seq_ = 0;
  std::vector<OpRecord> ring_;
  std::atomic<uint64_t> completed_{0};
  uint64_t checks_ = 0;
};

// World communicator for this process. CPU: Gloo over TCP with the store for rendezvous. CUDA:
// NCCL (non-blocking communicator, so the watchdog can abort it), the unique id shared through the
// store. `cuda_device` is the local GPU this rank uses.
std::unique_ptr<Communicator> make_world(Device device, int rank, int size, Store& store, CommOptions opt,
                                         int cuda_device = 0);

// Aborts every registered communicator when one collective stays in flight longer than the
// timeout, and reports per rank (stderr and the store) the last collective issued and completed.
class Watchdog {
 public:
  Watchdog(Store& store, int rank, Millis timeout);
  ~Watchdog();  // stops the thread
  void watch(Communicator* c);
  void unwatch(Communicator* c);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt::comm
