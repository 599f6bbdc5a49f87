// CPU communicator over Gloo (Debian libgloo-dev): TCP transport, rendezvous through our Store,
// Gloo's algorithms for every collective. Every call completes before it returns. Gloo's own
// timeout (CommOptions::timeout) bounds every wait; abort() closes the connections, so that the
// peers fail at once instead of at their timeouts (a call of this rank blocked in another thread
// still ends at its timeout: Debian's Gloo lacks the headers, gloo/common/memory.h, that reaching
// the transport's wake-up would need).
//
// The transport binds to an interface named by MT_GLOO_IFNAME or GLOO_SOCKET_IFNAME, else to the
// address MT_GLOO_HOST names, else to loopback when every rank runs on this host and to this
// host's name (as the resolver knows it) when they do not.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "comm/backends.h"
#include "core/log.h"

namespace mt::comm::detail {

namespace {

struct DoneWork : Work {
  void wait() override {}
};

// Gloo's rendezvous interface over our Store: the same keys, every wait bounded by the timeout.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(mt::comm::Store& s, Millis timeout) : s_(s), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_.set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = s_.get(key, timeout_);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { s_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    s_.wait(keys, timeout);
  }

 private:
  mt::comm::Store& s_;
  Millis timeout_;
};

std::string env_or(const char* a, const char* b = nullptr) {
  if (const char* v = std::getenv(a); v && *v) return v;
  if (b)
    if (const char* v = std::getenv(b); v && *v) return v;
  return "";
}

std::string this_host() {
  char h[256] = {0};
  if (gethostname(h, sizeof(h) - 1) != 0) return "localhost";
  return h;
}

