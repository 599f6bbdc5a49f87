// A frozen CUDA session with random weights: the model the engine tests generate from (a generator or an RL
// reference, Weights::Frozen).
#pragma once
#include <cstdint>
#include <memory>

#include "train/session.h"

namespace mt::cudatest {

inline std::unique_ptr<TrainSession> frozen_cuda_session(const ModelConfig& c, uint64_t seed) {
  SessionOptions so;
  so.device = Device::CUDA;
  so.weights = Weights::Frozen;
  auto s = std::make_unique<TrainSession>(c, so);
  s->init_weights(seed);
  return s;
}

}  // namespace mt::cudatest
