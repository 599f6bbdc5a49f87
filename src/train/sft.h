// `moetrain sft --model DIR --data FILE.jsonl [--key value ...]`: supervised fine-tuning on chat data.
// The data's `messages` lines are rendered with the Qwen3 chat template, tokenized with the model
// directory's tokenizer.json, trained on the assistant turns only, and packed with document boundaries
// (data/documents.h, data/packing.h); the run is the trainer's (run_training: every parallel layout,
// metrics, checkpoints in HF format with the tokenizer beside them, so a checkpoint is itself a model
// directory that sft, generate or the next run can start from).
//
// --model is a Hugging Face model directory (its weights are loaded) or, for demonstrations, a preset
// name with --tokenizer: a fresh, randomly initialised model whose vocabulary is widened to hold the
// tokenizer's ids (its config.json and the tokenizer are written to <out_dir>/init-model first).
// Every other `moetrain train` key works (`moetrain sft --help` lists them with the SFT defaults).
#pragma once
#include <string>
#include <vector>

#include "train/train_config.h"
#include "train/trainer.h"

namespace mt {

// moetrain sft's options over `c` (sft_defaults()): train's (declare_train_command), with --model and
// --data required and --data a .jsonl file.
cli::Options sft_options(TrainConfig& c);
// The train config of an sft command line (parse_train_args over sft_options): SFT defaults (out_dir
// runs/sft, lr 2e-5, no addition eval, ...), then --config FILE, then the --key value arguments.
TrainConfig sft_config_from_args(const std::vector<std::string>& args);
// The SFT defaults (what `moetrain sft --help` shows).
TrainConfig sft_defaults();
// Resolves the model and the tokenizer (see the file comment); for a preset writes <out_dir>/init-model.
// Returns the config run_training gets.
TrainConfig prepare_sft(const TrainConfig& cfg);

}  // namespace mt
