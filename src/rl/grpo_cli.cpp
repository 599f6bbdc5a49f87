// moetrain grpo [--model DIR] [--steps N] [--prompts-per-step P] [--n G] [--max-digits D] [--lr LR]
//               [--eval-problems N] [--device cpu|cuda|auto] [--out-dir DIR] [--seed S]
// GRPO (rl/grpo.h) on the built-in addition task: starts from the demo checkpoint (training it first
// when it is absent), rewards exact answers (1 or 0), evaluates greedy exact match on held-out problems
// before and after, writes per-step metrics (JSONL) and the final checkpoint, and ends with
// `grpo: exact-match <before>% -> <after>% on <n> held-out problems`. One process for now.
#include "rl/grpo_cli.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/cli_args.h"
#include "core/error.h"
#include "core/log.h"
#include "data/synthetic.h"
#include "model/hf_checkpoint.h"
#include "rl/grpo.h"
#include "train/session.h"
#include "train/trainer.h"

namespace mt {

namespace {

const char* kUsage =
    "usage: moetrain grpo [--model DIR] [--steps N] [--prompts-per-step P] [--n G] [--max-digits D] [--lr LR]\n"
    "       [--eval-problems N] [--device cpu|cuda|auto] [--out-dir DIR] [--seed S]";


std::vector<int32_t> ids32(const std::vector<int64_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

// Greedy exact match on the held-out problems, through the engine.
double exact_match(RolloutEngine& engine, const std::vector<Problem>& problems, int max_digits) {
  std::vector<GenerateRequest> reqs;
  for (const Problem& p : problems) {
    GenerateRequest r;
    r.prompt = ids32(p.prompt_ids);
    r.sampling.temperature = 0;
    r.max_new_tokens = max_answer_tokens(max_digits);
    reqs.push_back(r);
  }
  const std::vector<GeneratedSample> out = engine.generate(reqs);
  int64_t correct = 0;
  for (const GeneratedSample& g : out)
    correct += check_answer(problems[size_t(g.prompt_index)], std::vector<int64_t>(g.tokens.begin(), g.tokens.end()));
  return 100.0 * double(correct) / double(problems.size());
}

}  // namespace

int grpo_main(const std::vector<std::string>& args) {
  std::string model_dir = "runs/demo/checkpoint-2500", device_name = "auto", out_dir = "runs/grpo";
  int64_t steps = 60, per_step = 16, eval_n = 200, seed = 1;
  int max_digits = 4;
  rl::GrpoOptions o;
  o.n = 8;
  o.lr = 1e-4;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) MT_THROW(a, " needs a value; ", kUsage);
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      std::printf("%s\n", kUsage);
      return 0;
    } else if (a == "--model") model_dir = value();
    else if (a == "--steps") steps = parse_flag_number<int64_t>(a, value());
    else if (a == "--prompts-per-step") per_step = parse_flag_number<int64_t>(a, value());
    else if (a == "--n") o.n = parse_flag_number<int64_t>(a, value());
    else if (a == "--max-digits") max_digits = parse_flag_number<int>(a, value());
    else if (a == "--lr") o.lr = parse_flag_number<double>(a, value());
    else if (a == "--eval-problems") eval_n = parse_flag_number<int64_t>(a, value());
    else if (a == "--device") device_name = value();
    else if (a == "--out-dir") out_dir = value();
    else if (a == "--seed") seed = parse_flag_number<int64_t>(a, value());
    else MT_THROW("grpo: unknown argument '", a, "'; ", kUsage);
  }
  if (o.n < 2) MT_THROW("grpo: --n ", o.n, " samples per prompt; group advantages need at least 2");
  if (steps < 1 || per_step < 1 || eval_n < 1) MT_THROW("grpo: --steps, --prompts-per-step and --eval-problems must be >= 1");
  if (max_digits < 1 || max_digits > kMaxAdditionDigits)
    MT_THROW("grpo: --max-digits ", max_digits, " must be in [1, ", kMaxAdditionDigits, "]");
  const Device device = resolve_device(device_name);
  if (!std::filesystem::exists(model_dir + "/config.json")) {
    if (model_dir != "runs/demo/checkpoint-2500") MT_THROW("grpo: --model ", model_dir, " has no config.json");
    log_info("grpo: ", model_dir, " is absent: training the demo model first (moetrain train)");
    TrainConfig tc;
    tc.device = device_name;
    run_training(tc);
  }
  const ModelConfig cfg = load_model_config(model_dir);
  SessionOptions so;
  so.device = device;
  TrainSession session(cfg, so);
  session.load(model_dir);
  AdamWConfig ac;
  ac.weight_decay = 0;
  session.make_optimizer(ac, false);
  o.max_new_tokens = max_answer_tokens(max_digits);

  // The KV cache: what the larger of a step's rollouts and the evaluation can hold.
  GenerateRequest sizing;
  sizing.prompt.assign(size_t(max_problem_tokens(max_digits)), 0);
  sizing.max_new_tokens = o.max_new_tokens;
  sizing.n = o.n;
  EngineOptions eo;
  eo.record_routing = true;
  eo.max_running = std::max<int64_t>(per_step * o.n, eval_n);
  eo.kv_cache_bytes = std::max(
      RolloutEngine::kv_bytes_needed(session.model(), std::vector<GenerateRequest>(size_t(per_step), sizing), eo.block_size),
      RolloutEngine::kv_bytes_needed(session.model(), std::vector<GenerateRequest>(size_t(eval_n), [&] {
                                       GenerateRequest r = sizing;
                                       r.n = 1;
                                       return r;
                                     }()), eo.block_size));
  RolloutEngine engine(session.model(), eo);

  const std::vector<Problem> eval = make_eval_problems(eval_n, uint64_t(seed) + 7, max_digits);
  const double before = exact_match(engine, eval, max_digits);
  log_info("grpo: ", model_dir, ", task: addition up to ", max_digits, " digits; held-out exact match before: ", before,
           "%; ", steps, " steps of ", per_step, " prompts x ", o.n, " samples, lr ", o.lr);
  std::filesystem::create_directories(out_dir);
  std::ofstream metrics(out_dir + "/metrics.jsonl", std::ios::trunc);
  Rng rng{uint64_t(seed)};
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<Problem> problems;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t i = 0; i < per_step; ++i) {
      problems.push_back(sample_train_problem(rng, max_digits));
      prompts.push_back(ids32(problems.back().prompt_ids));
    }
    const rl::RewardFn exact = [&](const std::vector<GenerateRequest>&, const std::vector<GeneratedSample>& g) {
      std::vector<double> r;
      for (const GeneratedSample& x : g)
        r.push_back(check_answer(problems[size_t(x.prompt_index)], std::vector<int64_t>(x.tokens.begin(), x.tokens.end()))
                        ? 1.0
                        : 0.0);
      return r;
    };
    o.seed = uint64_t(seed);
    const rl::GrpoMetrics m = rl::grpo_step(session, engine, prompts, exact, o, step);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double eta = elapsed / double(step) * double(steps - step);
    log_info("grpo: step ", step, "/", steps, " reward ", m.reward_mean, " (groups with a reward ", m.groups_with_reward,
             ", zero variance ", m.groups_zero_variance, ") loss ", m.loss, " grad norm ", m.grad_norm, " | generate ",
             m.generate_s, " s, log-probs ", m.logprob_s, " s, update ", m.update_s, " s | ETA ", std::round(eta), " s");
    metrics << nlohmann::json{{"step", step},
                              {"reward_mean", m.reward_mean},
                              {"reward_std", m.reward_std},
                              {"reward_max", m.reward_max},
                              {"groups_with_reward", m.groups_with_reward},
                              {"groups_zero_variance", m.groups_zero_variance},
                              {"response_len_mean", m.response_len_mean},
                              {"response_len_max", m.response_len_max},
                              {"loss", m.loss},
                              {"grad_norm", m.grad_norm},
                              {"clip_low", m.clip_low},
                              {"clip_high", m.clip_high},
                              {"approx_kl", m.approx_kl},
                              {"logprob_diff_mean", m.logprob_diff_mean},
                              {"logprob_diff_max", m.logprob_diff_max},
                              {"importance_weight_mean", m.importance_weight_mean},
                              {"generate_s", m.generate_s},
                              {"logprob_s", m.logprob_s},
                              {"update_s", m.update_s},
                              {"weight_sync_s", m.weight_sync_s}}
                   .dump()
            << "\n"
            << std::flush;
  }
  const double after = exact_match(engine, eval, max_digits);
  const std::string dir = out_dir + "/checkpoint-" + std::to_string(steps);
  save_hf_checkpoint(dir, cfg, session.table(), session.model().params());
  log_info("grpo: saved ", dir);
  std::printf("grpo: exact-match %.1f%% -> %.1f%% on %lld held-out problems\n", before, after, (long long)eval_n);
  return 0;
}

}  // namespace mt
