// Learning-rate schedules: linear warmup, then cosine or linear decay to min_lr, or constant.
//
// For step s (0-based optimizer step) of a run of `steps` steps:
//   s < warmup_steps:  lr * (s + 1) / warmup_steps        (the first step is not at lr 0)
//   otherwise, with p = (s - warmup_steps) / (steps - warmup_steps - 1), clamped to [0, 1]
//   (p = 0 for the single step after warmup when there is only one, p = 1 for steps >= steps):
//     cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
//     linear:   lr + (min_lr - lr) * p
//     constant: lr
// So the first step after warmup runs at lr and the last step (steps - 1) at min_lr; steps past
// the end stay at min_lr.
#pragma once
#include <cstdint>
#include <string>

#include "train/train_config.h"

namespace mt {

enum class LrScheduleKind { kCosine, kLinear, kConstant };

struct LrParams {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 0;
  int64_t steps = 1;
  LrScheduleKind kind = LrScheduleKind::kCosine;
};

// "cosine" | "linear" | "constant"; anything else is an error naming the value and the allowed ones.
LrScheduleKind parse_lr_schedule(const std::string& name);
LrParams lr_params(const TrainConfig& c);

double lr_at(const LrParams& p, int64_t step);
double lr_at(const TrainConfig& c, int64_t step);

}  // namespace mt
