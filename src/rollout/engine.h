// The rollout engine: batched generation on the model's own weights over a paged KV cache.
//
// generate() is a loop over steps, split as vLLM v1 splits its engine core:
// - the Scheduler (rollout/scheduler.h) decides each step's batch: every running sequence's next token
//   (decode), then the prompts admitted this step (all their tokens: prefill). A prompt is admitted when
//   the block manager can reserve everything it and its n samples may ever hold (prompt + max_new_tokens
//   each) and the step's token budget allows; the n samples are forks of the prefilled prompt, sharing its
//   blocks (prefill once, copy-on-write of the partial last block). A finished sequence frees its blocks
//   at once, so a waiting prompt starts in the next step. Admission is the memory control: the engine never
//   runs out of KV blocks mid-sequence and never preempts.
// - the ModelRunner (rollout/runner.h) builds the step's inputs and runs the forward over the paged
//   cache, eagerly or, for decode steps, by replaying a CUDA graph of the forward and the sampler;
// - the sampler step (rollout/sampler.h, ops/sampling.h, on the model's device: the step's one
//   synchronisation brings the tokens back) draws with counter-based randomness keyed by (request seed,
//   sample index within its prompt, position, token), so a request's tokens do not depend on what else is
//   batched. Each token comes with log softmax(logits / T)[token] before truncation.
// The routing record (the experts each sparse layer chose for every token the model read: the prompt, then
// each generated token but the last, which is never fed back) is kept when asked, compactly
// (rollout/routing_record.h).
//
// Multi-turn (generate with a TurnFn; docs/rollout.md "Multi-turn"): a stop token or a per-turn limit ends a
// turn, not the sequence. Once per step the callback gets every turn that ended in it and replies per turn:
// the episode ends, or tokens (an observation, tokenised by the caller) are appended to the same sequence,
// run as a chunk over its cached prefix (an eager step, as a prefill is), and the model's next turn is drawn
// from the chunk's last row. Other sequences keep decoding around it; the whole response (model and appended
// tokens) stays within max_new_tokens, which admission reserved, so nothing is ever preempted.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/qwen3_moe.h"
#include "ops/sampling.h"
#include "rollout/kv_blocks.h"
#include "rollout/routing_record.h"
#include "rollout/scheduler.h"  // GenerateRequest

