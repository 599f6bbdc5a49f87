// Tests of the expert-parallel token dispatcher (moe/dispatcher.h), ranks as threads over Gloo.
// Routing is checked exactly with self-describing rows: each token row holds its source rank, its
// token index and its K expert ids, so a row that lands in the wrong expert block, on the wrong
// rank or in the wrong order is visible as such. Gradients are compared bit for bit with the
// single-device ops on the concatenated tokens, and with finite differences where tokens are dropped.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "comm/comm_test_util.h"
#include "core/rng.h"
#include "moe/dispatcher.h"
#include "ops/fd_check.h"
#include "ops/ops.h"
#include "parallel/mesh.h"
#include "test_util.h"

namespace mt::moe {
namespace {

using comm::Communicator;
using comm::testing::no_errors;
using comm::testing::run_ranks;
using namespace std::chrono_literals;

comm::CommOptions opt() {
  comm::CommOptions o;
  o.timeout = 20s;
  return o;
}

// Every collective compared across ranks before it runs, all_to_all_v counts included: a plan whose
// send counts on one rank disagree with the receive counts on another fails here, by name.
comm::CommOptions opt_per_op() {
  comm::CommOptions o = opt();
  o.schedule_check = comm::ScheduleCheck::PerOp;
  return o;
}

// A macro, not a function: GTEST_SKIP() returns from the function it is in, and must end the test.
#define MT_SKIP_WITHOUT_GLOO(ep) \
  if ((ep) > 1 && !comm::have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo"


// Deterministic routing of source rank `src`: K distinct experts per token, never one of `avoid`.
Tensor routing(int src, int64_t T, int64_t K, int64_t E, const std::set<int64_t>& avoid, uint64_t seed = 1) {
  std::vector<int32_t> allowed;
  for (int64_t e = 0; e < E; ++e)
    if (!avoid.count(e)) allowed.push_back(int32_t(e));
  MT_CHECK(int64_t(allowed.size()) >= K, "test routing: too few experts");
  Rng rng(seed * 1000 + uint64_t(src));
  Tensor idx = Tensor::empty({T, K}, DType::I32);
  int32_t* p = idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      int64_t j = rng.randint(0, int64_t(allowed.size()));
      // Probe forward to an expert this token has not chosen yet.
      while (std::find(p + t * K, p + t * K + k, allowed[size_t(j)]) != p + t * K + k)
        j = (j + 1) % int64_t(allowed.size());
      p[t * K + k] = allowed[size_t(j)];
    }
  }
  return idx;
}

// Self-describing token rows: (source rank, token, e_0 .. e_{K-1}, 1000 * src + t + 0.5, 0 ...).
constexpr int64_t kD = 8;
Tensor describing_rows(int src, const Tensor& idx_TK) {
  const int64_t T = idx_TK.size(0), K = idx_TK.size(1);
  Tensor x = Tensor::zeros({T, kD});
  for (int64_t t = 0; t < T; ++t) {
    float* r = x.data<float>() + t * kD;
    r[0] = float(src);
    r[1] = float(t);
    for (int64_t k = 0; k < K; ++k) r[2 + k] = float(idx_TK.data<int32_t>()[t * K + k]);
    r[2 + K] = float(1000 * src + t) + 0.5f;
  }
  return x;
}

// Dyadic weights (multiples of 1/8), so that sums of weight * small integer are exact in f32.
Tensor dyadic_weights(int src, int64_t T, int64_t K) {
  Tensor w = Tensor::empty({T, K});
  for (int64_t i = 0; i < T * K; ++i) w.data<float>()[i] = float(1 + (i + src) % 5) / 8.0f;
  return w;
}

int64_t tokens_of(int src, int ep) {
  return (ep == 4 && src == 1) ? 0 : 5 + 3 * src;
}

// ---- routing, exactly ----

struct Layout {
  int ep;
  int64_t E;
};
void PrintTo(const Layout& l, std::ostream* os) {
  *os << "ep " << l.ep << ", E " << l.E;
}

class DispatcherRouting : public ::testing::TestWithParam<Layout> {};

TEST_P(DispatcherRouting, SelfDescribingRowsLandInTheirExpertBlockInOrder) {
  const int ep = GetParam().ep;
  const int64_t E = GetParam().E, K = 2, L = E / ep;
  MT_SKIP_WITHOUT_GLOO(ep);
  // Experts 1, E-2 and E-1 receive nothing from anyone; with L = 2 the last rank receives nothing.
  const std::set<int64_t> avoid = {1, E - 2, E - 1};
  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        ExpertDispatcher d(comm, E);
        EXPECT_EQ(d.local_experts(), L);
        const int64_t T = tokens_of(rank, ep);
        Tensor idx = routing(rank, T, K, E, avoid), x = describing_rows(rank, idx), w = dyadic_weights(rank, T, K);
        DispatchPlan plan = d.prepare(idx);
        Tensor xr = d.dispatch(plan, x);
        ASSERT_EQ(xr.size(0), plan.rows_received);
        ASSERT_EQ(int64_t(plan.local_offsets_host.size()), L + 1);

        // What every expert of this rank must receive: sources ascending, tokens in assignment order.
        int64_t total = 0;
        for (int64_t l = 0; l < L; ++l) {
          const int64_t e = rank * L + l;
          std::vector<std::pair<int, int64_t>> want;  // (source, token)
          for (int s = 0; s < ep; ++s) {
            Tensor idx_s = routing(s, tokens_of(s, ep), K, E, avoid);
            for (int64_t a = 0; a < idx_s.numel(); ++a)
              if (idx_s.data<int32_t>()[a] == e) want.emplace_back(s, a / K);
          }
          const int64_t b = plan.local_offsets_host[size_t(l)], n = plan.local_offsets_host[size_t(l) + 1] - b;
          ASSERT_EQ(n, int64_t(want.size())) << "expert " << e << " on ep rank " << rank;
          if (avoid.count(e)) {
            EXPECT_EQ(n, 0) << "expert " << e << " was never chosen";
          }
          for (int64_t i = 0; i < n; ++i) {
            const float* row = xr.data<float>() + (b + i) * kD;
            const auto [s, t] = want[size_t(i)];
            EXPECT_EQ(row[0], float(s)) << "expert " << e << " row " << i;
            EXPECT_EQ(row[1], float(t)) << "expert " << e << " row " << i;
            bool names_e = false;
            for (int64_t k = 0; k < K; ++k) names_e |= row[2 + k] == float(e);
            EXPECT_TRUE(names_e) << "row from source " << row[0] << " token " << row[1] << " sits in expert " << e
                                 << " but chose " << row[2] << ", " << row[3];
            EXPECT_EQ(row[2 + K], float(1000 * s + t) + 0.5f);
          }
          total += n;
        }
        EXPECT_EQ(total, plan.rows_received);
        // An expert that is the identity: combine returns sum_k w[t,k] * x[t] (exact: dyadic weights).
        Combined c = d.combine(plan, xr, w);
        ASSERT_EQ(c.y_TD.shape(), (Shape{T, kD}));
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t j = 0; j < kD; ++j) {
            float want = 0;
            for (int64_t k = 0; k < K; ++k) want += w.data<float>()[t * K + k] * x.data<float>()[t * kD + j];
            EXPECT_EQ(c.y_TD.data<float>()[t * kD + j], want) << "token " << t << " column " << j;
          }
        }
      },
      opt_per_op());
  EXPECT_EQ(errors, no_errors(ep));
}

