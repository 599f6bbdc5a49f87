// `moetrain _selftest rl` (hidden): the RL update on fixed rollouts under any layout, for the layout tests.
// Every rank builds the same synthetic rollouts from --seed (prompts, responses, engine log-probs around
// log(1/V), rewards, the routing record to replay), runs grpo_update (GRPO, or PPO with a critic initialised
// from the policy), and rank 0 writes --out: the loss and metrics and every gradient of the last optimizer
// step (`grad.<name>`, gathered; the critic's `grad.critic.<name>`), and --params-out: every weight after
// the update (`param.<name>`, `param.critic.<name>`). One process and `moetrain launch ... --dp-shard 2` (or --ep,
// --tp, --dp-replicate) must write the same file within DESIGN's layout tolerance.
// The `_selftest rl` command parses the options.
#pragma once
#include <cstdint>
#include <string>

#include "parallel/mesh.h"
#include "rl/policy_loss.h"

namespace mt::rl {

struct RlSelftestOptions {
  std::string model_dir, out_path;
  std::string params_path;         // "": the weights after the update are not written
  std::string algorithm = "grpo";  // grpo | ppo (a critic initialised from the policy)
  PolicyLoss loss = PolicyLoss::PpoClip;
  int64_t groups = 4, n = 4;  // prompts, samples per prompt
  int64_t micro_batch_samples = 3, mini_batches = 2, epochs = 1;
  double kl_coef = 0.05, lr = 1e-3, aux_loss_coef = 0, router_z_loss_coef = 0;
  bool replay = true;  // replay the rollouts' routing record
  bool freeze_router = false;
  bool generate = false;  // the whole step: the engine samples from the fixed prompts, rewarded by even tokens
  uint64_t seed = 5;
  MeshSpec mesh;  // the layout under `moetrain launch`
};

int run_rl_selftest(const RlSelftestOptions& o);  // the exit status

}  // namespace mt::rl
