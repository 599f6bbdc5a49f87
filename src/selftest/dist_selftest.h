// `moetrain _selftest dist` (hidden): a rank that rendezvouses through detect_dist_env and the TCP
// store, proves the store works across processes, prints "rank R of W ok", and misbehaves on demand
// so that the tests can check the launcher's stop protocol and the barrier's error messages.
// The `_selftest dist` command parses the options.
#pragma once

namespace mt::comm {

struct DistSelftestOptions {
  int timeout_ms = 30000;  // the store's timeout
  int fail_rank = -1;      // this rank exits with exit_code after the barrier; -1: none
  int exit_code = 3;
  int crash_rank = -1;          // this rank aborts (SIGABRT) after the barrier
  int hang_rank = -1;           // this rank sleeps forever after the barrier
  int absent_rank = -1;         // this rank never reaches the barrier (sleeps forever before it)
  bool ignore_sigterm = false;  // ranks that hang or stay absent ignore SIGTERM (the launcher must SIGKILL)
  bool numa = false;            // bind each rank to the NUMA node of GPU <local rank> first (logs one line)
};

int run_dist_selftest(const DistSelftestOptions& o);  // the exit status

}  // namespace mt::comm