INSTANTIATE_TEST_SUITE_P(Layouts, DispatcherRouting,
                         ::testing::Values(Layout{1, 8}, Layout{2, 8}, Layout{4, 8}, Layout{3, 6}),
                         [](const auto& info) {
                           return "ep" + std::to_string(info.param.ep) + "_E" + std::to_string(info.param.E);
                         });

// ---- ep = 1 is the single-device path ----

void expect_same(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << what << " differs";
}

TEST(Dispatcher, Ep1IsExactlyTheSingleDevicePath) {
  auto errors = run_ranks(
      1,
      [&](int, Communicator& comm) {
        const int64_t T = 9, K = 3, E = 5, D = 6;
        Rng rng(7);
        Tensor idx = routing(0, T, K, E, {2}), x = testing::random_tensor({T, D}, rng);
        Tensor w = testing::random_tensor({T, K}, rng, 0.f, 1.f), dy = testing::random_tensor({T, D}, rng);
        ExpertDispatcher d(comm, E);
        DispatchPlan plan = d.prepare(idx, w);

        Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({T * K}, DType::I32);
        Tensor roa = Tensor::empty({T, K}, DType::I32);
        ops::make_dispatch_plan(idx, E, off, aor, roa);
        expect_same(plan.send_offsets_E1, off, "offsets");
        expect_same(plan.local_offsets, off, "local offsets");
        expect_same(plan.send_assign_of_row_S, aor, "assign_of_row");
        expect_same(plan.row_of_assign_TK, roa, "row_of_assign");
        EXPECT_TRUE(plan.regroup_identity);

        Tensor xp = Tensor::empty({T * K, D});
        ops::permute_fwd(x, aor, K, xp);
        Tensor xr = d.dispatch(plan, x);
        expect_same(xr, xp, "dispatched rows");
        Tensor yp = testing::random_tensor({T * K, D}, rng), y = Tensor::empty({T, D});
        ops::unpermute_fwd(yp, roa, w, y);
        Combined c = d.combine(plan, yp, w);
        expect_same(c.y_TD, y, "combined output");
        EXPECT_EQ(c.ys_SD.raw(), yp.raw()) << "ep = 1 without drops saves yr itself";

        Tensor dyp = Tensor::empty({T * K, D}), dw = Tensor::empty({T, K});
        ops::unpermute_bwd(dy, yp, roa, w, dyp, dw);
        CombineGrads g = d.combine_bwd(plan, dy, c.ys_SD, w);
        expect_same(g.dyr_RD, dyp, "dyr");
        expect_same(g.dw_TK, dw, "dw");
        Tensor dx = Tensor::zeros({T, D});
        ops::permute_bwd(dyp, aor, K, dx);
        expect_same(d.dispatch_bwd(plan, dyp), dx, "dx");
        EXPECT_TRUE(comm.history().empty()) << "ep = 1 issues no collective";
      },
      opt());
  EXPECT_EQ(errors, no_errors(1));
}

