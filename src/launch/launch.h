// The supervisor behind `moetrain launch`: starts the ranks of this node as child processes and supervises them, like
// torchrun. Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT
// (read back by detect_dist_env). Promises:
//   - every line a child writes (stdout or stderr) comes out whole, prefixed "[rank N] ", on the
//     launcher's stdout or stderr respectively;
//   - when a rank exits non-zero or by a signal, the launcher names it, sends SIGTERM to the others,
//     SIGKILL after the grace period, waits for all of them, and exits with that rank's code
//     (128 + signal for a signal); SIGINT/SIGTERM sent to the launcher are forwarded the same way;
//   - it exits 0 only when every rank exited 0, and never leaves a child behind: children run in
//     their own process groups (a rank's own children are stopped with it) and die with the
//     launcher (PR_SET_PDEATHSIG) should it be killed outright.
// run_launch() installs signal handlers for its duration: call it from one thread at a time.
#pragma once
#include <string>
#include <vector>

namespace mt::comm {

struct LaunchOptions {
  int nproc_per_node = 0;  // ranks started on this node
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;        // empty: 127.0.0.1 on one node (required with nnodes > 1)
  int master_port = 0;            // 0: pick a free port (one node only)
  double timeout_s = 0;           // wall-clock limit of the whole job; 0 = none. On expiry: stop all, exit 124
  double grace_s = 5;             // SIGTERM -> SIGKILL
  std::string exe;                // empty: this executable (/proc/self/exe)
  std::vector<std::string> args;  // the command line each rank runs after the executable
  int out_fd = 1;                 // where the ranks' stdout lines go (tests pass a pipe)
  int err_fd = 2;                 // where the ranks' stderr lines and the launcher's own messages go
};

// Runs the job; returns the launcher's exit status (see the promises above).
int run_launch(const LaunchOptions& opt);

// Splits a byte stream into whole lines, each emitted with a prefix (exposed for tests). A line
// longer than max_line is emitted in pieces of max_line bytes so that memory stays bounded.
class LinePrefixer {
 public:
  LinePrefixer(std::string prefix, size_t max_line = 64 * 1024) : prefix_(std::move(prefix)), max_line_(max_line) {}
  // Appends data; returns the complete lines, each "<prefix><line>\n".
  std::string feed(const char* data, size_t n);
  std::string finish();  // the unterminated tail (if any), with a newline added
 private:
  std::string prefix_;
  size_t max_line_;
  std::string partial_;
};

}  // namespace mt::comm
