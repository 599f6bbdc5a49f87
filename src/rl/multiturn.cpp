// Multi-turn rollouts against an Environment (multiturn.h).
#include "rl/multiturn.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"

namespace mt::rl {

TurnCredit parse_turn_credit(const std::string& s) {
  if (s == "final") return TurnCredit::Final;
  if (s == "per-turn") return TurnCredit::PerTurn;
  if (s == "per-turn-index") return TurnCredit::PerTurnIndex;
  MT_THROW("--turn-credit '", s, "' is unknown; use final (the last turn's reward for every turn), per-turn (each "
           "turn's return against the group's turns) or per-turn-index (against the group's turns of its index)");
}

const char* turn_credit_name(TurnCredit c) {
  switch (c) {
    case TurnCredit::Final:
      return "final";
    case TurnCredit::PerTurn:
      return "per-turn";
    case TurnCredit::PerTurnIndex:
      return "per-turn-index";
  }
  return "?";
}

void validate(const MultiTurnOptions& o) {
  if (o.max_turns < 1) MT_THROW("max_turns = ", o.max_turns, "; need >= 1 model turn per episode");
  if (o.max_turn_tokens < 0) MT_THROW("max_turn_tokens = ", o.max_turn_tokens, "; need >= 1, or 0 for no turn limit");
  if (o.max_observation_tokens < 1) MT_THROW("max_observation_tokens = ", o.max_observation_tokens, "; need >= 1");
}

std::vector<int64_t> token_turns(const GeneratedSample& s) {
  std::vector<int64_t> turn(s.tokens.size(), 0);
  size_t k = 0;
  for (size_t j = 0; j < s.tokens.size(); ++j) {
    while (k + 1 < s.turn_starts.size() && int64_t(j) >= s.turn_starts[k + 1]) ++k;
    turn[j] = int64_t(k);
  }
  return turn;
}

namespace {

// The episodes of one generate call and the callback's state.
class Episodes {
 public:
  Episodes(Environment& env, const TurnCodec& codec, const MultiTurnOptions& o) : env_(env), codec_(codec), o_(o) {}

  // init for every episode; the observations each request's episodes share go after its prompt.
  void start(std::vector<GenerateRequest>& reqs, int64_t first_id, const std::vector<nlohmann::json>& metadata) {
    if (!metadata.empty() && metadata.size() != reqs.size())
      MT_THROW("grpo: ", metadata.size(), " prompts' metadata for ", reqs.size(), " prompts");
    std::vector<EnvEpisode> eps;
    for (size_t p = 0; p < reqs.size(); ++p) {
      offset_.push_back(int64_t(eps.size()));
      const std::string text = codec_.decode(reqs[p].prompt);
      for (int64_t j = 0; j < reqs[p].n; ++j) {
        EnvEpisode e;
        e.id = first_id + int64_t(eps.size());
        e.prompt = text;
        if (!metadata.empty() && metadata[p].is_object()) {  // a chat's messages go apart from the other fields
          e.metadata = metadata[p];
          if (auto m = e.metadata.find("messages"); m != e.metadata.end()) {
            if (m->is_array()) e.messages = *m;
            e.metadata.erase(m);
          }
        }
        eps.push_back(std::move(e));
      }
    }
    ep_.resize(eps.size());
    ended_.assign(eps.size(), false);
    for (size_t i = 0; i < eps.size(); ++i) ep_[i].id = eps[i].id;
    started_ = true;
    const std::vector<EnvInitResult> init = env_.init(eps);
    if (init.size() != eps.size())
      MT_THROW("grpo: environment ", env_.name(), " answered init of ", eps.size(), " episodes with ", init.size(),
               " results; it must return one per episode");
    for (size_t p = 0; p < reqs.size(); ++p) {
      std::vector<int32_t> shared;
      bool first = true;
      for (int64_t j = 0; j < reqs[p].n; ++j) {
        const size_t i = size_t(offset_[p] + j);
        if (!init[i].error.empty()) {
          fail(i, "init: " + init[i].error);
          continue;
        }
        std::vector<int32_t> ids;  // no observation: nothing to render (a chat codec refuses an empty one)
        if (!init[i].observations.empty()) ids = codec_.encode(init[i].observations);
        if (first) {
          shared = std::move(ids);
          first = false;
        } else if (ids != shared) {
          MT_THROW("grpo: environment ", env_.name(), " gave the episodes of prompt ", p,
                   " different initial observations; the n samples of a prompt share it, so init must answer them "
                   "alike");
        }
      }
      if (int64_t(shared.size()) > o_.max_observation_tokens)
        MT_THROW("grpo: environment ", env_.name(), "'s initial observations for prompt ", p, " are ", shared.size(),
                 " tokens; --max-observation-tokens is ", o_.max_observation_tokens);
      for (int64_t j = 0; j < reqs[p].n; ++j) ep_[size_t(offset_[p] + j)].observation_tokens += int64_t(shared.size());
      reqs[p].prompt.insert(reqs[p].prompt.end(), shared.begin(), shared.end());
      reqs[p].max_turns = o_.max_turns;
      reqs[p].max_turn_tokens = o_.max_turn_tokens;
      reqs[p].max_observation_tokens = o_.max_observation_tokens;
    }
  }

