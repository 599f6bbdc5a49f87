// The models of a GRPO / PPO run: the policy (with its AdamW, no weight decay), the frozen reference and PPO's
// critic (the policy's architecture with a scalar head, started from the policy's body), on one distributed
// context laid out alike; for a resume, the policy's and the critic's masters, moments and counters restored.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "train/session.h"

namespace mt::rl {

struct GrpoSessionPlan {
  std::string model_dir;         // the initial model: the policy's start and the reference
  int64_t prompts_per_step = 1;  // must split evenly over the data-parallel ranks (checked before any load)
  bool reference = true, critic = false;
  uint64_t critic_seed = 0;               // the critic's head (its body is the policy's)
  std::string resume_dir;                 // "" for a fresh run
  const nlohmann::json* state = nullptr;  // the checkpoint's train_state.json when resuming
};

struct GrpoSessions {
  std::unique_ptr<TrainSession> policy, reference, critic;  // reference and critic may be null
  double restore_s = 0;                                     // the resume's reading of the training state
};

GrpoSessions make_grpo_sessions(const ModelConfig& cfg, SessionOptions so, const GrpoSessionPlan& plan);

}  // namespace mt::rl
