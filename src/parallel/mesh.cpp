#include "parallel/mesh.h"

#include "core/error.h"

namespace mt {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::DpReplicate: return "dp_replicate";
    case Axis::DpShard: return "dp_shard";
    case Axis::Sp: return "sp";
    case Axis::Tp: return "tp";
    case Axis::ExpertDp: return "expert_dp";
    case Axis::Ep: return "ep";
    case Axis::Etp: return "etp";
    case Axis::ExpertShard: return "expert_shard";
  }
  return "?";
}

DeviceMesh::DeviceMesh(const MeshSpec& spec, int world_size) : world_(world_size), s_(spec) {
  if (world_size < 1) MT_THROW("world size ", world_size, " must be at least 1");
  auto positive = [](int v, const char* n) {
    if (v < 1) MT_THROW(n, " ", v, " must be at least 1");
  };
  positive(s_.dp_replicate, "dp_replicate");
  positive(s_.sp, "sp");
  positive(s_.tp, "tp");
  positive(s_.ep, "ep");
  positive(s_.etp, "etp");
  if (s_.dp_shard < 0) MT_THROW("dp_shard ", s_.dp_shard, " must be at least 1 (or 0: fill the rest of the world)");
  const int fixed = s_.dp_replicate * s_.sp * s_.tp;
  if (s_.dp_shard == 0) {
    if (world_ % fixed != 0)
      MT_THROW("world size ", world_, " is not divisible by dp_replicate ", s_.dp_replicate, " × sp ", s_.sp, " × tp ",
               s_.tp, " = ", fixed, ", so dp_shard cannot fill the rest");
    s_.dp_shard = world_ / fixed;
  }
  if (s_.dp_replicate * s_.dp_shard * s_.sp * s_.tp != world_)
    MT_THROW("world size ", world_, " is not dp_replicate ", s_.dp_replicate, " × dp_shard ", s_.dp_shard, " × sp ",
             s_.sp, " × tp ", s_.tp, " = ", s_.dp_replicate * s_.dp_shard * s_.sp * s_.tp);
  if (s_.etp != 1 && s_.etp != s_.tp) MT_THROW("etp ", s_.etp, " must be 1 or equal to tp ", s_.tp);
  if (world_ % (s_.ep * s_.etp) != 0)
    MT_THROW("world size ", world_, " is not divisible by ep ", s_.ep, " × etp ", s_.etp, " (expert layers fold the world into expert_dp × ep × etp)");
  expert_dp_ = world_ / (s_.ep * s_.etp);
  expert_shard_ = expert_dp_;
  if (s_.ep > 1 && s_.dp_replicate > 1) {
    const int replica = world_ / s_.dp_replicate;
    if (replica % (s_.ep * s_.etp) != 0)
      MT_THROW("ep ", s_.ep, " × etp ", s_.etp, " = ", s_.ep * s_.etp, " must divide the ", replica,
               " ranks of one dp_replicate replica (dp_shard ", s_.dp_shard, " × sp ", s_.sp, " × tp ", s_.tp,
               "): under HSDP every replica holds all experts");
    expert_shard_ = replica / (s_.ep * s_.etp);
  }
}

int DeviceMesh::size(Axis a) const {
  switch (a) {
    case Axis::DpReplicate: return s_.dp_replicate;
    case Axis::DpShard: return s_.dp_shard;
    case Axis::Sp: return s_.sp;
    case Axis::Tp: return s_.tp;
    case Axis::ExpertDp: return expert_dp_;
    case Axis::Ep: return s_.ep;
    case Axis::Etp: return s_.etp;
    case Axis::ExpertShard: return expert_shard_;
  }
  return 1;
}

// Strides of each axis within its folding (dense: tp fastest; experts: etp fastest).
static int stride_of(const DeviceMesh& m, Axis a) {
  using A = Axis;
  switch (a) {
    case A::Tp: return 1;
    case A::Sp: return m.size(A::Tp);
    case A::DpShard: return m.size(A::Tp) * m.size(A::Sp);
    case A::DpReplicate: return m.size(A::Tp) * m.size(A::Sp) * m.size(A::DpShard);
    case A::Etp: return 1;
    case A::Ep: return m.size(A::Etp);
    case A::ExpertDp: return m.size(A::Etp) * m.size(A::Ep);
    case A::ExpertShard: return m.size(A::Etp) * m.size(A::Ep);  // the fast part of expert_dp
  }
  return 1;
}

int DeviceMesh::coord(Axis a, int rank) const {
  MT_CHECK(rank >= 0 && rank < world_, "rank ", rank, " outside world ", world_);
  return rank / stride_of(*this, a) % size(a);
}

std::vector<int> DeviceMesh::group(Axis a, int rank) const {
  const int st = stride_of(*this, a), base = rank - coord(a, rank) * st;
  std::vector<int> g;
  for (int i = 0; i < size(a); ++i) g.push_back(base + i * st);
  return g;
}

std::vector<int> DeviceMesh::dp_group(int rank) const {
  const int st = stride_of(*this, Axis::DpShard), n = s_.dp_replicate * s_.dp_shard;
  const int base = rank % st;
  std::vector<int> g;
  for (int i = 0; i < n; ++i) g.push_back(base + i * st);
  return g;
}

int DeviceMesh::group_color(Axis a, int rank) const {
  const int st = stride_of(*this, a);
  return rank % st + (rank / (st * size(a))) * st;
}

int DeviceMesh::dp_color(int rank) const { return rank % stride_of(*this, Axis::DpShard); }

namespace {
constexpr Axis kDenseAxes[] = {Axis::DpReplicate, Axis::DpShard, Axis::Sp, Axis::Tp};  // slowest first
bool has_axis(std::initializer_list<Axis> axes, Axis a) {
  for (Axis x : axes) {
    MT_CHECK(x == Axis::DpReplicate || x == Axis::DpShard || x == Axis::Sp || x == Axis::Tp,
             "multi-axis groups are over dense axes; got ", axis_name(x));
    if (x == a) return true;
  }
  return false;
}
}  // namespace

int DeviceMesh::group_color(std::initializer_list<Axis> axes, int rank) const {
  int c = 0;
  for (Axis a : kDenseAxes)
    if (!has_axis(axes, a)) c = c * size(a) + coord(a, rank);
  return c;
}

int DeviceMesh::group_coord(std::initializer_list<Axis> axes, int rank) const {
  int c = 0;
  for (Axis a : kDenseAxes)
    if (has_axis(axes, a)) c = c * size(a) + coord(a, rank);
  return c;
}

int DeviceMesh::group_size(std::initializer_list<Axis> axes) const {
  int n = 1;
  for (Axis a : kDenseAxes)
    if (has_axis(axes, a)) n *= size(a);
  return n;
}

void DeviceMesh::check_experts(int num_experts) const {
  if (num_experts % s_.ep != 0) MT_THROW("num_experts (", num_experts, ") must be divisible by ep (", s_.ep, ")");
}

std::string DeviceMesh::describe() const {
  return str("world ", world_, " = dp_replicate ", s_.dp_replicate, " × dp_shard ", s_.dp_shard, " × sp ", s_.sp,
             " × tp ", s_.tp, "; experts: expert_dp ", expert_dp_, " × ep ", s_.ep, " × etp ", s_.etp,
             expert_shard_ != expert_dp_ ? str(" (expert_shard ", expert_shard_, " per replica)") : std::string());
}

}  // namespace mt
