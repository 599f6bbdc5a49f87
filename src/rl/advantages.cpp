// Advantage estimators (advantages.h); fp64 throughout.
#include "rl/advantages.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mt::rl {

namespace {

void check_groups(std::span<const double> r, int64_t G, const char* what) {
  if (G < 2) MT_THROW(what, ": group size ", G, " < 2; a group baseline needs at least two samples per prompt (--n)");
  if (r.empty() || int64_t(r.size()) % G != 0)
    MT_THROW(what, ": ", r.size(), " rewards are not a whole number of groups of ", G);
  for (size_t i = 0; i < r.size(); ++i)
    if (!std::isfinite(r[i])) MT_THROW(what, ": reward ", i, " is ", r[i], "; rewards must be finite");
}

double mean(std::span<const double> x) {
  double s = 0;
  for (double v : x) s += v;
  return s / double(x.size());
}

double unbiased_std(std::span<const double> x, double m) {
  double s = 0;
  for (double v : x) s += (v - m) * (v - m);
  return std::sqrt(s / double(x.size() - 1));
}

}  // namespace

std::vector<double> grpo_advantages(std::span<const double> rewards, int64_t G, bool normalize_std, double eps) {
  check_groups(rewards, G, "grpo_advantages");
  std::vector<double> a(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += size_t(G)) {
    const std::span<const double> grp = rewards.subspan(g, size_t(G));
    const double m = mean(grp), s = normalize_std ? unbiased_std(grp, m) + eps : 1.0;
    for (int64_t i = 0; i < G; ++i) a[g + size_t(i)] = (grp[size_t(i)] - m) / s;
  }
  return a;
}

namespace {
// The step rewards of a group pooled, checked.
void check_step_groups(const std::vector<std::vector<double>>& r, int64_t G, const char* what) {
  if (G < 2) MT_THROW(what, ": group size ", G, " < 2; a group baseline needs at least two samples per prompt (--n)");
  if (r.empty() || int64_t(r.size()) % G != 0)
    MT_THROW(what, ": ", r.size(), " samples are not a whole number of groups of ", G);
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i].empty()) MT_THROW(what, ": sample ", i, " has no step reward; each needs one per step");
    for (size_t t = 0; t < r[i].size(); ++t)
      if (!std::isfinite(r[i][t])) MT_THROW(what, ": step ", t, " of sample ", i, " has reward ", r[i][t]);
  }
}
}  // namespace

std::vector<std::vector<double>> process_advantages(const std::vector<std::vector<double>>& r, int64_t G,
                                                    bool normalize_std, double eps) {
  check_step_groups(r, G, "process_advantages");
  std::vector<std::vector<double>> a(r.size());
  for (size_t g = 0; g < r.size(); g += size_t(G)) {
    std::vector<double> pooled;
    for (size_t i = g; i < g + size_t(G); ++i) pooled.insert(pooled.end(), r[i].begin(), r[i].end());
    const double m = mean(pooled), s = normalize_std && pooled.size() > 1 ? unbiased_std(pooled, m) + eps : 1.0;
    for (size_t i = g; i < g + size_t(G); ++i) {
      a[i].assign(r[i].size(), 0.0);
      double later = 0;
      for (size_t t = r[i].size(); t-- > 0;) {
        later += (r[i][t] - m) / s;
        a[i][t] = later;
      }
    }
  }
  return a;
}

std::vector<std::vector<double>> turn_advantages(const std::vector<std::vector<double>>& r, int64_t G,
                                                 bool normalize_std, double eps, bool by_turn) {
  check_step_groups(r, G, "turn_advantages");
  std::vector<std::vector<double>> ret(r.size()), a(r.size());
  for (size_t i = 0; i < r.size(); ++i) {
    ret[i].assign(r[i].size(), 0.0);
    double later = 0;
    for (size_t k = r[i].size(); k-- > 0;) ret[i][k] = later += r[i][k];
  }
  if (by_turn) return position_advantages(ret, G, normalize_std, eps);
  for (size_t g = 0; g < r.size(); g += size_t(G)) {
    std::vector<double> pooled;
    for (size_t i = g; i < g + size_t(G); ++i) pooled.insert(pooled.end(), ret[i].begin(), ret[i].end());
    const double m = mean(pooled), s = normalize_std && pooled.size() > 1 ? unbiased_std(pooled, m) + eps : 1.0;
    for (size_t i = g; i < g + size_t(G); ++i)
      for (double v : ret[i]) a[i].push_back((v - m) / s);
  }
  return a;
}

