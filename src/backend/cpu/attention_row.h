// One query row of attention in fp64, as the CPU's paged decode attention computes it and the training attention
// does in the batch-invariant mode (core/determinism.h): one function, so the two give the same bits.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mt::cpu {

// The row's output over keys 0..n-1: scores q . k_j / sqrt(Hd) (fp64 dot products), their softmax (the maximum
// first, then the weights and their sum, keys in order), the weighted sum of the values in fp64, rounded once to
// f32 into out[0, Hd). key(j) and value(j) point at key and value j. w and acc are scratch. Returns the scores'
// log-sum-exp.
template <class Key, class Value>
double attend_row(const float* q, int64_t n, int64_t Hd, const Key& key, const Value& value, std::vector<double>& w,
                  std::vector<double>& acc, float* out) {
  const double scale = 1.0 / std::sqrt(double(Hd));
  w.resize(size_t(n));
  double mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = key(j);
    double d = 0;
    for (int64_t i = 0; i < Hd; ++i) d += double(q[i]) * double(kj[i]);
    w[size_t(j)] = d * scale;
    mx = std::max(mx, w[size_t(j)]);
  }
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (w[size_t(j)] = std::exp(w[size_t(j)] - mx));
  acc.assign(size_t(Hd), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = value(j);
    for (int64_t i = 0; i < Hd; ++i) acc[size_t(i)] += w[size_t(j)] * double(vj[i]);
  }
  for (int64_t i = 0; i < Hd; ++i) out[i] = float(acc[size_t(i)] / sum);
  return mx + std::log(sum);
}

}  // namespace mt::cpu
