#include "ops/threads.h"

#include "backend/cpu/gemm.h"

namespace mt::ops {

void set_cpu_threads(int threads) { cpu::set_blas_threads(threads); }

}  // namespace mt::ops
