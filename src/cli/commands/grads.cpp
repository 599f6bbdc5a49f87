// moetrain grads --model DIR --batch FILE --out FILE [options]: one forward and backward of a Hugging Face
// model on one batch (train/grads.h says what it writes); rank 0 prints one summary line.
#include "rl/grads.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common_options.h"
#include "comm/dist_env.h"
#include "core/error.h"
#include "core/options.h"

namespace mt {

int grads_main(const std::vector<std::string>& args) {
  GradsOptions g;
  std::string recompute = recompute_name(g.recompute);
  std::string kl = g.policy.kl == rl::KlEstimator::K1 ? "k1" : g.policy.kl == rl::KlEstimator::K2 ? "k2" : "k3";
  cli::Options opt("grads", "--model DIR --batch FILE.safetensors --out FILE.safetensors [options]",
                   "Forward and backward of a Hugging Face model on one batch (input_ids, labels: i64 [B, T]) in "
                   "fp32;\nwrites loss, aux_loss, logits (log-probs under --objective) and every gradient. Under "
                   "moetrain launch the\nbatch is split over the ranks and rank 0 writes what one process would.");
  opt.group("input and output");
  opt.add("model", &g.model_dir, "the Hugging Face model directory").var("DIR").required();
  opt.add("batch", &g.batch_path, "input_ids and labels (and the policy loss's tensors under --objective)")
      .var("FILE.safetensors")
      .required();
  opt.add("out", &g.out_path, "loss, aux_loss, logits or logprobs, grad.<name>").var("FILE.safetensors").required();
  opt.group("model");
  opt.add("recompute", &recompute, "activation recomputation in the backward")
      .one_of({"none", "full", "selective", "moe"});
  opt.add("score-before-experts", &g.score_before_experts,
          "confirm that the model's config.json scores before the experts (it cannot change the model)");
  opt.add("temperature", &g.temperature, "every head sees logits / T (as the RL update at its sampling temperature)")
      .above(0);
  opt.group("RL policy loss (instead of cross-entropy)");
  opt.add("objective", &g.objective,
          "the policy loss; the batch then also holds advantages, old_logprobs, token_weights (and ref_logprobs)")
      .one_of({"ppo", "gspo", "pg"});
  opt.add("clip-low", &g.policy.clip_low, "the ratio's lower clip, 1 - eps").at_least(0).below(1);
  opt.add("clip-high", &g.policy.clip_high, "the ratio's upper clip, 1 + eps").at_least(0);
  opt.add("dual-clip", &g.policy.dual_clip, "dual clip c > 1 for negative advantages").at_least(0).says("0: off");
  opt.add("kl-coef", &g.policy.kl_coef, "KL-to-reference loss weight (needs ref_logprobs)").at_least(0);
  opt.add("kl", &kl, "the KL estimator").one_of({"k1", "k2", "k3"});
  opt.add("entropy-coef", &g.policy.entropy_coef, "entropy bonus weight");
  cli::add_mesh_options(opt, g.mesh, {.etp = true});
  opt.rule([&] {
    if (!g.objective.empty()) return;
    for (const char* f : {"clip-low", "clip-high", "dual-clip", "kl-coef", "kl", "entropy-coef"})
      if (opt.given(f))
        MT_THROW("grads: --", f,
                 " sets the RL policy loss; it needs --objective ppo|gspo|pg (without it the gradients are "
                 "cross-entropy's)");
  });
  if (!opt.parse(args)) {
    std::printf("%s", opt.help().c_str());
    return 0;
  }
  opt.check();
  g.recompute = parse_recompute(recompute);
  if (!g.objective.empty()) g.policy.kind = rl::parse_policy_loss(g.objective);
  g.policy.kl = rl::parse_kl_estimator(kl);

  const GradsResult r = run_grads(g);
  if (comm::detect_dist_env().rank != 0) return 0;  // rank 0 reports
  std::printf("grads: loss %.8f aux_loss %.8f over %lld target tokens -> %s\n", r.loss, r.aux_loss,
              (long long)r.n_valid, g.out_path.c_str());
  return 0;
}

}  // namespace mt
