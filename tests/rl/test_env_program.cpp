// The environment protocol over a child process (rl/env/env_program.h) and the reward program as its
// one-step case (rl/rewards/rewards.h), with real python3 programs (tests/assets/env/, examples/env_retry.py):
// replies in order and in reverse, a stray banner (an error quoting it, never a shift of later replies), a
// crash mid-batch and the restart, a missed deadline, malformed replies, a multi-turn episode, the old
// reward-program form with and without ids, and `moetrain grpo` ending non-zero when every sample failed.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <regex>
#include <thread>

#include "core/error.h"
#include "parallel/launch_test_util.h"
#include "rl/env/env_program.h"
#include "rl/rewards/rewards.h"
#include "rl/rl_test_util.h"

using mt::rltest::program_options;

using namespace mt;
using namespace mt::rl;

namespace {

const std::string kAssets = std::string(MT_SOURCE_DIR) + "/tests/assets/env/";

std::string env_cmd(const std::string& args) {
  return "python3 " + kAssets + "env_modes.py " + args;
}
std::string reward_cmd(const std::string& mode) {
  return "python3 " + kAssets + "reward_modes.py " + mode;
}

std::vector<EnvEpisode> episodes(std::vector<int64_t> ids, nlohmann::json metadata = nlohmann::json::object()) {
  std::vector<EnvEpisode> v;
  for (int64_t id : ids) v.push_back({id, "prompt " + std::to_string(id), nlohmann::json::array(), metadata});
  return v;
}

// Turn `turn` of each episode, its text `texts[i]`.
std::vector<EnvTurn> turns(std::vector<int64_t> ids, std::vector<std::string> texts, int64_t turn = 0) {
  std::vector<EnvTurn> v;
  for (size_t i = 0; i < ids.size(); ++i) {
    EnvTurn t;
    t.id = ids[i];
    t.turn = turn;
    t.text = texts[i];
    t.ids = {1, 2, 3};
    t.finish_reason = "stop";
    v.push_back(std::move(t));
  }
  return v;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST(EnvProgram, InitAndStepRepliesInOrder) {
  EnvProgram env({env_cmd("ordered"), 10, false, false});
  EXPECT_EQ(env.name(), "program:" + env_cmd("ordered"));
  const auto init = env.init(episodes({5, 6, 7}));
  ASSERT_EQ(init.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(init[i].observations.size(), 1u) << init[i].error;
    EXPECT_EQ(init[i].observations[0].role, "user");
    EXPECT_EQ(init[i].observations[0].content, "hello " + std::to_string(5 + i));
  }
  auto t = turns({5, 6, 7}, {"a", "bb", "ccc"}, 2);
  t[1].tool_call = ToolCall{"search", {{"q", "x"}}};
  const auto step = env.step(t);
  ASSERT_EQ(step.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(step[i].error, "");
    EXPECT_EQ(step[i].reward, double(i + 1));
    EXPECT_TRUE(step[i].done);
    EXPECT_EQ(step[i].metadata["turn"], 2);
  }
  EXPECT_EQ(step[1].metadata["tool"], "search");
  EXPECT_TRUE(step[0].metadata["tool"].is_null());
  env.close({5, 6, 7});
  EXPECT_EQ(env.tally().items, 3);  // episodes, each counted once over its calls
  EXPECT_EQ(env.tally().failures, 0);
  EXPECT_EQ(env.restarts(), 0);
}

TEST(EnvProgram, RepliesInReverseAreMatchedById) {
  EnvProgram env({env_cmd("reverse 4"), 10, false, false});
  const auto step = env.step(turns({10, 11, 12, 13}, {"a", "bb", "ccc", "dddd"}));
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(step[i].error, "");
    EXPECT_EQ(step[i].reward, double(i + 1));
  }
}

TEST(EnvProgram, StrayBannerIsAnErrorQuotingItAndShiftsNothing) {
  EnvProgram env({env_cmd("banner"), 10, false, false});
  const auto step = env.step(turns({1, 2, 3}, {"a", "bb", "ccc"}));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(step[i].error, "");
    EXPECT_EQ(step[i].reward, double(i + 1));
  }
  EXPECT_EQ(env.tally().stray_lines, 1);
  EXPECT_EQ(env.tally().failures, 0);
  EXPECT_TRUE(has(env.tally().first_error, "line 'loading...' is not JSON")) << env.tally().first_error;

