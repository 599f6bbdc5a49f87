// SIGINT / SIGTERM as a stop request (interrupt.h).
#include "core/interrupt.h"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <mutex>

namespace mt {

namespace {

// The first stop signal's number, 0 when none. Written from the handler: it must be lock-free to be
// async-signal-safe.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the stop flag must be lock-free (signal handler)");

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, sig)) return;  // the first: the loop stops at its next check
  // The second (of either kind): the default action, now. The signal is blocked while this handler
  // runs, so the re-raised one is delivered as the handler returns.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  raise(sig);
}

}  // namespace

void install_stop_signals() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
  });
}

bool stop_requested() {
  return g_stop_signal.load() != 0;
}

int stop_signal() {
  return g_stop_signal.load();
}

const char* stop_signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  static thread_local char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", sig);
  return buf;
}

void reset_stop_for_tests() {
  g_stop_signal.store(0);
}

}  // namespace mt
