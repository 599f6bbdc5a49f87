// TrainConfig's options, its JSON file, validation and JSON output (see train_config.h). Every field is
// declared once, in declare_train_options (core/options.h); the command line, the config file, the
// checks, the help, to_json and the list of keys all walk those declarations.
#include "train/train_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/strings.h"
#include "data/synthetic.h"
#include "model/lora.h"

namespace mt {

namespace {

using cli::Kind;

constexpr const char* kModelData = "model and data";
constexpr const char* kDevice = "device";
constexpr const char* kRunDir = "run directory and checkpoints";
constexpr const char* kSchedule = "batch, schedule and optimizer";
constexpr const char* kEval = "evaluation and logging";
constexpr const char* kNumerics = "numerics and memory";
constexpr const char* kMoe = "MoE routing and balancing";
constexpr const char* kLayout = "parallel layout (under moetrain launch)";
constexpr const char* kLora = "LoRA adapters";

std::string real_str(double v) {
  return nlohmann::json(v).dump();
}

bool synthetic(const TrainConfig& c) {
  return c.data.rfind("synthetic:", 0) == 0;
}

// The rules over several fields (and data's synthetic task), in the words of the keys: they also check
// configs built in code and read from files, where no flag was typed.
void declare_rules(cli::Options& o, const TrainConfig& c) {
  o.rule([&c] {
    if (synthetic(c) && c.data != "synthetic:addition")
      MT_THROW("train config: data = \"", c.data, "\" is not allowed: the synthetic tasks are: synthetic:addition");
    if (c.etp != 1 && c.etp != c.tp)
      MT_THROW("train config: etp = ", c.etp, " is not allowed: must be 1 or tp (", c.tp, ")");
    if (c.min_lr > c.lr)
      MT_THROW("train config: min_lr = ", real_str(c.min_lr), " is not allowed: must be <= lr = ", real_str(c.lr));
    if (c.max_steps > c.steps)
      MT_THROW("train config: max_steps = ", c.max_steps, " is not allowed: must be <= steps = ", c.steps,
               " (steps is the length of the LR schedule; max_steps stops the run earlier)");
    if (c.stop_at_exact_match > 0 && (!synthetic(c) || c.eval_every < 1))
      MT_THROW("train config: stop_at_exact_match = ", real_str(c.stop_at_exact_match),
               " is not allowed here: it stops at an evaluation of held-out exact match, which needs synthetic data "
               "(data = \"",
               c.data, "\") and eval_every >= 1 (", c.eval_every, ")");
    if (synthetic(c) && !c.tokenizer.empty())
      MT_THROW("train config: tokenizer = \"", c.tokenizer, "\" is not allowed with data = \"", c.data,
               "\": the synthetic task has its own character ids, which a tokenizer.json copied into its checkpoints "
               "would decode as another vocabulary's; drop tokenizer");
    if (synthetic(c) && c.eval_problems > max_eval_problems(int(c.max_digits)))
      MT_THROW("train config: eval_problems = ", c.eval_problems, " is not allowed with max_digits = ", c.max_digits,
               ": there are only ", max_eval_problems(int(c.max_digits)),
               " distinct held-out problems; use eval_problems <= ", max_eval_problems(int(c.max_digits)));
    if (synthetic(c) && c.seq_len < max_problem_tokens(int(c.max_digits)))
      MT_THROW("train config: seq_len = ", c.seq_len, " is not allowed with data = \"", c.data,
               "\" and max_digits = ", c.max_digits, ": a problem takes up to ", max_problem_tokens(int(c.max_digits)),
               " tokens, so seq_len must be >= ", max_problem_tokens(int(c.max_digits)));
    if (c.lora_rank > 0) {
      try {
        parse_lora_targets(c.lora_targets);
      } catch (const Error& e) {
        MT_THROW("train config: lora_targets = \"", c.lora_targets, "\" is not allowed: ", e.what());
      }
    }
  });
}

// An option's key in a config file and in to_json: its name with '_' for '-' ("warmup_steps").
std::string json_key(const cli::Option& o) {
  std::string k = o.names.front();
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

// --config is the command line's: a config file does not name another.
bool is_config(const cli::Option& o) {
  return o.names.front() == "config";
}

// The option a config file's key names; an unknown key is an error with the nearest keys (or all of them).
const cli::Option& option_of_key(const cli::Options& o, const std::string& key, const std::string& origin) {
  const cli::Option* opt = o.find(key);
  if (opt && !is_config(*opt)) return *opt;
  std::vector<std::string> names;
  for (const cli::Option& x : o.options())
    if (!is_config(x)) names.push_back(json_key(x));
  const std::vector<std::string> near = near_names(key, names);
  if (!near.empty()) {
    std::string close;
    for (const std::string& n : near) close += str(close.empty() ? "" : ", ", n);
    MT_THROW("train config (", origin, "): unknown key '", key, "'; did you mean: ", close, "?");
  }
  std::string all;
  for (const std::string& n : names) all += str(all.empty() ? "" : ", ", n);
  MT_THROW("train config (", origin, "): unknown key '", key, "'; the keys are: ", all);
}

// Why the option's declaration refuses `text` ("need > 0", "is not an integer"); "" when it takes it.
std::string why_refused(const cli::Option& opt, const std::string& text) {
  try {
    const std::string why = opt.refusal(text);
    return why.empty() ? why : "; " + why;
  } catch (const Error&) {  // the number does not parse
    return opt.kind == Kind::Int ? " is not an integer" : " is not a finite number";
  }
}

// Checks `text` against the option's declaration and sets it; an error names the key and `shown` (the
// value as the file or the caller wrote it) rather than a flag nobody typed.
void set_checked(cli::Options& o, const cli::Option& opt, const std::string& text, const std::string& shown,
                 const std::string& origin) {
  if (const std::string why = why_refused(opt, text); !why.empty())
    MT_THROW("train config (", origin, "): ", json_key(opt), " = ", shown, why);
  o.set(opt.names.front(), text);
}

[[noreturn]] void json_type_error(const cli::Option& opt, const nlohmann::json& v, const std::string& origin,
                                  const char* want) {
  MT_THROW("train config (", origin, "): ", json_key(opt), " = ", v.dump(), " (", v.type_name(), ") must be ", want);
}

// A JSON value as the text its option's setter reads, after the type check that the option's kind asks for.
std::string json_value_text(const cli::Option& opt, const nlohmann::json& v, const std::string& origin) {
  switch (opt.kind) {
    case Kind::Text:
      if (!v.is_string()) json_type_error(opt, v, origin, "a string");
      return v.get<std::string>();
    case Kind::Bool:
      if (v.is_boolean()) return v.get<bool>() ? "on" : "off";
      if (v.is_number_integer() && (v == 0 || v == 1)) return v == 1 ? "on" : "off";  // as to_json writes them
      json_type_error(opt, v, origin, "true or false (or 1 or 0)");
    case Kind::Int:
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
        json_type_error(opt, v, origin, "an integer that fits in int64");
      if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
      // 1e3 is written as a float in JSON but means 1000.
      if (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>() &&
          std::fabs(v.get<double>()) < 9e15)
        return std::to_string(int64_t(v.get<double>()));
      json_type_error(opt, v, origin, "an integer");
    case Kind::Real:
      if (!v.is_number()) json_type_error(opt, v, origin, "a number");
      return v.dump();  // the shortest text that reads back to the same double
  }
  return "";
}

// A JSON object's values through o's declarations (each checked, set and counted as given). The options the
// command line gave (`keep`) keep its values; the file's are still checked.
void apply_json_object(cli::Options& o, const std::string& json_text, const std::string& origin,
                       const std::vector<std::string>& keep) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("train config (", origin, "): not valid JSON: ", e.what());
  }
  if (!j.is_object()) MT_THROW("train config (", origin, "): the top level must be a JSON object, got ", j.type_name());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const cli::Option& opt = option_of_key(o, it.key(), origin);
    const std::string text = json_value_text(opt, it.value(), origin);
    if (std::find(keep.begin(), keep.end(), opt.names.front()) == keep.end()) {
      set_checked(o, opt, text, it.value().dump(), origin);
    } else if (const std::string why = why_refused(opt, text); !why.empty()) {
      MT_THROW("train config (", origin, "): ", json_key(opt), " = ", it.value().dump(), why);
    }
  }
}

