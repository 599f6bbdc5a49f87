#include "core/log.h"

#include <chrono>
#include <cstdio>

namespace mt {

static const auto kStart = std::chrono::steady_clock::now();
static int g_rank = -1;

void set_log_rank(int rank) { g_rank = rank; }

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - kStart).count();
}

void log_line(const std::string& msg) {
  if (g_rank >= 0)
    std::fprintf(stderr, "[%8.2fs r%d] %s\n", wall_seconds(), g_rank, msg.c_str());
  else
    std::fprintf(stderr, "[%8.2fs] %s\n", wall_seconds(), msg.c_str());
  std::fflush(stderr);
}

}  // namespace mt
