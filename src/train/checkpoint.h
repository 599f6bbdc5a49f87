// Training checkpoints that a run can continue from exactly, whatever layout it resumes under: the pieces
// (the shards of a training state, the commit, retention, the search for the newest good checkpoint).
// train/run_dir.h puts them together: the one writer of checkpoint-N and the resume point every rank takes.
//
// RUN_DIR/checkpoint-N/ holds
//   config.json, model*.safetensors (+ index), router_bias.safetensors, tokenizer.json   the HF weights,
//       as before: transformers and --init-from read the directory as it is
//   train_state.json                 step, optimizer and skipped steps, data position, the LR schedule,
//                                    the run's config and the layout it was saved under
//   train_state/rank-R.safetensors   rank R's f32 master shard, AdamW moments (exp_avg, exp_avg_sq) and
//                                    "pieces" (i64 [n, 3]: global flat begin, end, offset in the shard)
//   manifest.json                    every other file with its size and CRC32C, written last
// An older checkpoint may be reduced to its weights (retain_checkpoints): train_state.json and every
// subdirectory but adapter/ (a LoRA run's weights) go, the top-level files (the HF model) stay, and the manifest is rewritten to list what
// is left and say "weights_only": true, so that it still verifies and a resume names why it is skipped.
// A checkpoint is written into checkpoint-N.tmp/ and renamed to checkpoint-N once its manifest is on
// disk (io/manifest.h), so a run killed while saving leaves no directory that looks complete; a
// checkpoint-N without a manifest that verifies is not used.
//
// Resharding: the shards carry the global flat ranges they hold, so a rank of any later layout (other
// dp_shard, ep, tp, or one process) fills its own pieces from whichever saved shards cover them.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/params.h"

namespace mt {

inline constexpr const char* kTrainStateFile = "train_state.json";
inline constexpr const char* kTrainStateDir = "train_state";

// RUN_DIR/checkpoint-N and its temporary twin checkpoint-N.tmp.
std::string checkpoint_dir(const std::string& run_dir, int64_t step);

// Removes a stale `tmp_dir` (a save that was killed) and creates it empty. Errors name the path.
void begin_checkpoint(const std::string& tmp_dir);
// Writes this rank's shard of the training state into tmp_dir/train_state/rank-R.safetensors.
// master, exp_avg, exp_avg_sq: the rank's local f32 buffers (any device); pieces: the global flat ranges
// they hold (ParallelModel::pieces).
void save_train_state_shard(const std::string& tmp_dir, int rank, const Tensor& master, const Tensor& exp_avg,
                            const Tensor& exp_avg_sq, const std::vector<FlatRange>& pieces);
// Writes the manifest of tmp_dir, renames it to final_dir (an existing final_dir, say from an earlier
// run in the same directory, is replaced only after the new one is complete) and syncs the parent.
void commit_checkpoint(const std::string& tmp_dir, const std::string& final_dir);

struct ReshardReport {
  int shards = 0;            // saved ranks
  int64_t elements = 0;      // elements filled on this rank
  std::string saved_layout;  // as train_state.json records it
};
// Fills this rank's local buffers (f32, any device; elements outside `pieces` are left as they are) from
// the shards in ckpt_dir, whatever layout wrote them. An element of `pieces` that no shard holds, or a
// flat size that differs from table_total, is an error naming the checkpoint and the range.
ReshardReport load_train_state_shards(const std::string& ckpt_dir, int64_t table_total,
                                      const std::vector<FlatRange>& pieces, Tensor& master, Tensor& exp_avg,
                                      Tensor& exp_avg_sq);

// Steps of the RUN_DIR/checkpoint-N directories (not the .tmp ones), newest first.
std::vector<int64_t> list_checkpoints(const std::string& run_dir);

struct ResumePoint {
  std::string dir;  // "" when there is nothing to resume from
  int64_t step = 0;
  std::vector<std::string> rejected;  // "checkpoint-N: why" for each newer checkpoint that was not usable
};
// The newest checkpoint of run_dir whose manifest verifies (sizes and CRC32C) and that holds a training
// state (a weights-only one is skipped: rejected says so). `spec` is "latest" (search run_dir) or a
// checkpoint directory (verified the same way; an error when it does not verify, and for a weights-only
// one an error that names the newest checkpoint beside it that can be resumed from, and --init-from).
ResumePoint find_resume_checkpoint(const std::string& run_dir, const std::string& spec);

// Deletes all but the newest keep_last complete checkpoints of run_dir (keep_last <= 0: keeps all) and
// leftover checkpoint-N.tmp directories of other steps. Returns the directories removed.
std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep_last);

// What a run keeps after a new checkpoint committed (rank 0 only; save_checkpoint's keep_last, train/run_dir.h):
//   keep_last > 0:  prune_checkpoints: the newest keep_last complete checkpoints stay whole, the older ones
//                   (and leftover .tmp directories) are deleted;
//   keep_last <= 0: every checkpoint stays, but only the newest keep_full complete ones with their training
//                   state: each older complete one is reduced to its weights (reduce_to_weights), what
//                   `convert` and `generate --model` read (a training state is 12 of a checkpoint's 16
//                   bytes per parameter). Incomplete ones are left as they are.
// Returns one line per directory it touched, for the log: "removed DIR" or "reduced DIR to its weights
// (training state dropped)". Errors name the directory and the system's reason.
std::vector<std::string> retain_checkpoints(const std::string& run_dir, int64_t keep_last, int64_t keep_full = 2);

// Drops a committed checkpoint's training state: rewrites its manifest (crash-safe: written before any
// file goes) without train_state.json and the subdirectories' files and with "weights_only": true, then
// deletes them. A checkpoint already reduced has its leftovers deleted; nothing else changes.
void reduce_to_weights(const std::string& ckpt_dir);
// Whether the manifest of ckpt_dir marks it as reduced to its weights.
bool is_weights_only(const std::string& ckpt_dir);

// train_state.json of a checkpoint (an error naming the file when it is missing or not JSON).
nlohmann::json read_train_state(const std::string& ckpt_dir);

// Test hook: MOETRAIN_DEBUG_SAVE_KILL=STEP makes the process kill itself (SIGKILL) while writing
// checkpoint STEP, after its HF weights and before its training state and manifest.
void debug_kill_while_saving(int64_t step);

}  // namespace mt
