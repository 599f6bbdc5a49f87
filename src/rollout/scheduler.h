// The rollout scheduler: which sequences run in the next step, and what becomes of them after it.
// Host only: no model, no tensors on a device. It owns the requests' sequences and decides through the
// KvBlockManager; the runner (rollout/runner.h) executes its plan, the sampler (rollout/sampler.h) draws,
// and update() takes the drawn tokens back.
//
// Policy (continuous batching, first come first served):
// - Every running sequence decodes one token each step, in the order it joined; decodes never wait for
//   the token budget or for blocks (their blocks were reserved at admission).
// - Then waiting prompts join, whole (prefill), in request order, while the step's tokens stay within
//   max_step_tokens (a prompt alone in a step always fits), the running sequences, counting a prompt as
//   its n samples, stay within max_running, and KvBlockManager::can_admit can reserve every block the
//   prompt and its n samples may ever hold. The first prompt that does not fit stops admission for the
//   step: a later, smaller prompt does not overtake it.
// - No preemption: admission reserves the worst case, so a running sequence never runs out of blocks
//   and is never evicted or recomputed; when blocks run out, prompts wait.
// - After the step, an admitted prompt's n - 1 siblings fork its blocks (sample indices 1..n-1, after
//   the parent, 0). A sequence that drew a stop token (the EOS unless ignore_eos, or one of
//   stop_token_ids) or reached max_new_tokens frees its blocks at once, so a waiting prompt can join in
//   the next step.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/sampling.h"
#include "rollout/kv_blocks.h"
#include "rollout/routing_record.h"

namespace mt {

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t n = 1;  // samples of this prompt
  int64_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // besides the model's EOS
  bool ignore_eos = false;
};

// One sample of a request, from its admission to its last token.
struct Sequence {
  SeqId id = 0;
  int64_t req = 0, sample = 0, prompt_len = 0;
  int64_t cached = 0;           // tokens whose K/V are in the cache
  std::vector<int32_t> tokens;  // the prompt, then the new tokens
  std::vector<float> logprobs;  // one per new token
  RoutingRecord routing;        // the experts of every token read (when the step's routing is given)
  std::string finish_reason;    // empty while running; "stop" or "length"
};

// One sequence's share of a step.
struct ScheduledSeq {
  const Sequence* seq = nullptr;
  bool prefill = false;                     // its whole prompt; else one decode token
  int64_t first_token = 0, num_tokens = 0;  // its rows of the step's tokens
  int64_t first_draw = 0, num_draws = 0;    // its rows of the step's logits: n for a prompt, 1 for a decode
};

// A step's plan: what the runner feeds the model and the sampler draws.
struct StepPlan {
  std::vector<ScheduledSeq> seqs;  // the decodes (in running order), then the admitted prompts (in request order)
  std::vector<BlockCopy> copies;   // copy-on-write of shared partial blocks, to perform before the forward
  int64_t num_tokens = 0, num_draws = 0;
  int64_t num_decodes = 0, num_prefills = 0, num_prefill_tokens = 0;
  bool idle = false;  // nothing to run here (a step taken for the expert-parallel group's sake)
  bool decode_only() const { return num_prefills == 0 && num_decodes > 0; }
};

// What a step produced, on the host: one token and log-probability per draw and, when routing is
// recorded, the experts each sparse layer chose for each of the step's tokens (i32 [tokens, K] per layer).
struct StepDraws {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<Tensor> routing;
};

struct SchedulerOptions {
  int64_t max_step_tokens = 4096;                // tokens per step (decodes first, then whole prompts)
  int64_t max_running = 256;                     // sequences decoding at once
  int64_t eos_token_id = -1;                     // -1: none
  int64_t experts_per_tok = 0, num_experts = 0;  // the routing record's shape
};

class Scheduler {
 public:
  // The requests and the block manager must outlive the scheduler; the requests are taken as valid
  // (RolloutEngine::generate checks them), each able to fit in the whole pool.
  Scheduler(KvBlockManager& blocks, const std::vector<GenerateRequest>& requests, const SchedulerOptions& opt);

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  // The next step: appends a slot for each running sequence, admits waiting prompts (allocating their
  // blocks). Throws when work is waiting and nothing can run (a request that fits no pool).
  StepPlan schedule();
  // The step's draws (result rows follow the plan's draw rows): each sequence takes its token, forks the
  // samples of admitted prompts, finishes and frees the blocks of those that stopped. `plan` must be the
  // last schedule()'s.
  void update(const StepPlan& plan, const StepDraws& result);

  int64_t num_waiting() const { return int64_t(waiting_.size()); }
  int64_t num_running() const { return int64_t(running_.size()); }
  int64_t num_finished() const { return int64_t(finished_.size()); }
  int64_t new_tokens() const { return new_tokens_; }
  const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }
  const std::vector<std::unique_ptr<Sequence>>& finished() const { return finished_; }  // in finishing order
  std::vector<std::unique_ptr<Sequence>> take_finished() { return std::move(finished_); }

 private:
  void keep_routing(Sequence& s, const std::vector<Tensor>& routing, int64_t first_row, int64_t rows) const;
  void take(std::unique_ptr<Sequence> seq, int64_t draw, const StepDraws& result,
            std::vector<std::unique_ptr<Sequence>>& next);

  KvBlockManager& blocks_;
  const std::vector<GenerateRequest>& requests_;
  SchedulerOptions opt_;
  std::deque<int64_t> waiting_;                      // request indices
  std::vector<std::unique_ptr<Sequence>> running_;   // in the order they joined
  std::vector<std::unique_ptr<Sequence>> admitted_;  // this step's prompts, until update()
  std::vector<std::unique_ptr<Sequence>> finished_;
  SeqId next_id_ = 0;
  int64_t new_tokens_ = 0;
};

}  // namespace mt
