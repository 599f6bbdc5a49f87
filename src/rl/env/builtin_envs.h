// The built-in environments of `moetrain grpo --env builtin:NAME`, on the demo model's addition problems
// (data/synthetic.h: <bos> a + b = rev(c) <eos>, its char vocabulary, no HF tokenizer). They speak text in
// that vocabulary, the special tokens by their names ("<bos>", "<eos>"), which DemoCodec (rl/multiturn.h)
// turns into ids; an episode's prompt is a problem's prompt "<bos>A+B=".
//
// retry (SkyRL-Gym's multiply example, on addition): the model answers; right, the episode ends with reward
//   1. Wrong, the environment asks again by appending the problem once more, "<bos>A+B=" (preceded by
//   "<eos>" when the answer was cut before its own): the layout of the demo's packed training rows, where a
//   problem follows the previous one's <eos>, so the second attempt reads as the model's own data with the
//   failed attempt in its context. The second answer ends the episode: 0.5 when right, else 0.
//   Step metadata: first_try_correct (turn 0, 0/1) and second_try_correct (turn 1, 0/1): averaged over the
//   steps that report them, the first-try success rate over every episode and the second-try success rate
//   over the episodes that got a second try.
// calculator: a tool for the sum. The model may answer at once (a reversed sum then <eos>), or call the tool
//   by answering "?" <eos> (the '?' token: in the vocabulary, never in the demo's data): the environment then
//   appends "<bos>A+B=" followed by the sum reversed, then "<eos><bos>A+B=", so the problem's solved form sits
//   in the context and the model answers the problem again. The final answer (the first turn that is not a
//   call, or the turn after a call) scores 1 when right, else 0. A call after a call ends the episode with 0.
//   Step metadata: tool_call (turn 0, 0/1: the tool's use rate), correct (the final turn, 0/1).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "rl/env/environment.h"

namespace mt::rl {

// The names `--env builtin:NAME` accepts.
std::vector<std::string> builtin_env_names();
// An error naming the value and the allowed names when `name` is not one of them.
std::unique_ptr<Environment> make_builtin_env(const std::string& name);

// The reward of a right answer at the first and the second try of `retry`.
constexpr double kRetryFirstReward = 1.0, kRetrySecondReward = 0.5;

}  // namespace mt::rl
