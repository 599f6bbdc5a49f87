// Stop signals (core/interrupt.h): the first SIGINT or SIGTERM only sets the flag; a second one of either
// kind ends the process by its default action.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>

#include "core/interrupt.h"

using namespace mt;

TEST(StopSignals, TheFirstSignalSetsTheFlagAndNamesIt) {
  install_stop_signals();
  install_stop_signals();  // idempotent
  reset_stop_for_tests();
  EXPECT_FALSE(stop_requested());
  EXPECT_EQ(stop_signal(), 0);
  std::raise(SIGINT);  // handled: the test process goes on
  EXPECT_TRUE(stop_requested());
  EXPECT_EQ(stop_signal(), SIGINT);
  EXPECT_STREQ(stop_signal_name(stop_signal()), "SIGINT");
  install_stop_signals();  // a second install keeps what was received
  EXPECT_EQ(stop_signal(), SIGINT);
  reset_stop_for_tests();
  std::raise(SIGTERM);
  EXPECT_EQ(stop_signal(), SIGTERM);
  EXPECT_STREQ(stop_signal_name(SIGTERM), "SIGTERM");
  EXPECT_STREQ(stop_signal_name(SIGHUP), (std::string("signal ") + std::to_string(SIGHUP)).c_str());
  reset_stop_for_tests();
  EXPECT_FALSE(stop_requested());
}

// A second Ctrl-C kills at once; so does a SIGTERM after a SIGINT (by its own default action).
TEST(StopSignals, ASecondSignalKillsAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_stop_signals();
        reset_stop_for_tests();
        std::raise(SIGINT);
        std::raise(SIGINT);
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGINT), "");
  EXPECT_EXIT(
      {
        install_stop_signals();
        reset_stop_for_tests();
        std::raise(SIGINT);
        std::raise(SIGTERM);
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGTERM), "");
}
