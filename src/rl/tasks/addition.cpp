// The built-in addition tasks of `moetrain grpo` (tasks/addition.h).
#include "rl/tasks/addition.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "comm/dist_env.h"
#include "core/clock.h"
#include "core/device_select.h"
#include "core/error.h"
#include "core/log.h"
#include "data/char_tokenizer.h"
#include "model/config.h"
#include "rl/grpo_checkpoint.h"
#include "train/checkpoint.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace mt::rl::addition {

namespace fs = std::filesystem;

namespace {

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

}  // namespace

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
    t.steps = 500;
    return t;
  }
  MT_THROW("grpo: --task '", name, "' is unknown; use sharpen (the default) or extend");
}

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

MicroBatch supervised_batch(const std::vector<SupervisedRow>& rows, int64_t S) {
  int64_t longest = 0;
  for (const SupervisedRow& r : rows) longest = std::max(longest, int64_t(r.prompt.size() + r.response.size()));
  if (S == 0) S = longest;
  MT_CHECK(S >= longest, "supervised_batch: width ", S, " < the longest row's ", longest, " tokens");
  const int64_t R = int64_t(rows.size());
  Tensor ids = Tensor::zeros({R, S}, DType::I64), labels = Tensor::empty({R, S}, DType::I64);
  for (int64_t i = 0; i < R * S; ++i) labels.data<int64_t>()[i] = -100;
  for (int64_t r = 0; r < R; ++r) {
    int64_t s = 0;
    for (int64_t id : rows[size_t(r)].prompt) ids.data<int64_t>()[r * S + s++] = id;
    for (size_t t = 0; t < rows[size_t(r)].response.size(); ++t, ++s) {
      ids.data<int64_t>()[r * S + s] = rows[size_t(r)].response[t];
      if (rows[size_t(r)].in_loss[t]) labels.data<int64_t>()[r * S + s] = rows[size_t(r)].response[t];
    }
  }
  return MicroBatch{ids, labels};
}

SupervisedRow answer_row(const Problem& p) {
  SupervisedRow r;
  r.prompt = p.prompt_ids;
  r.response = p.answer_ids;
  r.in_loss.assign(p.answer_ids.size(), 1);
  return r;
}

// A call and what the tool appends after it (builtin_envs.cpp's calculator): "?" <eos>, then <bos>A+B= + the sum
// reversed + <eos> + <bos>A+B=; then the answer read from it.
SupervisedRow calculator_call_row(const Problem& p, bool call_in_loss) {
  SupervisedRow r;
  r.prompt = p.prompt_ids;
  const std::vector<int64_t> call = {CharTokenizer{}.char_id('?'), CharTokenizer::kEos};
  r.response = call;
  r.in_loss.assign(call.size(), call_in_loss ? 1 : 0);
  for (const std::vector<int64_t>* part : {&p.prompt_ids, &p.answer_ids, &p.prompt_ids}) {
    r.response.insert(r.response.end(), part->begin(), part->end());
    r.in_loss.insert(r.in_loss.end(), part->size(), 0);
  }
  r.response.insert(r.response.end(), p.answer_ids.begin(), p.answer_ids.end());
  r.in_loss.insert(r.in_loss.end(), p.answer_ids.size(), 1);
  return r;
}

std::string ensure_calculator_start(const std::string& device_name) {
  auto present = []() -> std::string {
    const std::string dir = start_checkpoint(kCalculatorStartRun);
    return !dir.empty() && fs::exists(dir + "/config.json") ? dir : "";
  };
  if (std::string dir = present(); !dir.empty()) return dir;
  if (comm::detect_dist_env().world_size > 1)
    MT_THROW("grpo: the calculator's start ", kCalculatorStartRun, " is absent; under moetrain launch make it first, "
             "in one process (moetrain grpo --env builtin:calculator --steps 1)");
  CalculatorStartOptions o;
  o.base = ensure_task_start(task_preset("sharpen"), device_name);
  o.run_dir = kCalculatorStartRun;
  o.device = device_name;
  FileLock lock(std::string(kCalculatorStartRun) + ".lock");
  if (std::string dir = present(); !dir.empty()) return dir;
  log_info("grpo: ", kCalculatorStartRun, " is absent: teaching ", o.base, " to call the calculator and read its "
           "result (", kCalculatorCopySteps, " steps reading the result, then calls in the mixture until ",
           100 * kCalculatorCallRate, "% of sampled first answers are calls)");
  return make_calculator_start(o);
}

