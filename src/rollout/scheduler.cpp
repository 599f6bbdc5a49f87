// Scheduler (scheduler.h): admission, the step's batch, forks and finishing, over the KV block manager.
#include "rollout/scheduler.h"

#include <algorithm>
#include <unordered_map>

#include "core/error.h"

namespace mt {

Scheduler::Scheduler(KvBlockManager& blocks, const std::vector<GenerateRequest>& requests, const SchedulerOptions& opt)
    : blocks_(blocks), requests_(requests), opt_(opt) {
  if (opt_.max_step_tokens < 1 || opt_.max_running < 1)
    MT_THROW("scheduler: max_step_tokens (", opt_.max_step_tokens, ") and max_running (", opt_.max_running,
             ") must be >= 1");
  for (size_t i = 0; i < requests.size(); ++i) waiting_.push_back(int64_t(i));
}

Scheduler::~Scheduler() {
  for (const auto* list : {&running_, &admitted_})
    for (const auto& sp : *list)
      if (sp && blocks_.contains(sp->id)) blocks_.free(sp->id);
}

StepPlan Scheduler::schedule() {
  MT_CHECK(admitted_.empty(), "scheduler: schedule() called again before update()");
  MT_CHECK(turn_ended_.empty(), "scheduler: schedule() before reply() to the ", turn_ended_.size(),
           " turns that ended");
  StepPlan plan;
  // A token's slot (a fresh block, or a copy of a shared partial one).
  auto slot = [&](const Sequence& s) {
    const AppendResult ar = blocks_.append_slot(s.id);
    if (ar.copy) plan.copies.push_back(*ar.copy);
  };
  // Every running sequence's next token (the last one drawn).
  for (const auto& sp : running_) {
    if (int64_t(sp->tokens.size()) - sp->cached != 1) continue;
    slot(*sp);
    plan.seqs.push_back({sp.get(), false, false, plan.num_tokens, 1, plan.num_draws, 1});
    ++plan.num_tokens;
    ++plan.num_draws;
    ++plan.num_decodes;
  }
  // Multi-turn: the sequences with appended tokens (the last model token, then the append), within the step's
  // budget; the first chunk of a step always gets a token, so appends progress however many decode.
  for (const auto& sp : running_) {
    const int64_t pending = int64_t(sp->tokens.size()) - sp->cached;
    if (pending <= 1) continue;
    int64_t take = std::min(pending, opt_.max_step_tokens - plan.num_tokens);
    if (plan.num_appends == 0) take = std::max<int64_t>(take, 1);
    if (take <= 0) break;
    for (int64_t k = 0; k < take; ++k) slot(*sp);
    const int64_t draws = take == pending ? 1 : 0;  // the draw comes with the chunk's last token
    plan.seqs.push_back({sp.get(), false, true, plan.num_tokens, take, plan.num_draws, draws});
    plan.num_tokens += take;
    plan.num_draws += draws;
    ++plan.num_appends;
    plan.num_append_tokens += take;
  }
  // Then whole prompts, in request order, while they fit.
  int64_t in_flight = int64_t(running_.size());
  while (!waiting_.empty()) {
    const GenerateRequest& r = requests_[size_t(waiting_.front())];
    const int64_t L = int64_t(r.prompt.size());
    const bool fits_tokens = plan.num_tokens == 0 || plan.num_tokens + L <= opt_.max_step_tokens;
    if (!fits_tokens || in_flight + r.n > opt_.max_running || !blocks_.can_admit(L, r.max_new_tokens, r.n)) break;
    auto s = std::make_unique<Sequence>();
    s->id = next_id_++;
    s->req = waiting_.front();
    s->prompt_len = L;
    s->tokens = r.prompt;
    blocks_.allocate(s->id, L, r.max_new_tokens, r.n);  // the forks' blocks reserved too
    s->turn_starts = {0};
    plan.seqs.push_back({s.get(), true, false, plan.num_tokens, L, plan.num_draws, r.n});
    plan.num_tokens += L;
    plan.num_draws += r.n;  // a row per sample, all from the prompt's last token
    plan.num_prefill_tokens += L;
    ++plan.num_prefills;
    in_flight += r.n;
    admitted_.push_back(std::move(s));
    waiting_.pop_front();
  }
  plan.idle = waiting_.empty() && running_.empty() && admitted_.empty();
  if (plan.num_tokens == 0 && !plan.idle)  // cannot happen: a request that fits nothing was refused up front
    MT_THROW("engine: nothing could be scheduled (", waiting_.size(), " waiting, ", blocks_.stats().available_blocks,
             " KV blocks available)");
  return plan;
}

void Scheduler::keep_routing(Sequence& s, const std::vector<Tensor>& routing, int64_t first_row, int64_t rows) const {
  if (routing.empty()) return;  // not recorded, or no sparse layer
  if (s.routing.empty()) s.routing = RoutingRecord(int64_t(routing.size()), opt_.experts_per_tok, opt_.num_experts);
  s.routing.append(routing, first_row, rows);
}

void Scheduler::take(std::unique_ptr<Sequence> seq, int64_t draw, const StepDraws& result,
                     std::vector<std::unique_ptr<Sequence>>& next) {
  Sequence& s = *seq;
  const GenerateRequest& r = requests_[size_t(s.req)];
  const int32_t token = result.tokens[size_t(draw)];
  s.tokens.push_back(token);
  s.logprobs.push_back(result.logprobs[size_t(draw)]);
  s.model_mask.push_back(1);
  ++new_tokens_;
  const bool eos = !r.ignore_eos && opt_.eos_token_id >= 0 && token == opt_.eos_token_id;
  const bool stop = eos || std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) != r.stop_token_ids.end();
  const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
  if (opt_.multi_turn) {  // a turn ends; reply() decides what follows
    const int64_t turn_len = generated - s.turn_starts.back();
    if (stop || generated >= r.max_new_tokens || (r.max_turn_tokens > 0 && turn_len >= r.max_turn_tokens)) {
      s.turn_finish = stop ? "stop" : "length";
      turn_ended_.push_back(&s);
    }
    next.push_back(std::move(seq));
    return;
  }
  if (stop || generated >= r.max_new_tokens) {
    s.finish_reason = stop ? "stop" : "length";
    blocks_.free(s.id);
    finished_.push_back(std::move(seq));
  } else {
    next.push_back(std::move(seq));
  }
}

