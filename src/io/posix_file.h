// Small POSIX file helpers shared by the safetensors writer and the checkpoint manifests: an error that
// names the path and errno's text, and a file descriptor closed on scope exit (every error path too).
#pragma once
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/error.h"

namespace mt::io {

[[noreturn]] inline void throw_errno(const std::string& what, const std::string& path) {
  MT_THROW(what, " '", path, "': ", std::strerror(errno));
}

struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace mt::io
