// moetrain launch --nproc-per-node N [options] -- <command> [args]: the options of the supervisor
// (launch/launch.h runs it); everything after "--" is the ranks' command line, passed on untouched.
#include "launch/launch.h"

#include <climits>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/options.h"

namespace mt {

namespace {

// The launcher's options on `opt`, filling `o`; the rules check them with the command after "--".
void declare_launch_options(cli::Options& opt, comm::LaunchOptions& o, const std::vector<std::string>& args) {
  opt.allow_positional("<command> [args]");
  opt.add("nproc-per-node", &o.nproc_per_node, "ranks on this node").at_least(1).at_most(4096).required();
  opt.add("nnodes", &o.nnodes, "nodes in the job; run one launcher per node").at_least(1);
  opt.add("node-rank", &o.node_rank, "this node's index in [0, --nnodes)").at_least(0);
  opt.add("master-addr", &o.master_addr,
          "host of rank 0, reachable from every node (127.0.0.1 on one node; required with --nnodes > 1)")
      .var("HOST");
  opt.add("master-port", &o.master_port, "rendezvous port")
      .at_least(0)
      .at_most(65535)
      .says("0: a free port, one node only");
  opt.add("timeout-s", &o.timeout_s, "stop every rank and exit 124 after this many seconds")
      .at_least(0)
      .says("0: no limit");
  opt.add("grace-s", &o.grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks").at_least(0);
  opt.add("exe", &o.exe, "run this program (e.g. build/train_step) instead of moetrain").var("PATH");
  opt.rule([&opt, &o, &args] {
    // Positional arguments before "--" are a command line put in the wrong place.
    size_t after = 0;
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i] == "--") {
        after = args.size() - i - 1;
        break;
      }
    const std::vector<std::string>& rest = opt.positional();
    if (rest.size() > after)
      MT_THROW("launch: unexpected argument '", rest.front(), "' before '--'; the command to run goes after it (",
               "moetrain launch --nproc-per-node 2 -- train)");
    const std::pair<const char*, double> seconds[] = {{"timeout-s", o.timeout_s}, {"grace-s", o.grace_s}};
    for (const auto& [flag, v] : seconds)  // beyond it the deadlines would overflow
      if (v > 1e9) MT_THROW("launch: --", flag, " ", v, "; need at most 1e9 seconds");
    if (int64_t(o.nnodes) * o.nproc_per_node > INT_MAX)
      MT_THROW("launch: --nnodes (", o.nnodes, ") x --nproc-per-node (", o.nproc_per_node, ") is too large");
    if (o.node_rank >= o.nnodes)
      MT_THROW("launch: --node-rank (", o.node_rank, ") must be in [0, --nnodes = ", o.nnodes, ")");
    if (o.nnodes > 1) {
      if (o.master_addr.empty())
        MT_THROW("launch: --master-addr is required with --nnodes ", o.nnodes,
                 " (the host of node 0, reachable from every node)");
      if (o.master_port == 0)
        MT_THROW("launch: --master-port is required with --nnodes ", o.nnodes, " (the same free port on every node)");
    }
    if (rest.empty())
      MT_THROW("launch: nothing to run: put the command after '--', e.g. moetrain launch --nproc-per-node 2 -- train");
  });
}

const char* const kSynopsis = "--nproc-per-node N [options] -- <command> [args...]";
const char* const kSummary =
    "Starts N ranks of `moetrain <command> [args...]` on this node, with RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT set. If a rank fails, the others are stopped\n"
    "and the launcher exits with that rank's status. Everything after '--' is passed to the ranks untouched.";

}  // namespace

namespace comm {

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  cli::Options opt("launch", kSynopsis, kSummary);
  declare_launch_options(opt, o, args);
  if (!opt.parse(args)) MT_THROW("launch: -h/--help asks for the help, not a launch (moetrain launch --help)");
  opt.check();
  o.args = opt.positional();
  return o;
}

}  // namespace comm

int launch_main(const std::vector<std::string>& args) {
  comm::LaunchOptions o;
  cli::Options opt("launch", kSynopsis, kSummary);
  declare_launch_options(opt, o, args);
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  o.args = opt.positional();
  return comm::run_launch(o);
}

}  // namespace mt
