// The commands' own argument rules on top of the options module: launch passes everything after "--" to
// the ranks untouched and refuses a command put before it; plot takes exactly one run directory; the hidden
// self tests parse their options in the shared form.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "launch/launch.h"
#include "parallel/launch_test_util.h"

using namespace mt;

namespace {

std::string error_of(const std::vector<std::string>& args) {
  try {
    comm::parse_launch_args(args);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(CliCommands, LaunchPassesEverythingAfterTheDoubleDashUntouched) {
  const comm::LaunchOptions o = comm::parse_launch_args(
      {"--nproc-per-node=2", "--grace-s", "0.5", "--", "grads", "--help", "--nproc-per-node", "9", "--", "-x"});
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_DOUBLE_EQ(o.grace_s, 0.5);
  EXPECT_EQ(o.args, (std::vector<std::string>{"grads", "--help", "--nproc-per-node", "9", "--", "-x"}));
  EXPECT_EQ(error_of({"--nproc-per-node", "2", "train", "--", "x"}),
            "launch: unexpected argument 'train' before '--'; the command to run goes after it (moetrain launch "
            "--nproc-per-node 2 -- train)");
  EXPECT_EQ(error_of({"--nproc-per-nod", "2", "--", "x"}),
            "launch: unknown option --nproc-per-nod; did you mean --nproc-per-node? (moetrain launch --help lists "
            "every option)");
  EXPECT_EQ(error_of({"--nproc-per-node", "1", "--timeout-s", "1e10", "--", "x"}),
            "launch: --timeout-s 1e+10; need at most 1e9 seconds");
}

TEST(CliCommands, PlotTakesExactlyOneRunDirectory) {
  mt::test::ShellRun r = mt::test::sh(mt::test::kMoetrainBin + " plot");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("moetrain plot: error: give a run directory (or its metrics.jsonl)\nusage: moetrain plot "),
            std::string::npos)
      << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " plot runs/a runs/b");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("one run directory, got 2 ('runs/a', 'runs/b')"), std::string::npos) << r.out;
}

TEST(CliCommands, SelftestsParseTheirOptionsInTheSharedForm) {
  mt::test::ShellRun r = mt::test::sh(mt::test::kMoetrainBin + " _selftest comm --iters 0");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--iters 0; need >= 1"), std::string::npos) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " _selftest dist --fail-rnk 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("did you mean --fail-rank"), std::string::npos) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " _selftest rl --out x.safetensors");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--model is required"), std::string::npos) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " _selftest rl --help");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--no-replay"), std::string::npos) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " _selftest bogus");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("expected comm, dist or rl, got 'bogus'"), std::string::npos) << r.out;
}
