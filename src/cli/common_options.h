// Option groups that several commands share, declared once (core/options.h): the device and CPU threads,
// the parallel layout under `moetrain launch`, the sampler, the seed. A command adds the groups it takes;
// the names, ranges and help are then the same everywhere.
#pragma once
#include <cstdint>
#include <string>

#include "core/options.h"
#include "ops/sampling.h"
#include "parallel/mesh.h"

namespace mt::cli {

// The seed every command starts from unless given one (train's, so the demo stays as it was).
constexpr int64_t kDefaultSeed = 1234;

struct DeviceOptions {
  std::string device = "auto";  // cpu | cuda | auto (cuda when a GPU is visible)
  int64_t threads = 0;          // CPU threads for the BLAS; 0: all cores
};
void add_device_options(Options& o, DeviceOptions& d);
// Sets the BLAS threads (when given) and resolves the device.
Device apply_device_options(const DeviceOptions& d);

// Which degrees of the mesh a command takes (generate: data and expert parallelism only).
struct MeshFlags {
  bool replicate = true, tp = true, sp = true, etp = false;
};
void add_mesh_options(Options& o, MeshSpec& m, MeshFlags which = {});

// --temperature, --top-p, --top-k, --min-p (checked again as a whole by validate_sampling_params).
void add_sampling_options(Options& o, SamplingParams& s);

}  // namespace mt::cli
