// The CPU communicator of one rank: every collective is what it means for a group of one (a copy
// or nothing), so single-process runs need no Gloo. It still records every call like any other
// backend, so schedule checks and the watchdog see the same sequence.
#include <cstring>

#include "comm/backends.h"

namespace mt::comm::detail {

namespace {

struct DoneWork : Work {
  void wait() override {}
};

class SelfComm : public Communicator {
 public:
  SelfComm(const std::string& name, Store& root, const std::string& prefix, CommOptions opt)
      : Communicator(0, 1, name, root, prefix, opt) {}
  Device device() const override { return Device::CPU; }
  const char* backend() const override { return "self"; }

 protected:
  std::shared_ptr<Work> done(const OpRecord& rec) {
    mark_completed(rec.seq);
    return std::make_shared<DoneWork>();
  }
  static void copy(const Tensor& from, Tensor& to) {
    if (from.raw() != to.raw() && from.nbytes()) std::memmove(to.raw(), from.raw(), from.nbytes());
  }
  std::shared_ptr<Work> do_all_gather(const Tensor& in, Tensor& out, const OpRecord& rec) override {
    copy(in, out);
    return done(rec);
  }
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp, const OpRecord& rec) override {
    copy(in, out);
    return done(rec);
  }
  std::shared_ptr<Work> do_all_reduce(Tensor&, ReduceOp, const OpRecord& rec) override { return done(rec); }
  std::shared_ptr<Work> do_broadcast(Tensor&, int, const OpRecord& rec) override { return done(rec); }
  std::shared_ptr<Work> do_all_to_all_v(const Tensor& in, const std::vector<int64_t>&, Tensor& out,
                                        const std::vector<int64_t>&, const OpRecord& rec) override {
    copy(in, out);
    return done(rec);
  }
  // The base class rejects a peer equal to the own rank, the only rank there is.
  void do_send(const Tensor&, int, const OpRecord&) override { MT_CHECK(false, "send in a group of one"); }
  void do_recv(Tensor&, int, const OpRecord&) override { MT_CHECK(false, "recv in a group of one"); }
  void do_barrier(const OpRecord& rec) override { mark_completed(rec.seq); }
  std::unique_ptr<Communicator> do_split(SplitPlan plan) override {
    if (plan.new_size == 0) return nullptr;
    return std::make_unique<SelfComm>(plan.name, *plan.root, plan.prefix, opt_);
  }
  void do_abort(const std::string&) override {}
};

}  // namespace

std::unique_ptr<Communicator> make_self_comm(const std::string& name, Store& root, const std::string& prefix,
                                             CommOptions opt) {
  return std::make_unique<SelfComm>(name, root, prefix, opt);
}

}  // namespace mt::comm::detail