void Scheduler::update(const StepPlan& plan, const StepDraws& result) {
  MT_CHECK(int64_t(result.tokens.size()) == plan.num_draws && int64_t(result.logprobs.size()) == plan.num_draws,
           "scheduler: the step drew ", result.tokens.size(), " tokens and ", result.logprobs.size(),
           " log-probs; the plan has ", plan.num_draws, " draws");
  std::vector<std::unique_ptr<Sequence>> next;
  // The running sequences in their order (those the step left out, waiting with appended tokens, too).
  std::unordered_map<const Sequence*, const ScheduledSeq*> entry;
  for (const ScheduledSeq& e : plan.seqs)
    if (!e.prefill) entry[e.seq] = &e;
  size_t found = 0;
  for (std::unique_ptr<Sequence>& owner : running_) {
    const auto it = entry.find(owner.get());
    if (it == entry.end()) {
      next.push_back(std::move(owner));
      continue;
    }
    const ScheduledSeq& e = *it->second;
    ++found;
    keep_routing(*owner, result.routing, e.first_token, e.num_tokens);
    owner->cached += e.num_tokens;
    if (e.num_draws == 1)
      take(std::move(owner), e.first_draw, result, next);
    else
      next.push_back(std::move(owner));  // a chunk of appended tokens with more to come
  }
  MT_CHECK(found == entry.size(), "scheduler: update() with a plan other than the last schedule()'s");
  size_t admitted_i = 0;
  for (const ScheduledSeq& e : plan.seqs) {
    if (!e.prefill) continue;
    std::unique_ptr<Sequence>& owner = admitted_.at(admitted_i++);
    MT_CHECK(owner.get() == e.seq, "scheduler: update() with a plan other than the last schedule()'s");
    keep_routing(*owner, result.routing, e.first_token, e.num_tokens);
    owner->cached += e.num_tokens;
    // The prompt's samples: forks of its blocks, each drawing from the same logits row.
    std::unique_ptr<Sequence> parent = std::move(owner);
    const GenerateRequest& r = requests_[size_t(parent->req)];
    std::vector<std::unique_ptr<Sequence>> samples;
    for (int64_t j = 1; j < r.n; ++j) {
      auto child = std::make_unique<Sequence>(*parent);
      child->id = next_id_++;
      child->sample = j;
      blocks_.fork(parent->id, child->id);
      samples.push_back(std::move(child));
    }
    take(std::move(parent), e.first_draw, result, next);
    for (int64_t j = 1; j < r.n; ++j) take(std::move(samples[size_t(j - 1)]), e.first_draw + j, result, next);
  }
  MT_CHECK(admitted_i == admitted_.size(), "scheduler: update() with a plan other than the last schedule()'s");
  running_ = std::move(next);
  admitted_.clear();
}

