// GPU communicator over NCCL. Non-blocking NCCL communicators (config.blocking = 0), so that no NCCL
// call can hold the host and abort() (the watchdog's thread) can always tear one down; every
// ncclInProgress is polled with ncclCommGetAsyncError until it settles, within the timeout.
// Each communicator has its own stream. Before an op that stream waits for the compute stream
// (mt::cuda::stream()), so the op sees everything queued before it; after it an event is recorded:
// Work::wait() makes the compute stream wait for that event (the host never blocks), and the
// pending events are polled to advance completed_seq() for the watchdog. The tensors of an op are
// kept alive until its event completes. send/recv make the compute stream wait at once (they
// return no Work). The unique id goes through the store (key "nccl/uid" under the communicator's
// prefix); split() uses ncclCommSplit.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <deque>
#include <exception>
#include <thread>

#include "backend/cuda/common.cuh"
#include "comm/backends.h"

namespace mt::comm::detail {

namespace {

// MOETRAIN_COMM_PRIORITY: high (default) or normal; anything else is an error naming the value.
bool comm_stream_high_priority() {
  const char* v = std::getenv("MOETRAIN_COMM_PRIORITY");
  if (!v || std::string(v) == "high") return true;
  if (std::string(v) == "normal") return false;
  MT_THROW("MOETRAIN_COMM_PRIORITY '", v, "' is not supported; allowed: high, normal");
}

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(DType dt) {
  switch (dt) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  return ncclSum;
}

// An event recorded after an op on the communicator's stream, with the tensors the op uses.
struct Pending {
  uint64_t seq = 0;
  cudaEvent_t event = nullptr;
  std::vector<Tensor> keep;  // storage the op reads or writes, alive until the event completes
  Pending() = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  // Destroying an event whose work is still queued is allowed: CUDA releases it on completion.
  ~Pending() {
    if (event) cudaEventDestroy(event);
  }
};

struct EventWork : Work {
  std::shared_ptr<Pending> p;
  explicit EventWork(std::shared_ptr<Pending> p_) : p(std::move(p_)) {}
  void wait() override { MT_CUDA_CHECK("Work::wait", cudaStreamWaitEvent(mt::cuda::stream(), p->event, 0)); }
};

class NcclComm : public Communicator {
 public:
  NcclComm(int rank, int size, const std::string& name, Store& root, const std::string& prefix, CommOptions opt,
           int cuda_device, ncclComm_t parent = nullptr, int color = 0, int key = 0)
      : Communicator(rank, size, name, root, prefix, opt), device_(cuda_device) {
    try {
      init(parent, color, key);
    } catch (const std::exception& e) {
      destroy(true);
      MT_THROW(where_nccl(), ": ", e.what());
    }
  }

  ~NcclComm() override {
    // Tear down without throwing: a clean finalize when every op has completed, an abort otherwise. A rank
    // leaving by an exception (unwinding) is out of step with its peers, so it aborts at once: a finalize
    // would wait up to the timeout for ops its peers may never match, per communicator, before the error
    // is even printed (seen as a silent hang of grpo --ep 2 on 2 H100s).
    try {
      destroy(/*abort_all=*/std::uncaught_exceptions() > 0);
    } catch (...) {
    }
  }

