// One GRPO step: prompts -> n samples each through the engine (the session's weights, no
// copy) -> the caller's rewards (+ DAPO's soft overlong penalty) -> dynamic sampling (groups whose rewards
// are all equal dropped and more prompts drawn, up to a cap on generate rounds) -> group-relative
// advantages -> the trainer's old log-probs (and the frozen reference's) with the recorded routing
// replayed, once, before the first epoch -> `epochs` passes over `mini_batches` mini-batches, each one
// optimizer step through TrainSession::train_step over its micro-batches (gradient accumulation) with
// PolicyObjective -> the engine reads the new weights at its next call.
// Sampling at temperature T: the trainer's head divides the logits by the same T
// (PassOptions::temperature), so the ratios compare the same distributions. docs/rl.md "One step".
// PPO (a critic session given): the critic's values of the rollout tokens before the update, GAE(gamma,
// lambda) advantages (whitened over the step) and returns from token rewards, the policy update as above
// with those per-token advantages, then the critic's own update (its AdamW, lr critic_lr) on the returns
// with the clipped value loss, over the same epochs and mini-batches. docs/rl.md "PPO with a critic".
//
// Several ranks (docs/rl.md "Several ranks"): every rank draws the same global prompt list and
// generates and rewards its data-parallel share (whole groups, so group statistics stay local to the
// data); one all-gather of the round's samples and rewards then gives every rank the same global round,
// and everything after it (metrics, dynamic sampling's decision, advantages, the mini- and micro-batches
// and their normalisers) is computed from identical data on every rank, the world-size-1 code. The
// update hands train_step global micro-batches (padded with empty rows to a multiple of the data-parallel
// size); the log-prob and value forwards run on each rank's rows and are all-gathered. So the same
// rollouts give the same loss and gradients under every layout, and no rank can take a branch another
// does not. Layouts: FSDP, HSDP, ep, tp and sp, alone or combined (tp and sp generate on a TpGenerator copy).
#pragma once
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "rl/advantages.h"
#include "rl/multiturn.h"
#include "rl/policy_loss.h"
#include "rl/rollout_batch.h"
#include "rollout/engine.h"
#include "train/session.h"

namespace mt::rl {

// Process rewards: one per response token of every sample of one generate round (the engine's order).
using TokenRewardFn = std::function<std::vector<std::vector<double>>(const std::vector<GenerateRequest>&,
                                                                     const std::vector<GeneratedSample>&)>;

struct GrpoOptions {
  // The defaults are `moetrain grpo`'s recipe (docs/rl.md "Measured"); the command takes them from here.
  int64_t n = 8;  // samples per prompt (>= 2)
  int64_t max_new_tokens = 16;
  SamplingParams sampling;  // temperature > 0 (the trainer's log-probs use the same T); seed set per prompt
  std::vector<int32_t> stop_token_ids;
  bool normalize_std = true;  // false: Dr. GRPO
  // Process supervision (advantages.h, process_advantages): a reward per response token, in the engine's
  // order. Set: token advantages from these (the outcome reward still gives the reward metrics), and a
  // group is "zero variance" for dynamic sampling when all its step rewards are equal. Empty: outcome GRPO.
  TokenRewardFn token_reward;
  // With token_reward: position_advantages (each token against the group's same position) instead of
  // process_advantages.
  bool per_position = false;
  PolicyLossConfig loss;  // kl_coef > 0 needs the reference session  // KL in the reward instead of (or besides) the
                          // loss term: each response token's reward gets
  // -kl_reward_coef k(old, ref) (the estimator loss.kl) before the advantages (GRPO: summed into the sample's
  // reward; process rewards and PPO's token rewards: per token). Needs the reference; 0: off.
  double kl_reward_coef = 0;

