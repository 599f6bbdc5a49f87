// TrainConfig: every setting of a training run, with its default, declared once as options
// (core/options.h: declare_train_options), and read from the command line and from a JSON file through
// those declarations: `--key value` or `--key=value` ('-' and '_' alike in keys, so --micro-batch-size and
// --micro_batch_size both work), on/off switches, "did you mean" for a misspelt key, `--help` generated
// from the same declarations with every default.
//
// The file format is JSON only: one object whose keys are the field names below, e.g.
//   {"model": "demo", "steps": 2500, "lr": 7e-4, "data": "synthetic:addition"}
// Unknown keys are errors (a typo must not silently fall back to a default), and every value is
// checked as the command line checks it, after its JSON type: the error names the field, the value and
// what is allowed. A call that throws leaves the config it was given unchanged.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/options.h"

namespace mt {

struct TrainConfig {
  std::string model = "demo";         // a preset name (tiny, demo, ...) or a Hugging Face model directory
  std::string init_from = "";         // "" = random init; else a Hugging Face directory to load weights from
  std::string load_mode = "auto";     // multi-rank loading: mmap (each rank reads its slices) | broadcast | auto
  std::string device = "auto";        // cpu | cuda | auto (cuda when a GPU is visible)
  std::string out_dir = "runs/demo";  // the run directory (--run-dir is the same key)
  int64_t steps = 2500;  // optimizer steps (the demo: 78.5-100% exact match over the seeds measured, docs/train.md)
  int64_t micro_batch_size = 16;  // sequences per micro-batch
  int64_t grad_accum = 1;         // micro-batches per optimizer step
  int64_t seq_len = 64;
  double lr = 7e-4;            // peak learning rate (the demo's 3e-3 of earlier versions was chaotic: docs/train.md)
  double min_lr = 7e-5;        // end of the decay
  int64_t warmup_steps = 100;  // more than steps: the run warms up over all its steps (effective_warmup_steps)
  std::string lr_schedule = "cosine";  // cosine | linear | constant
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // max global grad norm; 0 = off
  int64_t seed = 1234;
  std::string data = "synthetic:addition";  // "synthetic:addition", a *.jsonl file, or a token shard file / directory
  std::string tokenizer = "";               // JSONL data: tokenizer.json ("" = the model directory's)
  std::string data_format = "auto";         // JSONL data: auto | text | messages
  std::string bad_lines = "skip";           // JSONL data: skip | fail on malformed lines
  int64_t max_digits = 3;                   // synthetic addition operands have 1..max_digits digits
  int64_t eval_problems = 200;              // held-out problems for exact-match evaluation (synthetic data)
  int64_t eval_every = 500;                 // steps between evaluations; 0 = only at the end
  int64_t log_every = 1;                    // steps between log lines
  int64_t save_every = 0;                   // steps between checkpoints; 0 = only at the end
  // Keep the newest N complete checkpoints (a checkpoint takes 16 bytes per parameter); 0 = all of them,
  // those older than the newest 2 reduced to their weights (retain_checkpoints, train/checkpoint.h).
  int64_t keep_last = 2;
  int64_t max_steps = 0;  // stop (and save) at this step; 0 = steps (the schedule still spans steps)
  // Stop (and save) at the first evaluation whose held-out exact match (percent) reaches this; 0 = off.
  // A model stopped early that solves the task sometimes: the start of `moetrain grpo`'s built-in run.
  double stop_at_exact_match = 0;
  std::string resume = "";            // "" | latest (newest good checkpoint of out_dir) | a checkpoint dir
  std::string recompute = "none";     // activation recompute per block: none | full | selective | moe
  int64_t score_before_experts = -1;  // 1: routing weights multiply the experts' input; -1: init_from's
  std::string metrics_file = "";      // "" = <out_dir>/metrics.jsonl
  bool tensorboard = true;            // also a TensorBoard event file beside the metrics file
  // MoE load balancing beside the config.json aux loss (docs/model.md). 0 = off for both.
  double router_z_loss_coef = 0;       // ST-MoE router z-loss: coef * mean over router rows of lse(logits)^2
  double router_bias_update_rate = 0;  // DeepSeek-V3 aux-loss-free bias: b += rate * sign(mean - count) per step
  int64_t threads = 0;                 // CPU threads; 0 = all cores
  // Parallel layout (used when started by `moetrain launch` or another launcher with WORLD_SIZE > 1).
  int64_t dp_shard = 0;            // FSDP ranks; 0 = what is left of the world size
  int64_t dp_replicate = 1;        // HSDP replicas of the sharded model
  int64_t ep = 1;                  // expert parallelism: num_experts / ep experts per rank
  int64_t tp = 1;                  // tensor parallelism (the tp ranks share samples)
  int64_t etp = 1;                 // expert tensor parallelism: 1 or tp
  int64_t sp = 1;                  // sequence parallelism (Ulysses): each sequence split over sp ranks
  double moe_capacity_factor = 0;  // > 0: per-expert capacity per rank (Megatron's rule), drops lowest weights
  // The switches are saved as 0/1 (to_json), as every train_config.json and checkpoint has them.
  bool optimizer_overlap =
      false;  // one device, CUDA: each unit's AdamW update beside the next forward (slower today: bench/NOTES.md)
  bool deterministic = false;  // CUDA: the same bits run to run (no float atomics, fixed sum orders; slower)
  bool reshard_after_forward =
      true;  // FSDP: free gathered weights after each unit's forward; off keeps them for its backward
  std::string grad_reduce_dtype = "f32";  // FSDP gradient reduction: f32 | bf16 (bf16 on the wire, fp32 sums)
  std::string grad_sync =
      "every";                   // FSDP gradient reduce-scatter: every micro-batch | last (full-size grads meanwhile)
  int64_t comm_timeout_s = 300;  // a collective or rendezvous that takes longer is an error (watchdog)
  std::string schedule_check = "periodic";  // collective-schedule check: off | periodic | per_op (debug)
  int64_t schedule_check_every = 100;       // steps between periodic schedule checks
  // LoRA (docs/lora.md): rank > 0 trains low-rank adapters on the frozen base of init_from (or the model).
  int64_t lora_rank = 0;
  double lora_alpha = 0;                            // 0: 2 × rank
  std::string lora_targets = "attn,mlp,experts";  // groups and names (model/lora.h)

