// `moetrain grpo --env` and the multi-turn options (cli/commands/grpo_args.h) without starting a run: the
// built-in environments' defaults (an answer per turn, a problem per observation, the response room for both),
// and each refusal naming the option, its value and what is allowed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/commands/grpo_args.h"
#include "data/synthetic.h"
#include "parallel/launch_test_util.h"
#include "cli/grpo_args_test_util.h"
#include "test_util.h"

using namespace mt;

TEST(MultiTurnCli, BuiltinEnvironmentsSizeTheirTurnsAndResponse) {
  const GrpoArgs a = testutil::parsed_grpo_args({"--env", "builtin:retry"});
  EXPECT_EQ(a.env_builtin, "retry");
  EXPECT_EQ(a.o.multi_turn.max_turns, 2);
  EXPECT_EQ(a.o.multi_turn.max_turn_tokens, max_answer_tokens(3));  // 5
  EXPECT_EQ(a.o.multi_turn.max_observation_tokens, 6 * 3 + 8);
  EXPECT_EQ(a.o.max_new_tokens, 2 * 5 + 26);
  EXPECT_EQ(a.o.multi_turn.credit, rl::TurnCredit::Final);
  const GrpoArgs b = testutil::parsed_grpo_args({"--env", "builtin:calculator", "--max-turns", "3", "--turn-credit", "per-turn",
                             "--max-observation-tokens", "30", "--reward-on-error", "stop"});
  EXPECT_EQ(b.env_builtin, "calculator");
  // The calculator's own defaults: 4-digit operands (turns of max_answer_tokens(4) = 6), 150 steps.
  EXPECT_EQ(b.task.lo, 4);
  EXPECT_EQ(b.task.hi, 4);
  EXPECT_EQ(b.steps, 150);
  EXPECT_EQ(b.o.max_new_tokens, 3 * 6 + 2 * 30);
  const GrpoArgs c = testutil::parsed_grpo_args({"--env", "builtin:calculator", "--max-digits", "3", "--steps", "20"});
  EXPECT_EQ(c.task.lo, 1);
  EXPECT_EQ(c.task.hi, 3);
  EXPECT_EQ(c.steps, 20);
  const GrpoArgs d = testutil::parsed_grpo_args({"--env", "builtin:calculator", "--model", "M"});
  EXPECT_EQ(d.task.hi, 3);  // a model of the user's: the task's defaults
  EXPECT_EQ(d.steps, 1500);
  EXPECT_EQ(b.o.multi_turn.credit, rl::TurnCredit::PerTurn);
  EXPECT_TRUE(b.o.multi_turn.stop_on_error);
}

TEST(MultiTurnCli, RefusalsNameTheValue) {
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:chess"})
                .find("--env builtin:chess is unknown; the built-in environments are "
                      "builtin:retry and builtin:calculator"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "python3 env.py"}).find("--env 'python3 env.py' is unknown; use builtin:NAME"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "program:python3 env.py"}).find("runs on the prompts of --prompts FILE.jsonl"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "program: "}).find("--env program: needs a command"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--max-turns", "3"}).find("--max-turns sets a multi-turn episode; there is none without --env"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--turn-credit", "all"}).find("turn-credit"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--max-turns", "0"}).find("max-turns"), std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--reward", "exact"}).find("the environment gives the rewards"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--algorithm", "ppo"}).find("--env with --algorithm ppo"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--advantage", "position"}).find("--advantage position with --env"),
            std::string::npos);
  EXPECT_NE(testutil::grpo_args_error({"--env", "builtin:retry", "--prompts", "p.jsonl"}).find("drop --prompts"), std::string::npos);
}

// The real binary on the tiny golden model, one step against builtin:retry: the step line counts turns and
// the environment's metadata, and the run ends with the greedy episodes' line beside the exact match.
TEST(MultiTurnCli, OneStepAgainstRetryEndsWithTheEpisodesLine) {
  const mt::test::ShellRun r =
      mt::test::sh(mt::test::kMoetrainBin + " grpo --device cpu --model " + mt::test::kGoldens +
                   "/tiny --steps 1 --prompts-per-step 2 --n 2 --min-digits 1 --max-digits 2 --eval-problems 4 "
                   "--dynamic-sampling off --env builtin:retry --out-dir " +
                   mt::test::tmp_path("multiturncli", "retry"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("env builtin:retry: up to 2 turns, turn credit final"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" | turns "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("first_try_correct"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("grpo: env builtin:retry success "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("% on 4 held-out problems (greedy episodes; mean reward "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("grpo: exact-match "), std::string::npos) << r.out;
}

// --env program: examples/env_retry.py on a tiny text model (one SFT step from the preset, the test tokenizer):
// a wrong first answer hears "wrong, try again" (rendered as the chat's next user turn and tokenised), so every
// episode has two turns and observation tokens; the run ends with the greedy episodes' line.
TEST(MultiTurnCli, ProgramEnvironmentRunsTwoTurnEpisodes) {
  const std::string dir = mt::test::tmp_path("multiturncli", "program");
  const std::string src = MT_SOURCE_DIR;
  mt::test::ShellRun r =
      mt::test::sh(mt::test::kMoetrainBin + " sft --device cpu --model tiny --tokenizer " + src +
                   "/tests/assets/tokenizer/trained/tokenizer.json --data " + src +
                   "/examples/chat_small.jsonl --steps 1 --warmup-steps 0 --seq-len 64 --out-dir " + dir + "/sft");
  ASSERT_EQ(r.code, 0) << r.out;
  r = mt::test::sh(
      "printf '%s\\n' '{\"prompt\": \"What is 2 + 2?\", \"answer\": 4}' '{\"messages\": [{\"role\": "
      "\"user\", \"content\": \"What is 3 + 5?\"}], \"answer\": 8}' > " +
      dir + "/p.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " grpo --device cpu --model " + dir +
                   "/sft/checkpoint-1 --steps 1 --prompts-per-step 2 --n 2 --max-new-tokens 40 --max-turn-tokens 8 "
                   "--prompts " +
                   dir + "/p.jsonl --eval-prompts " + dir + "/p.jsonl --env program:\"python3 " + src +
                   "/examples/env_retry.py\" --run-dir " + dir + "/run");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" | turns 2 obs tokens "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" env errors 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("% on 2 held-out prompts (greedy episodes; mean reward "), std::string::npos) << r.out;
  // With --env the prompt lines need no "answer": the environment gives the rewards (here the test program's
  // reward, the turn's length).
  r = mt::test::sh("printf '%s\\n' '{\"prompt\": \"Say hi\"}' '{\"prompt\": \"Say bye\"}' > " + dir + "/q.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  r = mt::test::sh(mt::test::kMoetrainBin + " grpo --device cpu --model " + dir +
                   "/sft/checkpoint-1 --steps 1 --prompts-per-step 2 --n 2 --max-new-tokens 40 --max-turn-tokens 8 "
                   "--prompts " +
                   dir + "/q.jsonl --env program:\"python3 " + src + "/tests/assets/env/env_modes.py plain\" --run-dir " +
                   dir + "/run2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("; reward the environment's (--env)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" env errors 0"), std::string::npos) << r.out;
}
