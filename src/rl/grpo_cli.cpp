// moetrain grpo: GRPO (rl/grpo.h) on the built-in addition task (docs/rl.md "moetrain grpo"). Starts
// from the demo checkpoint (training it first when it is absent), on problems longer than the demo was
// trained on; by default each answer token is rewarded (1 for a right digit) and credited against the
// group's samples at the same position (--advantage position; the sample-level rewards and GRPO's
// outcome advantages are options); evaluates greedy exact match on held-out problems of the task before
// and after, writes per-step
// metrics (JSONL) and the final checkpoint, and ends with
// `grpo: exact-match <before>% -> <after>% on <n> held-out problems`. Every option is checked before
// any work starts. `--baseline sft` spends the same wall time on supervised fine-tuning instead (the
// right answers of problems from the same distribution, cross-entropy through the same train_step):
// the comparison the docs quote. One process for now.
#include "rl/grpo_cli.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/cli_args.h"
#include "core/error.h"
#include "core/log.h"
#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "model/hf_checkpoint.h"
#include "rl/grpo.h"
#include "train/metrics.h"
#include "train/session.h"
#include "train/trainer.h"

namespace mt {

namespace {

const char* kUsage =
    "usage: moetrain grpo [options]\n"
    "  --model DIR               start from this HF checkpoint (default runs/demo/checkpoint-2500, trained when "
    "absent)\n"
    "  --steps N                 GRPO steps (default 500)\n"
    "  --prompts-per-step P      groups per step (default 16)\n"
    "  --n G                     samples per prompt (>= 2, default 8)\n"
    "  --min-digits D            operands have D..max digits (default 1)\n"
    "  --max-digits D            (default 4; the demo is trained on 1..3)\n"
    "  --longest on|off          on: at least one operand has max digits (default on)\n"
    "  --algorithm A             grpo | dr-grpo (no std division) | ppo (a critic: GAE advantages) (default grpo)\n"
    "  --critic-lr LR, --gamma G, --lam L, --value-clip E   ppo's critic: its AdamW lr (default 5e-4), GAE's\n"
    "                            discount and lambda (defaults 1, 0.95), value clipping (default 0.2; 0 = off)\n"
    "  --loss L                  ppo | gspo | pg (default ppo)\n"
    "  --lr LR                   (default 2e-4), --warmup-steps N (default 5)\n"
    "  --temperature T           sampling temperature > 0, the trainer's log-probs use it too (default 1.5)\n"
    "  --clip-low E, --clip-high E, --dual-clip C       (defaults 0.2, 0.28, off)\n"
    "  --kl-coef B               KL-to-reference loss weight (default 0), --kl-estimator k1|k2|k3 (default k3)\n"
    "  --reward digits|prefix|exact   the share of answer positions right, of the answer right before the first\n"
    "                            mistake, or 1/0 for an exact answer (default digits)\n"
    "  --advantage outcome|process|position   one reward per sample (GRPO), or one per answer token (right\n"
    "                            digit: 1) with DeepSeekMath's process-supervised advantages, or each token\n"
    "                            against the group's same position (default position)\n"
    "  --reference on|off        keep a frozen copy of the initial policy (default on: the KL metric)\n"
    "  --entropy-coef C          (default 0)\n"
    "  --aggregation A           token-mean | seq-mean-token-sum | seq-mean-token-mean | constant\n"
    "  --dynamic-sampling on|off drop zero-variance groups and refill (default on; off under ppo),\n"
    "                            --max-generate-rounds R (4)\n"
    "  --overlong-filter on|off  weight 0 for samples cut at the length limit (default off)\n"
    "  --overlong-penalty F --overlong-buffer B        DAPO's soft overlong penalty (default off)\n"
    "  --epochs E, --mini-batches M, --micro-batch-samples S   the update (defaults 1, 1, 0 = one)\n"
    "  --eval-problems N         held-out problems (default 200)\n"
    "  --baseline sft --sft-seconds S   instead of GRPO, S seconds of SFT on the task's problems (the comparison)\n"
    "  --device cpu|cuda|auto, --out-dir DIR (runs/grpo), --seed S (1)";

constexpr const char* kDemoModel = "runs/demo/checkpoint-2500";

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

}  // namespace

int grpo_main(const std::vector<std::string>& args) {
  std::string model_dir = kDemoModel, device_name = "auto", out_dir = "runs/grpo", baseline;
  int64_t steps = 500, per_step = 16, eval_n = 200, seed = 1, warmup = 5;
  double sft_seconds = 0;
  Task task;
  bool use_reference = true;
  Reward reward_kind = Reward::Digits;
  bool process = true, per_position = true;
  bool ppo = false, dynamic_given = false;
  rl::GrpoOptions o;
  o.n = 8;
  o.lr = 2e-4;
  o.critic_lr = 5e-4;
  o.sampling.temperature = 1.5f;
  o.loss.clip_high = 0.28;
  o.dynamic_sampling = true;
  o.progress_every_s = 10;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) MT_THROW("grpo: ", a, " needs a value; ", kUsage);
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      std::printf("%s\n", kUsage);
      return 0;
    } else if (a == "--model")
      model_dir = value();
    else if (a == "--steps")
      steps = parse_flag_number<int64_t>(a, value());
    else if (a == "--prompts-per-step")
      per_step = parse_flag_number<int64_t>(a, value());
    else if (a == "--n")
      o.n = parse_flag_number<int64_t>(a, value());
    else if (a == "--min-digits")
      task.lo = parse_flag_number<int>(a, value());
    else if (a == "--max-digits")
      task.hi = parse_flag_number<int>(a, value());
    else if (a == "--algorithm") {
      const std::string v = value();
      if (v == "grpo")
        o.normalize_std = true;
      else if (v == "dr-grpo")
        o.normalize_std = false;
      else if (v == "ppo")
        ppo = true;
      else
        MT_THROW("grpo: --algorithm '", v, "' is unknown; use grpo, dr-grpo or ppo");
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
    } else if (a == "--reward") {
      const std::string v = value();
      if (v == "exact")
        reward_kind = Reward::Exact;
      else if (v == "prefix")
        reward_kind = Reward::Prefix;
      else if (v == "digits")
        reward_kind = Reward::Digits;
      else
        MT_THROW("grpo: --reward '", v, "' is unknown; use digits, prefix or exact");
    } else if (a == "--advantage") {
      const std::string v = value();
      if (v == "outcome")
        process = false;
      else if (v == "process")
        process = true;
      else if (v == "position")
        process = per_position = true;
      else
        MT_THROW("grpo: --advantage '", v, "' is unknown; use outcome, process or position");
    } else if (a == "--loss")
      o.loss.kind = rl::parse_policy_loss(value());
    else if (a == "--lr")
      o.lr = parse_flag_number<double>(a, value());
    else if (a == "--warmup-steps")
      warmup = parse_flag_number<int64_t>(a, value());
    else if (a == "--temperature")
      o.sampling.temperature = parse_flag_number<float>(a, value());
    else if (a == "--clip-low")
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
    else if (a == "--aggregation")
      o.aggregation = rl::parse_loss_aggregation(value());
    else if (a == "--dynamic-sampling") {
      o.dynamic_sampling = parse_on_off(a, value());
      dynamic_given = true;
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
    else if (a == "--micro-batch-samples")
      o.micro_batch_samples = parse_flag_number<int64_t>(a, value());
    else if (a == "--eval-problems")
      eval_n = parse_flag_number<int64_t>(a, value());
    else if (a == "--baseline") {
      baseline = value();
      if (baseline != "sft") MT_THROW("grpo: --baseline '", baseline, "' is unknown; use sft");
    } else if (a == "--sft-seconds")
      sft_seconds = parse_flag_number<double>(a, value());
    else if (a == "--device")
      device_name = value();
    else if (a == "--out-dir")
      out_dir = value();
    else if (a == "--seed")
      seed = parse_flag_number<int64_t>(a, value());
    else
      MT_THROW("grpo: unknown argument '", a, "'; ", kUsage);
  }
  // Every check before any work.
  if (o.n < 2) MT_THROW("grpo: --n ", o.n, " samples per prompt; group advantages need at least 2");
  if (steps < 1) MT_THROW("grpo: --steps ", steps, "; need >= 1");
  if (per_step < 1) MT_THROW("grpo: --prompts-per-step ", per_step, "; need >= 1");
  if (eval_n < 1) MT_THROW("grpo: --eval-problems ", eval_n, "; need >= 1");
  if (warmup < 0) MT_THROW("grpo: --warmup-steps ", warmup, "; need >= 0");
  if (task.lo < 1 || task.hi > kMaxAdditionDigits || task.lo > task.hi)
    MT_THROW("grpo: --min-digits ", task.lo, " and --max-digits ", task.hi,
             "; need 1 <= min <= max <= ", kMaxAdditionDigits);
  if (o.mini_batches > per_step)
    MT_THROW("grpo: --mini-batches ", o.mini_batches, " > --prompts-per-step ", per_step,
             "; a mini-batch holds whole groups");
  if (!baseline.empty() && !(sft_seconds > 0))
    MT_THROW("grpo: --baseline sft needs --sft-seconds S > 0 (the wall time of the run it is compared with)");
  if (baseline.empty() && sft_seconds != 0) MT_THROW("grpo: --sft-seconds ", sft_seconds, " without --baseline sft");
  if (o.loss.kl_coef > 0 && !use_reference)
    MT_THROW("grpo: --kl-coef ", o.loss.kl_coef, " needs the reference model; drop --reference off");
  // PPO has no group baseline: a group of equal rewards still trains the critic and has GAE advantages.
  if (ppo && !dynamic_given) o.dynamic_sampling = false;
  if (!ppo && (o.critic_lr != 5e-4 || o.gamma != 1.0 || o.lam != rl::GrpoOptions{}.lam ||
               o.value_clip != rl::GrpoOptions{}.value_clip))
    MT_THROW(
        "grpo: --critic-lr, --gamma, --lam and --value-clip set the critic of --algorithm ppo; the algorithm "
        "here has none");
  o.max_new_tokens = max_answer_tokens(task.hi);
  rl::validate(o);
  if (eval_n > max_eval_problems(task.hi))
    MT_THROW("grpo: --eval-problems ", eval_n, " > the ", max_eval_problems(task.hi), " held-out pairs of the task");
  const Device device = resolve_device(device_name);
  if (!std::filesystem::exists(model_dir + "/config.json")) {
    if (model_dir != kDemoModel) MT_THROW("grpo: --model ", model_dir, " has no config.json");
    log_info("grpo: ", model_dir, " is absent: training the demo model first (moetrain train)");
    TrainConfig tc;
    tc.device = device_name;
    run_training(tc);
  }
  const ModelConfig cfg = load_model_config(model_dir);
  if (cfg.vocab_size < CharTokenizer().vocab_size())
    MT_THROW("grpo: ", model_dir, " has a vocabulary of ", cfg.vocab_size, "; the addition task's tokenizer needs ",
             CharTokenizer().vocab_size());
  SessionOptions so;
  so.device = device;
  TrainSession session(cfg, so);
  session.load(model_dir);
  AdamWConfig ac;
  ac.weight_decay = 0;
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
    critic->init_weights(uint64_t(seed));
    rl::init_critic_from_policy(*critic, session);
    critic->make_optimizer(ac, false);
  }

  // The KV cache: what the larger of a step's rollouts and the evaluation can hold.
  GenerateRequest sizing;
  sizing.prompt.assign(size_t(max_problem_tokens(task.hi)), 0);
  sizing.max_new_tokens = o.max_new_tokens;
  sizing.n = o.n;
  EngineOptions eo;
  eo.record_routing = true;
  eo.max_running = std::max<int64_t>(per_step * o.n, eval_n);
  GenerateRequest eval_sizing = sizing;
  eval_sizing.n = 1;
  eo.kv_cache_bytes =
      std::max(RolloutEngine::kv_bytes_needed(session.model(), std::vector<GenerateRequest>(size_t(per_step), sizing),
                                              eo.block_size),
               RolloutEngine::kv_bytes_needed(
                   session.model(), std::vector<GenerateRequest>(size_t(eval_n), eval_sizing), eo.block_size));
  RolloutEngine engine(session.model(), eo);

  const std::vector<Problem> eval = task.eval(eval_n, uint64_t(seed) + 7);
  const double before = exact_match(engine, eval, task.hi);
  const std::string task_text = "addition, operands of " + std::to_string(task.lo) + ".." + std::to_string(task.hi) +
                                " digits" + (task.longest ? ", at least one of " + std::to_string(task.hi) : "");
  std::filesystem::create_directories(out_dir);
  MetricsWriter metrics(out_dir + "/metrics.jsonl", true);  // and a TensorBoard event file beside it
  Rng rng{uint64_t(seed)};
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto lr_at = [&](int64_t step) { return warmup > 0 ? o.lr * std::min(1.0, double(step) / double(warmup)) : o.lr; };
  int64_t steps_done = steps;
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
    log_info("grpo: ", model_dir, ", task: ", task_text, "; held-out exact match before: ", before, "%; ", steps,
             " steps of ", per_step, " prompts x ", o.n, " samples, lr ", o.lr, ", temperature ",
             o.sampling.temperature, o.dynamic_sampling ? ", dynamic sampling" : "",
             reference ? ", reference model" : "",
             critic ? ", PPO: critic lr " + std::to_string(o.critic_lr) + ", gamma " + std::to_string(o.gamma) +
                          ", lam " + std::to_string(o.lam) + ", value clip " + std::to_string(o.value_clip)
                    : std::string());
    std::map<std::vector<int32_t>, Problem> problems;  // by prompt: the reward's answer key
    const rl::PromptFn draw = [&](int64_t count) {
      problems.clear();  // one round's prompts at a time
      std::vector<std::vector<int32_t>> prompts;
      for (int64_t i = 0; i < count; ++i) {
        const Problem p = task.train(rng);
        prompts.push_back(ids32(p.prompt_ids));
        problems[prompts.back()] = p;
      }
      return prompts;
    };
    const rl::RewardFn exact = [&](const std::vector<GenerateRequest>& reqs, const std::vector<GeneratedSample>& g) {
      std::vector<double> r;
      for (const GeneratedSample& x : g)
        r.push_back(answer_reward(problems.at(reqs[size_t(x.prompt_index)].prompt), x.tokens, reward_kind));
      return r;
    };
    if (process)
      o.token_reward = [&](const std::vector<GenerateRequest>& reqs, const std::vector<GeneratedSample>& g) {
        std::vector<std::vector<double>> r;
        for (const GeneratedSample& x : g)
          r.push_back(answer_token_rewards(problems.at(reqs[size_t(x.prompt_index)].prompt), x.tokens));
        return r;
      };
    o.per_position = per_position;
    o.seed = uint64_t(seed);
    for (int64_t step = 1; step <= steps; ++step) {
      rl::GrpoOptions os = o;
      os.lr = lr_at(step);
      const rl::GrpoMetrics m =
          rl::grpo_step(session, engine, draw, per_step, exact, os, step, reference.get(), critic.get());
      const double eta = elapsed() / double(step) * double(steps - step);
      log_info("grpo: step ", step, "/", steps, " reward ", m.reward_mean, " (groups with a correct sample ",
               m.groups_correct, ", zero variance ", m.groups_zero_variance, "; kept ", m.groups_kept, "/",
               m.groups_generated, " in ", m.generate_rounds, " rounds) loss ", m.loss, " grad norm ", m.grad_norm,
               " kl(ref) ", m.ref_kl,
               critic ? " value loss " + std::to_string(m.value_loss) + " explained variance " +
                            std::to_string(m.explained_variance)
                      : std::string(),
               " | generate ", m.generate_s, " s, log-probs ", m.logprob_s + m.ref_logprob_s, " s, update ", m.update_s,
               " s | ETA ", std::round(eta), " s");
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
                                   {"response_len_max", m.response_len_max},
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
                                   {"approx_kl", m.approx_kl},
                                   {"ref_kl", m.ref_kl},
                                   {"entropy", m.entropy},
                                   {"advantage_mean", m.advantage_mean},
                                   {"advantage_std", m.advantage_std},
                                   {"logprob_diff_mean", m.logprob_diff_mean},
                                   {"logprob_diff_max", m.logprob_diff_max},
                                   {"importance_weight_mean", m.importance_weight_mean},
                                   {"value_loss", m.value_loss},
                                   {"value_mean", m.value_mean},
                                   {"explained_variance", m.explained_variance},
                                   {"value_clip_frac", m.value_clip_frac},
                                   {"critic_grad_norm", m.critic_grad_norm},
                                   {"rollout_tokens_per_s", m.rollout_tokens_per_s},
                                   {"train_tokens_per_s", m.train_tokens_per_s},
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
    }
  }
  const double after = exact_match(engine, eval, task.hi);
  const std::string dir = out_dir + "/checkpoint-" + std::to_string(steps_done);
  save_hf_checkpoint(dir, cfg, session.table(), session.model().params());
  log_info("grpo: saved ", dir, " (", std::round(elapsed()), " s of ", baseline.empty() ? "GRPO" : "SFT", ")");
  std::printf("grpo: exact-match %.1f%% -> %.1f%% on %lld held-out problems\n", before, after, (long long)eval_n);
  return 0;
}

}  // namespace mt