// Element-wise reduction for Gloo's allreduce: c = a op b over n elements of T (16-bit floats
// through f32, rounded back once).
template <class T>
void reduce_elems(ReduceOp op, void* c_, const void* a_, const void* b_, size_t n) {
  T* c = static_cast<T*>(c_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  if constexpr (std::is_same_v<T, Bf16> || std::is_same_v<T, Half>) {
    for (size_t i = 0; i < n; ++i) {
      double x = to_double(a[i]), y = to_double(b[i]);
      double r = op == ReduceOp::Sum ? x + y : op == ReduceOp::Max ? std::max(x, y) : std::min(x, y);
      c[i] = from_double<T>(r);
    }
  } else {
    for (size_t i = 0; i < n; ++i)
      c[i] = op == ReduceOp::Sum ? T(a[i] + b[i]) : op == ReduceOp::Max ? std::max(a[i], b[i]) : std::min(a[i], b[i]);
  }
}

gloo::AllreduceOptions::Func reduce_func(DType dt, ReduceOp op) {
  return dispatch_dtype(dt, [op](auto tag) -> gloo::AllreduceOptions::Func {
    using T = typename decltype(tag)::type;
    return [op](void* c, const void* a, const void* b, size_t n) { reduce_elems<T>(op, c, a, b, n); };
  });
}

// Slots of point-to-point messages: a prefix no Gloo collective uses, and the k-th message of the
// (sender, receiver) pair, so that the k-th send matches the k-th recv.
constexpr uint8_t kP2PSlotPrefix = 0x40;
// Slots of our ring reduce-scatter: the collective's tag, plus the step.
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;

class GlooComm : public Communicator {
 public:
  GlooComm(int rank, int size, const std::string& name, Store& root, const std::string& prefix, CommOptions opt,
           std::shared_ptr<gloo::transport::Device> dev)
      : Communicator(rank, size, name, root, prefix, opt), dev_(std::move(dev)), sent_(size), received_(size) {
    auto gloo_keys = make_prefix_store(store_, "gloo");
    StoreAdapter adapter(*gloo_keys, opt_.timeout);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(opt_.timeout);
    try {
      ctx->connectFullMesh(adapter, dev_);
    } catch (const std::exception& e) {
      MT_THROW("Gloo could not connect communicator '", name, "' (rank ", rank, " of ", size, ", device ", dev_->str(),
               ", timeout ", opt_.timeout.count(), " ms): ", e.what());
    }
    std::lock_guard<std::mutex> lock(ctx_mu_);
    ctx_ = std::move(ctx);
  }

  ~GlooComm() override {
    std::lock_guard<std::mutex> lock(ctx_mu_);
    ctx_.reset();
  }

  Device device() const override { return Device::CPU; }
  const char* backend() const override { return "gloo"; }

 protected:
  std::shared_ptr<Work> done(const OpRecord& rec) {
    mark_completed(rec.seq);
    return std::make_shared<DoneWork>();
  }
  // The tag of a collective: the collective number, the same on every rank.
  static uint32_t tag_of(const OpRecord& rec) { return uint32_t(rec.coll); }

  std::shared_ptr<Work> do_all_gather(const Tensor& in, Tensor& out, const OpRecord& rec) override {
    if (in.numel() == 0) return done(rec);
    gloo::AllgatherOptions o(ctx_);
    char* block = byte_ptr(out) + size_t(rank()) * in.nbytes();
    if (in.raw() != block) o.setInput<uint8_t>(reinterpret_cast<uint8_t*>(in.raw()), in.nbytes());
    o.setOutput<uint8_t>(reinterpret_cast<uint8_t*>(out.raw()), out.nbytes());
    o.setTag(tag_of(rec));
    o.setTimeout(opt_.timeout);
    gloo::allgather(o);
    return done(rec);
  }

  std::shared_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op, const OpRecord& rec) override {
    allreduce_raw(t.raw(), t.numel(), t.dtype(), op, rec);
    return done(rec);
  }

  void allreduce_raw(void* p, int64_t n, DType dt, ReduceOp op, const OpRecord& rec) {
    if (n == 0) return;
    gloo::AllreduceOptions o(ctx_);
    dispatch_dtype(dt, [&](auto tag) {
      using T = typename decltype(tag)::type;
      o.setOutput<T>(static_cast<T*>(p), size_t(n));
    });
    o.setReduceFunction(reduce_func(dt, op));
    o.setTag(tag_of(rec));
    o.setTimeout(opt_.timeout);
    gloo::allreduce(o);
  }

  // A ring reduce-scatter over Gloo's unbound buffers: n - 1 steps, each sending one block to the
  // right neighbour and reducing the block received from the left, so every rank sends (n-1)/n of
  // the input (an all-reduce would send twice that). Gloo's own ReduceScatterHalvingDoubling is not
  // used: it registers bound buffers per call, a peer that sends before they exist makes the
  // transport's thread busy-wait, and on Debian's Gloo later collectives on the same pairs were
  // measured to stall for hundreds of milliseconds after it.
  std::shared_ptr<Work> do_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, const OpRecord& rec) override {
    const int n = size(), r = rank();
    const size_t block = out.nbytes();
    if (block == 0) return done(rec);
    Tensor work = in.clone();
    Tensor tmp = Tensor::empty({out.numel()}, out.dtype());
    auto send_buf = ctx_->createUnboundBuffer(work.raw(), work.nbytes());
    auto recv_buf = ctx_->createUnboundBuffer(tmp.raw(), tmp.nbytes());
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag_of(rec));
    auto reduce = reduce_func(out.dtype(), op);
    for (int s = 0; s < n - 1; ++s) {
      // After the last step this rank holds the full reduction of its own block r.
      const int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
      send_buf->send(right, slot + uint64_t(s), size_t(send_idx) * block, block);
      recv_buf->recv(left, slot + uint64_t(s), 0, block);
      recv_buf->waitRecv(opt_.timeout);
      char* dst = byte_ptr(work) + size_t(recv_idx) * block;
      reduce(dst, dst, tmp.raw(), size_t(out.numel()));
    }
    for (int s = 0; s < n - 1; ++s) send_buf->waitSend(opt_.timeout);
    std::memcpy(out.raw(), byte_ptr(work) + size_t(r) * block, block);
    return done(rec);
  }

  std::shared_ptr<Work> do_broadcast(Tensor& t, int root, const OpRecord& rec) override {
    if (t.numel() == 0) return done(rec);
    gloo::BroadcastOptions o(ctx_);
    o.setOutput<uint8_t>(reinterpret_cast<uint8_t*>(t.raw()), t.nbytes());
    o.setRoot(root);
    o.setTag(tag_of(rec));
    o.setTimeout(opt_.timeout);
    gloo::broadcast(o);
    return done(rec);
  }

  std::shared_ptr<Work> do_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                                        const std::vector<int64_t>& recv_counts, const OpRecord& rec) override {
    int64_t es = int64_t(dtype_size(in.dtype()));
    std::vector<int64_t> send_bytes, recv_bytes;
    for (int64_t c : send_counts) send_bytes.push_back(c * es);
    for (int64_t c : recv_counts) recv_bytes.push_back(c * es);
    gloo::AlltoallvOptions o(ctx_);
    o.setInput<uint8_t>(reinterpret_cast<uint8_t*>(in.raw()), send_bytes);
    o.setOutput<uint8_t>(reinterpret_cast<uint8_t*>(out.raw()), recv_bytes);
    o.setTag(tag_of(rec));
    o.setTimeout(opt_.timeout);
    gloo::alltoallv(o);
    return done(rec);
  }

  void do_send(const Tensor& t, int peer, const OpRecord& rec) override {
    uint64_t slot = gloo::Slot::build(kP2PSlotPrefix, uint32_t(sent_[size_t(peer)]++));
    if (t.numel() > 0) {
      auto buf = ctx_->createUnboundBuffer(t.raw(), t.nbytes());
      buf->send(peer, slot);
      buf->waitSend(opt_.timeout);
    }
    mark_completed(rec.seq);
  }

  void do_recv(Tensor& t, int peer, const OpRecord& rec) override {
    uint64_t slot = gloo::Slot::build(kP2PSlotPrefix, uint32_t(received_[size_t(peer)]++));
    if (t.numel() > 0) {
      auto buf = ctx_->createUnboundBuffer(t.raw(), t.nbytes());
      buf->recv(peer, slot);
      buf->waitRecv(opt_.timeout);
    }
    mark_completed(rec.seq);
  }

  void do_barrier(const OpRecord& rec) override {
    gloo::BarrierOptions o(ctx_);
    o.setTag(tag_of(rec));
    o.setTimeout(opt_.timeout);
    gloo::barrier(o);
    mark_completed(rec.seq);
  }

  std::unique_ptr<Communicator> do_split(SplitPlan plan) override {
    if (plan.new_size == 0) return nullptr;
    if (plan.new_size == 1) return make_self_comm(plan.name, *plan.root, plan.prefix, opt_);
    return std::make_unique<GlooComm>(plan.new_rank, plan.new_size, plan.name, *plan.root, plan.prefix, opt_, dev_);
  }

  void do_abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(ctx_mu_);
    (void)why;
    if (ctx_) ctx_->closeConnections();
  }

 private:
  std::shared_ptr<gloo::transport::Device> dev_;
  std::mutex ctx_mu_;  // abort() may run on another thread while the constructor or destructor runs
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::vector<uint64_t> sent_, received_;  // point-to-point messages per peer
};