  LossAggregation aggregation = LossAggregation::TokenMean;
  // Rollout/trainer mismatch corrections on each token's weight (policy_loss.h minibatch_weights: TIS at token
  // or sequence level, token and sequence masks, a masked token in no denominator; all off by default).
  MismatchConfig mismatch;
  double lr = 2e-4;
  bool replay_routing = true;  // R3: the update uses the experts the engine chose
  // With replay: every this many steps (0: never) the old log-probs are also computed with the trainer's
  // own routing, for GrpoMetrics::logprob_diff_*_no_replay (one extra forward per micro-batch that step).
  int64_t mismatch_every = 10;
  uint64_t seed = 0;
  double correct_reward = 1.0;  // a sample whose reward reaches this counts as correct (metrics only)
  // Dynamic sampling (DAPO): keep only groups whose rewards are not all equal and draw `groups` more
  // prompts per round until the step has `groups` of them, at most max_generate_rounds rounds (then the
  // step trains on what it has; with none, the update is skipped).
  bool dynamic_sampling = true;
  int64_t max_generate_rounds = 4;
  // Overlong filtering: samples cut at max_new_tokens (finish "length") get token weight 0.
  bool overlong_filter = false;
  // DAPO's soft overlong penalty added to the reward (shaping.h): 0 = off; needs 1 <= buffer <= max_new_tokens.
  double overlong_penalty = 0;
  int64_t overlong_buffer = 0;
  // The update: `epochs` passes over the step's samples, split into `mini_batches` mini-batches of whole
  // groups (one optimizer step each), each in micro-batches of micro_batch_samples samples (0: one).
  int64_t epochs = 1, mini_batches = 1, micro_batch_samples = 0;
  // On-policy updates (one epoch of one mini-batch, no KL in the reward, no mismatch correction) take the
  // update's own log-probs, detached, as the old ones (PolicyObjective's on_policy): the same values the
  // trainer's forward before the update would give, without that forward. true: run it anyway (the A/B).
  bool old_logprob_forward = false;
  // The rollout's log-probs are the trainer's, bit for bit (the batch-invariant mode, core/determinism.h:
  // `--true-on-policy`): an update that is not on-policy (several epochs or mini-batches, the KL in the reward)
  // takes them as its old log-probs too, with no forward before it; the entropy and reference-KL metrics come
  // from the first epoch's update passes, the mismatch from its first mini-batch (0 by construction).
  bool rollout_logprobs_exact = false;
  // PPO (grpo_step's `critic`): token rewards r_t are the process rewards of token_reward when set, else
  // the outcome reward on the last response token; GAE(gamma, lam) over them with the critic's values
  // (0 after the last token); advantages whitened (mean 0, std 1) over the step's trained tokens; the
  // critic's clipped value loss with value_clip (<= 0: unclipped) at lr critic_lr.
  double gamma = 1.0, lam = 0.95, value_clip = 0.2, critic_lr = 5e-4;
  // MoE routers during the update: the load-balancing loss and the router z-loss as extra terms of the
  // policy's loss (0: off, the default; the aux loss needs the model's output_router_logits), and the routers
  // frozen (their gradients zeroed, their weights unchanged by the step).
  double aux_loss_coef = 0, router_z_loss_coef = 0;
  bool freeze_router = false;
  // During the update, a progress line (micro-batch k/K, ETA) at most this often (seconds; 0: never).
  double progress_every_s = 0;
  // Called on every rank before each generate round, its seconds added to weight_sync_s: the refresh of a
  // generator copy (TpGenerator::refresh), which generation under tp needs.
  std::function<double()> before_generate;
  // Multi-turn (rl/multiturn.h, docs/rl.md "Multi-turn GRPO"): with an environment each sample is an episode
  // of model turns and appended observations, its rewards the environment's (the RewardFn is not called);
  // the observation tokens are read by every forward and trained on by none. max_new_tokens caps the whole
  // response (turns and observations). Not with token_reward, a critic or several ranks.
  Environment* env = nullptr;
  TurnCodec codec;  // the environment's text <-> the model's tokens
  // The round's prompt k's metadata for its episodes (EnvEpisode::metadata; e.g. a prompt line's "answer");
  // unset: none.
  std::function<nlohmann::json(int64_t k)> episode_metadata;
  MultiTurnOptions multi_turn;
};
void validate(const GrpoOptions& o);  // errors name the field, its value and what is allowed
// A sparse layer's router (`model.layers.L.mlp.gate.weight`): what freeze_router holds fixed.
bool is_router_weight(const std::string& name);

struct GrpoMetrics {
  // Over every sample generated this step (all rounds), before filtering.
  double reward_mean = 0, reward_std = 0, reward_max = 0;
  // Fractions of the groups: with a sample of reward > 0; with a correct sample (reward >= correct_reward);
  // whose rewards are all equal.
  double groups_with_reward = 0, groups_correct = 0, groups_zero_variance = 0;
  // Response tokens per sample: mean, min and max; the share of samples cut at max_new_tokens; the mean length
  // of the samples that ended at a stop token (0: none did).
  double response_len_mean = 0, response_len_min = 0, response_len_max = 0;
  double overlong_fraction = 0, response_len_terminated_mean = 0;
  int64_t generate_rounds = 0, groups_generated = 0, groups_kept = 0;
  // The update, over the kept samples (averaged over the optimizer steps where it says so).
  int64_t updates = 0, micro_batches = 0;
  double loss = 0, policy_loss = 0, kl_loss = 0;  // mean over the optimizer steps
  double grad_norm = 0, grad_norm_max = 0;        // mean and max over the optimizer steps
  // Fractions / mean over the trained tokens (weight != 0) of every epoch's optimizer steps: the PPO clip took
  // the clipped term with the ratio below 1 - eps_low (A < 0) or above 1 + eps_high (A > 0), region either of
  // the two (the sides exclude each other, so region = low + high); the dual clip's bound -c A took the loss
  // (A < 0, ratio > c; in none of the three). Approximate KL: mean of old - logp.
  double clip_low = 0, clip_high = 0, clip_region = 0, clip_dual = 0, approx_kl = 0;
  double ref_kl = 0;  // mean over response tokens of k(old, ref) before the update (0 without a reference)
  // With a KL loss term (loss.kl_coef > 0): mean of k(logp, ref) over the trained tokens of every epoch, the
  // current policy's during the update (TRL's `kl`); 0 without one.
  double ref_kl_update = 0;
  double kl_reward = 0;  // with kl_reward_coef: mean over response tokens of the reward's -coef k(old, ref)
  double entropy = 0;    // mean over response tokens of the tempered distribution's entropy, before the update
  double advantage_mean = 0, advantage_std = 0;  // over the kept samples' response tokens
  // Rollout vs trainer log-probs of the sampled tokens (the trainer's before the update), over the kept
  // samples' response tokens (before any mismatch mask or cap): |old - rollout| and the importance ratio
  // exp(old - rollout).
  double logprob_diff_mean = 0, logprob_diff_max = 0;
  double importance_weight_mean = 0, importance_weight_min = 0, importance_weight_max = 0;
  double masked_fraction = 0;  // response tokens given weight 0 by the mismatch masks
  // The same with the trainer's own routing instead of the replay (the mismatch replay removes), on steps
  // where GrpoOptions::mismatch_every says so; -1 on the others and without replay.
  double logprob_diff_mean_no_replay = -1, logprob_diff_max_no_replay = 0;
  // Throughput per phase (0 where the phase did not run): generated tokens / generate_s; the others count the
  // sequences' prompt + response tokens (no padding) through the phase's forwards or train_steps, every epoch,
  // over its seconds: the old log-probs (with the no-replay check's extra forward), the reference's, the update,
  // the critic's values and its update.
  double rollout_tokens_per_s = 0, logprob_tokens_per_s = 0, ref_logprob_tokens_per_s = 0;
  double train_tokens_per_s = 0, critic_values_tokens_per_s = 0, critic_update_tokens_per_s = 0;
  // PPO's critic: value loss (mean over its optimizer steps), values and explained variance
  // 1 - Var(R - V) / Var(R) of the returns by the values before the update, the fraction of tokens on the
  // clipped side at its bound, the critic's gradient norm and update time.
  double value_loss = 0, value_mean = 0, explained_variance = 0, value_clip_frac = 0, critic_grad_norm = 0;
  double critic_update_s = 0, critic_value_s = 0;
  double generate_s = 0, reward_s = 0, logprob_s = 0, ref_logprob_s = 0, update_s = 0, weight_sync_s = 0;
  // Multi-turn (over every episode generated this step): model turns and observation tokens per episode, the
  // episodes an environment error ended (reward 0) and those a limit ended before the environment said done,
  // and the mean of each numeric field of the environment's step metadata over the steps reporting it (e.g.
  // retry's first_try_correct). Empty / 0 without an environment.
  double turns_mean = 0, observation_tokens_mean = 0, env_error_fraction = 0, episodes_cut_fraction = 0;
  int64_t env_errors = 0;
  std::map<std::string, double> env_metrics;
};
// The record as metrics.jsonl writes it (every field above by its name, the phases' seconds under "time_s";
// the loop adds step, lr and elapsed_s) and the log's one line for step `step` of `steps` (the reference's and
// the critic's parts only when the run has them).
nlohmann::json to_json(const GrpoMetrics& m);
std::string step_line(const GrpoMetrics& m, int64_t step, int64_t steps, bool with_reference, bool with_critic);
// The recipe in words for a run's first log line: lr, temperature, the advantages, the aggregation, dynamic
// sampling, the reference, PPO's critic settings.
std::string recipe_text(const GrpoOptions& o, bool ppo, bool process, bool per_position, const std::string& aggregation,
                        bool with_reference, bool with_critic);

// The rewards of every sample of one generate round, in the engine's order (prompt, then sample).
using RewardFn =
    std::function<std::vector<double>(const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>&)>;
// `count` new prompts (a round of generation).
using PromptFn = std::function<std::vector<std::vector<int32_t>>(int64_t count)>;

// `step` seeds the draws (each prompt's seed mixes it with the prompt's index in the step). `groups`
// prompts per round and wanted in the update. Several ranks: `prompts(groups)` must return the same list on
// every rank (the same seed, the same file position); each data-parallel rank generates its contiguous
// share of groups / dp prompts (groups must divide by dp) and calls `reward` (and token_reward) on its own
// samples only: the requests are the round's whole list and each sample's prompt_index indexes it, as in
// one process; the engine must step in lockstep over the ep group
// (EngineOptions::lockstep = dist().ep()). The session needs an optimizer; the engine must record
// routing when replay_routing. `reference`: a frozen session (SessionOptions::weights = Frozen) with the
// initial weights, needed when loss.kl_coef > 0, else optional (then ref_kl is reported). `critic`: a
// value-head session (ModelConfig::value_head) with an optimizer: PPO with GAE instead of group advantages.
GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const PromptFn& prompts, int64_t groups,
                      const RewardFn& reward, const GrpoOptions& opt, int64_t step, TrainSession* reference = nullptr,
                      TrainSession* critic = nullptr);
