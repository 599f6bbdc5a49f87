// moetrain grpo: GRPO (rl/grpo.h) on the built-in addition task or on the user's prompt files
// (docs/rl.md "moetrain grpo", "Prompt files"), with checkpoints a run can resume from exactly
// ("Checkpoints and resume").
//
// The built-in tasks (--task, rl/tasks/addition.h) each name a starting model, made when absent, and a recipe:
// sharpen (the default) the demo's own problems from the demo stopped early, with the standard recipe (an
// exact-answer reward, GRPO's outcome advantages); extend a fourth digit from the full demo, each answer
// token rewarded and credited against the group's samples at the same position. Both evaluate greedy exact
// match on held-out problems before and after and end with `grpo: exact-match <before>% -> <after>% on <n>
// held-out problems`. `--baseline sft` spends the same wall time on supervised fine-tuning instead (the right
// answers of problems from the same distribution, cross-entropy through the same train_step): the
// comparison the docs quote.
//
// `--prompts FILE.jsonl` trains on the user's prompts instead (rl/prompt_file.h; rollout/prompts.h reads them:
// prompt_ids, prompt or messages, plus answer and free metadata), drawn by a seeded sampler in shuffled epochs, with an
// exact-match, math or external-program reward (rl/rewards.h) on the decoded responses; with
// `--eval-prompts` it ends `grpo: <reward> <before> -> <after> on <n> held-out prompts`.
//
// Checkpoints (train/checkpoint.h): RUN_DIR/checkpoint-N holds the HF weights, the policy's f32 masters
// and AdamW moments, the critic's (PPO) in critic/, and train_state.json (step, optimizer counters, the
// prompt sampler's position or the task's draw count, the reference model's directory and fingerprint,
// the evaluation before training), under a manifest; `--resume` continues from the newest one that
// verifies, and on the CPU equals the run that never stopped, bit for bit. Every option (declared once:
// core/options.h) and every prompt is checked before any work starts; under `moetrain launch` every rank runs it.
#include "rl/grpo.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/commands/grpo_args.h"
#include "core/clock.h"
#include "core/determinism.h"
#include "core/device_select.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "ops/threads.h"
#include "rl/env/env_program.h"
#include "rl/grpo_checkpoint.h"
#include "rl/grpo_env.h"
#include "rl/grpo_sessions.h"
#include "rl/multiturn.h"
#include "rl/prompt_file.h"
#include "rl/prompt_source.h"
#include "rl/tasks/addition.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"

namespace mt {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

}  // namespace

int grpo_main(const std::vector<std::string>& args) {
  return grpo_main(args, GrpoHooks{});
}

