// The built-in environments on the demo's addition problems (builtin_envs.h).
#include "rl/env/builtin_envs.h"

#include <algorithm>
#include <charconv>
#include <map>

#include "core/error.h"

namespace mt::rl {

namespace {

constexpr const char* kBos = "<bos>";
constexpr const char* kEos = "<eos>";

struct Sum {
  int64_t a = 0, b = 0;
  std::string prompt;  // "<bos>A+B="
  std::string answer;  // the sum's digits, least significant first
};

// "<bos>A+B=" (the demo's prompt as the codec decodes it) -> the problem; an error says what it was.
bool parse_problem(const std::string& text, Sum& s, std::string* error) {
  std::string t = text;
  if (t.rfind(kBos, 0) == 0) t = t.substr(5);
  const size_t plus = t.find('+'), eq = t.find('=');
  auto number = [](const std::string& d, int64_t& v) {
    if (d.empty() || d.size() > 9 || !std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return false;
    return std::from_chars(d.data(), d.data() + d.size(), v).ec == std::errc();
  };
  if (plus == std::string::npos || eq == std::string::npos || eq != t.size() - 1 || plus > eq ||
      !number(t.substr(0, plus), s.a) || !number(t.substr(plus + 1, eq - plus - 1), s.b)) {
    *error = "the prompt '" + text + "' is not an addition problem <bos>A+B= (A and B of 1..9 digits)";
    return false;
  }
  s.prompt = std::string(kBos) + std::to_string(s.a) + "+" + std::to_string(s.b) + "=";
  s.answer = std::to_string(s.a + s.b);
  std::reverse(s.answer.begin(), s.answer.end());
  return true;
}

// The turn's answer (its text holds no end-of-turn token; cut at an <eos> inside it all the same) and whether
// the model ended it (a stop token, not the length limit).
std::string answer_of(const EnvTurn& t, bool* ended) {
  *ended = t.finish_reason == "stop";
  const size_t e = t.text.find(kEos);
  if (e != std::string::npos) *ended = true;
  return t.text.substr(0, e);
}

// What the episodes in flight are about, by id: the common part of both environments.
class AdditionEnv : public Environment {
 public:
  std::vector<EnvInitResult> init(const std::vector<EnvEpisode>& episodes) override {
    std::vector<EnvInitResult> out(episodes.size());
    for (size_t i = 0; i < episodes.size(); ++i) {
      Sum s;
      if (parse_problem(episodes[i].prompt, s, &out[i].error)) {
        if (live_.count(episodes[i].id))
          out[i].error = "episode id " + std::to_string(episodes[i].id) + " is already in flight";
        else
          live_[episodes[i].id] = s;
      } else {
        out[i].error = name() + ": " + out[i].error;
      }
    }
    return out;
  }
  std::vector<EnvStepResult> step(const std::vector<EnvTurn>& turns) override {
    std::vector<EnvStepResult> out(turns.size());
    for (size_t i = 0; i < turns.size(); ++i) {
      auto it = live_.find(turns[i].id);
      if (it == live_.end()) {
        out[i].error = name() + ": episode " + std::to_string(turns[i].id) + " was never initialised or is closed";
        continue;
      }
      out[i] = answer(it->second, turns[i]);
    }
    return out;
  }
  void close(const std::vector<int64_t>& ids) override {
    for (int64_t id : ids) live_.erase(id);
  }

 protected:
  virtual EnvStepResult answer(const Sum& s, const EnvTurn& t) = 0;

 private:
  std::map<int64_t, Sum> live_;
};

class RetryEnv : public AdditionEnv {
 public:
  std::string name() const override { return "retry"; }

 protected:
  EnvStepResult answer(const Sum& s, const EnvTurn& t) override {
    EnvStepResult r;
    bool ended = false;
    const bool right = answer_of(t, &ended) == s.answer && ended;
    if (t.turn == 0) {
      r.metadata["first_try_correct"] = right ? 1 : 0;
      if (right) {
        r.reward = kRetryFirstReward;
        return r;
      }
      r.done = false;
      r.observations.push_back({"user", std::string(ended ? "" : kEos) + s.prompt});
      return r;
    }
    r.metadata["second_try_correct"] = right ? 1 : 0;
    r.reward = right ? kRetrySecondReward : 0.0;
    return r;
  }
};

class CalculatorEnv : public AdditionEnv {
 public:
  std::string name() const override { return "calculator"; }

 protected:
  EnvStepResult answer(const Sum& s, const EnvTurn& t) override {
    EnvStepResult r;
    bool ended = false;
    const std::string ans = answer_of(t, &ended);
    const bool call = ans == "?" && ended;
    if (t.turn == 0) r.metadata["tool_call"] = call ? 1 : 0;
    if (call && t.turn == 0) {
      r.done = false;
      r.observations.push_back({"tool", s.prompt + s.answer + kEos + s.prompt});
      return r;
    }
    const bool right = !call && ended && ans == s.answer;
    r.metadata["correct"] = right ? 1 : 0;
    r.reward = right ? 1.0 : 0.0;
    return r;
  }
};

}  // namespace

std::vector<std::string> builtin_env_names() {
  return {"retry", "calculator"};
}

std::unique_ptr<Environment> make_builtin_env(const std::string& name) {
  if (name == "retry") return std::make_unique<RetryEnv>();
  if (name == "calculator") return std::make_unique<CalculatorEnv>();
  MT_THROW("--env builtin:", name, " is unknown; the built-in environments are builtin:retry and builtin:calculator");
}

}  // namespace mt::rl
