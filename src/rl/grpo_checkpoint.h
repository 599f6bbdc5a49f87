// A grpo run's checkpoints: written and found as every training command's (train/run_dir.h), with what a
// grpo run records beside the training state: the critic's state, the reference model's fingerprint, so that
// a resume can tell the initial model changed, and the command line less the options a resume may change.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/session.h"

namespace mt::rl {

// The model directory's files as they are: name, size and modification time of every regular file (cheap
// at any model size; a file rewritten in place changes its mtime).
nlohmann::json model_fingerprint(const std::string& dir);
// "" when `now` equals `saved`, else what changed (the first difference).
std::string fingerprint_change(const nlohmann::json& saved, const nlohmann::json& now);
// The command line a checkpoint records, less the options that may change between a save and its resume
// (saving, the device and the layout: the state is resharded on resume); --key=value read as --key value.
nlohmann::json recorded_args(const std::vector<std::string>& args);

// Where a grpo run resumes (--resume latest or a checkpoint directory): the newest checkpoint of run_dir
// whose manifest verifies (train/run_dir.h's resume_checkpoint, in each process: no session exists yet), or
// none (dir "": a fresh run, said in the log); an error
// when every checkpoint there is unusable, or the one found is not a grpo run's, started from another
// --model (when given), on the other kind of prompts (task / prompt file), or with(out) a critic other
// than --algorithm says. Other differences of the command line (`args`: recorded_args) are a warning.
struct GrpoResumePoint {
  std::string dir;        // the checkpoint, "" for none
  nlohmann::json state;   // its train_state.json
  std::string model_dir;  // the initial model the run started from
};
GrpoResumePoint find_grpo_resume(const std::string& run_dir, const std::string& resume, const std::string& model_dir,
                                 bool model_given, bool from_file, bool ppo, const nlohmann::json& args);

// Writes RUN_DIR/checkpoint-<step> with train/run_dir.h's save_checkpoint (committed by manifest and rename, then
// keep-last): the policy's HF weights and routing bias, `tokenizer_json` when given (a complete model directory),
// every rank's shard of the policy's training state, the critic's in critic/ (with its own train_state.json), and
// train_state.json: `state` (the run's own fields) with the optimizer counters and the layout added. Called on
// every rank; returns the checkpoint's directory.
std::string save_grpo_checkpoint(const std::string& run_dir, int64_t step, TrainSession& policy, TrainSession* critic,
                                 const std::string& tokenizer_json, nlohmann::json state, int64_t keep_last);

// The initial model's fingerprint; when resuming (`saved_state` the checkpoint's train_state.json), the
// recorded one, after checking the directory still matches it (an error says what changed: the initial model
// is the run's reference and start, so it must stay as it was).
nlohmann::json initial_model_fingerprint(const std::string& model_dir, const nlohmann::json* saved_state);

}  // namespace mt::rl
