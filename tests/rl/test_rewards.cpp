// Rewards: the built-in checkers on hand-written responses, and the external reward program with real
// child processes (sh and python3 scripts written by the test): replies as numbers and as objects, a
// program that crashes mid-batch (the rest of the batch gets 0 and an error naming the sample; the next
// batch restarts it), malformed replies, a program that never answers (the deadline holds: the call
// returns within the timeout), stop_on_error, and missing or non-executable programs refused up front.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <functional>

#include "core/error.h"
#include "parallel/launch_test_util.h"
#include "rl/rewards/rewards.h"
#include "rl/rl_test_util.h"

using mt::rltest::program_options;

using namespace mt;
using namespace mt::rl;

namespace {

std::string script(const std::string& name, const std::string& body) {
  const std::string path = test::tmp_path("rewards", name);
  std::ofstream(path) << body;
  ::chmod(path.c_str(), 0755);
  return path;
}

std::vector<RewardRequest> requests(int n) {
  std::vector<RewardRequest> v;
  for (int i = 0; i < n; ++i) v.push_back({"p" + std::to_string(i), std::string(size_t(i), 'x'), {{"i", i}}});
  return v;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Rewards, ExactMatchAndMathCheckerByHand) {
  EXPECT_EQ(exact_match_reward("  42\n", "42"), 1.0);
  EXPECT_EQ(exact_match_reward("42.0", "42"), 0.0);
  EXPECT_EQ(extract_final_answer("so the answer is \\boxed{\\frac{1}{2}} indeed").value(), "\\frac{1}{2}");
  EXPECT_EQ(extract_final_answer("first 3, then 1,234.").value(), "1,234");
  EXPECT_EQ(extract_final_answer("x = -7/2").value(), "-7/2");
  EXPECT_FALSE(extract_final_answer("no digits here").has_value());
  EXPECT_TRUE(answers_equivalent("1,234", "1234"));
  EXPECT_TRUE(answers_equivalent("$+0.5$", "1/2"));
  EXPECT_TRUE(answers_equivalent("42.0", "42"));
  EXPECT_FALSE(answers_equivalent("42.1", "42"));
  EXPECT_TRUE(answers_equivalent("x + 1", "x+1"));  // not numbers: compared as text without spaces
  EXPECT_EQ(math_reward("We get 2+2 = \\boxed{4}.", "4"), 1.0);
  EXPECT_EQ(math_reward("The total is 3 apples, 17 pears", "17"), 1.0);
  EXPECT_EQ(math_reward("The total is 17 pears, then 3", "17"), 0.0);
  EXPECT_EQ(math_reward("nothing", "17"), 0.0);
}

TEST(Rewards, ProgramRepliesAsNumbersAndObjects) {
  const std::string py =
      script("len.py",
             "#!/usr/bin/env python3\nimport sys, json\nfor line in sys.stdin:\n"
             "    r = json.loads(line)\n"
             "    if r['metadata']['i'] % 2: print(json.dumps({'reward': len(r['response'])}), flush=True)\n"
             "    else: print(len(r['response']) + 0.5, flush=True)\n");
  RewardProgram p(program_options(py, 10, false));
  for (int round = 0; round < 2; ++round) {  // started once, used twice
    const RewardBatch b = p.score(requests(5));
    EXPECT_EQ(b.rewards, (std::vector<double>{0.5, 1, 2.5, 3, 4.5}));
    EXPECT_EQ(b.failures, 0);
  }
  EXPECT_EQ(p.restarts(), 0);
}

TEST(Rewards, CrashMalformedAndLateRepliesGiveZeroAndNeverHang) {
  // Answers two requests, then exits 3.
  const std::string crash = script("crash.sh", "#!/bin/sh\nread a; echo 1; read b; echo 2; exit 3\n");
  RewardProgram c(program_options(crash, 10, false));
  RewardBatch b = c.score(requests(4));
  EXPECT_EQ(b.rewards, (std::vector<double>{1, 2, 0, 0}));
  EXPECT_EQ(b.failures, 2);
  EXPECT_NE(b.errors[2].find("exited with status 3"), std::string::npos) << b.errors[2];
  b = c.score(requests(2));  // restarted
  EXPECT_EQ(b.rewards, (std::vector<double>{1, 2}));
  EXPECT_EQ(c.restarts(), 1);

  const std::string bad = script("bad.sh", "#!/bin/sh\nwhile read l; do echo oops; done\n");
  RewardProgram m(program_options(bad, 10, false));
  b = m.score(requests(3));
  EXPECT_EQ(b.failures, 3);
  EXPECT_NE(b.errors[0].find("malformed reply 'oops'"), std::string::npos) << b.errors[0];

  const std::string slow = script("slow.sh", "#!/bin/sh\nread a; echo 1; sleep 30\n");
  RewardProgram s(program_options(slow, 0.5, false));
  const auto t = std::chrono::steady_clock::now();
  b = s.score(requests(3));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  EXPECT_LT(secs, 3.0) << "the deadline did not hold";
  EXPECT_EQ(b.rewards, (std::vector<double>{1, 0, 0}));
  EXPECT_NE(b.errors[1].find("no reply within"), std::string::npos) << b.errors[1];

  RewardProgram strict(program_options(bad, 10, true));
  expect_error([&] { strict.score(requests(2)); }, "sample 0: malformed reply 'oops'");
}

TEST(Rewards, MissingOrNonExecutableProgramsAreRefusedUpFront) {
  expect_error(
      [] {
        RewardProgram p(program_options("/nonexistent/reward.py --x", 10, false));
      },
      "reward program '/nonexistent/reward.py' does not exist");
  const std::string plain = test::tmp_path("rewards", "plain.txt");
  std::ofstream(plain) << "not a program\n";
  ::chmod(plain.c_str(), 0644);
  expect_error([&] { RewardProgram p(program_options(plain, 10, false)); }, "is not an executable file");
  expect_error([] { RewardProgram p(program_options("no-such-reward-program-xyz", 10, false)); }, "is not an executable on PATH");
}
