// Builds without CUDA: one stream, so the side scope and the events do nothing (core/streams.h).
#include "core/streams.h"

namespace mt::streams {

SideScope::SideScope(Device, Side) {}
SideScope::~SideScope() {}
EventSet::~EventSet() {}
void EventSet::resize(size_t n, Device, Side) {
  n_ = n;
}
void EventSet::record_side(size_t) {}
void EventSet::compute_waits(size_t) {}
void EventSet::compute_waits_all() {}
void EventSet::side_waits_compute() {}

// No side stream: the placement is remembered (so that code reading it behaves the same) but nothing
// ever runs beside the compute stream.
namespace {
thread_local WgradPlacement t_wgrad;
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
  return 0;
}
void count_wgrad_side_call() {}

}  // namespace mt::streams
