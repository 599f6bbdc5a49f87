// Every CPU collective on 1, 2, 3 and 4 ranks (threads, one Gloo context each; one rank is the
// "self" communicator), with self-describing data: element i of rank r holds f(r, i), so a wrong
// block, offset or reduction shows as a wrong value at a known place. Then split groups, send/recv,
// and the argument errors a user sees.
#include <gtest/gtest.h>

#include <cmath>

#include "comm/comm_test_util.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using namespace std::chrono_literals;
using testing::no_errors;
using testing::run_ranks;
using testutil::error_of;

// f(r, i): distinct per rank and index, exact in every dtype used (bf16 holds integers to 256).
double value_of(DType dt, int r, int64_t i) {
  if (dt == DType::BF16 || dt == DType::F16) return double(r * 32 + i % 32);
  return double(r * 1000 + i);
}


// Compares t[i] with want(i) for every i; reports the first few mismatches with their place.
void expect_values(const Tensor& t, const std::function<double(int64_t)>& want, const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < t.numel() && bad < 5; ++i) {
    if (host_value_at(t, i) != want(i)) {
      ADD_FAILURE() << what << ": element " << i << " is " << host_value_at(t, i) << ", expected " << want(i);
      ++bad;
    }
  }
}

const DType kAllDTypes[] = {DType::F32, DType::I32, DType::I64, DType::BF16};

class GlooCollectives : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (GetParam() > 1 && !have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo";
  }
  CommOptions opt() const {
    CommOptions o;
    o.timeout = 20s;
    return o;
  }
};

TEST_P(GlooCollectives, AllGather) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        EXPECT_EQ(c.rank(), r);
        EXPECT_EQ(c.size(), n);
        for (DType dt : kAllDTypes) {
          for (int64_t count : {int64_t(0), int64_t(1), int64_t(5), int64_t(4099)}) {
            Tensor in = host_tensor_from(dt, count, [&](int64_t i) { return value_of(dt, r, i); });
            Tensor out = Tensor::zeros({n * count}, dt);
            c.all_gather(in, out)->wait();
            expect_values(
                out, [&](int64_t j) { return value_of(dt, int(j / count), j % count); },
                str("all_gather ", dtype_name(dt), " x ", count, " on rank ", r));
          }
        }
        // In place: the input is this rank's block of the output.
        Tensor out = Tensor::zeros({n * 3}, DType::F32);
        Tensor mine = out.rows(r * 3, 3);
        mine.copy_from(host_tensor_from(DType::F32, 3, [&](int64_t i) { return value_of(DType::F32, r, i); }));
        c.all_gather(mine, out);
        expect_values(
            out, [&](int64_t j) { return value_of(DType::F32, int(j / 3), j % 3); }, "in-place all_gather");
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

// Sum, max and min over the ranks of f(r, i) = r * 1000 + i (or the bf16 form).
double reduced(DType dt, ReduceOp op, int n, int64_t i) {
  double s = 0, mx = -1e300, mn = 1e300;
  for (int r = 0; r < n; ++r) {
    double v = value_of(dt, r, i);
    s += v;
    mx = std::max(mx, v);
    mn = std::min(mn, v);
  }
  return op == ReduceOp::Sum ? s : op == ReduceOp::Max ? mx : mn;
}

TEST_P(GlooCollectives, AllReduce) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        for (DType dt : kAllDTypes)
          for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min})
            for (int64_t count : {int64_t(0), int64_t(1), int64_t(3), int64_t(1000)}) {
              Tensor t = host_tensor_from(dt, count, [&](int64_t i) { return value_of(dt, r, i); });
              c.all_reduce(t, op)->wait();
              expect_values(
                  t, [&](int64_t i) { return reduced(dt, op, n, i); },
                  str("all_reduce(", reduce_op_name(op), ") ", dtype_name(dt), " x ", count, " on rank ", r));
            }
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

TEST_P(GlooCollectives, ReduceScatter) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        for (DType dt : kAllDTypes)
          for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min})
            // Block sizes that do and do not divide into Gloo's power-of-two chunks.
            for (int64_t block : {int64_t(0), int64_t(1), int64_t(7), int64_t(1024), int64_t(3001)}) {
              Tensor in = host_tensor_from(dt, n * block, [&](int64_t i) { return value_of(dt, r, i); });
              Tensor out = Tensor::zeros({block}, dt);
              c.reduce_scatter(in, out, op)->wait();
              expect_values(
                  out, [&](int64_t i) { return reduced(dt, op, n, r * block + i); },
                  str("reduce_scatter(", reduce_op_name(op), ") ", dtype_name(dt), " block ", block, " on rank ", r));
            }
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

