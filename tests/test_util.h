// Helpers shared by the test suites.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace mt::testutil {

// Runs f, expects it to throw mt::Error, and returns the message ("" and a test failure otherwise).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an mt::Error";
  return "";
}

}  // namespace mt::testutil
