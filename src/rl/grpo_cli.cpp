// moetrain grpo: GRPO (rl/grpo.h) on the built-in addition task or on the user's prompt files
// (docs/rl.md "moetrain grpo", "Prompt files"), with checkpoints a run can resume from exactly
// ("Checkpoints and resume").
//
// The built-in tasks (--task, TaskPreset below) each name a starting model, made when absent, and a recipe:
// sharpen (the default) the demo's own problems from the demo stopped early, with the standard recipe (an
// exact-answer reward, GRPO's outcome advantages); extend a fourth digit from the full demo, each answer
// token rewarded and credited against the group's samples at the same position. Both evaluate greedy exact
// match on held-out problems before and after and end with `grpo: exact-match <before>% -> <after>% on <n>
// held-out problems`. `--baseline sft` spends the same wall time on supervised fine-tuning instead (the right
// answers of problems from the same distribution, cross-entropy through the same train_step): the
// comparison the docs quote.
//
// `--prompts FILE.jsonl` trains on the user's prompts instead (rollout/prompts.h reads them: prompt_ids,
// prompt or messages, plus answer and free metadata), drawn by a seeded sampler in shuffled epochs, with
// an exact-match, math or external-program reward (rl/rewards.h) on the decoded responses; with
// `--eval-prompts` it ends `grpo: <reward> <before> -> <after> on <n> held-out prompts`.
//
// Checkpoints (train/checkpoint.h): RUN_DIR/checkpoint-N holds the HF weights, the policy's f32 masters
// and AdamW moments, the critic's (PPO) in critic/, and train_state.json (step, optimizer counters, the
// prompt sampler's position or the task's draw count, the reference model's directory and fingerprint,
// the evaluation before training), under a manifest; `--resume` continues from the newest one that
// verifies, and on the CPU equals the run that never stopped, bit for bit. Every option and every prompt
// is checked before any work starts. One process for now.
#include "rl/grpo_cli.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "comm/dist_env.h"
#include "core/cli_args.h"
#include "core/determinism.h"
#include "core/error.h"
#include "core/log.h"
#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "io/manifest.h"
#include "model/hf_checkpoint.h"
#include "rl/grpo.h"
#include "rl/rewards.h"
#include "rollout/prompts.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/session.h"
#include "train/trainer.h"

namespace mt {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using rl::exact_match_reward;
using rl::math_reward;
using rl::RewardBatch;
using rl::RewardProgram;
using rl::RewardProgramOptions;
using rl::RewardRequest;

const char* kUsage =
    "usage: moetrain grpo [options]\n"
    "  --task sharpen|extend     the built-in task and its recipe (default sharpen: 1..3-digit addition from the\n"
    "                            demo stopped early at 15% held-out exact match, runs/grpo-start, trained when\n"
    "                            absent; exact reward, outcome advantages, T 1.0, lr 2e-4, 1000 steps. extend: a\n"
    "                            fourth digit from the full demo, runs/demo/checkpoint-2500: digits reward,\n"
    "                            position advantages, T 1.5, 500 steps); the options below override the recipe\n"
    "  --model DIR               start from this HF checkpoint instead (the task's start by default)\n"
    "  --prompts FILE.jsonl      train on these prompts instead of the built-in task: lines with \"prompt_ids\",\n"
    "                            \"prompt\" (text) or \"messages\" (chat), plus \"answer\" and any metadata\n"
    "                            (text needs DIR/tokenizer.json); drawn in shuffled epochs (--seed)\n"
    "  --eval-prompts FILE.jsonl held-out prompts: greedy reward before and after (with --prompts)\n"
    "  --max-new-tokens N        response length limit with --prompts (default 256)\n"
    "  --reward-timeout S, --reward-on-error zero|stop   a reward program's batch deadline (default 60) and\n"
    "                            what a failed sample does (default zero: reward 0, logged)\n"
    "  --steps N                 GRPO steps (default: the task's)\n"
    "  --prompts-per-step P      groups per step (default 16)\n"
    "  --n G                     samples per prompt (>= 2, default 8)\n"
    "  --min-digits D            built-in task: operands have D..max digits (default 1)\n"
    "  --max-digits D            (default: sharpen 3, extend 4; the demo is trained on 1..3)\n"
    "  --longest on|off          on: at least one operand has max digits (default: sharpen off, extend on)\n"
    "  --algorithm A             grpo | dr-grpo (no std division) | ppo (a critic: GAE advantages; its policy lr\n"
    "                            defaults to 1e-4) (default grpo)\n"
    "  --critic-lr LR, --gamma G, --lam L, --value-clip E   ppo's critic: its AdamW lr (default 5e-4), GAE's\n"
    "                            discount and lambda (defaults 1, 0.95), value clipping (default 0.2; 0 = off)\n"
    "  --loss L                  ppo | gspo | pg (default ppo)\n"
    "  --lr LR                   (default: the task's), --warmup-steps N (default 5), --min-lr LR: a cosine\n"
    "                            decay from LR after the warm-up to this at the last step (default: LR, constant)\n"
    "  --temperature T           sampling temperature > 0, the trainer's log-probs use it too (default: sharpen\n"
    "                            and --prompts 1.0, extend 1.5)\n"
    "  --clip-low E, --clip-high E, --dual-clip C       (defaults 0.2, 0.28, off)\n"
    "  --kl-coef B               KL-to-reference loss weight (default 0), --kl-estimator k1|k2|k3 (default k3)\n"
    "  --kl-reward-coef B        KL to the reference subtracted from the reward instead: -B k(old, ref) per token\n"
    "                            (default 0)\n"
    "  --reward R                built-in task: digits|prefix|exact, the share of answer positions right, of the\n"
    "                            answer right before the first mistake, or 1/0 for an exact answer (default:\n"
    "                            sharpen exact, extend digits; the advantages use it under --advantage outcome\n"
    "                            only, else it is a metric); --prompts: exact (default) | math |\n"
    "                            program:\"CMD ARGS\" (JSON lines\n"
    "                            {prompt, response, metadata} in, a number or {\"reward\": x} out)\n"
    "  --advantage outcome|process|position   one reward per sample (GRPO), or one per answer token (right\n"
    "                            digit: 1) with DeepSeekMath's process-supervised advantages, or each token\n"
    "                            against the group's same position (default: sharpen and --prompts outcome,\n"
    "                            extend position);\n"
    "                            under ppo GAE gets the per-token rewards, or the sample's with outcome\n"
    "  --reference on|off        keep a frozen copy of the initial policy (default on: the KL metric)\n"
    "  --entropy-coef C          (default 0)\n"
    "  --aux-loss-coef C, --router-z-loss-coef C   MoE load-balancing loss (needs output_router_logits in the\n"
    "                            model's config.json) and router z-loss in the update (defaults 0: off)\n"
    "  --freeze-router on|off    keep the routers' weights fixed during RL (default off)\n"
    "  --mismatch-every N        with routing replay, every N steps also measure the rollout/trainer log-prob\n"
    "                            mismatch without it (logprob_diff_*_no_replay; default 10, 0: never)\n"
    "  --tis-cap C, --tis-level token|sequence   truncated importance sampling of the rollout/trainer ratio\n"
    "                            (default off), --token-mask LOW,HIGH, --seq-mask LOW,HIGH   weight 0 for tokens\n"
    "                            (samples: geometric-mean ratio) outside the band (default off)\n"
    "  --aggregation A           token-mean | seq-mean-token-sum | seq-mean-token-mean | constant (default\n"
    "                            token-mean; seq-mean-token-mean under --loss gspo, GSPO's objective)\n"
    "  --dynamic-sampling on|off drop zero-variance groups and refill (default on),\n"
    "                            --max-generate-rounds R (4)\n"
    "  --overlong-filter on|off  weight 0 for samples cut at the length limit (default off)\n"
    "  --overlong-penalty F --overlong-buffer B        DAPO's soft overlong penalty on the sample's reward\n"
    "                            (with --advantage outcome; default off)\n"
    "  --epochs E, --mini-batches M, --micro-batch-samples S   the update (defaults 1, 1, 0 = one)\n"
    "  --old-logprob-forward on|off  a forward for the old log-probs even on-policy (default off: one epoch of\n"
    "                            one mini-batch takes the update's own, detached; the same values)\n"
    "  --eval-problems N         built-in task: held-out problems (default 200)\n"
    "  --baseline sft --sft-seconds S   instead of GRPO, S seconds of SFT on the task's problems (the comparison)\n"
    "  --run-dir DIR             checkpoints and metrics (default runs/grpo; --out-dir is the same)\n"
    "  --save-every N            a checkpoint every N steps (default 0: only at the end), --keep-last K (0: all)\n"
    "  --max-steps N             stop after step N (<= --steps), saving, as train does\n"
    "  --resume [CKPT_DIR]       continue from the newest checkpoint of the run dir whose manifest verifies\n"
    "                            (or from CKPT_DIR); the same options as the run that saved it\n"
    "  --device cpu|cuda|auto, --seed S (1)\n"
    "  --dp-shard N, --dp-replicate N, --ep N, --tp N, --sp N   the layout under moetrain launch (docs/rl.md "
    "\"Several\n"
    "                            ranks\"; --prompts-per-step must divide by dp_replicate x dp_shard)\n"
    "  --comm-timeout-s S        seconds before a stuck collective is an error naming it (default 300)\n"
    "  --deterministic           CUDA: the training kernels without float atomics (docs/cuda.md; the sampler's\n"
    "                            top-p is not covered)";

constexpr const char* kDemoModel = "runs/demo/checkpoint-2500";

// The built-in tasks (--task). Each names its starting model and the recipe its numbers were measured
// with (docs/rl.md "moetrain grpo"); any option given on the command line overrides the preset.
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
  double lr = 2e-4;
  int64_t steps = 500;
};
constexpr double kStartExactMatch = 20;
constexpr double kPpoLr = 1e-4;
constexpr const char* kStartRun = "runs/grpo-start";

