// The library's layering (DESIGN, README's code map): each folder of src/ includes only folders below it,
// so that nothing low depends on something high (the commands in src/cli sit on top; no library folder
// includes them). ops and backend are one layer (the op interface and its implementations include each
// other's headers). The test reads every source file's `#include "folder/..."` lines.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

namespace fs = std::filesystem;

TEST(Layering, NoIncludeGoesBackUp) {
  const std::map<std::string, int> level = {
      {"core", 0},  {"io", 1},      {"data", 1},  {"ops", 2},    {"backend", 2}, {"comm", 3}, {"launch", 3},
      {"moe", 4},   {"model", 5},   {"parallel", 6}, {"rollout", 6}, {"train", 7}, {"selftest", 7}, {"rl", 8},
      {"cli", 9}};
  const std::regex inc("^#include \"([a-z_]+)/");
  int files = 0, includes = 0;
  std::string bad;
  for (const auto& e : fs::recursive_directory_iterator(std::string(MT_SOURCE_DIR) + "/src")) {
    if (!e.is_regular_file()) continue;
    const std::string ext = e.path().extension().string();
    if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh") continue;
    const std::string rel = fs::relative(e.path(), std::string(MT_SOURCE_DIR) + "/src").string();
    const std::string folder = rel.substr(0, rel.find('/'));
    const auto me = level.find(folder);
    ASSERT_NE(me, level.end()) << "src/" << folder << " has no place in the layering: add it to this test and the docs";
    ++files;
    std::ifstream f(e.path());
    std::string line;
    std::smatch m;
    while (std::getline(f, line))
      if (std::regex_search(line, m, inc)) {
        ++includes;
        const auto it = level.find(m[1].str());
        if (it == level.end()) continue;  // not a folder of src/ (e.g. "nlohmann/...")
        if (it->second > me->second) bad += "\n  src/" + rel + ": " + line;
      }
  }
  EXPECT_GT(files, 100);
  EXPECT_GT(includes, 500);
  EXPECT_TRUE(bad.empty()) << "includes that go back up:" << bad;
}
