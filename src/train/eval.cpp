#include "train/eval.h"

#include <algorithm>
#include <map>
#include <string>

#include "data/char_tokenizer.h"

namespace mt {

std::vector<std::vector<int64_t>> greedy_generate(Qwen3MoeModel& model, const std::vector<std::vector<int64_t>>& prompts,
                                                  int64_t max_new, int64_t eos_id, const AgreeFn& agree,
                                                  int64_t vocab_limit) {
  std::vector<std::vector<int64_t>> out(prompts.size());
  std::map<size_t, std::vector<size_t>> by_len;
  for (size_t i = 0; i < prompts.size(); ++i) by_len[prompts[i].size()].push_back(i);
  const int64_t V = model.config().vocab_size;
  if (vocab_limit < 0 || vocab_limit > V)
    MT_THROW("greedy_generate: vocab_limit (", vocab_limit, ") must be in [0, ", V, "] (the model's vocabulary)");
  const int64_t choose = vocab_limit > 0 ? vocab_limit : V;
  for (const auto& [len, members] : by_len) {
    const int64_t B = int64_t(members.size());
    std::vector<std::vector<int64_t>> seqs;
    for (size_t i : members) seqs.push_back(prompts[i]);
    std::vector<bool> done(size_t(B), false);
    for (int64_t step = 0; step < max_new; ++step) {
      const int64_t S = int64_t(len) + step;
      Tensor ids = Tensor::empty({B, S}, DType::I64);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) ids.data<int64_t>()[b * S + s] = seqs[size_t(b)][size_t(s)];
      Tensor logits;
      model.forward(MicroBatch{ids, Tensor()}, &logits);
      Tensor host = logits.to(Device::CPU);
      bool all_done = true;
      for (int64_t b = 0; b < B; ++b) {
        const float* row = host.data<float>() + (b * S + S - 1) * V;
        int64_t best = 0;
        for (int64_t v = 1; v < choose; ++v)
          if (row[v] > row[best]) best = v;
        seqs[size_t(b)].push_back(best);
        if (best == eos_id) done[size_t(b)] = true;
        all_done = all_done && done[size_t(b)];
      }
      if (agree) all_done = agree(all_done);
      if (all_done) break;
    }
    for (int64_t b = 0; b < B; ++b)
      out[members[size_t(b)]].assign(seqs[size_t(b)].begin() + int64_t(len), seqs[size_t(b)].end());
  }
  return out;
}

std::string describe_answer(const Problem& p, const std::vector<int64_t>& generated) {
  static const CharTokenizer tok;
  auto eos = std::find(generated.begin(), generated.end(), tok.eos_id());
  const bool ok = check_answer(p, generated);
  return str(p.a, "+", p.b, "= -> ", tok.decode(std::vector<int64_t>(generated.begin(), eos), true),
             eos == generated.end() ? " (no <eos>)" : "", " (expected ", p.answer, ", ", ok ? "ok" : "wrong", ")");
}

EvalResult evaluate_addition(Qwen3MoeModel& model, const std::vector<Problem>& problems, int max_digits,
                             const AgreeFn& agree) {
  std::vector<std::vector<int64_t>> prompts;
  for (const Problem& p : problems) prompts.push_back(p.prompt_ids);
  CharTokenizer tok;
  auto gen = greedy_generate(model, prompts, max_answer_tokens(max_digits), tok.eos_id(), agree, tok.vocab_size());
  EvalResult r;
  r.problems = int64_t(problems.size());
  for (size_t i = 0; i < problems.size(); ++i) {
    bool ok = check_answer(problems[i], gen[i]);
    r.correct += ok ? 1 : 0;
    if (r.samples.size() < 3) r.samples.push_back(describe_answer(problems[i], gen[i]));
  }
  return r;
}

}  // namespace mt
