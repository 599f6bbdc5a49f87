// The training loop: micro-batches with gradient accumulation, AdamW with warmup + decay, global
// gradient clipping, the non-finite skip rule, progress per micro-batch, one log line and one JSONL
// metrics record per step, held-out evaluation for the synthetic task, HF checkpoints.
#pragma once
#include <cstdint>
#include <string>

#include "train/eval.h"
#include "train/train_config.h"

namespace mt {

struct TrainSummary {
  double first_loss = 0, last_loss = 0;
  int64_t steps = 0, skipped = 0;
  bool evaluated = false;
  EvalResult eval;
  std::string checkpoint_dir;
  // shard_digest (parallel/fsdp.h) of the f32 master weights (flat layout) that the last checkpoint
  // holds, taken from memory as it was written; one process on the CPU only (0 on a GPU and under FSDP).
  uint64_t checkpoint_digest = 0;
  std::string summary_line;  // "demo: loss a -> b, exact-match p% on n held-out problems"
};

// Resolves "auto" to cuda when the CUDA backend can run the model, else cpu; "cuda" without it is
// an error that says so.
Device resolve_device(const std::string& name);
// A preset name or a Hugging Face model directory.
ModelConfig resolve_model_config(const std::string& model);

TrainSummary run_training(const TrainConfig& cfg);
int train_main(const std::vector<std::string>& args);

}  // namespace mt
