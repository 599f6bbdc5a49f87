// One GRPO step (grpo.h).
#include "rl/grpo.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "rl/rollout_batch.h"
#include "rl/shaping.h"
#include "rl/value_loss.h"

namespace mt::rl {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One kept sample and what the update needs of it.
struct Kept {
  RolloutSample s;
  std::vector<double> step_rewards;     // process supervision
  std::vector<double> advantage;        // per response token
  std::vector<double> values, returns;  // PPO: the critic's values before the update, GAE returns
  bool filtered = false;                // overlong filtering: token weight 0
};

// A micro-batch of the update: its samples packed, their per-token values set.
struct UpdateMicroBatch {
  PackedRollouts p;
  std::vector<size_t> samples;  // indices into the kept samples
  PackedRollouts critic;        // PPO: the same rows for the critic (returns, old values, weights; no replay)
};

}  // namespace

void validate(const GrpoOptions& o) {
  if (o.n < 2) MT_THROW("grpo: n = ", o.n, " samples per prompt; group advantages need n >= 2");
  if (o.max_new_tokens < 1) MT_THROW("grpo: max_new_tokens = ", o.max_new_tokens, "; need >= 1");
  if (!(o.sampling.temperature > 0) || !std::isfinite(o.sampling.temperature))
    MT_THROW("grpo: temperature ", o.sampling.temperature,
             "; need a finite value > 0 (sampled log-probs; 0 is greedy decoding, which has none)");
  if (!(o.lr >= 0) || !std::isfinite(o.lr)) MT_THROW("grpo: lr ", o.lr, "; need a finite value >= 0");
  if (o.max_generate_rounds < 1) MT_THROW("grpo: max_generate_rounds = ", o.max_generate_rounds, "; need >= 1");
  if (o.overlong_penalty < 0) MT_THROW("grpo: overlong_penalty ", o.overlong_penalty, "; need >= 0 (0 = off)");
  if (o.overlong_penalty > 0 && (o.overlong_buffer < 1 || o.overlong_buffer > o.max_new_tokens))
    MT_THROW("grpo: overlong_buffer ", o.overlong_buffer, " with max_new_tokens ", o.max_new_tokens,
             "; the soft overlong penalty needs 1 <= buffer <= max_new_tokens");
  if (o.epochs < 1) MT_THROW("grpo: epochs = ", o.epochs, "; need >= 1");
  if (o.mini_batches < 1) MT_THROW("grpo: mini_batches = ", o.mini_batches, "; need >= 1");
  if (o.micro_batch_samples < 0)
    MT_THROW("grpo: micro_batch_samples = ", o.micro_batch_samples, "; need >= 0 (0: one)");
  if (!(o.gamma >= 0 && o.gamma <= 1)) MT_THROW("grpo: gamma ", o.gamma, "; need a value in [0, 1]");
  if (!(o.lam >= 0 && o.lam <= 1)) MT_THROW("grpo: lam ", o.lam, "; need a value in [0, 1]");
  if (!std::isfinite(o.value_clip)) MT_THROW("grpo: value_clip ", o.value_clip, "; need a finite value (<= 0: off)");
  if (!(o.critic_lr >= 0) || !std::isfinite(o.critic_lr))
    MT_THROW("grpo: critic_lr ", o.critic_lr, "; need a finite value >= 0");
  validate(o.loss);
}

void init_critic_from_policy(TrainSession& critic, TrainSession& policy) {
  if (!critic.config().value_head)
    MT_THROW("init_critic_from_policy: the critic's config has no value_head (it needs score.weight [1, D])");
  if (critic.dist().world_size() > 1 || policy.dist().world_size() > 1)
    MT_THROW("init_critic_from_policy: one process only (world sizes ", critic.dist().world_size(), " and ",
             policy.dist().world_size(), ")");
  const ParamTable& ct = critic.table();
  const ParamTable& pt = policy.table();
  const ParamEntry* score = ct.find("score.weight");
  MT_CHECK(score, "a value-head table without score.weight");
  // The body: the same entries in the same order before the head.
  for (const ParamEntry& e : ct.entries()) {
    if (e.name == "score.weight") continue;
    const ParamEntry* q = pt.find(e.name);
    if (!q || q->shape != e.shape || q->offset != e.offset)
      MT_THROW("init_critic_from_policy: the policy's ", e.name, " ", q ? "has another shape or place" : "is missing",
               "; the critic must be the policy's architecture with a scalar head");
  }
  Tensor body = policy.master().to(Device::CPU).rows(0, score->offset);
  Tensor cm = critic.master().to(Device::CPU);
  cm.rows(0, score->offset).copy_from(body);
  cm.rows(score->offset, score->numel).zero_();
  if (critic.master().device() != Device::CPU) critic.master().copy_from(cm);  // else cm is the master itself
  critic.refresh_compute_weights();
}

GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const RewardFn& reward, const GrpoOptions& o, int64_t step, TrainSession* reference,
                      TrainSession* critic) {
  if (prompts.empty()) MT_THROW("grpo: no prompts");
  const PromptFn same = [&](int64_t count) {
    if (count != int64_t(prompts.size()))
      MT_THROW("grpo: ", count, " prompts asked of a fixed set of ", prompts.size());
    return prompts;
  };
  return grpo_step(session, engine, same, int64_t(prompts.size()), reward, o, step, reference, critic);
}

GrpoMetrics grpo_step(TrainSession& session, RolloutEngine& engine, const PromptFn& prompt_fn, int64_t groups,
                      const RewardFn& reward, const GrpoOptions& o, int64_t step, TrainSession* reference,
                      TrainSession* critic) {
  validate(o);
  if (critic && !critic->config().value_head)
    MT_THROW("grpo: the critic session's model has an LM head; PPO's critic needs ModelConfig::value_head");
  if (critic && critic->dist().world_size() > 1) MT_THROW("grpo_step runs on one process for now (the critic too)");
  if (groups < 1) MT_THROW("grpo: groups = ", groups, " prompts per step; need >= 1");
  if (o.mini_batches > groups)
    MT_THROW("grpo: mini_batches = ", o.mini_batches, " for ", groups, " groups a step; a mini-batch needs a group");
  if (o.loss.kl_coef > 0 && !reference)
    MT_THROW("grpo: kl_coef ", o.loss.kl_coef, " needs a reference model (a frozen copy of the initial policy)");
  if (session.dist().world_size() > 1) MT_THROW("grpo_step runs on one process for now");
  Qwen3MoeModel& model = session.model();
  const int64_t K = model.config().num_experts_per_tok;
  const int64_t n = o.n;
  GrpoMetrics m;

  // 1. Generate, reward, keep: rounds of `groups` prompts until `groups` groups are kept.
  std::vector<Kept> kept;
  std::vector<double> kept_rewards;  // shaped, per kept sample
  double r_sum = 0, r_sq = 0, len_sum = 0;
  int64_t samples_seen = 0, drawn = 0, gen_tokens = 0;
  const int64_t max_rounds = o.dynamic_sampling ? o.max_generate_rounds : 1;
  while (m.groups_kept < groups && m.generate_rounds < max_rounds) {
    auto t = Clock::now();
    const std::vector<std::vector<int32_t>> prompts = prompt_fn(groups);
    if (int64_t(prompts.size()) != groups)
      MT_THROW("grpo: the prompt source gave ", prompts.size(), " prompts for ", groups, " asked");
    std::vector<GenerateRequest> reqs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (prompts[i].empty()) MT_THROW("grpo: prompt ", drawn + int64_t(i), " of step ", step, " is empty");
      GenerateRequest r;
      r.prompt = prompts[i];
      r.n = n;
      r.max_new_tokens = o.max_new_tokens;
      r.sampling = o.sampling;
      r.sampling.seed = mix64(o.seed ^ mix64(uint64_t(step) * 1000003 + uint64_t(drawn) + i));
      r.stop_token_ids = o.stop_token_ids;
      reqs.push_back(std::move(r));
    }
    drawn += groups;
    const double sync_before = engine.stats().weight_sync_seconds;
    const std::vector<GeneratedSample> gen = engine.generate(reqs);
    m.weight_sync_s += engine.stats().weight_sync_seconds - sync_before;
    m.generate_s += since(t);
    ++m.generate_rounds;
    if (int64_t(gen.size()) != groups * n)
      MT_THROW("grpo: the engine returned ", gen.size(), " samples for ", groups, " prompts x ", n);
    t = Clock::now();
    std::vector<double> rewards = reward(reqs, gen);
    m.reward_s += since(t);
    if (rewards.size() != gen.size()) MT_THROW("grpo: ", rewards.size(), " rewards for ", gen.size(), " samples");
    // Metrics over everything generated (the policy's behaviour), on the rewards as the function gave them.
    for (size_t i = 0; i < gen.size(); ++i) {
      const double r = rewards[i];
      if (!std::isfinite(r)) MT_THROW("grpo: reward ", r, " for sample ", i % size_t(n), " of prompt ", i / size_t(n));
      r_sum += r;
      r_sq += r * r;
      m.reward_max = samples_seen + int64_t(i) == 0 ? r : std::max(m.reward_max, r);
      const double len = double(gen[i].tokens.size());
      len_sum += len;
      gen_tokens += int64_t(len);
      m.response_len_max = std::max(m.response_len_max, len);
      m.overlong_fraction += gen[i].finish_reason == "length";
    }
    samples_seen += int64_t(gen.size());
    for (int64_t g = 0; g < groups; ++g) {
      bool any = false, correct = false;
      for (int64_t j = 0; j < n; ++j) {
        any = any || rewards[size_t(g * n + j)] > 0;
        correct = correct || rewards[size_t(g * n + j)] >= o.correct_reward;
      }
      m.groups_with_reward += any;
      m.groups_correct += correct;
    }
    // Shaping, then which groups carry a gradient.
    if (o.overlong_penalty > 0)
      for (size_t i = 0; i < gen.size(); ++i)
        rewards[i] += soft_overlong_penalty(int64_t(gen[i].tokens.size()), o.max_new_tokens, o.overlong_buffer,
                                            o.overlong_penalty);
    std::vector<std::vector<double>> steps;
    if (o.token_reward) {
      t = Clock::now();
      steps = o.token_reward(reqs, gen);
      m.reward_s += since(t);
      if (steps.size() != gen.size())
        MT_THROW("grpo: ", steps.size(), " token reward rows for ", gen.size(), " samples");
      for (size_t i = 0; i < gen.size(); ++i)
        if (steps[i].size() != gen[i].tokens.size())
          MT_THROW("grpo: sample ", i, " has ", gen[i].tokens.size(), " tokens and ", steps[i].size(),
                   " token rewards");
    }
    const std::vector<bool> constant = o.token_reward ? constant_step_groups(steps, n) : constant_groups(rewards, n);
    for (int64_t g = 0; g < groups; ++g) {
      m.groups_zero_variance += constant[size_t(g)];
      if ((o.dynamic_sampling && constant[size_t(g)]) || m.groups_kept >= groups) continue;
      ++m.groups_kept;
      for (int64_t j = 0; j < n; ++j) {
        const size_t i = size_t(g * n + j);
        const GeneratedSample& x = gen[i];
        if (x.prompt_index != g || x.sample_index != j)
          MT_THROW("grpo: the engine's sample ", i, " is prompt ", x.prompt_index, " sample ", x.sample_index,
                   "; expected prompt ", g, " sample ", j);
        Kept k;
        k.s = {reqs[size_t(g)].prompt, x.tokens, x.logprobs, o.replay_routing ? x.routing : RoutingRecord()};
        k.filtered = o.overlong_filter && x.finish_reason == "length";
        if (o.token_reward) k.step_rewards = steps[i];
        kept.push_back(std::move(k));
        kept_rewards.push_back(rewards[i]);
      }
    }
  }
  m.groups_generated = m.generate_rounds * groups;
  m.reward_mean = r_sum / double(samples_seen);
  m.reward_std = std::sqrt(std::max(0.0, r_sq / double(samples_seen) - m.reward_mean * m.reward_mean));
  m.response_len_mean = len_sum / double(samples_seen);
  m.overlong_fraction /= double(samples_seen);
  m.groups_with_reward /= double(m.groups_generated);
  m.groups_correct /= double(m.groups_generated);
  m.groups_zero_variance /= double(m.groups_generated);
  m.rollout_tokens_per_s = m.generate_s > 0 ? double(gen_tokens) / m.generate_s : 0;
  if (kept.empty()) {
    log_info("grpo: step ", step, ": no group with differing rewards in ", m.generate_rounds,
             " generate rounds; update skipped");
    return m;
  }

  // 2. Advantages, per kept group; with a critic, GAE per sample from its values.
  if (critic) {
    auto t = Clock::now();
    const size_t per = o.micro_batch_samples > 0 ? size_t(o.micro_batch_samples) : kept.size();
    for (size_t c0 = 0; c0 < kept.size(); c0 += per) {
      std::vector<RolloutSample> ss;
      for (size_t i = c0; i < std::min(kept.size(), c0 + per); ++i) {
        ss.push_back(kept[i].s);
        ss.back().routing = RoutingRecord();  // the critic routes with its own router
      }
      const PackedRollouts p = pack_rollouts(ss, K);
      const std::vector<std::vector<float>> v = response_values(p, critic->model().forward(p.mb, PassOptions{}).value);
      for (size_t k = 0; k < ss.size(); ++k) {
        Kept& x = kept[c0 + k];
        x.values.assign(v[k].begin(), v[k].end());
        std::vector<double> r(x.s.response.size(), 0.0);
        if (o.token_reward)
          r = x.step_rewards;
        else
          r.back() = kept_rewards[c0 + k];
        Gae g = gae(r, x.values, o.gamma, o.lam);
        x.advantage = std::move(g.advantages);
        x.returns = std::move(g.returns);
      }
    }
    m.critic_value_s = since(t);
    // Whitened over the trained tokens; value metrics against the returns.
    double n_tok = 0, a_sum = 0, a_sq = 0, v_sum = 0, r_sum2 = 0, r_sq2 = 0, e_sum = 0, e_sq = 0;
    for (const Kept& x : kept)
      if (!x.filtered)
        for (size_t j = 0; j < x.advantage.size(); ++j) {
          n_tok += 1;
          a_sum += x.advantage[j];
          a_sq += x.advantage[j] * x.advantage[j];
          v_sum += x.values[j];
          r_sum2 += x.returns[j];
          r_sq2 += x.returns[j] * x.returns[j];
          const double e = x.returns[j] - x.values[j];
          e_sum += e;
          e_sq += e * e;
        }
    if (n_tok > 0) {
      const double mean = a_sum / n_tok, sd = std::sqrt(std::max(0.0, a_sq / n_tok - mean * mean));
      for (Kept& x : kept)
        for (double& a : x.advantage) a = (a - mean) / (sd + 1e-6);
      m.value_mean = v_sum / n_tok;
      const double var_r = r_sq2 / n_tok - (r_sum2 / n_tok) * (r_sum2 / n_tok);
      const double var_e = e_sq / n_tok - (e_sum / n_tok) * (e_sum / n_tok);
      m.explained_variance = var_r > 1e-12 ? 1.0 - var_e / var_r : 0.0;
    }
  } else if (o.token_reward) {
    std::vector<std::vector<double>> steps;
    for (const Kept& k : kept) steps.push_back(k.step_rewards);
    const std::vector<std::vector<double>> adv =
        o.per_position ? position_advantages(steps, n, o.normalize_std) : process_advantages(steps, n, o.normalize_std);
    for (size_t i = 0; i < kept.size(); ++i) kept[i].advantage = adv[i];
  } else {
    const std::vector<double> adv = grpo_advantages(kept_rewards, n, o.normalize_std);
    for (size_t i = 0; i < kept.size(); ++i) kept[i].advantage.assign(kept[i].s.response.size(), adv[i]);
  }

  // 3. Mini-batches of whole groups, micro-batches of samples; each packed once, and the old (and
  //    reference) log-probs computed before the first epoch.
  const int64_t kept_groups = m.groups_kept;
  const int64_t mini = std::min(o.mini_batches, kept_groups);
  std::vector<std::vector<UpdateMicroBatch>> minis;
  minis.resize(static_cast<size_t>(mini));
  PassOptions po;
  po.token_logprobs = true;
  po.token_entropy = true;
  po.temperature = o.sampling.temperature;
  PassOptions ref_po = po;
  ref_po.token_entropy = false;
  double dsum = 0, wsum = 0, ent_sum = 0, ref_kl_sum = 0, adv_sum = 0, adv_sq = 0;
  int64_t tokens_all = 0;
  for (int64_t b = 0; b < mini; ++b) {
    const size_t g0 = size_t(b * kept_groups / mini), g1 = size_t((b + 1) * kept_groups / mini);
    const size_t s0 = g0 * size_t(n), s1 = g1 * size_t(n);
    // The mini-batch's normalisers (the aggregation over its trained tokens and samples).
    int64_t mb_tokens = 0, mb_samples = 0;
    for (size_t i = s0; i < s1; ++i)
      if (!kept[i].filtered) {
        mb_tokens += int64_t(kept[i].s.response.size());
        ++mb_samples;
      }
    const size_t per = o.micro_batch_samples > 0 ? size_t(o.micro_batch_samples) : s1 - s0;
    for (size_t c0 = s0; c0 < s1; c0 += per) {
      UpdateMicroBatch u;
      std::vector<RolloutSample> ss;
      for (size_t i = c0; i < std::min(s1, c0 + per); ++i) {
        u.samples.push_back(i);
        ss.push_back(kept[i].s);
      }
      u.p = pack_rollouts(ss, K);
      auto t = Clock::now();
      const LossParts lp = model.forward(u.p.mb, po);
      const std::vector<std::vector<float>> old = response_values(u.p, lp.logp);
      const std::vector<std::vector<float>> ent = response_values(u.p, lp.entropy);
      m.logprob_s += since(t);
      std::vector<std::vector<float>> ref;
      if (reference) {
        t = Clock::now();
        ref = response_values(u.p, reference->model().forward(u.p.mb, ref_po).logp);
        m.ref_logprob_s += since(t);
      }
      std::vector<std::vector<float>> adv_t, w_t;
      for (size_t k = 0; k < u.samples.size(); ++k) {
        const Kept& x = kept[u.samples[k]];
        const int64_t len = int64_t(x.s.response.size());
        for (int64_t j = 0; j < len; ++j) {
          const double d = double(old[k][size_t(j)]) - double(x.s.logprobs[size_t(j)]);
          dsum += std::abs(d);
          wsum += std::exp(d);
          m.logprob_diff_max = std::max(m.logprob_diff_max, std::abs(d));
          ent_sum += ent[k][size_t(j)];
          if (reference) ref_kl_sum += kl_value(o.loss.kl, old[k][size_t(j)], ref[k][size_t(j)]);
          adv_sum += x.advantage[size_t(j)];
          adv_sq += x.advantage[size_t(j)] * x.advantage[size_t(j)];
        }
        tokens_all += len;
        adv_t.emplace_back(x.advantage.begin(), x.advantage.end());
        const double w = x.filtered ? 0.0
                                    : aggregation_norm(o.aggregation, len, std::max<int64_t>(mb_tokens, 1),
                                                       std::max<int64_t>(mb_samples, 1), double(o.max_new_tokens));
        w_t.emplace_back(size_t(len), float(w));
      }
      set_token_values(u.p, PolicyObjective::kAdvantage, adv_t);
      set_token_values(u.p, PolicyObjective::kOldLogp, old);
      set_token_values(u.p, PolicyObjective::kWeight, w_t);
      if (reference) set_token_values(u.p, PolicyObjective::kRefLogp, ref);
      if (critic) {
        std::vector<RolloutSample> cs;
        std::vector<std::vector<float>> ret_t, val_t, cw_t;
        for (size_t i : u.samples) {
          const Kept& x = kept[i];
          cs.push_back(x.s);
          cs.back().routing = RoutingRecord();
          ret_t.emplace_back(x.returns.begin(), x.returns.end());
          val_t.emplace_back(x.values.begin(), x.values.end());
          // The value loss's token mean over the mini-batch's trained tokens.
          cw_t.emplace_back(x.s.response.size(),
                            x.filtered ? 0.0f : float(1.0 / double(std::max<int64_t>(mb_tokens, 1))));
        }
        u.critic = pack_rollouts(cs, K);
        set_token_values(u.critic, ValueLossObjective::kReturn, ret_t);
        set_token_values(u.critic, ValueLossObjective::kOldValue, val_t);
        set_token_values(u.critic, ValueLossObjective::kWeight, cw_t);
      }
      minis[size_t(b)].push_back(std::move(u));
    }
  }
  m.logprob_diff_mean = dsum / double(tokens_all);
  m.importance_weight_mean = wsum / double(tokens_all);
  m.entropy = ent_sum / double(tokens_all);
  m.ref_kl = reference ? ref_kl_sum / double(tokens_all) : 0;
  m.advantage_mean = adv_sum / double(tokens_all);
  m.advantage_std = std::sqrt(std::max(0.0, adv_sq / double(tokens_all) - m.advantage_mean * m.advantage_mean));

  // 4. The update: epochs x mini-batches optimizer steps, each over its micro-batches.
  auto t = Clock::now();
  int64_t total_mbs = 0, done_mbs = 0, train_tokens = 0, clip_low = 0, clip_high = 0, trained = 0;
  double approx_kl = 0;
  for (const auto& mb : minis) total_mbs += int64_t(mb.size());
  total_mbs *= o.epochs;
  auto last_line = Clock::now();
  for (int64_t e = 0; e < o.epochs; ++e)
    for (const std::vector<UpdateMicroBatch>& mb : minis) {
      std::vector<MicroBatch> batches;
      for (const UpdateMicroBatch& u : mb) {
        batches.push_back(u.p.mb);
        train_tokens += u.p.mb.input_ids.numel();
      }
      PolicyObjective obj(o.loss);
      StepOptions so;
      so.lr = o.lr;
      so.objective = &obj;
      so.temperature = o.sampling.temperature;
      so.on_micro_batch = [&](int64_t, int64_t, const LossParts&) {
        ++done_mbs;
        if (o.progress_every_s > 0 && since(last_line) >= o.progress_every_s && done_mbs < total_mbs) {
          const double el = since(t);
          log_info("grpo: step ", step, " update: micro-batch ", done_mbs, "/", total_mbs, " (epoch ", e + 1, "/",
                   o.epochs, "), ", el, " s, ETA ", std::round(el / double(done_mbs) * double(total_mbs - done_mbs)),
                   " s");
          last_line = Clock::now();
        }
      };
      const StepResult r = session.train_step(batches, so);
      ++m.updates;
      m.micro_batches += int64_t(batches.size());
      m.loss += r.loss;
      m.grad_norm += r.opt.grad_norm;
      m.grad_norm_max = std::max(m.grad_norm_max, r.opt.grad_norm);
      const PolicyMetrics& pm = obj.metrics();
      m.policy_loss += pm.pg_loss;
      m.kl_loss += pm.kl_loss;
      clip_low += pm.clipped_low;
      clip_high += pm.clipped_high;
      approx_kl += pm.approx_kl;
      trained += pm.tokens;
    }
  m.update_s = since(t);
  // 5. PPO: the critic's update on the returns, the same epochs and mini-batches.
  if (critic) {
    const auto tc = Clock::now();
    int64_t c_updates = 0, c_tokens = 0, c_clipped = 0;
    for (int64_t e = 0; e < o.epochs; ++e)
      for (const std::vector<UpdateMicroBatch>& mb : minis) {
        std::vector<MicroBatch> batches;
        for (const UpdateMicroBatch& u : mb) batches.push_back(u.critic.mb);
        ValueLossObjective vobj(o.value_clip);
        StepOptions so;
        so.lr = o.critic_lr;
        so.objective = &vobj;
        const StepResult r = critic->train_step(batches, so);
        ++c_updates;
        m.value_loss += r.objective_sum;
        m.critic_grad_norm += r.opt.grad_norm;
        c_tokens += vobj.metrics().tokens;
        c_clipped += vobj.metrics().clipped;
      }
    m.value_loss /= double(c_updates);
    m.critic_grad_norm /= double(c_updates);
    m.value_clip_frac = c_tokens > 0 ? double(c_clipped) / double(c_tokens) : 0.0;
    m.critic_update_s = since(tc);
  }
  m.train_tokens_per_s = m.update_s > 0 ? double(train_tokens) / m.update_s : 0;
  m.loss /= double(m.updates);
  m.grad_norm /= double(m.updates);
  m.policy_loss /= double(m.updates);
  m.kl_loss /= double(m.updates);
  if (trained > 0) {
    m.clip_low = double(clip_low) / double(trained);
    m.clip_high = double(clip_high) / double(trained);
    m.approx_kl = approx_kl / double(trained);
  }
  return m;
}

}  // namespace mt::rl