TaskPreset task_preset(const std::string& name) {
  if (name == "sharpen") {
    TaskPreset t;
    t.name = name;
    t.start = kStartRun;
    t.start_is_run = true;
    t.steps = 1500;
    return t;
  }
  if (name == "extend") {
    TaskPreset t;
    t.name = name;
    t.start = kDemoModel;
    t.hi = 4;
    t.longest = true;
    t.reward = "digits";
    t.process = t.per_position = true;
    t.temperature = 1.5f;
    t.lr = 2e-4;
    t.steps = 500;
    return t;
  }
  MT_THROW("grpo: --task '", name, "' is unknown; use sharpen (the default) or extend");
}

// The newest complete checkpoint of the early-stopped demo run, or "" when it has none.
std::string start_checkpoint(const std::string& run) {
  if (!fs::is_directory(run)) return "";
  return find_resume_checkpoint(run, "latest").dir;
}

// An exclusive lock on PATH (created when absent), held until the object dies: runs started together (a
// seed study) make the shared starting model once, the others wait for it and then read it.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd_ < 0) MT_THROW("grpo: cannot open the lock file ", path, ": ", std::strerror(errno));
    if (::flock(fd_, LOCK_EX) != 0) {
      const int e = errno;
      ::close(fd_);
      MT_THROW("grpo: cannot lock ", path, ": ", std::strerror(e));
    }
  }
  ~FileLock() { ::close(fd_); }  // closing releases the lock
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

// The task's starting model: made when absent (the demo recipe, trained here), as `moetrain train` would.
std::string ensure_task_start(const TaskPreset& t, const std::string& device_name) {
  auto present = [&t]() -> std::string {  // the start's model directory, "" while it has none
    const std::string dir = t.start_is_run ? start_checkpoint(t.start) : t.start;
    return !dir.empty() && fs::exists(dir + "/config.json") ? dir : "";
  };
  if (std::string dir = present(); !dir.empty()) return dir;
  if (comm::detect_dist_env().world_size > 1)  // a process rendezvouses once: train it in its own run
    MT_THROW("grpo: the starting model ", t.start, " is absent; under moetrain launch make it first, in one process (",
             t.start_is_run ? str("moetrain train --run-dir ", t.start, " --eval-every 50 --stop-at-exact-match ",
                                  kStartExactMatch)
                            : std::string("moetrain train"),
             ")");
  const fs::path parent = fs::path(t.start).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  FileLock lock(t.start + ".lock");
  if (std::string dir = present(); !dir.empty()) return dir;  // another run made it meanwhile
  TrainConfig tc;
  tc.device = device_name;
  if (t.start_is_run) {
    tc.out_dir = t.start;
    tc.eval_every = 50;
    tc.stop_at_exact_match = kStartExactMatch;
    log_info("grpo: ", t.start, " is absent: training the demo model until its held-out exact match reaches ",
             kStartExactMatch, "% (moetrain train --run-dir ", t.start, " --eval-every 50 --stop-at-exact-match ",
             kStartExactMatch, ")");
  } else {
    log_info("grpo: ", t.start, " is absent: training the demo model first (moetrain train)");
  }
  run_training(tc);
  const std::string dir = present();
  if (dir.empty()) MT_THROW("grpo: training the starting model left no checkpoint in ", t.start);
  return dir;
}

std::vector<int32_t> ids32(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

int64_t pow10(int k) {
  int64_t p = 1;
  for (int i = 0; i < k; ++i) p *= 10;
  return p;
}

// Operands with a digit count uniform in [lo, hi], uniform among those numbers (1 digit includes 0).
int64_t operand(Rng& rng, int lo, int hi) {
  const int k = int(rng.randint(lo, hi + 1));
  return rng.randint(k == 1 ? 0 : pow10(k - 1), pow10(k));
}

// The task's problems: training never draws a held-out pair (synthetic.h's split), evaluation only those.
// longest: at least one operand has `hi` digits (the problems a model trained on shorter ones fails).
struct Task {
  int lo = 1, hi = 4;
  bool longest = true;
  bool wanted(int64_t a, int64_t b) const { return !longest || std::max(a, b) >= pow10(hi - 1); }
  Problem train(Rng& rng) const {
    for (;;) {
      const int64_t a = operand(rng, lo, hi), b = operand(rng, lo, hi);
      if (!is_eval_pair(a, b) && wanted(a, b)) return make_addition_problem(a, b);
    }
  }
  std::vector<Problem> eval(int64_t n, uint64_t seed) const {
    Rng rng{mix64(seed ^ 0x6772706f5f657661ull)};
    std::set<std::pair<int64_t, int64_t>> seen;
    std::vector<Problem> out;
    for (int64_t tries = 0; int64_t(out.size()) < n; ++tries) {
      if (tries > 1000 * n + 100000)
        MT_THROW("grpo: could not draw ", n, " distinct held-out problems with ", lo, "..", hi,
                 "-digit operands; ask for fewer (--eval-problems)");
      const int64_t a = operand(rng, lo, hi), b = operand(rng, lo, hi);
      if (is_eval_pair(a, b) && wanted(a, b) && seen.insert({a, b}).second) out.push_back(make_addition_problem(a, b));
    }
    return out;
  }
};

// Greedy exact match on the held-out problems, through the engine.
double exact_match(RolloutEngine& engine, const std::vector<Problem>& problems, int max_digits) {
  std::vector<GenerateRequest> reqs;
  for (const Problem& p : problems) {
    GenerateRequest r;
    r.prompt = ids32(p.prompt_ids);
    r.sampling.temperature = 0;
    r.max_new_tokens = max_answer_tokens(max_digits);
    reqs.push_back(r);
  }
  const std::vector<GeneratedSample> out = engine.generate(reqs);
  int64_t correct = 0;
  for (const GeneratedSample& g : out)
    correct += check_answer(problems[size_t(g.prompt_index)], std::vector<int64_t>(g.tokens.begin(), g.tokens.end()));
  return 100.0 * double(correct) / double(problems.size());
}

// The reward of a response. exact: 1 or 0. prefix: the share of the answer (digits, then <eos>) right
// before the first mistake. digits: the share of the answer's positions the response gets right (a 4-digit
// sum with a wrong tens digit scores 5/6 rather than 0), so groups on problems the model never solves
// still differ. An exact answer scores 1 under each, and only an exact answer does.
enum class Reward { Exact, Prefix, Digits };
double answer_reward(const Problem& p, const std::vector<int32_t>& tokens, Reward kind) {
  if (kind == Reward::Exact) return check_answer(p, std::vector<int64_t>(tokens.begin(), tokens.end())) ? 1.0 : 0.0;
  size_t k = 0, right = 0;
  while (k < p.answer_ids.size() && k < tokens.size() && int64_t(tokens[k]) == p.answer_ids[k]) ++k;
  for (size_t i = 0; i < p.answer_ids.size() && i < tokens.size(); ++i) right += int64_t(tokens[i]) == p.answer_ids[i];
  return double(kind == Reward::Prefix ? k : right) / double(p.answer_ids.size());
}

// Process rewards: 1 for each response token equal to the answer's token at its position, else 0 (the
// digits reward spread over the tokens).
std::vector<double> answer_token_rewards(const Problem& p, const std::vector<int32_t>& tokens) {
  std::vector<double> r(tokens.size(), 0.0);
  for (size_t i = 0; i < tokens.size() && i < p.answer_ids.size(); ++i) r[i] = int64_t(tokens[i]) == p.answer_ids[i];
  return r;
}

bool parse_on_off(const std::string& flag, const std::string& v) {
  if (v == "on") return true;
  if (v == "off") return false;
  MT_THROW("grpo: ", flag, " '", v, "'; use on or off");
}

// One SFT micro-batch of `rows` problems: prompt -100, answer tokens as targets (HF labels).
MicroBatch sft_batch(const Task& task, Rng& rng, int64_t rows) {
  const int64_t S = max_problem_tokens(task.hi);
  Tensor ids = Tensor::zeros({rows, S}, DType::I64), labels = Tensor::empty({rows, S}, DType::I64);
  for (int64_t i = 0; i < rows * S; ++i) labels.data<int64_t>()[i] = -100;
  for (int64_t r = 0; r < rows; ++r) {
    const Problem p = task.train(rng);
    int64_t s = 0;
    for (int64_t id : p.prompt_ids) ids.data<int64_t>()[r * S + s++] = id;
    for (int64_t id : p.answer_ids) {
      ids.data<int64_t>()[r * S + s] = labels.data<int64_t>()[r * S + s] = id;
      ++s;
    }
  }
  return MicroBatch{ids, labels};
}

// ---- Prompt files --------------------------------------------------------------------------------

enum class FileReward { Exact, Math, Program };

// A prompt file and what its rewards need. The answers are read (and checked) once, before any work.
struct PromptFile {
  std::string path;
  std::vector<Prompt> prompts;
  std::vector<std::string> answers;              // text answers (with a tokenizer)
  std::vector<std::vector<int32_t>> answer_ids;  // token-id answers (exact match without a tokenizer)
};

PromptFile load_prompt_file(const std::string& path, const ModelConfig& cfg, int64_t max_new_tokens,
                            const Tokenizer* tok, FileReward reward) {
  const int64_t room = cfg.max_position_embeddings - max_new_tokens;
  if (room < 1)
    MT_THROW("grpo: --max-new-tokens ", max_new_tokens, " leaves no room for a prompt in the model's ",
             cfg.max_position_embeddings, " positions");
  PromptFile f;
  f.path = path;
  f.prompts = read_prompts(path, cfg.vocab_size, room, tok);  // errors name the line (and the tokenizer's absence)
  const bool needs_answer = reward != FileReward::Program;
  for (const Prompt& p : f.prompts) {
    const std::string where = path + ":" + std::to_string(p.line);
    auto it = p.meta.find("answer");
    if (it == p.meta.end()) {
      if (needs_answer)
        MT_THROW(where, ": no \"answer\"; the ", reward == FileReward::Exact ? "exact" : "math",
                 " reward compares the response with it (add \"answer\" or use --reward program:CMD)");
      f.answers.emplace_back();
      f.answer_ids.emplace_back();
      continue;
    }
    const json& a = *it;
    std::vector<int32_t> ids;
    std::string text;
    if (a.is_string())
      text = a.get<std::string>();
    else if (a.is_number())
      text = a.dump();
    else if (a.is_array() && !tok && reward == FileReward::Exact) {
      for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].is_number_integer() || a[i].get<int64_t>() < 0 || a[i].get<int64_t>() >= cfg.vocab_size)
          MT_THROW(where, ": answer[", i, "] is ", a[i].dump(), ", not a token id in [0, ", cfg.vocab_size, ")");
        ids.push_back(int32_t(a[i].get<int64_t>()));
      }
    } else if (needs_answer) {
      MT_THROW(
          where, ": \"answer\" is ", a.dump().substr(0, 80), "; ",
          tok ? "use a string or a number" : "without a tokenizer, exact match compares token ids: use a list of ids");
    }
    if (needs_answer && !tok && ids.empty())
      MT_THROW(where, ": \"answer\" is ", a.dump().substr(0, 80),
               "; the model directory has no tokenizer.json, so responses have no text: exact match then "
               "compares token ids (give \"answer\" as a list of ids), and math needs the tokenizer");
    f.answers.push_back(std::move(text));
    f.answer_ids.push_back(std::move(ids));
  }
  return f;
}