 private:
  void init(ncclComm_t parent, int color, int key) {
    set_device();
    // The collectives' stream has the device's highest priority (unless MOETRAIN_COMM_PRIORITY=normal):
    // a gather or reduce-scatter queued beside a GEMM then gets its CTAs onto SMs as soon as any free
    // up, instead of waiting behind the GEMM's remaining waves, so it finishes under the compute.
    int least = 0, greatest = 0;
    MT_CUDA_CHECK("NCCL communicator", cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MT_CUDA_CHECK("NCCL communicator",
                  cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, comm_stream_high_priority() ? greatest : least));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    cfg.commName = name().c_str();
    ncclComm_t c = nullptr;
    ncclResult_t r;
    const char* call = parent ? "ncclCommSplit" : "ncclCommInitRankConfig";
    if (parent) {
      split_out_ = nullptr;
      r = ncclCommSplit(parent, color, key, &split_out_, &cfg);
      if (r != ncclSuccess && r != ncclInProgress) MT_THROW(call, " failed: ", ncclGetErrorString(r));
      // The parent is non-blocking: the child's handle appears once the parent leaves ncclInProgress.
      const auto deadline = Clock::now() + opt_.timeout;
      for (;;) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(parent, &st);
        if (q != ncclSuccess) st = q;
        if (st == ncclSuccess) break;
        if (st != ncclInProgress) MT_THROW(call, " failed: ", ncclGetErrorString(st));
        if (Clock::now() > deadline)
          MT_THROW(call, " did not finish within ", opt_.timeout.count(), " ms (a rank is missing or stuck)");
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      c = split_out_;
      if (!c) MT_THROW(call, " completed without a communicator for color ", color);
    } else {
      ncclUniqueId uid;
      if (rank() == 0) {
        nccl_check(ncclGetUniqueId(&uid), "ncclGetUniqueId");
        store_.set("nccl/uid", Bytes(reinterpret_cast<uint8_t*>(&uid), reinterpret_cast<uint8_t*>(&uid) + sizeof(uid)));
      } else {
        Bytes b;
        try {
          b = store_.get("nccl/uid", opt_.timeout);
        } catch (const std::exception& e) {
          MT_THROW("no NCCL unique id from rank 0 (", e.what(), ")");
        }
        MT_CHECK(b.size() == sizeof(uid), "NCCL unique id of ", b.size(), " bytes, expected ", sizeof(uid));
        std::memcpy(&uid, b.data(), sizeof(uid));
      }
      r = ncclCommInitRankConfig(&c, size(), uid, rank(), &cfg);
    }
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      comm_ = c;
    }
    if (r != ncclSuccess && r != ncclInProgress) MT_THROW(call, " failed: ", ncclGetErrorString(r));
    settle(call);
    int nranks = 0, me = 0;
    ncclCommCount(comm_, &nranks);
    ncclCommUserRank(comm_, &me);
    MT_CHECK(nranks == size() && me == rank(), "NCCL made rank ", me, " of ", nranks, ", the store's agreement says ",
             rank(), " of ", size());
  }

 public:
  Device device() const override { return Device::CUDA; }
  const char* backend() const override { return "nccl"; }

  void poll_completion() override {
    std::lock_guard<std::mutex> lock(pending_mu_);
    while (!pending_.empty()) {
      cudaError_t e = cudaEventQuery(pending_.front()->event);
      if (e == cudaErrorNotReady) break;
      if (e != cudaSuccess) {
        (void)cudaGetLastError();  // reported by the next call that synchronizes
        break;
      }
      mark_completed(pending_.front()->seq);
      pending_.pop_front();
    }
  }

 protected:
  // --- collectives -------------------------------------------------------------------------------
  std::shared_ptr<Work> do_all_gather(const Tensor& in, Tensor& out, const OpRecord& rec) override {
    begin();
    if (in.numel() > 0)  // every rank agrees on the count (it is part of the schedule)
      enqueue("ncclAllGather", [&](ncclComm_t c) {
        return ncclAllGather(in.raw(), out.raw(), size_t(in.numel()), nccl_dtype(in.dtype()), c, stream_);
      });
    return finish(rec, {in, out});
  }

  std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, const OpRecord& rec) override {
    begin();
    if (out.numel() > 0)
      enqueue("ncclReduceScatter", [&](ncclComm_t c) {
        return ncclReduceScatter(in.raw(), out.raw(), size_t(out.numel()), nccl_dtype(in.dtype()), nccl_op(op), c,
                                 stream_);
      });
    return finish(rec, {in, out});
  }

