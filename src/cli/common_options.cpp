// The shared option groups (cli/common_options.h).
#include "cli/common_options.h"

#include "core/device_select.h"
#include "ops/threads.h"

namespace mt::cli {

void add_device_options(Options& o, DeviceOptions& d) {
  o.group("device");
  o.add("device", &d.device, "where the model runs: cpu, cuda, or auto (cuda when a GPU is visible)")
      .one_of({"auto", "cpu", "cuda"});
  o.add("threads", &d.threads, "CPU threads of the matrix products").at_least(0).says("0: all cores");
}

Device apply_device_options(const DeviceOptions& d) {
  if (d.threads > 0) ops::set_cpu_threads(int(d.threads));
  return resolve_device(d.device);
}

void add_mesh_options(Options& o, MeshSpec& m, MeshFlags which) {
  o.group("parallel layout (under moetrain launch)");
  o.add("dp-shard", &m.dp_shard, "ranks the model's weights are sharded over (FSDP)")
      .at_least(0)
      .says("0: what the other degrees leave of the world size");
  if (which.replicate) o.add("dp-replicate", &m.dp_replicate, "replicas of the sharded model (HSDP)").at_least(1);
  o.add("ep", &m.ep, "expert parallelism: each rank holds num_experts / ep experts").at_least(1);
  if (which.tp) o.add("tp", &m.tp, "tensor parallelism: each rank a slice of every weight").at_least(1);
  if (which.etp) o.add("etp", &m.etp, "expert tensor parallelism: 1 or the tp degree").at_least(1);
  if (which.sp) o.add("sp", &m.sp, "sequence parallelism (Ulysses): each sequence split over sp ranks").at_least(1);
}

void add_sampling_options(Options& o, SamplingParams& s) {
  o.group("sampling");
  o.add("temperature", &s.temperature, "the logits are divided by it before sampling").at_least(0).says("0: greedy");
  o.add("top-p", &s.top_p, "nucleus sampling: the smallest set of tokens with this much probability")
      .above(0)
      .at_most(1)
      .says("1: off");
  o.add("top-k", &s.top_k, "sample among the k most likely tokens").at_least(0).says("0: off");
  o.add("min-p", &s.min_p, "drop tokens below min-p times the top token's probability")
      .at_least(0)
      .at_most(1)
      .says("0: off");
}

}  // namespace mt::cli
