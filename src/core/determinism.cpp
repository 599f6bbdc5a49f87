// The deterministic switch (core/determinism.h): an atomic flag, first filled from the environment.
#include "core/determinism.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace mt {

namespace {

// -1: not decided yet (read the environment), 0: off, 1: on.
std::atomic<int> g_state{-1}, g_batch_invariant{-1};

int from_env(const char* name) {
  const char* v = std::getenv(name);
  const std::string s = v ? v : "";
  if (s.empty() || s == "0") return 0;
  if (s == "1") return 1;
  MT_THROW(name, " (\"", s, "\") must be 0 or 1");
}

bool read(std::atomic<int>& state, const char* name) {
  int s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    int expected = -1;
    state.compare_exchange_strong(expected, from_env(name));
    s = state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

}  // namespace

bool deterministic() {
  return read(g_state, "MOETRAIN_DETERMINISTIC");
}

void set_deterministic(bool on) {
  g_state.store(on ? 1 : 0, std::memory_order_relaxed);
}

bool batch_invariant() {
  return read(g_batch_invariant, "MOETRAIN_BATCH_INVARIANT");
}

void set_batch_invariant(bool on) {
  g_batch_invariant.store(on ? 1 : 0, std::memory_order_relaxed);
}

BatchInvariantScope::BatchInvariantScope(bool on) : prev_(batch_invariant()) {
  set_batch_invariant(on);
}

BatchInvariantScope::~BatchInvariantScope() {
  set_batch_invariant(prev_);
}

DeterministicScope::DeterministicScope(bool on) : prev_(deterministic()) {
  set_deterministic(on);
}

DeterministicScope::~DeterministicScope() {
  set_deterministic(prev_);
}

}  // namespace mt