  std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op, const OpRecord& rec) override {
    begin();
    if (t.numel() > 0)
      enqueue("ncclAllReduce", [&](ncclComm_t c) {
        return ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_dtype(t.dtype()), nccl_op(op), c, stream_);
      });
    return finish(rec, {t});
  }

  std::shared_ptr<Work> do_broadcast(Tensor& t, int root, const OpRecord& rec) override {
    begin();
    if (t.numel() > 0)
      enqueue("ncclBroadcast", [&](ncclComm_t c) {
        return ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), nccl_dtype(t.dtype()), root, c, stream_);
      });
    return finish(rec, {t});
  }

  // Grouped send/recv; the own block is a device copy on the same stream.
  std::shared_ptr<Work> do_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                        const std::vector<int64_t>& recv_counts, const OpRecord& rec) override {
    begin();
    size_t es = dtype_size(in.dtype());
    ncclDataType_t dt = nccl_dtype(in.dtype());
    std::vector<size_t> soff(size_t(size()) + 1, 0), roff(size_t(size()) + 1, 0);
    for (int r = 0; r < size(); ++r) {
      soff[size_t(r) + 1] = soff[size_t(r)] + size_t(send_counts[size_t(r)]);
      roff[size_t(r) + 1] = roff[size_t(r)] + size_t(recv_counts[size_t(r)]);
    }
    if (send_counts[size_t(rank())] > 0)
      MT_CUDA_CHECK("all_to_all_v",
                    cudaMemcpyAsync(byte_ptr(out) + roff[size_t(rank())] * es, byte_ptr(in) + soff[size_t(rank())] * es,
                                    size_t(send_counts[size_t(rank())]) * es, cudaMemcpyDeviceToDevice, stream_));
    enqueue_group("all_to_all_v", [&](ncclComm_t c) -> ncclResult_t {
      for (int r = 0; r < size(); ++r) {
        if (r == rank()) continue;
        if (send_counts[size_t(r)] > 0) {
          ncclResult_t e =
              ncclSend(byte_ptr(in) + soff[size_t(r)] * es, size_t(send_counts[size_t(r)]), dt, r, c, stream_);
          if (e != ncclSuccess && e != ncclInProgress) return e;
        }
        if (recv_counts[size_t(r)] > 0) {
          ncclResult_t e =
              ncclRecv(byte_ptr(out) + roff[size_t(r)] * es, size_t(recv_counts[size_t(r)]), dt, r, c, stream_);
          if (e != ncclSuccess && e != ncclInProgress) return e;
        }
      }
      return ncclSuccess;
    });
    return finish(rec, {in, out});
  }

  void do_send(const Tensor& t, int peer, const OpRecord& rec) override {
    begin();
    if (t.numel() > 0)
      enqueue("ncclSend", [&](ncclComm_t c) {
        return ncclSend(t.raw(), size_t(t.numel()), nccl_dtype(t.dtype()), peer, c, stream_);
      });
    finish(rec, {t})->wait();
  }

  void do_recv(Tensor& t, int peer, const OpRecord& rec) override {
    begin();
    if (t.numel() > 0)
      enqueue("ncclRecv", [&](ncclComm_t c) {
        return ncclRecv(t.raw(), size_t(t.numel()), nccl_dtype(t.dtype()), peer, c, stream_);
      });
    finish(rec, {t})->wait();
  }

  // NCCL has no barrier: an all-reduce of one integer, and the host waits for it (within the
  // timeout, watching for asynchronous errors).
  void do_barrier(const OpRecord& rec) override {
    if (!barrier_buf_.defined()) barrier_buf_ = Tensor::zeros({1}, DType::I32, Device::CUDA);
    begin();
    enqueue("ncclAllReduce (barrier)", [&](ncclComm_t c) {
      return ncclAllReduce(barrier_buf_.raw(), barrier_buf_.raw(), 1, ncclInt32, ncclSum, c, stream_);
    });
    auto w = std::static_pointer_cast<EventWork>(finish(rec, {barrier_buf_}));
    auto deadline = Clock::now() + opt_.timeout;
    for (;;) {
      cudaError_t e = cudaEventQuery(w->p->event);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) MT_CUDA_CHECK("barrier", e);
      check_async("barrier");
      if (Clock::now() > deadline)
        MT_THROW("barrier did not complete within ", opt_.timeout.count(), " ms (a rank is missing or stuck)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    poll_completion();
  }

  std::unique_ptr<Communicator> do_split(SplitPlan plan) override {
    set_device();
    std::unique_ptr<Communicator> child;
    if (plan.new_size == 0) {
      // This rank joins no group but still takes part in the parent's ncclCommSplit.
      ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
      cfg.blocking = 0;
      ncclComm_t none = nullptr;
      nccl_check(with_comm([&](ncclComm_t c) { return ncclCommSplit(c, NCCL_SPLIT_NOCOLOR, plan.key, &none, &cfg); }),
                 "ncclCommSplit");
    } else {
      // The parent's handle stays locked while the child is made from it, so that an abort from the
      // watchdog cannot free it meanwhile (the child's own wait is bounded by the timeout).
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (!comm_) MT_THROW(where_nccl(), ": split after abort");
      child = std::make_unique<NcclComm>(plan.new_rank, plan.new_size, plan.name, *plan.root, plan.prefix, opt_,
                                         device_, comm_, plan.color, plan.key);
    }
    settle("ncclCommSplit (parent)");  // a non-blocking parent may be in progress after a split
    return child;
  }

  void do_abort(const std::string&) override {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

 private:
  std::string where_nccl() const {
    return str("NCCL communicator '", name(), "' (rank ", rank(), " of ", size(), ", GPU ", device_, ")");
  }

  void set_device() {
    int cur = -1;
    MT_CUDA_CHECK("NCCL communicator", cudaGetDevice(&cur));
    if (cur != device_) MT_CUDA_CHECK("NCCL communicator", cudaSetDevice(device_));
  }

  void nccl_check(ncclResult_t r, const char* call) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    std::string last;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (comm_) last = ncclGetLastError(comm_);
    }
    MT_THROW(call, " failed: ", ncclGetErrorString(r), last.empty() ? "" : " (" + last + ")");
  }

  // Runs f(comm) under the lock that abort() takes, so that the comm cannot be freed under it.
  template <class F>
  ncclResult_t with_comm(F&& f) {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (!comm_) MT_THROW("the NCCL communicator was aborted");
    return f(comm_);
  }

  void check_async(const char* what) {
    ncclResult_t st = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (!comm_) MT_THROW(what, ": the NCCL communicator was aborted");
      ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
      if (r != ncclSuccess) st = r;
    }
    if (st != ncclSuccess && st != ncclInProgress) {
      std::string last;
      {
        std::lock_guard<std::mutex> lock(nccl_mu_);
        if (comm_) last = ncclGetLastError(comm_);
      }
      MT_THROW(what, ": NCCL reports ", ncclGetErrorString(st), last.empty() ? "" : " (" + last + ")");
    }
  }

  // Polls until the communicator leaves ncclInProgress (init, split, an enqueue that returned
  // ncclInProgress), within the timeout.
  void settle(const char* what) {
    auto deadline = Clock::now() + opt_.timeout;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(nccl_mu_);
        if (!comm_) MT_THROW(what, ": the NCCL communicator was aborted");
        ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
        if (r != ncclSuccess) st = r;
      }
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) {
        std::string last;
        {
          std::lock_guard<std::mutex> lock(nccl_mu_);
          if (comm_) last = ncclGetLastError(comm_);
        }
        MT_THROW(what, " failed: ", ncclGetErrorString(st), last.empty() ? "" : " (" + last + ")");
      }
      if (Clock::now() > deadline)
        MT_THROW(what, " did not finish within ", opt_.timeout.count(), " ms (a rank is missing or stuck)");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // The communicator's stream waits for everything queued on the compute stream so far.
  void begin() {
    set_device();
    poll_completion();
    if (!ready_) MT_CUDA_CHECK("NCCL communicator", cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    MT_CUDA_CHECK("NCCL op", cudaEventRecord(ready_, mt::cuda::stream()));
    MT_CUDA_CHECK("NCCL op", cudaStreamWaitEvent(stream_, ready_, 0));
  }

  template <class F>
  void enqueue(const char* call, F&& f) {
    ncclResult_t r = with_comm(f);
    nccl_check(r, call);
    if (r == ncclInProgress) settle(call);
  }

  template <class F>
  void enqueue_group(const char* call, F&& f) {
    ncclResult_t r = with_comm([&](ncclComm_t c) {
      ncclResult_t s = ncclGroupStart();
      if (s != ncclSuccess) return s;
      ncclResult_t body = f(c);
      ncclResult_t end = ncclGroupEnd();  // always closes the group, even after an error in it
      return body != ncclSuccess && body != ncclInProgress ? body : end;
    });
    nccl_check(r, call);
    if (r == ncclInProgress) settle(call);
  }

  std::shared_ptr<Work> finish(const OpRecord& rec, std::vector<Tensor> keep) {
    auto p = std::make_shared<Pending>();
    p->seq = rec.seq;
    p->keep = std::move(keep);
    MT_CUDA_CHECK("NCCL op", cudaEventCreateWithFlags(&p->event, cudaEventDisableTiming));
    MT_CUDA_CHECK("NCCL op", cudaEventRecord(p->event, stream_));
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_.push_back(p);
    }
    return std::make_shared<EventWork>(p);
  }

  // abort_all: ncclCommAbort at once; otherwise finalize (flushes every op) and destroy, falling back
  // to an abort when that does not settle within the timeout.
  void destroy(bool abort_all) {
    ncclComm_t c = nullptr;
    {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      c = comm_;
    }
    if (c && !abort_all && !aborted()) {
      bool clean = false;
      ncclResult_t fin = ncclCommFinalize(c);
      if (fin == ncclSuccess || fin == ncclInProgress) {
        auto deadline = Clock::now() + opt_.timeout;
        for (;;) {
          ncclResult_t st = ncclSuccess;
          if (ncclCommGetAsyncError(c, &st) != ncclSuccess) break;
          if (st == ncclSuccess) {
            clean = true;
            break;
          }
          if (st != ncclInProgress || Clock::now() > deadline) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (comm_) {
        if (clean)
          ncclCommDestroy(comm_);
        else
          ncclCommAbort(comm_);
        comm_ = nullptr;
      }
    } else {
      std::lock_guard<std::mutex> lock(nccl_mu_);
      if (comm_) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
      }
    }
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_.clear();  // after finalize/abort no op of this communicator runs any more
    }
    if (ready_) cudaEventDestroy(ready_);
    ready_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::mutex nccl_mu_;  // guards comm_ against abort() from the watchdog's thread
  ncclComm_t comm_ = nullptr;
  // Where a non-blocking ncclCommSplit writes the child's handle: NCCL stores it only when the split
  // completes (after the call has returned), so it must outlive the call.
  ncclComm_t split_out_ = nullptr;
  std::mutex pending_mu_;
  std::deque<std::shared_ptr<Pending>> pending_;
  Tensor barrier_buf_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_comm(int rank, int size, const std::string& name, Store& root,
                                             const std::string& prefix, CommOptions opt, int cuda_device) {
  check_world(rank, size, "NCCL communicator");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    MT_THROW("communicator '", name, "' (rank ", rank, " of ", size, "): no CUDA device is visible");
  }
  if (cuda_device < 0 || cuda_device >= n)
    MT_THROW("communicator '", name, "' (rank ", rank, " of ", size, "): GPU ", cuda_device,
             " does not exist; this process sees ", n, " GPU", n == 1 ? "" : "s", " (0..", n - 1, ")");
  return std::make_unique<NcclComm>(rank, size, name, root, prefix, opt, cuda_device);
}

}  // namespace mt::comm::detail