std::vector<std::vector<double>> position_advantages(const std::vector<std::vector<double>>& r, int64_t G,
                                                     bool normalize_std, double eps) {
  check_step_groups(r, G, "position_advantages");
  std::vector<std::vector<double>> a(r.size());
  for (size_t g = 0; g < r.size(); g += size_t(G)) {
    size_t longest = 0;
    for (size_t i = g; i < g + size_t(G); ++i) {
      a[i].assign(r[i].size(), 0.0);
      longest = std::max(longest, r[i].size());
    }
    for (size_t t = 0; t < longest; ++t) {
      std::vector<double> at;
      for (size_t i = g; i < g + size_t(G); ++i)
        if (t < r[i].size()) at.push_back(r[i][t]);
      if (at.size() < 2) continue;
      const double m = mean(at), s = normalize_std ? unbiased_std(at, m) + eps : 1.0;
      for (size_t i = g; i < g + size_t(G); ++i)
        if (t < r[i].size()) a[i][t] = (r[i][t] - m) / s;
    }
  }
  return a;
}

std::vector<bool> constant_step_groups(const std::vector<std::vector<double>>& r, int64_t G) {
  check_step_groups(r, G, "constant_step_groups");
  std::vector<bool> c;
  for (size_t g = 0; g < r.size(); g += size_t(G)) {
    bool same = true;
    for (size_t i = g; i < g + size_t(G) && same; ++i)
      for (double v : r[i]) same = same && v == r[g][0];
    c.push_back(same);
  }
  return c;
}

std::vector<double> rloo_advantages(std::span<const double> rewards, int64_t G) {
  check_groups(rewards, G, "rloo_advantages");
  std::vector<double> a(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += size_t(G)) {
    double sum = 0;
    for (int64_t i = 0; i < G; ++i) sum += rewards[g + size_t(i)];
    for (int64_t i = 0; i < G; ++i) {
      const double r = rewards[g + size_t(i)];
      a[g + size_t(i)] = r - (sum - r) / double(G - 1);
    }
  }
  return a;
}

std::vector<double> batch_normalized_advantages(std::span<const double> rewards, double eps) {
  if (rewards.size() < 2) MT_THROW("batch_normalized_advantages: ", rewards.size(), " rewards; need at least 2");
  const double m = mean(rewards), s = unbiased_std(rewards, m) + eps;
  std::vector<double> a(rewards.size());
  for (size_t i = 0; i < rewards.size(); ++i) a[i] = (rewards[i] - m) / s;
  return a;
}

Gae gae(std::span<const double> r, std::span<const double> v, double gamma, double lambda) {
  if (r.size() != v.size()) MT_THROW("gae: ", r.size(), " token rewards but ", v.size(), " values");
  if (!(gamma >= 0 && gamma <= 1)) MT_THROW("gae: gamma ", gamma, " must be in [0, 1]");
  if (!(lambda >= 0 && lambda <= 1)) MT_THROW("gae: lambda ", lambda, " must be in [0, 1]");
  const size_t T = r.size();
  Gae out{std::vector<double>(T), std::vector<double>(T)};
  double next_v = 0, next_a = 0;  // after the last token: terminal
  for (size_t k = T; k-- > 0;) {
    const double delta = r[k] + gamma * next_v - v[k];
    next_a = delta + gamma * lambda * next_a;
    out.advantages[k] = next_a;
    out.returns[k] = next_a + v[k];
    next_v = v[k];
  }
  return out;
}

std::vector<bool> constant_groups(std::span<const double> rewards, int64_t G) {
  check_groups(rewards, G, "constant_groups");
  std::vector<bool> c;
  for (size_t g = 0; g < rewards.size(); g += size_t(G)) {
    bool same = true;
    for (int64_t i = 1; i < G; ++i) same = same && rewards[g + size_t(i)] == rewards[g];
    c.push_back(same);
  }
  return c;
}

}  // namespace mt::rl
