// The numerics tool behind `moetrain grads`: reads a Hugging Face model directory and a batch (input_ids, labels: i64
// [B, T], HF semantics), runs forward and backward in fp32 and writes loss, aux_loss, logits (logprobs under
// --objective) and grad.<name> for every parameter, named as in the model's files.
#pragma once
#include <string>

#include "model/qwen3_moe.h"
#include "parallel/mesh.h"
#include "rl/policy_loss.h"

namespace mt {

struct GradsOptions {
  std::string model_dir;
  std::string batch_path;
  std::string out_path;
  Recompute recompute = Recompute::None;
  // --score-before-experts: a check that the model directory's config.json says so (ModelConfig::
  // score_before_experts, its moetrain_score_before_experts); it cannot change the model.
  bool score_before_experts = false;
  // Parallel layout when started by `moetrain launch` (world size > 1): the batch rows are split over
  // the data-parallel ranks, the parameters FSDP-sharded; rank 0 writes the gathered result, which
  // means the same as the single-process output. etp is 1 or tp (experts' F split over the tp ranks).
  MeshSpec mesh{};
  // --objective ppo|gspo|pg: an RL policy loss (rl/policy_loss.h) instead of cross-entropy. The batch
  // file then also holds f32 [B, T] tensors aligned with labels: advantages, old_logprobs,
  // token_weights and (with a KL term) ref_logprobs; each batch row is one sample. The output has loss
  // (the objective, + aux), the gradients and, instead of the logits, `logprobs`: f32 [B, T] aligned with
  // labels, log p(label) under logits / temperature where the label is not -100, else 0.
  std::string objective;
  rl::PolicyLossConfig policy;
  // --temperature T: every head sees logits / T (PassOptions::temperature), as the RL update's trainer does
  // at the sampling temperature.
  double temperature = 1.0;
};

// Loss definition (as transformers): mean token cross-entropy over labels != -100 after the
// shift, plus router_aux_loss_coef * aux when the config enables router logits.
struct GradsResult {
  double loss = 0, aux_loss = 0;
  int64_t n_valid = 0;
};

GradsResult run_grads(const GradsOptions& opt);

}  // namespace mt
