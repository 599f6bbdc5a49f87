// A child process spoken to in lines (the reward program, rl/rewards/rewards.h, and the environment program,
// rl/env/env_program.h): `/bin/sh -c COMMAND` in its own process group, its stdin and stdout pipes
// non-blocking under poll, so a program that stops reading or answering can never block the caller past a
// call's deadline. A call that ends with the program dead (EOF, an exit, a signal) or late (the deadline) leaves
// it stopped (a late one is killed, with whatever it started); the next call starts it again and counts a
// restart; so does one that ended between calls (with a warning). What it writes to stderr goes to the
// trainer's stderr.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace mt::rl {

// Checks that a command's first word names an executable file (a path, or a name on PATH); `what` names the
// kind of program in the error ("reward program", "environment program").
void check_executable(const std::string& what, const std::string& command);

// Failures over a program's life (every call counted): what a run reports when nothing ever succeeded.
struct FailureTally {
  int64_t calls = 0;        // calls with at least one item
  int64_t items = 0;        // samples or episode calls sent
  int64_t failures = 0;     // of them, failed (no usable reply)
  int64_t stray_lines = 0;  // lines that were no reply to anything
  std::string first_error;  // the first failure or stray line, as reported
  void note(const std::string& error) {
    if (first_error.empty()) first_error = error;
  }
  bool all_failed() const { return items > 0 && failures == items; }
};
// When every item failed: an error for the end of a run, naming the program, the counts and the first
// error ("the reward program failed on every sample of the run: 8 of 8 in 4 calls; the first: ..."); else "".
std::string all_failed_message(const FailureTally& t, const std::string& what, const std::string& items);

class ChildProcess {
 public:
  // Checks the command (check_executable) and starts it.
  ChildProcess(std::string what, std::string command);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Writes `input` (after whatever post() could not write yet) and hands every line the program writes
  // (without its newline or a trailing \r; blank lines skipped) to `on_line`, until on_line returns true
  // (everything answered), the program ends or the deadline passes. Returns "" when on_line finished it, else
  // what happened ("the environment program exited with status 3", "... no reply within the call's 2 s
  // deadline"); the program is then stopped and restarted by the next call. Starts it first when stopped.
  std::string exchange(const std::string& input, double timeout_s,
                       const std::function<bool(const std::string&)>& on_line);
  // Writes `input` without waiting for a reply (what the pipe does not take now goes first in the next call).
  void post(const std::string& input);
  // Stops the program now (closes its stdin, waits briefly, then kills its process group); the next call
  // restarts it. Lines it wrote and nobody read are dropped.
  void stop();
  bool running() const { return pid_ >= 0; }
  int64_t restarts() const { return restarts_; }
  const std::string& what() const { return what_; }
  // The complete lines the program has written past the end of the last call (more than it waited for):
  // those read already and those it can read now without waiting, taken out.
  std::string take_leftover();

 private:
  void start();
  std::string what_, command_;
  int pid_ = -1, to_child_ = -1, from_child_ = -1;
  std::string pending_;  // bytes read past the last complete line
  std::string outbox_;   // posted bytes not yet written
  int64_t restarts_ = 0;
};

}  // namespace mt::rl
