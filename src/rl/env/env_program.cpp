// An environment program: the JSON-lines protocol over a child process (env_program.h).
#include "rl/env/env_program.h"

#include <cmath>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt::rl {

using json = nlohmann::json;

namespace {

constexpr const char* kWhat = "environment program";

// A program's line as an error quotes it: at most 200 characters.
std::string quoted(const std::string& line) {
  return "'" + (line.size() > 200 ? line.substr(0, 200) + "..." : line) + "'";
}

std::string shown(const json& v) {
  const std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 80) + "..." : s;
}

// "observations": absent, null or a list of {"role": "user" | "tool", "content": string}; "" or what is wrong.
EnvProgramOptions checked(EnvProgramOptions opt) {
  if (!(opt.timeout_s > 0)) MT_THROW(kWhat, ": the timeout (", opt.timeout_s, " s) must be > 0");
  return opt;
}

}  // namespace

json init_request(const EnvEpisode& e) {
  return json{{"id", e.id}, {"type", "init"}, {"prompt", e.prompt}, {"messages", e.messages}, {"metadata", e.metadata}};
}

json step_request(const EnvTurn& t) {
  return json{
      {"id", t.id},
      {"type", "step"},
      {"turn", t.turn},
      {"text", t.text},
      {"ids", t.ids},
      {"finish_reason", t.finish_reason},
      {"tool_call", t.tool_call ? json{{"name", t.tool_call->name}, {"arguments", t.tool_call->arguments}} : json()},
      {"tool_call_error", t.tool_call_error}};
}

std::string parse_observations(const json& j, std::vector<EnvObservation>& out) {
  auto it = j.find("observations");
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_array()) return str("\"observations\" is ", shown(*it), ", not a list");
  for (size_t k = 0; k < it->size(); ++k) {
    const json& o = (*it)[k];
    if (!o.is_object() || !o.contains("content") || !o["content"].is_string())
      return str("observations[", k, "] is ", shown(o), ", not {\"role\": \"user\" | \"tool\", \"content\": string}");
    EnvObservation ob;
    ob.content = o["content"].get<std::string>();
    if (o.contains("role")) {
      if (!o["role"].is_string() || (o["role"] != "user" && o["role"] != "tool"))
        return str("observations[", k, "].role is ", shown(o["role"]), "; use \"user\" or \"tool\"");
      ob.role = o["role"].get<std::string>();
    }
    out.push_back(std::move(ob));
  }
  return {};
}

std::string parse_step_reply(const json& j, EnvStepResult& r) {
  if (!j.contains("reward") || !j["reward"].is_number() || !std::isfinite(j["reward"].get<double>()))
    return j.contains("reward") ? str("\"reward\" is ", shown(j["reward"]), ", not a finite number")
                                : std::string("no \"reward\" (a finite number)");
  if (!j.contains("done") || !j["done"].is_boolean())
    return j.contains("done") ? str("\"done\" is ", shown(j["done"]), ", not true or false")
                              : std::string("no \"done\" (true or false)");
  r.reward = j["reward"].get<double>();
  r.done = j["done"].get<bool>();
  if (j.contains("metadata") && !j["metadata"].is_null()) {
    if (!j["metadata"].is_object()) return str("\"metadata\" is ", shown(j["metadata"]), ", not an object");
    r.metadata = j["metadata"];
  }
  return parse_observations(j, r.observations);
}

EnvProgram::EnvProgram(EnvProgramOptions opt) : opt_(checked(std::move(opt))) {
  if (opt_.reward_only) {
    RewardProgramOptions ro;
    ro.command = opt_.command;
    ro.timeout_s = opt_.timeout_s;
    ro.stop_on_error = opt_.stop_on_error;
    reward_ = std::make_unique<RewardProgram>(ro);
  } else {
    proc_ = std::make_unique<ChildProcess>(kWhat, opt_.command);
  }
}

EnvProgram::~EnvProgram() = default;

const FailureTally& EnvProgram::tally() const {
  return reward_ ? reward_->tally() : tally_;
}

int64_t EnvProgram::restarts() const {
  return reward_ ? reward_->restarts() : proc_->restarts();
}

