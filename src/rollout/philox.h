// Counter-based random numbers for sampling: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
// random numbers: as easy as 1, 2, 3", SC 2011), a pure function of a 64-bit key and a 128-bit counter.
//
// The sampler draws the uniform number of one token from (seed, sample index, position) alone. So a
// draw does not depend on which other rows share the batch, on the order rows are processed in, or on
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

// The uniform number in [0, 1) of one sampling draw: Philox with key = seed and counter = (sample,
// position), each split into (low, high) 32-bit words; the first two output words give 53 bits, so
// the double is exact and the same on host and device.
MT_HOST_DEVICE inline double sampling_uniform(uint64_t seed, uint64_t sample, uint64_t position) {
  const Philox4x32 ctr{{uint32_t(sample), uint32_t(sample >> 32), uint32_t(position), uint32_t(position >> 32)}};
  const Philox4x32 r = philox4x32_10(ctr, uint32_t(seed), uint32_t(seed >> 32));
  const uint64_t bits53 = (uint64_t(r.v[0]) << 21) | (r.v[1] >> 11);
  return double(bits53) * 0x1.0p-53;
}

}  // namespace mt
