// `moetrain _selftest dist` (hidden): a rank that rendezvouses through detect_dist_env and the TCP
// store, proves the store works across processes, prints "rank R of W ok", and misbehaves on demand
// so that the tests can check the launcher's stop protocol and the barrier's error messages.
#pragma once
#include <string>
#include <vector>

namespace mt::comm {

int selftest_main(const std::vector<std::string>& args);

}  // namespace mt::comm
