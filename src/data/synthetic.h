// Built-in synthetic task: multi-digit addition, generated at run time and deterministic from a seed,
// so that `moetrain train` works with no data on disk and its loss curve is reproducible.
//
// A problem is "a+b=c" where a and b each have 1..max_digits digits (the digit count is drawn
// uniformly, then the number uniformly among numbers with that many digits; 1-digit numbers include 0).
// The answer c = a + b is written REVERSED, least-significant digit first: 123+989 -> "2111".
// A causal model then produces each answer digit after it has seen the digits it depends on
// (the aligned digits of a and b and the carry it just wrote), which makes addition learnable by a
// small model; written most-significant first, the first digit depends on every carry.
//
// Token layout of one problem: <bos> a + b = rev(c) <eos>. The prompt is <bos> a + b =; the
// answer is rev(c) <eos>.
//
// Held-out evaluation: for every a and every b / 10 one last digit of b, chosen by a hash of
// (a, b / 10), makes (a, b) an evaluation pair (1 pair in 10). A hash rather than a rule on digits:
// an earlier rule, (a * 1000003 + b) % 10 == 0, depended on the units digits only, so 10
// of the 100 units-digit combinations never occurred in training at the units position.
// Training never produces an evaluation pair (the sampler draws again), evaluation only produces
// evaluation pairs, so exact-match accuracy on the evaluation set measures generalisation, not
// memorisation. The evaluation set also uses a seed stream disjoint from training.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/batch.h"

namespace mt {

inline constexpr int kMaxAdditionDigits = 9;  // a + b stays far from int64 overflow; sequences stay short

struct Problem {
  int64_t a = 0, b = 0, c = 0;
  std::vector<int64_t> prompt_ids;  // <bos> a + b =
  std::string answer;               // digits of c, least-significant first
  std::vector<int64_t> answer_ids;  // answer digits, then <eos>
  std::string text() const;         // "a+b=" + answer, e.g. "123+989=2111"
};

// The pair belongs to the evaluation bucket (1 pair in 10; see above).
bool is_eval_pair(int64_t a, int64_t b);
Problem make_addition_problem(int64_t a, int64_t b);
// The longest problem and the longest answer (digits + <eos>) for numbers of up to max_digits digits.
int64_t max_problem_tokens(int max_digits);  // 3 * max_digits + 5
int64_t max_answer_tokens(int max_digits);   // max_digits + 2
// One random training problem (never an evaluation pair).
Problem sample_train_problem(Rng& rng, int max_digits);

// n distinct evaluation problems, deterministic from seed. There are exactly 10^(2*max_digits - 1)
// evaluation pairs; asking for more is an error.
std::vector<Problem> make_eval_problems(int64_t n, uint64_t seed, int max_digits = 3);
int64_t max_eval_problems(int max_digits);  // 10^(2*max_digits - 1)

// True when `generated` (the tokens the model produced after the prompt) holds the answer digits
// followed by <eos>. Tokens after the first <eos> are ignored; no <eos> at all is a wrong answer.
bool check_answer(const Problem& p, const std::vector<int64_t>& generated);

// Micro-batches of packed training problems. Each row of length S is filled with whole problems
// back to back; a problem that does not fit starts the next row, the tail is padded with <pad>.
// Labels equal input_ids on the answer tokens (answer digits and <eos>) and are -100 on the prompt
// tokens and the padding, so the loss covers only the answers. Problems in one row are not masked
// from each other (as in packed pretraining); <bos> separates them.
//
// Batch i is a pure function of (seed, i): resuming at step k or giving data-parallel rank r the
// batches r, r + world, ... needs no saved state beyond the index.
class SyntheticBatcher : public BatchSource {
 public:
  SyntheticBatcher(int64_t batch_size, int64_t seq_len, int max_digits = 3, uint64_t seed = 1234);

  Batch batch(int64_t index) const override;
  int64_t batch_size() const override { return B_; }
  int64_t seq_len() const override { return S_; }
  std::string describe() const override;
  int max_digits() const { return max_digits_; }

 private:
  int64_t B_, S_;
  int max_digits_;
  uint64_t seed_;
};

}  // namespace mt
