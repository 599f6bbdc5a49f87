// `moetrain _selftest rl` (rl_selftest.h).
#include "rl/rl_selftest.h"

#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/params.h"
#include "rl/grpo.h"
#include "rollout/engine.h"
#include "train/session.h"

namespace mt::rl {

namespace {

// Rollouts of `groups` prompts x n samples: prompts of 2..5 and responses of 1..6 random tokens, the
// engine's log-probs around log(1/V) (ratios on both sides of the clip range), rewards in {0, 0.5, 1} with
// no group all equal, and a routing record of K distinct random experts per token and sparse layer.
RolloutGroups synthetic_rollouts(const ModelConfig& cfg, int64_t groups, int64_t n, uint64_t seed, bool routing) {
  Rng rng(seed);
  const int64_t V = cfg.vocab_size, K = cfg.num_experts_per_tok, E = cfg.num_experts;
  const int64_t layers = cfg.num_sparse_layers();
  RolloutGroups r;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<int32_t> prompt(size_t(2 + rng.randint(0, 4)));
    for (int32_t& t : prompt) t = int32_t(rng.randint(0, V));
    for (int64_t j = 0; j < n; ++j) {
      RolloutSample s;
      s.prompt = prompt;
      s.response.resize(size_t(1 + rng.randint(0, 6)));
      for (int32_t& t : s.response) t = int32_t(rng.randint(0, V));
      for (size_t t = 0; t < s.response.size(); ++t)
        s.logprobs.push_back(float(-std::log(double(V)) + rng.uniform() * 0.8 - 0.4));
      if (routing && layers > 0) {
        const int64_t T = int64_t(prompt.size() + s.response.size()) - 1;
        std::vector<Tensor> ids;
        for (int64_t l = 0; l < layers; ++l) {
          Tensor t = Tensor::empty({T, K}, DType::I32);
          for (int64_t i = 0; i < T; ++i) {
            // K distinct experts: a random start and stride 1 modulo E.
            const int64_t e0 = rng.randint(0, E);
            for (int64_t k = 0; k < K; ++k) t.data<int32_t>()[i * K + k] = int32_t((e0 + k) % E);
          }
          ids.push_back(t);
        }
        s.routing = RoutingRecord(layers, K, E);
        s.routing.append(ids, 0, T);
      }
      r.samples.push_back(std::move(s));
      r.rewards.push_back(j == 0 ? 1.0 : j == 1 ? 0.0 : 0.5 * double(rng.randint(0, 3)));
    }
  }
  return r;
}

// Every tensor of the session's global table, gathered (gradients or values), into `out` with a prefix.
void gather_all(TrainSession& s, const std::string& prefix, NamedTensors& grads_out, NamedTensors& params_out) {
  for (const ParamEntry& e : s.table().entries()) {
    for (bool grads : {true, false}) {
      Tensor t = s.fsdp() ? s.parallel().gather_param_host(e, grads)
                          : view_at(grads ? s.grads() : s.master(), e.offset, e.shape).to(Device::CPU).clone();
      (grads ? grads_out : params_out).emplace_back((grads ? "grad." : "param.") + prefix + e.name, t);
    }
  }
}

Tensor scalar(double v) {
  Tensor t = Tensor::empty({1});
  t.data<float>()[0] = float(v);
  return t;
}

}  // namespace