std::vector<std::string> EnvProgram::call(const char* kind, const std::vector<int64_t>& ids, const std::string& send,
                                          const std::function<std::string(size_t, const json&)>& parse) {
  const size_t n = ids.size();
  std::vector<std::string> errors(n);
  if (n == 0) return errors;
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < n; ++i)
    if (!index.emplace(ids[i], i).second)
      MT_THROW(kWhat, ": episode id ", ids[i], " appears twice in one ", kind,
               " call; ids must be unique among the episodes in flight");
  std::vector<std::string> stray;  // lines that answered nothing, as errors quoting them
  {
    std::istringstream left(proc_->take_leftover());
    for (std::string line; std::getline(left, line);)
      if (line.find_first_not_of(" \t\r") != std::string::npos)
        stray.push_back(str("line ", quoted(line), " came after the previous call was answered"));
  }
  std::vector<char> answered(n, 0);
  size_t done = 0;
  auto on_line = [&](const std::string& line) {
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) {
      stray.push_back(
          str("line ", quoted(line), " is not JSON (a reply is one JSON object on one line; logs belong on stderr)"));
      return done == n;
    }
    if (!j.is_object() || !j.contains("id")) {
      stray.push_back(str("reply ", quoted(line), " has no \"id\" (a reply names its episode: {\"id\": n, ...})"));
      return done == n;
    }
    const auto it = j["id"].is_number_integer() ? index.find(j["id"].get<int64_t>()) : index.end();
    if (it == index.end()) {
      stray.push_back(
          str("reply ", quoted(line), " has id ", shown(j["id"]), ", which is no episode of this ", kind, " call"));
      return done == n;
    }
    const size_t i = it->second;
    if (answered[i]) {
      errors[i] = str("a second reply ", quoted(line), " for episode ", ids[i], " in one ", kind, " call");
      return done == n;
    }
    answered[i] = 1;
    ++done;
    if (j.contains("error")) {
      errors[i] = str("the program reported an error for episode ", ids[i], ": ",
                      j["error"].is_string() ? j["error"].get<std::string>() : shown(j["error"]));
    } else if (const std::string why = parse(i, j); !why.empty()) {
      errors[i] = str("reply ", quoted(line), " for episode ", ids[i], ": ", why);
    }
    return done == n;
  };
  const std::string failure = proc_->exchange(send, opt_.timeout_s, on_line);
  int64_t failures = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!answered[i] && errors[i].empty())
      errors[i] = stray.empty() ? failure
                                : str(failure, "; before that it wrote ", stray.size(),
                                      " line(s) that were no reply: ", stray.front());
    failures += errors[i].empty() ? 0 : 1;
  }
  ++tally_.calls;
  tally_.stray_lines += int64_t(stray.size());
  for (size_t i = 0; i < n; ++i) {  // an episode counts once, and fails once whichever of its calls failed
    auto [it, fresh] = failed_.try_emplace(ids[i], false);
    tally_.items += fresh ? 1 : 0;
    if (!errors[i].empty() && !it->second) {
      it->second = true;
      ++tally_.failures;
    }
  }
  if (failures > 0 || !stray.empty()) {
    size_t first = 0;
    while (first < n && errors[first].empty()) ++first;
    std::string msg = first < n ? str(kWhat, ": ", kind, ": ", failures, " of ", n, " episodes failed; episode ",
                                      ids[first], ": ", errors[first])
                                : str(kWhat, ": ", kind, ": ", stray.front());
    if (first < n && !stray.empty()) msg += str("; and ", stray.size(), " stray line(s): ", stray.front());
    tally_.note(msg);
    if (opt_.stop_on_error) MT_THROW(msg);
    log_info("warning: ", msg);
  }
  return errors;
}

std::vector<EnvInitResult> EnvProgram::init(const std::vector<EnvEpisode>& episodes) {
  std::vector<EnvInitResult> out(episodes.size());
  if (reward_) {  // the one-step case: nothing to ask before the response
    for (const EnvEpisode& e : episodes) episodes_[e.id] = e;
    return out;
  }
  std::vector<int64_t> ids;
  std::string send;
  for (const EnvEpisode& e : episodes) {
    failed_.erase(e.id);  // a new episode with the id of an earlier one
    ids.push_back(e.id);
    send += init_request(e).dump() + "\n";
  }
  const auto errors =
      call("init", ids, send, [&](size_t i, const json& j) { return parse_observations(j, out[i].observations); });
  for (size_t i = 0; i < out.size(); ++i)
    if (!errors[i].empty()) {
      out[i].observations.clear();
      out[i].error = errors[i];
    }
  return out;
}

std::vector<EnvStepResult> EnvProgram::step(const std::vector<EnvTurn>& turns) {
  std::vector<EnvStepResult> out(turns.size());
  if (reward_) {
    std::vector<RewardRequest> reqs;
    std::vector<size_t> asked;
    for (size_t i = 0; i < turns.size(); ++i) {
      const auto it = episodes_.find(turns[i].id);
      if (it == episodes_.end()) {
        out[i].error = str("reward program: episode ", turns[i].id, " was never started with init");
        continue;
      }
      reqs.push_back({it->second.prompt, turns[i].text, it->second.metadata});
      asked.push_back(i);
    }
    const RewardBatch b = reward_->score(reqs);
    for (size_t k = 0; k < asked.size(); ++k) {
      out[asked[k]].reward = b.rewards[k];
      out[asked[k]].error = b.errors[k];
    }
    return out;
  }
  std::vector<int64_t> ids;
  std::string send;
  for (const EnvTurn& t : turns) {
    ids.push_back(t.id);
    send += step_request(t).dump() + "\n";
  }
  const auto errors = call("step", ids, send, [&](size_t i, const json& j) -> std::string {
    return parse_step_reply(j, out[i]);
  });
  for (size_t i = 0; i < out.size(); ++i)
    if (!errors[i].empty()) out[i] = EnvStepResult{{}, 0.0, true, json::object(), errors[i]};
  return out;
}

void EnvProgram::close(const std::vector<int64_t>& ids) {
  if (reward_) {
    for (int64_t id : ids) episodes_.erase(id);
    return;
  }
  std::string send;
  for (int64_t id : ids) {
    failed_.erase(id);
    send += json{{"id", id}, {"type", "close"}}.dump() + "\n";
  }
  proc_->post(send);
}

}  // namespace mt::rl
