// Rewards (rewards.h): the built-in checkers and the external reward program.
#include "rl/rewards/rewards.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace mt::rl {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string squeeze(std::string_view s) {  // without whitespace and $
  std::string out;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c)) && c != '$') out.push_back(c);
  return out;
}

std::optional<double> parse_plain(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

// A number as a final answer is written: 42, -3.5, +7, 1,234, 3/4, $12$.
std::optional<double> parse_number(std::string_view text) {
  std::string s = squeeze(text);
  if (!s.empty() && s[0] == '+') s.erase(0, 1);
  s.erase(std::remove(s.begin(), s.end(), ','), s.end());
  if (s.empty() || s.find_first_of("0123456789") == std::string::npos) return std::nullopt;
  const size_t slash = s.find('/');
  if (slash != std::string::npos) {
    const auto a = parse_plain(s.substr(0, slash)), b = parse_plain(s.substr(slash + 1));
    if (!a || !b || *b == 0) return std::nullopt;
    return *a / *b;
  }
  return parse_plain(s);
}

}  // namespace

double exact_match_reward(std::string_view response, std::string_view answer) {
  return trim(response) == trim(answer) ? 1.0 : 0.0;
}

std::optional<std::string> extract_final_answer(std::string_view r) {
  const size_t box = r.rfind("\\boxed{");
  if (box != std::string_view::npos) {
    int depth = 1;
    const size_t begin = box + 7;
    for (size_t i = begin; i < r.size(); ++i) {
      if (r[i] == '{') ++depth;
      if (r[i] == '}' && --depth == 0) return std::string(trim(r.substr(begin, i - begin)));
    }
    // An unclosed \boxed{: fall back to the last number.
  }
  // The last run of number characters that holds a digit.
  auto is_num = [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == ',' || c == '/' || c == '-' || c == '+';
  };
  size_t end = r.size();
  while (end > 0) {
    while (end > 0 && !is_num(r[end - 1])) --end;
    size_t begin = end;
    while (begin > 0 && is_num(r[begin - 1])) --begin;
    std::string tok(r.substr(begin, end - begin));
    while (!tok.empty() &&
           (tok.back() == '.' || tok.back() == ',' || tok.back() == '-' || tok.back() == '+' || tok.back() == '/'))
      tok.pop_back();  // the sentence's full stop, a trailing comma
    if (tok.find_first_of("0123456789") != std::string::npos) return tok;
    end = begin;
  }
  return std::nullopt;
}

bool answers_equivalent(std::string_view a, std::string_view b) {
  const auto x = parse_number(a), y = parse_number(b);
  if (x && y) return std::abs(*x - *y) <= 1e-9 * std::max(1.0, std::abs(*y));
  return squeeze(a) == squeeze(b) && !squeeze(a).empty();
}

double math_reward(std::string_view response, std::string_view answer) {
  const auto got = extract_final_answer(response);
  return got && answers_equivalent(*got, answer) ? 1.0 : 0.0;
}

// ---- the external program ----

namespace {

// The first word of a shell command, and whether it names an executable file (directly or on PATH).
void check_executable(const std::string& command) {
  std::istringstream is(command);
  std::string prog;
  is >> prog;
  if (prog.empty()) MT_THROW("reward program: the command is empty");
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (prog.find('/') != std::string::npos) {
    struct stat st {};
    if (::stat(prog.c_str(), &st) != 0) MT_THROW("reward program '", prog, "' does not exist (command: ", command, ")");
    if (!executable(prog)) MT_THROW("reward program '", prog, "' is not an executable file (command: ", command, ")");
    return;
  }
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && executable(dir + "/" + prog)) return;
  MT_THROW("reward program '", prog, "' is not an executable on PATH (command: ", command, ")");
}

double seconds_left(std::chrono::steady_clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
}

}  // namespace

RewardProgram::RewardProgram(RewardProgramOptions opt) : opt_(std::move(opt)) {
  if (!(opt_.timeout_s > 0)) MT_THROW("reward program: the timeout (", opt_.timeout_s, " s) must be > 0");
  check_executable(opt_.command);
  ::signal(SIGPIPE, SIG_IGN);  // a dead program's pipe is an error code, not a signal
  start();
}

RewardProgram::~RewardProgram() {
  stop();
}

