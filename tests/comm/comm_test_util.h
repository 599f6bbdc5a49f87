// Helpers for communicator tests: ranks as threads over one memory store (each thread makes its own
// communicator, as a process would), and FakeComm, a backend that moves no data, for testing what
// the base class does (records, schedule checks, the watchdog) without a transport.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "comm/communicator.h"

namespace mt::comm::testing {

// Runs fn(rank, comm) on `n` threads, each with its own make_world(device, rank, n) communicator
// over one memory store; returns each rank's error message ("" when it returned normally).
inline std::vector<std::string> run_ranks(int n, const std::function<void(int, Communicator&)>& fn,
                                          CommOptions opt = {}, Device device = Device::CPU,
                                          Store* shared_store = nullptr) {
  std::unique_ptr<Store> own;
  if (!shared_store) own = make_memory_store();
  Store& store = shared_store ? *shared_store : *own;
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = make_world(device, r, n, store, opt);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
        if (errors[size_t(r)].empty()) errors[size_t(r)] = "(empty error message)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline std::vector<std::string> no_errors(int n) {
  return std::vector<std::string>(static_cast<size_t>(n));
}

struct DoneWork : Work {
  void wait() override {}
};

// Records like any communicator but moves no data. Ops complete at once unless `hang` is set, in
// which case they stay in flight (as an asynchronous CUDA collective would) for the watchdog.
class FakeComm : public Communicator {
 public:
  FakeComm(int rank, int size, Store& root, CommOptions opt, std::string prefix = "fake", std::string name = "fake")
      : Communicator(rank, size, std::move(name), root, std::move(prefix), opt) {}
  Device device() const override { return Device::CPU; }
  const char* backend() const override { return "fake"; }
  bool hang = false;
  std::string abort_reason;

 protected:
  std::shared_ptr<Work> done(const OpRecord& rec) {
    if (!hang) mark_completed(rec.seq);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<Work> do_all_gather(const Tensor&, Tensor&, const OpRecord& rec) override { return done(rec); }
  std::shared_ptr<Work> do_reduce_scatter(const Tensor&, Tensor&, ReduceOp, const OpRecord& rec) override {
    return done(rec);
  }
  std::shared_ptr<Work> do_all_reduce(Tensor&, ReduceOp, const OpRecord& rec) override { return done(rec); }
  std::shared_ptr<Work> do_broadcast(Tensor&, int, const OpRecord& rec) override { return done(rec); }
  std::shared_ptr<Work> do_all_to_all_v(const Tensor&, const std::vector<int64_t>&, Tensor&,
                                        const std::vector<int64_t>&, const OpRecord& rec) override {
    return done(rec);
  }
  void do_send(const Tensor&, int, const OpRecord& rec) override { done(rec); }
  void do_recv(Tensor&, int, const OpRecord& rec) override { done(rec); }
  void do_barrier(const OpRecord& rec) override { done(rec); }
  std::unique_ptr<Communicator> do_split(SplitPlan plan) override {
    if (plan.new_size == 0) return nullptr;
    return std::make_unique<FakeComm>(plan.new_rank, plan.new_size, *plan.root, opt_, plan.prefix, plan.name);
  }
  void do_abort(const std::string& why) override { abort_reason = why; }
};

// Runs fn(rank, comm) on `n` threads with FakeComm ranks over one memory store.
inline std::vector<std::string> run_fake_ranks(int n, const std::function<void(int, FakeComm&)>& fn,
                                               CommOptions opt = {}) {
  auto store = make_memory_store();
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        FakeComm comm(r, n, *store, opt);
        fn(r, comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace mt::comm::testing
