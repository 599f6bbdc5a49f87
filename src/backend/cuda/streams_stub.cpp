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
}  // namespace mt::streams
