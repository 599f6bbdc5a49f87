// TrainConfig loading, overrides, validation and JSON output (see train_config.h). All fields are
// described once, in kFields; parsing, checking, printing and help all walk that table.
#include "train/train_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <variant>

#include "core/error.h"
#include "core/strings.h"
#include "data/synthetic.h"

namespace mt {

namespace {

using StrMember = std::string TrainConfig::*;
using IntMember = int64_t TrainConfig::*;
using RealMember = double TrainConfig::*;

struct Field {
  const char* key;
  std::variant<StrMember, IntMember, RealMember> member;
  const char* help;
  // Returns "" when the field's value is allowed, else what is allowed ("must be > 0").
  std::string (*rule)(const TrainConfig&);
};

std::string one_of(const std::string& v, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (v == a) return "";
  std::string list;
  for (const char* a : allowed) list += str(list.empty() ? "" : ", ", a);
  return "allowed values: " + list;
}

std::string zero_or_one(int64_t v) {
  return v == 0 || v == 1 ? "" : std::string("must be 0 or 1");
}

// The on/off settings (0 or 1 in the struct): on the command line they also take on/off, true/false, yes/no
// or nothing (a bare --tensorboard is on), in a JSON file true/false, as every command's booleans do.
bool is_switch(const std::string& key) {
  return key == "tensorboard" || key == "optimizer_overlap" || key == "deterministic" || key == "reshard_after_forward";
}

std::string real_str(double v) {
  return nlohmann::json(v).dump();
}

const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = {
      {"model", &TrainConfig::model, "preset name (tiny, demo, bench-4L, qwen3-30b-a3b) or a Hugging Face model dir",
       [](const TrainConfig& c) { return c.model.empty() ? std::string("must not be empty") : ""; }},
      {"init_from", &TrainConfig::init_from, "\"\" = random init, or a Hugging Face dir to load weights from",
       [](const TrainConfig&) { return std::string(); }},
      {"device", &TrainConfig::device, "cpu | cuda | auto",
       [](const TrainConfig& c) {
         return one_of(c.device, {"cpu", "cuda", "auto"});
       }},
      {"out_dir", &TrainConfig::out_dir, "directory for checkpoints, logs and metrics",
       [](const TrainConfig& c) { return c.out_dir.empty() ? std::string("must not be empty") : ""; }},
      {"steps", &TrainConfig::steps, "optimizer steps",
       [](const TrainConfig& c) { return c.steps < 0 ? std::string("must be >= 0") : ""; }},
      {"micro_batch_size", &TrainConfig::micro_batch_size, "sequences per micro-batch",
       [](const TrainConfig& c) { return c.micro_batch_size < 1 ? std::string("must be >= 1") : ""; }},
      {"grad_accum", &TrainConfig::grad_accum, "micro-batches per optimizer step",
       [](const TrainConfig& c) { return c.grad_accum < 1 ? std::string("must be >= 1") : ""; }},
      {"seq_len", &TrainConfig::seq_len, "tokens per sequence",
       [](const TrainConfig& c) { return c.seq_len < 2 ? std::string("must be >= 2") : ""; }},
      {"lr", &TrainConfig::lr, "peak learning rate",
       [](const TrainConfig& c) { return c.lr > 0 && std::isfinite(c.lr) ? "" : std::string("must be > 0"); }},
      {"min_lr", &TrainConfig::min_lr, "learning rate at the end of the decay (<= lr)",
       [](const TrainConfig& c) {
         return c.min_lr >= 0 && std::isfinite(c.min_lr) ? "" : std::string("must be >= 0");
       }},
      {"warmup_steps", &TrainConfig::warmup_steps,
       "steps of linear warmup; more than steps: the run warms up over all its steps",
       [](const TrainConfig& c) { return c.warmup_steps < 0 ? std::string("must be >= 0") : ""; }},
      {"lr_schedule", &TrainConfig::lr_schedule, "cosine | linear | constant (after warmup)",
       [](const TrainConfig& c) {
         return one_of(c.lr_schedule, {"cosine", "linear", "constant"});
       }},
      {"weight_decay", &TrainConfig::weight_decay, "AdamW decoupled weight decay",
       [](const TrainConfig& c) {
         return c.weight_decay >= 0 && std::isfinite(c.weight_decay) ? "" : std::string("must be >= 0");
       }},
      {"beta1", &TrainConfig::beta1, "AdamW beta1, in [0, 1)",
       [](const TrainConfig& c) { return c.beta1 >= 0 && c.beta1 < 1 ? "" : std::string("must be in [0, 1)"); }},
      {"beta2", &TrainConfig::beta2, "AdamW beta2, in [0, 1)",
       [](const TrainConfig& c) { return c.beta2 >= 0 && c.beta2 < 1 ? "" : std::string("must be in [0, 1)"); }},
      {"eps", &TrainConfig::eps, "AdamW epsilon",
       [](const TrainConfig& c) { return c.eps > 0 && std::isfinite(c.eps) ? "" : std::string("must be > 0"); }},
      {"grad_clip", &TrainConfig::grad_clip, "max global gradient norm; 0 = off",
       [](const TrainConfig& c) {
         return c.grad_clip >= 0 && std::isfinite(c.grad_clip) ? "" : std::string("must be >= 0 (0 = off)");
       }},
      {"seed", &TrainConfig::seed, "seed of initialisation and data order",
       [](const TrainConfig& c) { return c.seed < 0 ? std::string("must be >= 0") : ""; }},
      {"data", &TrainConfig::data,
       "synthetic:addition, a *.jsonl file of text or messages lines (tokenized, packed with document boundaries), "
       "or a token shard file or directory of *.bin shards",
       [](const TrainConfig& c) {
         if (c.data.empty()) return std::string("must not be empty");
         if (c.data.rfind("synthetic:", 0) == 0 && c.data != "synthetic:addition")
           return std::string("the synthetic tasks are: synthetic:addition");
         return std::string();
       }},
      {"tokenizer", &TrainConfig::tokenizer,
       "tokenizer.json for JSONL data (\"\" = the model directory's, when it has one); copied into checkpoints; "
       "not with synthetic data (its own character ids)",
       [](const TrainConfig&) { return std::string(); }},
      {"data_format", &TrainConfig::data_format, "JSONL data: auto (per line: messages or text) | text | messages",
       [](const TrainConfig& c) {
         return one_of(c.data_format, {"auto", "text", "messages"});
       }},
      {"bad_lines", &TrainConfig::bad_lines,
       "JSONL data: skip (count malformed lines, report them with line numbers, skip them) | fail (stop at the first)",
       [](const TrainConfig& c) {
         return one_of(c.bad_lines, {"skip", "fail"});
       }},
      {"max_digits", &TrainConfig::max_digits, "synthetic addition: operands have 1..max_digits digits",
       [](const TrainConfig& c) {
         return c.max_digits >= 1 && c.max_digits <= kMaxAdditionDigits ? ""
                                                                        : str("must be in 1..", kMaxAdditionDigits);
       }},
      {"eval_problems", &TrainConfig::eval_problems, "held-out problems for exact-match evaluation",
       [](const TrainConfig& c) { return c.eval_problems < 0 ? std::string("must be >= 0") : ""; }},
      {"eval_every", &TrainConfig::eval_every, "steps between evaluations; 0 = only at the end",
       [](const TrainConfig& c) { return c.eval_every < 0 ? std::string("must be >= 0 (0 = only at the end)") : ""; }},
      {"log_every", &TrainConfig::log_every, "steps between log lines",
       [](const TrainConfig& c) { return c.log_every < 1 ? std::string("must be >= 1") : ""; }},
      {"save_every", &TrainConfig::save_every, "steps between checkpoints; 0 = only at the end",
       [](const TrainConfig& c) { return c.save_every < 0 ? std::string("must be >= 0 (0 = only at the end)") : ""; }},
      {"keep_last", &TrainConfig::keep_last,
       "keep the newest N complete checkpoints, deleting older ones once a new one is complete; 0 = keep all, "
       "those older than the newest 2 as weights only (HF config and safetensors, no training state)",
       [](const TrainConfig& c) { return c.keep_last < 0 ? std::string("must be >= 0 (0 = keep all)") : ""; }},
      {"max_steps", &TrainConfig::max_steps,
       "stop after this step (saving a checkpoint there) although the LR schedule spans `steps`; 0 = steps",
       [](const TrainConfig& c) { return c.max_steps < 0 ? std::string("must be >= 0 (0 = steps)") : ""; }},
      {"stop_at_exact_match", &TrainConfig::stop_at_exact_match,
       "stop (saving a checkpoint) at the first evaluation (eval_every) whose held-out exact match reaches this "
       "percentage; 0 = off",
       [](const TrainConfig& c) {
         return c.stop_at_exact_match < 0 || c.stop_at_exact_match > 100 ? std::string("must be in [0, 100] (0 = off)")
                                                                         : "";
       }},
      {"resume", &TrainConfig::resume,
       "continue a run exactly: latest (bare --resume: the newest checkpoint of the run dir whose manifest "
       "verifies) or a checkpoint-N directory; \"\" = start fresh",
       [](const TrainConfig&) { return std::string(); }},
      {"recompute", &TrainConfig::recompute,
       "activation recompute per block: none | full | selective | moe (docs/model.md)",
       [](const TrainConfig& c) {
         return one_of(c.recompute, {"none", "full", "selective", "moe"});
       }},
      {"score_before_experts", &TrainConfig::score_before_experts,
       "1: y = sum_k expert_k(w_k x) (routing weights on the experts' input); 0 (Qwen3-MoE): y = sum_k w_k "
       "expert_k(x); -1: as the checkpoint of init_from (or the model directory) says. Saved in the checkpoints' "
       "config.json; a 0 or 1 that contradicts init_from's is an error",
       [](const TrainConfig& c) {
         return c.score_before_experts >= -1 && c.score_before_experts <= 1
                    ? std::string()
                    : std::string("must be -1 (the checkpoint's), 0 or 1");
       }},
      {"metrics_file", &TrainConfig::metrics_file, "\"\" = <out_dir>/metrics.jsonl",
       [](const TrainConfig&) { return std::string(); }},
      {"tensorboard", &TrainConfig::tensorboard,
       "1: also write a TensorBoard event file (events.out.tfevents.*) beside the metrics file; 0 = off",
       [](const TrainConfig& c) { return zero_or_one(c.tensorboard); }},
      {"router_z_loss_coef", &TrainConfig::router_z_loss_coef,
       "router z-loss (ST-MoE) coefficient: adds coef * mean over router rows of logsumexp(logits)^2; 0 = off",
       [](const TrainConfig& c) {
         return c.router_z_loss_coef >= 0 && std::isfinite(c.router_z_loss_coef)
                    ? ""
                    : std::string("must be >= 0 (0 = off)");
       }},
      {"router_bias_update_rate", &TrainConfig::router_bias_update_rate,
       "aux-loss-free balancing (DeepSeek-V3): per-expert routing bias step after each optimizer step; 0 = off",
       [](const TrainConfig& c) {
         return c.router_bias_update_rate >= 0 && std::isfinite(c.router_bias_update_rate)
                    ? ""
                    : std::string("must be >= 0 (0 = off)");
       }},
      {"threads", &TrainConfig::threads, "CPU threads; 0 = all cores",
       [](const TrainConfig& c) { return c.threads < 0 ? std::string("must be >= 0 (0 = all cores)") : ""; }},
      {"dp_shard", &TrainConfig::dp_shard, "FSDP ranks; 0 = the rest of the world size",
       [](const TrainConfig& c) {
         return c.dp_shard < 0 ? std::string("must be >= 0 (0 = the rest of the world)") : "";
       }},
      {"dp_replicate", &TrainConfig::dp_replicate, "HSDP replicas of the sharded model",
       [](const TrainConfig& c) { return c.dp_replicate < 1 ? std::string("must be >= 1") : ""; }},
      {"grad_sync", &TrainConfig::grad_sync,
       "FSDP gradient reduction: every (micro-batch) | last (only in the last micro-batch; full-size grads meanwhile)",
       [](const TrainConfig& c) {
         return one_of(c.grad_sync, {"every", "last"});
       }},
      {"load_mode", &TrainConfig::load_mode,
       "multi-rank loading: mmap (each rank reads its own slices) | broadcast (rank 0 reads, large buckets) | "
       "auto (broadcast only when some rank cannot see the files)",
       [](const TrainConfig& c) {
         return one_of(c.load_mode, {"auto", "mmap", "broadcast"});
       }},
      {"moe_capacity_factor", &TrainConfig::moe_capacity_factor,
       "0 = dropless; > 0: each expert takes at most ceil(T K / E x factor) assignments per rank, lowest weights "
       "dropped",
       [](const TrainConfig& c) {
         return c.moe_capacity_factor < 0 ? std::string("must be >= 0 (0 = dropless)") : "";
       }},
      {"ep", &TrainConfig::ep, "expert parallelism: experts split over ep ranks (tokens move by all-to-all)",
       [](const TrainConfig& c) { return c.ep < 1 ? std::string("must be >= 1") : ""; }},
      {"tp", &TrainConfig::tp, "tensor parallelism: heads and MLP columns split over tp ranks that share samples",
       [](const TrainConfig& c) { return c.tp < 1 ? std::string("must be >= 1") : ""; }},
      {"etp", &TrainConfig::etp,
       "expert tensor parallelism: 1 (experts whole) or tp (experts' F split over the tp ranks)",
       [](const TrainConfig& c) { return c.etp != 1 && c.etp != c.tp ? str("must be 1 or tp (", c.tp, ")") : ""; }},
      {"sp", &TrainConfig::sp,
       "sequence parallelism (Ulysses): each sequence split over sp ranks (all-to-all attention)",
       [](const TrainConfig& c) { return c.sp < 1 ? std::string("must be >= 1") : ""; }},
      {"optimizer_overlap", &TrainConfig::optimizer_overlap,
       "one device on CUDA: 1 runs each unit's AdamW update on a side stream, the next forward waiting only for "
       "the units it reaches (bit-identical to 0, which updates everything before the next step starts; measured "
       "slower on an H200, see bench/NOTES.md)",
       [](const TrainConfig& c) { return zero_or_one(c.optimizer_overlap); }},
      {"deterministic", &TrainConfig::deterministic,
       "CUDA: 1 (or a bare --deterministic) gives the same bits run to run and an exact --resume: no float atomics "
       "(RMSNorm dw, embedding gradient, router sums in fixed-order partials), cuDNN's deterministic attention "
       "backward; slower (docs/cuda.md). The CPU is deterministic either way",
       [](const TrainConfig& c) { return zero_or_one(c.deterministic); }},
      {"reshard_after_forward", &TrainConfig::reshard_after_forward,
       "FSDP: 1 frees a unit's gathered weights after its forward and gathers them again for its backward; 0 keeps "
       "them (no all-gather in the backward, every unit's full weights held from forward to backward)",
       [](const TrainConfig& c) { return zero_or_one(c.reshard_after_forward); }},
      {"grad_reduce_dtype", &TrainConfig::grad_reduce_dtype,
       "FSDP gradient reduction: f32 (reduce-scatter in fp32) | bf16 (bf16 on the wire, summed in fp32)",
       [](const TrainConfig& c) {
         return one_of(c.grad_reduce_dtype, {"f32", "bf16"});
       }},
      {"comm_timeout_s", &TrainConfig::comm_timeout_s, "seconds before a stuck collective or rendezvous is an error",
       [](const TrainConfig& c) { return c.comm_timeout_s < 1 ? std::string("must be >= 1") : ""; }},
      {"schedule_check", &TrainConfig::schedule_check, "collective-schedule check: off | periodic | per_op (debug)",
       [](const TrainConfig& c) {
         return one_of(c.schedule_check, {"off", "periodic", "per_op"});
       }},
      {"schedule_check_every", &TrainConfig::schedule_check_every, "steps between periodic schedule checks",
       [](const TrainConfig& c) { return c.schedule_check_every < 1 ? std::string("must be >= 1") : ""; }},
  };
  return kFields;
}

std::string normalize_key(std::string k) {
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

[[noreturn]] void unknown_key(const std::string& key, const std::string& origin) {
  std::vector<std::string> keys;
  for (const Field& f : fields()) keys.push_back(f.key);
  const std::vector<std::string> near = near_names(normalize_key(key), keys, keys.size());
  auto dashed = [](std::string k) {
    std::replace(k.begin(), k.end(), '_', '-');
    return k;
  };
  std::string close, flags;
  for (const std::string& name : near) {
    close += str(close.empty() ? "" : ", ", name);
    flags += str(flags.empty() ? "--" : ", --", dashed(name));
  }
  if (origin.rfind("--", 0) == 0)  // the command line: every command's form (cli/options.h)
    MT_THROW("unknown option --", dashed(key), flags.empty() ? "" : "; did you mean " + flags + "?",
             " (--help lists every option)");
  if (!close.empty()) MT_THROW("train config (", origin, "): unknown key '", key, "'; did you mean: ", close, "?");
  std::string all;
  for (const std::string& k : keys) all += str(all.empty() ? "" : ", ", k);
  MT_THROW("train config (", origin, "): unknown key '", key, "'; the keys are: ", all);
}

const Field& find_field(const std::string& key, const std::string& origin) {
  std::string k = normalize_key(key);
  if (k == "run_dir") k = "out_dir";  // the and torchtitan's name for it
  for (const Field& f : fields())
    if (k == f.key) return f;
  unknown_key(key, origin);
}

// The field's value as text, quoted for strings, for error messages.
std::string value_str(const TrainConfig& c, const Field& f) {
  if (auto m = std::get_if<StrMember>(&f.member)) return str("\"", c.**m, "\"");
  if (auto m = std::get_if<IntMember>(&f.member)) return std::to_string(c.**m);
  return real_str(c.*std::get<RealMember>(f.member));
}

void check_rule(const TrainConfig& c, const Field& f, const std::string& origin) {
  std::string why = f.rule(c);
  if (!why.empty()) MT_THROW("train config (", origin, "): ", f.key, " = ", value_str(c, f), " is not allowed: ", why);
}

bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  const char* b = s.data() + (s[0] == '+' ? 1 : 0);
  auto [p, ec] = std::from_chars(b, s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

bool parse_real(const std::string& s, double* out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

void mark_given(TrainConfig& c, const Field& f) {
  if (!train_config_given(c, f.key)) c.given.push_back(f.key);
}

void set_from_text(TrainConfig& c, const Field& f, const std::string& value, const std::string& origin) {
  if (auto m = std::get_if<StrMember>(&f.member)) {
    c.** m = value;
  } else if (auto m = std::get_if<IntMember>(&f.member)) {
    if (is_switch(f.key)) {
      const std::optional<bool> on = bool_word(value);
      if (!on)
        MT_THROW("train config (", origin, "): ", f.key, " = \"", value,
                 "\" is not on or off (on/off, true/false, 1/0, yes/no)");
      c.** m = *on ? 1 : 0;
    } else if (!parse_int(value, &(c.**m)))
      MT_THROW("train config (", origin, "): ", f.key, " = \"", value, "\" is not an integer");
  } else {
    if (!parse_real(value, &(c.*std::get<RealMember>(f.member))))
      MT_THROW("train config (", origin, "): ", f.key, " = \"", value, "\" is not a finite number");
  }
  check_rule(c, f, origin);
  mark_given(c, f);
}

void set_from_json(TrainConfig& c, const Field& f, const nlohmann::json& v, const std::string& origin) {
  auto type_error = [&](const char* want) {
    MT_THROW("train config (", origin, "): ", f.key, " = ", v.dump(), " (", v.type_name(), ") must be ", want);
  };
  if (auto m = std::get_if<StrMember>(&f.member)) {
    if (!v.is_string()) type_error("a string");
    c.** m = v.get<std::string>();
  } else if (auto m = std::get_if<IntMember>(&f.member)) {
    if (is_switch(f.key) && v.is_boolean()) {
      c.** m = v.get<bool>() ? 1 : 0;
    } else if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
        type_error("an integer that fits in int64");
      c.** m = v.get<int64_t>();
    } else if (v.is_number_float() && std::nearbyint(v.get<double>()) == v.get<double>() &&
               std::fabs(v.get<double>()) < 9e15) {
      c.** m = int64_t(v.get<double>());  // 1e3 is written as a float in JSON but means 1000
    } else {
      type_error("an integer");
    }
  } else {
    if (!v.is_number()) type_error("a number");
    c.*std::get<RealMember>(f.member) = v.get<double>();
  }
  check_rule(c, f, origin);
  mark_given(c, f);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("train config: cannot open '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `--key value` / `--key=value` pairs, without the final validation.
void apply_args(TrainConfig& c, const std::vector<std::string>& args, bool allow_config) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 3 || a.rfind("--", 0) != 0)
      MT_THROW("train config: unexpected argument '", a, "'; settings are written --key value or --key=value");
    std::string key, value;
    size_t eq = a.find('=');
    if (eq != std::string::npos) {
      key = a.substr(2, eq - 2);
      value = a.substr(eq + 1);
    } else {
      key = a.substr(2);
      if (normalize_key(key) == "resume" && (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)) {
        set_from_text(c, find_field(key, "--" + key), "latest", "--" + key);  // a bare --resume
        continue;
      }
      if (is_switch(normalize_key(key)) && (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)) {
        set_from_text(c, find_field(key, "--" + key), "1", "--" + key);  // a bare switch is on
        continue;
      }
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
        MT_THROW("train config: --", key, " needs a value (--", key, " VALUE or --", key, "=VALUE)");
      value = args[++i];
    }
    if (normalize_key(key) == "config") {
      if (allow_config) continue;
      MT_THROW("train config: --config is read by train_config_from_args, not as an override");
    }
    set_from_text(c, find_field(key, "--" + key), value, "--" + key);
  }
}

}  // namespace

void apply_json(TrainConfig& c, const std::string& json_text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("train config (", origin, "): not valid JSON: ", e.what());
  }
  if (!j.is_object()) MT_THROW("train config (", origin, "): the top level must be a JSON object, got ", j.type_name());
  TrainConfig next = c;  // `c` is left untouched when a value is rejected
  for (auto it = j.begin(); it != j.end(); ++it) set_from_json(next, find_field(it.key(), origin), it.value(), origin);
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
  apply_args(next, args, false);
  validate_train_config(next);
  c = next;
}