// ---- gradients: ep ranks against the single-device ops on the concatenated tokens ----

// A row-wise "expert" that depends on the expert: f_e(v) = c_e * v^2, f'_e(v) = 2 c_e v.
float expert_coef(int64_t e) {
  return 0.5f + 0.25f * float(e);
}
Tensor apply_experts(const Tensor& xr, const std::vector<int64_t>& offsets, int64_t first_expert, bool derivative) {
  Tensor y = Tensor::empty(xr.shape());
  const int64_t D = xr.size(1);
  for (size_t l = 0; l + 1 < offsets.size(); ++l) {
    const float c = expert_coef(first_expert + int64_t(l));
    for (int64_t i = offsets[l] * D; i < offsets[l + 1] * D; ++i) {
      const float v = xr.data<float>()[i];
      y.data<float>()[i] = derivative ? 2.0f * c * v : c * v * v;
    }
  }
  return y;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor y = Tensor::empty(a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) y.data<float>()[i] = a.data<float>()[i] * b.data<float>()[i];
  return y;
}

struct Source {
  Tensor idx, x, w, dy;
};
Source source_data(int s, int64_t T, int64_t K, int64_t E, int64_t D) {
  Rng rng(100 + uint64_t(s));
  Source src;
  src.idx = routing(s, T, K, E, {0}, 3);  // expert 0 unused
  src.x = testing::random_tensor({T, D}, rng);
  src.w = testing::random_tensor({T, K}, rng, 0.05f, 1.f);
  src.dy = testing::random_tensor({T, D}, rng);
  return src;
}

Tensor concat_rows(const std::vector<Tensor>& parts) {
  int64_t n = 0;
  for (const Tensor& p : parts) n += p.size(0);
  Shape s = parts[0].shape();
  s[0] = n;
  Tensor out = Tensor::empty(s, parts[0].dtype());
  int64_t at = 0;
  for (const Tensor& p : parts) {
    out.rows(at, p.size(0)).copy_from(p);
    at += p.size(0);
  }
  return out;
}

class DispatcherGrads : public ::testing::TestWithParam<Layout> {};

