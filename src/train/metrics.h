// Per-step metrics as JSON lines: rank 0 writes one object per line to the run's metrics file (the
// other ranks hold a writer that writes nothing), flushed at once, so a run that dies keeps every step
// it finished. step_json gives the fields every training loop shares (loss parts, gradient norm,
// optimizer decision, time split, expert load, memory, communication); a loop adds its own
// (learning rate, data time, RL statistics, ...).
//
// Beside the JSONL file the writer keeps a TensorBoard event file (io/tensorboard.h) in the same
// directory, unless switched off: every number of every line becomes a scalar (nested keys joined
// with '/', "time_s/forward"), at the line's "step" (the last step seen when a line has none); a line
// with "event": "<name>" (an evaluation, say) gets its tags prefixed "<name>/". A TensorBoard write
// that fails is logged once and stops the TensorBoard file; the JSONL file goes on.
#pragma once
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "train/session.h"

namespace mt {

class TensorBoardWriter;

class MetricsWriter {
 public:
  // lead: this rank writes. Creates the file's directory and truncates the file; tensorboard: also
  // starts a new event file in that directory. resume_step >= 0 (a resumed run): the file keeps its
  // lines up to that step (those of later steps, from the run that stopped, are dropped) and grows.
  MetricsWriter(const std::string& path, bool lead, bool tensorboard = true, int64_t resume_step = -1);
  ~MetricsWriter();
  void write(const nlohmann::json& j);
  const std::string& path() const { return path_; }
  // The event file's path; "" when there is none (not the lead rank, switched off, or failed).
  std::string tensorboard_path() const;

 private:
  std::string path_;
  std::ofstream f_;
  std::unique_ptr<TensorBoardWriter> tb_;
  int64_t last_step_ = 0;
};

// The shared fields of one step: "loss", "ce", "aux", "z_loss", "grad_norm", "clip_scale", "skipped",
// "tokens", "target_tokens", "time_s" {"forward", "backward", "optimizer"}, "moe_dropped_rank0",
// "experts" {...} (models with sparse layers), and under several ranks "world_size",
// "time_s" {"comm_wait_rank0", "comm_wait_max"}, "peak_bytes_max_rank".
nlohmann::json step_json(const StepResult& r, const DistContext& dist);

}  // namespace mt
