// Deterministic random numbers: splitmix64-seeded xoshiro256**. The same seed gives the same
// stream on every platform, which the tests and the data generators rely on.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

// splitmix64's output function of x + golden ratio: a bijective hash of 64 bits, for deriving
// independent seeds and deterministic choices from counters.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next_u64();
  double uniform();                    // [0, 1)
  int64_t randint(int64_t lo, int64_t hi);  // [lo, hi)
  double normal();                     // N(0, 1), Box-Muller
  void fill_normal(Tensor& t, float mean, float std);        // CPU f32
  void fill_uniform(Tensor& t, float lo, float hi);          // CPU f32

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace mt