  // Not a setting: the keys a config file or the command line set (in their JSON spelling, e.g.
  // "warmup_steps"), so that a message can tell the user's value from a default. to_json leaves it out.
  std::vector<std::string> given;
};

// Declares every field of `c` as an option of `o`, in to_json's order, each with its group, help, range or
// choices, and the rules over several fields (o.rule, run by o.check()). c's values are the defaults the
// help shows. `c` must outlive `o`.
void declare_train_options(cli::Options& o, TrainConfig& c);
// A training command's options over `c`: --config FILE.json (read by parse_train_args), then
// declare_train_options.
void declare_train_command(cli::Options& o, TrainConfig& c);
// moetrain train's options over `c` (its name, synopsis and summary, and declare_train_command).
cli::Options train_options(TrainConfig& c);
// A training command's whole line into `c` (whose values are the defaults), with `o` from train_options (or
// sft_options, train/sft.h): the options are parsed; the --config file, if any, is read through the same
// declarations (a key the command line also gives keeps the command line's value, wherever --config
// stands); then the required options and the rules (o.check()). c.given records what the file and the
// command line set.
// Returns false when -h/--help was asked for: o.help() is then the text to print.
bool parse_train_args(cli::Options& o, TrainConfig& c, const std::vector<std::string>& args);

// Reads a JSON config file and validates it (validate_train_config).
TrainConfig load_train_config(const std::string& path);
// Applies the fields of a JSON object to `c` (checks each value, not the cross-field rules).
// `origin` names the source in error messages, e.g. the file name.
void apply_json(TrainConfig& c, const std::string& json_text, const std::string& origin);
// Applies `--key value` / `--key=value` arguments (no --config), then validates. A key, a value or a
// missing value that is wrong is an error naming the argument.
void apply_overrides(TrainConfig& c, const std::vector<std::string>& args);
// moetrain train's command line (parse_train_args over train_options); -h/--help is an error here.
TrainConfig train_config_from_args(const std::vector<std::string>& args);
// Sets one field from its text form (the command-line spelling of the key is accepted).
void set_train_config_field(TrainConfig& c, const std::string& key, const std::string& value);
// Every field's value against its declaration (range, choices), then the rules that involve several
// fields: min_lr <= lr, max_steps <= steps, and for synthetic data a seq_len that holds one problem and no
// more eval_problems than there are held-out pairs. (warmup_steps > steps is not an error: see
// effective_warmup_steps.)
void validate_train_config(const TrainConfig& c);
// Whether a config file or the command line set `key` (TrainConfig::given).
bool train_config_given(const TrainConfig& c, const std::string& key);

// The warm-up the run uses: warmup_steps, clamped to steps (a short run of the default 100-step warm-up
// warms up over all its steps instead of being refused).
int64_t effective_warmup_steps(const TrainConfig& c);
// "" when warmup_steps <= steps; else the line that says so, naming the value as the user's when a config
// file or the command line set it: "warmup_steps 100 > steps 20; warming up over all 20 steps".
std::string warmup_clamp_note(const TrainConfig& c);

// Every field as a JSON object, in declaration order, 2-space indented (the switches as 0/1);
// load_train_config reads it back.
std::string to_json(const TrainConfig& c);
std::vector<std::string> train_config_keys();
// moetrain train's help (Options::help of train_options) showing the values of `defaults`.
std::string train_config_help(const TrainConfig& defaults = TrainConfig{});
// The settings that change the arithmetic of a run and differ between a saved config (to_json's object,
// from a checkpoint) and `c`, as "key saved -> now, ..."; "" when none do. Settings that only change
// where and how the same steps run (layout, device, logging, saving, resume) are not compared.
std::string train_config_changes(const nlohmann::json& saved, const TrainConfig& c);
// metrics_file, or <out_dir>/metrics.jsonl when it is empty.
std::string metrics_path(const TrainConfig& c);

}  // namespace mt
