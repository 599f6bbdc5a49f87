// Wall-clock timing for logs and metrics: a monotonic clock and the seconds since a point of it.
#pragma once
#include <chrono>

namespace mt {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace mt