TrainConfig train_config_from_args(const std::vector<std::string>& args) {
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string path;
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) MT_THROW("train config: --config needs a file name");
      path = args[++i];
    } else if (args[i].rfind("--config=", 0) == 0) {
      path = args[i].substr(9);
    } else {
      continue;
    }
    if (!config_path.empty()) MT_THROW("train config: --config given twice ('", config_path, "' and '", path, "')");
    if (path.empty()) MT_THROW("train config: --config needs a file name");
    config_path = path;
  }
  TrainConfig c;
  if (!config_path.empty()) apply_json(c, read_file(config_path), config_path);
  apply_args(c, args, true);
  validate_train_config(c);
  return c;
}

void set_train_config_field(TrainConfig& c, const std::string& key, const std::string& value) {
  TrainConfig next = c;
  set_from_text(next, find_field(key, key), value, key);
  c = next;
}

void validate_train_config(const TrainConfig& c) {
  for (const Field& f : fields()) check_rule(c, f, "validate");
  if (c.min_lr > c.lr)
    MT_THROW("train config: min_lr = ", real_str(c.min_lr), " is not allowed: must be <= lr = ", real_str(c.lr));
  if (c.max_steps > c.steps)
    MT_THROW("train config: max_steps = ", c.max_steps, " is not allowed: must be <= steps = ", c.steps,
             " (steps is the length of the LR schedule; max_steps stops the run earlier)");
  if (c.stop_at_exact_match > 0 && (c.data.rfind("synthetic:", 0) != 0 || c.eval_every < 1))
    MT_THROW("train config: stop_at_exact_match = ", real_str(c.stop_at_exact_match),
             " is not allowed here: it stops at an evaluation of held-out exact match, which needs synthetic data "
             "(data = \"",
             c.data, "\") and eval_every >= 1 (", c.eval_every, ")");
  if (c.data.rfind("synthetic:", 0) == 0 && !c.tokenizer.empty())
    MT_THROW("train config: tokenizer = \"", c.tokenizer, "\" is not allowed with data = \"", c.data,
             "\": the synthetic task has its own character ids, which a tokenizer.json copied into its checkpoints "
             "would decode as another vocabulary's; drop tokenizer");
  if (c.data.rfind("synthetic:", 0) == 0 && c.eval_problems > max_eval_problems(int(c.max_digits)))
    MT_THROW("train config: eval_problems = ", c.eval_problems, " is not allowed with max_digits = ", c.max_digits,
             ": there are only ", max_eval_problems(int(c.max_digits)),
             " distinct held-out problems; use eval_problems <= ", max_eval_problems(int(c.max_digits)));
  if (c.data.rfind("synthetic:", 0) == 0 && c.seq_len < max_problem_tokens(int(c.max_digits)))
    MT_THROW("train config: seq_len = ", c.seq_len, " is not allowed with data = \"", c.data,
             "\" and max_digits = ", c.max_digits, ": a problem takes up to ", max_problem_tokens(int(c.max_digits)),
             " tokens, so seq_len must be >= ", max_problem_tokens(int(c.max_digits)));
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
  nlohmann::ordered_json j;
  for (const Field& f : fields()) {
    if (auto m = std::get_if<StrMember>(&f.member))
      j[f.key] = c.**m;
    else if (auto m = std::get_if<IntMember>(&f.member))
      j[f.key] = c.**m;
    else
      j[f.key] = c.*std::get<RealMember>(f.member);
  }
  return j.dump(2);
}

std::vector<std::string> train_config_keys() {
  std::vector<std::string> keys;
  for (const Field& f : fields()) keys.push_back(f.key);
  return keys;
}

std::string train_config_help(const TrainConfig& defaults) {
  std::string out;
  for (const Field& f : fields()) {
    std::string flag = "--" + std::string(f.key);
    std::replace(flag.begin(), flag.end(), '_', '-');
    out += str("  ", flag, std::string(flag.size() < 20 ? 20 - flag.size() : 1, ' '), f.help, " (default ",
               value_str(defaults, f), ")\n");
  }
  return out;
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
