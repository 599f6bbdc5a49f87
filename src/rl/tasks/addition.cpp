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
#include "core/error.h"
#include "core/log.h"
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
