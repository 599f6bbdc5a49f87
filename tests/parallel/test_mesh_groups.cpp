// Device mesh groups over several dense axes (used by sequence parallelism: dp_shard × sp for the
// dense parameter shards, dp × sp for the batch statistics): a color shared exactly by the ranks
// that differ only along those axes, and a coordinate in folding order, checked by brute force.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "parallel/mesh.h"

using namespace mt;

TEST(MeshGroups, MultiAxisColorsAndCoordinatesMatchBruteForce) {
  MeshSpec s;
  s.dp_replicate = 2;
  s.dp_shard = 2;
  s.sp = 2;
  s.tp = 2;
  DeviceMesh m(s, 16);
  const Axis all[] = {Axis::DpReplicate, Axis::DpShard, Axis::Sp, Axis::Tp};
  auto check = [&](std::initializer_list<Axis> axes, int want_size) {
    EXPECT_EQ(m.group_size(axes), want_size);
    std::map<int, std::set<int>> coords_of_color;
    for (int a = 0; a < 16; ++a)
      for (int b = 0; b < 16; ++b) {
        bool same_outside = true;
        for (Axis x : all) {
          bool in = false;
          for (Axis y : axes) in = in || x == y;
          if (!in && m.coord(x, a) != m.coord(x, b)) same_outside = false;
        }
        EXPECT_EQ(m.group_color(axes, a) == m.group_color(axes, b), same_outside) << a << " " << b;
      }
    for (int r = 0; r < 16; ++r) {
      int want = 0;
      for (Axis x : all)
        for (Axis y : axes)
          if (x == y) want = want * m.size(x) + m.coord(x, r);
      EXPECT_EQ(m.group_coord(axes, r), want) << r;
      EXPECT_TRUE(coords_of_color[m.group_color(axes, r)].insert(m.group_coord(axes, r)).second) << r;
    }
    for (auto& [color, coords] : coords_of_color) EXPECT_EQ(int(coords.size()), want_size) << color;
  };
  check({Axis::DpShard, Axis::Sp}, 4);
  check({Axis::DpReplicate, Axis::DpShard, Axis::Sp}, 8);
  check({Axis::Sp}, 2);
  // dp × sp: the coordinate is dp_rank × sp + sp coordinate (what moetrain grads relies on).
  for (int r = 0; r < 16; ++r)
    EXPECT_EQ(m.group_coord({Axis::DpReplicate, Axis::DpShard, Axis::Sp}, r),
              (m.coord(Axis::DpReplicate, r) * 2 + m.coord(Axis::DpShard, r)) * 2 + m.coord(Axis::Sp, r));
}
