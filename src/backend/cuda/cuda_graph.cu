// CUDA graphs of the compute stream (core/cuda_graph.h): stream capture in thread-local mode, the graph
// instantiated once, launched on the compute stream.
#include <cuda_runtime.h>

#include "backend/cuda/common.cuh"
#include "core/cuda_graph.h"
#include "core/error.h"

namespace mt::cuda_graph {

namespace {
cudaGraphExec_t as_exec(void* p) { return static_cast<cudaGraphExec_t>(p); }
}  // namespace

Graph::~Graph() { reset(); }

Graph::Graph(Graph&& o) noexcept : exec_(o.exec_), epoch_(o.epoch_) { o.exec_ = nullptr; }

Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    reset();
    exec_ = o.exec_;
    epoch_ = o.epoch_;
    o.exec_ = nullptr;
  }
  return *this;
}

void Graph::reset() {
  if (exec_) cudaGraphExecDestroy(as_exec(exec_));
  exec_ = nullptr;
}

bool Graph::capture(const std::function<void()>& fn, std::string* why) {
  reset();
  cudaStream_t s = cuda::compute_stream();
  const uint64_t e0 = epoch();
  cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    if (why) *why = std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(err);
    cudaGetLastError();
    return false;
  }
  std::string thrown;
  try {
    fn();
  } catch (const std::exception& ex) {
    thrown = ex.what();
  }
  cudaGraph_t graph = nullptr;
  err = cudaStreamEndCapture(s, &graph);
  cudaGetLastError();  // a failed capture's error is not sticky; clear it
  auto fail = [&](const std::string& w) {
    if (graph) cudaGraphDestroy(graph);
    if (why) *why = w;
    return false;
  };
  if (!thrown.empty()) return fail("the captured function threw: " + thrown);
  if (err != cudaSuccess) return fail(std::string("the capture failed: ") + cudaGetErrorString(err));
  if (epoch() != e0) return fail("device memory moved during the capture (an arena or scratch buffer grew)");
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(err);
    return false;
  }
  exec_ = exec;
  epoch_ = e0;
  return true;
}

void Graph::replay() const {
  MT_CHECK(exec_ != nullptr, "cuda_graph::Graph::replay: nothing captured");
  MT_CUDA_CHECK("cuda graph launch", cudaGraphLaunch(as_exec(exec_), cuda::compute_stream()));
}

}  // namespace mt::cuda_graph
