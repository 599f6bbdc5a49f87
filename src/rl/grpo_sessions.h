// The models of a GRPO / PPO run: the policy (with its AdamW, no weight decay), the frozen reference and PPO's
// critic (the policy's architecture with a scalar head, started from the policy's body), on one distributed
// context laid out alike; for a resume, the policy's and the critic's masters, moments and counters restored.
// A LoRA policy (SessionOptions::lora) trains adapters on its frozen base and is its own reference (the base
// with the adapters off): no second model.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "rl/grpo.h"
#include "rollout/engine.h"
#include "train/session.h"

namespace mt::rl {

struct GrpoSessionPlan {
  std::string model_dir;         // the initial model: the policy's start and the reference
  int64_t preset_seed = -1;      // >= 0: model_dir is a preset, initialised at this seed (no directory)
  int64_t prompts_per_step = 1;  // must split evenly over the data-parallel ranks (checked before any load)
  bool reference = true, critic = false;
  uint64_t critic_seed = 0;               // the critic's head (its body is the policy's)
  std::string resume_dir;                 // "" for a fresh run
  const nlohmann::json* state = nullptr;  // the checkpoint's train_state.json when resuming
};

// The options a model must support, checked before any weight is read: the load-balancing loss needs
// output_router_logits in its config.json, router options need MoE layers, and the built-in task needs the
// char tokenizer's vocabulary. Errors name the option and the model directory.
void check_grpo_model(const ModelConfig& cfg, const GrpoOptions& o, const std::string& model_dir, bool builtin_task);

struct GrpoSessions {
  std::unique_ptr<TrainSession> policy, reference, critic;  // reference and critic may be null
  double restore_s = 0;                                     // the resume's reading of the training state
  bool lora_reference = false;  // a LoRA policy (SessionOptions::lora) is its own reference: its base
  // The session the reference's log-probs come from: the frozen copy, the LoRA policy itself, or null.
  TrainSession* reference_session() const { return reference ? reference.get() : lora_reference ? policy.get() : nullptr; }
};

GrpoSessions make_grpo_sessions(const ModelConfig& cfg, SessionOptions so, const GrpoSessionPlan& plan);

// The rollout engine of a run. Under tp or sp it runs on a one-device copy of the policy's weights
// (TpGenerator), refreshed before each round (o.before_generate, set here) and each evaluation; under tp
// without routing replay (o.replay_routing turned off here). Else on the policy, ep ranks in lockstep. The
// KV cache holds the larger of a step's rollouts (prompts x n) and `eval_count` greedy evaluation prompts, of
// up to `longest_prompt` + o.max_new_tokens tokens.
class GrpoEngine {
 public:
  GrpoEngine(TrainSession& policy, GrpoOptions& o, int64_t prompts_per_step, int64_t longest_prompt,
             int64_t eval_count);
  RolloutEngine& engine() { return *engine_; }
  std::unique_ptr<TpGenerator> tp_copy;  // null unless tp or sp

 private:
  std::unique_ptr<RolloutEngine> engine_;
};

}  // namespace mt::rl
