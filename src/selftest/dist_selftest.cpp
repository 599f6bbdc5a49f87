// The hidden `_selftest dist` command (dist_selftest.h): a rank that rendezvouses and misbehaves on demand.
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

}  // namespace

int run_dist_selftest(const DistSelftestOptions& o) {
  DistEnv env = detect_dist_env();
  set_log_rank(env.rank);
  const int r = env.rank, w = env.world_size;
  const Millis timeout(o.timeout_ms);
  if (o.numa) bind_to_gpu_numa_node(r, device_mem::cuda_pci_bus_id(env.local_rank));
  if (o.ignore_sigterm && (r == o.hang_rank || r == o.absent_rank)) std::signal(SIGTERM, SIG_IGN);
  if (r == o.absent_rank) {
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
  if (r == o.fail_rank) {
    std::fprintf(stderr, "rank %d: failing on purpose with exit code %d\n", r, o.exit_code);
    return o.exit_code;
  }
  if (r == o.crash_rank) std::abort();
  if (r == o.hang_rank) sleep_forever();
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
