// moetrain _selftest comm|dist|rl [options] (hidden): the self tests the multi-process tests run, each a
// library function taking its options struct (selftest/comm_selftest.h, selftest/dist_selftest.h,
// rl/rl_selftest.h); this file parses their options.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common_options.h"
#include "core/error.h"
#include "core/options.h"
#include "rl/rl_selftest.h"
#include "selftest/comm_selftest.h"
#include "selftest/dist_selftest.h"

namespace mt {

namespace {

int comm_selftest(const std::vector<std::string>& args) {
  comm::CommSelftestOptions o;
  std::string device = "cpu";
  cli::Options opt("_selftest comm", "[options]",
                   "Every collective checked with self-describing data on the world communicator, then timed (run "
                   "it under\nmoetrain launch); exit 0 when every check passed.");
  opt.add("device", &device, "the world's device: Gloo on cpu, NCCL on cuda").one_of({"cpu", "cuda"});
  opt.add("timeout-ms", &o.timeout_ms, "collective and store timeout").at_least(1);
  opt.add("bench-mib", &o.bench_mib, "size of the timed buffers")
      .at_least(-1)
      .says("-1: 256 on cuda, 16 on cpu; 0: no timing");
  opt.add("iters", &o.iters, "timed iterations per op (after 2 untimed)").at_least(1);
  opt.add("kill-rank", &o.kill_rank, "this rank SIGKILLs itself during a run of all_reduces")
      .at_least(-1)
      .says("-1: none");
  opt.add("skip-without-gpus", &o.skip_without_gpus,
          "with --device cuda: fewer GPUs visible than this prints 'skipped: no GPU' and exits 0")
      .at_least(0);
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  o.device = device == "cuda" ? Device::CUDA : Device::CPU;
  return comm::run_comm_selftest(o);
}

int dist_selftest(const std::vector<std::string>& args) {
  comm::DistSelftestOptions o;
  cli::Options opt("_selftest dist", "[options]",
                   "A rank that rendezvouses through the TCP store, prints 'rank R of W ok' and misbehaves on "
                   "demand\n(run it under moetrain launch).");
  opt.add("timeout-ms", &o.timeout_ms, "the store's timeout").at_least(1);
  opt.add("fail-rank", &o.fail_rank, "this rank exits with --exit-code after the barrier")
      .at_least(-1)
      .says("-1: none");
  opt.add("exit-code", &o.exit_code, "the failing rank's exit code").at_least(0).at_most(255);
  opt.add("crash-rank", &o.crash_rank, "this rank aborts (SIGABRT) after the barrier").at_least(-1).says("-1: none");
  opt.add("hang-rank", &o.hang_rank, "this rank sleeps forever after the barrier").at_least(-1).says("-1: none");
  opt.add("absent-rank", &o.absent_rank, "this rank never reaches the barrier").at_least(-1).says("-1: none");
  opt.add("ignore-sigterm", &o.ignore_sigterm, "ranks that hang or stay absent ignore SIGTERM");
  opt.add("numa", &o.numa, "bind each rank to the NUMA node of GPU <local rank> first");
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  return comm::run_dist_selftest(o);
}

int rl_selftest(const std::vector<std::string>& args) {
  rl::RlSelftestOptions o;
  std::string loss = "ppo";
  int64_t seed = int64_t(o.seed);
  bool no_replay = !o.replay;
  cli::Options opt("_selftest rl", "--model DIR --out FILE.safetensors [options]",
                   "The RL update on synthetic rollouts from --seed (rl/rl_selftest.h); rank 0 writes the loss, the "
                   "metrics and\nevery gradient, and --params-out the weights after the update.");
  opt.group("input and output");
  opt.add("model", &o.model_dir, "the Hugging Face model directory").var("DIR").required();
  opt.add("out", &o.out_path, "loss, metrics and grad.<name>").var("FILE.safetensors").required();
  opt.add("params-out", &o.params_path, "param.<name> after the update").var("FILE.safetensors");
  opt.group("update");
  opt.add("algorithm", &o.algorithm, "ppo adds a critic initialised from the policy").one_of({"grpo", "ppo"});
  opt.add("loss", &loss, "the policy loss").one_of({"ppo", "gspo", "pg"});
  opt.add("groups", &o.groups, "prompts").at_least(1);
  opt.add("n", &o.n, "samples per prompt").at_least(1);
  opt.add("micro-batch-samples", &o.micro_batch_samples, "samples per micro-batch").at_least(1);
  opt.add("mini-batches", &o.mini_batches, "optimizer steps per epoch").at_least(1);
  opt.add("epochs", &o.epochs, "passes over the samples").at_least(1);
  opt.add("kl-coef", &o.kl_coef, "KL-to-reference loss weight (0: no reference model)").at_least(0);
  opt.add("lr", &o.lr, "AdamW learning rate").above(0);
  opt.add("no-replay", &no_replay, "do not replay the rollouts' routing");
  opt.add("freeze-router", &o.freeze_router, "keep the routers' weights fixed");
  opt.add("aux-loss-coef", &o.aux_loss_coef, "MoE load-balancing loss weight").at_least(0);
  opt.add("router-z-loss-coef", &o.router_z_loss_coef, "router z-loss weight").at_least(0);
  opt.add("generate", &o.generate, "the whole step: the engine samples from the fixed prompts");
  opt.add("seed", &seed, "the synthetic rollouts' seed").at_least(0);
  cli::add_mesh_options(opt, o.mesh);
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  o.loss = rl::parse_policy_loss(loss);
  o.replay = !no_replay;
  o.seed = uint64_t(seed);
  return rl::run_rl_selftest(o);
}

}  // namespace

int selftest_main(const std::vector<std::string>& args) {
  const std::string which = args.empty() ? "" : args[0];
  const std::vector<std::string> rest(args.begin() + (args.empty() ? 0 : 1), args.end());
  if (which == "comm") return comm_selftest(rest);
  if (which == "dist") return dist_selftest(rest);
  if (which == "rl") return rl_selftest(rest);
  MT_THROW("_selftest: expected comm, dist or rl, got '", which, "'");
}

}  // namespace mt