namespace mt {

struct GeneratedSample {
  int64_t prompt_index = 0, sample_index = 0;
  std::vector<int32_t> tokens;  // the new tokens: the model's turns and, multi-turn, the appended tokens between them
  std::vector<float> logprobs;  // one per new token; 0 for appended tokens
  // Single turn: "stop" (a stop token or EOS, included in tokens) or "length". Multi-turn: "stop" when a reply
  // ended the episode (done) after a turn the budget did not cut; "length" when a limit did (max_new_tokens
  // mid-turn, max_turns, an append that would not leave the model a token).
  std::string finish_reason;
  // The experts of prompt + new tokens - 1 tokens in every sparse layer (EngineOptions::record_routing),
  // appended tokens included; compact; routing.tensors() is MicroBatch::routing's form.
  RoutingRecord routing;
  std::vector<uint8_t> model_mask;     // one per new token: 1 the model drew it, 0 appended (no loss on it)
  std::vector<int64_t> turn_starts;    // index in tokens where each model turn starts ({0} for a single turn)
  int64_t observation_tokens_cut = 0;  // appended tokens dropped by GenerateRequest::max_observation_tokens
  int64_t append_tokens_cut = 0;       // appended tokens dropped because they would have spent the response budget
};

// Multi-turn: called once per engine step with every turn that ended in it (TurnEnd, scheduler.h); returns one
// TurnReply per TurnEnd, in the same order.
using TurnFn = std::function<std::vector<TurnReply>(const std::vector<TurnEnd>&)>;

struct EngineProgress {
  int64_t finished = 0, total = 0;  // sequences
  int64_t new_tokens = 0, running = 0, waiting = 0;
  double seconds = 0;
};

struct EngineOptions {
  int64_t kv_cache_bytes = int64_t(1) << 30;  // the KV budget; kv_pool_blocks turns it into blocks
  int32_t block_size = 16;
  int64_t max_step_tokens = 4096;  // tokens per forward (decode tokens first, then whole prompts)
  int64_t max_running = 256;       // sequences decoding at once
  bool record_routing = false;
  std::function<void(const EngineProgress&)> on_step;  // after every step
  // Expert parallelism: the model's ep group. Every rank of it steps while any has work (one
  // all-reduce of a flag per step), since each forward exchanges tokens with all of them. Null: the
  // rank steps alone (one device, or data parallelism without ep).
  comm::Communicator* lockstep = nullptr;
  // Decode steps (every running sequence's next token, no prompt) as CUDA graphs of the forward and the
  // sampler, one per batch bucket (the batch padded up to 1, 2, 4, 8, then multiples of 8 to 64, of 32 to
  // 512, of 128 beyond; the step's sampling rows copied to the device first, so a replay draws anew): captured
  // at a bucket's first decode step of a generate call and replayed after. Only where the model can be
  // captured (Qwen3MoeModel::capturable_cached: CUDA, no expert parallelism) and op profiling is off;
  // MOETRAIN_CUDA_GRAPHS=0 turns them off too. docs/rollout.md "CUDA graphs".
  bool cuda_graphs = true;
};

struct EngineStats {
  int64_t steps = 0, prefill_tokens = 0, decode_tokens = 0, block_copies = 0, num_blocks = 0;
  int64_t append_tokens = 0, turn_calls = 0;  // multi-turn: tokens run as appended chunks; turn callback calls
  int64_t idle_steps = 0;  // expert parallelism: steps this rank ran with no tokens for its group's sake
  double seconds = 0, forward_seconds = 0, sample_seconds = 0;
  double weight_sync_seconds = 0;               // Qwen3MoeModel::begin_inference: the inference layout's gathers
  int64_t graph_steps = 0, graph_captures = 0;  // decode steps replayed from a CUDA graph; graphs captured
  double graph_capture_seconds = 0;
};

class RolloutEngine {
 public:
  // The model must outlive the engine; its weights are read where they are (no copy on one device).
  // generate() holds the model's inference layout (Qwen3MoeModel::begin_inference) for its duration
  // unless the caller already began it (a rollout phase of several calls).
  RolloutEngine(Qwen3MoeModel& model, const EngineOptions& opt);
  // Every sample of every request, ordered by (prompt index, sample index). Bad requests (an empty
  // prompt, a token outside the vocabulary, prompt + max_new_tokens beyond the model's positions, n < 1,
  // bad sampling parameters, a prompt whose samples cannot fit in the KV budget at all) are errors
  // naming the request and the value, before any work starts.
  std::vector<GeneratedSample> generate(const std::vector<GenerateRequest>& requests);
  // Multi-turn episodes: as above, but a stop token (or max_turn_tokens, or the response budget) ends a turn and
  // on_turns decides, once per step for every turn that ended in it, whether the episode ends or which tokens are
  // appended before the model's next turn (docs/rollout.md "Multi-turn"). An empty on_turns is generate(requests).
  // A reply count that differs from the turns given, or an appended token outside the vocabulary, is an error.
  std::vector<GeneratedSample> generate(const std::vector<GenerateRequest>& requests, const TurnFn& on_turns);
  const EngineStats& stats() const { return stats_; }
  // The KV bytes these requests could hold at once at most (every sample at its full length): a budget
  // above it buys nothing, so callers cap theirs here.
  static int64_t kv_bytes_needed(const Qwen3MoeModel& model, const std::vector<GenerateRequest>& requests,
                                 int32_t block_size);
  int64_t num_blocks() const { return blocks_.num_blocks(); }

 private:
  Qwen3MoeModel& model_;
  EngineOptions opt_;
  KvBlockManager blocks_;
  KvCache cache_;  // one block more than blocks_ hands out: the scratch block padded graph rows write to
  EngineStats stats_;
  std::string graphs_off_;  // why decode graphs failed to capture once (then not tried again); empty: fine
};

}  // namespace mt
