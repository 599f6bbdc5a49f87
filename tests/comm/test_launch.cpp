// Tests of the launcher: argument checks, line prefixing, and run_launch on /bin/sh ranks (the rank
// environment, exit codes, the stop protocol, SIGKILL escalation, forwarded signals, process groups).
// Every job also carries --timeout-s as a safety net, so a broken stop protocol fails a test instead
// of hanging it. The real `moetrain launch -- _selftest dist` rendezvous is a CLI test (CMakeLists).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "launch/launch.h"
#include "test_util.h"

namespace mt::comm {
namespace {

using testutil::error_of;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

TEST(LaunchArgs, Parses) {
  LaunchOptions o =
      parse_launch_args(split("--nproc-per-node 4 --nnodes 2 --node-rank 1 --master-addr h "
                              "--master-port=29500 --timeout-s 2.5 --grace-s 0 -- train --lr 1e-3"));
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "h");
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  EXPECT_DOUBLE_EQ(o.grace_s, 0);
  EXPECT_EQ(o.args, split("train --lr 1e-3"));
  o = parse_launch_args(split("--nproc-per-node 1 -- grads --nproc-per-node 9"));  // after "--": the command's
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.args, split("grads --nproc-per-node 9"));
}

TEST(LaunchArgs, ErrorsNameTheFlagAndValue) {
  auto err = [](const std::string& s) { return error_of([&] { parse_launch_args(split(s)); }); };
  EXPECT_EQ(err("-- train"),
            "launch: --nproc-per-node is required\nusage: moetrain launch --nproc-per-node N [options] -- <command> "
            "[args...]\n(moetrain launch --help lists every option)");
  EXPECT_EQ(err("--nproc-per-node 0 -- train"), "launch: --nproc-per-node 0; need 1..4096");
  EXPECT_EQ(err("--nproc-per-node two -- train"), "launch: --nproc-per-node 'two' is not a whole number");
  EXPECT_EQ(err("--nproc-per-node"), "launch: --nproc-per-node needs a value (N: 1..4096)");
  EXPECT_EQ(err("--nproc-per-node 2"),
            "launch: nothing to run: put the command after '--', e.g. moetrain launch --nproc-per-node 2 -- train");
  EXPECT_EQ(err("--nproc-per-node 2 train"),
            "launch: unexpected argument 'train' before '--'; the command to run goes after it (moetrain launch "
            "--nproc-per-node 2 -- train)");
  EXPECT_EQ(err("--nproc-per-node 2 --nnodes 2 --node-rank 2 -- x"),
            "launch: --node-rank (2) must be in [0, --nnodes = 2)");
  EXPECT_EQ(err("--nproc-per-node 2 --nnodes 2 --master-port 5 -- x"),
            "launch: --master-addr is required with --nnodes 2 (the host of node 0, reachable from every node)");
  EXPECT_EQ(err("--nproc-per-node 2 --nnodes 2 --master-addr h -- x"),
            "launch: --master-port is required with --nnodes 2 (the same free port on every node)");
  EXPECT_EQ(err("--nproc-per-node 2 --master-port 65536 -- x"),
            "launch: --master-port 65536; need 0..65535; 0: a free port, one node only");
  EXPECT_EQ(err("--nproc-per-node 2 --timeout-s -1 -- x"), "launch: --timeout-s -1; need >= 0; 0: no limit");
}

TEST(LinePrefixer, EmitsWholeLinesOnly) {
  LinePrefixer p("[rank 3] ", 8);
  EXPECT_EQ(p.feed("ab", 2), "");
  EXPECT_EQ(p.feed("c\nde\n\nf", 7), "[rank 3] abc\n[rank 3] de\n[rank 3] \n");
  EXPECT_EQ(p.feed("0123456789", 10), "[rank 3] f0123456\n");  // bounded: split at 8 bytes
  EXPECT_EQ(p.finish(), "[rank 3] 789\n");
  EXPECT_EQ(p.finish(), "");
}

// A job of /bin/sh ranks whose output lands in files of a fresh directory.
struct ShJob {
  std::string dir;
  LaunchOptions opt;
  int code = -1;
  std::string out, err;

