// CPU threading for the ops: how many threads the CPU backend's GEMMs (BLAS) may use. The one
// setting a trainer needs from a backend, so that src/train includes no backend header.
#pragma once

namespace mt::ops {

// threads >= 1: that many BLAS threads; 0 leaves the library's default. A no-op without a threaded BLAS.
void set_cpu_threads(int threads);

}  // namespace mt::ops
