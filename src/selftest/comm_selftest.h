// The hidden `_selftest comm` command: run under `moetrain launch`, every rank makes the world
// communicator (Gloo on cpu, NCCL on cuda), checks every collective with self-describing data
// (f32/bf16/i32/i64, every reduction, all_to_all_v with zero counts, send/recv, a split into two
// groups), then times a large all_gather and reduce_scatter and rank 0 prints one JSON line per op
// with the bus bandwidth. With --kill-rank R, rank R kills itself (SIGKILL) in the middle of a run
// of all_reduces, and the others must fail with an error that names the op, without waiting for the
// timeout. Exit status: 0 when every check passed, 1 otherwise. The command parses the options.
#pragma once
#include "core/dtype.h"

namespace mt::comm {

struct CommSelftestOptions {
  Device device = Device::CPU;  // the world's: Gloo on cpu, NCCL on cuda
  int timeout_ms = 60000;       // collective and store timeout
  int bench_mib = -1;           // the timed buffers' size; -1: 256 on cuda, 16 on cpu; 0: no timing
  int iters = 10;               // timed iterations per op (after 2 untimed)
  int kill_rank = -1;           // this rank SIGKILLs itself during a run of all_reduces; -1: none
  int skip_without_gpus = 0;    // on cuda: fewer GPUs visible than this prints "skipped: no GPU", exit 0
};

int run_comm_selftest(const CommSelftestOptions& o);  // the exit status

}  // namespace mt::comm