  explicit ShJob(const std::string& script, int nproc = 3) {
    char tmpl[] = "/tmp/mt_launch_XXXXXX";
    dir = ::mkdtemp(tmpl);
    opt.nproc_per_node = nproc;
    opt.exe = "/bin/sh";
    opt.args = {"-c", script};
    opt.timeout_s = 60;  // safety net only
    opt.grace_s = 5;
  }
  ~ShJob() { std::system(("rm -rf " + dir).c_str()); }
  void run() {
    std::string out_path = dir + "/out", err_path = dir + "/err";
    FILE* o = std::fopen(out_path.c_str(), "w");
    FILE* e = std::fopen(err_path.c_str(), "w");
    opt.out_fd = ::fileno(o);
    opt.err_fd = ::fileno(e);
    code = run_launch(opt);
    std::fclose(o);
    std::fclose(e);
    out = slurp(out_path);
    err = slurp(err_path);
  }
  static std::string slurp(const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
bool matches(const std::string& s, const std::string& re) {
  return std::regex_search(s, std::regex(re));
}

TEST(Launch, SetsTheRankEnvironmentAndPrefixesOutput) {
  ShJob job(
      "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $MASTER_ADDR $MASTER_PORT\"; "
      "echo to-stderr >&2; printf 'no newline'");
  job.run();
  EXPECT_EQ(job.code, 0) << job.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(job.out, m, std::regex("\\[rank 0\\] 0 3 0 3 0 127\\.0\\.0\\.1 ([0-9]+)\n")))
      << job.out;
  std::string port = m[1];
  EXPECT_NE(port, "0");
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(job.out, str("[rank ", r, "] ", r, " 3 ", r, " 3 0 127.0.0.1 ", port, "\n"))) << job.out;
    EXPECT_TRUE(contains(job.out, str("[rank ", r, "] no newline\n"))) << job.out;
    EXPECT_TRUE(contains(job.err, str("[rank ", r, "] to-stderr\n"))) << job.err;
  }
  EXPECT_FALSE(contains(job.err, "to-stdout"));
}

TEST(Launch, SecondNodeRanksAndGivenMaster) {
  ShJob job("echo \"$RANK $WORLD_SIZE $LOCAL_RANK $NODE_RANK $MASTER_ADDR:$MASTER_PORT\"", 2);
  job.opt.nnodes = 3;
  job.opt.node_rank = 1;
  job.opt.master_addr = "head";
  job.opt.master_port = 29555;
  job.run();
  EXPECT_EQ(job.code, 0) << job.err;
  EXPECT_TRUE(contains(job.out, "[rank 2] 2 6 0 1 head:29555\n")) << job.out;
  EXPECT_TRUE(contains(job.out, "[rank 3] 3 6 1 1 head:29555\n")) << job.out;
}

TEST(Launch, AFailingRankStopsTheOthersAndSetsTheExitCode) {
  ShJob job("if [ \"$RANK\" = 1 ]; then echo dying >&2; exit 5; fi; exec sleep 1000");
  job.run();
  EXPECT_EQ(job.code, 5) << job.err;
  EXPECT_TRUE(matches(job.err, "moetrain launch: rank 1 \\(pid [0-9]+\\) exited with code 5; stopping the other ranks"))
      << job.err;
  EXPECT_TRUE(matches(job.err, "rank 0 \\(pid [0-9]+\\) killed by signal 15")) << job.err;
  EXPECT_TRUE(matches(job.err, "rank 2 \\(pid [0-9]+\\) killed by signal 15")) << job.err;
  EXPECT_TRUE(contains(job.err, "[rank 1] dying\n")) << job.err;
  EXPECT_FALSE(contains(job.err, "ran past --timeout-s")) << job.err;
}

TEST(Launch, ARankKilledByASignalIsNamed) {
  ShJob job("if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 1000", 2);
  job.run();
  EXPECT_EQ(job.code, 128 + 9) << job.err;
  EXPECT_TRUE(matches(job.err, "rank 0 \\(pid [0-9]+\\) killed by signal 9")) << job.err;
}

TEST(Launch, RanksThatIgnoreSigtermAreKilledAfterTheGracePeriod) {
  // An ignored signal stays ignored across exec, so sleep ignores SIGTERM too. Rank 0 fails only once
  // rank 1 is ignoring it.
  ShJob job("", 2);
  job.opt.args[1] =
      str("if [ \"$RANK\" = 0 ]; then while [ ! -f ", job.dir, "/ready ]; do sleep 0.01; done; exit 1; fi; ",
          "trap '' TERM; touch ", job.dir, "/ready; exec sleep 1000");
  job.opt.grace_s = 0.2;
  job.run();
  EXPECT_EQ(job.code, 1) << job.err;
  EXPECT_TRUE(matches(job.err, "rank 1 \\(pid [0-9]+\\) did not stop within 0.2 s; SIGKILL")) << job.err;
  EXPECT_TRUE(matches(job.err, "rank 1 \\(pid [0-9]+\\) killed by signal 9")) << job.err;
}