TEST_P(GlooCollectives, BroadcastFromEveryRoot) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        for (DType dt : kAllDTypes)
          for (int root = 0; root < n; ++root) {
            Tensor t = host_tensor_from(dt, 777, [&](int64_t i) { return value_of(dt, r, i); });
            c.broadcast(t, root)->wait();
            expect_values(
                t, [&](int64_t i) { return value_of(dt, root, i); },
                str("broadcast ", dtype_name(dt), " from ", root, " on rank ", r));
          }
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

// Rank s sends (s + 2d) % 3 elements to rank d (zero counts included); element k of that block is
// s * 10000 + d * 100 + k.
int64_t a2a_count(int s, int d) {
  return (s + 2 * d) % 3;
}

TEST_P(GlooCollectives, AllToAllVWithZeroCounts) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        for (DType dt : kAllDTypes) {
          std::vector<int64_t> send, recv;
          std::vector<double> in_vals, want;
          for (int d = 0; d < n; ++d) {
            send.push_back(a2a_count(r, d));
            for (int64_t k = 0; k < a2a_count(r, d); ++k) in_vals.push_back(r * 10000 + d * 100 + k);
          }
          for (int s = 0; s < n; ++s) {
            recv.push_back(a2a_count(s, r));
            for (int64_t k = 0; k < a2a_count(s, r); ++k) want.push_back(s * 10000 + r * 100 + k);
          }
          if (dt == DType::BF16) {  // keep the values exact in bf16: source, then index
            for (auto* v : {&in_vals, &want})
              for (double& x : *v) x = std::floor(x / 10000) * 8 + std::fmod(x, 100);
          }
          Tensor in = host_tensor_from(dt, int64_t(in_vals.size()), [&](int64_t i) { return in_vals[size_t(i)]; });
          Tensor out = Tensor::zeros({int64_t(want.size())}, dt);
          c.all_to_all_v(in, send, out, recv)->wait();
          expect_values(
              out, [&](int64_t i) { return want[size_t(i)]; }, str("all_to_all_v ", dtype_name(dt), " on rank ", r));
        }
        // Every count zero.
        std::vector<int64_t> zeros(size_t(n), 0);
        Tensor e_in = Tensor::empty({0}), e_out = Tensor::empty({0});
        c.all_to_all_v(e_in, zeros, e_out, zeros);
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