// Generation under tensor parallelism: the engine runs on one device, so every rank keeps a one-device
// copy of the full weights (frozen, the global layout) and refresh() gathers them from the policy's shards
// (every tensor, collective over the world) before a rollout phase; every rank of a tp group then generates
// the same share, and grpo_step's exchange keeps one copy of it. Build the engine on model() (no lockstep:
// the copy holds every expert), set GrpoOptions::before_generate to refresh, replay_routing false (the
// tp model cannot replay). Costs a full copy of the weights per rank: a first version. A LoRA policy's copy
// holds its adapters too (whole on every rank, copied at each refresh) and its base, gathered once (frozen).
class TpGenerator {
 public:
  explicit TpGenerator(TrainSession& policy);
  Qwen3MoeModel& model() { return model_; }
  double refresh();  // seconds; collective
 private:
  TrainSession& policy_;
  Qwen3MoeModel model_;
  std::unique_ptr<LoraAdapters> lora_;  // a LoRA policy's adapters, attached to model_
  bool base_copied_ = false;
};

// PPO's critic from the policy: every weight but the head copied from `policy` (the same architecture),
// the scalar head score.weight set to zero (values start at 0), the compute copy
// refreshed. Several ranks: both sessions in the same layout; each rank copies its own shard. Errors name
// what differs (a critic without value_head, other shapes, other layouts).
void init_critic_from_policy(TrainSession& critic, TrainSession& policy);

