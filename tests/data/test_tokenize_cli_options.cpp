// `moetrain tokenize` options given to a mode that does not read them once ran and were ignored (--file
// without --bench or --out read stdin instead, --text without --chat printed ids, ...); each is an error now,
// before any input is read (the real binary, stdin from /dev/null; each run a few milliseconds).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "parallel/launch_test_util.h"

using namespace mt::test;

namespace {

const std::string kTok = std::string(MT_SOURCE_DIR) + "/tests/assets/tokenizer/qwen/tokenizer.json";

}  // namespace

TEST(TokenizeCliOptions, AnOptionOfAnotherModeIsAnError) {
  const std::string text = tmp_path("tokclioptions", "text.txt");
  sh("sh -c 'echo hello > " + text + "'");
  const std::pair<std::string, std::string> cases[] = {
      {"--file " + text, "--file is read only with --bench or --out; this run encodes stdin"},
      {"--text", "--text is read only with --chat; this run encodes stdin"},
      {"--add-generation-prompt", "--add-generation-prompt is read only with --chat; this run encodes stdin"},
      {"--enable-thinking false", "--enable-thinking is read only with --chat; this run encodes stdin"},
      {"--skip-special", "--skip-special is read only with --decode; this run encodes stdin"},
      {"--chat --skip-special", "--skip-special is read only with --decode; this run is --chat"},
      {"--chat --jsonl", "--jsonl is read only when encoding or with --decode; this run is --chat"},
      {"--passes 2", "--passes is read only with --bench; this run encodes stdin"},
      {"--decode --eos none", "--eos is read only with --out; this run is --decode"},
      {"--shard-tokens 10", "--shard-tokens is read only with --out; this run encodes stdin"},
      {"--bad-lines fail", "--bad-lines is read only with --out; this run encodes stdin"},
      {"--bench --out " + tmp_path("tokclioptions", "shards"), "--bench and --out are exclusive"},
  };
  for (const auto& [opts, want] : cases) {
    const ShellRun r = sh(kMoetrainBin + " tokenize --tokenizer " + kTok + " " + opts + " < /dev/null");
    EXPECT_NE(r.code, 0) << opts << ": " << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << opts << ": " << r.out;
  }
  // In their own modes they run.
  for (const std::string& opts : std::vector<std::string>{"--decode --jsonl --skip-special",
                                                          "--chat --text --enable-thinking true",
                                                          "--bench --passes 1 --file " + text}) {
    const ShellRun r = sh(kMoetrainBin + " tokenize --tokenizer " + kTok + " " + opts + " < /dev/null");
    EXPECT_EQ(r.code, 0) << opts << ": " << r.out;
  }
}
