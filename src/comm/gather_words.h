// Variable-length all-gather of i32 words over a communicator: each rank's word count is all-gathered,
// then the words padded to the longest and all-gathered; every rank gets every rank's words, in rank
// order. Collective (every rank of `comm` calls it). Used to move samples between ranks (rollout/generate,
// rl/grpo).
#pragma once
#include <cstdint>
#include <vector>

#include "comm/communicator.h"

namespace mt::comm {

std::vector<std::vector<int32_t>> all_gather_words(Communicator& comm, const std::vector<int32_t>& words);

}  // namespace mt::comm
