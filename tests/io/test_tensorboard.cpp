// Tests for the TensorBoard event files (io/tensorboard.h): CRC32C against published vectors, the
// Event encoding against bytes assembled by hand from event.proto, files written and read back (steps,
// tags, values, both CRCs), damage detected (a cut-short last record, a flipped byte), MetricsWriter's
// file beside metrics.jsonl from a real training run, and — when the tensorboard Python package is
// importable — TensorBoard's own EventAccumulator reading our file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/tensorboard.h"
#include "test_util.h"
#include "train/metrics.h"
#include "train/trainer.h"
#include "train/trainer_test_util.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() /
           ("mt_tb_" + std::string(info->name()) + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

uint32_t crc_of(const std::string& s) {
  return crc32c(s.data(), s.size());
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(b.data(), std::streamsize(b.size()));
}

const TbScalar* find_tag(const TbEvent& e, const std::string& tag) {
  for (const TbScalar& s : e.scalars)
    if (s.tag == tag) return &s;
  return nullptr;
}

// Writes five steps of nested metrics; returns the event file's path.
std::string write_sample_run(const std::string& dir) {
  TensorBoardWriter w(dir);
  for (int step = 1; step <= 5; ++step) {
    nlohmann::json j{{"loss", 4.0 / step},
                     {"skipped", step == 3},
                     {"time_s", {{"forward", 0.25 * step}}},
                     {"experts", {{"imbalance_per_layer", {1.5, 2.5}}}},
                     {"note", "text is not a scalar"}};
    w.add_scalars(step * 10, json_scalars(j), 1.7e9 + step);
  }
  return w.path();
}

}  // namespace

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc_of("123456789"), 0xE3069283u);
  EXPECT_EQ(crc_of(""), 0u);
  // RFC 3720 (iSCSI) appendix B.4.
  EXPECT_EQ(crc_of(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc_of(std::string(32, '\xff')), 0x62A8AB43u);
  std::string inc, dec;
  for (int i = 0; i < 32; ++i) {
    inc.push_back(char(i));
    dec.push_back(char(31 - i));
  }
  EXPECT_EQ(crc_of(inc), 0x46DD794Eu);
  EXPECT_EQ(crc_of(dec), 0x113FDB5Cu);
  // A running value continues over pieces.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
  const uint32_t c = crc_of("123456789");
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, EventEncodingMatchesTheProtoByHand) {
  TbEvent e;
  e.wall_time = 1.5;
  e.step = 3;
  e.scalars = {{"a", 2.0f}};
  // wall_time: key 0x09 + double 1.5; step: key 0x10 + varint 3; summary: key 0x2a, length 10,
  // Summary.value: key 0x0a, length 8, Value{tag: 0x0a 0x01 'a', simple_value: 0x15 + float 2.0}.
  const std::string want("\x09\x00\x00\x00\x00\x00\x00\xf8\x3f\x10\x03\x2a\x0a\x0a\x08\x0a\x01\x61\x15\x00\x00\x00\x40",
                         23);
  EXPECT_EQ(encode_tb_event(e), want);
  TbEvent v;
  v.wall_time = 0;
  v.step = 300;  // varint 0xac 0x02
  v.file_version = "brain.Event:2";
  const std::string want_v = std::string("\x09\0\0\0\0\0\0\0\0\x10\xac\x02\x1a\x0d", 14) + "brain.Event:2";
  EXPECT_EQ(encode_tb_event(v), want_v);
}

TEST(TensorBoard, WritesAndReadsBackStepsTagsAndValues) {
  TempDir d;
  const std::string path = write_sample_run(d.path.string());
  const std::string name = fs::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(tb_event_files(d.path.string()), std::vector<std::string>{path});

  const std::vector<TbEvent> ev = read_tb_events(path);
  ASSERT_EQ(ev.size(), 6u);
  EXPECT_EQ(ev[0].file_version, "brain.Event:2");
  EXPECT_TRUE(ev[0].scalars.empty());
  for (int step = 1; step <= 5; ++step) {
    const TbEvent& e = ev[size_t(step)];
    EXPECT_EQ(e.step, step * 10);
    EXPECT_DOUBLE_EQ(e.wall_time, 1.7e9 + step);
    EXPECT_TRUE(e.file_version.empty());
    ASSERT_EQ(e.scalars.size(), 5u) << "loss, skipped, time_s/forward, experts/imbalance_per_layer/{0,1}";
    ASSERT_NE(find_tag(e, "loss"), nullptr);
    EXPECT_EQ(find_tag(e, "loss")->value, float(4.0 / step));
    ASSERT_NE(find_tag(e, "time_s/forward"), nullptr);
    EXPECT_EQ(find_tag(e, "time_s/forward")->value, float(0.25 * step));
    ASSERT_NE(find_tag(e, "skipped"), nullptr);
    EXPECT_EQ(find_tag(e, "skipped")->value, step == 3 ? 1.0f : 0.0f);
    ASSERT_NE(find_tag(e, "experts/imbalance_per_layer/1"), nullptr);
    EXPECT_EQ(find_tag(e, "experts/imbalance_per_layer/1")->value, 2.5f);
    EXPECT_EQ(find_tag(e, "note"), nullptr);
  }
}

