// The epoch of core/cuda_graph.h (the graphs themselves are in backend/cuda/cuda_graph.cu, or its stub).
#include "core/cuda_graph.h"

#include <atomic>

namespace mt::cuda_graph {

namespace {
std::atomic<uint64_t> g_epoch{0};
}

uint64_t epoch() { return g_epoch.load(std::memory_order_relaxed); }
void bump_epoch() { g_epoch.fetch_add(1, std::memory_order_relaxed); }

}  // namespace mt::cuda_graph
