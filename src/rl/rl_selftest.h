// `moetrain _selftest rl` (hidden): the RL update on fixed rollouts under any layout, for the layout tests.
// Every rank builds the same synthetic rollouts from --seed (prompts, responses, engine log-probs around
// log(1/V), rewards, the routing record to replay), runs grpo_update (GRPO, or PPO with a critic initialised
// from the policy), and rank 0 writes --out: the loss and metrics and every gradient of the last optimizer
// step (`grad.<name>`, gathered; the critic's `grad.critic.<name>`), and --params-out: every weight after
// the update (`param.<name>`, `param.critic.<name>`). One process and `moetrain launch ... --dp-shard 2` (or --ep,
// --tp, --dp-replicate) must write the same file within DESIGN's layout tolerance.
#pragma once
#include <string>
#include <vector>

namespace mt::rl {

int rl_selftest_main(const std::vector<std::string>& args);  // args after "rl"

}  // namespace mt::rl