bool process_gone(pid_t pid) {
  // Gone, or a zombie waiting for init to reap it: either way no longer running.
  for (int i = 0; i < 200; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;
    size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

TEST(Launch, ARanksOwnChildrenAreStoppedWithIt) {
  ShJob job("", 2);
  job.opt.args[1] =
      "if [ \"$RANK\" = 0 ]; then sleep 0.2; exit 2; fi; sleep 1000 & echo $! > " + job.dir + "/grandchild; wait";
  job.run();
  EXPECT_EQ(job.code, 2) << job.err;
  std::ifstream f(job.dir + "/grandchild");
  pid_t pid = 0;
  ASSERT_TRUE(f >> pid);
  EXPECT_TRUE(process_gone(pid)) << "the background sleep of rank 1 (pid " << pid << ") survived";
}

TEST(Launch, SigtermToTheLauncherIsForwarded) {
  ShJob job("", 2);
  job.opt.args[1] = "touch " + job.dir + "/started.$RANK; exec sleep 1000";
  std::string dir = job.dir;
  std::thread killer([dir] {
    // The ranks start after the launcher's handlers are installed: once they exist, signal.
    struct stat st;
    for (int i = 0; i < 1000; ++i) {
      if (::stat((dir + "/started.0").c_str(), &st) == 0 && ::stat((dir + "/started.1").c_str(), &st) == 0) {
        ::kill(::getpid(), SIGTERM);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  job.run();
  killer.join();
  EXPECT_EQ(job.code, 128 + SIGTERM) << job.err;
  EXPECT_TRUE(contains(job.err, "got signal 15 (Terminated); forwarding it to every rank")) << job.err;
  EXPECT_TRUE(matches(job.err, "rank 1 \\(pid [0-9]+\\) killed by signal 15")) << job.err;
}

TEST(Launch, JobTimeoutStopsEveryRank) {
  ShJob job("exec sleep 1000", 2);
  job.opt.timeout_s = 0.3;
  job.run();
  EXPECT_EQ(job.code, 124) << job.err;
  EXPECT_TRUE(contains(job.err, "the job ran past --timeout-s 0.3 s; stopping every rank")) << job.err;
}

TEST(Launch, AnExecutableThatCannotRunIsReported) {
  ShJob job("", 2);
  job.opt.exe = "/no/such/program";
  job.run();
  EXPECT_EQ(job.code, 127) << job.err;
  EXPECT_TRUE(contains(job.err, "cannot execute /no/such/program")) << job.err;
}

TEST(Launch, ConcurrentLinesStayWhole) {
  constexpr int kLines = 3000;
  ShJob job(str("i=0; while [ $i -lt ", kLines,
                " ]; do echo \"$RANK:$i:abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz\"; "
                "i=$((i+1)); done"),
            4);
  job.run();
  ASSERT_EQ(job.code, 0) << job.err;
  std::istringstream in(job.out);
  std::regex line_re(
      "\\[rank ([0-9])\\] ([0-9]):([0-9]+):abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz");
  std::map<int, int> next;  // per rank, the next line number expected (order kept within a rank)
  int total = 0;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_re)) << "torn line: " << line;
    int rank = std::stoi(m[1]);
    ASSERT_EQ(std::stoi(m[2]), rank) << line;
    ASSERT_EQ(std::stoi(m[3]), next[rank]++) << line;
    ++total;
  }
  EXPECT_EQ(total, 4 * kLines);
}

// The launcher's pick of MASTER_PORT stays reserved for the job: a plain bind of it fails while the
// job runs (so no other process's bind or ephemeral port takes it before rank 0's store binds), and
// a bind with SO_REUSEADDR, as the store server does, listens on it.
TEST(Launch, ThePickedMasterPortIsHeldForRankZero) {
  ShJob job(
      "echo $MASTER_PORT > \"$D/port.tmp\" && mv \"$D/port.tmp\" \"$D/port\"; "
      "i=0; while [ ! -e \"$D/done\" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done",
      1);
  ::setenv("D", job.dir.c_str(), 1);
  std::thread launcher([&] { job.run(); });
  int port = 0;
  for (int i = 0; i < 300 && port == 0; ++i) {
    std::ifstream f(job.dir + "/port");
    if (!(f >> port)) port = 0;
    if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(port, 0) << "the rank never wrote MASTER_PORT";
  auto try_bind = [port](bool reuse) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    int e = rc == 0 ? 0 : errno;
    if (rc == 0 && reuse) e = ::listen(fd, 4) == 0 ? 0 : errno;
    ::close(fd);
    return e;
  };
  EXPECT_EQ(try_bind(false), EADDRINUSE) << "port " << port << " was not held";
  EXPECT_EQ(try_bind(true), 0) << "port " << port << ": a SO_REUSEADDR bind (the store server's) failed";
  std::ofstream(job.dir + "/done") << "1";
  launcher.join();
  ::unsetenv("D");
  EXPECT_EQ(job.code, 0) << job.err;
}

}  // namespace
}  // namespace mt::comm
