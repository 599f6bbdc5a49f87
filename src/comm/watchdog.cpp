// The collective watchdog: a thread that, every `poll`, looks at each watched communicator's oldest
// op not yet completed. When one has been in flight longer than the timeout it reports once (stderr
// and the store key "watchdog/<rank>"), aborts every watched communicator (so that a rank blocked in
// a collective, and its peers, get errors instead of hanging), and gives the main thread `grace` to
// react; a process whose main thread neither destroys the watchdog nor unwatches the communicators
// in that time exits with kWatchdogExitCode. For Gloo the op blocks the calling thread and Gloo's
// own timeout throws there; the watchdog still reports, from its own thread: an op that failed
// (threw) is reported like one overdue, since the rank is out of step with its group either way.
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/communicator.h"
#include "core/log.h"

namespace mt::comm {

using Clock = std::chrono::steady_clock;

struct Watchdog::Impl {
  Store& store;
  int rank;
  Millis timeout, grace, poll;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::vector<Communicator*> comms;
  std::atomic<bool> fired{false};
  Clock::time_point deadline{};
  std::thread thread;

  Impl(Store& s, int r, Millis t, Millis g, Millis p) : store(s), rank(r), timeout(t), grace(g), poll(p) {}

  // The report for `c` when its oldest incomplete op has been in flight longer than the timeout.
  std::string overdue(Communicator& c, Clock::time_point now) {
    c.poll_completion();
    uint64_t done = c.completed_seq();
    OpRecord last = c.last_issued();
    if (last.seq <= done) return "";
    OpRecord oldest = last;
    for (const auto& r : c.history())
      if (r.seq == done + 1) oldest = r;
    double secs = int64_t(std::chrono::duration<double>(now - oldest.issued).count() * 10) / 10.0;
    std::string msg;
    if (uint64_t f = c.failed_seq(); f != 0) {
      // The op threw in the main thread (Gloo's own timeout, a lost peer): report it all the same, so
      // that the store has every rank's last collective.
      for (const auto& r : c.history())
        if (r.seq == f) oldest = r;
      msg = str("watchdog: rank ", rank, ": communicator '", c.name(), "' op ", oldest.str(), " failed (", c.failure(),
                "); last completed #", done);
    } else {
      if (now - oldest.issued <= timeout) return "";
      msg = str("watchdog: rank ", rank, ": communicator '", c.name(), "' op ", oldest.str(), " in flight for ", secs,
                " s; last completed #", done);
    }
    if (last.seq != oldest.seq) msg += str(" (last issued ", last.str(), ")");
    return msg;
  }

  // Local first (abort this rank's communicators, mark fired), then the report for the other ranks:
  // whoever reads the report can rely on this rank having already aborted.
  void fire(const std::string& msg) {
    std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
    for (Communicator* c : comms) c->abort(msg);
    deadline = Clock::now() + grace;
    fired.store(true);
    try {
      store.set_str(str("watchdog/", rank), msg);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "watchdog: rank %d: could not write the report to the store: %s\n", rank, e.what());
    }
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      cv.wait_for(lock, poll, [&] { return stop; });
      if (stop) break;
      auto now = Clock::now();
      if (fired.load()) {
        if (!comms.empty() && now > deadline) {
          std::fprintf(stderr,
                       "watchdog: rank %d: the main thread did not react within %.1f s of the abort; exiting with "
                       "code %d\n",
                       rank, grace.count() / 1000.0, kWatchdogExitCode);
          std::fflush(stderr);
          std::_Exit(kWatchdogExitCode);
        }
        continue;
      }
      for (Communicator* c : comms) {
        std::string msg = overdue(*c, now);
        if (!msg.empty()) {
          fire(msg);
          break;
        }
      }
    }
  }
};

Watchdog::Watchdog(Store& store, int rank, Millis timeout, Millis grace, Millis poll)
    : impl_(std::make_unique<Impl>(store, rank, timeout, grace, poll)) {
  if (timeout.count() <= 0) MT_THROW("watchdog: timeout must be positive, got ", timeout.count(), " ms");
  if (poll.count() <= 0) MT_THROW("watchdog: poll interval must be positive, got ", poll.count(), " ms");
  impl_->thread = std::thread([this] { impl_->run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

void Watchdog::watch(Communicator* c) {
  MT_CHECK(c != nullptr, "watchdog: watch(nullptr)");
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (Communicator* w : impl_->comms)
    if (w == c) return;
  impl_->comms.push_back(c);
  // A communicator joining after the watchdog fired is aborted too: the job is going down.
  if (impl_->fired.load()) c->abort("watchdog: fired before this communicator was watched");
}

void Watchdog::unwatch(Communicator* c) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::erase(impl_->comms, c);
}

bool Watchdog::fired() const {
  return impl_->fired.load();
}

}  // namespace mt::comm
