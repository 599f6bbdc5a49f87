// PPO with a critic (rl/grpo.h's `critic`), on the tiny model, fp32 CPU: the critic starts from the
// policy's body with a zero scalar head; over PPO steps on a reward that favours the low eighth of the
// vocabulary the critic's value loss falls and the reward rises (as RlGrpo's does); a critic without a
// value head is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "rl/grpo.h"
#include "rl/rl_test_util.h"
#include "rollout/engine.h"
#include "train/session.h"

using namespace mt;
using namespace mt::rl;
using namespace mt::rltest;

TEST(RlPpo, CriticStartsFromThePolicyWithAZeroHead) {
  SessionOptions so;
  TrainSession policy(tiny(), so);
  policy.init_weights(3);
  ModelConfig cc = tiny();
  cc.value_head = true;
  TrainSession critic(cc, so);
  critic.init_weights(9);
  init_critic_from_policy(critic, policy);
  const ParamEntry* score = critic.table().find("score.weight");
  ASSERT_NE(score, nullptr);
  for (int64_t i = 0; i < score->offset; ++i)
    ASSERT_EQ(critic.master().data<float>()[i], policy.master().data<float>()[i]) << "element " << i;
  for (int64_t i = 0; i < score->numel; ++i) ASSERT_EQ(critic.master().data<float>()[score->offset + i], 0.0f);
  TrainSession not_critic(tiny(), so);
  EXPECT_THROW(init_critic_from_policy(not_critic, policy), Error);
}

TEST(RlPpo, ValueLossFallsAndTheRewardRises) {
  Rig r = make_rig(3);
  TrainSession& policy = *r.s;
  RolloutEngine& engine = *r.engine;
  const std::unique_ptr<TrainSession> critic_owner = make_critic(policy, 3);
  TrainSession& critic = *critic_owner;
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 2e-2;
  o.critic_lr = 1e-2;
  o.dynamic_sampling = false;  // every group trains the critic
  std::vector<double> reward, vloss;
  for (int64_t step = 0; step < 24; ++step) {
    const GrpoMetrics m = grpo_step(policy, engine, fixed_prompts(4), low_token_reward, o, step, nullptr, &critic);
    reward.push_back(m.reward_mean);
    vloss.push_back(m.value_loss);
    EXPECT_TRUE(std::isfinite(m.value_loss) && std::isfinite(m.loss)) << "step " << step;
    std::printf("step %lld: reward %.3f, value loss %.4f, value mean %.3f, explained variance %.3f, clipped %.3f\n",
                (long long)step, m.reward_mean, m.value_loss, m.value_mean, m.explained_variance, m.value_clip_frac);
  }
  auto mean3 = [](const std::vector<double>& v, size_t i) { return (v[i] + v[i + 1] + v[i + 2]) / 3; };
  EXPECT_GT(mean3(reward, 21), mean3(reward, 0) + 0.3) << "the reward did not rise";
  EXPECT_LT(mean3(vloss, 21), 0.5 * mean3(vloss, 0)) << "the critic's value loss did not fall";
}

// The policy held fixed (lr 0) and a reward that depends on the prompt only (0, 0.25, 0.5, 0.75): the
// critic, which reads the prompt, can learn every return exactly; its loss falls from the zero head's
// 0.5 E[R^2] to a small fraction of it and the explained variance nears 1.
TEST(RlPpo, CriticFitsTheReturnsOfAFixedPolicy) {
  Rig r = make_rig(3);
  TrainSession& policy = *r.s;
  RolloutEngine& engine = *r.engine;
  const std::unique_ptr<TrainSession> critic_owner = make_critic(policy, 3);
  TrainSession& critic = *critic_owner;
  GrpoOptions o;
  o.n = 4;
  o.max_new_tokens = 8;
  o.lr = 0;
  o.critic_lr = 3e-3;
  o.dynamic_sampling = false;  // every group trains the critic
  o.epochs = 4;  // four critic steps a rollout (the policy's lr is 0)
  o.lam = 1.0;   // returns = the outcome reward on every token, whatever the values
  const RewardFn by_prompt = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
    std::vector<double> r;
    for (const GeneratedSample& x : g) r.push_back(0.25 * double(x.prompt_index));
    return r;
  };
  std::vector<double> vloss, ev;
  for (int64_t step = 0; step < 20; ++step) {
    const GrpoMetrics m = grpo_step(policy, engine, fixed_prompts(4), by_prompt, o, step, nullptr, &critic);
    vloss.push_back(m.value_loss);
    ev.push_back(m.explained_variance);
  }
  std::printf("value loss %.4f -> %.4f, explained variance %.3f -> %.3f\n", vloss[0], vloss.back(), ev[0], ev.back());
  auto mean3 = [](const std::vector<double>& v, size_t i) { return (v[i] + v[i + 1] + v[i + 2]) / 3; };
  EXPECT_LT(mean3(vloss, 17), 0.1 * vloss[0]);
  EXPECT_GT(mean3(ev, 17), 0.8);
}
