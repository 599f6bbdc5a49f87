// What a grpo run's checkpoint records beside the training state (train/checkpoint.h): the reference
// model's fingerprint, so that a resume can tell the initial model changed, and the command line less
// the options a resume may change.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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
// whose manifest verifies (train/checkpoint.h), or none (dir "": a fresh run, said in the log); an error
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

}  // namespace mt::rl
