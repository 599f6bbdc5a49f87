// A child process spoken to in lines (child_process.h).
#include "rl/env/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt::rl {

void check_executable(const std::string& what, const std::string& command) {
  std::istringstream is(command);
  std::string prog;
  is >> prog;
  if (prog.empty()) MT_THROW(what, ": the command is empty");
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (prog.find('/') != std::string::npos) {
    struct stat st {};
    if (::stat(prog.c_str(), &st) != 0) MT_THROW(what, " '", prog, "' does not exist (command: ", command, ")");
    if (!executable(prog)) MT_THROW(what, " '", prog, "' is not an executable file (command: ", command, ")");
    return;
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && executable(dir + "/" + prog)) return;
  MT_THROW(what, " '", prog, "' is not an executable on PATH (command: ", command, ")");
}

std::string all_failed_message(const FailureTally& t, const std::string& what, const std::string& items) {
  if (!t.all_failed()) return {};
  return str(what, " failed on every ", items, " of the run: ", t.failures, " of ", t.items, " in ", t.calls,
             t.calls == 1 ? " call" : " calls", ", so no reward reached training; the first error: ", t.first_error);
}

ChildProcess::ChildProcess(std::string what, std::string command)
    : what_(std::move(what)), command_(std::move(command)) {
  check_executable(what_, command_);
  ::signal(SIGPIPE, SIG_IGN);  // a dead program's pipe is an error code, not a signal
  start();
}

ChildProcess::~ChildProcess() {
  stop();
}

void ChildProcess::start() {
  int in[2], out[2];
  if (::pipe(in) != 0 || ::pipe(out) != 0) MT_THROW(what_, ": pipe failed: ", std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) MT_THROW(what_, ": fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);             // its own process group: stop() kills what the program started too
    ::signal(SIGPIPE, SIG_DFL);  // the trainer ignores it; the program should not inherit that
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::close(in[0]);
    ::close(in[1]);
    ::close(out[0]);
    ::close(out[1]);
    ::execl("/bin/sh", "sh", "-c", command_.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  pid_ = pid;
  to_child_ = in[1];
  from_child_ = out[0];
  ::fcntl(to_child_, F_SETFL, ::fcntl(to_child_, F_GETFL) | O_NONBLOCK);
  ::fcntl(from_child_, F_SETFL, ::fcntl(from_child_, F_GETFL) | O_NONBLOCK);
  pending_.clear();
  outbox_.clear();
}

void ChildProcess::stop() {
  if (pid_ < 0) return;
  ::close(to_child_);  // EOF: a well-behaved program exits
  ::close(from_child_);
  int status = 0;
  for (int i = 0; i < 50 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) ::usleep(2000);
  if (::waitpid(pid_, &status, WNOHANG) == 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
  }
  pid_ = to_child_ = from_child_ = -1;
  pending_.clear();
  outbox_.clear();
}

void ChildProcess::post(const std::string& input) {
  if (pid_ < 0) return;  // nobody to tell: a restarted program starts without state
  outbox_ += input;
  while (!outbox_.empty()) {
    const ssize_t w = ::write(to_child_, outbox_.data(), outbox_.size());
    if (w <= 0) break;  // full (the next call writes the rest) or closed (the next call finds out)
    outbox_.erase(0, size_t(w));
  }
}

std::string ChildProcess::take_leftover() {
  while (pid_ >= 0) {  // what it has written by now, without waiting
    char buf[65536];
    const ssize_t r = ::read(from_child_, buf, sizeof buf);
    if (r <= 0) break;  // nothing now, or EOF (the next call finds out)
    pending_.append(buf, size_t(r));
  }
  const size_t last = pending_.rfind('\n');
  if (last == std::string::npos) return {};
  std::string lines = pending_.substr(0, last + 1);
  pending_.erase(0, last + 1);
  return lines;
}

std::string ChildProcess::exchange(const std::string& input, double timeout_s,
                                   const std::function<bool(const std::string&)>& on_line) {
  int ended = 0;
  if (pid_ >= 0 && ::waitpid(pid_, &ended, WNOHANG) == pid_) {
    // It ended between calls, after answering the last one: this call starts it again, and says so.
    log_info("warning: ", what_, WIFEXITED(ended) ? " exited with status " : " was killed by signal ",
             WIFEXITED(ended) ? WEXITSTATUS(ended) : WTERMSIG(ended), " between calls; starting it again");
    ::close(to_child_);
    ::close(from_child_);
    pid_ = to_child_ = from_child_ = -1;
  }
  if (pid_ < 0) {
    start();
    ++restarts_;
  }
  std::string send = std::move(outbox_);
  outbox_.clear();
  send += input;
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  size_t sent = 0;
  std::string failure;
  bool finished = false, deaf = false;
  // Lines already read (a previous call's leftovers were taken or dropped by the caller) come first.
  auto drain = [&] {
    size_t nl;
    while (!finished && (nl = pending_.find('\n')) != std::string::npos) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      finished = on_line(line);
    }
  };
  drain();
  while (!finished && failure.empty()) {
    const double left = std::chrono::duration<double>(deadline - clock::now()).count();
    if (left <= 0) {
      std::ostringstream s;
      s << what_ << ": no reply within the call's " << timeout_s << " s deadline"
        << (deaf ? " (it closed its input before reading every request)" : "");
      failure = s.str();
      break;
    }
    const bool writing = sent < send.size();
    pollfd fds[2] = {{from_child_, POLLIN, 0}, {to_child_, short(writing ? POLLOUT : 0), 0}};
    const int rc = ::poll(fds, writing ? 2 : 1, int(std::ceil(std::min(left, 1.0) * 1000)));
    if (rc < 0 && errno != EINTR) MT_THROW(what_, ": poll failed: ", std::strerror(errno));
    if (writing && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t w = ::write(to_child_, send.data() + sent, send.size() - sent);
      if (w > 0)
        sent += size_t(w);
      else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        // It closed its input: what it still writes counts, and its exit (or the deadline) ends the call.
        sent = send.size();
        deaf = true;
      }
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      char buf[65536];
      const ssize_t r = ::read(from_child_, buf, sizeof buf);
      if (r > 0) {
        pending_.append(buf, size_t(r));
        drain();
      } else if (r == 0) {
        // EOF: what it wrote without a final newline is a line too.
        if (!pending_.empty()) {
          pending_ += '\n';
          drain();
          if (finished) break;
        }
        int status = 0;
        ::waitpid(pid_, &status, 0);
        failure = WIFEXITED(status) ? what_ + " exited with status " + std::to_string(WEXITSTATUS(status))
                                    : what_ + " was killed by signal " + std::to_string(WTERMSIG(status));
        ::close(to_child_);
        ::close(from_child_);
        pid_ = to_child_ = from_child_ = -1;
        pending_.clear();
      }
    }
  }
  if (finished && sent < send.size()) outbox_ = send.substr(sent);
  if (!failure.empty() && pid_ >= 0) stop();  // late or deaf: killed, restarted by the next call
  return failure;
}

}  // namespace mt::rl