TEST_P(DispatcherGrads, OutputAndGradientsEqualTheSingleDeviceOpsBitForBit) {
  const int ep = GetParam().ep;
  const int64_t E = GetParam().E, K = 2, D = 5;
  MT_SKIP_WITHOUT_GLOO(ep);
  auto T_of = [](int s) { return int64_t(4 + 2 * s); };
  // The reference: one device, all sources' tokens concatenated, the ops the model runs today.
  std::vector<Tensor> idxs, xs, ws, dys;
  for (int s = 0; s < ep; ++s) {
    Source src = source_data(s, T_of(s), K, E, D);
    idxs.push_back(src.idx), xs.push_back(src.x), ws.push_back(src.w), dys.push_back(src.dy);
  }
  Tensor idx = concat_rows(idxs), x = concat_rows(xs), w = concat_rows(ws), dy = concat_rows(dys);
  const int64_t T = idx.size(0), R = T * K;
  Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({R}, DType::I32);
  Tensor roa = Tensor::empty({T, K}, DType::I32), xp = Tensor::empty({R, D}), y = Tensor::empty({T, D});
  ops::make_dispatch_plan(idx, E, off, aor, roa);
  ops::permute_fwd(x, aor, K, xp);
  const int64_t* o = off.data<int64_t>();
  const std::vector<int64_t> offv(o, o + E + 1);
  Tensor yp = apply_experts(xp, offv, 0, false);
  ops::unpermute_fwd(yp, roa, w, y);
  Tensor dyp = Tensor::empty({R, D}), dw = Tensor::empty({T, K}), dx = Tensor::zeros({T, D});
  ops::unpermute_bwd(dy, yp, roa, w, dyp, dw);
  ops::permute_bwd(mul(dyp, apply_experts(xp, offv, 0, true)), aor, K, dx);

  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        Source src = source_data(rank, T_of(rank), K, E, D);
        int64_t first = 0;
        for (int s = 0; s < rank; ++s) first += T_of(s);
        ExpertDispatcher d(comm, E);
        DispatchPlan plan = d.prepare(src.idx, src.w);
        Tensor xr = d.dispatch(plan, src.x);
        Tensor yr = apply_experts(xr, plan.local_offsets_host, d.first_local_expert(), false);
        Combined c = d.combine(plan, yr, src.w);
        CombineGrads g = d.combine_bwd(plan, src.dy, c.ys_SD, src.w);
        Tensor dxr = mul(g.dyr_RD, apply_experts(xr, plan.local_offsets_host, d.first_local_expert(), true));
        Tensor dx_r = d.dispatch_bwd(plan, dxr);
        // In two halves (the model starts it from experts_bwd's after_dx): the same rows, added.
        DispatchBwdPending back = d.dispatch_bwd_start(plan, dxr);
        Tensor dx_halves = Tensor::zeros({T_of(rank), D});
        d.dispatch_bwd_finish(plan, back, dx_halves);
        expect_same(dx_halves, dx.rows(first, T_of(rank)).clone(), "dx (start, finish)");
        expect_same(c.y_TD, y.rows(first, T_of(rank)).clone(), "y");
        expect_same(g.dw_TK, dw.rows(first, T_of(rank)).clone(), "dw");
        expect_same(dx_r, dx.rows(first, T_of(rank)).clone(), "dx");
        // The expert side holds exactly the reference rows of its experts, in the same expert order.
        const int64_t b = o[d.first_local_expert()], n = o[d.first_local_expert() + d.local_experts()] - b;
        ASSERT_EQ(xr.size(0), n);
        // Within an expert the order is source-major, then assignment order: the reference's
        // token order over the concatenated sources.
        expect_same(xr, xp.rows(b, n).clone(), "expert-side rows");
      },
      opt_per_op());
  EXPECT_EQ(errors, no_errors(ep));
}

INSTANTIATE_TEST_SUITE_P(Layouts, DispatcherGrads, ::testing::Values(Layout{2, 4}, Layout{4, 8}, Layout{3, 6}),
                         [](const auto& info) {
                           return "ep" + std::to_string(info.param.ep) + "_E" + std::to_string(info.param.E);
                         });

// ---- an ep group split from a larger world by the device mesh ----