  EnvProgram strict({env_cmd("banner"), 10, true, false});
  expect_error([&] { strict.step(turns({1}, {"a"})); }, "environment program: step: line 'loading...' is not JSON");
}

TEST(EnvProgram, CrashFailsTheUnansweredAndTheNextCallRestarts) {
  EnvProgram env({env_cmd("crash 2"), 10, false, false});
  auto step = env.step(turns({0, 1, 2, 3}, {"a", "bb", "ccc", "dddd"}));
  EXPECT_EQ(step[0].error, "");
  EXPECT_EQ(step[1].reward, 2.0);
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(step[i].error, "environment program exited with status 3");
    EXPECT_EQ(step[i].reward, 0.0);
  }
  EXPECT_EQ(env.tally().failures, 2);
  step = env.step(turns({4, 5}, {"a", "bb"}));  // started again
  EXPECT_EQ(step[0].error, "");
  EXPECT_EQ(step[1].reward, 2.0);
  EXPECT_EQ(env.restarts(), 1);
}

TEST(EnvProgram, TheDeadlineHoldsAndTheLateProgramIsRestarted) {
  EnvProgram env({env_cmd("slow"), 0.5, false, false});
  const auto t0 = std::chrono::steady_clock::now();
  auto step = env.step(turns({0, 1, 2}, {"a", "bb", "ccc"}));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 3.0) << "the deadline did not hold";
  EXPECT_EQ(step[0].reward, 1.0);
  EXPECT_EQ(step[1].error, "environment program: no reply within the call's 0.5 s deadline");
  EXPECT_EQ(step[2].error, step[1].error);
  step = env.step(turns({3}, {"dddd"}));
  EXPECT_EQ(step[0].error, "");
  EXPECT_EQ(step[0].reward, 4.0);
  EXPECT_EQ(env.restarts(), 1);
}

TEST(EnvProgram, MalformedRepliesNameTheLine) {
  EnvProgram env({env_cmd("malformed"), 10, false, false});
  const auto step = env.step(turns({0, 1}, {"a", "bb"}));
  EXPECT_EQ(step[0].error,
            "a second reply '{\"id\": 0, \"reward\": 1, \"done\": true, \"metadata\": {\"turn\": 0, \"tool\": null}}' "
            "for episode 0 in one step call");
  EXPECT_EQ(step[0].reward, 0.0);
  EXPECT_EQ(
      step[1].error,
      "reply '{\"id\": 1, \"reward\": 2, \"metadata\": {\"turn\": 0, \"tool\": null}}' for episode 1: no \"done\" "
      "(true or false)");
  EXPECT_EQ(step[1].reward, 0.0);
  EXPECT_EQ(env.tally().stray_lines, 1);  // the reply for episode 999, which is not in the call
  EXPECT_TRUE(has(env.tally().first_error, "id 999, which is no episode of this step call")) << env.tally().first_error;
  EXPECT_TRUE(env.tally().all_failed());
  EXPECT_TRUE(has(all_failed_message(env.tally(), "grpo: the environment program", "episode"),
                  "grpo: the environment program failed on every episode of the run: 2 of 2 in 1 call, so no reward "
                  "reached training; the first error: environment program: step: 2 of 2 episodes failed; episode 0: a "
                  "second reply"));
  expect_error([&] { env.step(turns({4, 4}, {"a", "b"})); }, "episode id 4 appears twice in one step call");
  expect_error(
      [] {
        EnvProgram e({"/no/such/env.py", 10, false, false});
      },
      "environment program '/no/such/env.py' does not exist");
  expect_error([] { EnvProgram e({env_cmd("ordered"), 0, false, false}); }, "the timeout (0 s) must be > 0");
}

