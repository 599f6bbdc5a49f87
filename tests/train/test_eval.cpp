// Held-out evaluation of the synthetic task: greedy decoding chooses only ids the tokenizer has.
#include <gtest/gtest.h>

#include "data/char_tokenizer.h"
#include "data/synthetic.h"
#include "model/params.h"
#include "train/eval.h"

using namespace mt;

namespace {

// A demo model whose logits put ids 30 or 31 (padding rows past the tokenizer's 22 tokens) first at
// every position and tie all other ids at 0: the final norm keeps only dimension 0 of h, and only
// lm_head rows 30 (+) and 31 (-) read it.
void prefer_padding_ids(Qwen3MoeModel& m) {
  const ModelConfig& c = m.config();
  const ParamTable& t = m.table();
  init_weights(c, t, m.params(), 3);
  Tensor& p = m.params();
  const ParamEntry& norm = t.at("model.norm.weight");
  const ParamEntry& head = t.at("lm_head.weight");
  for (int64_t i = 0; i < norm.numel; ++i) p.data<float>()[norm.offset + i] = i == 0 ? 1.0f : 0.0f;
  for (int64_t i = 0; i < head.numel; ++i) p.data<float>()[head.offset + i] = 0.0f;
  const int64_t D = c.hidden_size;
  p.data<float>()[head.offset + 30 * D] = 100.0f;
  p.data<float>()[head.offset + 31 * D] = -100.0f;
}

}  // namespace

TEST(Eval, GreedyDecodingChoosesOnlyTheTokenizersIds) {
  Qwen3MoeModel m(preset_model_config("demo"));
  prefer_padding_ids(m);
  const CharTokenizer tok;
  const std::vector<Problem> problems = make_eval_problems(8, 5, 3);
  std::vector<std::vector<int64_t>> prompts;
  for (const Problem& p : problems) prompts.push_back(p.prompt_ids);
  // Unrestricted, the model's favourites are the padding rows: the test's premise.
  for (const auto& g : greedy_generate(m, prompts, 3, tok.eos_id()))
    for (int64_t id : g) ASSERT_GE(id, 30);
  for (const auto& g : greedy_generate(m, prompts, 3, tok.eos_id(), {}, tok.vocab_size()))
    for (int64_t id : g) EXPECT_EQ(id, 0) << "ties among the allowed ids go to the lowest";
  // The evaluation scores such a model 0% instead of failing on an id it cannot decode.
  const EvalResult r = evaluate_addition(m, problems, 3);
  EXPECT_EQ(r.problems, 8);
  EXPECT_EQ(r.correct, 0);
  EXPECT_EQ(r.samples.size(), 3u);
}

// What the log shows of an answer stops at its <eos>: batched decoding goes on after it, and the run
// printed "491+94= -> 5857 (expected 585, ok)" for a correct answer.
TEST(Eval, SampleLineShowsTheAnswerUpToItsEos) {
  const CharTokenizer tok;
  const Problem p = make_addition_problem(491, 94);  // 585, reversed "585"
  std::vector<int64_t> gen = tok.encode("585");
  gen.push_back(tok.eos_id());
  for (int64_t id : tok.encode("7")) gen.push_back(id);
  EXPECT_EQ(describe_answer(p, gen), "491+94= -> 585 (expected 585, ok)");
  EXPECT_EQ(describe_answer(p, tok.encode("5857")), "491+94= -> 5857 (no <eos>) (expected 585, wrong)");
}

TEST(Eval, VocabLimitOutsideTheModelsVocabularyIsAnError) {
  Qwen3MoeModel m(preset_model_config("demo"));
  prefer_padding_ids(m);
  try {
    greedy_generate(m, {{1, 4}}, 1, 2, {}, 33);
    FAIL() << "vocab_limit 33 accepted for a vocabulary of 32";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_limit (33) must be in [0, 32]"), std::string::npos) << e.what();
  }
}
