// A command run in the background for tests that signal it: start it with its output in a log file, wait
// for a line, read its exit code (128 + the signal when a signal ended it).
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>

namespace mt::test {

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Started through sh and exec'd (the pid is the command's), output into `log`, one BLAS thread.
inline pid_t start_command(const std::string& cmd, const std::string& log) {
  const std::string full = "exec env OPENBLAS_NUM_THREADS=1 " + cmd + " > " + log + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits until `log` matches `re` (true) or the process ends or 120 s pass (false).
inline bool wait_for_log(pid_t pid, const std::string& log, const std::regex& re) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < until) {
    if (std::regex_search(read_text(log), re)) return true;
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return std::regex_search(read_text(log), re);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The exit code (128 + signal for a signal), waiting for the process.
inline int exit_code(pid_t pid) {
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Starts `cmd`, sends it SIGINT once its log matches `ready`, waits for it and returns its log and exit code.
struct Interrupted {
  bool reached = false;  // the log matched `ready` before the command ended
  int code = -1;
  std::string log;
};
inline Interrupted interrupt_when(const std::string& cmd, const std::string& log, const std::regex& ready) {
  Interrupted r;
  const pid_t pid = start_command(cmd, log);
  r.reached = wait_for_log(pid, log, ready);
  kill(pid, SIGINT);
  r.code = exit_code(pid);
  r.log = read_text(log);
  return r;
}

}  // namespace mt::test
