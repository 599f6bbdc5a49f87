// Logging to stderr with wall-clock time since start and the rank (when set). One line per call.
#pragma once
#include <string>

#include "core/error.h"

namespace mt {

void log_line(const std::string& msg);
void set_log_rank(int rank);  // -1 = single process (no rank prefix)
double wall_seconds();        // seconds since process start, monotonic

template <class... A>
void log_info(const A&... a) {
  log_line(str(a...));
}

}  // namespace mt