std::string make_calculator_start(const CalculatorStartOptions& o) {
  const std::string& base = o.base;
  const auto t0 = Clock::now();
  const ModelConfig cfg = load_model_config(base);
  SessionOptions so;
  so.device = resolve_device(o.device);
  TrainSession session(cfg, so);
  session.load(base);
  AdamWConfig ac;
  ac.weight_decay = 0;
  session.make_optimizer(ac, false);
  Task task;
  task.lo = task.hi = kCalculatorDigits;
  task.longest = false;
  Rng rng{99};
  constexpr int64_t kRows = 32, kProbe = 64;
  constexpr double kLr = 3e-4;
  std::vector<Problem> probe;
  for (int64_t i = 0; i < kProbe; ++i) probe.push_back(task.train(rng));
  EngineOptions eo;
  eo.kv_cache_bytes = int64_t(64) << 20;
  RolloutEngine engine(session.model(), eo);
  const int32_t call0 = int32_t(CharTokenizer{}.char_id('?')), eos = int32_t(CharTokenizer::kEos);
  auto call_rate = [&] {  // the share of sampled first answers (T = 1) that are calls
    std::vector<GenerateRequest> reqs;
    for (const Problem& p : probe) {
      GenerateRequest r;
      r.prompt = ids32(p.prompt_ids);
      r.n = 4;
      r.max_new_tokens = 5;
      r.sampling.temperature = 1.0f;
      r.sampling.seed = 1;
      reqs.push_back(r);
    }
    int64_t calls = 0, all = 0;
    for (const GeneratedSample& g : engine.generate(reqs)) {
      ++all;
      calls += g.tokens.size() >= 2 && g.tokens[0] == call0 && g.tokens[1] == eos;
    }
    return double(calls) / double(all);
  };
  auto step = [&](bool mixture) {
    std::vector<SupervisedRow> rows;
    for (int64_t k = 0; k < kRows; ++k) {
      const Problem p = task.train(rng);
      rows.push_back(mixture && k % 4 != 0 ? answer_row(p) : calculator_call_row(p, mixture));
    }
    StepOptions st;
    st.lr = kLr;
    return session.train_step({supervised_batch(rows)}, st);
  };
  int64_t steps = 0;
  for (; steps < o.copy_steps; ++steps) {
    const StepResult r = step(false);
    if ((steps + 1) % 100 == 0)
      log_info("grpo: calculator start: step ", steps + 1, "/", o.copy_steps, " reading the result, loss ",
               r.loss, " | ", std::round(seconds_since(t0)), " s");
  }
  double rate = call_rate();
  const double rate_before = rate;
  for (int64_t m = 0; rate < o.call_rate && m < o.max_mixture_steps; ++m, ++steps) {
    const StepResult r = step(true);
    rate = call_rate();
    if ((m + 1) % 10 == 0)
      log_info("grpo: calculator start: mixture step ", m + 1, " loss ", r.loss, ", sampled call rate ", rate, " | ",
               std::round(seconds_since(t0)), " s");
  }
  if (rate < o.call_rate)
    log_info("grpo: warning: calculator start: the sampled call rate reached only ", rate, " (wanted ", o.call_rate,
             ") in ", o.max_mixture_steps, " mixture steps; GRPO starts from it all the same");
  nlohmann::json st = {{"format", "moetrain-calculator-start-1"}, {"step", steps}, {"model", base},
                       {"call_rate_before", rate_before}, {"call_rate_after", rate}};
  const std::string dir = save_grpo_checkpoint(o.run_dir, steps, session, nullptr, "", st, 0);
  log_info("grpo: calculator start ", dir, " made in ", std::round(seconds_since(t0)), " s (", steps,
           " steps; sampled call rate ", rate_before, " -> ", rate, ")");
  return dir;
}

std::vector<int32_t> ids32(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

bool Task::wanted(int64_t a, int64_t b) const {
  return !longest || std::max(a, b) >= pow10(hi - 1);
}

Problem Task::train(Rng& rng) const {
  for (;;) {
    const int64_t a = operand(rng, lo, hi), b = operand(rng, lo, hi);
    if (!is_eval_pair(a, b) && wanted(a, b)) return make_addition_problem(a, b);
  }
}

std::vector<Problem> Task::eval(int64_t n, uint64_t seed) const {
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

// One SFT micro-batch of `rows` problems: prompt -100, answer tokens as targets (HF labels).
MicroBatch sft_batch(const Task& task, Rng& rng, int64_t rows) {
  std::vector<SupervisedRow> r;
  for (int64_t i = 0; i < rows; ++i) r.push_back(answer_row(task.train(rng)));
  return supervised_batch(r, max_problem_tokens(task.hi));
}

int64_t sft_baseline(TrainSession& session, const Task& task, uint64_t seed, int64_t rows, double budget_s,
                     const std::function<double(int64_t)>& lr_at, MetricsWriter& metrics) {
  const auto t0 = Clock::now();
  Rng rng{seed};
  int64_t step = 0;
  while (seconds_since(t0) < budget_s) {
    ++step;
    StepOptions st;
    st.lr = lr_at(step);
    const StepResult r = session.train_step({sft_batch(task, rng, rows)}, st);
    nlohmann::json j = step_json(r, session.dist());
    j["step"] = step;
    j["lr"] = st.lr;
    j["elapsed_s"] = seconds_since(t0);
    metrics.write(j);
    if (step % 10 == 0) log_info("grpo: sft step ", step, " loss ", r.loss, " | ", std::round(seconds_since(t0)), " s");
  }
  return step;
}

}  // namespace mt::rl::addition
