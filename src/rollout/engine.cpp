// RolloutEngine (engine.h): the step loop over the scheduler, the model runner and the sampler.
#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "core/clock.h"
#include "core/error.h"
#include "ops/profile.h"
#include "rollout/runner.h"
#include "rollout/sampler.h"
#include "rollout/scheduler.h"

namespace mt {

namespace {

// Refuses a bad request before any work, naming it and the value; returns the samples asked for in all.
int64_t check_requests(const std::vector<GenerateRequest>& requests, const ModelConfig& c, const KvBlockManager& blocks,
                       int64_t max_running, bool multi_turn) {
  int64_t total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.prompt.empty()) MT_THROW("request ", i, ": the prompt is empty");
    for (size_t j = 0; j < r.prompt.size(); ++j)
      if (r.prompt[j] < 0 || r.prompt[j] >= c.vocab_size)
        MT_THROW("request ", i, ": token ", r.prompt[j], " at index ", j, " is outside the vocabulary [0, ",
                 c.vocab_size, ")");
    if (r.n < 1) MT_THROW("request ", i, ": n = ", r.n, " samples; allowed: n >= 1");
    if (r.max_new_tokens < 1) MT_THROW("request ", i, ": max_new_tokens ", r.max_new_tokens, " must be >= 1");
    const int64_t need = int64_t(r.prompt.size()) + r.max_new_tokens;
    if (need > c.max_position_embeddings)
      MT_THROW("request ", i, ": prompt (", r.prompt.size(), " tokens) + max_new_tokens (", r.max_new_tokens,
               ") = ", need, " exceeds the model's max_position_embeddings (", c.max_position_embeddings, ")");
    if (r.max_turns < 0 || r.max_turn_tokens < 0 || r.max_observation_tokens < 0)
      MT_THROW("request ", i, ": max_turns (", r.max_turns, "), max_turn_tokens (", r.max_turn_tokens,
               ") and max_observation_tokens (", r.max_observation_tokens, ") must be >= 0 (0 = no limit)");
    if (!multi_turn && (r.max_turns != 0 || r.max_turn_tokens != 0 || r.max_observation_tokens != 0))
      MT_THROW("request ", i, ": max_turns (", r.max_turns, "), max_turn_tokens (", r.max_turn_tokens,
               ") and max_observation_tokens (", r.max_observation_tokens,
               ") apply to multi-turn episodes; give generate a turn callback or set them to 0");
    validate_sampling_params(r.sampling);
    const int64_t needed_blocks = blocks.blocks_needed(int64_t(r.prompt.size()), r.max_new_tokens, r.n);
    if (needed_blocks > blocks.num_blocks())
      MT_THROW("request ", i, ": its ", r.n, " samples of up to ", need, " tokens need ", needed_blocks,
               " KV blocks; the cache holds ", blocks.num_blocks(),
               " (raise --kv-cache-fraction, or lower n or "
               "max_new_tokens)");
    if (r.n > max_running)
      MT_THROW("request ", i, ": n = ", r.n, " exceeds the engine's max running sequences (", max_running, ")");
    total += r.n;
  }
  return total;
}

// Expert parallelism: step while any rank of the group has work (a max of a flag per step).
bool group_busy(comm::Communicator* lockstep, bool mine) {
  if (!lockstep || lockstep->size() == 1) return mine;
  Tensor f = Tensor::zeros({1}, DType::F32);
  f.data<float>()[0] = mine ? 1.0f : 0.0f;
  Tensor d = lockstep->device() == Device::CPU ? f : f.to(lockstep->device());
  lockstep->all_reduce(d, comm::ReduceOp::Max)->wait();
  return d.to(Device::CPU).data<float>()[0] > 0.0f;
}

// The runner of one generate call: decode graphs where the model can be captured and nothing turned them
// off, their buffers sized for the call (the longest request's block table, the most sequences at once).
RunnerSetup runner_setup(const EngineOptions& opt, bool graphs_failed, const Qwen3MoeModel& model,
                         const std::vector<GenerateRequest>& requests, int64_t total) {
  RunnerSetup s;
  s.record_routing = opt.record_routing;
  s.decode_graphs =
      opt.cuda_graphs && !graphs_failed && model.capturable_cached() && !ops::op_profiling() && decode_graphs_env();
  if (s.decode_graphs) {
    for (const GenerateRequest& r : requests)
      s.table_width =
          std::max(s.table_width, (int64_t(r.prompt.size()) + r.max_new_tokens + opt.block_size - 1) / opt.block_size);
    s.max_batch = decode_bucket(std::min(opt.max_running, total));
  }
  return s;
}

void count_step(EngineStats& st, const StepPlan& plan, const StepOutput& out) {
  ++st.steps;
  if (plan.idle) ++st.idle_steps;
  st.prefill_tokens += plan.num_prefill_tokens;
  st.decode_tokens += plan.num_decodes;
  st.append_tokens += plan.num_append_tokens;
  st.block_copies += int64_t(plan.copies.size());
  if (out.graph_replayed) ++st.graph_steps;
  if (out.graph_captured) ++st.graph_captures;
  st.graph_capture_seconds += out.graph_capture_seconds;
}

