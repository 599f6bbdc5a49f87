// Errors and checks. Every failure says what was wrong, the values involved and, for internal
// invariants, the file and line. User-input errors throw mt::Error with a message a user can act on.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace mt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... A>
std::string str(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}

[[noreturn]] void fail_at(const char* file, int line, const std::string& msg);

}  // namespace mt

// Internal invariant: names the condition, the file/line and the caller's message.
#define MT_CHECK(cond, ...)                                                                     \
  do {                                                                                          \
    if (!(cond)) ::mt::fail_at(__FILE__, __LINE__, ::mt::str("check failed: " #cond ": ", __VA_ARGS__)); \
  } while (0)

// User-facing error: the message alone (no file/line), thrown as mt::Error.
#define MT_THROW(...) throw ::mt::Error(::mt::str(__VA_ARGS__))
