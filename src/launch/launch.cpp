// The launcher: fork/exec of the ranks, one poll() loop in the calling thread over their output
// pipes and a self-pipe fed by the signal handlers (no other threads, so nothing between fork and
// exec can deadlock), and the stop protocol described in launch.h.
#include "launch/launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "core/error.h"

extern char** environ;

namespace mt::comm {

std::string LinePrefixer::feed(const char* data, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    char c = data[i];
    if (c == '\n') {
      out += prefix_ + partial_ + "\n";
      partial_.clear();
    } else {
      partial_ += c;
      if (partial_.size() >= max_line_) {
        out += prefix_ + partial_ + "\n";
        partial_.clear();
      }
    }
  }
  return out;
}

std::string LinePrefixer::finish() {
  if (partial_.empty()) return "";
  std::string out = prefix_ + partial_ + "\n";
  partial_.clear();
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

int g_sig_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t r = ::write(g_sig_pipe[1], &b, 1);
  errno = saved;
}

// Installs the handlers for one run and restores the previous ones afterwards.
class SignalScope {
 public:
  SignalScope() {
    if (::pipe2(g_sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) MT_THROW("launch: pipe() failed: ", std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, &old_pipe_);  // a closed stdout must not kill the supervisor
  }
  ~SignalScope() {
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
    ::close(g_sig_pipe[0]);
    ::close(g_sig_pipe[1]);
    g_sig_pipe[0] = g_sig_pipe[1] = -1;
  }
  static constexpr int kSignals[3] = {SIGCHLD, SIGINT, SIGTERM};

 private:
  struct sigaction old_[3]{};
  struct sigaction old_pipe_ {};
};

void write_all(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    ssize_t k = ::write(fd, s.data() + at, s.size() - at);
    if (k > 0) {
      at += static_cast<size_t>(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else {
      return;  // the reader went away (EPIPE): the ranks' output is dropped, the job goes on
    }
  }
}

// A free port (the kernel's pick), held for the whole job: the socket stays bound (SO_REUSEADDR, not
// listening, close-on-exec), so the kernel gives the port to no other bind(0) or outgoing connection
// while rank 0 binds it (also with SO_REUSEADDR, which Linux allows while this one is not listening).
// Without the hold another job's ephemeral port (a Gloo pair, say) could take it between the pick and
// rank 0's bind. The caller closes the returned fd when the job is over.
struct HeldPort {
  int port = 0;
  int fd = -1;
};

HeldPort pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) MT_THROW("launch: socket() failed: ", std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    int e = errno;
    ::close(fd);
    MT_THROW("launch: could not find a free port: ", std::strerror(e));
  }
  return {ntohs(a.sin_port), fd};
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) MT_THROW("launch: cannot find this executable (/proc/self/exe): ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  int out_fd = -1, err_fd = -1;  // read ends of the pipes
  LinePrefixer out, err;
  Child(int r) : rank(r), out(str("[rank ", r, "] ")), err(str("[rank ", r, "] ")) {}
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return str("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    const char* name = ::strsignal(s);
    return str("killed by signal ", s, name ? str(" (", name, ")") : "");
  }
  return str("ended with status ", status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_launch(const LaunchOptions& opt) {
  const int world = opt.nnodes * opt.nproc_per_node;
  const std::string exe = opt.exe.empty() ? self_exe() : opt.exe;
  const std::string addr = opt.master_addr.empty() ? "127.0.0.1" : opt.master_addr;
  const HeldPort held = opt.master_port > 0 ? HeldPort{opt.master_port, -1} : pick_free_port();
  const int port = held.port;
  struct CloseHeld {
    int fd;
    ~CloseHeld() {
      if (fd >= 0) ::close(fd);
    }
  } close_held{held.fd};
  auto say = [&](const std::string& msg) { write_all(opt.err_fd, "moetrain launch: " + msg + "\n"); };

  // Everything the children need is built before the first fork: only async-signal-safe calls
  // happen between fork and exec.
  std::vector<std::string> base_env;
  static const char* kOurs[] = {"RANK=",      "WORLD_SIZE=", "LOCAL_RANK=",  "LOCAL_WORLD_SIZE=",
                                "NODE_RANK=", "GROUP_RANK=", "MASTER_ADDR=", "MASTER_PORT="};
  for (char** e = environ; *e; ++e) {
    bool ours = false;
    for (const char* k : kOurs) ours = ours || std::strncmp(*e, k, std::strlen(k)) == 0;
    if (!ours) base_env.emplace_back(*e);
  }
  std::vector<std::string> argv_s{exe};
  argv_s.insert(argv_s.end(), opt.args.begin(), opt.args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  SignalScope signals;
  say(str("starting ", opt.nproc_per_node, " ranks on node ", opt.node_rank, " of ", opt.nnodes, " (world ", world,
          "), master ", addr, ":", port));

  std::vector<std::unique_ptr<Child>> kids;
  std::string fork_error;
  const pid_t parent = ::getpid();
  sigset_t block, old_mask;
  sigemptyset(&block);
  for (int s : SignalScope::kSignals) sigaddset(&block, s);
  for (int local = 0; local < opt.nproc_per_node; ++local) {
    int rank = opt.node_rank * opt.nproc_per_node + local;
    std::vector<std::string> env_s = base_env;
    env_s.push_back(str("RANK=", rank));
    env_s.push_back(str("WORLD_SIZE=", world));
    env_s.push_back(str("LOCAL_RANK=", local));
    env_s.push_back(str("LOCAL_WORLD_SIZE=", opt.nproc_per_node));
    env_s.push_back(str("NODE_RANK=", opt.node_rank));
    env_s.push_back(str("GROUP_RANK=", opt.node_rank));
    env_s.push_back(str("MASTER_ADDR=", addr));
    env_s.push_back(str("MASTER_PORT=", port));
    std::vector<char*> envp;
    for (std::string& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out_pipe[2], err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
      fork_error = str("pipe() failed: ", std::strerror(errno));
      break;
    }
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
      fork_error = str("pipe() failed: ", std::strerror(errno));
      ::close(out_pipe[0]);
      ::close(out_pipe[1]);
      break;
    }
    std::string exec_fail = str("moetrain launch: rank ", rank, ": cannot execute ", exe, "\n");
    ::sigprocmask(SIG_BLOCK, &block, &old_mask);
    pid_t pid = ::fork();
    if (pid == 0) {
      // Child: async-signal-safe calls only.
      for (int s : SignalScope::kSignals) ::signal(s, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(128 + SIGKILL);  // the launcher died before prctl
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out_pipe[1], 1);
      ::dup2(err_pipe[1], 2);
      ::execve(exe.c_str(), argv.data(), envp.data());
      [[maybe_unused]] ssize_t r = ::write(2, exec_fail.data(), exec_fail.size());
      ::_exit(127);
    }
    int fork_errno = errno;
    if (pid > 0) ::setpgid(pid, pid);  // also here: kill(-pid) must work before the child runs
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    if (pid < 0) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      fork_error = str("fork() failed: ", std::strerror(fork_errno));
      break;
    }
    auto c = std::make_unique<Child>(rank);
    c->pid = pid;
    c->alive = true;
    c->out_fd = out_pipe[0];
    c->err_fd = err_pipe[0];
    kids.push_back(std::move(c));
  }

  // Stop protocol state.
  bool stopping = false;
  int exit_code = 0;
  Clock::time_point kill_at = Clock::time_point::max();
  const Clock::time_point job_end =
      opt.timeout_s > 0
          ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s))
          : Clock::time_point::max();
  auto grace = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.grace_s));
  auto signal_all = [&](int sig) {
    for (auto& c : kids)
      if (c->alive) ::kill(-c->pid, sig);  // the rank's process group: its own children too
  };
  auto begin_stop = [&](int code, int sig) {
    stopping = true;
    exit_code = code;
    signal_all(sig);
    kill_at = Clock::now() + grace;
  };
  if (!fork_error.empty()) {
    say(str("could not start rank ", opt.node_rank * opt.nproc_per_node + static_cast<int>(kids.size()), ": ",
            fork_error, "; stopping the others"));
    begin_stop(1, SIGTERM);
  }

  Clock::time_point drain_until = Clock::time_point::max();  // set once every child is reaped
  std::vector<pollfd> pfds;
  std::vector<std::pair<Child*, bool>> owners;  // pfds[i + 1] belongs to (child, is_err)
  char buf[65536];
  for (;;) {
    // Reap.
    bool any_alive = false;
    for (auto& c : kids) {
      if (!c->alive) continue;
      int status = 0;
      pid_t r = ::waitpid(c->pid, &status, WNOHANG);
      if (r == c->pid) {
        c->alive = false;
        c->status = status;
        bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && !stopping) {
          say(str("rank ", c->rank, " (pid ", c->pid, ") ", describe_status(status), "; stopping the other ranks"));
          begin_stop(exit_code_of(status), SIGTERM);
        } else if (stopping) {
          say(str("rank ", c->rank, " (pid ", c->pid, ") ", describe_status(status)));
        }
        // A rank that exits 0 while others still run is normal (ranks finish at different times).
      } else {
        any_alive = true;
      }
    }
    bool any_pipe = false;
    for (auto& c : kids) any_pipe = any_pipe || c->out_fd >= 0 || c->err_fd >= 0;
    if (!any_alive && drain_until == Clock::time_point::max())
      drain_until = Clock::now() + std::chrono::seconds(2);  // grandchildren may keep a pipe open
    if (!any_alive && (!any_pipe || Clock::now() >= drain_until)) break;

    // Deadlines.
    auto now = Clock::now();
    if (!stopping && now >= job_end) {
      say(str("the job ran past --timeout-s ", opt.timeout_s, " s; stopping every rank"));
      begin_stop(124, SIGTERM);
    }
    if (stopping && now >= kill_at) {
      for (auto& c : kids)
        if (c->alive)
          say(str("rank ", c->rank, " (pid ", c->pid, ") did not stop within ", opt.grace_s, " s; SIGKILL"));
      signal_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    Clock::time_point next = std::min({stopping ? kill_at : job_end, drain_until});
    int wait_ms = -1;
    if (next != Clock::time_point::max())
      wait_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() + 1, 0, 1000));

    pfds.clear();
    owners.clear();
    pfds.push_back({g_sig_pipe[0], POLLIN, 0});
    for (auto& c : kids) {
      if (c->out_fd >= 0) {
        pfds.push_back({c->out_fd, POLLIN, 0});
        owners.emplace_back(c.get(), false);
      }
      if (c->err_fd >= 0) {
        pfds.push_back({c->err_fd, POLLIN, 0});
        owners.emplace_back(c.get(), true);
      }
    }
    int n = ::poll(pfds.data(), pfds.size(), wait_ms);
    if (n < 0 && errno != EINTR) MT_THROW("launch: poll() failed: ", std::strerror(errno));
    if (n <= 0) continue;
    if (pfds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t k;
      while ((k = ::read(g_sig_pipe[0], sigs, sizeof(sigs))) > 0) {
        for (ssize_t j = 0; j < k; ++j) {
          int sig = sigs[j];
          if (sig == SIGCHLD) continue;  // reaped at the top of the loop
          if (!stopping) {
            say(str("got signal ", sig, " (", ::strsignal(sig), "); forwarding it to every rank"));
            begin_stop(128 + sig, sig);
          } else {
            say(str("got signal ", sig, " again; SIGKILL to every rank"));
            signal_all(SIGKILL);
          }
        }
      }
    }
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [c, is_err] = owners[i - 1];
      int& fd = is_err ? c->err_fd : c->out_fd;
      LinePrefixer& lp = is_err ? c->err : c->out;
      int target = is_err ? opt.err_fd : opt.out_fd;
      ssize_t k = ::read(fd, buf, sizeof(buf));
      if (k > 0) {
        std::string lines = lp.feed(buf, static_cast<size_t>(k));
        if (!lines.empty()) write_all(target, lines);
      } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) {
        write_all(target, lp.finish());
        ::close(fd);
        fd = -1;
      }
    }
  }
  for (auto& c : kids) {  // pipes still held open by a rank's leftover children
    if (c->out_fd >= 0) {
      write_all(opt.out_fd, c->out.finish());
      ::close(c->out_fd);
    }
    if (c->err_fd >= 0) {
      write_all(opt.err_fd, c->err.finish());
      ::close(c->err_fd);
    }
  }
  if (exit_code != 0) say(str("exiting with code ", exit_code));
  return exit_code;
}

}  // namespace mt::comm
