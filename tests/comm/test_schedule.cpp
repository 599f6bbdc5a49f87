// The collective-schedule check: ranks that issue different collectives are named, with the first
// op where they differ, periodically (FakeComm: the base class's logic without a transport) and
// per op (real Gloo ranks: the mismatching op is caught before it runs); store timeouts name the
// ranks that never reported; a Gloo op that a rank never joins fails within its timeout with the
// communicator, rank, op and seq named.
#include <gtest/gtest.h>

#include <future>

#include "comm/comm_test_util.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using namespace std::chrono_literals;
using testing::FakeComm;
using testing::no_errors;
using testing::run_fake_ranks;
using testing::run_ranks;
using Clock = std::chrono::steady_clock;

TEST(ScheduleCheck, NamesTheRanksAndTheFirstDifferingOp) {
  auto errors = run_fake_ranks(2, [](int r, FakeComm& c) {
    Tensor small = Tensor::zeros({16}), big = Tensor::zeros({4096}), half = Tensor::zeros({2048});
    c.all_reduce(small);
    if (r == 0)
      c.all_reduce(big);
    else
      c.all_gather(half, big);
    c.barrier();
    c.check_schedule();
  });
  std::string want =
      "collective schedule diverged on communicator 'fake' at op #2: rank 0 issued all_reduce f32 x 4096, rank 1 "
      "issued all_gather f32 x 2048";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
}

TEST(ScheduleCheck, GroupsRanksThatAgree) {
  auto errors = run_fake_ranks(4, [](int r, FakeComm& c) {
    Tensor t = Tensor::zeros({8});
    c.all_reduce(t, r == 2 ? ReduceOp::Max : ReduceOp::Sum);
    c.check_schedule();
  });
  std::string want =
      "collective schedule diverged on communicator 'fake' at op #1: ranks 0, 1, 3 issued all_reduce f32 x 8, rank 2 "
      "issued all_reduce(max) f32 x 8";
  EXPECT_EQ(errors, std::vector<std::string>(4, want));
}

TEST(ScheduleCheck, ARankThatSkippedAnOp) {
  auto errors = run_fake_ranks(2, [](int r, FakeComm& c) {
    Tensor t = Tensor::zeros({8});
    c.all_reduce(t);
    c.broadcast(t, 1);
    if (r == 0) c.barrier();
    c.check_schedule();
  });
  std::string want =
      "collective schedule diverged on communicator 'fake' at op #3: rank 0 issued barrier, rank 1 had issued only 2 "
      "collectives";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
}

TEST(ScheduleCheck, DivergenceOlderThanTheHistoryIsStillCaught) {
  auto errors = run_fake_ranks(2, [](int r, FakeComm& c) {
    Tensor t = Tensor::zeros({8});
    c.all_reduce(t, r == 0 ? ReduceOp::Sum : ReduceOp::Min);
    for (int i = 0; i < 100; ++i) c.all_reduce(t);
    c.check_schedule();
  });
  std::string want =
      "collective schedule diverged on communicator 'fake' before op #38 (older than the 64 ops each rank remembers; "
      "the ranks' hashes already differ there)";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
}

TEST(ScheduleCheck, AgreeingRanksPassRepeatedlyAndPointToPointIsNotScheduled) {
  auto errors = run_fake_ranks(3, [](int r, FakeComm& c) {
    Tensor t = Tensor::zeros({8});
    for (int step = 0; step < 5; ++step) {
      c.all_reduce(t);
      // Only ranks 0 and 1 talk point to point; rank 2 does not, and that is not a divergence.
      if (r == 0) c.send(t, 1);
      if (r == 1) c.recv(t, 0);
      c.check_schedule();
    }
    c.barrier();
    EXPECT_EQ(c.last_issued().coll, 6u);
    EXPECT_EQ(c.last_issued().seq, r == 2 ? 6u : 11u);
  });
  EXPECT_EQ(errors, no_errors(3));
}

TEST(ScheduleCheck, OffIsANoOp) {
  CommOptions opt;
  opt.schedule_check = ScheduleCheck::Off;
  auto errors = run_fake_ranks(
      2,
      [](int r, FakeComm& c) {
        Tensor t = Tensor::zeros({8});
        c.all_reduce(t, r == 0 ? ReduceOp::Sum : ReduceOp::Max);
        c.check_schedule();
      },
      opt);
  EXPECT_EQ(errors, no_errors(2));
}

TEST(ScheduleCheck, TimeoutNamesTheRanksThatNeverReported) {
  CommOptions opt;
  opt.timeout = 300ms;
  auto errors = run_fake_ranks(
      3,
      [](int r, FakeComm& c) {
        Tensor t = Tensor::zeros({16});
        c.all_reduce(t);
        if (r == 0) c.check_schedule();  // ranks 1 and 2 never come
      },
      opt);
  EXPECT_EQ(errors[0],
            "schedule check #1 on communicator 'fake' (rank 0 of 3, fake) timed out after 300 ms: ranks 1, 2 never "
            "reported (this rank is at op #1 all_reduce f32 x 16)");
}

