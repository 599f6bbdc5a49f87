// Rewards for RL post-training (docs/rl.md "Rewards").
//
// Built-in checkers work on the response text:
//   exact match: the response, trimmed of surrounding whitespace, equals the answer (trimmed);
//   math: the response's final answer (the content of its last \boxed{...}, braces balanced, else the
//     last number in the text) is equivalent to the answer: both numbers (integers, decimals, fractions
//     a/b, thousands commas, a leading +, surrounding $) and equal within 1e-9 relative, else equal as
//     strings with whitespace and $ removed.
// An external reward program is started once and kept (rl/env/child_process.h): JSON lines over its
// stdin/stdout, one request line {"id": n, "prompt": ..., "response": ..., "metadata": {...}} per sample (n: its
// index in the batch), one reply line per request: {"id": n, "reward": number}, matched by id in any order,
// or (the older form) a number or {"reward": number} without an id, matched by order. It is the one-step case
// of the environment protocol (rl/env/env_program.h; docs/rl.md "Environments"). A batch has one deadline; a
// program that crashes or misses the deadline fails the samples it had not answered, a malformed reply fails
// its sample, and a line that is no reply is an error that quotes it, never a silent shift of later rewards
// (docs/rl.md "Rewards" says how the order-matched form tells a stray line from a reply gone wrong). Failed
// samples get reward 0 (or the call throws, RewardProgramOptions::stop_on_error); a dead or late program is
// restarted for the next batch, and nothing ever waits past the deadline.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rl/env/child_process.h"

namespace mt::rl {

double exact_match_reward(std::string_view response, std::string_view answer);

std::optional<std::string> extract_final_answer(std::string_view response);
bool answers_equivalent(std::string_view a, std::string_view b);
double math_reward(std::string_view response, std::string_view answer);

struct RewardRequest {
  std::string prompt, response;
  nlohmann::json metadata = nlohmann::json::object();
};

struct RewardProgramOptions {
  std::string command;    // run with /bin/sh -c; its first word must name an executable
  double timeout_s = 60;  // per batch
  bool stop_on_error = false;
  // In-process instead (the Python API's reward function; `command` then only names it in messages): one call
  // per batch, one reward per request. An exception, a result of the wrong count or a non-finite reward fails
  // the samples it concerns, with the same policy and tally as a program's failures; no deadline.
  std::function<std::vector<double>(const std::vector<RewardRequest>&)> function;
};

struct RewardBatch {
  std::vector<double> rewards;      // one per request; 0 where the program failed
  std::vector<std::string> errors;  // one per request; empty where the reward is the program's
  int64_t failures = 0;
  std::vector<std::string> stray;  // lines that were no reply to any request, each an error quoting it
};

class RewardProgram {
 public:
  // Checks that the command's program exists and is executable (an error naming it otherwise), then
  // starts it.
  explicit RewardProgram(RewardProgramOptions opt);
  ~RewardProgram();
  RewardProgram(const RewardProgram&) = delete;
  RewardProgram& operator=(const RewardProgram&) = delete;

  RewardBatch score(const std::vector<RewardRequest>& batch);
  int64_t restarts() const { return proc_ ? proc_->restarts() : 0; }
  // Every batch's failures and stray lines over the program's life.
  const FailureTally& tally() const { return tally_; }
  const std::string& command() const { return opt_.command; }

 private:
  RewardBatch score_function(const std::vector<RewardRequest>& batch);
  // The batch's failures into the tally, logged (or thrown under stop_on_error).
  void account(const std::vector<RewardRequest>& batch, RewardBatch& out);

  RewardProgramOptions opt_;
  std::unique_ptr<ChildProcess> proc_;  // null for an in-process function
  FailureTally tally_;
};

}  // namespace mt::rl
