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
// - Multi-turn (SchedulerOptions::multi_turn; docs/rollout.md "Multi-turn"): a stop token, max_turn_tokens
//   or the response budget ends a turn instead; update() leaves the sequence running and lists it
//   (turn_ends()), and reply() either finishes it or appends the caller's tokens to it. Appended tokens run
//   as a chunk over the sequence's cached prefix (with the last model token, which was never fed back),
//   after the step's decodes and before its prompts, within max_step_tokens (the step's first chunk always
//   gets a token; a longer chunk runs over several steps, the draw with its last token). The blocks they
//   take were reserved at admission: the whole response, model and appended tokens, is at most
//   max_new_tokens.
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
  // The response's tokens: the model's, and with a turn callback the appended ones too (prompt +
  // max_new_tokens is what admission reserves).
  int64_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // besides the model's EOS; with a turn callback they end a turn
  bool ignore_eos = false;
  // Multi-turn limits (RolloutEngine::generate with a turn callback; refused without one), 0 = none:
  int64_t max_turns = 0;               // model turns per episode
  int64_t max_turn_tokens = 0;         // model tokens per turn (then the turn ends with "length")
  int64_t max_observation_tokens = 0;  // tokens per append; a longer append is cut to its first ones
};

// Multi-turn: one sequence's finished turn, as the engine hands it to the turn callback.
struct TurnEnd {
  int64_t prompt_index = 0, sample_index = 0;  // prompt_index: the request's index in generate's requests
  int64_t turn = 0;                            // 0 for the model's first turn
  std::vector<int32_t> tokens;                 // this turn's model tokens, the stop token included when drawn
  std::string finish_reason;                   // "stop" (a stop token or EOS) or "length" (a token limit)
  // The episode ends after this turn whatever the reply (the response budget is spent or this is turn
  // max_turns - 1): the reply is read only for `done` (which decides "stop" or "length").
  bool last = false;
  int64_t tokens_left = 0;  // response tokens still allowed: an append must be shorter to leave the model a turn
};

// The caller's answer to one TurnEnd.
struct TurnReply {
  std::vector<int32_t> append;  // tokens to add before the model's next turn (ignored when done)
  bool done = true;             // the episode ends here
};

// One sample of a request, from its admission to its last token.
struct Sequence {
  SeqId id = 0;
  int64_t req = 0, sample = 0, prompt_len = 0;
  int64_t cached = 0;                // tokens whose K/V are in the cache
  std::vector<int32_t> tokens;       // the prompt, then the new tokens (the model's and appended ones)
  std::vector<float> logprobs;       // one per new token; 0 for appended ones
  std::vector<uint8_t> model_mask;   // one per new token: 1 drawn by the model, 0 appended
  std::vector<int64_t> turn_starts;  // where each model turn starts among the new tokens
  RoutingRecord routing;             // the experts of every token read (when the step's routing is given)
  std::string finish_reason;         // empty while running; "stop" or "length"
  std::string turn_finish;           // multi-turn: the turn that ended in the last update(), until reply()
  int64_t observation_tokens_cut = 0, append_tokens_cut = 0;  // GeneratedSample's
};

// One sequence's share of a step.
struct ScheduledSeq {
  const Sequence* seq = nullptr;
  bool prefill = false;                     // its whole prompt; else one decode token or appended tokens
  bool appended = false;                    // a running sequence's appended tokens (num_draws 0 or 1)
  int64_t first_token = 0, num_tokens = 0;  // its rows of the step's tokens
  int64_t first_draw = 0, num_draws = 0;    // its rows of the step's logits: n for a prompt, 1 for a decode
};

// A step's plan: what the runner feeds the model and the sampler draws.
struct StepPlan {
  // The decodes (in running order), then the appended chunks (in running order), then the admitted prompts
  // (in request order).
  std::vector<ScheduledSeq> seqs;
  std::vector<BlockCopy> copies;  // copy-on-write of shared partial blocks, to perform before the forward
  int64_t num_tokens = 0, num_draws = 0;
  int64_t num_decodes = 0, num_prefills = 0, num_prefill_tokens = 0;
  int64_t num_appends = 0, num_append_tokens = 0;  // chunks of appended tokens, and their tokens
  bool idle = false;  // nothing to run here (a step taken for the expert-parallel group's sake)
  bool decode_only() const { return num_prefills == 0 && num_appends == 0 && num_decodes > 0; }
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
  bool multi_turn = false;                       // stops end turns, answered through turn_ends() / reply()
  int64_t vocab_size = 0;                        // appended tokens must be in [0, vocab_size) (0: unchecked)
};

class Scheduler {
 public:
  // The requests and the block manager must outlive the scheduler; the requests are taken as valid
  // (RolloutEngine::generate checks them), each able to fit in the whole pool.
  Scheduler(KvBlockManager& blocks, const std::vector<GenerateRequest>& requests, const SchedulerOptions& opt);
  // Frees the blocks of sequences still held (a generate call that ended in an error).
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  // The next step: appends a slot for each running sequence, admits waiting prompts (allocating their
  // blocks). Throws when work is waiting and nothing can run (a request that fits no pool).
  StepPlan schedule();
  // The step's draws (result rows follow the plan's draw rows): each sequence takes its token, forks the
  // samples of admitted prompts, finishes and frees the blocks of those that stopped. `plan` must be the
  // last schedule()'s.
  void update(const StepPlan& plan, const StepDraws& result);
  // Multi-turn: the turns that ended in the last update() (in running order), awaiting reply().
  bool awaiting_replies() const { return !turn_ended_.empty(); }
  std::vector<TurnEnd> turn_ends() const;
  // One reply per turn_ends() entry, in its order: each episode ends (its blocks freed) or takes the
  // appended tokens (cut to max_observation_tokens; dropped, ending the episode with "length", when they
  // would leave the model no token of its response budget). An appended token outside the vocabulary or a
  // wrong number of replies is an error naming it.
  void reply(const std::vector<TurnReply>& replies);

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
  std::vector<Sequence*> turn_ended_;  // multi-turn: running sequences whose turn ended, until reply()
  SeqId next_id_ = 0;
  int64_t new_tokens_ = 0;
};

}  // namespace mt
