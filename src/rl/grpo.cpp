// One GRPO step (grpo.h).
#include "rl/grpo.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "rl/rollout_batch.h"

namespace mt::rl {

namespace {
double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const RewardFn& reward, const GrpoOptions& o, int64_t step) {
  if (o.n < 2) MT_THROW("grpo: n = ", o.n, " samples per prompt; group advantages need n >= 2");
  if (o.sampling.temperature != 1.0f)
    MT_THROW("grpo: temperature ", o.sampling.temperature, "; only 1 for now (the trainer's log-probs are at T = 1)");
  if (session.dist().world_size() > 1) MT_THROW("grpo_step runs on one process for now");
  if (prompts.empty()) MT_THROW("grpo: no prompts");
  Qwen3MoeModel& model = session.model();
  GrpoMetrics m;
  // 1. Generate (the engine holds the inference layout for the call: its time is the weight sync).
  auto t = std::chrono::steady_clock::now();
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt = prompts[i];
    r.n = o.n;
    r.max_new_tokens = o.max_new_tokens;
    r.sampling = o.sampling;
    r.sampling.seed = mix64(o.seed ^ mix64(uint64_t(step) * 1000003 + i));
    r.stop_token_ids = o.stop_token_ids;
    reqs.push_back(std::move(r));
  }
  const double sync_before = engine.stats().weight_sync_seconds;
  const std::vector<GeneratedSample> gen = engine.generate(reqs);
  m.weight_sync_s = engine.stats().weight_sync_seconds - sync_before;
  m.generate_s = since(t);
  // 2. Rewards and advantages.
  const std::vector<double> rewards = reward(reqs, gen);
  if (rewards.size() != gen.size()) MT_THROW("grpo: ", rewards.size(), " rewards for ", gen.size(), " samples");
  const std::vector<double> adv = grpo_advantages(rewards, o.n, o.normalize_std);
  const std::vector<bool> constant = constant_groups(rewards, o.n);
  double sum = 0, sq = 0;
  for (double r : rewards) {
    sum += r;
    sq += r * r;
    m.reward_max = std::max(m.reward_max, r);
  }
  m.reward_mean = sum / double(rewards.size());
  m.reward_std = std::sqrt(std::max(0.0, sq / double(rewards.size()) - m.reward_mean * m.reward_mean));
  for (size_t g = 0; g < constant.size(); ++g) {
    bool any = false;
    for (int64_t j = 0; j < o.n; ++j) any = any || rewards[g * size_t(o.n) + size_t(j)] > 0;
    m.groups_with_reward += any;
    m.groups_zero_variance += constant[g];
  }
  m.groups_with_reward /= double(constant.size());
  m.groups_zero_variance /= double(constant.size());
  // 3. The batch, and the trainer's log-probs before the update (the PPO "old" policy).
  t = std::chrono::steady_clock::now();
  std::vector<RolloutSample> samples;
  int64_t tokens = 0;
  for (const GeneratedSample& g : gen) {
    samples.push_back({reqs[size_t(g.prompt_index)].prompt, g.tokens, g.logprobs,
                       o.replay_routing ? g.routing : RoutingRecord()});
    tokens += int64_t(g.tokens.size());
    m.response_len_max = std::max(m.response_len_max, double(g.tokens.size()));
  }
  m.response_len_mean = double(tokens) / double(gen.size());
  PackedRollouts p = pack_rollouts(samples, model.config().num_experts_per_tok);
  PassOptions po;
  po.token_logprobs = true;
  const LossParts lp = model.forward(p.mb, po);
  const std::vector<std::vector<float>> old = response_values(p, lp.logp);
  m.logprob_s = since(t);
  double dsum = 0, wsum = 0;
  std::vector<std::vector<float>> adv_t, w_t;
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t len = int64_t(samples[i].response.size());
    for (int64_t j = 0; j < len; ++j) {
      const double d = double(old[i][size_t(j)]) - double(samples[i].logprobs[size_t(j)]);
      dsum += std::abs(d);
      wsum += std::exp(d);
      m.logprob_diff_max = std::max(m.logprob_diff_max, std::abs(d));
    }
    adv_t.emplace_back(size_t(len), float(adv[i]));
    w_t.emplace_back(size_t(len), float(aggregation_norm(o.aggregation, len, tokens, int64_t(samples.size()),
                                                         double(o.max_new_tokens))));
  }
  m.logprob_diff_mean = dsum / double(tokens);
  m.importance_weight_mean = wsum / double(tokens);
  set_token_values(p, PolicyObjective::kAdvantage, adv_t);
  set_token_values(p, PolicyObjective::kOldLogp, old);
  set_token_values(p, PolicyObjective::kWeight, w_t);
  // 4. The update.
  t = std::chrono::steady_clock::now();
  PolicyObjective obj(o.loss);
  StepOptions so;
  so.lr = o.lr;
  so.objective = &obj;
  const StepResult r = session.train_step({p.mb}, so);
  m.update_s = since(t);
  m.loss = r.loss;
  m.grad_norm = r.opt.grad_norm;
  const PolicyMetrics& pm = obj.metrics();
  if (pm.tokens > 0) {
    m.clip_low = double(pm.clipped_low) / double(pm.tokens);
    m.clip_high = double(pm.clipped_high) / double(pm.tokens);
    m.approx_kl = pm.approx_kl / double(pm.tokens);
  }
  return m;
}

}  // namespace mt::rl
