// A run directory's checkpoints, written and found one way by every command that trains (train, sft,
// grpo): what goes into RUN_DIR/checkpoint-N and in which order, the keep-last that follows, and where a
// resumed run starts, agreed by every rank. train/checkpoint.h has the directory's layout and the pieces
// used here (state shards, the manifest commit, retention, the search for the newest good checkpoint).
//
// save_checkpoint, called on every rank, writes checkpoint-N.tmp/ and commits it:
//   1. rank 0 creates checkpoint-N.tmp/ (removing the leftovers of a killed save); a barrier
//   2. the HF weights: config.json and the safetensors, gathered one parameter at a time and streamed by
//      rank 0 under FSDP, else written from the flat parameter buffer of the one process; a LoRA run's
//      instead: its adapters as a PEFT directory, adapter/ (the base is unchanged and stays where it is)
//   3. rank 0: router_bias.safetensors (when the model routes with a bias) and tokenizer.json (when given),
//      so that the directory is a complete model
//   4. MOETRAIN_DEBUG_SAVE_KILL=N kills the process here (debug_kill_while_saving)
//   5. each training state: every rank's shard, SUBDIR/train_state/rank-R.safetensors, and rank 0's
//      SUBDIR/train_state.json
//   6. a barrier (every shard is on disk); rank 0 writes the manifest, renames the directory to
//      checkpoint-N and applies keep_last (retain_checkpoints), logging each directory it removed or reduced
//   7. rank 0 logs "saved checkpoint DIR (HF weights + training state[ + SUBDIR], manifest) in T s"
// A process killed at any moment leaves either no checkpoint-N or a complete one.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/params.h"

namespace mt {

class DistContext;   // parallel/dist.h
class TrainSession;  // train/session.h

// The model a checkpoint holds as HF weights (config and table: the caller's, alive during the save).
struct CheckpointWeights {
  const ModelConfig* config = nullptr;  // the global config (config.json)
  const ParamTable* table = nullptr;    // the global parameter table
  // Under FSDP: each parameter's full values on the host, gathered (every rank calls it in table order;
  // rank 0 writes). Null: `flat` is the whole flat parameter buffer of one process.
  std::function<Tensor(const ParamEntry&)> gather;
  Tensor flat;
  Tensor router_bias;          // f32 [sparse layers, E], any device; undefined: the model routes without one
  std::string tokenizer_json;  // a tokenizer.json copied into the checkpoint; "": none
  // LoRA (model/lora.h): the adapters, written as adapter/ (a PEFT directory naming lora_base as its base) in
  // place of the HF weights and router bias, which are the frozen base's. Null: a full model.
  const LoraSpec* lora = nullptr;
  Tensor lora_flat;
  std::string lora_base;
};

// One training state of a checkpoint: this rank's shard of it and, from rank 0, its train_state.json.
struct CheckpointState {
  std::string subdir;  // "" for the checkpoint's own (train_state/ and train_state.json); "critic" for grpo's critic
  Tensor master, exp_avg, exp_avg_sq;  // this rank's f32 buffers, any device
  std::vector<FlatRange> pieces;       // the global flat ranges they hold (ParallelModel::pieces)
  nlohmann::ordered_json train_state;  // written as given (rank 0)
};

// A session's weights as a checkpoint holds them: its global config and table, gathered under FSDP, its
// routing bias when it has one; no tokenizer. A LoRA session's: its adapters (lora_base: the caller's).
CheckpointWeights checkpoint_weights(TrainSession& session);
// A session's training state: its master weights and AdamW moments with their flat ranges (a LoRA session's:
// its adapters', the whole adapter table on the one process).
CheckpointState checkpoint_state(TrainSession& session, std::string subdir, nlohmann::ordered_json train_state);

// A LoRA run's adapters as its train_state.json records them ("lora": rank, alpha, targets); the caller adds
// the base it ran on.
nlohmann::ordered_json lora_state_json(const LoraSpec& spec);
// A resume's training state into the session: its trainable values (the master weights, or a LoRA session's
// adapters) and AdamW moments from the checkpoint's shards, whatever layout wrote them, then the compute copy.
// `state` is the checkpoint's train_state.json: a LoRA checkpoint resumed without adapters, or the reverse, is
// an error that says which option to give (`log_prefix` starts it).
struct ReshardReport;  // train/checkpoint.h
ReshardReport restore_checkpoint_state(TrainSession& session, const std::string& ckpt_dir, const nlohmann::json& state,
                                       const std::string& log_prefix = "");

// Writes RUN_DIR/checkpoint-<step> (the file comment's steps) and returns its directory. `states` holds the
// checkpoint's own state first (subdir ""), then any others. Called on every rank of `dist` in the same
// order; `log_prefix` starts each log line ("grpo: "). Errors (a full disk, an unwritable directory) name the
// file and the system's reason; the earlier checkpoints are untouched.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const CheckpointWeights& weights,
                            const std::vector<CheckpointState>& states, int64_t keep_last, DistContext& dist,
                            const std::string& log_prefix = "");

// Where a run resumes: `spec` is "latest" (the newest checkpoint of run_dir whose manifest verifies and that
// holds a training state) or a checkpoint directory (find_resume_checkpoint). Rank 0 searches and logs each
// checkpoint it passes over ("resume: not using checkpoint-N: why"); every rank of `dist` takes its verdict
// (null: this process decides alone). Returns the checkpoint's directory, or "" when run_dir has none yet (a
// fresh run: logged). An error when there are checkpoints but none can be resumed from: rank 0's names each
// and why, the other ranks' point to rank 0's log. `log_prefix` starts the errors and the fresh-run line.
std::string resume_checkpoint(const std::string& run_dir, const std::string& spec, DistContext* dist,
                              const std::string& log_prefix = "");

}  // namespace mt
