// Reward shaping and batch filtering (shaping.h).
#include "rl/shaping.h"

#include "core/error.h"
#include "rl/advantages.h"

namespace mt::rl {

double soft_overlong_penalty(int64_t length, int64_t max_length, int64_t buffer, double factor) {
  if (buffer < 1 || buffer > max_length || length < 0 || factor < 0)
    MT_THROW("soft_overlong_penalty: length ", length, ", max length ", max_length, ", buffer ", buffer, ", factor ",
             factor, "; need 1 <= buffer <= max length, length >= 0, factor >= 0");
  const int64_t start = max_length - buffer;
  if (length <= start) return 0;
  if (length > max_length) return -factor;
  return double(start - length) / double(buffer) * factor;
}

std::vector<int64_t> informative_groups(std::span<const double> rewards, int64_t G) {
  const std::vector<bool> constant = constant_groups(rewards, G);
  std::vector<int64_t> keep;
  for (size_t g = 0; g < constant.size(); ++g)
    if (!constant[g]) keep.push_back(int64_t(g));
  return keep;
}

std::vector<double> token_rewards_with_kl(double outcome, std::span<const double> logp, std::span<const double> ref,
                                          double beta) {
  if (logp.size() != ref.size() || logp.empty())
    MT_THROW("token_rewards_with_kl: ", logp.size(), " log-probs and ", ref.size(),
             " reference log-probs; need the same non-zero count");
  std::vector<double> r(logp.size());
  for (size_t t = 0; t < logp.size(); ++t) r[t] = -beta * (logp[t] - ref[t]);
  r.back() += outcome;
  return r;
}

}  // namespace mt::rl
