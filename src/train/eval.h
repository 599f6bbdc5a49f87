// Held-out evaluation of the synthetic addition task: greedy decoding of each problem's answer
// from its prompt, scored by exact match. Decoding re-runs the forward over the whole prefix for
// each new token (no KV cache): prompts are a dozen tokens, so this is cheap and uses only the
// training forward, which is what we want to measure.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "data/synthetic.h"
#include "model/qwen3_moe.h"

namespace mt {

struct EvalResult {
  int64_t problems = 0;
  int64_t correct = 0;
  double exact_match() const { return problems ? 100.0 * double(correct) / double(problems) : 0.0; }
  std::vector<std::string> samples;  // a few "prompt -> generated (expected)" lines for the log
};

// Every rank of a sharded model must run the same number of forwards: `agree` turns this rank's
// "all sequences finished" into the value every rank shares (e.g. an all-reduce). Null: one process.
using AgreeFn = std::function<bool(bool)>;

// Greedy continuation of every prompt by up to max_new tokens; problems are batched by prompt length.
// Only ids below vocab_limit are chosen (0: the model's whole vocabulary): a model's vocabulary may be
// padded past its tokenizer's (the demo's 32 rows hold 22 tokens), and those rows are no tokens.
// Ties go to the lowest id.
std::vector<std::vector<int64_t>> greedy_generate(Qwen3MoeModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                                  int64_t max_new, int64_t eos_id, const AgreeFn& agree = {},
                                                  int64_t vocab_limit = 0);

// One evaluated problem for the log: "69+73= -> 241 (expected 241, ok)", the generated answer up to its
// <eos> (the tokens a batch generates after it are not part of the answer), or "(no <eos>)".
std::string describe_answer(const Problem& p, const std::vector<int64_t>& generated);
EvalResult evaluate_addition(Qwen3MoeModel& model, const std::vector<Problem>& problems, int max_digits,
                             const AgreeFn& agree = {});

}  // namespace mt
