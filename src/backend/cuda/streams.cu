// The side stream and its events (core/streams.h).
#include "backend/cuda/common.cuh"
#include "core/streams.h"

namespace mt::streams {

namespace {

cudaStream_t side_of(Side side) {
  return side == Side::low ? cuda::side_stream() : cuda::urgent_stream();
}

}  // namespace

SideScope::SideScope(Device device, Side side) : on_(device == Device::CUDA) {
  if (on_) cuda::set_stream_override(side_of(side));
}

SideScope::~SideScope() {
  if (on_) cuda::set_stream_override(nullptr);
}

EventSet::~EventSet() {
  for (void* e : ev_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (compute_mark_) cudaEventDestroy(static_cast<cudaEvent_t>(compute_mark_));
}

void EventSet::resize(size_t n, Device device, Side side) {
  n_ = n;
  cuda_ = device == Device::CUDA;
  side_ = side;
  if (!cuda_) return;
  while (ev_.size() < n) {
    cudaEvent_t e = nullptr;
    MT_CUDA_CHECK("EventSet", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ev_.push_back(e);
  }
  if (!compute_mark_) {
    cudaEvent_t e = nullptr;
    MT_CUDA_CHECK("EventSet", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    compute_mark_ = e;
  }
}

void EventSet::record_side(size_t i) {
  MT_CHECK(i < n_, "event ", i, " of ", n_);
  if (cuda_) MT_CUDA_CHECK("EventSet::record_side", cudaEventRecord(static_cast<cudaEvent_t>(ev_[i]), side_of(side_)));
}

void EventSet::compute_waits(size_t i) {
  MT_CHECK(i < n_, "event ", i, " of ", n_);
  if (cuda_)
    MT_CUDA_CHECK("EventSet::compute_waits", cudaStreamWaitEvent(cuda::stream(), static_cast<cudaEvent_t>(ev_[i]), 0));
}

void EventSet::compute_waits_all() {
  for (size_t i = 0; i < n_; ++i) compute_waits(i);
}

void EventSet::side_waits_compute() {
  if (!cuda_) return;
  cudaEvent_t mark = static_cast<cudaEvent_t>(compute_mark_);
  MT_CUDA_CHECK("EventSet::side_waits_compute", cudaEventRecord(mark, cuda::stream()));
  MT_CUDA_CHECK("EventSet::side_waits_compute", cudaStreamWaitEvent(side_of(side_), mark, 0));
}

}  // namespace mt::streams
