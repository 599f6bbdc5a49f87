// "Who am I": this process's rank, world size, local rank and the rendezvous address, read from the
// environment a launcher left. Sources, first match wins:
//   env      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (or GROUP_RANK), MASTER_ADDR,
//            MASTER_PORT: torchrun and `moetrain launch`
//   slurm    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE
//            ("4(x2),3"), SLURM_NODEID; MASTER_ADDR from the environment or the first host of
//            SLURM_JOB_NODELIST / SLURM_NODELIST ("node[01-04,07]"); MASTER_PORT from the environment
//            or 10000 + SLURM_JOB_ID % 20000 (what every rank of the job computes alike)
//   openmpi  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; the node index is rank / local
//            size (OpenMPI's NODE_RANK is a rank within the node, not a node index); MASTER_ADDR and
//            MASTER_PORT from the environment (mpirun -x)
//   single   none of the above: rank 0 of 1
// Every value is validated; an error names the variable, its value and what is allowed.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mt::comm {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;            // 0 only when world_size is 1 (nothing to rendezvous with)
  std::string source = "single";  // "env", "slurm", "openmpi" or "single"
  // "rank 3 of 8 (local 1 of 4, node 0), master 10.0.0.1:29500, from slurm"
  std::string str() const;
};

// Returns the variable's value, or nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

DistEnv detect_dist_env();                      // from the process environment
DistEnv detect_dist_env(const EnvLookup& env);  // from any lookup (tests pass a map)

// Slurm's compressed host lists: "node[01-04,07],login2,rack[1-2]-n[1-2]" -> node01 ... rack2-n2.
// Zero padding is kept. Throws on unbalanced brackets or bad ranges, naming the list.
std::vector<std::string> expand_slurm_nodelist(const std::string& list);
// SLURM_TASKS_PER_NODE ("4(x2),3") -> the count on node `node_id` (4, 4, 3 for nodes 0, 1, 2).
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id);

}  // namespace mt::comm
