// The device mesh: which rank plays which role. Dense layers see the world as
// dp_replicate × dp_shard × sp × tp (tp varies fastest); expert layers re-fold the same ranks as
// expert_dp × ep × etp (etp fastest), where etp is 1 or tp (docs/design.md, "parallel folding"). "axis"
// is a mesh axis; "dim" is a tensor dimension. Invalid layouts are rejected naming every degree.
//
// Under HSDP (dp_replicate > 1) with expert parallelism every replica (the dp_shard × sp × tp ranks of
// one dp_replicate coordinate, a contiguous block of world / dp_replicate ranks) holds all experts:
// ep × etp must divide the replica, and expert_dp splits into dp_replicate (slowest) × expert_shard,
// the ranks of one replica that hold the same experts. The ranks holding the same expert shard in
// the other replicas are then exactly the rank's dp_replicate group (same position in the replica).
#pragma once
#include <initializer_list>
#include <string>
#include <vector>

namespace mt {

// ExpertShard: the expert_dp ranks of one dp_replicate replica (= ExpertDp without HSDP).
enum class Axis { DpReplicate, DpShard, Sp, Tp, ExpertDp, Ep, Etp, ExpertShard };
const char* axis_name(Axis a);  // "dp_replicate", ...

struct MeshSpec {
  int dp_replicate = 1;
  int dp_shard = 0;  // 0: whatever is left of the world size
  int sp = 1, tp = 1, ep = 1, etp = 1;
};

class DeviceMesh {
 public:
  DeviceMesh(const MeshSpec& spec, int world_size);  // throws naming the degrees and the rule
  int world_size() const { return world_; }
  int size(Axis a) const;
  int coord(Axis a, int rank) const;
  // The ranks that differ from `rank` only along `a`, in coordinate order (rank's own group).
  std::vector<int> group(Axis a, int rank) const;
  // The ranks that differ from `rank` only along the data-parallel axes (dp_replicate × dp_shard):
  // the ranks that see different samples of the batch.
  std::vector<int> dp_group(int rank) const;
  // Index that is equal for all ranks of rank's group along `a` and different between groups (a
  // color for Communicator::split).
  int group_color(Axis a, int rank) const;
  int dp_color(int rank) const;
  // Groups over several dense axes (dp_replicate, dp_shard, sp, tp), e.g. {DpShard, Sp}: the ranks
  // that differ from `rank` only along those axes. group_color is equal within a group and differs
  // between groups; group_coord is rank's index in its group, the axes taken in folding order
  // (dp_replicate slowest, tp fastest), so {DpReplicate, DpShard, Sp} gives dp_rank × sp + sp coord.
  int group_color(std::initializer_list<Axis> axes, int rank) const;
  int group_coord(std::initializer_list<Axis> axes, int rank) const;
  int group_size(std::initializer_list<Axis> axes) const;
  // Checks the experts split: num_experts divisible by ep.
  void check_experts(int num_experts) const;
  std::string describe() const;  // "world 8 = dp_replicate 1 × dp_shard 4 × sp 1 × tp 2; experts: ..."

 private:
  int world_;
  MeshSpec s_;
  int expert_dp_ = 1, expert_shard_ = 1;
};

}  // namespace mt
