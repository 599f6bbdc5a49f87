// A training session with LoRA adapters (SessionOptions::lora): the base stays bit for bit as loaded, only
// the adapters move, the loss falls on a repeated batch, and the optimizer's state covers the adapters alone.
#include <gtest/gtest.h>

#include <cstring>

#include "model/config.h"
#include "test_util.h"
#include "model/model_test_util.h"
#include "train/session.h"

using namespace mt;

TEST(LoraSession, OnlyTheAdaptersTrainAndTheLossFalls) {
  const ModelConfig c = preset_model_config("tiny");
  SessionOptions so;
  so.lora.rank = 8;
  so.lora.targets = parse_lora_targets("attn,mlp,experts");
  so.lora_seed = 3;
  TrainSession s(c, so);
  s.init_weights(1);
  ASSERT_NE(s.lora(), nullptr);
  const Tensor base_before = s.master().clone();
  s.make_optimizer(AdamWConfig{}, false);
  EXPECT_EQ(s.optimizer().exp_avg().numel(), s.lora()->table().total());
  EXPECT_LT(s.lora()->table().total(), s.master().numel() / 4);
  const MicroBatch mb = test::random_batch(c, 4, 16, 9);
  StepOptions st;
  st.lr = 3e-3;
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    const StepResult r = s.train_step({mb}, st);
    ASSERT_FALSE(r.opt.skipped);
    if (i == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, first - 0.5) << first << " -> " << last;
  ASSERT_EQ(s.master().numel(), base_before.numel());
  EXPECT_EQ(0, std::memcmp(s.master().data<float>(), base_before.data<float>(), size_t(base_before.numel()) * 4));
}
