// The hidden `_selftest dist` command (see dist_selftest.h). Options:
//   --timeout-ms T        store timeout (default 30000)
//   --fail-rank R         rank R exits with --exit-code (default 3) after the barrier
//   --crash-rank R        rank R aborts (SIGABRT) after the barrier
//   --hang-rank R         rank R sleeps forever after the barrier
//   --absent-rank R       rank R never reaches the barrier (sleeps forever before it)
//   --ignore-sigterm      ranks that hang or stay absent ignore SIGTERM (the launcher must SIGKILL)
//   --numa                bind each rank to the NUMA node of GPU <local rank> first (logs one line)
#include "selftest/dist_selftest.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "comm/dist_env.h"
#include "comm/numa.h"
#include "comm/store.h"
#include "core/error.h"
#include "core/log.h"
#include "core/tensor.h"

namespace mt::comm {

namespace {

[[noreturn]] void sleep_forever() {
  for (;;) ::pause();
}

int int_arg(const std::vector<std::string>& args, size_t& i) {
  if (i + 1 >= args.size()) MT_THROW(args[i], " needs a value");
  const std::string& v = args[++i];
  char* end = nullptr;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end) MT_THROW(args[i - 1], " ('", v, "') is not an integer");
  return static_cast<int>(x);
}

}  // namespace

int selftest_main(const std::vector<std::string>& args) {
  if (args.empty() || args[0] != "dist") MT_THROW("_selftest: expected 'dist' (the only self test)");
  int timeout_ms = 30000, fail_rank = -1, exit_code = 3, crash_rank = -1, hang_rank = -1, absent_rank = -1;
  bool ignore_sigterm = false, numa = false;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--timeout-ms")
      timeout_ms = int_arg(args, i);
    else if (a == "--fail-rank")
      fail_rank = int_arg(args, i);
    else if (a == "--exit-code")
      exit_code = int_arg(args, i);
    else if (a == "--crash-rank")
      crash_rank = int_arg(args, i);
    else if (a == "--hang-rank")
      hang_rank = int_arg(args, i);
    else if (a == "--absent-rank")
      absent_rank = int_arg(args, i);
    else if (a == "--ignore-sigterm")
      ignore_sigterm = true;
    else if (a == "--numa")
      numa = true;
    else
      MT_THROW("_selftest dist: unknown option '", a, "'");
  }
  DistEnv env = detect_dist_env();
  set_log_rank(env.rank);
  const int r = env.rank, w = env.world_size;
  const Millis timeout(timeout_ms);
  if (numa) bind_to_gpu_numa_node(r, device_mem::cuda_pci_bus_id(env.local_rank));
  if (ignore_sigterm && (r == hang_rank || r == absent_rank)) std::signal(SIGTERM, SIG_IGN);
  if (r == absent_rank) {
    std::printf("rank %d of %d: staying away from the barrier\n", r, w);
    std::fflush(stdout);
    sleep_forever();
  }
  auto store = make_tcp_store(env.master_addr, env.master_port, r == 0, timeout);
  // Data through the store: every rank publishes a value and reads its neighbour's; a counter
  // proves ADD is atomic across processes.
  store->set_str(str("selftest/value/", r), str("from rank ", r));
  store->add("selftest/count", 1);
  store->barrier("selftest", r, w, timeout);
  int peer = (r + 1) % w;
  std::string got = store->get_str(str("selftest/value/", peer), timeout);
  if (got != str("from rank ", peer)) MT_THROW("rank ", r, " read '", got, "' from rank ", peer, "'s key");
  int64_t count = store->add("selftest/count", 0);
  if (count != w) MT_THROW("rank ", r, ": the counter says ", count, " ranks arrived, expected ", w);
  std::printf("rank %d of %d ok (local %d of %d, node %d, from %s)\n", r, w, env.local_rank, env.local_world_size,
              env.node_rank, env.source.c_str());
  std::fflush(stdout);
  if (r == fail_rank) {
    std::fprintf(stderr, "rank %d: failing on purpose with exit code %d\n", r, exit_code);
    return exit_code;
  }
  if (r == crash_rank) std::abort();
  if (r == hang_rank) sleep_forever();
  // Rank 0 serves the store: it leaves only after every rank is done with it.
  store->set_str(str("selftest/done/", r), "1");
  if (r == 0) {
    std::vector<std::string> done;
    for (int i = 0; i < w; ++i) done.push_back(str("selftest/done/", i));
    store->wait(done, timeout);
  }
  return 0;
}

}  // namespace mt::comm