// Every finished sequence as a sample, ordered by (prompt, sample).
std::vector<GeneratedSample> collect(std::vector<std::unique_ptr<Sequence>> finished) {
  std::vector<GeneratedSample> out;
  for (auto& sp : finished) {
    Sequence& s = *sp;
    GeneratedSample g;
    g.prompt_index = s.req;
    g.sample_index = s.sample;
    g.tokens.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    g.logprobs = s.logprobs;
    g.finish_reason = s.finish_reason;
    g.routing = std::move(s.routing);
    g.model_mask = std::move(s.model_mask);
    g.turn_starts = std::move(s.turn_starts);
    g.observation_tokens_cut = s.observation_tokens_cut;
    g.append_tokens_cut = s.append_tokens_cut;
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(), [](const GeneratedSample& a, const GeneratedSample& b) {
    return a.prompt_index != b.prompt_index ? a.prompt_index < b.prompt_index : a.sample_index < b.sample_index;
  });
  return out;
}

}  // namespace

RolloutEngine::RolloutEngine(Qwen3MoeModel& model, const EngineOptions& opt)
    : model_(model),
      opt_(opt),
      blocks_(
          [&] {
            const ModelConfig& c = model.config();
            if (opt.block_size < 1) MT_THROW("block size ", opt.block_size, " must be >= 1");
            const KvCacheGeometry g{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, opt.block_size,
                                    model.device() == Device::CUDA ? 2 : 4};
            return kv_pool_blocks(opt.kv_cache_bytes, g, opt.block_size);
          }(),
          opt.block_size) {
  if (opt_.max_step_tokens < 1 || opt_.max_running < 1)
    MT_THROW("engine: max_step_tokens (", opt_.max_step_tokens, ") and max_running (", opt_.max_running,
             ") must be >= 1");
  cache_ = KvCache::allocate(model.config(), model.device(), blocks_.num_blocks() + 1, opt.block_size);
  stats_.num_blocks = blocks_.num_blocks();
}

int64_t RolloutEngine::kv_bytes_needed(const Qwen3MoeModel& model, const std::vector<GenerateRequest>& requests,
                                       int32_t block_size) {
  const ModelConfig& c = model.config();
  const KvCacheGeometry g{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size,
                          model.device() == Device::CUDA ? 2 : 4};
  const KvBlockManager sizing(1, block_size);
  int64_t blocks = 0;
  for (const GenerateRequest& r : requests)
    blocks += sizing.blocks_needed(int64_t(r.prompt.size()), r.max_new_tokens, r.n);
  return std::max<int64_t>(blocks, 1) * kv_bytes_per_block(g);
}

std::vector<GeneratedSample> RolloutEngine::generate(const std::vector<GenerateRequest>& requests) {
  return generate(requests, TurnFn());
}

std::vector<GeneratedSample> RolloutEngine::generate(const std::vector<GenerateRequest>& requests,
                                                     const TurnFn& on_turns) {
  const ModelConfig& c = model_.config();
  const bool multi_turn = bool(on_turns);
  const int64_t total = check_requests(requests, c, blocks_, opt_.max_running, multi_turn);
  const auto t_start = Clock::now();
  // The inference layout for the whole call, unless the caller holds it already.
  struct InferenceGuard {
    Qwen3MoeModel& m;
    bool mine;
    ~InferenceGuard() {
      if (mine) m.end_inference();
    }
  } guard{model_, !model_.in_inference()};
  if (guard.mine) stats_.weight_sync_seconds += model_.begin_inference();
  Scheduler scheduler(blocks_, requests,
                      {.max_step_tokens = opt_.max_step_tokens,
                       .max_running = opt_.max_running,
                       .eos_token_id = c.eos_token_id,
                       .experts_per_tok = c.num_experts_per_tok,
                       .num_experts = c.num_experts,
                       .multi_turn = multi_turn,
                       .vocab_size = c.vocab_size});
  ModelRunner runner(model_, cache_, blocks_, runner_setup(opt_, !graphs_off_.empty(), model_, requests, total));
  while (group_busy(opt_.lockstep, scheduler.has_work())) {
    const StepPlan plan = scheduler.schedule();
    const SamplingBatch draws = sampling_batch(plan, requests);
    const auto tf = Clock::now();
    StepOutput out = runner.run(plan, draws);  // a decode graph samples too
    stats_.forward_seconds += seconds_since(tf);
    count_step(stats_, plan, out);
    if (!out.graphs_off.empty()) graphs_off_ = out.graphs_off;  // not tried again by this engine
    const auto ts = Clock::now();
    StepDraws result = out.drawn ? runner.read_draws() : sample_step(out.logits, draws);  // the one sync
    result.routing = routing_to_host(std::move(out.routing));
    scheduler.update(plan, result);
    stats_.sample_seconds += seconds_since(ts);
    if (scheduler.awaiting_replies()) {  // the step's ended turns, in one call
      scheduler.reply(on_turns(scheduler.turn_ends()));
      ++stats_.turn_calls;
    }
    if (opt_.on_step)
      opt_.on_step({.finished = scheduler.num_finished(),
                    .total = total,
                    .new_tokens = scheduler.new_tokens(),
                    .running = scheduler.num_running(),
                    .waiting = scheduler.num_waiting(),
                    .seconds = seconds_since(t_start)});
  }
  stats_.seconds += seconds_since(t_start);
  return collect(scheduler.take_finished());
}

}  // namespace mt
