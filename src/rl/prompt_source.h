// Where an RL run's prompts come from and how its samples are scored: the built-in addition task
// (rl/tasks/addition.h) or a prompt file (rl/prompt_file.h), behind one interface the loop uses. Each
// draws a round's prompts, scores that round's samples (and, for the task, each response token), evaluates
// greedily on its held-out set, and keeps its position in a checkpoint's state.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rl/prompt_file.h"
#include "rl/tasks/addition.h"
#include "rollout/engine.h"

namespace mt::rl {

class PromptSource {
 public:
  virtual ~PromptSource() = default;
  // The next `count` prompts; the rewards below score the samples of the last call's prompts.
  virtual std::vector<std::vector<int32_t>> draw(int64_t count) = 0;
  virtual std::vector<double> rewards(const std::vector<GeneratedSample>& g) = 0;
  // Per response token (process supervision); only the built-in task has them.
  virtual std::vector<std::vector<double>> token_rewards(const std::vector<GeneratedSample>& g) = 0;
  // The last call's prompt k's metadata (a prompt line's other fields; an object), which an environment's
  // episodes receive (EnvEpisode::metadata); the built-in task's problems have none.
  virtual nlohmann::json metadata(int64_t k) const {
    (void)k;
    return nlohmann::json::object();
  }
  // The greedy held-out score: percent right (exact, math), or the mean reward of a program.
  virtual double evaluate(RolloutEngine& engine) = 0;
  virtual bool has_eval() const = 0;
  virtual int64_t eval_size() const = 0;                  // held-out prompts
  virtual std::string eval_name() const = 0;              // "exact-match", "math", "program-reward"
  virtual std::string shown(double score) const = 0;      // "12.5%" or "0.4321"
  virtual std::string describe() const = 0;               // for the run's first log line
  virtual int64_t longest_prompt() const = 0;             // tokens, for the KV cache
  virtual void save(nlohmann::json& state) const = 0;     // the position: the fields a resume needs
  virtual void restore(const nlohmann::json& state) = 0;  // from a checkpoint's state
};

// The built-in task: training problems drawn from a generator seeded by `seed` (a resume replays its
// draws), `eval_n` held-out problems, the reward `kind`.
std::unique_ptr<PromptSource> addition_source(const addition::Task& task, int64_t eval_n, uint64_t seed,
                                              addition::Reward kind);
// A prompt file: drawn in seeded epochs (PromptSampler); the held-out file evaluated greedily with at most
// `max_new_tokens` and these stop tokens.
std::unique_ptr<PromptSource> file_source(const PromptRun& run, uint64_t seed, int64_t max_new_tokens,
                                          std::vector<int32_t> stop_token_ids);

}  // namespace mt::rl