std::vector<TurnEnd> Scheduler::turn_ends() const {
  std::vector<TurnEnd> out;
  for (const Sequence* sp : turn_ended_) {
    const Sequence& s = *sp;
    const GenerateRequest& r = requests_[size_t(s.req)];
    const int64_t turn = int64_t(s.turn_starts.size()) - 1, response = int64_t(s.tokens.size()) - s.prompt_len;
    TurnEnd t;
    t.prompt_index = s.req;
    t.sample_index = s.sample;
    t.turn = turn;
    t.tokens.assign(s.tokens.begin() + s.prompt_len + s.turn_starts.back(), s.tokens.end());
    t.finish_reason = s.turn_finish;
    t.tokens_left = r.max_new_tokens - response;
    t.last = t.tokens_left <= 0 || (r.max_turns > 0 && turn + 1 >= r.max_turns);
    out.push_back(std::move(t));
  }
  return out;
}

void Scheduler::reply(const std::vector<TurnReply>& replies) {
  if (replies.size() != turn_ended_.size())
    MT_THROW("turn callback: ", replies.size(), " replies for ", turn_ended_.size(),
             " ended turns; it must return one per TurnEnd, in their order");
  auto where = [&](size_t i) {
    const Sequence& s = *turn_ended_[i];
    return std::string("turn callback: reply ") + std::to_string(i) + " (prompt " + std::to_string(s.req) +
           ", sample " + std::to_string(s.sample) + ", turn " + std::to_string(s.turn_starts.size() - 1) + ")";
  };
  for (size_t i = 0; i < replies.size(); ++i) {  // checked before any episode changes
    if (replies[i].done || opt_.vocab_size <= 0) continue;
    const std::vector<int32_t>& a = replies[i].append;
    for (size_t j = 0; j < a.size(); ++j)
      if (a[j] < 0 || a[j] >= opt_.vocab_size)
        MT_THROW(where(i), ": appended token ", a[j], " at index ", j, " is outside the vocabulary [0, ",
                 opt_.vocab_size, ")");
  }
  bool any_finished = false;
  for (size_t i = 0; i < replies.size(); ++i) {
    Sequence& s = *turn_ended_[i];
    const GenerateRequest& r = requests_[size_t(s.req)];
    const TurnReply& rep = replies[i];
    const int64_t response = int64_t(s.tokens.size()) - s.prompt_len, left = r.max_new_tokens - response;
    const int64_t turns = int64_t(s.turn_starts.size());
    const bool cut_turn = s.turn_finish == "length" && left <= 0;  // the budget ended the turn mid-way
    s.turn_finish.clear();
    std::string finish;
    if (cut_turn)
      finish = "length";
    else if (rep.done)
      finish = "stop";
    else if (r.max_turns > 0 && turns >= r.max_turns)
      finish = "length";
    if (finish.empty()) {
      int64_t keep = int64_t(rep.append.size());
      if (r.max_observation_tokens > 0 && keep > r.max_observation_tokens) {
        s.observation_tokens_cut += keep - r.max_observation_tokens;
        keep = r.max_observation_tokens;
      }
      if (keep >= left) {  // no model token would fit after it: dropped, the episode ends
        s.append_tokens_cut += keep;
        finish = "length";
      } else {
        s.tokens.insert(s.tokens.end(), rep.append.begin(), rep.append.begin() + keep);
        s.logprobs.resize(s.logprobs.size() + size_t(keep), 0.0f);
        s.model_mask.resize(s.model_mask.size() + size_t(keep), 0);
        s.turn_starts.push_back(response + keep);
        continue;
      }
    }
    s.finish_reason = finish;
    any_finished = true;
  }
  turn_ended_.clear();
  if (!any_finished) return;
  std::vector<std::unique_ptr<Sequence>> next;
  for (std::unique_ptr<Sequence>& sp : running_) {
    if (sp->finish_reason.empty()) {
      next.push_back(std::move(sp));
      continue;
    }
    blocks_.free(sp->id);
    finished_.push_back(std::move(sp));
  }
  running_ = std::move(next);
}

}  // namespace mt
