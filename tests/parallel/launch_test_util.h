// Helpers for tests that run the real `moetrain` binary (often under `moetrain launch`): a shell
// command with its exit code and output, a per-process temp path, and the step lines of a
// metrics.jsonl.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.h"

// CPU ranks talk through Gloo; builds without it (the GPU machines) cannot run the multi-rank tests.
#define MT_SKIP_WITHOUT_GLOO() \
  if (!::mt::comm::have_gloo()) GTEST_SKIP() << "skipped: this build has no Gloo (CPU communicators)"

namespace mt::test {

inline const std::string kMoetrainBin = std::string(MT_BINARY_DIR) + "/moetrain";
inline const std::string kGoldens = std::string(MT_SOURCE_DIR) + "/tests/assets/goldens";  // model directories

// The evaluation summary a `train --model tiny` run prints ("tiny: loss a -> b, exact-match p% on n"
// up to " held-out problems"); empty when the output has none.
inline std::string eval_summary(const std::string& out) {
  const size_t e = out.find(" held-out problems");
  if (e == std::string::npos) return std::string();
  const size_t b = out.rfind("tiny: loss", e);
  return b == std::string::npos ? std::string() : out.substr(b, e - b);
}

struct ShellRun {
  int code;
  std::string out;
};

// Runs `cmd` with one BLAS thread per process (ranks share the cores), stderr merged into the output.
inline ShellRun sh(const std::string& cmd) {
  std::string full = "OPENBLAS_NUM_THREADS=1 " + cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

// A path in a directory of this test process (`tag` keeps suites apart).
inline std::string tmp_path(const std::string& tag, const std::string& name) {
  std::filesystem::path d = std::filesystem::temp_directory_path() / ("mt_" + tag + "_" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return (d / name).string();
}

// Every line of a JSON-lines file (blank lines skipped), in order.
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> v;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

// The per-step objects of a metrics.jsonl (lines with a "loss"), in order.
inline std::vector<nlohmann::json> read_step_metrics(const std::string& path) {
  std::vector<nlohmann::json> v;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) v.push_back(j);
    }
  return v;
}

}  // namespace mt::test