// The rollouts of a step, as the update takes them: whole groups of n samples, group-major (the n samples
// of the first group, then the next), the same on every rank.
struct RolloutGroups {
  std::vector<RolloutSample> samples;  // prompt, response, the engine's log-probs, routing (empty: no replay)
  std::vector<double> rewards;         // one per sample (shaped)
  std::vector<std::vector<double>> token_rewards;  // empty, or one per response token of every sample
  std::vector<bool> truncated;                     // empty, or one per sample: cut at max_new_tokens (overlong_filter)
};

// The update half of grpo_step on given rollouts (advantages, old/reference log-probs, critic values,
// epochs x mini-batches of train_step): what the layout tests hold to one process, and where a caller with
// its own rollouts enters. Collective over the world; every rank must pass the same rollouts. Runs under
// FSDP, HSDP, ep, tp and sp. The generation metrics stay 0.
GrpoMetrics grpo_update(TrainSession& session, const RolloutGroups& rollouts, const GrpoOptions& opt, int64_t step,
                        TrainSession* reference = nullptr, TrainSession* critic = nullptr);

// The head's per-target rows (log-probs, entropies, values; PassOptions says which) of a micro-batch of whole
// sequences, every row on every rank: each data-parallel rank runs the forward on its rows, then the rows are
// gathered over the ranks. Host f32 [B S], the layout of a one-process forward. Collective over the world.
struct HeadRows {
  Tensor logp, entropy, value;
};
HeadRows forward_rows(TrainSession& session, const MicroBatch& whole, const PassOptions& po);

// The same prompts every round (tests, fixed prompt sets).
GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const RewardFn& reward, const GrpoOptions& opt, int64_t step, TrainSession* reference = nullptr,
                      TrainSession* critic = nullptr);

}  // namespace mt::rl
