// Optional per-op timing for benchmarks: when enabled, every op waits for its device before and
// after it runs and adds its wall time to a per-op total. Off by default (no cost but a branch).
#pragma once
#include <map>
#include <string>

#include "core/tensor.h"

namespace mt::ops {

void set_op_profiling(bool on);
bool op_profiling();
std::map<std::string, double> op_seconds();  // op name -> seconds since the last reset
void reset_op_seconds();

class OpScope {
 public:
  OpScope(const char* op, bool cuda);
  ~OpScope();

 private:
  const char* op_ = nullptr;
  bool cuda_ = false;
  double start_ = 0;
};

}  // namespace mt::ops
