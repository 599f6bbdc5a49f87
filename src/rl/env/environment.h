// Environments for multi-turn RL (docs/rl.md "Environments"): an episode starts from a prompt, the policy
// acts in turns, and after each turn the environment answers with observations, a reward and whether the
// episode is done (SkyRL-Gym's BaseTextEnv: init(prompt) -> observation, step(action) -> observations,
// reward, done). Implementations: the built-in environments (rl/env/builtin_envs.h) and a child process
// speaking the JSON-lines protocol (rl/env/env_program.h), of which the single-turn reward program is the
// one-step case.
//
// Calls are batched: init and step take many episodes at once and return one result per input, in the
// input's order (an implementation over a process may receive the replies in any order: it matches them by
// episode id). A failed call for one episode is that result's `error` (non-empty), never an exception; the
// caller applies its policy (--reward-on-error: reward 0, or stop).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace mt::rl {

// A tool call parsed from the model's turn: Qwen3's <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
struct ToolCall {
  std::string name;
  nlohmann::json arguments = nlohmann::json::object();
};

// One episode as the environment first sees it.
struct EnvEpisode {
  int64_t id = 0;                                    // unique among the episodes in flight
  std::string prompt;                                // the prompt as text (the chat rendered, or the ids' decode)
  nlohmann::json messages = nlohmann::json::array();  // the prompt as chat messages, when it came as a chat
  nlohmann::json metadata = nlohmann::json::object();  // the prompt line's other fields
};

// A message the environment appends to the conversation: role "user" (feedback) or "tool" (a tool's result,
// rendered as a <tool_response> turn).
struct EnvObservation {
  std::string role = "user";
  std::string content;
};

struct EnvInitResult {
  std::vector<EnvObservation> observations;  // appended after the prompt before the first turn (may be none)
  std::string error;                         // non-empty: init failed for this episode
};

// The model's turn, as the environment receives it.
struct EnvTurn {
  int64_t id = 0;                // the episode
  int64_t turn = 0;              // 0 for the first model turn
  std::string text;              // the turn decoded (no end-of-turn token)
  std::vector<int32_t> ids;      // the turn's token ids (the end-of-turn token included when it was sampled)
  std::string finish_reason;     // "stop" or "length"
  std::optional<ToolCall> tool_call;  // parsed from text when it holds <tool_call>...</tool_call>
  std::string tool_call_error;        // the call was there but malformed: what was wrong (tool_call empty)
};

struct EnvStepResult {
  std::vector<EnvObservation> observations;  // appended before the model's next turn (none: done)
  double reward = 0;                         // this turn's reward
  bool done = true;
  nlohmann::json metadata = nlohmann::json::object();
  std::string error;  // non-empty: the step failed for this episode (the caller's error policy applies)
};

class Environment {
 public:
  virtual ~Environment() = default;
  virtual std::string name() const = 0;
  virtual std::vector<EnvInitResult> init(const std::vector<EnvEpisode>& episodes) = 0;
  virtual std::vector<EnvStepResult> step(const std::vector<EnvTurn>& turns) = 0;
  // The episodes are over (done, cut by a limit, or abandoned); their state may be dropped.
  virtual void close(const std::vector<int64_t>& ids) { (void)ids; }
};

}  // namespace mt::rl
