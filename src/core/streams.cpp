// The weight-gradient placement (core/streams.h): host state only, the same with and without CUDA. Without
// CUDA nothing queues work beside the compute stream, so nothing counts a side call and the count stays 0.
#include "core/streams.h"

#include <atomic>

namespace mt::streams {

namespace {
thread_local WgradPlacement t_wgrad;
std::atomic<size_t> g_wgrad_side_calls{0};
}  // namespace

WgradScope::WgradScope(WgradPlacement p) : prev_(t_wgrad) {
  t_wgrad = p;
}
WgradScope::~WgradScope() {
  t_wgrad = prev_;
}
WgradPlacement wgrad_placement() {
  return t_wgrad;
}
size_t wgrad_side_calls() {
  return g_wgrad_side_calls.load();
}
void count_wgrad_side_call() {
  ++g_wgrad_side_calls;
}

}  // namespace mt::streams