int run_rl_selftest(const RlSelftestOptions& opt) {
  if (opt.algorithm != "grpo" && opt.algorithm != "ppo")
    MT_THROW("_selftest rl: unknown algorithm '", opt.algorithm, "'; allowed: grpo, ppo");
  SessionOptions so;
  so.dist.mesh = opt.mesh;
  const ModelConfig cfg = load_model_config(opt.model_dir);
  TrainSession policy(cfg, so);
  policy.load(opt.model_dir);
  AdamWConfig ac;
  ac.weight_decay = 0;
  policy.make_optimizer(ac, false);
  std::unique_ptr<TrainSession> reference, critic;
  if (opt.kl_coef > 0) {
    SessionOptions ro = so;
    ro.weights = Weights::Frozen;
    ro.shared_dist = &policy.dist();
    reference = std::make_unique<TrainSession>(cfg, ro);
    reference->load(opt.model_dir);
  }
  if (opt.algorithm == "ppo") {
    ModelConfig cc = cfg;
    cc.value_head = true;
    cc.tie_word_embeddings = false;
    SessionOptions co = so;
    co.shared_dist = &policy.dist();
    critic = std::make_unique<TrainSession>(cc, co);
    critic->init_weights(opt.seed);
    init_critic_from_policy(*critic, policy);
    critic->make_optimizer(ac, false);
  }
  GrpoOptions o;
  o.n = opt.n;
  o.sampling.temperature = 0.9f;  // the tempered head
  o.lr = opt.lr;
  o.critic_lr = opt.lr;
  o.micro_batch_samples = opt.micro_batch_samples;
  o.mini_batches = opt.mini_batches;
  o.epochs = opt.epochs;
  o.replay_routing = opt.replay;
  o.loss.kind = opt.loss;
  o.loss.kl_coef = opt.kl_coef;
  o.loss.clip_high = 0.28;
  o.freeze_router = opt.freeze_router;
  o.aux_loss_coef = opt.aux_loss_coef;
  o.router_z_loss_coef = opt.router_z_loss_coef;
  o.max_new_tokens = 6;
  GrpoMetrics m;
  if (opt.generate) {
    // The whole step: the engine samples from the fixed prompts on every data-parallel rank's share,
    // rewarded by the share of even tokens, with dynamic sampling (rounds decided from the whole round).
    RolloutGroups fixed = synthetic_rollouts(cfg, opt.groups, 1, opt.seed, false);
    std::vector<std::vector<int32_t>> prompts;
    for (const RolloutSample& s : fixed.samples) prompts.push_back(s.prompt);
    o.dynamic_sampling = true;
    o.max_generate_rounds = 2;
    EngineOptions eo;
    eo.record_routing = opt.replay;
    eo.kv_cache_bytes = int64_t(64) << 20;
    // Under tp or sp the engine runs on a one-device copy refreshed before each round; else on the policy.
    std::unique_ptr<TpGenerator> copy;
    if (policy.dist().mesh().size(Axis::Tp) > 1 || policy.dist().mesh().size(Axis::Sp) > 1) {
      copy = std::make_unique<TpGenerator>(policy);
      o.before_generate = [&copy] { return copy->refresh(); };
    } else {
      eo.lockstep = policy.dist().ep();
    }
    RolloutEngine engine(copy ? copy->model() : policy.model(), eo);
    const RewardFn even = [](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      std::vector<double> r;
      for (const GeneratedSample& x : g) {
        double k = 0;
        for (int32_t t : x.tokens) k += t % 2 == 0;
        r.push_back(k / double(x.tokens.size()));
      }
      return r;
    };
    m = grpo_step(policy, engine, prompts, even, o, 1, reference.get(), critic.get());
  } else {
    m = grpo_update(policy, synthetic_rollouts(cfg, opt.groups, opt.n, opt.seed, opt.replay), o, 1, reference.get(),
                    critic.get());
  }
  NamedTensors out{{"loss", scalar(m.loss)},
                   {"policy_loss", scalar(m.policy_loss)},
                   {"grad_norm", scalar(m.grad_norm)},
                   {"entropy", scalar(m.entropy)},
                   {"ref_kl", scalar(m.ref_kl)},
                   {"importance_weight_mean", scalar(m.importance_weight_mean)},
                   {"advantage_std", scalar(m.advantage_std)}};
  // The rollout/trainer gap of the synthetic rollouts is O(1); of generated ones it is rounding, which
  // differs between layouts by as much as itself.
  if (!opt.generate) out.emplace_back("logprob_diff_mean", scalar(m.logprob_diff_mean));
  if (critic) {
    out.emplace_back("value_loss", scalar(m.value_loss));
    out.emplace_back("critic_grad_norm", scalar(m.critic_grad_norm));
  }
  NamedTensors params;
  gather_all(policy, "", out, params);
  if (critic) gather_all(*critic, "critic.", out, params);
  if (policy.dist().rank() == 0) {
    write_safetensors(opt.out_path, out);
    if (!opt.params_path.empty()) write_safetensors(opt.params_path, params);
    std::printf(
        "rl selftest: %s, reward %.4f, %lld rounds, %lld groups kept, %lld updates of %lld micro-batches, loss %.6f, "
        "grad norm %.6f, clip %.3f/%.3f\n",
        opt.algorithm.c_str(), m.reward_mean, (long long)m.generate_rounds, (long long)m.groups_kept,
        (long long)m.updates, (long long)m.micro_batches, m.loss, m.grad_norm, m.clip_low, m.clip_high);
  }
  return 0;
}

}  // namespace mt::rl