TEST(TensorBoard, TwoWritersInOneSecondGetTwoFiles) {
  TempDir d;
  TensorBoardWriter a(d.path.string()), b(d.path.string());
  EXPECT_NE(a.path(), b.path());
  a.add_scalars(1, {{"x", 1.0f}});
  b.add_scalars(1, {{"x", 2.0f}});
  EXPECT_EQ(read_tb_events(a.path()).at(1).scalars.at(0).value, 1.0f);
  EXPECT_EQ(read_tb_events(b.path()).at(1).scalars.at(0).value, 2.0f);
}

TEST(TensorBoard, DamageIsDetectedAndNamed) {
  TempDir d;
  const std::string path = write_sample_run(d.path.string());
  const std::string good = read_bytes(path);
  std::vector<size_t> starts;  // each record's offset, from the stored lengths
  for (size_t off = 0; off < good.size();) {
    starts.push_back(off);
    uint64_t len;
    std::memcpy(&len, good.data() + off, 8);
    off += 12 + len + 4;
  }
  ASSERT_EQ(starts.size(), 6u);
  const std::string last = path + ": record 5 at byte " + std::to_string(starts[5]);

  // A writer killed mid-record: the last record cut short in its data CRC, its data, its header.
  for (size_t keep : {good.size() - 1, good.size() - 6, starts[5] + 12}) {
    write_bytes(path, good.substr(0, keep));
    const std::string msg = testutil::error_of([&] { read_tb_events(path); });
    EXPECT_NE(msg.find(last + ": the record of "), std::string::npos) << msg;
    EXPECT_NE(msg.find("cut short"), std::string::npos) << msg;
  }
  write_bytes(path, good.substr(0, starts[5] + 5));
  std::string msg = testutil::error_of([&] { read_tb_events(path); });
  EXPECT_NE(msg.find(last + ": the header is cut short (5 of 12 bytes"), std::string::npos) << msg;

  // One flipped bit in the data of record 1, then in the length of record 2.
  std::string bad = good;
  bad[starts[1] + 12 + 3] ^= 0x10;
  write_bytes(path, bad);
  msg = testutil::error_of([&] { read_tb_events(path); });
  EXPECT_NE(msg.find("record 1 at byte " + std::to_string(starts[1]) + ": the data's CRC does not match"),
            std::string::npos)
      << msg;
  bad = good;
  bad[starts[2]] ^= 0x01;
  write_bytes(path, bad);
  msg = testutil::error_of([&] { read_tb_events(path); });
  EXPECT_NE(msg.find("record 2 at byte " + std::to_string(starts[2]) + ": the length's CRC does not match"),
            std::string::npos)
      << msg;
  write_bytes(path, good);
  EXPECT_EQ(read_tb_events(path).size(), 6u);
}

TEST(TensorBoard, MetricsWriterKeepsAnEventFileBesideTheJsonl) {
  TempDir d;
  const std::string jsonl = (d.path / "sub" / "metrics.jsonl").string();
  {
    MetricsWriter m(jsonl, true);
    ASSERT_FALSE(m.tensorboard_path().empty());
    EXPECT_EQ(fs::path(m.tensorboard_path()).parent_path(), d.path / "sub");
    m.write({{"step", 1}, {"loss", 3.0}, {"time_s", {{"step", 0.5}}}});
    m.write({{"step", 2}, {"loss", 2.0}});
    m.write({{"event", "eval"}, {"step", 2}, {"exact_match", 42.5}});
    m.write({{"loss", 1.0}});  // no step: the last step seen
  }
  const std::vector<std::string> files = tb_event_files((d.path / "sub").string());
  ASSERT_EQ(files.size(), 1u);
  const std::vector<TbEvent> ev = read_tb_events(files[0]);
  ASSERT_EQ(ev.size(), 5u);
  EXPECT_EQ(ev[1].step, 1);
  EXPECT_EQ(find_tag(ev[1], "step"), nullptr) << "the step is the event's step, not a scalar";
  ASSERT_NE(find_tag(ev[1], "time_s/step"), nullptr);
  EXPECT_EQ(find_tag(ev[1], "time_s/step")->value, 0.5f);
  EXPECT_EQ(ev[2].step, 2);
  EXPECT_EQ(ev[3].step, 2);
  ASSERT_EQ(ev[3].scalars.size(), 1u);
  EXPECT_EQ(ev[3].scalars[0].tag, "eval/exact_match");
  EXPECT_EQ(ev[3].scalars[0].value, 42.5f);
  EXPECT_EQ(ev[4].step, 2);

  // Switched off, and on a rank that does not lead: no event file.
  TempDir off;
  {
    MetricsWriter m((off.path / "metrics.jsonl").string(), true, false);
    EXPECT_TRUE(m.tensorboard_path().empty());
    m.write({{"step", 1}, {"loss", 3.0}});
    MetricsWriter other((off.path / "other" / "metrics.jsonl").string(), false);
    EXPECT_TRUE(other.tensorboard_path().empty());
  }
  EXPECT_TRUE(tb_event_files(off.path.string()).empty());
  EXPECT_TRUE(fs::exists(off.path / "metrics.jsonl"));
}