TEST(EnvProgram, MultiTurnEpisodeRetriesOnce) {
  EnvProgram env({"python3 " + std::string(MT_SOURCE_DIR) + "/examples/env_retry.py", 10, false, false});
  const auto init = env.init(episodes({3, 10}));  // prompts "prompt 3", "prompt 10": no sum to answer
  ASSERT_EQ(init[0].observations.size(), 1u) << init[0].error;
  EXPECT_EQ(init[0].observations[0].content, "What is 8 + 7? Answer with the number.");
  EXPECT_EQ(init[1].observations[0].content, "What is 9 + 7? Answer with the number.");
  auto step = env.step(turns({3, 10}, {"It is 15.", "15"}));
  EXPECT_EQ(step[0].reward, 1.0);
  EXPECT_TRUE(step[0].done);
  EXPECT_TRUE(step[0].observations.empty());
  EXPECT_EQ(step[1].reward, 0.0);
  EXPECT_FALSE(step[1].done);
  ASSERT_EQ(step[1].observations.size(), 1u);
  EXPECT_EQ(step[1].observations[0].content, "wrong, try again");
  step = env.step(turns({10}, {"16"}, 1));
  EXPECT_EQ(step[0].reward, 0.5);
  EXPECT_TRUE(step[0].done);
  // The prompt line's answer, or the sum the prompt asks for: no question of its own; a wrong second answer
  // ends with 0.
  std::vector<EnvEpisode> given = episodes({20, 21}, {{"answer", 42}});
  given[1].prompt = "What is 20 + 3?";
  given[1].metadata = nlohmann::json::object();
  const auto ginit = env.init(given);
  EXPECT_TRUE(ginit[0].observations.empty() && ginit[1].observations.empty());
  step = env.step(turns({20, 21}, {"41", "23"}));
  EXPECT_FALSE(step[0].done);
  EXPECT_EQ(step[1].reward, 1.0);
  step = env.step(turns({20}, {"43"}, 1));
  EXPECT_EQ(step[0].reward, 0.0);
  EXPECT_TRUE(step[0].done);
  // Closed episodes are gone: the program's "error" reply is the episode's error.
  env.close({3, 10, 20, 21});
  step = env.step(turns({3}, {"10"}));
  EXPECT_EQ(step[0].error, "the program reported an error for episode 3: episode 3 was never started, or is closed");
  EXPECT_EQ(env.tally().failures, 1);
}

TEST(EnvProgram, ARewardProgramIsTheOneStepCase) {
  EnvProgram env({reward_cmd("ids_reverse"), 10, false, true});
  const auto init = env.init(episodes({7, 8, 9, 10}));
  for (const auto& r : init) EXPECT_TRUE(r.observations.empty() && r.error.empty());
  const auto step = env.step(turns({7, 8, 9, 10}, {"a", "bb", "ccc", "dddd"}));
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(step[i].error, "");
    EXPECT_EQ(step[i].reward, double(i + 1));
    EXPECT_TRUE(step[i].done);
  }
  EXPECT_EQ(env.step(turns({99}, {"x"}))[0].error, "reward program: episode 99 was never started with init");
}

namespace {

std::vector<RewardRequest> responses(std::vector<std::string> texts) {
  std::vector<RewardRequest> v;
  for (auto& t : texts) v.push_back({"p", t, nlohmann::json::object()});
  return v;
}

}  // namespace

TEST(RewardProgram, RepliesByOrderAndById) {
  RewardProgram order(program_options(reward_cmd("order"), 10, false));
  RewardProgram ids(program_options(reward_cmd("ids_reverse"), 10, false));
  for (int round = 0; round < 2; ++round) {
    for (RewardProgram* p : {&order, &ids}) {
      const RewardBatch b = p->score(responses({"a", "bb", "ccc", "dddd"}));
      EXPECT_EQ(b.rewards, (std::vector<double>{1, 2, 3, 4}));
      EXPECT_EQ(b.failures, 0);
      EXPECT_TRUE(b.stray.empty());
    }
  }
  EXPECT_EQ(order.restarts() + ids.restarts(), 0);
  EXPECT_EQ(ids.tally().items, 8);
}

