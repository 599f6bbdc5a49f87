// The deterministic switch (core/determinism.h): an atomic flag, first filled from the environment.
#include "core/determinism.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace mt {

namespace {

// -1: not decided yet (read the environment), 0: off, 1: on.
std::atomic<int> g_state{-1};

int from_env() {
  const char* v = std::getenv("MOETRAIN_DETERMINISTIC");
  const std::string s = v ? v : "";
  if (s.empty() || s == "0") return 0;
  if (s == "1") return 1;
  MT_THROW("MOETRAIN_DETERMINISTIC (\"", s, "\") must be 0 or 1");
}

}  // namespace

bool deterministic() {
  int s = g_state.load(std::memory_order_relaxed);
  if (s < 0) {
    int expected = -1;
    g_state.compare_exchange_strong(expected, from_env());
    s = g_state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

void set_deterministic(bool on) {
  g_state.store(on ? 1 : 0, std::memory_order_relaxed);
}

DeterministicScope::DeterministicScope(bool on) : prev_(deterministic()) {
  set_deterministic(on);
}

DeterministicScope::~DeterministicScope() {
  set_deterministic(prev_);
}

}  // namespace mt
