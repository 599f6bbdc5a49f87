// Synthetic addition task (see synthetic.h for the format and the evaluation split).
#include "data/synthetic.h"

#include <algorithm>
#include <set>
#include <utility>

#include "core/error.h"
#include "core/rng.h"
#include "data/char_tokenizer.h"

namespace mt {

namespace {

// Salts that separate the training and evaluation seed streams.
constexpr uint64_t kTrainSalt = 0x7472616e5f616464ull;
constexpr uint64_t kEvalSalt = 0x6576616c5f616464ull;
constexpr uint64_t kSplitSalt = 0x73706c69745f6576ull;

int64_t pow10(int k) {
  int64_t p = 1;
  for (int i = 0; i < k; ++i) p *= 10;
  return p;
}

void check_digits(int max_digits) {
  if (max_digits < 1 || max_digits > kMaxAdditionDigits)
    MT_THROW("synthetic addition: max_digits = ", max_digits, " is not allowed; use 1..", kMaxAdditionDigits);
}

// A number with a uniformly drawn digit count in 1..max_digits, uniform among those numbers.
int64_t sample_operand(Rng& rng, int max_digits) {
  int k = int(rng.randint(1, max_digits + 1));
  int64_t lo = k == 1 ? 0 : pow10(k - 1);
  return rng.randint(lo, pow10(k));
}

}  // namespace

std::string Problem::text() const {
  return str(a, "+", b, "=", answer);
}

namespace {
// The last digit of b that is held out for the pair's other digits (a, b / 10): a hash, so every
// combination of units digits (and of any other digit position) occurs in training for most a.
int64_t held_out_last_digit(int64_t a, int64_t b_high) {
  return int64_t(mix64(mix64(uint64_t(a) ^ kSplitSalt) + uint64_t(b_high)) % 10);
}
}  // namespace

bool is_eval_pair(int64_t a, int64_t b) {
  return b % 10 == held_out_last_digit(a, b / 10);
}

Problem make_addition_problem(int64_t a, int64_t b) {
  MT_CHECK(a >= 0 && b >= 0, "addition operands must be non-negative: ", a, ", ", b);
  static const CharTokenizer tok;
  Problem p;
  p.a = a;
  p.b = b;
  p.c = a + b;
  p.answer = std::to_string(p.c);
  std::reverse(p.answer.begin(), p.answer.end());
  p.prompt_ids.push_back(tok.bos_id());
  for (int64_t id : tok.encode(str(a, "+", b, "="))) p.prompt_ids.push_back(id);
  p.answer_ids = tok.encode(p.answer);
  p.answer_ids.push_back(tok.eos_id());
  return p;
}

int64_t max_problem_tokens(int max_digits) {
  return 3 * int64_t(max_digits) + 5;
}
int64_t max_answer_tokens(int max_digits) {
  return int64_t(max_digits) + 2;
}

Problem sample_train_problem(Rng& rng, int max_digits) {
  check_digits(max_digits);
  for (;;) {
    int64_t a = sample_operand(rng, max_digits), b = sample_operand(rng, max_digits);
    if (!is_eval_pair(a, b)) return make_addition_problem(a, b);
  }
}

int64_t max_eval_problems(int max_digits) {
  check_digits(max_digits);
  // For M = 10^d, every (a, b / 10) has exactly one held-out last digit of b.
  int64_t m = pow10(max_digits);
  return m * (m / 10);
}

std::vector<Problem> make_eval_problems(int64_t n, uint64_t seed, int max_digits) {
  int64_t m = pow10(max_digits), available = max_eval_problems(max_digits);
  if (n < 0 || n > available)
    MT_THROW("synthetic addition: eval_problems = ", n, " is not allowed for max_digits = ", max_digits, "; use 0..",
             available, " (the number of distinct evaluation pairs)");
  Rng rng(mix64(seed ^ kEvalSalt));
  std::set<std::pair<int64_t, int64_t>> seen;
  std::vector<Problem> out;
  out.reserve(size_t(n));
  // Rejection sampling keeps the training distribution of digit counts. The small digit-count
  // classes run out first when n is close to `available`, so fall back to a uniform draw over all
  // evaluation pairs after a while; that always finishes.
  int64_t tries = 0, budget = 64 * n + 4096;
  while (int64_t(out.size()) < n) {
    int64_t a, b;
    if (tries++ < budget) {
      a = sample_operand(rng, max_digits);
      b = sample_operand(rng, max_digits);
      if (!is_eval_pair(a, b)) continue;
    } else {
      a = rng.randint(0, m);
      int64_t b_high = rng.randint(0, m / 10);
      b = b_high * 10 + held_out_last_digit(a, b_high);
    }
    if (seen.insert({a, b}).second) out.push_back(make_addition_problem(a, b));
  }
  return out;
}

bool check_answer(const Problem& p, const std::vector<int64_t>& generated) {
  auto eos = std::find(generated.begin(), generated.end(), CharTokenizer::kEos);
  if (eos == generated.end()) return false;
  // answer_ids ends with <eos>; compare the digits before it.
  return std::equal(generated.begin(), eos, p.answer_ids.begin(), p.answer_ids.end() - 1);
}

SyntheticBatcher::SyntheticBatcher(int64_t batch_size, int64_t seq_len, int max_digits, uint64_t seed)
    : B_(batch_size), S_(seq_len), max_digits_(max_digits), seed_(seed) {
  check_digits(max_digits);
  if (batch_size < 1) MT_THROW("synthetic addition: micro_batch_size = ", batch_size, " must be >= 1");
  if (seq_len < max_problem_tokens(max_digits))
    MT_THROW("synthetic addition: seq_len = ", seq_len, " cannot hold a problem of max_digits = ", max_digits,
             " (up to ", max_problem_tokens(max_digits), " tokens); use seq_len >= ", max_problem_tokens(max_digits),
             " or fewer digits");
}

std::string SyntheticBatcher::describe() const {
  return str("synthetic addition (1..", max_digits_, " digits, reversed answers), ", B_, " x ", S_,
             " tokens per micro-batch, seed ", seed_);
}

Batch SyntheticBatcher::batch(int64_t index) const {
  MT_CHECK(index >= 0, "batch index must be >= 0, got ", index);
  Rng rng(mix64(mix64(seed_ ^ kTrainSalt) + uint64_t(index)));
  Batch out{Tensor::empty({B_, S_}, DType::I64), Tensor::empty({B_, S_}, DType::I64), Tensor()};
  int64_t* ids = out.input_ids.data<int64_t>();
  int64_t* labels = out.labels.data<int64_t>();
  Problem p = sample_train_problem(rng, max_digits_);
  for (int64_t r = 0; r < B_; ++r) {
    int64_t s = 0;
    for (;;) {
      int64_t len = int64_t(p.prompt_ids.size() + p.answer_ids.size());
      if (s + len > S_) break;  // starts the next row (or is dropped after the last row)
      for (int64_t id : p.prompt_ids) {
        ids[r * S_ + s] = id;
        labels[r * S_ + s++] = kIgnoreIndex;
      }
      for (int64_t id : p.answer_ids) {
        ids[r * S_ + s] = id;
        labels[r * S_ + s++] = id;
      }
      p = sample_train_problem(rng, max_digits_);
    }
    for (; s < S_; ++s) {
      ids[r * S_ + s] = CharTokenizer::kPad;
      labels[r * S_ + s] = kIgnoreIndex;
    }
  }
  return out;
}

}  // namespace mt
