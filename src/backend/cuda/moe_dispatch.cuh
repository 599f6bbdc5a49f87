// Error reporting of the CUDA dispatch plan (moe_dispatch.cu), for the ops that consume the plan.
//
// make_dispatch_plan validates expert ids on the device without synchronising: an id outside
// [0, E) is clamped into range (so every later kernel stays in bounds) and recorded in a sticky
// deferred error (gemm.cuh). The error is thrown, naming the token, the choice and the id, by
//   - the next make_dispatch_plan call that finds the record already copied to the host,
//   - experts_fwd / experts_bwd, which synchronise anyway (they read the offsets) and call this,
//   - any caller of check_dispatch_plan_errors after a stream synchronisation.
#pragma once

namespace mt::cuda {

// Throws mt::Error if a make_dispatch_plan call whose error record has reached the host saw an
// expert id out of range. Never synchronises unless there is an error to report.
void check_dispatch_plan_errors(const char* op);

}  // namespace mt::cuda
