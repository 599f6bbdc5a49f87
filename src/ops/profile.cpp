#include "ops/profile.h"

#include <chrono>

namespace mt::ops {

static bool g_on = false;
static std::map<std::string, double> g_seconds;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void set_op_profiling(bool on) { g_on = on; }
bool op_profiling() { return g_on; }
std::map<std::string, double> op_seconds() { return g_seconds; }
void reset_op_seconds() { g_seconds.clear(); }

OpScope::OpScope(const char* op, bool cuda) {
  if (!g_on) return;
  op_ = op;
  cuda_ = cuda;
  if (cuda_) device_mem::synchronize(Device::CUDA);
  start_ = now();
}

OpScope::~OpScope() {
  if (!op_) return;
  if (cuda_) device_mem::synchronize(Device::CUDA);
  g_seconds[op_] += now() - start_;
}

}  // namespace mt::ops