  // The engine's callback: one reply per ended turn, in order.
  std::vector<TurnReply> on_turns(const std::vector<TurnEnd>& ends) {
    std::vector<TurnReply> replies(ends.size());
    std::vector<EnvTurn> turns;
    std::vector<size_t> which;  // ends index of each turn sent
    for (size_t k = 0; k < ends.size(); ++k) {
      const size_t i = episode(ends[k].prompt_index, ends[k].sample_index);
      replies[k].done = true;
      if (ended_[i]) continue;  // an earlier error ended it
      turns.push_back(turn_of(i, ends[k].turn, ends[k].tokens, ends[k].finish_reason));
      which.push_back(k);
    }
    const std::vector<EnvStepResult> res = step(turns);
    for (size_t t = 0; t < res.size(); ++t) {
      const size_t k = which[t], i = episode(ends[k].prompt_index, ends[k].sample_index);
      if (!take(i, res[t])) continue;
      if (res[t].done || ends[k].last || int64_t(ep_[i].turn_rewards.size()) >= o_.max_turns) {
        ended_[i] = true;
        replies[k].done = res[t].done;  // not done here: a limit ended the episode ("length")
        continue;
      }
      std::vector<int32_t> ids;
      try {
        if (!res[t].observations.empty()) ids = codec_.encode(res[t].observations);
      } catch (const std::exception& e) {
        fail(i, str("its observations: ", e.what()));
        continue;
      }
      if (int64_t(ids.size()) > o_.max_observation_tokens) {
        fail(i, str("its observations after turn ", ends[k].turn, " are ", ids.size(),
                    " tokens; --max-observation-tokens is ", o_.max_observation_tokens));
        continue;
      }
      if (ids.empty()) {
        fail(i, str("step ", ends[k].turn, " said not done but gave no observation to continue from"));
        continue;
      }
      ep_[i].observation_tokens += int64_t(ids.size());
      replies[k].append = std::move(ids);
      replies[k].done = false;
    }
    return replies;
  }

