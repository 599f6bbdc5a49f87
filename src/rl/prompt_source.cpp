// The built-in task and prompt files behind one interface (prompt_source.h).
#include "rl/prompt_source.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "core/rng.h"

namespace mt::rl {

namespace {

using json = nlohmann::json;

class AdditionSource : public PromptSource {
 public:
  AdditionSource(const addition::Task& task, int64_t eval_n, uint64_t seed, addition::Reward kind)
      : task_(task), rng_{seed}, eval_(task.eval(eval_n, seed + 7)), kind_(kind) {}

  std::vector<std::vector<int32_t>> draw(int64_t count) override {
    std::vector<std::vector<int32_t>> prompts;
    round_.clear();
    for (int64_t i = 0; i < count; ++i) {
      round_.push_back(task_.train(rng_));
      ++drawn_;
      prompts.push_back(addition::ids32(round_.back().prompt_ids));
    }
    return prompts;
  }
  std::vector<double> rewards(const std::vector<GeneratedSample>& g) override {
    std::vector<double> r;
    for (const GeneratedSample& x : g)
      r.push_back(addition::answer_reward(round_.at(size_t(x.prompt_index)), x.tokens, kind_));
    return r;
  }
  std::vector<std::vector<double>> token_rewards(const std::vector<GeneratedSample>& g) override {
    std::vector<std::vector<double>> r;
    for (const GeneratedSample& x : g)
      r.push_back(addition::answer_token_rewards(round_.at(size_t(x.prompt_index)), x.tokens));
    return r;
  }
  double evaluate(RolloutEngine& engine) override { return addition::exact_match(engine, eval_, task_.hi); }
  bool has_eval() const override { return true; }
  int64_t eval_size() const override { return int64_t(eval_.size()); }
  std::string eval_name() const override { return "exact-match"; }
  std::string shown(double v) const override {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f%%", v);
    return b;
  }
  std::string describe() const override {
    return "task: addition, operands of " + std::to_string(task_.lo) + ".." + std::to_string(task_.hi) + " digits" +
           (task_.longest ? ", at least one of " + std::to_string(task_.hi) : "");
  }
  int64_t longest_prompt() const override { return max_problem_tokens(task_.hi); }
  void save(json& st) const override { st["problems_drawn"] = drawn_; }
  void restore(const json& st) override {
    for (const int64_t n = st.at("problems_drawn").get<int64_t>(); drawn_ < n; ++drawn_) task_.train(rng_);
  }

 private:
  addition::Task task_;
  Rng rng_;
  std::vector<Problem> eval_;
  addition::Reward kind_;
  std::vector<Problem> round_;  // the last round's problems, by its prompt index
  int64_t drawn_ = 0;           // the problems drawn from rng_: a resumed run replays them
};

class FileSource : public PromptSource {
 public:
  FileSource(const PromptRun& run, uint64_t seed, int64_t max_new_tokens, std::vector<int32_t> stops)
      : run_(run),
        sampler_(std::max<int64_t>(1, int64_t(run.train.prompts.size())), mix64(seed)),
        max_new_tokens_(max_new_tokens),
        stops_(std::move(stops)) {}

  std::vector<std::vector<int32_t>> draw(int64_t count) override {
    std::vector<std::vector<int32_t>> prompts;
    round_.clear();
    for (int64_t i = 0; i < count; ++i) {
      round_.push_back(sampler_.next());
      prompts.push_back(run_.train.prompts[size_t(round_.back())].ids);
    }
    return prompts;
  }
  std::vector<double> rewards(const std::vector<GeneratedSample>& g) override {
    return run_.rewarder(run_.train, round_, g);
  }
  std::vector<std::vector<double>> token_rewards(const std::vector<GeneratedSample>&) override {
    MT_THROW("grpo: a prompt file has no per-token rewards (use --advantage outcome)");
  }
  json metadata(int64_t k) const override { return run_.train.prompts[size_t(round_.at(size_t(k)))].meta; }
  double evaluate(RolloutEngine& engine) override {
    std::vector<GenerateRequest> reqs;
    std::vector<int64_t> which;
    for (size_t k = 0; k < run_.eval.prompts.size(); ++k) {
      GenerateRequest r;
      r.prompt = run_.eval.prompts[k].ids;
      r.sampling.temperature = 0;
      r.max_new_tokens = max_new_tokens_;
      r.stop_token_ids = stops_;
      reqs.push_back(std::move(r));
      which.push_back(int64_t(k));
    }
    const std::vector<double> r = run_.rewarder(run_.eval, which, engine.generate(reqs));
    double sum = 0;
    for (double x : r) sum += accuracy() ? (x >= 1.0 ? 1.0 : 0.0) : x;
    return (accuracy() ? 100.0 : 1.0) * sum / double(r.size());
  }
  // With --env the environment's greedy episodes are the evaluation (the file has no reward of its own).
  bool has_eval() const override { return !run_.eval.prompts.empty() && run_.rewarder.kind != FileReward::Environment; }
  int64_t eval_size() const override { return int64_t(run_.eval.prompts.size()); }
  std::string eval_name() const override {
    return run_.rewarder.kind == FileReward::Exact  ? "exact-match"
           : run_.rewarder.kind == FileReward::Math ? "math"
                                                    : "program-reward";
  }
  std::string shown(double v) const override {
    char b[32];
    std::snprintf(b, sizeof b, accuracy() ? "%.1f%%" : "%.4f", v);
    return b;
  }
  std::string describe() const override { return "prompts: " + run_.train.path; }
  int64_t longest_prompt() const override {
    int64_t longest = 1;
    for (const PromptFile* f : {&run_.train, &run_.eval})
      for (const Prompt& p : f->prompts) longest = std::max<int64_t>(longest, int64_t(p.ids.size()));
    return longest;
  }
  void save(json& st) const override {
    st["prompt_position"] = sampler_.position();
    st["prompts"] = {{"file", run_.train.path}, {"count", run_.train.prompts.size()}};
  }
  void restore(const json& st) override { sampler_.set_position(st.at("prompt_position").get<int64_t>()); }

 private:
  bool accuracy() const { return run_.rewarder.kind != FileReward::Program; }
  const PromptRun& run_;
  PromptSampler sampler_;
  int64_t max_new_tokens_;
  std::vector<int32_t> stops_;
  std::vector<int64_t> round_;  // the last round's file indices, by its prompt index
};

}  // namespace

std::unique_ptr<PromptSource> addition_source(const addition::Task& task, int64_t eval_n, uint64_t seed,
                                              addition::Reward kind) {
  return std::make_unique<AdditionSource>(task, eval_n, seed, kind);
}

std::unique_ptr<PromptSource> file_source(const PromptRun& run, uint64_t seed, int64_t max_new_tokens,
                                          std::vector<int32_t> stop_token_ids) {
  return std::make_unique<FileSource>(run, seed, max_new_tokens, std::move(stop_token_ids));
}

}  // namespace mt::rl