// Prompts drawn in epochs, each a permutation of the file seeded by (seed, epoch): the position (prompts
// drawn so far) is the whole state a checkpoint needs.
class PromptSampler {
 public:
  PromptSampler(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}
  int64_t next() {
    const int64_t epoch = pos_ / size_;
    if (epoch != epoch_) {
      order_.resize(size_t(size_));
      for (int64_t i = 0; i < size_; ++i) order_[size_t(i)] = i;
      Rng rng{mix64(seed_ ^ mix64(uint64_t(epoch) + 0x70726f6d7074ull))};
      for (int64_t i = size_ - 1; i > 0; --i) std::swap(order_[size_t(i)], order_[size_t(rng.randint(0, i + 1))]);
      epoch_ = epoch;
    }
    return order_[size_t(pos_++ % size_)];
  }
  int64_t position() const { return pos_; }
  void set_position(int64_t p) { pos_ = p; }

 private:
  int64_t size_;
  uint64_t seed_;
  int64_t pos_ = 0, epoch_ = -1;
  std::vector<int64_t> order_;
};

// The response without its final stop token (the EOS or a stop token, which the engine includes).
std::vector<int32_t> response_ids(const GeneratedSample& g) {
  std::vector<int32_t> ids = g.tokens;
  if (g.finish_reason == "stop" && !ids.empty()) ids.pop_back();
  return ids;
}

std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<uint32_t> u;  // ids the tokenizer lacks (a padded vocabulary) have no text
  for (int32_t t : ids)
    if (t >= 0 && uint32_t(t) < tok.vocab_size()) u.push_back(uint32_t(t));
  return tok.decode(u, true);
}

// The rewards of a prompt file's samples: `which[k]` is the file index of the round's prompt k.
struct FileRewarder {
  FileReward kind = FileReward::Exact;
  const Tokenizer* tok = nullptr;
  RewardProgram* program = nullptr;

  std::vector<double> operator()(const PromptFile& f, const std::vector<int64_t>& which,
                                 const std::vector<GeneratedSample>& gen) const {
    std::vector<double> r(gen.size(), 0.0);
    std::vector<RewardRequest> reqs;
    for (size_t i = 0; i < gen.size(); ++i) {
      const int64_t k = which.at(size_t(gen[i].prompt_index));
      const Prompt& p = f.prompts[size_t(k)];
      const std::vector<int32_t> ids = response_ids(gen[i]);
      if (kind == FileReward::Exact && !tok) {
        r[i] = ids == f.answer_ids[size_t(k)] ? 1.0 : 0.0;
      } else if (kind == FileReward::Exact) {
        r[i] = exact_match_reward(decode_text(*tok, ids), f.answers[size_t(k)]);
      } else if (kind == FileReward::Math) {
        r[i] = math_reward(decode_text(*tok, ids), f.answers[size_t(k)]);
      } else {
        RewardRequest q;
        auto pt = p.meta.find("prompt");
        q.prompt = pt != p.meta.end() && pt->is_string()
                       ? pt->get<std::string>()
                       : (tok ? tok->decode(std::vector<uint32_t>(p.ids.begin(), p.ids.end())) : json(p.ids).dump());
        q.response = tok ? decode_text(*tok, ids) : json(ids).dump();
        q.metadata = p.meta;
        reqs.push_back(std::move(q));
      }
    }
    if (kind == FileReward::Program) {
      const RewardBatch b = program->score(reqs);
      r = b.rewards;
    }
    return r;
  }
};

// ---- Checkpoints ---------------------------------------------------------------------------------

// The reference model's files as they were: name, size and modification time of every regular file in
// its directory (cheap at any model size; a file rewritten in place changes its mtime).
json model_fingerprint(const std::string& dir) {
  json files = json::array();
  std::vector<fs::path> paths;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if (it->is_regular_file()) paths.push_back(it->path());
  if (ec) MT_THROW("grpo: cannot list the model directory ", dir, ": ", ec.message());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    struct stat sb {};
    if (::stat(p.c_str(), &sb) != 0) MT_THROW("grpo: cannot stat ", p.string(), ": ", std::strerror(errno));
    files.push_back({{"name", p.filename().string()},
                     {"size", int64_t(sb.st_size)},
                     {"mtime_ns", int64_t(sb.st_mtim.tv_sec) * 1000000000 + int64_t(sb.st_mtim.tv_nsec)}});
  }
  return files;
}

// "" when `now` equals `saved`, else what changed (the first difference).
std::string fingerprint_change(const json& saved, const json& now) {
  std::map<std::string, json> a, b;
  for (const json& e : saved) a[e.at("name").get<std::string>()] = e;
  for (const json& e : now) b[e.at("name").get<std::string>()] = e;
  for (const auto& [name, e] : a) {
    auto it = b.find(name);
    if (it == b.end()) return name + " is gone";
    if (it->second.at("size") != e.at("size"))
      return str(name, " has ", it->second.at("size").get<int64_t>(), " bytes, it had ", e.at("size").get<int64_t>());
    if (it->second.at("mtime_ns") != e.at("mtime_ns")) return name + " was modified (its mtime changed)";
  }
  for (const auto& [name, e] : b)
    if (!a.count(name)) return name + " is new";
  return "";
}

// The command line a checkpoint records (less the options that may change between a save and its resume:
// the layout too, since the state is resharded on resume).
json recorded_args(const std::vector<std::string>& args) {
  json out = json::array();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--max-steps" || a == "--save-every" || a == "--keep-last" || a == "--device" || a == "--dp-shard" ||
        a == "--dp-replicate" || a == "--ep" || a == "--tp" || a == "--sp" || a == "--comm-timeout-s") {
      ++i;
      continue;
    }
    if (a == "--resume") {
      if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) ++i;
      continue;
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace

int grpo_main(const std::vector<std::string>& args) {
  // The built-in task's preset first: the options below override its values.
  std::string task_name = "sharpen";
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--task") task_name = args[i + 1];
  const TaskPreset preset = task_preset(task_name);
  std::string model_dir, device_name = "auto", run_dir = "runs/grpo", baseline, reward_spec;
  std::string prompts_path, eval_prompts_path, resume;
  int64_t steps = preset.steps, per_step = 16, eval_n = 200, seed = 1, warmup = 5, max_new_tokens = -1;
  std::optional<double> min_lr;  // --min-lr: a cosine decay to it; unset: constant after the warm-up
  int64_t save_every = 0, keep_last = 0, max_steps = 0;
  MeshSpec mesh;  // under moetrain launch
  double sft_seconds = 0, reward_timeout = 60, comm_timeout_s = 300;
  bool reward_stop = false, model_given = false;
  Task task;
  task.lo = preset.lo;
  task.hi = preset.hi;
  task.longest = preset.longest;
  bool use_reference = true;
  Reward reward_kind = Reward::Digits;
  std::string advantage_given;
  bool temperature_given = false;
  std::string aggregation_name;         // --aggregation as given ("": the loss's own, below)
  std::vector<std::string> task_flags;  // built-in task options given (refused with --prompts)
  bool process = preset.process, per_position = preset.per_position;
  bool ppo = false;
  rl::GrpoOptions o;
  o.n = 8;
  o.lr = preset.lr;
  o.critic_lr = 5e-4;
  o.sampling.temperature = preset.temperature;
  o.loss.clip_high = 0.28;
  o.dynamic_sampling = true;
  o.progress_every_s = 10;
  std::set<std::string> given;  // the options on the command line
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    given.insert(a);
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) MT_THROW("grpo: ", a, " needs a value; ", kUsage);
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      std::printf("%s\n", kUsage);
      return 0;
    } else if (a == "--task") {
      value();  // applied above, before the other options
      task_flags.push_back(a);
    } else if (a == "--model") {
      model_dir = value();
      model_given = true;
    } else if (a == "--prompts")
      prompts_path = value();
    else if (a == "--eval-prompts")
      eval_prompts_path = value();
    else if (a == "--max-new-tokens")
      max_new_tokens = parse_flag_number<int64_t>(a, value());
    else if (a == "--reward-timeout")
      reward_timeout = parse_flag_number<double>(a, value());
    else if (a == "--reward-on-error") {
      const std::string v = value();
      if (v != "zero" && v != "stop") MT_THROW("grpo: --reward-on-error '", v, "'; use zero or stop");
      reward_stop = v == "stop";
    } else if (a == "--steps")
      steps = parse_flag_number<int64_t>(a, value());
    else if (a == "--prompts-per-step")
      per_step = parse_flag_number<int64_t>(a, value());
    else if (a == "--n")
      o.n = parse_flag_number<int64_t>(a, value());
    else if (a == "--min-digits") {
      task.lo = parse_flag_number<int>(a, value());
      task_flags.push_back(a);
    } else if (a == "--max-digits") {
      task.hi = parse_flag_number<int>(a, value());
      task_flags.push_back(a);
    } else if (a == "--algorithm") {
      const std::string v = value();
      if (v != "grpo" && v != "dr-grpo" && v != "ppo")
        MT_THROW("grpo: --algorithm '", v, "' is unknown; use grpo, dr-grpo or ppo");
      ppo = v == "ppo";  // the last one given runs
      o.normalize_std = v != "dr-grpo";
    } else if (a == "--critic-lr") {
      o.critic_lr = parse_flag_number<double>(a, value());
    } else if (a == "--gamma") {
      o.gamma = parse_flag_number<double>(a, value());
    } else if (a == "--lam") {
      o.lam = parse_flag_number<double>(a, value());
    } else if (a == "--value-clip") {
      o.value_clip = parse_flag_number<double>(a, value());
    } else if (a == "--longest") {
      task.longest = parse_on_off(a, value());
      task_flags.push_back(a);
    } else if (a == "--reward") {
      reward_spec = value();
    } else if (a == "--advantage") {
      const std::string v = value();
      advantage_given = v;
      if (v == "outcome")
        process = false;
      else if (v == "process") {  // the same token rewards, DeepSeekMath's advantages (not per position)
        process = true;
        per_position = false;
      } else if (v == "position")
        process = per_position = true;
      else
        MT_THROW("grpo: --advantage '", v, "' is unknown; use outcome, process or position");
    } else if (a == "--loss")
      o.loss.kind = rl::parse_policy_loss(value());
    else if (a == "--lr")
      o.lr = parse_flag_number<double>(a, value());
    else if (a == "--warmup-steps")
      warmup = parse_flag_number<int64_t>(a, value());
    else if (a == "--min-lr")
      min_lr = parse_flag_number<double>(a, value());
    else if (a == "--temperature") {
      o.sampling.temperature = parse_flag_number<float>(a, value());
      temperature_given = true;
    } else if (a == "--clip-low")
      o.loss.clip_low = parse_flag_number<double>(a, value());
    else if (a == "--clip-high")
      o.loss.clip_high = parse_flag_number<double>(a, value());
    else if (a == "--dual-clip")
      o.loss.dual_clip = parse_flag_number<double>(a, value());
    else if (a == "--kl-coef")
      o.loss.kl_coef = parse_flag_number<double>(a, value());
    else if (a == "--kl-estimator")
      o.loss.kl = rl::parse_kl_estimator(value());
    else if (a == "--reference")
      use_reference = parse_on_off(a, value());
    else if (a == "--entropy-coef")
      o.loss.entropy_coef = parse_flag_number<double>(a, value());
    else if (a == "--deterministic")
      set_deterministic(true);  // a bare flag: CUDA kernels without float atomics (docs/cuda.md)
    else if (a == "--kl-reward-coef")
      o.kl_reward_coef = parse_flag_number<double>(a, value());
    else if (a == "--aux-loss-coef")
      o.aux_loss_coef = parse_flag_number<double>(a, value());
    else if (a == "--router-z-loss-coef")
      o.router_z_loss_coef = parse_flag_number<double>(a, value());
    else if (a == "--freeze-router")
      o.freeze_router = parse_on_off(a, value());
    else if (a == "--mismatch-every")
      o.mismatch_every = parse_flag_number<int64_t>(a, value());
    else if (a == "--tis-cap")
      o.mismatch.tis_cap = parse_flag_number<double>(a, value());
    else if (a == "--tis-level") {
      const std::string v = value();
      if (v != "token" && v != "sequence") MT_THROW("grpo: --tis-level '", v, "'; use token or sequence");
      o.mismatch.tis_sequence = v == "sequence";
    } else if (a == "--token-mask" || a == "--seq-mask") {
      const std::string v = value();
      const size_t comma = v.find(',');
      if (comma == std::string::npos) MT_THROW("grpo: ", a, " '", v, "'; use LOW,HIGH (e.g. 0.5,2)");
      const double lo = parse_flag_number<double>(a, v.substr(0, comma)),
                   hi = parse_flag_number<double>(a, v.substr(comma + 1));
      if (!(lo >= 0 && lo < hi))  // the loop reads HIGH <= 0 as "no mask"
        MT_THROW("grpo: ", a, " '", v, "'; need 0 <= LOW < HIGH (e.g. 0.5,2)");
      (a == "--token-mask" ? o.mismatch.token_mask_low : o.mismatch.seq_mask_low) = lo;
      (a == "--token-mask" ? o.mismatch.token_mask_high : o.mismatch.seq_mask_high) = hi;
    } else if (a == "--aggregation") {
      aggregation_name = value();
      o.aggregation = rl::parse_loss_aggregation(aggregation_name);
    } else if (a == "--dynamic-sampling") {
      o.dynamic_sampling = parse_on_off(a, value());
    } else if (a == "--max-generate-rounds")
      o.max_generate_rounds = parse_flag_number<int64_t>(a, value());
    else if (a == "--overlong-filter")
      o.overlong_filter = parse_on_off(a, value());
    else if (a == "--overlong-penalty")
      o.overlong_penalty = parse_flag_number<double>(a, value());
    else if (a == "--overlong-buffer")
      o.overlong_buffer = parse_flag_number<int64_t>(a, value());
    else if (a == "--epochs")
      o.epochs = parse_flag_number<int64_t>(a, value());
    else if (a == "--mini-batches")
      o.mini_batches = parse_flag_number<int64_t>(a, value());
    else if (a == "--old-logprob-forward")
      o.old_logprob_forward = parse_on_off(a, value());
    else if (a == "--micro-batch-samples")
      o.micro_batch_samples = parse_flag_number<int64_t>(a, value());
    else if (a == "--eval-problems") {
      eval_n = parse_flag_number<int64_t>(a, value());
      task_flags.push_back(a);
    } else if (a == "--baseline") {
      baseline = value();
      if (baseline != "sft") MT_THROW("grpo: --baseline '", baseline, "' is unknown; use sft");
    } else if (a == "--sft-seconds")
      sft_seconds = parse_flag_number<double>(a, value());
    else if (a == "--device")
      device_name = value();
    else if (a == "--out-dir" || a == "--run-dir")
      run_dir = value();
    else if (a == "--save-every")
      save_every = parse_flag_number<int64_t>(a, value());
    else if (a == "--keep-last")
      keep_last = parse_flag_number<int64_t>(a, value());
    else if (a == "--max-steps")
      max_steps = parse_flag_number<int64_t>(a, value());
    else if (a == "--resume")
      resume = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0 ? args[++i] : std::string("latest");
    else if (a == "--dp-shard")
      mesh.dp_shard = parse_flag_number<int>(a, value());
    else if (a == "--dp-replicate")
      mesh.dp_replicate = parse_flag_number<int>(a, value());
    else if (a == "--ep")
      mesh.ep = parse_flag_number<int>(a, value());
    else if (a == "--tp")
      mesh.tp = parse_flag_number<int>(a, value());
    else if (a == "--sp")
      mesh.sp = parse_flag_number<int>(a, value());
    else if (a == "--comm-timeout-s") {
      comm_timeout_s = parse_flag_number<double>(a, value());
      if (!(comm_timeout_s >= 1)) MT_THROW("grpo: --comm-timeout-s ", comm_timeout_s, "; need seconds >= 1");
    } else if (a == "--seed")
      seed = parse_flag_number<int64_t>(a, value());
    else
      MT_THROW("grpo: unknown argument '", a, "'; ", kUsage);
  }
  // Every check before any work.
  const bool from_file = !prompts_path.empty();
  // GSPO's objective is a mean over sequences (seq-mean-token-mean); the others' default is token-mean.
  if (aggregation_name.empty()) {
    aggregation_name = o.loss.kind == rl::PolicyLoss::Gspo ? "seq-mean-token-mean" : "token-mean";
    o.aggregation = rl::parse_loss_aggregation(aggregation_name);
  }
  // Under tp or sp a rank holds part of each sample's tokens, and GSPO's ratio is over the whole sample.
  if (o.loss.kind == rl::PolicyLoss::Gspo && (mesh.tp > 1 || mesh.sp > 1))
    MT_THROW("grpo: --loss gspo under --tp ", mesh.tp, " --sp ", mesh.sp,
             ": its sequence ratio needs each sample's tokens on one rank; use --dp-shard, --dp-replicate or --ep");
  if (o.n < 2) MT_THROW("grpo: --n ", o.n, " samples per prompt; group advantages need at least 2");
  if (steps < 1) MT_THROW("grpo: --steps ", steps, "; need >= 1");
  if (per_step < 1) MT_THROW("grpo: --prompts-per-step ", per_step, "; need >= 1");
  if (eval_n < 1) MT_THROW("grpo: --eval-problems ", eval_n, "; need >= 1");
  if (warmup < 0) MT_THROW("grpo: --warmup-steps ", warmup, "; need >= 0");
  if (min_lr && !(*min_lr >= 0 && *min_lr <= o.lr))
    MT_THROW("grpo: --min-lr ", *min_lr, "; need 0 <= min-lr <= --lr (", o.lr, ")");
  if (save_every < 0) MT_THROW("grpo: --save-every ", save_every, "; need >= 0 (0: only at the end)");
  if (keep_last < 0) MT_THROW("grpo: --keep-last ", keep_last, "; need >= 0 (0: keep all)");
  if (max_steps < 0 || max_steps > steps)
    MT_THROW("grpo: --max-steps ", max_steps, "; need 1..--steps (", steps, "), or 0 for --steps");
  if (!(reward_timeout > 0)) MT_THROW("grpo: --reward-timeout ", reward_timeout, "; need seconds > 0");
  if (task.lo < 1 || task.hi > kMaxAdditionDigits || task.lo > task.hi)
    MT_THROW("grpo: --min-digits ", task.lo, " and --max-digits ", task.hi,
             "; need 1 <= min <= max <= ", kMaxAdditionDigits);
  if (o.mini_batches > per_step)
    MT_THROW("grpo: --mini-batches ", o.mini_batches, " > --prompts-per-step ", per_step,
             "; a mini-batch holds whole groups");
  if (!baseline.empty() && !(sft_seconds > 0))
    MT_THROW("grpo: --baseline sft needs --sft-seconds S > 0 (the wall time of the run it is compared with)");
  if (baseline.empty() && sft_seconds != 0) MT_THROW("grpo: --sft-seconds ", sft_seconds, " without --baseline sft");
  if (!baseline.empty() && (!resume.empty() || save_every > 0 || max_steps > 0))
    MT_THROW("grpo: --baseline sft runs for a wall time; --resume, --save-every and --max-steps are for GRPO runs");
  if (o.loss.kl_coef > 0 && !use_reference)
    MT_THROW("grpo: --kl-coef ", o.loss.kl_coef, " needs the reference model; drop --reference off");
  if (o.kl_reward_coef > 0 && !use_reference)
    MT_THROW("grpo: --kl-reward-coef ", o.kl_reward_coef, " needs the reference model; drop --reference off");
  // PPO has no group baseline: a group of equal rewards still trains the critic and has GAE advantages.
  // PPO's policy takes smaller steps than GRPO's by default: its whitened GAE advantages carry the critic's
  // error too (measured: lr 2e-4 loses the reward the task starts with, 1e-4 gains; docs/rl.md).
  if (ppo && !given.count("--lr")) o.lr = kPpoLr;
  if (!ppo && (o.critic_lr != 5e-4 || o.gamma != 1.0 || o.lam != rl::GrpoOptions{}.lam ||
               o.value_clip != rl::GrpoOptions{}.value_clip))
    MT_THROW(
        "grpo: --critic-lr, --gamma, --lam and --value-clip set the critic of --algorithm ppo; the algorithm "
        "here has none");
  if (ppo && !advantage_given.empty() && advantage_given != "outcome")
    MT_THROW("grpo: --advantage ", advantage_given,
             " is a group estimator; under --algorithm ppo the advantages are GAE's over the critic's values, on "
             "the per-token rewards (the default) or, with --advantage outcome, on the sample's reward at its last "
             "token");
  // The reward: the built-in task's kinds, or a prompt file's.
  FileReward file_reward = FileReward::Exact;
  std::string program_cmd;
  if (from_file) {
    if (!task_flags.empty())
      MT_THROW("grpo: ", task_flags.front(), " sets the built-in addition task; with --prompts the prompts come from ",
               prompts_path);
    if (!baseline.empty()) MT_THROW("grpo: --baseline sft compares on the built-in task; drop --prompts");
    if (reward_spec.empty() || reward_spec == "exact")
      file_reward = FileReward::Exact;
    else if (reward_spec == "math")
      file_reward = FileReward::Math;
    else if (reward_spec.rfind("program:", 0) == 0) {
      file_reward = FileReward::Program;
      program_cmd = reward_spec.substr(8);
      if (program_cmd.find_first_not_of(" \t") == std::string::npos)
        MT_THROW("grpo: --reward program: needs a command, e.g. --reward program:\"python3 score.py\"");
    } else
      MT_THROW("grpo: --reward '", reward_spec, "' is unknown with --prompts; use exact, math or program:CMD");
    if (!advantage_given.empty() && advantage_given != "outcome")
      MT_THROW("grpo: --advantage ", advantage_given,
               " needs per-token rewards, which only the built-in task has; with --prompts use outcome");
    process = false;
    // 1.5 suits the built-in task's small model; a user's model samples at its usual temperature.
    if (!temperature_given) o.sampling.temperature = 1.0f;
    if (max_new_tokens == -1) max_new_tokens = 256;
    if (max_new_tokens < 1) MT_THROW("grpo: --max-new-tokens ", max_new_tokens, "; need >= 1");
  } else {
    if (!eval_prompts_path.empty()) MT_THROW("grpo: --eval-prompts needs --prompts (the training prompts)");
    if (max_new_tokens != -1)
      MT_THROW(
          "grpo: --max-new-tokens sets the response length of --prompts; the built-in task's comes from "
          "--max-digits");
    if (reward_spec.empty()) reward_spec = preset.reward;
    if (reward_spec == "digits")
      reward_kind = Reward::Digits;
    else if (reward_spec == "exact")
      reward_kind = Reward::Exact;
    else if (reward_spec == "prefix")
      reward_kind = Reward::Prefix;
    else if (reward_spec == "math" || reward_spec.rfind("program:", 0) == 0)
      MT_THROW("grpo: --reward ", reward_spec, " scores the responses to a prompt file; give it with --prompts FILE");
    else
      MT_THROW("grpo: --reward '", reward_spec, "' is unknown; use digits, prefix or exact");
  }
  o.max_new_tokens = from_file ? max_new_tokens : max_answer_tokens(task.hi);
  rl::validate(o);
  // The soft overlong penalty is added to the sample's reward; per-token rewards replace that reward in the
  // advantages (and in PPO's returns), so the penalty would only change the reward metrics.
  if (process && o.overlong_penalty > 0)
    MT_THROW("grpo: --overlong-penalty ", o.overlong_penalty, " shapes the sample's reward, which --advantage ",
             advantage_given.empty() ? "position (the task's default)" : advantage_given,
             " does not train on (its advantages come from the per-token rewards); add --advantage outcome or drop "
             "--overlong-penalty");
  // Options that refine another one: without it they would do nothing.
  auto refines = [&](const char* flag, bool applies, const std::string& why) {
    if (given.count(flag) && !applies) MT_THROW("grpo: ", flag, " ", why);
  };
  for (const char* f : {"--reward-timeout", "--reward-on-error"})
    refines(f, file_reward == FileReward::Program && from_file,
            "sets the reward program's deadline or failure handling; there is no program without --prompts FILE "
            "--reward program:CMD");
  refines("--tis-level", o.mismatch.tis_cap > 0,
          "chooses the level of truncated importance sampling, which is off without --tis-cap C");
  refines("--overlong-buffer", o.overlong_penalty > 0,
          "is the soft overlong penalty's buffer, which is off without --overlong-penalty F");
  refines("--max-generate-rounds", o.dynamic_sampling,
          "caps dynamic sampling's generate rounds, which --dynamic-sampling off turns off");
  refines("--kl-estimator", use_reference,
          "measures the KL to the reference model, which --reference off drops (no KL metric, loss or reward term)");
  for (const char* f : {"--clip-low", "--clip-high", "--dual-clip"})
    refines(f, o.loss.kind != rl::PolicyLoss::PolicyGradient,
            "clips the policy ratio; --loss pg has no ratio to clip (use --loss ppo or gspo, or drop it)");
  if (!from_file && eval_n > max_eval_problems(task.hi))
    MT_THROW("grpo: --eval-problems ", eval_n, " > the ", max_eval_problems(task.hi), " held-out pairs of the task");
  const Device device = resolve_device(device_name);

  // Resume: the newest checkpoint of the run dir that verifies (train/checkpoint.h).
  std::string resume_dir;
  json state;
  if (!resume.empty()) {
    const ResumePoint rp = find_resume_checkpoint(run_dir, resume);
    for (const std::string& r : rp.rejected) log_info("resume: not using ", r);
    if (rp.dir.empty() && !rp.rejected.empty()) {
      std::string all;
      for (const std::string& r : rp.rejected) all += "; " + r;
      MT_THROW("grpo: resume: no checkpoint in ", run_dir, " can be resumed from", all,
               " (remove them or drop --resume to start over)");
    }
    if (rp.dir.empty())
      log_info("grpo: resume: no checkpoint in ", run_dir, " yet; starting from step 0");
    else {
      resume_dir = rp.dir;
      state = read_train_state(resume_dir);
      if (state.value("format", std::string()) != "moetrain-grpo-state-1")
        MT_THROW("grpo: resume: ", resume_dir, " holds a '", state.value("format", std::string("?")),
                 "' state, not a grpo run's (moetrain-grpo-state-1)");
      const std::string saved_model = state.at("model_dir").get<std::string>();
      if (!model_given)
        model_dir = saved_model;
      else if (fs::weakly_canonical(model_dir) != fs::weakly_canonical(saved_model))
        MT_THROW("grpo: resume: --model ", model_dir, ", but the run being resumed started from ", saved_model,
                 " (its reference model); drop --model or give that directory");
      if (state.at("mode").get<std::string>() != (from_file ? "prompts" : "task"))
        MT_THROW("grpo: resume: ", resume_dir, " is a ",
                 state.at("mode").get<std::string>() == "prompts" ? "run on --prompts; give the same --prompts"
                                                                  : "run on the built-in task; drop --prompts");
      if (state.contains("critic") != ppo)
        MT_THROW("grpo: resume: ", resume_dir,
                 ppo ? " has no critic: it was not an --algorithm ppo run"
                     : " holds a critic: resume it with --algorithm ppo");
      // --model is checked above on its own (a resume may leave it out): the other options are compared.
      auto without_model = [](json a) {
        for (size_t k = 0; k + 1 < a.size(); ++k)
          if (a[k] == "--model") a.erase(a.begin() + std::ptrdiff_t(k), a.begin() + std::ptrdiff_t(k) + 2);
        return a;
      };
      if (without_model(state.value("args", json::array())) != without_model(recorded_args(args)))
        log_info("grpo: resume: warning: the options differ from the saved run's (", state["args"].dump(), " -> ",
                 recorded_args(args).dump(), ")");
    }
  }
  const bool resuming = !resume_dir.empty();
  const int64_t start_step = resuming ? state.at("step").get<int64_t>() : 0;
  const int64_t stop = max_steps > 0 ? max_steps : steps;
  if (start_step >= stop)
    MT_THROW("grpo: resume: checkpoint ", resume_dir, " is at step ", start_step,
             ", which is not before the end of this run (", max_steps > 0 ? "--max-steps " : "--steps ", stop,
             "); raise --steps or --max-steps");

  if (model_dir.empty()) {
    model_dir = from_file ? std::string(kDemoModel) : ensure_task_start(preset, device_name);
  }
  if (!fs::exists(model_dir + "/config.json")) MT_THROW("grpo: --model ", model_dir, " has no config.json");
  // The reference is the frozen initial model: a resumed run reads it again and it must be unchanged.
  const json fingerprint = resuming ? state.at("model_fingerprint") : model_fingerprint(model_dir);
  if (resuming) {
    const std::string why = fingerprint_change(fingerprint, model_fingerprint(model_dir));
    if (!why.empty())
      MT_THROW("grpo: resume: the initial model ", model_dir, " changed since the run started (", why,
               "); it is the reference and the start of the run, so it must stay as it was");
  }
  const ModelConfig cfg = load_model_config(model_dir);
  if (o.aux_loss_coef > 0 && !cfg.output_router_logits)
    MT_THROW("grpo: --aux-loss-coef ", o.aux_loss_coef, " needs the load-balancing loss, which ", model_dir,
             "/config.json turns off (output_router_logits false); set it true there or drop the option");
  if (cfg.num_sparse_layers() == 0 && (o.freeze_router || o.router_z_loss_coef > 0))
    MT_THROW("grpo: ",
             o.freeze_router ? std::string("--freeze-router on") : str("--router-z-loss-coef ", o.router_z_loss_coef),
             ": ", model_dir, " has no MoE layers, so no routers (num_experts ", cfg.num_experts, "); drop it");
  if (!from_file && cfg.vocab_size < CharTokenizer().vocab_size())
    MT_THROW("grpo: ", model_dir, " has a vocabulary of ", cfg.vocab_size, "; the addition task's tokenizer needs ",
             CharTokenizer().vocab_size());
  // Prompt files, their answers and the reward program: checked before any weight is read.
  std::optional<Tokenizer> tokenizer;
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  PromptFile train_file, eval_file;
  std::unique_ptr<RewardProgram> program;
  FileRewarder rewarder;
  if (from_file) {
    if (fs::exists(tokenizer_path)) tokenizer = Tokenizer::from_file(tokenizer_path);
    const Tokenizer* tok = tokenizer ? &*tokenizer : nullptr;
    if (!tok && file_reward == FileReward::Math)
      MT_THROW("grpo: --reward math reads the response's text, and ", model_dir,
               " has no tokenizer.json to decode it; add the tokenizer or use exact (token ids)");
    train_file = load_prompt_file(prompts_path, cfg, o.max_new_tokens, tok, file_reward);
    if (resuming && state.contains("prompts") &&
        state["prompts"].value("count", int64_t(-1)) != int64_t(train_file.prompts.size()))
      log_info("grpo: resume: warning: ", prompts_path, " has ", train_file.prompts.size(),
               " prompts, the saved run's file had ", state["prompts"].value("count", int64_t(-1)),
               ": the sampler's order from here differs from the run that stopped");
    if (!eval_prompts_path.empty())
      eval_file = load_prompt_file(eval_prompts_path, cfg, o.max_new_tokens, tok, file_reward);
    if (file_reward == FileReward::Program) {
      RewardProgramOptions po;
      po.command = program_cmd;
      po.timeout_s = reward_timeout;
      po.stop_on_error = reward_stop;
      program = std::make_unique<RewardProgram>(po);  // an error naming a missing or non-executable program
    }
    rewarder.kind = file_reward;
    rewarder.tok = tok;
    rewarder.program = program.get();
    // Stops: the model's EOS (the engine's own), and the chat template's ends when the tokenizer has them.
    if (tok)
      for (const char* s : {"<|im_end|>", "<|endoftext|>"}) {
        const int64_t id = tok->token_to_id(s);
        if (id >= 0 && id < cfg.vocab_size && id != cfg.eos_token_id) o.stop_token_ids.push_back(int32_t(id));
      }
    log_info("grpo: ", train_file.prompts.size(), " prompts from ", prompts_path,
             eval_file.prompts.empty() ? std::string()
                                       : str(", ", eval_file.prompts.size(), " held-out from ", eval_prompts_path),
             "; reward ",
             file_reward == FileReward::Exact  ? (tok ? "exact match (text)" : "exact match (token ids)")
             : file_reward == FileReward::Math ? "math"
                                               : "program: " + program_cmd,
             tok ? "; tokenizer " + tokenizer_path : std::string("; no tokenizer"));
  }

  SessionOptions so;
  so.device = device;
  so.dist.mesh = mesh;
  so.dist.comm.timeout = std::chrono::milliseconds(int64_t(comm_timeout_s * 1000));
  TrainSession session(cfg, so);
  DistContext& dist = session.dist();
  const bool lead = dist.rank() == 0;
  if (per_step % dist.dp_size() != 0)
    MT_THROW("grpo: --prompts-per-step ", per_step, " cannot be split evenly over ", dist.dp_size(),
             " data-parallel ranks (dp_replicate x dp_shard); use a multiple of ", dist.dp_size());
  // The reference and the critic run on the policy's distributed context, laid out like it.
  so.shared_dist = &dist;
  AdamWConfig ac;
  ac.weight_decay = 0;
  // load reads the model's routing bias too; a resume takes it from the initial model (frozen in grpo;
  // the fingerprint holds its file unchanged).
  if (!resuming)
    session.load(model_dir);
  else
    session.load_router_bias(model_dir);
  session.make_optimizer(ac, false);
  std::unique_ptr<TrainSession> reference;
  if (use_reference && baseline.empty()) {
    SessionOptions ro = so;
    ro.weights = Weights::Frozen;
    reference = std::make_unique<TrainSession>(cfg, ro);
    reference->load(model_dir);
  }
  // PPO's critic: the policy's architecture with a scalar head (score.weight [1, D], zero) on the same body.
  std::unique_ptr<TrainSession> critic;
  if (ppo && baseline.empty()) {
    ModelConfig cc = cfg;
    cc.value_head = true;
    cc.tie_word_embeddings = false;  // its own copy of the embedding
    critic = std::make_unique<TrainSession>(cc, so);
    critic->make_optimizer(ac, false);
    if (!resuming) {
      critic->init_weights(uint64_t(seed));
      rl::init_critic_from_policy(*critic, session);
    }
    critic->load_router_bias(model_dir);  // the policy's body routes as the policy does
  }
  if (resuming) {
    // The policy's masters and moments, the critic's, the counters: the state the run stopped with.
    const auto t = std::chrono::steady_clock::now();
    AdamW& opt = session.optimizer();
    load_train_state_shards(resume_dir, session.table().total(), session.parallel().pieces(session.table()),
                            session.master(), opt.exp_avg(), opt.exp_avg_sq());
    session.refresh_compute_weights();
    opt.set_state(state.at("optimizer_steps").get<int64_t>(), state.at("skipped_steps").get<int64_t>());
    session.set_steps_done(state.value("session_steps", start_step));
    if (critic) {
      const json& cs = state.at("critic");
      const std::string cdir = (fs::path(resume_dir) / cs.at("dir").get<std::string>()).string();
      AdamW& copt = critic->optimizer();
      load_train_state_shards(cdir, critic->table().total(), critic->parallel().pieces(critic->table()),
                              critic->master(), copt.exp_avg(), copt.exp_avg_sq());
      critic->refresh_compute_weights();
      copt.set_state(cs.at("optimizer_steps").get<int64_t>(), cs.at("skipped_steps").get<int64_t>());
      critic->set_steps_done(cs.value("session_steps", start_step));
    }
    log_info("grpo: resume: step ", start_step, " from ", resume_dir, "; policy", critic ? " and critic" : "",
             " weights, AdamW moments and counters, ",
             from_file ? str("prompt sampler position ", state.at("prompt_position").get<int64_t>())
                       : str(state.at("problems_drawn").get<int64_t>(), " task problems drawn"),
             " restored in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), " s");
  }

  // The KV cache: what the larger of a step's rollouts and the evaluation can hold.
  int64_t longest_prompt = max_problem_tokens(task.hi), eval_count = eval_n;
  if (from_file) {
    longest_prompt = 1;
    for (const PromptFile* f : {&train_file, &eval_file})
      for (const Prompt& p : f->prompts) longest_prompt = std::max<int64_t>(longest_prompt, int64_t(p.ids.size()));
    eval_count = std::max<int64_t>(1, std::min<int64_t>(int64_t(eval_file.prompts.size()), 256));
  }
  GenerateRequest sizing;
  sizing.prompt.assign(size_t(longest_prompt), 0);
  sizing.max_new_tokens = o.max_new_tokens;
  sizing.n = o.n;
  EngineOptions eo;
  eo.record_routing = true;
  // Under tp or sp the engine runs on a one-device copy of the weights, refreshed before each round and
  // each evaluation (rl::TpGenerator; under tp without routing replay); else on the policy, ep ranks in
  // lockstep.
  std::unique_ptr<rl::TpGenerator> tp_copy;
  if (dist.mesh().size(Axis::Tp) > 1 || dist.mesh().size(Axis::Sp) > 1) {
    tp_copy = std::make_unique<rl::TpGenerator>(session);
    if (const Tensor& b = session.model().router_bias(); b.defined()) {  // the copy routes as the policy
      tp_copy->model().enable_router_bias();
      tp_copy->model().router_bias().copy_from(b);
    }
    o.before_generate = [&tp_copy] { return tp_copy->refresh(); };
    if (dist.mesh().size(Axis::Tp) > 1) {
      o.replay_routing = false;
      eo.record_routing = false;
    }
  } else {
    eo.lockstep = dist.ep();
  }
  Qwen3MoeModel& gen_model = tp_copy ? tp_copy->model() : session.model();
  eo.max_running = std::max<int64_t>(per_step * o.n, eval_count);
  GenerateRequest eval_sizing = sizing;
  eval_sizing.n = 1;
  eo.kv_cache_bytes = std::max(
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(per_step), sizing), eo.block_size),
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(eval_count), eval_sizing),
                                     eo.block_size));
  RolloutEngine engine(gen_model, eo);

  // Evaluation: greedy, on the held-out problems of the task or the --eval-prompts file.
  const std::vector<Problem> eval = from_file ? std::vector<Problem>() : task.eval(eval_n, uint64_t(seed) + 7);
  const bool file_accuracy = file_reward != FileReward::Program;
  auto evaluate = [&]() -> double {
    if (tp_copy) tp_copy->refresh();  // every rank evaluates every problem (the same collectives)
    if (!from_file) return exact_match(engine, eval, task.hi);
    std::vector<GenerateRequest> reqs;
    std::vector<int64_t> which;
    for (size_t k = 0; k < eval_file.prompts.size(); ++k) {
      GenerateRequest r;
      r.prompt = eval_file.prompts[k].ids;
      r.sampling.temperature = 0;
      r.max_new_tokens = o.max_new_tokens;
      r.stop_token_ids = o.stop_token_ids;
      reqs.push_back(std::move(r));
      which.push_back(int64_t(k));
    }
    const std::vector<double> r = rewarder(eval_file, which, engine.generate(reqs));
    double sum = 0;
    for (double x : r) sum += file_accuracy ? (x >= 1.0 ? 1.0 : 0.0) : x;
    return (file_accuracy ? 100.0 : 1.0) * sum / double(r.size());
  };
  const bool has_eval = !from_file || !eval_file.prompts.empty();
  double before = 0;
  if (resuming && state.contains("eval_before"))
    before = state["eval_before"].get<double>();  // of the initial model, measured when the run started
  else if (has_eval) {
    if (resuming)
      log_info(
          "grpo: resume: warning: the saved run recorded no evaluation before training; \"before\" is "
          "measured now, at step ",
          start_step);
    before = evaluate();
  }
  const std::string task_text = from_file ? prompts_path
                                          : "addition, operands of " + std::to_string(task.lo) + ".." +
                                                std::to_string(task.hi) + " digits" +
                                                (task.longest ? ", at least one of " + std::to_string(task.hi) : "");
  const std::string eval_name = !from_file                         ? "exact-match"
                                : file_reward == FileReward::Exact ? "exact-match"
                                : file_reward == FileReward::Math  ? "math"
                                                                   : "program-reward";
  auto shown = [&](double v) {
    char b[64];
    std::snprintf(b, sizeof b, !from_file || file_accuracy ? "%.1f%%" : "%.4f", v);
    return std::string(b);
  };
  std::filesystem::create_directories(run_dir);
  MetricsWriter metrics(run_dir + "/metrics.jsonl", lead, true,
                        resuming ? start_step : -1);  // and a TensorBoard event file beside it
  Rng rng{uint64_t(seed)};
  PromptSampler sampler(std::max<int64_t>(1, int64_t(train_file.prompts.size())), mix64(uint64_t(seed)));
  int64_t problems_drawn = 0;  // the task's draws from rng: a resumed run replays them
  if (resuming) {
    if (from_file)
      sampler.set_position(state.at("prompt_position").get<int64_t>());
    else
      for (const int64_t n = state.at("problems_drawn").get<int64_t>(); problems_drawn < n; ++problems_drawn)
        task.train(rng);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  // Linear warm-up over steps 1..warmup, then constant at --lr, or a cosine from --lr down to --min-lr at the
  // last step.
  auto lr_at = [&](int64_t step) {
    if (warmup > 0 && step <= warmup) return o.lr * double(step) / double(warmup);
    if (!min_lr || steps <= warmup) return o.lr;
    const double progress = std::clamp(double(step - warmup) / double(steps - warmup), 0.0, 1.0);
    return *min_lr + (o.lr - *min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  };

  // A checkpoint: the HF weights (a model directory: config, safetensors, tokenizer.json), the policy's and
  // the critic's training state and train_state.json, committed by manifest and rename.
  auto save = [&](int64_t step) {
    const auto t = std::chrono::steady_clock::now();
    const std::string final_dir = checkpoint_dir(run_dir, step), dir = final_dir + ".tmp";
    if (lead) begin_checkpoint(dir);
    if (dist.distributed()) dist.world()->barrier();  // the directory exists before any rank writes into it
    if (session.fsdp())
      save_sharded_hf_checkpoint(
          dir, cfg, session.table(),
          [&session](const ParamEntry& e) { return session.parallel().gather_param_host(e, false); }, lead);
    else
      save_hf_checkpoint(dir, cfg, session.table(), session.model().params());
    if (lead && fs::exists(tokenizer_path))
      fs::copy_file(tokenizer_path, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
    if (lead && session.model().router_bias().defined())  // the routing bias it ran with: a complete model
      save_router_bias(dir, cfg, session.model().router_bias());
    debug_kill_while_saving(step);
    AdamW& opt = session.optimizer();
    save_train_state_shard(dir, dist.rank(), session.master(), opt.exp_avg(), opt.exp_avg_sq(),
                           session.parallel().pieces(session.table()));
    const DeviceMesh& dm = dist.mesh();
    const json layout = {{"world_size", dist.world_size()},
                         {"dp_replicate", dm.size(Axis::DpReplicate)},
                         {"dp_shard", dm.size(Axis::DpShard)},
                         {"ep", dm.size(Axis::Ep)},
                         {"tp", dm.size(Axis::Tp)}};
    json st;
    st["format"] = "moetrain-grpo-state-1";
    st["step"] = step;
    st["session_steps"] = session.steps_done();
    st["optimizer_steps"] = opt.steps_taken();
    st["skipped_steps"] = opt.steps_skipped();
    st["flat_numel"] = session.table().total();
    st["layout"] = layout;
    st["mode"] = from_file ? "prompts" : baseline.empty() ? "task" : "sft-baseline";
    if (from_file) {
      st["prompt_position"] = sampler.position();
      st["prompts"] = {{"file", prompts_path}, {"count", train_file.prompts.size()}};
    } else {
      st["problems_drawn"] = problems_drawn;
    }
    st["rng"] = "none besides: sampling seeds are functions of (seed, step, prompt index)";
    st["lr_schedule"] = {
        {"lr", o.lr}, {"warmup_steps", warmup}, {"min_lr", min_lr.value_or(o.lr)}, {"next_lr", lr_at(step + 1)}};
    st["model_dir"] = model_dir;
    st["model_fingerprint"] = fingerprint;
    if (has_eval) st["eval_before"] = before;
    if (critic) {
      const std::string cdir = (fs::path(dir) / "critic").string();
      AdamW& copt = critic->optimizer();
      save_train_state_shard(cdir, dist.rank(), critic->master(), copt.exp_avg(), copt.exp_avg_sq(),
                             critic->parallel().pieces(critic->table()));
      if (lead)
        write_file_atomic(
            (fs::path(cdir) / kTrainStateFile).string(),
            json{{"format", "moetrain-grpo-critic-1"}, {"flat_numel", critic->table().total()}, {"layout", layout}}
                    .dump(2) +
                "\n");
      st["critic"] = {{"dir", "critic"},
                      {"optimizer_steps", copt.steps_taken()},
                      {"skipped_steps", copt.steps_skipped()},
                      {"session_steps", critic->steps_done()}};
    }
    st["args"] = recorded_args(args);
    if (lead) write_file_atomic((fs::path(dir) / kTrainStateFile).string(), st.dump(2) + "\n");
    if (dist.distributed()) dist.world()->barrier();  // every shard is on disk
    if (lead) {
      commit_checkpoint(dir, final_dir);
      for (const std::string& r : prune_checkpoints(run_dir, keep_last)) log_info("grpo: removed ", r);
    }
    log_info("grpo: saved checkpoint ", final_dir, " (HF weights + training state", critic ? " + critic" : "",
             ", manifest) in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), " s");
  };

  int64_t steps_done = stop;
  if (!baseline.empty()) {
    // The comparison: SFT for the wall time of the GRPO run it is compared with.
    const double budget = sft_seconds;
    log_info("grpo: baseline sft: ", model_dir, ", task: ", task_text, "; held-out exact match before: ", before,
             "%; supervised fine-tuning for ", budget, " s, ", per_step * o.n, " problems a step, lr ", o.lr);
    int64_t step = 0;
    while (elapsed() < budget) {
      ++step;
      StepOptions st;
      st.lr = lr_at(step);
      const StepResult r = session.train_step({sft_batch(task, rng, per_step * o.n)}, st);
      nlohmann::json j = step_json(r, session.dist());
      j["step"] = step;
      j["lr"] = st.lr;
      j["elapsed_s"] = elapsed();
      metrics.write(j);
      if (step % 10 == 0) log_info("grpo: sft step ", step, " loss ", r.loss, " | ", std::round(elapsed()), " s");
    }
    steps_done = step;
  } else {
    log_info("grpo: ", model_dir, ", ", from_file ? "prompts: " : "task: ", task_text,
             has_eval ? "; held-out " + eval_name + " before: " + shown(before) : std::string("; no evaluation"), "; ",
             resuming ? str("steps ", start_step + 1, "..", stop, " of ") : std::string(), steps, " steps of ",
             per_step, " prompts x ", o.n, " samples, lr ", o.lr, ", temperature ", o.sampling.temperature,
             ", advantages: ",
             ppo            ? (process ? "GAE on per-token rewards" : "GAE on the outcome reward")
             : !process     ? "outcome"
             : per_position ? "position"
                            : "process",
             ", aggregation ", aggregation_name, o.dynamic_sampling ? ", dynamic sampling" : "",
             reference ? ", reference model" : "",
             critic ? ", PPO: critic lr " + std::to_string(o.critic_lr) + ", gamma " + std::to_string(o.gamma) +
                          ", lam " + std::to_string(o.lam) + ", value clip " + std::to_string(o.value_clip)
                    : std::string());
    // One round's prompts at a time: the reward's answer key, by the round's prompt index.
    std::vector<Problem> round_problems;
    std::vector<int64_t> round_prompts;
    const rl::PromptFn draw = [&](int64_t count) {
      std::vector<std::vector<int32_t>> prompts;
      round_problems.clear();
      round_prompts.clear();
      for (int64_t i = 0; i < count; ++i) {
        if (from_file) {
          round_prompts.push_back(sampler.next());
          prompts.push_back(train_file.prompts[size_t(round_prompts.back())].ids);
        } else {
          round_problems.push_back(task.train(rng));
          ++problems_drawn;
          prompts.push_back(ids32(round_problems.back().prompt_ids));
        }
      }
      return prompts;
    };
    const rl::RewardFn reward_fn = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      if (from_file) return rewarder(train_file, round_prompts, g);
      std::vector<double> r;
      for (const GeneratedSample& x : g)
        r.push_back(answer_reward(round_problems.at(size_t(x.prompt_index)), x.tokens, reward_kind));
      return r;
    };
    if (process)
      o.token_reward = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
        std::vector<std::vector<double>> r;
        for (const GeneratedSample& x : g)
          r.push_back(answer_token_rewards(round_problems.at(size_t(x.prompt_index)), x.tokens));
        return r;
      };
    o.per_position = per_position;
    o.seed = uint64_t(seed);
    for (int64_t step = start_step + 1; step <= stop; ++step) {
      rl::GrpoOptions os = o;
      os.lr = lr_at(step);
      const rl::GrpoMetrics m =
          rl::grpo_step(session, engine, draw, per_step, reward_fn, os, step, reference.get(), critic.get());
      const double eta = elapsed() / double(step - start_step) * double(stop - step);
      // The comparison set (docs/rl.md "Metric names against TRL and veRL") on one line.
      log_info(
          "grpo: step ", step, "/", steps, " reward ", m.reward_mean, " (zero-std groups ", m.groups_zero_variance,
          ", correct ", m.groups_correct, "; kept ", m.groups_kept, "/", m.groups_generated, " in ", m.generate_rounds,
          " rounds) loss ", m.loss, " grad norm ", m.grad_norm, " | clip ", m.clip_region, " entropy ", m.entropy,
          " len ", m.response_len_mean, "/", m.response_len_max, " clipped ", m.overlong_fraction, " kl(ref) ",
          m.ref_kl, " | rollout/trainer |dlogp| ", m.logprob_diff_mean,
          m.logprob_diff_mean_no_replay >= 0 ? str(" (own routing: ", m.logprob_diff_mean_no_replay, ")")
                                             : std::string(),
          " ratio ", m.importance_weight_mean, " [", m.importance_weight_min, ", ", m.importance_weight_max, "]",
          critic ? str(" | value loss ", m.value_loss, " explained variance ", m.explained_variance) : std::string(),
          " | tokens/s generate ", std::lround(m.rollout_tokens_per_s), " logprob ",
          std::lround(m.logprob_tokens_per_s),
          reference ? str(" ref ", std::lround(m.ref_logprob_tokens_per_s)) : std::string(), " update ",
          std::lround(m.train_tokens_per_s),
          critic ? str(" critic values ", std::lround(m.critic_values_tokens_per_s), " update ",
                       std::lround(m.critic_update_tokens_per_s))
                 : std::string(),
          " | ETA ", std::round(eta), " s");
      metrics.write(nlohmann::json{{"step", step},
                                   {"lr", os.lr},
                                   {"reward_mean", m.reward_mean},
                                   {"reward_std", m.reward_std},
                                   {"reward_max", m.reward_max},
                                   {"groups_with_reward", m.groups_with_reward},
                                   {"groups_correct", m.groups_correct},
                                   {"groups_zero_variance", m.groups_zero_variance},
                                   {"generate_rounds", m.generate_rounds},
                                   {"groups_generated", m.groups_generated},
                                   {"groups_kept", m.groups_kept},
                                   {"response_len_mean", m.response_len_mean},
                                   {"response_len_min", m.response_len_min},
                                   {"response_len_max", m.response_len_max},
                                   {"response_len_terminated_mean", m.response_len_terminated_mean},
                                   {"overlong_fraction", m.overlong_fraction},
                                   {"updates", m.updates},
                                   {"micro_batches", m.micro_batches},
                                   {"loss", m.loss},
                                   {"policy_loss", m.policy_loss},
                                   {"kl_loss", m.kl_loss},
                                   {"grad_norm", m.grad_norm},
                                   {"grad_norm_max", m.grad_norm_max},
                                   {"clip_low", m.clip_low},
                                   {"clip_high", m.clip_high},
                                   {"clip_region", m.clip_region},
                                   {"clip_dual", m.clip_dual},
                                   {"approx_kl", m.approx_kl},
                                   {"ref_kl", m.ref_kl},
                                   {"ref_kl_update", m.ref_kl_update},
                                   {"entropy", m.entropy},
                                   {"advantage_mean", m.advantage_mean},
                                   {"advantage_std", m.advantage_std},
                                   {"logprob_diff_mean", m.logprob_diff_mean},
                                   {"logprob_diff_max", m.logprob_diff_max},
                                   {"logprob_diff_mean_no_replay", m.logprob_diff_mean_no_replay},
                                   {"logprob_diff_max_no_replay", m.logprob_diff_max_no_replay},
                                   {"importance_weight_mean", m.importance_weight_mean},
                                   {"importance_weight_min", m.importance_weight_min},
                                   {"importance_weight_max", m.importance_weight_max},
                                   {"masked_fraction", m.masked_fraction},
                                   {"kl_reward", m.kl_reward},
                                   {"value_loss", m.value_loss},
                                   {"value_mean", m.value_mean},
                                   {"explained_variance", m.explained_variance},
                                   {"value_clip_frac", m.value_clip_frac},
                                   {"critic_grad_norm", m.critic_grad_norm},
                                   {"rollout_tokens_per_s", m.rollout_tokens_per_s},
                                   {"logprob_tokens_per_s", m.logprob_tokens_per_s},
                                   {"ref_logprob_tokens_per_s", m.ref_logprob_tokens_per_s},
                                   {"train_tokens_per_s", m.train_tokens_per_s},
                                   {"critic_values_tokens_per_s", m.critic_values_tokens_per_s},
                                   {"critic_update_tokens_per_s", m.critic_update_tokens_per_s},
                                   {"time_s",
                                    {{"generate", m.generate_s},
                                     {"reward", m.reward_s},
                                     {"logprob", m.logprob_s},
                                     {"ref_logprob", m.ref_logprob_s},
                                     {"update", m.update_s},
                                     {"critic_values", m.critic_value_s},
                                     {"critic_update", m.critic_update_s},
                                     {"weight_sync", m.weight_sync_s}}},
                                   {"elapsed_s", elapsed()}});
      // The checkpoint first: whatever the evaluation meets, the weights are on disk.
      if (save_every > 0 && step % save_every == 0 && step < stop) save(step);
    }
  }
  save(steps_done);
  log_info("grpo: ", std::round(elapsed()), " s of ", baseline.empty() ? "GRPO" : "SFT");
  if (!has_eval) {
    if (lead) std::printf("grpo: %lld steps done; evaluation skipped (no --eval-prompts)\n", (long long)steps_done);
    return 0;
  }
  const double after = evaluate();
  if (!lead) return 0;
  if (from_file)
    std::printf("grpo: %s %s -> %s on %lld held-out prompts\n", eval_name.c_str(), shown(before).c_str(),
                shown(after).c_str(), (long long)eval_file.prompts.size());
  else
    std::printf("grpo: exact-match %.1f%% -> %.1f%% on %lld held-out problems\n", before, after, (long long)eval_n);
  return 0;
}

}  // namespace mt
