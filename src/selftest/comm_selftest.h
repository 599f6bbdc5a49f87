// The hidden `_selftest comm` command: run under `moetrain launch`, every rank makes the world
// communicator (Gloo on cpu, NCCL on cuda), checks every collective with self-describing data
// (f32/bf16/i32/i64, every reduction, all_to_all_v with zero counts, send/recv, a split into two
// groups), then times a large all_gather and reduce_scatter and rank 0 prints one JSON line per op
// with the bus bandwidth. With --kill-rank R, rank R kills itself (SIGKILL) in the middle of a run
// of all_reduces, and the others must fail with an error that names the op, without waiting for the
// timeout. Exit status: 0 when every check passed, 1 otherwise.
#pragma once
#include <string>
#include <vector>

namespace mt::comm {

int comm_selftest_main(const std::vector<std::string>& args);  // args after "comm"

}  // namespace mt::comm
