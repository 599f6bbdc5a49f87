// The rollout model runner: a step's plan in, its logits (or, for a decode graph, its draws) out. It turns
// the plan into the model's inputs (tokens, positions, KV slots, block tables, logit rows), performs the
// plan's copy-on-write block copies, and runs Qwen3MoeModel::forward_cached over the paged KV cache:
// eagerly, or for a decode step (every running sequence's next token, no prompt) by replaying a CUDA graph
// of the forward and the sampler (docs/rollout.md "CUDA graphs"). One runner serves one generate call: its
// graphs and their buffers live as long as it does.
//
// Decode graphs: device inputs and outputs at fixed addresses, sized for the largest batch bucket of the
// call, one graph per bucket (1, 2, 4, 8, multiples of 8 to 64, of 32 to 512, of 128 beyond). A step is
// padded to its bucket with token 0 at position 0 of the cache's scratch block (one block past what the
// block manager hands out), which no sequence owns; padding rows are drawn greedily. A bucket's first decode
// step runs eagerly into the buffers (its results are used, and it grows every arena and scratch buffer),
// then the same pass is captured; a graph from another cuda_graph::epoch() is captured again, never
// replayed. A failed capture turns graphs off from there on (StepOutput::graphs_off says why).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/qwen3_moe.h"
#include "rollout/kv_blocks.h"
#include "rollout/sampler.h"
#include "rollout/scheduler.h"

namespace mt {

// The batch a decode step is padded to for its CUDA graph: 1, 2, 4, 8, multiples of 8 to 64, of 32 to 512,
// of 128 beyond (at most 1/8 of a large batch is padding; few graphs per call).
int64_t decode_bucket(int64_t n);
// MOETRAIN_CUDA_GRAPHS: unset, empty or "1" on, "0" off; anything else is an error naming the value.
bool decode_graphs_env();

struct RunnerSetup {
  bool decode_graphs = false;  // replay decode steps from CUDA graphs (the model must be capturable)
  int64_t max_batch = 0;       // decode graphs: rows of their buffers (a bucket)
  int64_t table_width = 0;     // decode graphs: block-table width (blocks of the longest request)
  bool record_routing = false;
};

struct StepOutput {
  Tensor logits;                // f32 [draws, V] on the model's device
  std::vector<Tensor> routing;  // record_routing: per sparse layer, i32 [tokens, K] on the model's device
  bool drawn = false;           // a decode graph sampled too: read_draws() has the tokens
  bool graph_replayed = false, graph_captured = false;
  double graph_capture_seconds = 0;
  std::string graphs_off;  // a capture failed, and why: decode graphs are off from here on
};

class ModelRunner {
 public:
  // The model, cache and block manager must outlive the runner. The cache holds one block more than the
  // block manager hands out (the decode graphs' scratch block).
  ModelRunner(Qwen3MoeModel& model, KvCache& cache, const KvBlockManager& blocks, const RunnerSetup& setup);
  ~ModelRunner();
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // The step's forward (plan: Scheduler::schedule; draws: sampling_batch of it).
  StepOutput run(const StepPlan& plan, const SamplingBatch& draws);
  // The last step's draws when a decode graph made them (StepOutput::drawn), on the host: one copy of one
  // buffer, the step's one synchronisation. Routing is left empty.
  StepDraws read_draws();

 private:
  struct Inputs;  // the step's inputs on the host
  struct DecodeGraphs;
  StepOutput run_eager(const Inputs& in);
  StepOutput run_graph(const Inputs& in, const SamplingBatch& draws);

  Qwen3MoeModel& model_;
  KvCache& cache_;
  const KvBlockManager& blocks_;
  RunnerSetup setup_;
  std::unique_ptr<DecodeGraphs> graphs_;
  std::string graphs_off_;
  int64_t drawn_rows_ = 0;  // the last graph step's draws
};

// The routing tensors on the host (after the step's synchronisation: no layer waited for these).
std::vector<Tensor> routing_to_host(std::vector<Tensor> routing);

}  // namespace mt