TEST(Dispatcher, WorksOnTheEpGroupsOfADeviceMesh) {
  const int world = 4;
  const int64_t E = 4, K = 2, D = 3, T = 5;
  MT_SKIP_WITHOUT_GLOO(world);
  const DeviceMesh mesh(MeshSpec{.ep = 2}, world);  // expert_dp 2 × ep 2: ep groups {0, 1} and {2, 3}
  mesh.check_experts(int(E));
  auto errors = run_ranks(
      world,
      [&](int rank, Communicator& comm) {
        auto ep_comm = comm.split(mesh.group_color(Axis::Ep, rank), mesh.coord(Axis::Ep, rank), "ep");
        ASSERT_TRUE(ep_comm);
        EXPECT_EQ(ep_comm->size(), 2);
        const std::vector<int> group = mesh.group(Axis::Ep, rank);
        // The single-device reference over this group's tokens (sources seeded by world rank).
        std::vector<Tensor> idxs, xs, ws;
        for (int s : group) {
          Source src = source_data(s, T, K, E, D);
          idxs.push_back(src.idx), xs.push_back(src.x), ws.push_back(src.w);
        }
        Tensor idx = concat_rows(idxs), x = concat_rows(xs), w = concat_rows(ws);
        const int64_t TG = idx.size(0);
        Tensor off = Tensor::empty({E + 1}, DType::I64), aor = Tensor::empty({TG * K}, DType::I32);
        Tensor roa = Tensor::empty({TG, K}, DType::I32), xp = Tensor::empty({TG * K, D}), y = Tensor::empty({TG, D});
        ops::make_dispatch_plan(idx, E, off, aor, roa);
        ops::permute_fwd(x, aor, K, xp);
        const int64_t* o = off.data<int64_t>();
        ops::unpermute_fwd(apply_experts(xp, std::vector<int64_t>(o, o + E + 1), 0, false), roa, w, y);

        Source mine = source_data(rank, T, K, E, D);
        ExpertDispatcher d(*ep_comm, E);
        DispatchPlan plan = d.prepare(mine.idx);
        Tensor xr = d.dispatch(plan, mine.x);
        Combined c = d.combine(plan, apply_experts(xr, plan.local_offsets_host, d.first_local_expert(), false), mine.w);
        expect_same(c.y_TD, y.rows(ep_comm->rank() * T, T).clone(), "y");
        EXPECT_TRUE(comm.history().size() == 1u) << "only the split ran on the world communicator";
      },
      opt());
  EXPECT_EQ(errors, no_errors(world));
}

// ---- finite differences through the whole dispatch -> expert -> combine, with and without drops ----

class DispatcherFiniteDiff : public ::testing::TestWithParam<double> {};

TEST_P(DispatcherFiniteDiff, GradientsOfXAndWeightsMatchFiniteDifferences) {
  const double cf = GetParam();
  const int ep = 2;
  const int64_t E = 4, K = 2, D = 3, T = 5;
  MT_SKIP_WITHOUT_GLOO(ep);
  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        Rng rng(40 + uint64_t(rank));
        Tensor idx = routing(rank, T, K, E, {}, 9);
        Tensor x = testing::random_tensor({T, D}, rng), w = testing::random_tensor({T, K}, rng, 0.1f, 1.f);
        Tensor r = testing::random_tensor({T, D}, rng);
        ExpertDispatcher d(comm, E, DispatcherOptions{cf});
        const DispatchPlan plan = d.prepare(idx, w);  // fixed routing: the gradient is at this decision
        if (cf > 0) {
          EXPECT_GT(plan.n_dropped, 0) << "the capacity should drop something here";
        }
        auto forward = [&](Tensor& xr_out, Combined& c) {
          xr_out = d.dispatch(plan, x);
          c = d.combine(plan, apply_experts(xr_out, plan.local_offsets_host, d.first_local_expert(), false), w);
        };
        Tensor xr;
        Combined c;
        forward(xr, c);
        CombineGrads g = d.combine_bwd(plan, r, c.ys_SD, w);
        Tensor dx = d.dispatch_bwd(
            plan, mul(g.dyr_RD, apply_experts(xr, plan.local_offsets_host, d.first_local_expert(), true)));
        // L = sum(r * y) over this rank's tokens. y of a token depends only on that token's x and w,
        // so perturbing rank s's inputs changes only rank s's L; every rank still runs every forward.
        auto fd = [&](Tensor& p, int owner, int64_t n) {
          Tensor num = Tensor::zeros({n});
          const double eps = 1e-2;
          for (int64_t i = 0; i < n; ++i) {
            double lp = 0, lm = 0;
            float orig = 0, up = 0, dn = 0;
            if (rank == owner) {
              orig = p.data<float>()[i], up = float(orig + eps), dn = float(orig - eps);
              p.data<float>()[i] = up;
            }
            forward(xr, c);
            lp = testing::weighted_sum(c.y_TD, r);
            if (rank == owner) p.data<float>()[i] = dn;
            forward(xr, c);
            lm = testing::weighted_sum(c.y_TD, r);
            if (rank == owner) {
              p.data<float>()[i] = orig;
              num.data<float>()[i] = float((lp - lm) / (double(up) - double(dn)));
            }
          }
          return num;
        };
        for (int owner = 0; owner < ep; ++owner) {
          Tensor num_x = fd(x, owner, T * D), num_w = fd(w, owner, T * K);
          if (rank != owner) continue;
          EXPECT_LT(testing::rel_l2(dx, num_x), 1e-3) << "dx, ep rank " << rank;
          EXPECT_LT(testing::rel_l2(g.dw_TK, num_w), 1e-3) << "dw, ep rank " << rank;
        }
        for (int64_t a = 0; a < T * K; ++a) {
          if (plan.row_of_assign_TK.data<int32_t>()[a] == plan.rows_sent) {
            EXPECT_EQ(g.dw_TK.data<float>()[a], 0.0f) << "dropped assignment " << a;
          }
        }
      },
      opt());
  EXPECT_EQ(errors, no_errors(ep));
}

