// CUDA graphs of the compute stream: what a function launches, captured once and replayed (the rollout
// engine's decode steps, docs/rollout.md "CUDA graphs"). A captured kernel keeps the addresses it was
// given, so a graph is only valid while the memory behind them stays where it was: epoch() counts the
// events that move such memory (an arena taking a new block, a kernel scratch buffer growing), and a
// graph captured at one epoch must not be replayed at another. In a build without CUDA nothing can be
// captured (capture() says so) and the epoch still counts.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace mt::cuda_graph {

uint64_t epoch();
void bump_epoch();  // called where device memory that kernels point at is replaced

class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Runs fn with this thread's compute stream capturing (thread-local mode: a call that is not allowed
  // in a capture, a synchronisation or cudaMalloc from this thread, fails it). Nothing fn launches runs.
  // Returns false with the reason in *why, the graph left empty, when fn threw, a call failed the capture,
  // or the epoch moved during it. Replaces what the graph held.
  bool capture(const std::function<void()>& fn, std::string* why);
  void replay() const;  // on the compute stream; the graph must not be empty
  bool empty() const { return exec_ == nullptr; }
  uint64_t captured_epoch() const { return epoch_; }
  void reset();

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
  uint64_t epoch_ = 0;
};

}  // namespace mt::cuda_graph
