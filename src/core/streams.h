// A second stream for work that may run beside the compute stream, and events to order the two.
// Used by the optimizer's overlapped step (train/optimizer.h): each unit's AdamW update runs on the
// side stream and marks an event, and the next forward waits for a unit's event before it reads the
// unit's weights, so the updates of later units overlap the forward of earlier ones.
//
// The experts' backward puts its weight-gradient GEMMs there too, or on the urgent side stream, a
// second one of the highest priority (WgradScope below).
//
// Rules for work on the side stream: elementwise ops, and the CUTLASS grouped weight-gradient GEMM
// (its argument arrays and workspace are its own), but no cuBLASLt GEMM (the cuBLASLt workspace belongs
// to the compute stream) and no tensor allocation or free (the memory pool orders frees on the compute
// stream). On the CPU, or in a build without CUDA, everything runs inline and in order: the scope and
// the events do nothing.
#pragma once
#include <cstddef>
#include <vector>

#include "core/tensor.h"

namespace mt::streams {

// Which side stream: low, the side stream (the lowest priority: the compute stream's kernels go first
// when both have work); high, the urgent side stream (the highest priority: its kernels go first, so a
// persistent kernel there takes its SMs as soon as they free up and the compute stream keeps the rest).
// Both are non-blocking: legacy-stream copies do not wait for them.
enum class Side { low, high };

// While alive (and `device` is CUDA), ops launched by this thread run on that side stream.
class SideScope {
 public:
  explicit SideScope(Device device, Side side = Side::low);
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
  // side: the side stream that record_side and side_waits_compute mean.
  void resize(size_t n, Device device, Side side = Side::low);
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
  Side side_ = Side::low;
};

// The experts' weight-gradient GEMMs beside the rest of the backward (ModelOptions::wgrad_stream,
// MOETRAIN_WGRAD_STREAM). While a WgradScope with side = true is alive on this thread, the CUDA experts'
// grouped backward (ops::experts_bwd) queues its two weight-gradient GEMMs on the side stream `stream`
// (high by default: see Side), after that stream waits for the compute stream's work so far (their
// inputs are ready then). The caller then owns the ordering: it records an event on that stream after
// the call (an EventSet of the same Side, record_side) and makes the compute stream wait for it before
// anything overwrites the
// GEMMs' inputs (the routed rows, the output gradient rows, the expert hidden rows) or reads the
// gradients. The experts' own scratch (dh, dgu, the GEMMs' argument arrays) is ordered by experts.cu.
// ctas caps the weight-gradient GEMMs' persistent grid (0: one CTA per SM on the compute stream, half
// the SMs on the side stream, so that the compute stream keeps SMs of its own), on either stream.
// Other paths (per-expert cuBLASLt reference, CPU, builds without CUDA) ignore the scope: everything
// runs in order on the compute stream, with the same results.
struct WgradPlacement {
  bool side = false;
  int ctas = 0;
  Side stream = Side::high;
};
class WgradScope {
 public:
  explicit WgradScope(WgradPlacement p);
  ~WgradScope();
  WgradScope(const WgradScope&) = delete;
  WgradScope& operator=(const WgradScope&) = delete;

 private:
  WgradPlacement prev_;
};
WgradPlacement wgrad_placement();  // this thread's current placement (default: compute stream, all SMs)
// How many experts backward calls of this process queued their weight gradients on the side stream
// (tests: the switch did take the side path).
size_t wgrad_side_calls();
void count_wgrad_side_call();

}  // namespace mt::streams