INSTANTIATE_TEST_SUITE_P(CapacityFactor, DispatcherFiniteDiff, ::testing::Values(0.0, 0.5),
                         [](const auto& info) { return info.param == 0 ? "dropless" : "cf0_5"; });

// ---- capacity ----

TEST(Dispatcher, CapacityFollowsMegatron) {
  EXPECT_EQ(expert_capacity(8, 2, 4, 0.5), 2);
  EXPECT_EQ(expert_capacity(10, 2, 8, 1.0), 3);  // 2.5 rounds up
  EXPECT_EQ(expert_capacity(8, 2, 4, 1.25), 5);
  EXPECT_EQ(expert_capacity(0, 2, 4, 1.0), 0);
  EXPECT_NE(testutil::error_of([] { expert_capacity(8, 2, 4, -1); }).find("capacity_factor (-1)"), std::string::npos);
}

TEST(Dispatcher, CapacityDropsExactlyTheLowestWeightAssignmentsBeyondCapacity) {
  const int ep = 2;
  const int64_t E = 4, K = 2, T = 8, L = E / ep;
  const double cf = 0.5;  // capacity ceil(8 * 2 / 4 * 0.5) = 2 per expert per source
  MT_SKIP_WITHOUT_GLOO(ep);
  // Weights on a coarse grid so that ties happen (the lower assignment index wins a tie).
  auto weights = [&](int s) {
    Tensor w = Tensor::empty({T, K});
    Rng rng(500 + uint64_t(s));
    for (int64_t i = 0; i < T * K; ++i) w.data<float>()[i] = float(rng.randint(1, 5)) / 8.0f;
    return w;
  };
  // The expected kept set, by brute force over (weight desc, assignment asc) per expert.
  auto kept_set = [&](int s) {
    Tensor idx = routing(s, T, K, E, {3}, 11), w = weights(s);  // expert 3 gets nothing
    std::vector<char> kept(size_t(T * K), 0);
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> as;
      for (int64_t a = 0; a < T * K; ++a)
        if (idx.data<int32_t>()[a] == e) as.push_back(a);
      std::stable_sort(as.begin(), as.end(),
                       [&](int64_t a, int64_t b) { return w.data<float>()[a] > w.data<float>()[b]; });
      for (size_t i = 0; i < as.size() && i < 2; ++i) kept[size_t(as[i])] = 1;
    }
    return kept;
  };
  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        Tensor idx = routing(rank, T, K, E, {3}, 11), w = weights(rank), x = describing_rows(rank, idx);
        ExpertDispatcher d(comm, E, DispatcherOptions{cf});
        DispatchPlan plan = d.prepare(idx, w);
        EXPECT_EQ(plan.capacity, 2);
        const std::vector<char> kept = kept_set(rank);
        int64_t n_kept = 0;
        for (int64_t a = 0; a < T * K; ++a) {
          const bool dropped = plan.row_of_assign_TK.data<int32_t>()[a] == plan.rows_sent;
          EXPECT_EQ(dropped, !kept[size_t(a)]) << "assignment " << a << " (token " << a / K << ", choice " << a % K
                                               << ", weight " << w.data<float>()[a] << ")";
          n_kept += kept[size_t(a)];
        }
        EXPECT_EQ(plan.rows_sent, n_kept);
        EXPECT_EQ(plan.n_dropped, T * K - n_kept);
        EXPECT_GT(plan.n_dropped, 0);

        // The experts receive exactly the kept assignments of every source, in order.
        Tensor xr = d.dispatch(plan, x);
        for (int64_t l = 0; l < L; ++l) {
          const int64_t e = rank * L + l;
          std::vector<std::pair<int, int64_t>> want;
          for (int s = 0; s < ep; ++s) {
            Tensor idx_s = routing(s, T, K, E, {3}, 11);
            const std::vector<char> kept_s = kept_set(s);
            int64_t from_s = 0;
            for (int64_t a = 0; a < T * K; ++a)
              if (idx_s.data<int32_t>()[a] == e && kept_s[size_t(a)]) want.emplace_back(s, a / K), ++from_s;
            EXPECT_LE(from_s, plan.capacity);
            EXPECT_EQ(plan.recv_counts_SL[size_t(s * L + l)], from_s);
          }
          const int64_t b = plan.local_offsets_host[size_t(l)];
          ASSERT_EQ(plan.local_offsets_host[size_t(l) + 1] - b, int64_t(want.size())) << "expert " << e;
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_EQ(xr.data<float>()[(b + int64_t(i)) * kD + 0], float(want[i].first));
            EXPECT_EQ(xr.data<float>()[(b + int64_t(i)) * kD + 1], float(want[i].second));
          }
        }
        // Identity expert: y = sum over kept k of w * x (exact: dyadic weights, integer rows).
        Combined c = d.combine(plan, xr, w);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t j = 0; j < kD; ++j) {
            float want = 0;
            for (int64_t k = 0; k < K; ++k)
              if (kept[size_t(t * K + k)]) want += w.data<float>()[t * K + k] * x.data<float>()[t * kD + j];
            EXPECT_EQ(c.y_TD.data<float>()[t * kD + j], want) << "token " << t << " column " << j;
          }
        }
        // Weight gradients: <dy, x_t> for kept, exactly 0 for dropped; dx sums only kept copies.
        Tensor dy = Tensor::empty({T, kD});
        for (int64_t i = 0; i < T * kD; ++i) dy.data<float>()[i] = float(i % 3) - 1.0f;
        CombineGrads g = d.combine_bwd(plan, dy, c.ys_SD, w);
        Tensor dx = d.dispatch_bwd(plan, g.dyr_RD);
        for (int64_t t = 0; t < T; ++t) {
          double wsum = 0;
          for (int64_t k = 0; k < K; ++k) {
            double dot = 0;
            for (int64_t j = 0; j < kD; ++j) dot += double(dy.data<float>()[t * kD + j]) * x.data<float>()[t * kD + j];
            const bool keep = kept[size_t(t * K + k)];
            EXPECT_EQ(g.dw_TK.data<float>()[t * K + k], keep ? float(dot) : 0.0f) << "token " << t << " k " << k;
            if (keep) wsum += w.data<float>()[t * K + k];
          }
          for (int64_t j = 0; j < kD; ++j)
            EXPECT_FLOAT_EQ(dx.data<float>()[t * kD + j], float(wsum * dy.data<float>()[t * kD + j]));
        }
      },
      opt());
  EXPECT_EQ(errors, no_errors(ep));
}

