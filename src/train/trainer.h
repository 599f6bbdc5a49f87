// The training loop: micro-batches with gradient accumulation, AdamW with warmup + decay, global
// gradient clipping, the non-finite skip rule, progress per micro-batch, one log line and one JSONL
// metrics record per step, held-out evaluation for the synthetic task, HF checkpoints.
//
// A stop signal (core/interrupt.h: SIGINT, SIGTERM; the train and sft commands install the handler) ends the
// run after the step in progress: every rank stops at the same step, that step is saved, the log says where
// and how to resume, and the command exits with 128 + the signal (130 for Ctrl-C).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
  int stop_signal = 0;       // the signal that stopped the run after step `steps` (SIGINT, SIGTERM); 0: none
};

// How a command runs the loop.
struct RunOptions {
  std::string command = "train";  // the command in messages and in the resume hint: "train", "sft"
  // Called on every rank after each step is logged (step 1-based), before the stop check: tests raise a
  // signal here.
  std::function<void(int64_t step)> after_step;
};

// Resolves "auto" to cuda when the CUDA backend can run the model, else cpu; "cuda" without it is
// an error that says so.

// A preset name or a Hugging Face model directory.
ModelConfig resolve_model_config(const std::string& model);

TrainSummary run_training(const TrainConfig& cfg, const RunOptions& run = {});
// A summary's exit status: 0, or 128 + the signal that stopped the run (130 for SIGINT).
int exit_status(const TrainSummary& s);

}  // namespace mt
