// Scheduler (scheduler.h): admission, the step's batch, forks and finishing, over the KV block manager.
#include "rollout/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

Scheduler::Scheduler(KvBlockManager& blocks, const std::vector<GenerateRequest>& requests, const SchedulerOptions& opt)
    : blocks_(blocks), requests_(requests), opt_(opt) {
  if (opt_.max_step_tokens < 1 || opt_.max_running < 1)
    MT_THROW("scheduler: max_step_tokens (", opt_.max_step_tokens, ") and max_running (", opt_.max_running,
             ") must be >= 1");
  for (size_t i = 0; i < requests.size(); ++i) waiting_.push_back(int64_t(i));
}

StepPlan Scheduler::schedule() {
  MT_CHECK(admitted_.empty(), "scheduler: schedule() called again before update()");
  StepPlan plan;
  // Every running sequence's next token: its slot (a fresh block, or a copy of a shared partial one).
  for (const auto& sp : running_) {
    const AppendResult ar = blocks_.append_slot(sp->id);
    if (ar.copy) plan.copies.push_back(*ar.copy);
    plan.seqs.push_back({sp.get(), false, plan.num_tokens, 1, plan.num_draws, 1});
    ++plan.num_tokens;
    ++plan.num_draws;
    ++plan.num_decodes;
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
    plan.seqs.push_back({s.get(), true, plan.num_tokens, L, plan.num_draws, r.n});
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
  ++new_tokens_;
  const bool eos = !r.ignore_eos && opt_.eos_token_id >= 0 && token == opt_.eos_token_id;
  const bool stop = eos || std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) != r.stop_token_ids.end();
  const int64_t generated = int64_t(s.tokens.size()) - s.prompt_len;
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
  size_t decode_i = 0, admitted_i = 0;
  for (const ScheduledSeq& e : plan.seqs) {
    std::unique_ptr<Sequence>& owner = e.prefill ? admitted_.at(admitted_i++) : running_.at(decode_i++);
    MT_CHECK(owner.get() == e.seq, "scheduler: update() with a plan other than the last schedule()'s");
    keep_routing(*owner, result.routing, e.first_token, e.num_tokens);
    owner->cached += e.num_tokens;
    if (!e.prefill) {
      take(std::move(owner), e.first_draw, result, next);
      continue;
    }
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
  MT_CHECK(decode_i == running_.size() && admitted_i == admitted_.size(),
           "scheduler: update() with a plan other than the last schedule()'s");
  running_ = std::move(next);
  admitted_.clear();
}

}  // namespace mt
