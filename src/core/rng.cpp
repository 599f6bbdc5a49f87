#include "core/rng.h"

#include <cmath>

namespace mt {

static uint64_t splitmix64(uint64_t& x) {
  const uint64_t z = mix64(x);
  x += 0x9e3779b97f4a7c15ull;
  return z;
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix64(seed);
}

uint64_t Rng::next_u64() {
  uint64_t result = rotl(s_[1] * 5, 7) * 9;
  uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }

int64_t Rng::randint(int64_t lo, int64_t hi) {
  MT_CHECK(hi > lo, "randint range [", lo, ", ", hi, ") is empty");
  return lo + int64_t(next_u64() % uint64_t(hi - lo));
}

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2 * M_PI * u2);
  has_spare_ = true;
  return r * std::cos(2 * M_PI * u2);
}

void Rng::fill_normal(Tensor& t, float mean, float std) {
  float* p = t.data<float>();
  MT_CHECK(t.is_cpu(), "fill_normal needs a CPU tensor, got ", t.desc());
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = mean + std * float(normal());
}

void Rng::fill_uniform(Tensor& t, float lo, float hi) {
  float* p = t.data<float>();
  MT_CHECK(t.is_cpu(), "fill_uniform needs a CPU tensor, got ", t.desc());
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = lo + (hi - lo) * float(uniform());
}

}  // namespace mt
