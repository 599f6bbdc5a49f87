// Multi-turn rollouts against an Environment (rl/env/environment.h; docs/rl.md "Multi-turn GRPO"): each
// request's n samples are n episodes (ids unique in the run); init's observations are appended to the
// prompt before the first turn; then the engine generates with a turn callback (RolloutEngine::generate's
// TurnFn): every model turn that ended is decoded (TurnCodec), its tool call parsed when the codec has a
// parser, and the batch goes to env.step; each episode's observations are tokenised and appended, or the
// episode stops (done, an error, or the turn limit). Turns the callback never saw (the response limit cut
// them) are stepped after generation, so every model turn has its reward. close() for every episode at the
// end, also on an error.
//
// Rewards: each env step's reward is its turn's. The episode's reward, by default (TurnCredit::Final), is
// the reward of its last step, given to every model token of the episode (GRPO's outcome advantages over
// the group's episodes); TurnCredit::PerTurn gives each turn's tokens the return of its turn (the sum of the
// rewards of that step and the later ones) normalised over the group's turns (advantages.h turn_advantages);
// TurnCredit::PerTurnIndex normalises turn k's return over the group's turns k only (a second try against the
// other second tries).
// The error policy (--reward-on-error): an env error (a failed init or step, results of the wrong count)
// zeroes the episode's every turn reward and ends it (counted in the round's errors, the first message
// logged), or with stop_on_error throws naming the episode.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "rl/env/environment.h"
#include "rl/multiturn_codec.h"
#include "rollout/engine.h"

namespace mt::rl {

enum class TurnCredit { Final, PerTurn, PerTurnIndex };
// "final" | "per-turn" | "per-turn-index"; else an error naming them.
TurnCredit parse_turn_credit(const std::string& s);
const char* turn_credit_name(TurnCredit c);
// Whether the advantages come from the turns' returns (per-turn and per-turn-index), not the episode's reward.
inline bool per_turn_credit(TurnCredit c) { return c != TurnCredit::Final; }

struct MultiTurnOptions {
  int64_t max_turns = 2;                // model turns per episode (>= 1)
  int64_t max_turn_tokens = 0;          // tokens per model turn; 0: the response limit only
  int64_t max_observation_tokens = 64;  // tokens per step's observations (>= 1); longer: an env error
  TurnCredit credit = TurnCredit::Final;
  bool stop_on_error = false;  // an env error throws (--reward-on-error stop) instead of zeroing the episode
};
void validate(const MultiTurnOptions& o);  // errors name the field, its value and what is allowed

// One episode (one sample of one request) after generation.
struct EpisodeResult {
  int64_t id = 0;
  std::vector<double> turn_rewards;      // one per model turn, in order (zeros after an error)
  std::string error;                     // the env error that ended it; empty: none
  bool done = false;                     // the environment ended it (false: a limit did)
  int64_t observation_tokens = 0;        // appended by the environment (init's included)
  std::vector<nlohmann::json> metadata;  // the steps' metadata, one per model turn
  // The reward under TurnCredit::Final: the last turn's (0 without a turn).
  double final_reward() const { return turn_rewards.empty() ? 0.0 : turn_rewards.back(); }
};

struct MultiTurnRound {
  std::vector<GeneratedSample> samples;  // the engine's, by (prompt, sample); model_mask and turn_starts set
  std::vector<EpisodeResult> episodes;   // the same order
  int64_t errors = 0;
  std::string first_error;
  // The numeric fields of the steps' metadata: sum and count per name (a mean over the steps reporting it).
  std::map<std::string, std::pair<double, int64_t>> env_metrics;
};

// Runs the episodes of `requests` (their prompts are extended in place by init's observations, which the n
// episodes of one request must share: they share its prompt). Episode ids are first_id, first_id + 1, ... in
// (request, sample) order. Each request gets the turn limits of `o` (GenerateRequest::max_turns, ...).
// metadata: empty, or per request the prompt's metadata (EnvEpisode::metadata of its episodes).
MultiTurnRound run_episodes(RolloutEngine& engine, std::vector<GenerateRequest>& requests, Environment& env,
                            const TurnCodec& codec, const MultiTurnOptions& o, int64_t first_id,
                            const std::vector<nlohmann::json>& metadata = {});

// Greedy episodes (temperature 0, one per prompt) on held-out prompts: the share that succeeded (final
// reward > 0), the mean final reward, and the environment's metadata means (e.g. retry's first- and
// second-try success), through run_episodes. Episode ids start at first_id.
struct EpisodeEval {
  int64_t episodes = 0, errors = 0;
  double success = 0, reward_mean = 0;
  std::map<std::string, double> env_metrics;
};
EpisodeEval evaluate_episodes(RolloutEngine& engine, Environment& env, const TurnCodec& codec,
                              const std::vector<std::vector<int32_t>>& prompts, const MultiTurnOptions& o,
                              int64_t max_new_tokens, const std::vector<int32_t>& stop_token_ids, int64_t first_id);

// The model turn of every response token (by turn_starts), for the per-turn advantages; observation tokens
// get the turn they follow.
std::vector<int64_t> token_turns(const GeneratedSample& s);

}  // namespace mt::rl
