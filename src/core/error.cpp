#include "core/error.h"

namespace mt {

void fail_at(const char* file, int line, const std::string& msg) {
  throw Error(str(msg, " (", file, ":", line, ")"));
}

}  // namespace mt