  // After generation: the turns the callback never saw (cut by the response limit) stepped, every episode
  // closed, the round's results.
  MultiTurnRound finish(std::vector<GeneratedSample> gen) {
    if (gen.size() != ep_.size())
      MT_THROW("grpo: the engine returned ", gen.size(), " samples for ", ep_.size(), " episodes");
    std::vector<EnvTurn> turns;
    std::vector<size_t> which;
    for (size_t s = 0; s < gen.size(); ++s) {
      const GeneratedSample& g = gen[s];
      const size_t i = episode(g.prompt_index, g.sample_index);
      if (g.model_mask.size() != g.tokens.size())
        MT_THROW("grpo: the engine's sample ", s, " has ", g.model_mask.size(), " model-mask entries for ",
                 g.tokens.size(), " tokens");
      // What the engine cut or dropped of the appends never reached the model.
      ep_[i].observation_tokens -= g.observation_tokens_cut + g.append_tokens_cut;
      const int64_t model_turns = int64_t(g.turn_starts.size()), seen = int64_t(ep_[i].turn_rewards.size());
      if (ended_[i] || model_turns <= seen) continue;
      // The last turn, cut before the callback saw it: its tokens run from its start to the end of the sample.
      const int64_t t0 = g.turn_starts.back();
      std::vector<int32_t> ids(g.tokens.begin() + t0, g.tokens.end());
      turns.push_back(turn_of(i, model_turns - 1, ids, g.finish_reason));
      which.push_back(i);
    }
    const std::vector<EnvStepResult> res = step(turns);
    for (size_t t = 0; t < res.size(); ++t) take(which[t], res[t]);
    close_all();
    MultiTurnRound r;
    r.samples = std::move(gen);
    r.episodes = std::move(ep_);
    r.errors = errors_;
    r.first_error = first_error_;
    r.env_metrics = std::move(metrics_);
    return r;
  }

  void close_all() {
    if (!started_ || closed_) return;
    closed_ = true;
    std::vector<int64_t> ids;
    for (const EpisodeResult& e : ep_) ids.push_back(e.id);
    env_.close(ids);
  }

 private:
  size_t episode(int64_t p, int64_t j) const {
    if (p < 0 || size_t(p) >= offset_.size())
      MT_THROW("grpo: the engine named prompt ", p, " of ", offset_.size(), " in a turn");
    const int64_t end = size_t(p) + 1 < offset_.size() ? offset_[size_t(p) + 1] : int64_t(ep_.size());
    if (j < 0 || offset_[size_t(p)] + j >= end)
      MT_THROW("grpo: the engine named sample ", j, " of prompt ", p, ", which has ", end - offset_[size_t(p)]);
    return size_t(offset_[size_t(p)] + j);
  }

  EnvTurn turn_of(size_t i, int64_t turn, const std::vector<int32_t>& ids, const std::string& finish) const {
    EnvTurn t;
    t.id = ep_[i].id;
    t.turn = turn;
    t.ids = ids;
    t.finish_reason = finish;
    std::vector<int32_t> body = ids;
    if (!body.empty() &&
        std::find(codec_.end_of_turn.begin(), codec_.end_of_turn.end(), body.back()) != codec_.end_of_turn.end())
      body.pop_back();
    t.text = codec_.decode(body);
    if (codec_.parse_tool_call) {
      std::string err;
      t.tool_call = codec_.parse_tool_call(t.text, &err);
      if (!t.tool_call) t.tool_call_error = err;
    }
    return t;
  }

  // env.step on a batch, its result count checked.
  std::vector<EnvStepResult> step(const std::vector<EnvTurn>& turns) {
    if (turns.empty()) return {};
    std::vector<EnvStepResult> res = env_.step(turns);
    if (res.size() != turns.size())
      MT_THROW("grpo: environment ", env_.name(), " answered a step of ", turns.size(), " turns with ", res.size(),
               " results; it must return one per turn");
    return res;
  }

  // One step's result into episode i; false when it was an error (the episode is then over).
  bool take(size_t i, const EnvStepResult& r) {
    EpisodeResult& e = ep_[i];
    if (!r.error.empty()) {
      e.turn_rewards.push_back(0);
      e.metadata.push_back(r.metadata);
      fail(i, str("step ", e.turn_rewards.size() - 1, ": ", r.error));
      return false;
    }
    if (!std::isfinite(r.reward)) {
      e.turn_rewards.push_back(0);
      e.metadata.push_back(r.metadata);
      fail(i, str("step ", e.turn_rewards.size() - 1, " gave reward ", r.reward, "; rewards must be finite"));
      return false;
    }
    e.turn_rewards.push_back(r.reward);
    e.metadata.push_back(r.metadata);
    e.done = r.done;
    if (r.metadata.is_object())
      for (auto it = r.metadata.begin(); it != r.metadata.end(); ++it)
        if (it.value().is_number() || it.value().is_boolean()) {
          auto& [sum, count] = metrics_[it.key()];
          sum += it.value().is_boolean() ? double(it.value().get<bool>()) : it.value().get<double>();
          ++count;
        }
    return true;
  }

