// Builds without CUDA: no graph can be captured (core/cuda_graph.h).
#include "core/cuda_graph.h"

#include "core/error.h"

namespace mt::cuda_graph {

Graph::~Graph() = default;
Graph::Graph(Graph&& o) noexcept : exec_(o.exec_), epoch_(o.epoch_) { o.exec_ = nullptr; }
Graph& Graph::operator=(Graph&& o) noexcept {
  exec_ = o.exec_;
  epoch_ = o.epoch_;
  o.exec_ = nullptr;
  return *this;
}
bool Graph::capture(const std::function<void()>&, std::string* why) {
  if (why) *why = "this build has no CUDA";
  return false;
}
void Graph::replay() const { MT_THROW("cuda_graph::Graph::replay: this build has no CUDA"); }
void Graph::reset() { exec_ = nullptr; }

}  // namespace mt::cuda_graph
