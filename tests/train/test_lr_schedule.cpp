// LR schedules: warmup, the end points of each decay, monotonicity, and the schedule name check.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "train/lr_schedule.h"

using namespace mt;

TEST(LrSchedule, WarmupIsLinearFromLrOverWarmup) {
  LrParams p{1.0, 0.1, 4, 20, LrScheduleKind::kCosine};
  EXPECT_DOUBLE_EQ(lr_at(p, 0), 0.25);
  EXPECT_DOUBLE_EQ(lr_at(p, 1), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(p, 3), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(p, 4), 1.0) << "first step after warmup is at the peak";
}

TEST(LrSchedule, EndpointsAndMonotonicDecay) {
  for (auto kind : {LrScheduleKind::kCosine, LrScheduleKind::kLinear}) {
    LrParams p{3e-3, 3e-4, 10, 100, kind};
    EXPECT_DOUBLE_EQ(lr_at(p, 10), 3e-3);
    EXPECT_NEAR(lr_at(p, 99), 3e-4, 1e-15);
    EXPECT_NEAR(lr_at(p, 500), 3e-4, 1e-15) << "past the end stays at min_lr";
    for (int64_t s = 1; s < 10; ++s) EXPECT_GT(lr_at(p, s), lr_at(p, s - 1)) << s;
    for (int64_t s = 11; s < 100; ++s) EXPECT_LT(lr_at(p, s), lr_at(p, s - 1)) << s;
  }
  // Midpoint of the decay: cosine and linear both at (lr + min_lr) / 2.
  LrParams c{1.0, 0.0, 0, 11, LrScheduleKind::kCosine}, l{1.0, 0.0, 0, 11, LrScheduleKind::kLinear};
  EXPECT_NEAR(lr_at(c, 5), 0.5, 1e-12);
  EXPECT_NEAR(lr_at(l, 5), 0.5, 1e-12);
  // Cosine stays above linear in the first half.
  EXPECT_GT(lr_at(c, 2), lr_at(l, 2));
  EXPECT_NEAR(lr_at(l, 2), 0.8, 1e-12);
  EXPECT_NEAR(lr_at(c, 2), 0.5 * (1 + std::cos(M_PI * 0.2)), 1e-12);
}

TEST(LrSchedule, ConstantAndEdgeCases) {
  LrParams k{2.0, 0.5, 2, 10, LrScheduleKind::kConstant};
  EXPECT_DOUBLE_EQ(lr_at(k, 0), 1.0);
  for (int64_t s = 2; s < 20; ++s) EXPECT_DOUBLE_EQ(lr_at(k, s), 2.0);
  // No warmup: step 0 at lr.
  LrParams n{2.0, 0.5, 0, 10, LrScheduleKind::kCosine};
  EXPECT_DOUBLE_EQ(lr_at(n, 0), 2.0);
  // Warmup covering every step, and one step after warmup: no division by zero, no NaN.
  LrParams all{1.0, 0.1, 5, 5, LrScheduleKind::kLinear};
  EXPECT_DOUBLE_EQ(lr_at(all, 4), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(all, 5), 0.1);
  LrParams one{1.0, 0.1, 4, 5, LrScheduleKind::kCosine};
  EXPECT_DOUBLE_EQ(lr_at(one, 4), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(one, 5), 0.1);
  EXPECT_THROW(lr_at(n, -1), Error);
}

TEST(LrSchedule, FromTrainConfig) {
  TrainConfig c;  // lr 7e-4, min_lr 7e-5, warmup 100, steps 2500, cosine
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 7e-4 / 100);
  EXPECT_DOUBLE_EQ(lr_at(c, 99), 7e-4);
  EXPECT_DOUBLE_EQ(lr_at(c, 100), 7e-4);
  EXPECT_NEAR(lr_at(c, 2499), 7e-5, 1e-15);
  c.lr_schedule = "warmup-only";
  std::string msg;
  try {
    lr_at(c, 0);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("lr_schedule = \"warmup-only\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("cosine, linear, constant"), std::string::npos) << msg;
}
