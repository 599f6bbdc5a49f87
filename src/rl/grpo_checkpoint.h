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

}  // namespace mt::rl