// A real (tiny, 4-step) training run: the event file holds every step's loss as metrics.jsonl has it.
TEST(TensorBoard, TrainingRunWritesItsCurves) {
  TrainConfig c = test::tiny_train_run("tb", "train", 4);
  run_training(c);
  std::vector<nlohmann::json> rows;
  {
    std::ifstream f(c.out_dir + "/metrics.jsonl");
    std::string line;
    while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  }
  const std::vector<std::string> files = tb_event_files(c.out_dir);
  ASSERT_EQ(files.size(), 1u);
  const std::vector<TbEvent> ev = read_tb_events(files[0]);
  ASSERT_EQ(ev.size(), rows.size() + 1);
  int steps = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const TbEvent& e = ev[i + 1];
    EXPECT_EQ(e.step, rows[i]["step"].get<int64_t>());
    if (rows[i].contains("event")) {
      ASSERT_NE(find_tag(e, "eval/exact_match"), nullptr);
      continue;
    }
    ++steps;
    for (const char* tag : {"loss", "grad_norm", "lr", "tokens_per_s"}) {
      ASSERT_NE(find_tag(e, tag), nullptr) << tag;
      EXPECT_EQ(find_tag(e, tag)->value, float(rows[i][tag].get<double>())) << tag;
    }
    ASSERT_NE(find_tag(e, "time_s/forward"), nullptr);
    ASSERT_NE(find_tag(e, "experts/imbalance"), nullptr);
  }
  EXPECT_EQ(steps, 4);
  fs::remove_all(c.out_dir);
  c.tensorboard = 0;
  run_training(c);
  EXPECT_TRUE(tb_event_files(c.out_dir).empty());
  fs::remove_all(c.out_dir);
}

// TensorBoard's own reader, when the package is installed (MT_TB_PYTHON picks the interpreter).
TEST(TensorBoard, TensorBoardPackageReadsTheFile) {
  const char* env = std::getenv("MT_TB_PYTHON");
  const std::string py = env && *env ? env : "python3";
  const std::string probe =
      py + " -c 'from tensorboard.backend.event_processing import event_accumulator' > /dev/null 2>&1";
  if (std::system(probe.c_str()) != 0)
    GTEST_SKIP() << "skipped: the tensorboard Python package is not importable by " << py
                 << " (pip install tensorboard, or set MT_TB_PYTHON to an interpreter that has it)";
  TempDir d;
  write_sample_run(d.path.string());
  const std::string script = d.path.string() + "/read.py";
  {
    std::ofstream f(script);
    f << "import json, sys\n"
         "from tensorboard.backend.event_processing import event_accumulator as ea\n"
         "acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})\n"
         "acc.Reload()\n"
         "out = {t: [[s.step, s.value] for s in acc.Scalars(t)] for t in acc.Tags()['scalars']}\n"
         "print(json.dumps(out))\n";
  }
  const std::string cmd = py + " " + script + " " + d.path.string() + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out.substr(out.rfind('{', out.find("\"loss\""))));
  ASSERT_TRUE(j.contains("loss")) << out;
  ASSERT_EQ(j["loss"].size(), 5u) << out;
  for (int step = 1; step <= 5; ++step) {
    EXPECT_EQ(j["loss"][size_t(step - 1)][0].get<int64_t>(), step * 10);
    EXPECT_FLOAT_EQ(j["loss"][size_t(step - 1)][1].get<float>(), float(4.0 / step));
  }
  ASSERT_TRUE(j.contains("time_s/forward")) << out;
  EXPECT_FLOAT_EQ(j["time_s/forward"][4][1].get<float>(), 1.25f);
  EXPECT_TRUE(j.contains("experts/imbalance_per_layer/0")) << out;
}