  // The error policy: stop, or the episode's rewards zeroed and the episode ended.
  void fail(size_t i, const std::string& what) {
    EpisodeResult& e = ep_[i];
    const std::string msg = str("environment ", env_.name(), ", episode ", e.id, ": ", what);
    if (o_.stop_on_error) MT_THROW("grpo: ", msg, " (--reward-on-error stop)");
    std::fill(e.turn_rewards.begin(), e.turn_rewards.end(), 0.0);
    e.error = msg;
    e.done = false;
    ended_[i] = true;
    if (errors_++ == 0) first_error_ = msg;
  }

  Environment& env_;
  const TurnCodec& codec_;
  const MultiTurnOptions& o_;
  std::vector<int64_t> offset_;  // per request, its first episode
  std::vector<EpisodeResult> ep_;
  std::vector<bool> ended_;  // per episode: no more turns (done, an error, the turn limit)
  int64_t errors_ = 0;
  std::string first_error_;
  std::map<std::string, std::pair<double, int64_t>> metrics_;
  bool started_ = false, closed_ = false;
};

}  // namespace

MultiTurnRound run_episodes(RolloutEngine& engine, std::vector<GenerateRequest>& requests, Environment& env,
                            const TurnCodec& codec, const MultiTurnOptions& o, int64_t first_id,
                            const std::vector<nlohmann::json>& metadata) {
  validate(o);
  Episodes eps(env, codec, o);
  try {
    eps.start(requests, first_id, metadata);
    std::vector<GeneratedSample> gen =
        engine.generate(requests, [&](const std::vector<TurnEnd>& ends) { return eps.on_turns(ends); });
    MultiTurnRound r = eps.finish(std::move(gen));
    if (r.errors > 0)
      log_info("grpo: ", r.errors, " of ", r.episodes.size(),
               " episodes ended by an environment error (reward 0; "
               "--reward-on-error stop to stop instead); the first: ",
               r.first_error);
    return r;
  } catch (...) {
    eps.close_all();
    throw;
  }
}

EpisodeEval evaluate_episodes(RolloutEngine& engine, Environment& env, const TurnCodec& codec,
                              const std::vector<std::vector<int32_t>>& prompts, const MultiTurnOptions& o,
                              int64_t max_new_tokens, const std::vector<int32_t>& stop_token_ids, int64_t first_id) {
  if (prompts.empty()) MT_THROW("evaluate_episodes: no prompts");
  std::vector<GenerateRequest> reqs;
  for (const std::vector<int32_t>& p : prompts) {
    GenerateRequest r;
    r.prompt = p;
    r.sampling.temperature = 0;
    r.max_new_tokens = max_new_tokens;
    r.stop_token_ids = stop_token_ids;
    reqs.push_back(std::move(r));
  }
  const MultiTurnRound round = run_episodes(engine, reqs, env, codec, o, first_id);
  EpisodeEval e;
  e.episodes = int64_t(round.episodes.size());
  e.errors = round.errors;
  for (const EpisodeResult& x : round.episodes) {
    e.success += x.final_reward() > 0;
    e.reward_mean += x.final_reward();
  }
  e.success /= double(e.episodes);
  e.reward_mean /= double(e.episodes);
  for (const auto& [k, v] : round.env_metrics) e.env_metrics[k] = v.first / double(std::max<int64_t>(v.second, 1));
  return e;
}

}  // namespace mt::rl
