// A second stream for work that may run beside the compute stream, and events to order the two.
// Used by the optimizer's overlapped step (train/optimizer.h): each unit's AdamW update runs on the
// side stream and marks an event, and the next forward waits for a unit's event before it reads the
// unit's weights, so the updates of later units overlap the forward of earlier ones.
//
// Rules for work on the side stream: elementwise ops only (no GEMM: the cuBLASLt workspace belongs to
// the compute stream) and no tensor allocation or free (the memory pool orders frees on the compute
// stream). On the CPU, or in a build without CUDA, everything runs inline and in order: the scope and
// the events do nothing.
#pragma once
#include <cstddef>
#include <vector>

#include "core/tensor.h"

namespace mt::streams {

// While alive (and `device` is CUDA), ops launched by this thread run on the side stream. The side
// stream is a non-blocking stream of the lowest priority: legacy-stream copies do not wait for it
// and the compute stream's kernels go first when both have work.
class SideScope {
 public:
  explicit SideScope(Device device);
  ~SideScope();
  SideScope(const SideScope&) = delete;
  SideScope& operator=(const SideScope&) = delete;

 private:
  bool on_ = false;
};

// n events, reused from step to step. A fresh or never-recorded event is complete.
class EventSet {
 public:
  EventSet() = default;
  ~EventSet();
  EventSet(const EventSet&) = delete;
  EventSet& operator=(const EventSet&) = delete;
  void resize(size_t n, Device device);
  size_t size() const { return n_; }
  void record_side(size_t i);      // event i marks the side stream's work queued so far
  void compute_waits(size_t i);    // the compute stream waits for event i (the host does not)
  void compute_waits_all();
  void side_waits_compute();       // the side stream waits for the compute stream's work queued so far

 private:
  std::vector<void*> ev_;  // cudaEvent_t
  void* compute_mark_ = nullptr;
  size_t n_ = 0;
  bool cuda_ = false;
};

}  // namespace mt::streams
