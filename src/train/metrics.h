// Per-step metrics as JSON lines: rank 0 writes one object per line to the run's metrics file (the
// other ranks hold a writer that writes nothing), flushed at once, so a run that dies keeps every step
// it finished. step_json gives the fields every training loop shares (loss parts, gradient norm,
// optimizer decision, time split, expert load, memory, communication); a loop adds its own
// (learning rate, data time, RL statistics, ...).
#pragma once
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "train/session.h"

namespace mt {

class MetricsWriter {
 public:
  // lead: this rank writes. Creates the file's directory and truncates the file.
  MetricsWriter(const std::string& path, bool lead);
  void write(const nlohmann::json& j);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream f_;
};

// The shared fields of one step: "loss", "ce", "aux", "z_loss", "grad_norm", "clip_scale", "skipped",
// "tokens", "target_tokens", "time_s" {"forward", "backward", "optimizer"}, "moe_dropped_rank0",
// "experts" {...} (models with sparse layers), and under several ranks "world_size",
// "time_s" {"comm_wait_rank0", "comm_wait_max"}, "peak_bytes_max_rank".
nlohmann::json step_json(const StepResult& r, const DistContext& dist);

}  // namespace mt
