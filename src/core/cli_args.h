// Command-line flag values shared by the subcommands: a number parsed whole, or an error naming the flag.
#pragma once
#include <sstream>
#include <string>

#include "core/error.h"

namespace mt {

template <class T>
T parse_flag_number(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  T x{};
  if (!(is >> x) || !is.eof()) MT_THROW(flag, " '", v, "' is not a number");
  return x;
}

}  // namespace mt