void RewardProgram::start() {
  int in[2], out[2];
  if (::pipe(in) != 0 || ::pipe(out) != 0) MT_THROW("reward program: pipe failed: ", std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) MT_THROW("reward program: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);  // its own process group: stop() kills what the program started too
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::close(in[0]);
    ::close(in[1]);
    ::close(out[0]);
    ::close(out[1]);
    ::execl("/bin/sh", "sh", "-c", opt_.command.c_str(), static_cast<char*>(nullptr));
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
}

void RewardProgram::stop() {
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
}

RewardBatch RewardProgram::score(const std::vector<RewardRequest>& batch) {
  const size_t n = batch.size();
  RewardBatch out{std::vector<double>(n, 0.0), std::vector<std::string>(n), 0};
  if (n == 0) return out;
  if (pid_ < 0) {
    start();
    ++restarts_;
  }
  std::string send;
  for (const RewardRequest& r : batch)
    send += nlohmann::json{{"prompt", r.prompt}, {"response", r.response}, {"metadata", r.metadata}}.dump() + "\n";
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(opt_.timeout_s));
  size_t sent = 0, got = 0;
  std::string failure;  // why the rest of the batch has no reward
  auto take_line = [&](const std::string& line) {
    const size_t i = got++;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      const nlohmann::json& v = j.is_object() && j.contains("reward") ? j.at("reward") : j;
      if (!v.is_number() || !std::isfinite(v.get<double>())) throw std::runtime_error("not a finite number");
      out.rewards[i] = v.get<double>();
    } catch (const std::exception&) {
      out.errors[i] = "malformed reply '" + line.substr(0, 200) + "' (expected a number or {\"reward\": number})";
    }
  };
  while (got < n && failure.empty()) {
    const double left = seconds_left(deadline);
    if (left <= 0) {
      failure = "no reply within the batch's " + std::to_string(opt_.timeout_s) + " s";
      break;
    }
    pollfd fds[2] = {{from_child_, POLLIN, 0}, {to_child_, short(sent < send.size() ? POLLOUT : 0), 0}};
    const int rc = ::poll(fds, sent < send.size() ? 2 : 1, int(std::ceil(std::min(left, 1.0) * 1000)));
    if (rc < 0 && errno != EINTR) MT_THROW("reward program: poll failed: ", std::strerror(errno));
    if (sent < send.size() && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t w = ::write(to_child_, send.data() + sent, send.size() - sent);
      if (w > 0)
        sent += size_t(w);
      else if (w < 0 && errno != EAGAIN && errno != EINTR)
        failure = "the reward program closed its input";
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      char buf[65536];
      const ssize_t r = ::read(from_child_, buf, sizeof buf);
      if (r > 0) {
        pending_.append(buf, size_t(r));
        size_t nl;
        while (got < n && (nl = pending_.find('\n')) != std::string::npos) {
          take_line(pending_.substr(0, nl));
          pending_.erase(0, nl + 1);
        }
      } else if (r == 0) {
        int status = 0;
        ::waitpid(pid_, &status, 0);
        failure = WIFEXITED(status) ? "the reward program exited with status " + std::to_string(WEXITSTATUS(status))
                                    : "the reward program was killed by signal " + std::to_string(WTERMSIG(status));
        ::close(to_child_);
        ::close(from_child_);
        pid_ = to_child_ = from_child_ = -1;
      }
    }
  }
  if (!failure.empty()) {
    for (size_t i = got; i < n; ++i) out.errors[i] = failure;
    if (pid_ >= 0) stop();  // late: killed, restarted with the next batch
  }
  for (size_t i = 0; i < n; ++i)
    if (!out.errors[i].empty()) {
      out.rewards[i] = 0;
      ++out.failures;
    }
  if (out.failures > 0) {
    size_t first = 0;
    while (out.errors[first].empty()) ++first;
    const std::string msg =
        str("reward program: ", out.failures, " of ", n, " samples without a reward; sample ", first, ": ",
            out.errors[first], " (response: '", batch[first].response.substr(0, 80), "')");
    if (opt_.stop_on_error) MT_THROW(msg);
    log_info("warning: ", msg, "; they get reward 0");
  }
  return out;
}

}  // namespace mt::rl