TEST(PerOpCheck, CatchesTheMismatchBeforeItRunsOnGloo) {
  if (!have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo";
  CommOptions opt;
  opt.schedule_check = ScheduleCheck::PerOp;
  opt.timeout = 10s;
  std::vector<double> seconds(2);
  auto errors = run_ranks(
      2,
      [&](int r, Communicator& c) {
        Tensor small = Tensor::zeros({16}), big = Tensor::zeros({4096}), half = Tensor::zeros({2048});
        c.all_reduce(small);  // checked and run
        auto t0 = Clock::now();
        try {
          if (r == 0)
            c.all_reduce(big);
          else
            c.all_gather(half, big);
        } catch (...) {
          seconds[size_t(r)] = std::chrono::duration<double>(Clock::now() - t0).count();
          EXPECT_EQ(c.completed_seq(), 1u);  // the mismatching op never ran
          throw;
        }
      },
      opt);
  std::string want =
      "collective schedule diverged on communicator 'world' at op #2: rank 0 issued all_reduce f32 x 4096, rank 1 "
      "issued all_gather f32 x 2048 (caught before it ran)";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
  // Caught by comparing records, not by waiting for a timeout.
  EXPECT_LT(seconds[0], 10.0);
  EXPECT_LT(seconds[1], 10.0);
}

TEST(PerOpCheck, AllToAllVCountsMustPair) {
  CommOptions opt;
  opt.schedule_check = ScheduleCheck::PerOp;
  auto errors = run_fake_ranks(
      2,
      [](int r, FakeComm& c) {
        // Rank 0 sends 3 elements to rank 1, but rank 1 expects 2 from rank 0.
        std::vector<int64_t> send = r == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 1};
        std::vector<int64_t> recv = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
        Tensor in = Tensor::zeros({send[0] + send[1]}), out = Tensor::zeros({recv[0] + recv[1]});
        c.all_to_all_v(in, send, out, recv);
      },
      opt);
  std::string want =
      "all_to_all_v counts disagree on communicator 'fake' at op #1: rank 0 sends 3 elements to rank 1, rank 1 "
      "expects 2 from rank 0 (caught before it ran)";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
}

TEST(PerOpCheck, SplitIsPartOfTheSchedule) {
  CommOptions opt;
  opt.schedule_check = ScheduleCheck::PerOp;
  auto errors = run_fake_ranks(
      2,
      [](int r, FakeComm& c) {
        Tensor t = Tensor::zeros({4});
        if (r == 0)
          c.split(0, 0, "g");
        else
          c.all_reduce(t);
      },
      opt);
  std::string want =
      "collective schedule diverged on communicator 'fake' at op #1: rank 0 issued split, rank 1 issued all_reduce "
      "f32 x 4 (caught before it ran)";
  EXPECT_EQ(errors, std::vector<std::string>({want, want}));
}

// One rank never joins an all_reduce: the other's Gloo op fails at its timeout, and the error names
// the communicator, the rank, the op and its seq, the timeout, and the rank that never reported.
TEST(GlooTimeout, ARankThatNeverJoinsFailsTheOthersWithinTheTimeout) {
  if (!have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo";
  CommOptions opt;
  opt.timeout = 500ms;
  std::promise<void> rank0_failed;
  auto failed = rank0_failed.get_future().share();
  double seconds = 0;
  auto errors = run_ranks(
      2,
      [&](int r, Communicator& c) {
        Tensor t = Tensor::zeros({16});
        c.barrier();  // both connected and in step
        if (r == 0) {
          auto t0 = Clock::now();
          try {
            c.all_reduce(t);
          } catch (...) {
            seconds = std::chrono::duration<double>(Clock::now() - t0).count();
            rank0_failed.set_value();
            throw;
          }
        } else {
          failed.wait();
          c.all_reduce(t);  // too late: rank 0 gave up and closed its connections
        }
      },
      opt);
  EXPECT_NE(errors[0].find("communicator 'world' (rank 0 of 2, gloo): op #2 all_reduce f32 x 16 failed after "),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("(timeout 500 ms)"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 1 did not report within 500 ms (exited, or blocked elsewhere)"), std::string::npos)
      << errors[0];
  EXPECT_GE(seconds, 0.4);
  EXPECT_LT(seconds, 5.0);  // the timeout plus the bounded diagnosis, not a hang
  EXPECT_NE(errors[1].find("communicator 'world' (rank 1 of 2, gloo): op #2 all_reduce f32 x 16 failed"),
            std::string::npos)
      << errors[1];
}

}  // namespace
}  // namespace mt::comm
