// The built-in RL tasks of `moetrain grpo` on the demo's addition problems (data/synthetic.h): the task
// presets (--task) with their starting models, made when absent; the problems (training pairs never
// held out, held-out pairs only for evaluation); the rewards of a response; the greedy evaluation; and
// the supervised batches of the SFT baseline. docs/rl.md "moetrain grpo" has the recipes and their numbers.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/synthetic.h"
#include "model/micro_batch.h"
#include "rollout/engine.h"
#include "train/metrics.h"
#include "train/session.h"

namespace mt::rl::addition {

constexpr const char* kDemoModel = "runs/demo/checkpoint-2500";
constexpr const char* kStartRun = "runs/grpo-start";
// The early-stopped demo that `sharpen` starts from stops at the first evaluation reaching this (percent).
constexpr double kStartExactMatch = 20;

// A built-in task (--task). Each names its starting model and the recipe its numbers were measured with;
// any option given on the command line overrides the preset.
// sharpen (the default): the demo's own task (1..3-digit addition) from the demo recipe stopped early, at
//   the first evaluation that reaches kStartExactMatch: a model that solves the problems sometimes (pass@8
//   well above pass@1), which GRPO with a binary reward and outcome advantages makes reliable.
// extend: a fourth digit the demo was never trained on (pass@k = 0 for an exact answer), from the fully
//   trained demo, with a reward per right digit credited per position.
struct TaskPreset {
  std::string name;
  std::string start;  // a model directory, or (sharpen) the run directory of the early-stopped demo
  bool start_is_run = false;
  int lo = 1, hi = 3;
  bool longest = false;
  const char* reward = "exact";
  bool process = false, per_position = false;  // --advantage outcome | position
  float temperature = 1.0f;
  int64_t steps = 500;
};
TaskPreset task_preset(const std::string& name);  // "sharpen" | "extend"; else an error naming both

// The task's starting model directory: made when absent (the demo recipe, trained here as `moetrain train`
// would, under a lock file beside it, so runs started together make it once), then its newest checkpoint.
std::string ensure_task_start(const TaskPreset& t, const std::string& device_name);

// The start of `grpo --env builtin:calculator` (rl/env/builtin_envs.h): a model that sometimes calls the tool and
// can read its result, made when absent (under a lock, as ensure_task_start) in kCalculatorStartRun from the
// sharpen task's start, on kCalculatorDigits-digit problems (where a direct answer never succeeds, so a call
// pays): supervised steps of 32 rows at lr 3e-4 (AdamW 0.9 / 0.95, no decay, clip 1), first kCalculatorCopySteps
// whose every row is a call ("?" <eos>), the tool's result (no loss on either) and the answer read from it; then
// a mixture, a quarter of the rows such a call with the call in the loss and the rest plain answers, until the
// sampled first answers (T = 1, 64 problems x 4) are calls kCalculatorCallRate of the time (at most 300 steps).
// GRPO then learns when calling pays. Returns the start's checkpoint directory.
constexpr const char* kCalculatorStartRun = "runs/calculator-start";
constexpr int kCalculatorDigits = 4;
constexpr int64_t kCalculatorSteps = 150;  // grpo's steps on it unless --steps says otherwise
constexpr int64_t kCalculatorCopySteps = 600;
constexpr double kCalculatorCallRate = 0.2;
std::string ensure_calculator_start(const std::string& device_name);

// The making itself, from `base` into `run_dir` (its checkpoint-N; returned), with the recipe's numbers as
// options (ensure_calculator_start passes the ones above).
struct CalculatorStartOptions {
  std::string base, run_dir, device = "cpu";
  int64_t copy_steps = kCalculatorCopySteps, max_mixture_steps = 300;
  double call_rate = kCalculatorCallRate;
};
std::string make_calculator_start(const CalculatorStartOptions& o);
// One supervised row: a prompt, then a response whose in_loss tokens are targets.
struct SupervisedRow {
  std::vector<int64_t> prompt, response;
  std::vector<uint8_t> in_loss;
};
// The rows as one micro-batch of width S (>= every row's length; 0: the longest row's): ids padded with 0, labels
// -100 but the in_loss response tokens (HF labels).
MicroBatch supervised_batch(const std::vector<SupervisedRow>& rows, int64_t S = 0);
// A problem's prompt and its answer, every answer token in the loss.
SupervisedRow answer_row(const Problem& p);
// One training row of the calculator's start: prompt + "?" <eos> + the tool's result as the calculator environment
// appends it + the answer; the loss on the answer (and on the call too with call_in_loss).
SupervisedRow calculator_call_row(const Problem& p, bool call_in_loss);

// The task's problems: training never draws a held-out pair (synthetic.h's split), evaluation only those.
// Operands have a digit count uniform in [lo, hi]; longest: at least one operand has `hi` digits (the
// problems a model trained on shorter ones fails).
struct Task {
  int lo = 1, hi = 4;
  bool longest = true;
  bool wanted(int64_t a, int64_t b) const;
  Problem train(Rng& rng) const;
  std::vector<Problem> eval(int64_t n, uint64_t seed) const;  // n distinct held-out problems
};

// Greedy exact match (percent) on the held-out problems, through the engine.
double exact_match(RolloutEngine& engine, const std::vector<Problem>& problems, int max_digits);

// The reward of a response. exact: 1 or 0. prefix: the share of the answer (digits, then <eos>) right
// before the first mistake. digits: the share of the answer's positions the response gets right (a 4-digit
// sum with a wrong tens digit scores 5/6 rather than 0), so groups on problems the model never solves
// still differ. An exact answer scores 1 under each, and only an exact answer does.
enum class Reward { Exact, Prefix, Digits };
double answer_reward(const Problem& p, const std::vector<int32_t>& tokens, Reward kind);
// Process rewards: 1 for each response token equal to the answer's token at its position, else 0 (the
// digits reward spread over the tokens).
std::vector<double> answer_token_rewards(const Problem& p, const std::vector<int32_t>& tokens);

// One SFT micro-batch of `rows` training problems: prompt -100, answer tokens as targets (HF labels).
MicroBatch sft_batch(const Task& task, Rng& rng, int64_t rows);

std::vector<int32_t> ids32(const std::vector<int64_t>& v);

// The SFT baseline (`grpo --baseline sft`): supervised steps of `rows` training problems (drawn from a
// generator seeded by `seed`) at lr_at(step), for `budget_s` seconds of wall time, each step's record into
// `metrics` and a log line every 10; returns the steps run.
int64_t sft_baseline(TrainSession& session, const Task& task, uint64_t seed, int64_t rows, double budget_s,
                     const std::function<double(int64_t)>& lr_at, MetricsWriter& metrics);

}  // namespace mt::rl::addition
