// Command-line flag values shared by the subcommands: a number parsed whole, or an error naming the flag.
#pragma once
#include <sstream>
#include <string>
#include <type_traits>

#include "core/error.h"

namespace mt {

template <class T>
T parse_flag_number(const std::string& flag, const std::string& v) {
  // A stream reads "-1" into an unsigned type as its largest value, without an error.
  if constexpr (std::is_unsigned_v<T>)
    if (v.find('-') != std::string::npos) MT_THROW(flag, " '", v, "' must be >= 0");
  std::istringstream is(v);
  T x{};
  if (!(is >> x) || !is.eof()) MT_THROW(flag, " '", v, "' is not a number");
  return x;
}

}  // namespace mt
