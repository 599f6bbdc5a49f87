// The watchdog: reports an op in flight past the timeout (stderr and the store), aborts the
// communicators it watches, stays quiet while ops complete, and ends a process whose main thread
// does not react within the grace period.
#include <gtest/gtest.h>

#include <future>
#include <regex>

#include "comm/comm_test_util.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using namespace std::chrono_literals;
using testing::FakeComm;
using testing::run_ranks;

TEST(Watchdog, QuietWhileOpsComplete) {
  auto store = make_memory_store();
  FakeComm c(0, 1, *store, {});
  Watchdog w(*store, 0, 50ms, 10s, 5ms);
  w.watch(&c);
  Tensor t = Tensor::zeros({4});
  for (int i = 0; i < 40; ++i) {
    c.all_reduce(t);
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_FALSE(w.fired());
  EXPECT_FALSE(c.aborted());
  EXPECT_FALSE(store->check({"watchdog/0"}));
  w.unwatch(&c);
}

TEST(Watchdog, ReportsTheOldestOpInFlightAndAbortsEveryWatchedCommunicator) {
  auto store = make_memory_store();
  FakeComm stuck(0, 1, *store, {}, "a", "world"), other(0, 1, *store, {}, "b", "dp");
  Tensor t = Tensor::zeros({4096});
  stuck.all_reduce(t);  // completes
  stuck.hang = true;    // from now on ops stay in flight, as queued CUDA collectives would
  stuck.all_reduce(t);
  stuck.broadcast(t, 0);
  // Watched only now, so that a slow machine cannot fire the watchdog between the two calls above
  // (in flight is measured from when an op was issued).
  Watchdog w(*store, 0, 100ms, 60s, 10ms);
  w.watch(&stuck);
  w.watch(&other);
  std::string report = store->get_str("watchdog/0", 20s);
  EXPECT_TRUE(std::regex_match(report, std::regex("watchdog: rank 0: communicator 'world' op #2 all_reduce f32 x 4096 "
                                                  "in flight for [0-9.]+ s; last completed #1 \\(last issued #3 "
                                                  "broadcast f32 x 4096 root 0\\)")))
      << report;
  EXPECT_TRUE(w.fired());
  EXPECT_TRUE(stuck.aborted());
  EXPECT_TRUE(other.aborted());
  EXPECT_EQ(other.abort_reason, report);
  EXPECT_NE(testutil::error_of([&] { stuck.all_reduce(t); }).find("the communicator was aborted (watchdog: rank 0"),
            std::string::npos);
  w.unwatch(&stuck);
  w.unwatch(&other);
}

// A Gloo rank blocked in an all_reduce that its peer never joins: the watchdog reports it from its
// own thread while the op is still blocked, and aborts the communicator (closing its connections),
// so that the peer's next call fails at once instead of hanging.
TEST(Watchdog, ReportsAGlooOpBlockedOnAMissingRank) {
  if (!have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo";
  auto store = make_memory_store();
  CommOptions opt;
  opt.timeout = 3s;
  std::atomic<Communicator*> comm0{nullptr};
  auto errors = run_ranks(
      2,
      [&](int r, Communicator& c) {
        Watchdog w(*store, r, 200ms, 60s, 20ms);
        w.watch(&c);
        Tensor t = Tensor::zeros({16});
        try {
          if (r == 0) {
            comm0 = &c;
            c.all_reduce(t);
          } else {
            store->get("watchdog/0", 20s);  // rank 0's watchdog has reported ...
            while (!comm0.load() || !comm0.load()->aborted()) std::this_thread::sleep_for(1ms);  // ... and aborted
            c.all_reduce(t);
          }
        } catch (...) {
          w.unwatch(&c);
          throw;
        }
      },
      opt, Device::CPU, store.get());
  std::string report = store->get_str("watchdog/0", 1s);
  EXPECT_TRUE(std::regex_match(
      report, std::regex("watchdog: rank 0: communicator 'world' op #1 all_reduce f32 x 16 in flight for [0-9.]+ s; "
                         "last completed #0")))
      << report;
  // Rank 1's call failed at once (connection reset); its watchdog reports the failure.
  std::string report1 = store->get_str("watchdog/1", 1s);
  EXPECT_TRUE(std::regex_match(report1, std::regex("watchdog: rank 1: communicator 'world' op #1 all_reduce f32 x 16 "
                                                   "failed \\(.*\\); last completed #0")))
      << report1;
  EXPECT_NE(errors[0].find("communicator 'world' (rank 0 of 2, gloo): op #1 all_reduce f32 x 16 failed"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("communicator 'world' (rank 1 of 2, gloo): op #1 all_reduce f32 x 16 failed"),
            std::string::npos)
      << errors[1];
}

// The main thread ignores the abort (it is stuck elsewhere): the process exits with the watchdog's
// code after the grace period, having said why.
TEST(WatchdogDeathTest, ExitsWhenTheMainThreadDoesNotReact) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto store = make_memory_store();
        FakeComm c(0, 1, *store, {});
        Watchdog w(*store, 0, 100ms, 300ms, 10ms);
        w.watch(&c);
        c.hang = true;
        Tensor t = Tensor::zeros({4});
        c.all_reduce(t);
        std::this_thread::sleep_for(60s);
      },
      ::testing::ExitedWithCode(kWatchdogExitCode),
      "watchdog: rank 0: communicator 'fake' op #1 all_reduce f32 x 4 in flight for [0-9.]+ s; last completed "
      "#0(.|\n)*watchdog: rank 0: the main thread did not react within 0.3 s of the abort; exiting with code 70");
}

}  // namespace
}  // namespace mt::comm