TEST(Dispatcher, LargeCapacityDropsNothingAndEqualsDropless) {
  const int ep = 2;
  const int64_t E = 4, K = 2, T = 6;
  MT_SKIP_WITHOUT_GLOO(ep);
  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        Tensor idx = routing(rank, T, K, E, {}, 5), w = dyadic_weights(rank, T, K), x = describing_rows(rank, idx);
        ExpertDispatcher capped(comm, E, DispatcherOptions{100.0}), dropless(comm, E);
        DispatchPlan pc = capped.prepare(idx, w), pd = dropless.prepare(idx);
        EXPECT_EQ(pc.n_dropped, 0);
        EXPECT_FALSE(pc.has_drops());
        expect_same(pc.row_of_assign_TK, pd.row_of_assign_TK, "row_of_assign");
        expect_same(capped.dispatch(pc, x), dropless.dispatch(pd, x), "dispatched rows");
      },
      opt());
  EXPECT_EQ(errors, no_errors(ep));
}

// ---- the collective schedule: one counts exchange in prepare, one all_to_all_v per call after ----

TEST(Dispatcher, PlanIsReusedWithoutNewDecisions) {
  const int ep = 2;
  const int64_t E = 4, K = 2, T = 5;
  MT_SKIP_WITHOUT_GLOO(ep);
  auto errors = run_ranks(
      ep,
      [&](int rank, Communicator& comm) {
        Tensor idx = routing(rank, T, K, E, {}, 2), w = dyadic_weights(rank, T, K), x = describing_rows(rank, idx);
        ExpertDispatcher d(comm, E);
        DispatchPlan plan = d.prepare(idx);
        EXPECT_EQ(comm.history().size(), 1u);
        Tensor xr1 = d.dispatch(plan, x);
        Combined c = d.combine(plan, xr1, w);
        Tensor xr2 = d.dispatch(plan, x);  // a recompute
        expect_same(xr2, xr1, "recomputed dispatch");
        auto h = comm.history();
        ASSERT_EQ(h.size(), 4u);
        for (const auto& rec : h) EXPECT_EQ(rec.op, "all_to_all_v");
        EXPECT_EQ(h[0].dtype, DType::I64);
        EXPECT_EQ(h[0].count, E) << "the counts exchange sends E counts (L per rank)";
        comm.check_schedule();
      },
      opt());
  EXPECT_EQ(errors, no_errors(ep));
}

