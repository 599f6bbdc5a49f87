// A small, fast training run of the tiny model on the CPU for trainer tests (4 steps × 2 micro-batches
// of 2 × 32 tokens), in a fresh per-process output directory.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>

#include "train/train_config.h"

namespace mt::test {

inline TrainConfig tiny_train_run(const std::string& tag, const std::string& name, int64_t eval_problems) {
  TrainConfig c;
  c.model = "tiny";
  c.device = "cpu";
  c.out_dir = (std::filesystem::temp_directory_path() / ("moetrain_" + tag + "_" + name + "_" + std::to_string(getpid())))
                  .string();
  std::filesystem::remove_all(c.out_dir);
  c.steps = 4;
  c.micro_batch_size = 2;
  c.grad_accum = 2;
  c.seq_len = 32;
  c.warmup_steps = 1;
  c.eval_problems = eval_problems;
  c.log_every = 1;
  return c;
}

}  // namespace mt::test
