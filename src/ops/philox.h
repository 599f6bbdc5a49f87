// Counter-based random numbers for sampling: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
// random numbers: as easy as 1, 2, 3", SC 2011), a pure function of a 64-bit key and a 128-bit counter.
//
// The sampler draws each token's uniform number from (seed, sample index, position, token id) alone. So
// a draw does not depend on which other rows share the batch, on the order rows are processed in, or on
// the device: the CUDA sampler includes this header and gets the same bits. No state, no offsets to
// carry between steps. The Random123 known-answer vectors are checked in tests/rollout.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

namespace mt {

struct Philox4x32 {
  uint32_t v[4];
};

// The ten-round Philox4x32 bijection of `ctr` under `key`.
MT_HOST_DEVICE inline Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kM0) * ctr.v[0], p1 = uint64_t(kM1) * ctr.v[2];
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
    const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ key0, lo1, hi0 ^ ctr.v[3] ^ key1, lo0}};
    key0 += kW0;
    key1 += kW1;
  }
  return ctr;
}

// The clocks of one sampling draw (ops/sampling.h): token t's uniform number comes from Philox with key =
// seed and counter = (sample low, sample high, position, t / 4), output word t % 4. One call serves four
// consecutive tokens; positions are below 2^32 (the model's positions are).
MT_HOST_DEVICE inline Philox4x32 sampling_words(uint64_t seed, uint64_t sample, uint32_t position, uint32_t group) {
  return philox4x32_10(Philox4x32{{uint32_t(sample), uint32_t(sample >> 32), position, group}}, uint32_t(seed),
                       uint32_t(seed >> 32));
}

// A 32-bit word as a uniform number in (0, 1): (w + 1/2) 2^-32, never 0 or 1; exact in double.
MT_HOST_DEVICE inline double word_uniform(uint32_t w) { return (double(w) + 0.5) * 0x1.0p-32; }

}  // namespace mt
