// The models of a GRPO / PPO run (grpo_sessions.h).
#include "rl/grpo_sessions.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "data/char_tokenizer.h"
#include "rl/grpo.h"
#include "train/checkpoint.h"
#include "train/run_dir.h"

namespace mt::rl {

void check_grpo_model(const ModelConfig& cfg, const GrpoOptions& o, const std::string& model_dir, bool builtin_task) {
  if (o.aux_loss_coef > 0 && !cfg.output_router_logits)
    MT_THROW("grpo: --aux-loss-coef ", o.aux_loss_coef, " needs the load-balancing loss, which ", model_dir,
             "/config.json turns off (output_router_logits false); set it true there or drop the option");
  if (cfg.num_sparse_layers() == 0 && (o.freeze_router || o.router_z_loss_coef > 0))
    MT_THROW("grpo: ",
             o.freeze_router ? std::string("--freeze-router on") : str("--router-z-loss-coef ", o.router_z_loss_coef),
             ": ", model_dir, " has no MoE layers, so no routers (num_experts ", cfg.num_experts, "); drop it");
  if (builtin_task && cfg.vocab_size < CharTokenizer().vocab_size())
    MT_THROW("grpo: ", model_dir, " has a vocabulary of ", cfg.vocab_size, "; the addition task's tokenizer needs ",
             CharTokenizer().vocab_size());
}

GrpoSessions make_grpo_sessions(const ModelConfig& cfg, SessionOptions so, const GrpoSessionPlan& plan) {
  GrpoSessions out;
  out.policy = std::make_unique<TrainSession>(cfg, so);
  TrainSession& session = *out.policy;
  DistContext& dist = session.dist();
  if (plan.prompts_per_step % dist.dp_size() != 0)
    MT_THROW("grpo: --prompts-per-step ", plan.prompts_per_step, " cannot be split evenly over ", dist.dp_size(),
             " data-parallel ranks (dp_replicate x dp_shard); use a multiple of ", dist.dp_size());
  // The reference and the critic run on the policy's distributed context, laid out like it.
  so.shared_dist = &dist;
  AdamWConfig ac;
  ac.weight_decay = 0;
  const bool resuming = plan.state != nullptr;
  // load reads the model's routing bias too; a resume takes it from the initial model (frozen in grpo;
  // the fingerprint holds its file unchanged).
  LoraAdapters* lora = session.lora();
  // The initial model: its directory, or a preset's init at its seed.
  auto start = [&](TrainSession& s) {
    if (plan.preset_seed >= 0)
      s.init_weights(uint64_t(plan.preset_seed));
    else
      s.load(plan.model_dir);
  };
  if (!resuming || lora)  // (a LoRA run's state is its adapters': the base is read again)
    start(session);
  else if (plan.preset_seed < 0)
    session.load_router_bias(plan.model_dir);
  session.make_optimizer(ac, false);
  if (lora && plan.critic) MT_THROW("grpo: LoRA with PPO's critic is not supported; use grpo or dr-grpo");
  out.lora_reference = lora && plan.reference;
  if (plan.reference && !lora) {
    SessionOptions ro = so;
    ro.weights = Weights::Frozen;
    out.reference = std::make_unique<TrainSession>(cfg, ro);
    start(*out.reference);
  }
  // PPO's critic: the policy's architecture with a scalar head (score.weight [1, D], zero) on the same body.
  if (plan.critic) {
    ModelConfig cc = cfg;
    cc.value_head = true;
    cc.tie_word_embeddings = false;  // its own copy of the embedding
    out.critic = std::make_unique<TrainSession>(cc, so);
    out.critic->make_optimizer(ac, false);
    if (!resuming) {
      out.critic->init_weights(plan.critic_seed);
      init_critic_from_policy(*out.critic, session);
    }
    if (plan.preset_seed < 0) out.critic->load_router_bias(plan.model_dir);  // the policy's body routes as it does
  }
  if (resuming) {
    // The policy's masters and moments, the critic's, the counters: the state the run stopped with.
    const auto t = Clock::now();
    const nlohmann::json& state = *plan.state;
    const int64_t step = state.at("step").get<int64_t>();
    AdamW& opt = session.optimizer();
    restore_checkpoint_state(session, plan.resume_dir, state, "grpo: ");
    opt.set_state(state.at("optimizer_steps").get<int64_t>(), state.at("skipped_steps").get<int64_t>());
    session.set_steps_done(state.value("session_steps", step));
    if (TrainSession* critic = out.critic.get()) {
      const nlohmann::json& cs = state.at("critic");
      const std::string cdir = (std::filesystem::path(plan.resume_dir) / cs.at("dir").get<std::string>()).string();
      AdamW& copt = critic->optimizer();
      load_train_state_shards(cdir, critic->table().total(), critic->parallel().pieces(critic->table()),
                              critic->master(), copt.exp_avg(), copt.exp_avg_sq());
      critic->refresh_compute_weights();
      copt.set_state(cs.at("optimizer_steps").get<int64_t>(), cs.at("skipped_steps").get<int64_t>());
      critic->set_steps_done(cs.value("session_steps", step));
    }
    out.restore_s = seconds_since(t);
  }
  return out;
}

GrpoEngine::GrpoEngine(TrainSession& session, GrpoOptions& o, int64_t per_step, int64_t longest_prompt,
                       int64_t eval_count) {
  DistContext& dist = session.dist();
  GenerateRequest sizing;
  sizing.prompt.assign(size_t(longest_prompt), 0);
  sizing.max_new_tokens = o.max_new_tokens;
  sizing.n = o.n;
  EngineOptions eo;
  eo.record_routing = true;
  if (dist.mesh().size(Axis::Tp) > 1 || dist.mesh().size(Axis::Sp) > 1) {
    tp_copy = std::make_unique<TpGenerator>(session);
    if (const Tensor& b = session.model().router_bias(); b.defined()) {  // the copy routes as the policy
      tp_copy->model().enable_router_bias();
      tp_copy->model().router_bias().copy_from(b);
    }
    TpGenerator* copy = tp_copy.get();
    o.before_generate = [copy] { return copy->refresh(); };
    if (dist.mesh().size(Axis::Tp) > 1) {
      o.replay_routing = false;
      eo.record_routing = false;
    }
  } else {
    eo.lockstep = dist.ep();
  }
  Qwen3MoeModel& gen_model = tp_copy ? tp_copy->model() : session.model();
  eo.max_running = std::max<int64_t>(per_step * o.n, eval_count);
  GenerateRequest eval_sizing = sizing;
  eval_sizing.n = 1;
  eo.kv_cache_bytes = std::max(
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(per_step), sizing), eo.block_size),
      RolloutEngine::kv_bytes_needed(gen_model, std::vector<GenerateRequest>(size_t(eval_count), eval_sizing),
                                     eo.block_size));
  engine_ = std::make_unique<RolloutEngine>(gen_model, eo);
}

}  // namespace mt::rl
