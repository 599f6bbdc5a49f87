// A prompt file for RL (`moetrain grpo --prompts`): its prompts (rollout/prompts.h reads them) and the
// answers its reward needs, checked once before any work; the seeded sampler that walks it in epochs; and
// the rewards of a round's samples (exact match, the math checker, or an external program: rl/rewards.h).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/config.h"
#include "rl/rewards/rewards.h"
#include "rollout/engine.h"
#include "rollout/prompts.h"

namespace mt::rl {

// Environment: --env gives the rewards (its steps'); the lines need no "answer" and no reward program runs.
enum class FileReward { Exact, Math, Program, Environment };

struct PromptFile {
  std::string path;
  std::vector<Prompt> prompts;
  std::vector<std::string> answers;              // text answers (with a tokenizer)
  std::vector<std::vector<int32_t>> answer_ids;  // token-id answers (exact match without a tokenizer)
};
// Reads and checks every line (errors name the file and the line): room for max_new_tokens after each
// prompt, an answer of the kind the reward compares (text with a tokenizer, token ids without).
PromptFile load_prompt_file(const std::string& path, const ModelConfig& cfg, int64_t max_new_tokens,
                            const Tokenizer* tok, FileReward reward);

// Prompts drawn in epochs, each a permutation of the file seeded by (seed, epoch): the position (prompts
// drawn so far) is the whole state a checkpoint needs.
class PromptSampler {
 public:
  PromptSampler(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}
  int64_t next();
  int64_t position() const { return pos_; }
  void set_position(int64_t p) { pos_ = p; }

 private:
  int64_t size_;
  uint64_t seed_;
  int64_t pos_ = 0, epoch_ = -1;
  std::vector<int64_t> order_;
};

// The response without its final stop token (the EOS or a stop token, which the engine includes).
std::vector<int32_t> response_ids(const GeneratedSample& g);
// The text of ids, special tokens dropped; ids the tokenizer lacks (a padded vocabulary) have none.
std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids);

// The rewards of a prompt file's samples: `which[k]` is the file index of the round's prompt k.
struct FileRewarder {
  FileReward kind = FileReward::Exact;
  const Tokenizer* tok = nullptr;
  RewardProgram* program = nullptr;
  std::vector<double> operator()(const PromptFile& f, const std::vector<int64_t>& which,
                                 const std::vector<GeneratedSample>& gen) const;
};

// A prompt-file run's inputs, opened and checked before any weight is read: the model directory's
// tokenizer (when it has tokenizer.json), the training and held-out files (`eval_path` "": none), the reward
// program (started when the reward is Program: an error names a missing one) and the rewarder over them,
// and the chat template's end tokens the tokenizer has (besides the model's EOS) as extra stops. One log line
// says what was read. Not movable: the rewarder points at the tokenizer and the program.
struct PromptRun {
  std::optional<Tokenizer> tokenizer;
  PromptFile train, eval;
  std::unique_ptr<RewardProgram> program;
  FileRewarder rewarder;
  std::vector<int32_t> stop_token_ids;
};
std::unique_ptr<PromptRun> open_prompt_run(const std::string& train_path, const std::string& eval_path,
                                           const std::string& model_dir, const ModelConfig& cfg, int64_t max_new_tokens,
                                           FileReward reward, const RewardProgramOptions& program);

}  // namespace mt::rl