int grpo_main(const std::vector<std::string>& args, const GrpoHooks& hooks) {
  GrpoArgs ga;
  ga.python_reward = bool(hooks.reward);
  ga.python_env = hooks.env != nullptr;
  std::string help;
  if (!parse_grpo_args(args, ga, &help)) {
    std::printf("%s", help.c_str());
    return 0;
  }
  install_stop_signals();
  if (ga.deterministic) set_deterministic(true);
  if (ga.dev.threads > 0) ops::set_cpu_threads(int(ga.dev.threads));
  const Device device = resolve_device(ga.device_name);
  if (ga.true_on_policy) set_batch_invariant(true);

  // Resume: the newest checkpoint of the run dir that verifies, checked against this command line.
  const rl::GrpoResumePoint rp = ga.resume.empty()
                                     ? rl::GrpoResumePoint{}
                                     : rl::find_grpo_resume(ga.run_dir, ga.resume, ga.model_dir, ga.model_given,
                                                            ga.from_file, ga.ppo, rl::recorded_args(args));
  if (!rp.dir.empty() && !ga.model_given) ga.model_dir = rp.model_dir;
  const std::string& resume_dir = rp.dir;
  const json& state = rp.state;
  const bool resuming = !resume_dir.empty();
  const int64_t start_step = resuming ? state.at("step").get<int64_t>() : 0;
  const int64_t stop = ga.max_steps > 0 ? ga.max_steps : ga.steps;
  if (start_step >= stop)
    MT_THROW("grpo: resume: checkpoint ", resume_dir, " is at step ", start_step,
             ", which is not before the end of this run (", ga.max_steps > 0 ? "--max-steps " : "--steps ", stop,
             "); raise --steps or --max-steps");

  if (ga.model_dir.empty()) {
    ga.model_dir = ga.from_file                        ? std::string(rl::addition::kDemoModel)
                   : ga.env_builtin == "calculator" ? rl::addition::ensure_calculator_start(ga.device_name)
                                                    : rl::addition::ensure_task_start(ga.preset, ga.device_name);
  }
  // A preset (--model qwen3-30b-a3b) starts from its random init at --seed: a model of any size without a
  // directory (a benchmark, or LoRA on a base no file holds here).
  const std::vector<std::string> presets = preset_names();
  const bool preset =
      !fs::is_directory(ga.model_dir) && std::find(presets.begin(), presets.end(), ga.model_dir) != presets.end();
  if (!preset && !fs::exists(ga.model_dir + "/config.json"))
    MT_THROW("grpo: --model ", ga.model_dir, " has no config.json (nor is it a preset such as qwen3-30b-a3b)");
  // The reference is the frozen initial model: a resumed run reads it again and it must be unchanged.
  const json fingerprint = preset ? json{{"preset", ga.model_dir}, {"seed", ga.seed}}
                                  : rl::initial_model_fingerprint(ga.model_dir, resuming ? &state : nullptr);
  if (preset && resuming && state.value("model_fingerprint", json()) != fingerprint)
    MT_THROW("grpo: resume: the run started from ", state.value("model_fingerprint", json()).dump(), ", not ",
             fingerprint.dump(), " (a preset's start is its init at --seed)");
  const ModelConfig cfg = preset ? preset_model_config(ga.model_dir) : load_model_config(ga.model_dir);
  rl::check_grpo_model(cfg, ga.o, ga.model_dir, !ga.from_file);
  // Prompt files, their answers and the reward program: checked before any weight is read.
  const std::string tokenizer_path = ga.model_dir + "/tokenizer.json";
  std::unique_ptr<rl::PromptRun> prompt_run;
  if (ga.from_file) {
    rl::RewardProgramOptions po;
    po.command = ga.program_cmd;
    po.timeout_s = ga.reward_timeout;
    po.stop_on_error = ga.reward_stop;
    if (ga.reward_spec == "python") po.function = hooks.reward;
    prompt_run = rl::open_prompt_run(ga.prompts_path, ga.eval_prompts_path, ga.model_dir, cfg, ga.o.max_new_tokens,
                                     ga.file_reward, po);
    if (resuming && state.contains("prompts") &&
        state["prompts"].value("count", int64_t(-1)) != int64_t(prompt_run->train.prompts.size()))
      log_info("grpo: resume: warning: ", ga.prompts_path, " has ", prompt_run->train.prompts.size(),
               " prompts, the saved run's file had ", state["prompts"].value("count", int64_t(-1)),
               ": the sampler's order from here differs from the run that stopped");
    ga.o.stop_token_ids.insert(ga.o.stop_token_ids.end(), prompt_run->stop_token_ids.begin(),
                               prompt_run->stop_token_ids.end());
  }

  // The policy, the frozen reference and PPO's critic, on one distributed context; restored when resuming.
  SessionOptions so;
  so.device = device;
  so.dist.mesh = ga.mesh;
  so.dist.comm.timeout = std::chrono::milliseconds(int64_t(ga.comm_timeout_s * 1000));
  so.lora = ga.lora;
  so.recompute = parse_recompute(ga.recompute);
  so.lora_seed = uint64_t(ga.seed);
  rl::GrpoSessionPlan plan;
  plan.model_dir = ga.model_dir;
  plan.preset_seed = preset ? ga.seed : -1;
  plan.prompts_per_step = ga.per_step;
  plan.reference = ga.use_reference && ga.baseline.empty();
  plan.critic = ga.ppo && ga.baseline.empty();
  plan.critic_seed = uint64_t(ga.seed);
  plan.resume_dir = resume_dir;
  plan.state = resuming ? &state : nullptr;
  rl::GrpoSessions sessions = rl::make_grpo_sessions(cfg, so, plan);
  TrainSession& session = *sessions.policy;
  TrainSession* reference = sessions.reference_session();
  std::unique_ptr<TrainSession>& critic = sessions.critic;
  DistContext& dist = session.dist();
  const bool lead = dist.rank() == 0;
  if (LoraAdapters* l = session.lora(); l && lead)
    log_info("grpo: LoRA rank ", l->spec().rank, ", alpha ", l->spec().effective_alpha(), " on ",
             lora_targets_text(l->spec()), ": ", l->table().total(), " adapter parameters train; the base is frozen");
  if (resuming)
    log_info("grpo: resume: step ", start_step, " from ", resume_dir, "; policy", critic ? " and critic" : "",
             " weights, AdamW moments and counters, ",
             ga.from_file ? str("prompt sampler position ", state.at("prompt_position").get<int64_t>())
                          : str(state.at("problems_drawn").get<int64_t>(), " task problems drawn"),
             " restored in ", sessions.restore_s, " s");

  // Where the prompts come from and how samples are scored: the built-in task or the prompt file.
  std::unique_ptr<rl::PromptSource> source =
      ga.from_file ? rl::file_source(*prompt_run, uint64_t(ga.seed), ga.o.max_new_tokens, ga.o.stop_token_ids)
                   : rl::addition_source(ga.task, ga.eval_n, uint64_t(ga.seed), ga.reward_kind);
  if (resuming) source->restore(state);
  // Multi-turn (--env): the environment, the codec between its text and the model's tokens, and the held-out
  // prompts its greedy episodes are measured on (the built-in task's held-out problems, or --eval-prompts).
  rl::GrpoEnvRun env_run;
  if (!ga.env_spec.empty())
    env_run =
        rl::open_grpo_env({ga.env_spec, ga.env_builtin, ga.env_program, ga.reward_timeout, ga.reward_stop,
                           ga.env_spec == "python" ? hooks.env : nullptr},
                          ga.task, ga.eval_n, uint64_t(ga.seed), prompt_run.get(), cfg, ga.model_dir, *source, ga.o);
  rl::Environment* const env = env_run.env;
  const std::vector<std::vector<int32_t>>& env_eval = env_run.eval;
  // The rollout engine, its KV cache sized for the larger of a step's rollouts and the evaluation.
  const int64_t eval_count =
      ga.from_file ? std::max<int64_t>(1, std::min<int64_t>(source->eval_size(), 256)) : ga.eval_n;
  rl::GrpoEngine generator(session, ga.o, ga.per_step, source->longest_prompt(), eval_count);
  RolloutEngine& engine = generator.engine();
  auto evaluate = [&] {
    if (generator.tp_copy) generator.tp_copy->refresh();  // every rank evaluates every prompt (the same collectives)
    return source->evaluate(engine);
  };
  double before = 0;
  if (resuming && state.contains("eval_before"))
    before = state["eval_before"].get<double>();  // of the initial model, measured when the run started
  else if (source->has_eval()) {
    if (resuming)
      log_info(
          "grpo: resume: warning: the saved run recorded no evaluation before training; \"before\" is "
          "measured now, at step ",
          start_step);
    before = evaluate();
  }
  // The environment's greedy episodes before training (measured again at the end, not kept in checkpoints).
  auto evaluate_env = [&] {
    if (generator.tp_copy) generator.tp_copy->refresh();
    return rl::evaluate_episodes(engine, *env, ga.o.codec, env_eval, ga.o.multi_turn, ga.o.max_new_tokens,
                                 ga.o.stop_token_ids, int64_t(1) << 62);
  };
  rl::EpisodeEval env_before;
  if (env && !env_eval.empty()) env_before = evaluate_env();
  std::filesystem::create_directories(ga.run_dir);
  MetricsWriter metrics(ga.run_dir + "/metrics.jsonl", lead, true,
                        resuming ? start_step : -1);  // and a TensorBoard event file beside it
  const auto t0 = Clock::now();
  auto elapsed = [&] { return seconds_since(t0); };
  // train/lr_schedule.h's schedule (steps count from 1 here): a linear warm-up over steps 1..warmup, then
  // constant at --lr, or a cosine from --lr after the warm-up down to --min-lr at the last step.
  const LrParams lrp{ga.o.lr, ga.min_lr.value_or(ga.o.lr), ga.warmup, ga.steps,
                     ga.min_lr ? LrScheduleKind::kCosine : LrScheduleKind::kConstant};
  auto lr_at = [&lrp](int64_t step) { return mt::lr_at(lrp, step - 1); };

  // A checkpoint (rl/grpo_checkpoint.h): the weights and training state, and what this run needs to go on.
  auto save = [&](int64_t step) {
    json st;
    st["format"] = "moetrain-grpo-state-1";
    st["step"] = step;
    st["mode"] = ga.from_file ? "prompts" : ga.baseline.empty() ? "task" : "sft-baseline";
    source->save(st);
    st["rng"] = "none besides: sampling seeds are functions of (seed, step, prompt index)";
    st["lr_schedule"] = {{"lr", ga.o.lr},
                         {"warmup_steps", ga.warmup},
                         {"min_lr", ga.min_lr.value_or(ga.o.lr)},
                         {"next_lr", lr_at(step + 1)}};
    st["model_dir"] = ga.model_dir;
    st["model_fingerprint"] = fingerprint;
    if (source->has_eval()) st["eval_before"] = before;
    st["args"] = rl::recorded_args(args);
    rl::save_grpo_checkpoint(ga.run_dir, step, session, critic.get(),
                             fs::exists(tokenizer_path) ? tokenizer_path : std::string(), std::move(st), ga.keep_last);
  };

  int64_t steps_done = stop;
  int stop_sig = 0;  // a stop signal every rank agreed on after a step
  if (!ga.baseline.empty()) {
    // The comparison: SFT for the wall time of the GRPO run it is compared with.
    log_info("grpo: baseline sft: ", ga.model_dir, ", ", source->describe(), "; held-out exact match before: ", before,
             "%; supervised fine-tuning for ", ga.sft_seconds, " s, ", ga.per_step * ga.o.n, " problems a step, lr ",
             ga.o.lr);
    steps_done = rl::addition::sft_baseline(session, ga.task, uint64_t(ga.seed), ga.per_step * ga.o.n, ga.sft_seconds,
                                            lr_at, metrics);
  } else {
    log_info("grpo: ", ga.model_dir, ", ", source->describe(),
             source->has_eval() ? "; held-out " + source->eval_name() + " before: " + source->shown(before)
                                : std::string("; no evaluation"),
             "; ", resuming ? str("steps ", start_step + 1, "..", stop, " of ") : std::string(), ga.steps, " steps of ",
             ga.per_step, " prompts x ", ga.o.n, " samples, ",
             rl::recipe_text(ga.o, ga.ppo, ga.process, ga.per_position, ga.aggregation_name, reference != nullptr,
                             critic != nullptr),
             env ? str(", env ", ga.env_spec, ": up to ", ga.o.multi_turn.max_turns, " turns, turn credit ",
                       rl::turn_credit_name(ga.o.multi_turn.credit),
                       env_eval.empty() ? std::string()
                                        : str("; greedy episodes before: success ", 100 * env_before.success, "%"))
                 : std::string());
    const rl::PromptFn draw = [&](int64_t count) { return source->draw(count); };
    const rl::RewardFn reward_fn = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      return source->rewards(g);
    };
    if (ga.process)
      ga.o.token_reward = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
        return source->token_rewards(g);
      };
    ga.o.per_position = ga.per_position;
    ga.o.seed = uint64_t(ga.seed);
    for (int64_t step = start_step + 1; step <= stop; ++step) {
      rl::GrpoOptions os = ga.o;
      os.lr = lr_at(step);
      const rl::GrpoMetrics m =
          rl::grpo_step(session, engine, draw, ga.per_step, reward_fn, os, step, reference, critic.get());
      const double eta = elapsed() / double(step - start_step) * double(stop - step);
      log_info(rl::step_line(m, step, ga.steps, reference != nullptr, critic != nullptr), " | ETA ", std::round(eta),
               " s");
      nlohmann::json rec = rl::to_json(m);
      rec["step"] = step;
      rec["lr"] = os.lr;
      rec["elapsed_s"] = elapsed();
      metrics.write(rec);
      // The checkpoint first: whatever the evaluation meets, the weights are on disk.
      if (ga.save_every > 0 && step % ga.save_every == 0 && step < stop) save(step);
      // Ctrl-C or SIGTERM (core/interrupt.h): this step is done; save it and stop, every rank here.
      if (const int sig = dist.agreed_stop_signal(device)) {
        stop_sig = sig;
        steps_done = step;
        break;
      }
    }
  }
  save(steps_done);
  if (stop_sig != 0) {
    if (lead)
      log_info("grpo: stopped by ", stop_signal_name(stop_sig), " after step ", steps_done, "; saved ",
               checkpoint_dir(ga.run_dir, steps_done), "; resume with the same command and --resume",
               steps_done < stop ? "" : " (the final evaluation was skipped)");
    return 128 + stop_sig;
  }
  log_info("grpo: ", std::round(elapsed()), " s of ", ga.baseline.empty() ? "GRPO" : "SFT");
  // A reward or environment program that failed on every sample taught nothing: the run fails, naming the
  // first error (checked after the last collective, so every rank ends; each rank has its own program).
  auto verdict = [&] {
    std::string all_failed =
        prompt_run && prompt_run->program
            ? rl::all_failed_message(prompt_run->program->tally(), "grpo: the reward program", "sample")
            : std::string();
    if (const auto* ep = dynamic_cast<const rl::EnvProgram*>(env); ep && all_failed.empty())
      all_failed = rl::all_failed_message(ep->tally(), "grpo: the environment program", "episode");
    if (all_failed.empty()) return 0;
    log_info(all_failed);
    return 1;
  };
  const bool single_eval = source->has_eval(), env_evaluates = env && !env_eval.empty();
  const double after = single_eval ? evaluate() : 0;
  if (env_evaluates) {
    const std::string line =
        rl::env_eval_line(ga.env_spec, env_before, evaluate_env(), ga.from_file ? "prompts" : "problems");
    if (lead) std::printf("%s\n", line.c_str());
  }
  if (!single_eval) {
    if (lead && !env_evaluates)
      std::printf("grpo: %lld steps done; evaluation skipped (no --eval-prompts)\n", (long long)steps_done);
    return verdict();
  }
  if (!lead) return verdict();
  std::printf("grpo: %s %s -> %s on %lld held-out %s\n", source->eval_name().c_str(), source->shown(before).c_str(),
              source->shown(after).c_str(), (long long)source->eval_size(), ga.from_file ? "prompts" : "problems");
  return verdict();
}

}  // namespace mt