TEST(RewardProgram, ABannerIsAStrayLineQuotedNotAShift) {
  for (const char* mode : {"order_banner", "ids_banner", "order_log"}) {
    const std::string line = mode == std::string("order_log") ? "line '{\"log\": \"starting\"}' is not a reply"
                                                              : "line 'loading...' is not JSON";
    RewardProgram p(program_options(reward_cmd(mode), 10, false));
    for (int round = 0; round < 2; ++round) {
      const RewardBatch b = p.score(responses({"a", "bb", "ccc"}));
      EXPECT_EQ(b.rewards, (std::vector<double>{1, 2, 3})) << mode;
      EXPECT_EQ(b.failures, 0) << mode;
      ASSERT_EQ(b.stray.size(), round == 0 ? 1u : 0u) << mode;  // the banner was no reply: no restart
      if (!b.stray.empty()) {
        EXPECT_TRUE(has(b.stray[0], line)) << b.stray[0];
      }
    }
  }
  RewardProgram strict(program_options(reward_cmd("ids_banner"), 10, true));
  expect_error([&] { strict.score(responses({"a"})); }, "reward program: line 'loading...' is not JSON");
}

TEST(RewardProgram, AGarbageReplyFailsItsSampleOnly) {
  const std::string sh = test::tmp_path("envprogram", "garbage.sh");
  std::ofstream(sh) << "#!/bin/sh\nread a; echo 1; read b; echo oops; read c; echo 3; while read d; do echo 4; done\n";
  std::filesystem::permissions(sh, std::filesystem::perms::owner_all);
  RewardProgram p(program_options(sh, 10, false));
  RewardBatch b = p.score(responses({"a", "b", "c"}));
  EXPECT_EQ(b.rewards, (std::vector<double>{1, 0, 3}));
  EXPECT_EQ(b.failures, 1);
  EXPECT_TRUE(has(b.errors[1], "malformed reply 'oops' where the reply for request id 1 was due")) << b.errors[1];
  b = p.score(responses({"a"}));  // started afresh: the order was in doubt
  EXPECT_EQ(b.rewards, (std::vector<double>{1}));
  EXPECT_EQ(p.restarts(), 1);
  EXPECT_EQ(p.tally().items, 4);
  EXPECT_EQ(p.tally().failures, 1);
}

TEST(RewardProgram, AProgramThatEndsBetweenBatchesIsStartedAgain) {
  const std::string sh = test::tmp_path("envprogram", "once.sh");
  std::ofstream(sh) << "#!/bin/sh\nread a; echo 1\n";
  std::filesystem::permissions(sh, std::filesystem::perms::owner_all);
  RewardProgram p(program_options(sh, 10, false));
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(p.score(responses({"a"})).rewards, (std::vector<double>{1}));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // it has exited by now
  }
  EXPECT_EQ(p.restarts(), 1);
  EXPECT_EQ(p.tally().failures, 0);
}

TEST(EnvProgram, GrpoRunWhoseEverySampleFailedExitsNonZero) {
  const std::string dir = test::tmp_path("envprogram", "allfail");
  std::ofstream(dir + ".jsonl") << "{\"prompt_ids\": [1, 2, 3]}\n{\"prompt_ids\": [7, 8]}\n";
  const test::ShellRun r = test::sh(test::kMoetrainBin + " grpo --device cpu --model " + test::kGoldens +
                                    "/tiny --steps 2 --prompts-per-step 2 --n 2 --max-new-tokens 4 --prompts " + dir +
                                    ".jsonl --reward 'program:" + reward_cmd("fail") + "' --run-dir " + dir);
  EXPECT_EQ(r.code, 1) << r.out;
  // Dynamic sampling draws again while every group's rewards are equal: more calls than steps.
  EXPECT_TRUE(std::regex_search(
      r.out,
      std::regex(R"(grpo: the reward program failed on every sample of the run: (\d+) of \1 in \d+ calls, so no )"
                 R"(reward reached training)")))
      << r.out;
  EXPECT_TRUE(has(r.out,
                  "the first error: reward program: 4 of 4 samples without a reward; sample 0: reward "
                  "program exited with status 2"))
      << r.out;
}
