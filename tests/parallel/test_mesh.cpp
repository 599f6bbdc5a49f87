// Device mesh: sizes, coordinates, groups and the errors for invalid layouts.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/error.h"
#include "parallel/mesh.h"

using namespace mt;

static std::string error_of(const MeshSpec& s, int world) {
  try {
    DeviceMesh m(s, world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Mesh, DpShardFillsTheRest) {
  MeshSpec s;
  s.tp = 2;
  DeviceMesh m(s, 8);
  EXPECT_EQ(m.size(Axis::DpShard), 4);
  EXPECT_EQ(m.size(Axis::Tp), 2);
  EXPECT_EQ(m.describe(), "world 8 = dp_replicate 1 × dp_shard 4 × sp 1 × tp 2; experts: expert_dp 8 × ep 1 × etp 1");
}

TEST(Mesh, InvalidLayoutsNameEveryDegree) {
  MeshSpec s;
  s.dp_shard = 4;
  EXPECT_EQ(error_of(s, 6), "world size 6 is not dp_replicate 1 × dp_shard 4 × sp 1 × tp 1 = 4");
  MeshSpec t;
  t.tp = 4;
  EXPECT_EQ(error_of(t, 6), "world size 6 is not divisible by dp_replicate 1 × sp 1 × tp 4 = 4, so dp_shard cannot fill the rest");
  MeshSpec e;
  e.tp = 2;
  e.etp = 3;
  EXPECT_EQ(error_of(e, 4), "etp 3 must be 1 or equal to tp 2");
  MeshSpec z;
  z.sp = 0;
  EXPECT_EQ(error_of(z, 4), "sp 0 must be at least 1");
  MeshSpec x;
  x.ep = 3;
  EXPECT_NE(error_of(x, 4).find("not divisible by ep 3"), std::string::npos);
  MeshSpec ok;
  ok.ep = 4;
  DeviceMesh m(ok, 4);
  EXPECT_THROW(m.check_experts(6), Error);
  try {
    m.check_experts(6);
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "num_experts (6) must be divisible by ep (4)");
  }
}

// Every axis partitions the world into groups of size(axis); colors agree within a group only; a
// rank's coordinates along the dense axes identify it uniquely.
TEST(Mesh, GroupsPartitionTheWorld) {
  MeshSpec s;
  s.dp_replicate = 2;
  s.sp = 2;
  s.tp = 2;
  s.ep = 4;
  s.etp = 2;
  const int W = 16;
  DeviceMesh m(s, W);
  EXPECT_EQ(m.size(Axis::DpShard), 2);
  EXPECT_EQ(m.size(Axis::ExpertDp), 2);
  for (Axis a : {Axis::DpReplicate, Axis::DpShard, Axis::Sp, Axis::Tp, Axis::ExpertDp, Axis::Ep, Axis::Etp}) {
    std::map<int, std::set<int>> by_color;
    for (int r = 0; r < W; ++r) {
      std::vector<int> g = m.group(a, r);
      ASSERT_EQ(int(g.size()), m.size(a)) << axis_name(a);
      EXPECT_EQ(g[size_t(m.coord(a, r))], r) << axis_name(a);
      for (int q : g) {
        EXPECT_EQ(m.group(a, q), g) << axis_name(a);
        EXPECT_EQ(m.group_color(a, q), m.group_color(a, r)) << axis_name(a);
      }
      by_color[m.group_color(a, r)].insert(r);
    }
    EXPECT_EQ(int(by_color.size()), W / m.size(a)) << axis_name(a);
  }
  std::set<std::vector<int>> coords;
  for (int r = 0; r < W; ++r)
    coords.insert({m.coord(Axis::DpReplicate, r), m.coord(Axis::DpShard, r), m.coord(Axis::Sp, r), m.coord(Axis::Tp, r)});
  EXPECT_EQ(int(coords.size()), W);
  // tp varies fastest, dp_replicate slowest.
  EXPECT_EQ(m.group(Axis::Tp, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.group(Axis::DpReplicate, 0), (std::vector<int>{0, 8}));
  EXPECT_EQ(m.dp_group(1), (std::vector<int>{1, 5, 9, 13}));
  EXPECT_EQ(m.dp_color(5), m.dp_color(13));
}