TEST_P(GlooCollectives, SendRecvRingAndBarrier) {
  int n = GetParam();
  if (n == 1) GTEST_SKIP() << "send/recv need a peer";
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        // Sends block until the peer receives, so even ranks send first and odd ranks receive first.
        int next = (r + 1) % n, prev = (r + n - 1) % n;
        Tensor out = host_tensor_from(DType::F32, 100, [&](int64_t i) { return value_of(DType::F32, r, i); });
        Tensor in = Tensor::zeros({100});
        for (int round = 0; round < 3; ++round) {
          if (r % 2 == 0) {
            c.send(out, next);
            c.recv(in, prev);
          } else {
            c.recv(in, prev);
            c.send(out, next);
          }
          expect_values(
              in, [&](int64_t i) { return value_of(DType::F32, prev, i); }, str("recv on rank ", r));
          c.barrier();
        }
        // Point-to-point calls are numbered but are not collectives.
        auto h = c.history();
        EXPECT_EQ(h.back().op, "barrier");
        EXPECT_EQ(h.back().seq, 9u);
        EXPECT_EQ(h.back().coll, 3u);
        c.check_schedule();
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

TEST_P(GlooCollectives, ManyOpsCompleteAndAreRecorded) {
  int n = GetParam();
  auto errors = run_ranks(
      n,
      [&](int r, Communicator& c) {
        Tensor t = Tensor::zeros({16});
        for (int i = 0; i < 100; ++i) c.all_reduce(t);
        EXPECT_EQ(c.completed_seq(), 100u);
        EXPECT_EQ(c.last_issued().str(), "#100 all_reduce f32 x 16");
        EXPECT_EQ(c.history().size(), Communicator::kHistory);
        EXPECT_EQ(c.history().front().seq, 100u - Communicator::kHistory + 1);
        c.check_schedule();
        c.check_schedule();
        (void)r;
      },
      opt());
  EXPECT_EQ(errors, no_errors(n));
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(GlooSplit, FourRanksIntoTwoGroupsByColorOrderedByKey) {
  if (!have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo";
  auto errors = run_ranks(4, [&](int r, Communicator& world) {
    // Color r % 2; key -r, so the larger world rank comes first in each group.
    auto g = world.split(r % 2, -r, "pair");
    ASSERT_NE(g, nullptr);
    EXPECT_EQ(g->name(), "pair");
    EXPECT_EQ(g->size(), 2);
    EXPECT_EQ(g->rank(), r >= 2 ? 0 : 1);
    EXPECT_STREQ(g->backend(), "gloo");
    Tensor in = host_tensor_from(DType::F32, 3, [&](int64_t i) { return value_of(DType::F32, r, i); });
    Tensor out = Tensor::zeros({6});
    g->all_gather(in, out);
    int first = r % 2 + 2, second = r % 2;  // world ranks of group ranks 0 and 1
    expect_values(
        out, [&](int64_t j) { return value_of(DType::F32, j < 3 ? first : second, j % 3); },
        str("group all_gather on world rank ", r));
    Tensor s = Tensor::zeros({1});
    s.data<float>()[0] = float(r);
    g->all_reduce(s);
    EXPECT_EQ(s.data<float>()[0], float(first + second));
    // The world still works, and a second split (all ranks, one group) gets its own namespace.
    Tensor w = Tensor::zeros({1});
    w.data<float>()[0] = 1;
    world.all_reduce(w);
    EXPECT_EQ(w.data<float>()[0], 4.0f);
    auto all = world.split(0, r, "all");
    Tensor a = Tensor::zeros({1});
    a.data<float>()[0] = float(r);
    all->all_reduce(a, ReduceOp::Max);
    EXPECT_EQ(a.data<float>()[0], 3.0f);
    // A group of one and no group.
    auto alone = world.split(r == 0 ? 5 : -1, 0, "alone");
    if (r == 0) {
      ASSERT_NE(alone, nullptr);
      EXPECT_EQ(alone->size(), 1);
      alone->all_reduce(a);
    } else {
      EXPECT_EQ(alone, nullptr);
    }
    g->check_schedule();
    world.check_schedule();
  });
  EXPECT_EQ(errors, no_errors(4));
}

TEST(GlooArguments, ErrorsNameTheCommunicatorTheOpAndTheSizes) {
  auto store = make_memory_store();
  auto c = make_world(Device::CPU, 0, 1, *store, {});
  Tensor in = Tensor::zeros({4}), out = Tensor::zeros({5});
  EXPECT_EQ(error_of([&] { c->all_gather(in, out); }),
            "all_gather on communicator 'world' (rank 0): out has 5 elements, expected size 1 x in 4 = 4");
  Tensor out_i = Tensor::zeros({4}, DType::I32);
  EXPECT_EQ(error_of([&] { c->all_gather(in, out_i); }),
            "all_gather on communicator 'world' (rank 0): in is f32[4] cpu, out is i32[4] cpu; they must have the "
            "same dtype");
  EXPECT_EQ(error_of([&] { c->broadcast(in, 1); }),
            "broadcast on communicator 'world' (rank 0): root 1 is not a rank of 0..0");
  EXPECT_EQ(error_of([&] { c->all_to_all_v(in, {3}, out, {5}); }),
            "all_to_all_v on communicator 'world' (rank 0): send_counts sum to 3 but in has 4 elements");
  EXPECT_EQ(error_of([&] {
              c->all_to_all_v(in, {4, 0}, out, {5});
            }),
            "all_to_all_v on communicator 'world' (rank 0): send_counts has 2 entries, expected one per rank (1)");
  EXPECT_EQ(error_of([&] { c->send(in, 0); }),
            "send on communicator 'world' (rank 0): peer 0 must be another rank of 0..0");
  EXPECT_EQ(c->last_issued().seq, 0u);  // rejected calls are not recorded
  EXPECT_EQ(error_of([&] { make_world(Device::CPU, 2, 2, *store, {}); }),
            "make_world: rank 2 is outside 0..1 (world size 2)");
}

TEST(GlooArguments, AbortedCommunicatorRefusesCalls) {
  auto store = make_memory_store();
  auto c = make_world(Device::CPU, 0, 1, *store, {});
  c->abort("test over");
  Tensor t = Tensor::zeros({4});
  EXPECT_EQ(error_of([&] { c->all_reduce(t); }),
            "communicator 'world' (rank 0 of 1, self): cannot issue all_reduce: the communicator was aborted (test "
            "over)");
}

}  // namespace
}  // namespace mt::comm