// The TCP device for a world: the interface or address from the environment, else loopback when
// every rank is on this host (the hostnames are compared through the store), else this host's name.
std::shared_ptr<gloo::transport::Device> make_device(int rank, int size, Store& root, const std::string& prefix,
                                                     Millis timeout) {
  gloo::transport::tcp::attr attr;
  std::string how;
  std::string iface = env_or("MT_GLOO_IFNAME", "GLOO_SOCKET_IFNAME");
  std::string host = env_or("MT_GLOO_HOST");
  if (!iface.empty()) {
    attr.iface = iface;
    how = "interface " + iface + " (MT_GLOO_IFNAME/GLOO_SOCKET_IFNAME)";
  } else if (!host.empty()) {
    attr.hostname = host;
    how = "address " + host + " (MT_GLOO_HOST)";
  } else {
    std::string me = this_host();
    auto ns = make_prefix_store(root, prefix + "/hosts");
    ns->set_str(std::to_string(rank), me);
    bool one_host = true;
    for (int r = 0; r < size; ++r) one_host = one_host && ns->get_str(std::to_string(r), timeout) == me;
    attr.hostname = one_host ? "127.0.0.1" : me;
    how = one_host ? "loopback (every rank on " + me + ")" : "host name " + me + " (ranks on several hosts)";
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    MT_THROW("Gloo could not open a TCP device on ", how, ": ", e.what(),
             "; set MT_GLOO_IFNAME (an interface such as eth0) or MT_GLOO_HOST (an address of this host)");
  }
}

}  // namespace

std::unique_ptr<Communicator> make_gloo_comm(int rank, int size, const std::string& name, Store& root,
                                             const std::string& prefix, CommOptions opt) {
  check_world(rank, size, "Gloo communicator");
  if (size == 1) return make_self_comm(name, root, prefix, opt);
  // A peer that dies closes its sockets; Gloo's next write to one must fail with EPIPE (an error this
  // communicator reports with the op and the ranks), not raise SIGPIPE and kill this process
  // silently. Only the default disposition is replaced: a handler the program installed stays.
  static const bool pipe_ignored = [] {
    struct sigaction old {};
    if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)pipe_ignored;
  auto dev = make_device(rank, size, root, prefix, opt.timeout);
  return std::make_unique<GlooComm>(rank, size, name, root, prefix, opt, std::move(dev));
}

}  // namespace mt::comm::detail

namespace mt::comm {
bool have_gloo() {
  return true;
}
}  // namespace mt::comm