// ---- errors ----

TEST(Dispatcher, ExpertsNotDivisibleByEpNamesBothNumbers) {
  MT_SKIP_WITHOUT_GLOO(4);
  auto errors = run_ranks(
      4,
      [&](int, Communicator& comm) {
        const std::string m = testutil::error_of([&] { ExpertDispatcher d(comm, 6); });
        EXPECT_NE(m.find("num_experts (6) must be divisible by ep (4)"), std::string::npos) << m;
        comm.barrier();  // no rank tears the group down while another is still connecting
      },
      opt());
  EXPECT_EQ(errors, no_errors(4));
}

TEST(Dispatcher, BadInputsAreNamed) {
  auto errors = run_ranks(
      1,
      [&](int, Communicator& comm) {
        using testutil::error_of;
        ExpertDispatcher d(comm, 4);
        Tensor idx = routing(0, 4, 2, 4, {});
        idx.data<int32_t>()[2 * 2 + 1] = 9;
        std::string m = error_of([&] { d.prepare(idx); });
        EXPECT_NE(m.find("token 2"), std::string::npos) << m;
        EXPECT_NE(m.find("expert id 9"), std::string::npos) << m;
        idx.data<int32_t>()[2 * 2 + 1] = -1;
        m = error_of([&] { d.prepare(idx); });
        EXPECT_NE(m.find("expert id -1"), std::string::npos) << m;

        Tensor good = routing(0, 4, 2, 4, {});
        m = error_of([&] { d.prepare(Tensor::zeros({4, 2})); });
        EXPECT_NE(m.find("topk_idx_TK must be i32 [T, K]"), std::string::npos) << m;
        m = error_of([&] { d.prepare(good, Tensor::zeros({4, 3})); });
        EXPECT_NE(m.find("expected f32 [4, 2]"), std::string::npos) << m;

        ExpertDispatcher capped(comm, 4, DispatcherOptions{1.0});
        m = error_of([&] { capped.prepare(good); });
        EXPECT_NE(m.find("needs the routing weights"), std::string::npos) << m;
        m = error_of([&] { ExpertDispatcher bad(comm, 4, DispatcherOptions{-0.5}); });
        EXPECT_NE(m.find("capacity_factor (-0.5) must be >= 0"), std::string::npos) << m;

        DispatchPlan plan = d.prepare(good);
        m = error_of([&] { d.dispatch(plan, Tensor::zeros({5, 3})); });
        EXPECT_NE(m.find("x_TD is f32[5, 3] cpu; expected [4, D]"), std::string::npos) << m;
        m = error_of([&] { d.combine(plan, Tensor::zeros({7, 3}), Tensor::zeros({4, 2})); });
        EXPECT_NE(m.find("expected [8, D]"), std::string::npos) << m;
        m = error_of([&] { d.combine(plan, Tensor::zeros({8, 3}), Tensor::zeros({4, 1})); });
        EXPECT_NE(m.find("w_TK is f32[4, 1] cpu; expected f32 [4, 2]"), std::string::npos) << m;
        ExpertDispatcher other(comm, 8);
        m = error_of([&] { other.dispatch(plan, Tensor::zeros({4, 3})); });
        EXPECT_NE(m.find("the plan was made for ep rank 0 of 1 with 4 experts"), std::string::npos) << m;
      },
      opt());
  EXPECT_EQ(errors, no_errors(1));
}

}  // namespace
}  // namespace mt::moe
