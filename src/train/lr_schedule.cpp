// Learning-rate schedules (see lr_schedule.h for the formulas).
#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mt {

LrScheduleKind parse_lr_schedule(const std::string& name) {
  if (name == "cosine") return LrScheduleKind::kCosine;
  if (name == "linear") return LrScheduleKind::kLinear;
  if (name == "constant") return LrScheduleKind::kConstant;
  MT_THROW("lr_schedule = \"", name, "\" is not allowed: allowed values: cosine, linear, constant");
}

LrParams lr_params(const TrainConfig& c) {
  return LrParams{c.lr, c.min_lr, c.warmup_steps, c.steps, parse_lr_schedule(c.lr_schedule)};
}

double lr_at(const LrParams& p, int64_t step) {
  MT_CHECK(step >= 0, "lr_at: step must be >= 0, got ", step);
  MT_CHECK(p.warmup_steps >= 0, "lr_at: warmup_steps must be >= 0, got ", p.warmup_steps);
  if (step < p.warmup_steps) return p.lr * double(step + 1) / double(p.warmup_steps);
  if (p.kind == LrScheduleKind::kConstant) return p.lr;
  int64_t decay_steps = p.steps - p.warmup_steps - 1;  // steps after the first post-warmup step
  // With at most one step after warmup there is nothing to decay over: that step runs at lr and
  // anything past the end at min_lr.
  double progress = decay_steps <= 0 ? (step >= p.steps ? 1.0 : 0.0)
                                     : std::clamp(double(step - p.warmup_steps) / double(decay_steps), 0.0, 1.0);
  if (p.kind == LrScheduleKind::kLinear) return p.lr + (p.min_lr - p.lr) * progress;
  return p.min_lr + (p.lr - p.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double lr_at(const TrainConfig& c, int64_t step) {
  return lr_at(lr_params(c), step);
}

}  // namespace mt