// The options `o` was given (by the command line or a config file), in c.given's spelling.
void record_given(const cli::Options& o, TrainConfig& c) {
  for (const cli::Option& opt : o.options())
    if (!is_config(opt) && o.given(opt.names.front()) && !train_config_given(c, json_key(opt)))
      c.given.push_back(json_key(opt));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("train config: cannot open '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Options of the fields alone, for the library's calls that have no command.
struct Declared {
  cli::Options o;
  explicit Declared(TrainConfig& c, const std::string& command = "train config") : o(command, "[--key value ...]") {
    declare_train_options(o, c);
  }
};

}  // namespace

// Declared in to_json's order, which is every saved train_config.json's and checkpoint's: the help gathers
// the options by group.
void declare_train_options(cli::Options& o, TrainConfig& c) {
  o.group(kModelData);
  o.add("model", &c.model, "a preset (tiny, demo, bench-4L, qwen3-30b-a3b) or a Hugging Face model directory")
      .var("NAME|DIR")
      .not_empty();
  o.add("init-from", &c.init_from, "a Hugging Face directory to load the weights from; empty: random init").var("DIR");
  o.group(kDevice);
  o.add("device", &c.device, "where the model runs: cpu, cuda, or auto (cuda when a GPU is visible)")
      .one_of({"auto", "cpu", "cuda"});
  o.group(kRunDir);
  o.add("out-dir|run-dir", &c.out_dir, "the run directory: checkpoints, logs and metrics").var("DIR").not_empty();
  o.group(kSchedule);
  o.add("steps", &c.steps, "optimizer steps: the length of the learning-rate schedule").at_least(0);
  o.add("micro-batch-size", &c.micro_batch_size, "sequences per micro-batch").at_least(1);
  o.add("grad-accum", &c.grad_accum, "micro-batches per optimizer step").at_least(1);
  o.add("seq-len", &c.seq_len, "tokens per sequence").at_least(2);
  o.add("lr", &c.lr, "peak learning rate").above(0);
  o.add("min-lr", &c.min_lr, "learning rate at the end of the decay (<= lr)").at_least(0);
  o.add("warmup-steps", &c.warmup_steps,
        "steps of linear warm-up; more than steps: the run warms up over all its steps")
      .at_least(0);
  o.add("lr-schedule", &c.lr_schedule, "the learning rate's decay after the warm-up")
      .one_of({"cosine", "linear", "constant"});
  o.add("weight-decay", &c.weight_decay, "AdamW decoupled weight decay").at_least(0);
  o.add("beta1", &c.beta1, "AdamW beta1").at_least(0).below(1);
  o.add("beta2", &c.beta2, "AdamW beta2").at_least(0).below(1);
  o.add("eps", &c.eps, "AdamW epsilon").above(0);
  o.add("grad-clip", &c.grad_clip, "max global gradient norm").at_least(0).says("0: off");
  o.group(kModelData);
  o.add("seed", &c.seed, "seed of the initialisation and the data order").at_least(0);
  o.add("data", &c.data,
        "synthetic:addition, a *.jsonl file of text or messages lines (tokenized, packed with document "
        "boundaries), or a token shard file or directory of *.bin shards")
      .var("SOURCE")
      .not_empty();
  o.add("tokenizer", &c.tokenizer,
        "tokenizer.json for JSONL data (empty: the model directory's, when it has one); copied into checkpoints; "
        "not with synthetic data (its own character ids)")
      .var("FILE");
  o.add("data-format", &c.data_format, "JSONL data: auto (per line: messages or text), text or messages")
      .one_of({"auto", "text", "messages"});
  o.add("bad-lines", &c.bad_lines,
        "JSONL data: skip (count malformed lines, report them with line numbers, skip them) or fail (stop at the "
        "first)")
      .one_of({"skip", "fail"});
  o.add("max-digits", &c.max_digits, "synthetic addition: operands have 1..max-digits digits")
      .at_least(1)
      .at_most(kMaxAdditionDigits);
  o.group(kEval);
  o.add("eval-problems", &c.eval_problems, "held-out problems for exact-match evaluation (synthetic data)").at_least(0);
  o.add("eval-every", &c.eval_every, "steps between evaluations").at_least(0).says("0: only at the end");
  o.add("log-every", &c.log_every, "steps between log lines").at_least(1);
  o.group(kRunDir);
  o.add("save-every", &c.save_every, "steps between checkpoints").at_least(0).says("0: only at the end");
  o.add("keep-last", &c.keep_last,
        "keep the newest N complete checkpoints, deleting older ones once a new one is complete")
      .at_least(0)
      .says(
          "0: keep all, those older than the newest 2 as weights only (HF config and safetensors, no training "
          "state)");
  o.group(kSchedule);
  o.add("max-steps", &c.max_steps,
        "stop after this step (saving a checkpoint there) although the learning-rate schedule spans steps")
      .at_least(0)
      .says("0: steps");
  o.group(kEval);
  o.add("stop-at-exact-match", &c.stop_at_exact_match,
        "stop (saving a checkpoint) at the first evaluation (eval-every) whose held-out exact match reaches this "
        "percentage")
      .at_least(0)
      .at_most(100)
      .says("0: off");
  o.group(kRunDir);
  o.add("resume", &c.resume,
        "continue a run exactly: latest (a bare --resume: the newest checkpoint of the run directory whose "
        "manifest verifies) or a checkpoint-N directory; empty: start fresh")
      .var("latest|DIR")
      .bare_means("latest");
  o.group(kNumerics);
  o.add("recompute", &c.recompute, "activation recompute per block (docs/model.md)")
      .one_of({"none", "full", "selective", "moe"});
  o.group(kMoe);
  o.add("score-before-experts", &c.score_before_experts,
        "1: y = sum_k expert_k(w_k x) (routing weights on the experts' input); 0 (Qwen3-MoE): y = sum_k w_k "
        "expert_k(x); -1: as the checkpoint of init-from (or the model directory) says. Saved in the checkpoints' "
        "config.json; a 0 or 1 that contradicts init-from's is an error")
      .at_least(-1)
      .at_most(1);
  o.group(kEval);
  o.add("metrics-file", &c.metrics_file, "the metrics' JSONL file; empty: <out-dir>/metrics.jsonl").var("FILE");
  o.add("tensorboard", &c.tensorboard,
        "also write a TensorBoard event file (events.out.tfevents.*) beside the metrics file");
  o.group(kMoe);
  o.add("router-z-loss-coef", &c.router_z_loss_coef,
        "router z-loss (ST-MoE) coefficient: adds coef * mean over router rows of logsumexp(logits)^2")
      .at_least(0)
      .says("0: off");
  o.add("router-bias-update-rate", &c.router_bias_update_rate,
        "aux-loss-free balancing (DeepSeek-V3): per-expert routing bias step after each optimizer step")
      .at_least(0)
      .says("0: off");
  o.group(kDevice);
  o.add("threads", &c.threads, "CPU threads of the matrix products").at_least(0).says("0: all cores");
  o.group(kLayout);
  o.add("dp-shard", &c.dp_shard, "ranks the model's weights are sharded over (FSDP)")
      .at_least(0)
      .says("0: what the other degrees leave of the world size");
  o.add("dp-replicate", &c.dp_replicate, "replicas of the sharded model (HSDP)").at_least(1);
  o.add("grad-sync", &c.grad_sync,
        "FSDP gradient reduce-scatter: every micro-batch, or only in the last (full-size gradients meanwhile)")
      .one_of({"every", "last"});
  o.add("load-mode", &c.load_mode,
        "multi-rank loading: mmap (each rank reads its own slices), broadcast (rank 0 reads, large buckets), or "
        "auto (broadcast only when some rank cannot see the files)")
      .one_of({"auto", "mmap", "broadcast"});
  o.group(kMoe);
  o.add("moe-capacity-factor", &c.moe_capacity_factor,
        "> 0: each expert takes at most ceil(T K / E x factor) assignments per rank, the lowest weights dropped")
      .at_least(0)
      .says("0: dropless");
  o.group(kLayout);
  o.add("ep", &c.ep, "expert parallelism: experts split over ep ranks (tokens move by all-to-all)").at_least(1);
  o.add("tp", &c.tp, "tensor parallelism: heads and MLP columns split over tp ranks that share samples").at_least(1);
  o.add("etp", &c.etp, "expert tensor parallelism: 1 (experts whole) or tp (the experts' F split over the tp ranks)")
      .at_least(1);
  o.add("sp", &c.sp, "sequence parallelism (Ulysses): each sequence split over sp ranks (all-to-all attention)")
      .at_least(1);
  o.group(kDevice);
  o.add("optimizer-overlap", &c.optimizer_overlap,
        "one device on CUDA: each unit's AdamW update on a side stream, the next forward waiting only for the "
        "units it reaches (bit-identical to off, which updates everything before the next step starts; measured "
        "slower on an H200, see bench/NOTES.md)");
  o.group(kNumerics);
  o.add("deterministic", &c.deterministic,
        "CUDA: the same bits run to run and an exact --resume: no float atomics (RMSNorm dw, embedding gradient, "
        "router sums in fixed-order partials), cuDNN's deterministic attention backward; slower (docs/cuda.md). The "
        "CPU is deterministic either way");
  o.group(kLayout);
  o.add("reshard-after-forward", &c.reshard_after_forward,
        "FSDP: free a unit's gathered weights after its forward and gather them again for its backward; off keeps "
        "them (no all-gather in the backward, every unit's full weights held from forward to backward)");
  o.add("grad-reduce-dtype", &c.grad_reduce_dtype,
        "FSDP gradient reduction: f32 (reduce-scatter in fp32) or bf16 (bf16 on the wire, summed in fp32)")
      .one_of({"f32", "bf16"});
  o.add("comm-timeout-s", &c.comm_timeout_s, "seconds before a stuck collective or rendezvous is an error").at_least(1);
  o.add("schedule-check", &c.schedule_check, "collective-schedule check (per_op: for debugging)")
      .one_of({"off", "periodic", "per_op"});
  o.add("schedule-check-every", &c.schedule_check_every, "steps between periodic schedule checks").at_least(1);
  o.group(kLora);
  o.add("lora-rank", &c.lora_rank,
        "train low-rank adapters of this rank on the frozen base (docs/lora.md); checkpoints then hold the adapters "
        "(a PEFT adapter directory) and their optimizer state")
      .at_least(0)
      .says("0: train every weight");
  o.add("lora-alpha", &c.lora_alpha, "the adapters' scale is alpha / rank").at_least(0).says("0: 2 × rank");
  o.add("lora-targets", &c.lora_targets,
        "what gets adapters: attn, mlp (dense layers), experts (each routed expert), router, or single names "
        "(q_proj, ..., experts.gate_up_proj)")
      .var("LIST");
  declare_rules(o, c);
}

void declare_train_command(cli::Options& o, TrainConfig& c) {
  o.group("config file");
  auto path = std::make_shared<std::string>();
  o.custom(
       "config", Kind::Text,
       "a JSON object of these settings, keys as here with '_' for '-' ({\"warmup_steps\": 10}); the command line "
       "overrides it",
       [path](const std::string& p) {
         if (!path->empty()) MT_THROW("--config given twice ('", *path, "' and '", p, "')");
         *path = p;
       },
       [path] { return *path; })
      .var("FILE.json")
      .not_empty();
  declare_train_options(o, c);
}

cli::Options train_options(TrainConfig& c) {
  cli::Options o("train", "[--config FILE.json] [--key value ...]",
                 "Trains a model: by default the demo model on the built-in synthetic addition task (docs/train.md).");
  declare_train_command(o, c);
  return o;
}

bool parse_train_args(cli::Options& o, TrainConfig& c, const std::vector<std::string>& args) {
  if (!o.parse(args)) return false;
  if (const cli::Option* config = o.find("config"); config && !config->get().empty()) {
    std::vector<std::string> keep;
    for (const cli::Option& opt : o.options())
      if (o.given(opt.names.front())) keep.push_back(opt.names.front());
    apply_json_object(o, read_file(config->get()), config->get(), keep);
  }
  o.check();
  record_given(o, c);
  return true;
}

void apply_json(TrainConfig& c, const std::string& json_text, const std::string& origin) {
  TrainConfig next = c;  // `c` is left untouched when a value is rejected
  Declared d(next);
  apply_json_object(d.o, json_text, origin, {});
  record_given(d.o, next);
  c = next;
}

TrainConfig load_train_config(const std::string& path) {
  TrainConfig c;
  apply_json(c, read_file(path), path);
  validate_train_config(c);
  return c;
}

void apply_overrides(TrainConfig& c, const std::vector<std::string>& args) {
  TrainConfig next = c;  // `c` is left untouched when an argument is rejected
  Declared d(next, "train");
  if (!d.o.parse(args)) MT_THROW("train: -h/--help asks for the help, which the command prints");
  record_given(d.o, next);
  validate_train_config(next);
  c = next;
}

TrainConfig train_config_from_args(const std::vector<std::string>& args) {
  TrainConfig c;
  cli::Options o = train_options(c);
  if (!parse_train_args(o, c, args)) MT_THROW("train: -h/--help asks for the help, which the command prints");
  return c;
}

void set_train_config_field(TrainConfig& c, const std::string& key, const std::string& value) {
  TrainConfig next = c;
  Declared d(next);
  const cli::Option& opt = option_of_key(d.o, key, key);
  set_checked(d.o, opt, value, opt.kind == Kind::Text ? nlohmann::json(value).dump() : value, key);
  record_given(d.o, next);
  c = next;
}

void validate_train_config(const TrainConfig& c) {
  TrainConfig copy = c;
  Declared d(copy);
  for (const cli::Option& opt : d.o.options()) {
    const std::string text = opt.get();
    if (const std::string why = why_refused(opt, text); !why.empty())
      MT_THROW("train config: ", json_key(opt), " = ", opt.kind == Kind::Text ? nlohmann::json(text).dump() : text,
               why);
  }
  d.o.check();
}

bool train_config_given(const TrainConfig& c, const std::string& key) {
  return std::find(c.given.begin(), c.given.end(), key) != c.given.end();
}

int64_t effective_warmup_steps(const TrainConfig& c) {
  return std::min(c.warmup_steps, c.steps);
}

std::string warmup_clamp_note(const TrainConfig& c) {
  if (c.warmup_steps <= c.steps) return "";
  return str("warmup_steps ", c.warmup_steps, train_config_given(c, "warmup_steps") ? " (your setting)" : "",
             " > steps ", c.steps, "; warming up over all ", c.steps, " steps");
}

std::string to_json(const TrainConfig& c) {
  TrainConfig copy = c;
  Declared d(copy);
  nlohmann::ordered_json j;
  for (const cli::Option& opt : d.o.options()) {
    // The LoRA settings only in a LoRA run's config: every other run's saved config stays as it was.
    if (c.lora_rank == 0 && opt.group == kLora) continue;
    const std::string text = opt.get();  // exact: a number reads back to the same bits
    switch (opt.kind) {
      case Kind::Text:
        j[json_key(opt)] = text;
        break;
      case Kind::Int: {
        int64_t v = 0;
        std::from_chars(text.data(), text.data() + text.size(), v);
        j[json_key(opt)] = v;
        break;
      }
      case Kind::Real: {
        double v = 0;
        std::from_chars(text.data(), text.data() + text.size(), v);
        j[json_key(opt)] = v;
        break;
      }
      case Kind::Bool:  // 0/1, as every saved config has them (a file may say true/false too)
        j[json_key(opt)] = bool_word(text).value_or(false) ? 1 : 0;
        break;
    }
  }
  return j.dump(2);
}

std::vector<std::string> train_config_keys() {
  TrainConfig c;
  Declared d(c);
  std::vector<std::string> keys;
  for (const cli::Option& opt : d.o.options()) keys.push_back(json_key(opt));
  return keys;
}

std::string train_config_help(const TrainConfig& defaults) {
  TrainConfig c = defaults;
  return train_options(c).help();
}

std::string train_config_changes(const nlohmann::json& saved, const TrainConfig& c) {
  // Where and how the same steps run: these may change between a save and its resume. (score_before_experts
  // is the checkpoint's own: the trainer refuses a resume that contradicts it, and -1 takes it.)
  static const std::vector<std::string> kFree = {"score_before_experts",
                                                 "init_from",
                                                 "load_mode",
                                                 "device",
                                                 "out_dir",
                                                 "steps",
                                                 "max_steps",
                                                 "stop_at_exact_match",
                                                 "resume",
                                                 "save_every",
                                                 "keep_last",
                                                 "log_every",
                                                 "eval_every",
                                                 "eval_problems",
                                                 "metrics_file",
                                                 "tensorboard",
                                                 "threads",
                                                 "dp_shard",
                                                 "dp_replicate",
                                                 "ep",
                                                 "tp",
                                                 "etp",
                                                 "sp",
                                                 "optimizer_overlap",
                                                 "deterministic",
                                                 "reshard_after_forward",
                                                 "grad_sync",
                                                 "comm_timeout_s",
                                                 "schedule_check",
                                                 "schedule_check_every",
                                                 "recompute",
                                                 "bad_lines"};
  if (!saved.is_object()) return "";
  const nlohmann::json now = nlohmann::json::parse(to_json(c));
  std::string out;
  for (auto it = now.begin(); it != now.end(); ++it) {
    if (std::find(kFree.begin(), kFree.end(), it.key()) != kFree.end() || !saved.contains(it.key())) continue;
    const nlohmann::json& was = saved[it.key()];
    if (was == it.value()) continue;
    out += str(out.empty() ? "" : ", ", it.key(), " ", was.dump(), " -> ", it.value().dump());
  }
  return out;
}

std::string metrics_path(const TrainConfig& c) {
  if (!c.metrics_file.empty()) return c.metrics_file;
  return (std::filesystem::path(c.out_dir) / "metrics.jsonl").string();
}

}  // namespace mt
