// A run directory's checkpoints: the one writer of checkpoint-N and the resume point every rank agrees on
// (run_dir.h).
#include "train/run_dir.h"

#include <algorithm>
#include <filesystem>

#include "comm/communicator.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "io/manifest.h"
#include "model/hf_checkpoint.h"
#include "model/lora_peft.h"
#include "parallel/dist.h"
#include "parallel/fsdp.h"
#include "train/checkpoint.h"
#include "train/load_balance.h"
#include "train/session.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

void barrier(DistContext& dist) {
  if (dist.distributed()) dist.world()->barrier();
}

}  // namespace

CheckpointWeights checkpoint_weights(TrainSession& session) {
  CheckpointWeights w;
  w.config = &session.config();
  w.table = &session.table();
  if (LoraAdapters* l = session.lora()) {
    w.lora = &l->spec();
    w.lora_flat = l->params();
    return w;
  }
  if (session.fsdp())
    w.gather = [&session](const ParamEntry& e) { return session.parallel().gather_param_host(e, false); };
  else
    w.flat = session.model().params();
  if (session.model().router_bias().defined()) w.router_bias = session.model().router_bias();
  return w;
}

CheckpointState checkpoint_state(TrainSession& session, std::string subdir, nlohmann::ordered_json train_state) {
  AdamW& opt = session.optimizer();
  if (LoraAdapters* l = session.lora())
    return {std::move(subdir), l->params(), opt.exp_avg(), opt.exp_avg_sq(),
            {FlatRange{0, l->table().total(), 0}}, std::move(train_state)};
  return {std::move(subdir),
          session.master(),
          opt.exp_avg(),
          opt.exp_avg_sq(),
          session.parallel().pieces(session.table()),
          std::move(train_state)};
}

nlohmann::ordered_json lora_state_json(const LoraSpec& spec) {
  return {{"rank", spec.rank}, {"alpha", spec.effective_alpha()}, {"targets", lora_targets_text(spec)}};
}

ReshardReport restore_checkpoint_state(TrainSession& session, const std::string& ckpt_dir, const nlohmann::json& state,
                                       const std::string& log_prefix) {
  LoraAdapters* lora = session.lora();
  if (state.contains("lora") != (lora != nullptr))
    MT_THROW(log_prefix, "resume: ", ckpt_dir,
             lora ? " is not a LoRA run's checkpoint; drop --lora-rank to resume it"
                  : str(" holds LoRA adapters (rank ", state["lora"].value("rank", 0),
                        "); give --lora-rank and the run's other LoRA options to resume it"));
  AdamW& opt = session.optimizer();
  const CheckpointState mine = checkpoint_state(session, "", {});
  const ReshardReport rr =
      load_train_state_shards(ckpt_dir, lora ? lora->table().total() : session.table().total(), mine.pieces,
                              session.trainable_params(), opt.exp_avg(), opt.exp_avg_sq());
  if (!lora) session.refresh_compute_weights();
  return rr;
}

std::string save_checkpoint(const std::string& run_dir, int64_t step, const CheckpointWeights& weights,
                            const std::vector<CheckpointState>& states, int64_t keep_last, DistContext& dist,
                            const std::string& log_prefix) {
  MT_CHECK(weights.config && weights.table, "save_checkpoint: the weights need their config and parameter table");
  MT_CHECK(!states.empty() && states[0].subdir.empty(), "save_checkpoint: the first training state must be the ",
           "checkpoint's own (subdir \"\"), got ", states.empty() ? "none" : "'" + states[0].subdir + "'");
  const auto t = Clock::now();
  const bool lead = dist.rank() == 0;
  const std::string final_dir = checkpoint_dir(run_dir, step), dir = final_dir + ".tmp";
  if (lead) begin_checkpoint(dir);
  barrier(dist);  // the directory exists before any rank writes into it
  if (weights.lora) {
    if (lead)
      write_peft_adapter((fs::path(dir) / "adapter").string(), *weights.config, *weights.lora, weights.lora_flat,
                         weights.lora_base);
  } else if (weights.gather) {
    save_sharded_hf_checkpoint(dir, *weights.config, *weights.table, weights.gather, lead);
  } else {
    save_hf_checkpoint(dir, *weights.config, *weights.table, weights.flat);
  }
  // The bias the model routes with, learned or read (a checkpoint without it would route differently).
  if (lead && weights.router_bias.defined() && !weights.lora)
    save_router_bias(dir, *weights.config, weights.router_bias);
  if (lead && !weights.tokenizer_json.empty())  // a complete HF directory: the next run (sft, generate) reads it
    fs::copy_file(weights.tokenizer_json, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
  debug_kill_while_saving(step);
  std::string held;  // the states beside the checkpoint's own, for the log
  for (const CheckpointState& s : states) {
    const std::string sdir = s.subdir.empty() ? dir : (fs::path(dir) / s.subdir).string();
    save_train_state_shard(sdir, dist.rank(), s.master, s.exp_avg, s.exp_avg_sq, s.pieces);
    if (lead) write_file_atomic((fs::path(sdir) / kTrainStateFile).string(), s.train_state.dump(2) + "\n");
    if (!s.subdir.empty()) held += " + " + s.subdir;
  }
  barrier(dist);  // every shard is on disk
  if (lead) {
    commit_checkpoint(dir, final_dir);
    for (const std::string& r : retain_checkpoints(run_dir, keep_last)) log_info(log_prefix, r);
    log_info(log_prefix, "saved checkpoint ", final_dir, weights.lora ? " (LoRA adapters" : " (HF weights",
             " + training state", held, ", manifest) in ", seconds_since(t), " s");
  }
  return final_dir;
}

std::string resume_checkpoint(const std::string& run_dir, const std::string& spec, DistContext* dist,
                              const std::string& log_prefix) {
  const bool lead = !dist || dist->rank() == 0;
  ResumePoint rp;
  if (lead) {
    rp = find_resume_checkpoint(run_dir, spec);
    for (const std::string& r : rp.rejected) log_info("resume: not using ", r);
  }
  // Rank 0's verdict: the step found, -1 (no checkpoint at all) or -2 (none usable).
  const double mine = !rp.dir.empty() ? double(std::max<int64_t>(rp.step, 0)) : rp.rejected.empty() ? -1.0 : -2.0;
  const int64_t found =
      int64_t(dist && dist->distributed() ? comm::all_gather_doubles(*dist->world(), {mine})[0] : mine);
  if (found == -2) {
    if (!lead) MT_THROW(log_prefix, "resume: no usable checkpoint in ", run_dir, " (rank 0 logs why)");
    std::string all;
    for (const std::string& r : rp.rejected) all += "; " + r;
    MT_THROW(log_prefix, "resume: no checkpoint in ", run_dir, " can be resumed from", all,
             " (remove them or drop --resume to start over)");
  }
  if (found >= 0) return lead ? rp.dir : spec == "latest" ? checkpoint_dir(run_dir, found) : spec;
  if (lead) log_info(log_prefix, "resume: no checkpoint in ", run_dir, " yet; starting from step 0");
  return "";
}

}  // namespace mt
