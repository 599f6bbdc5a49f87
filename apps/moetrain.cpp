// The `moetrain` command. `moetrain train` with no arguments trains the demo model on the built-in
// synthetic addition task; `moetrain grads` is the numerics tool. Errors print one line and exit 1.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"

static const char* kUsage =
    "usage: moetrain <command> [options]\n"
    "commands:\n"
    "  train   [--config FILE.json] [--key value ...]   train a model (default: the demo model on synthetic addition)\n"
    "  sft     --model DIR --data FILE.jsonl [--key value ...]   fine-tune a HF model on chat data (see sft --help)\n"
    "  grads   --model DIR --batch FILE --out FILE [--recompute none|full|selective|moe] [--score-before-experts]\n"
    "          [--dp-shard N --dp-replicate N --ep N --tp N --etp 1|N] (under launch: the batch split over the ranks)\n"
    "          forward + backward of a Hugging Face model on one batch; writes loss, logits and every gradient\n"
    "          (--score-before-experts only confirms a model whose config.json says it: docs/model.md)\n"
    "  generate --model DIR --prompts FILE.jsonl --out FILE.jsonl [--max-new-tokens N] [--temperature T] [--n N] ...\n"
    "          sample from a Hugging Face model with the rollout engine (paged KV cache; see generate --help)\n"
    "  grpo [--model DIR] [--steps N] [--n G] [--max-digits D] ...\n"
    "          GRPO on the built-in addition task from the demo checkpoint (see grpo --help; under launch: --dp-shard, "
    "--ep, --tp)\n"
    "  convert --from RUN_DIR/checkpoint-N --to DIR [--dtype bf16|f32] [--max-shard-size SIZE] [--tokenizer PATH]\n"
    "          export a checkpoint as a Hugging Face model directory (config, generation config, shards, tokenizer)\n"
    "  plot    RUN_DIR [--out FILE.svg]   draw a run's metrics.jsonl (loss, reward, throughput, ...) as an SVG\n"
    "  tokenize --tokenizer tokenizer.json [--jsonl] [--decode] [--chat] [--bench]\n"
    "          encode stdin lines to ids, decode ids, render Qwen3 chat messages, or time the tokenizer\n"
    "  launch  --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] -- <command> [args]\n"
    "          start the ranks of a command on this node and supervise them (like torchrun; see launch --help)\n"
    "  help    this text; `moetrain train --help` lists every training option\n";

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string cmd = args.empty() ? "help" : args[0];
  std::vector<std::string> rest(args.begin() + (args.empty() ? 0 : 1), args.end());
  try {
    if (cmd == "train") return mt::train_main(rest);
    if (cmd == "grads") return mt::grads_main(rest);
    if (cmd == "sft") return mt::sft_main(rest);
    if (cmd == "generate") return mt::generate_main(rest);
    if (cmd == "grpo") return mt::grpo_main(rest);
    if (cmd == "tokenize") return mt::tokenize_main(rest);
    if (cmd == "plot") return mt::plot_main(rest);
    if (cmd == "convert") return mt::convert_main(rest);
    if (cmd == "launch") return mt::launch_main(rest);
    if (cmd == "_selftest") return mt::selftest_main(rest);  // hidden: comm, dist, rl (the tests run them)
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "moetrain: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    // A message that starts with the command's name already says whose it is.
    std::string msg = e.what();
    if (msg.rfind(cmd + ": ", 0) == 0) msg = msg.substr(cmd.size() + 2);
    std::fprintf(stderr, "moetrain %s: error: %s\n", cmd.c_str(), msg.c_str());
    return 1;
  }
}
