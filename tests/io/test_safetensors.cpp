// Tests for safetensors reading/writing and checkpoint directories: round trips in every dtype,
// row slices, sharding, the errors a user sees for broken files, and a file written by Python's
// safetensors library (tools/make_safetensors_fixture.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "io/safetensors.h"

using namespace mt;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() / ("mt_io_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
                                        std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

Tensor arange_f32(const Shape& shape, float scale = 1.0f, float offset = 0.0f) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = float(i) * scale + offset;
  return t;
}

Tensor i64_tensor(std::vector<int64_t> v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, DType::I64);
  std::memcpy(t.raw(), v.data(), v.size() * 8);
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
}

#define EXPECT_CONTAINS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << haystack

}  // namespace

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir dir;
  Tensor f32 = arange_f32({2, 3}, 0.25f, -1.0f);
  Tensor bf16 = arange_f32({5}, 1.5f, -3.0f).to(DType::BF16);
  Tensor f16 = arange_f32({3, 2}, 0.125f, 0.5f).to(DType::F16);
  Tensor i64 = i64_tensor({0, -1, int64_t(1) << 40, 42});
  Tensor i32 = arange_f32({2}, 7.0f).to(DType::I32);
  Tensor scalar = arange_f32({}, 1.0f, 3.5f);
  Tensor empty = Tensor::empty({0, 4});
  NamedTensors in = {{"a.f32", f32}, {"b.bf16", bf16},     {"c.f16", f16},    {"d.i64", i64},
                     {"e.i32", i32}, {"f.scalar", scalar}, {"g.empty", empty}};
  std::string path = dir / "x.safetensors";
  write_safetensors(path, in, {{"step", "12"}});
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile f(path);
  std::vector<std::string> order;
  for (auto& [n, t] : in) order.push_back(n);
  EXPECT_EQ(f.names(), order);  // data in the given order
  EXPECT_EQ(f.metadata().at("step"), "12");
  EXPECT_EQ(f.metadata().at("format"), "pt");  // transformers needs it
  for (auto& [name, t] : in) {
    SCOPED_TRACE(name);
    EXPECT_EQ(f.info(name).dtype, t.dtype());
    EXPECT_EQ(f.info(name).shape, t.shape());
    EXPECT_TRUE(same_bytes(f.view(name), t));
    Tensor r = f.read_f32(name);
    Tensor want = t.to(DType::F32);
    EXPECT_TRUE(same_bytes(r, want));
  }
  EXPECT_EQ(f.read_f32("d.i64").data<float>()[2], float(int64_t(1) << 40));

  // Header length is a multiple of 8, so data (and views into it) are 8-byte aligned.
  std::ifstream raw(path, std::ios::binary);
  uint64_t header_len = 0;
  raw.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(fs::file_size(path), 8 + header_len + f32.nbytes() + bf16.nbytes() + f16.nbytes() + i64.nbytes() +
                                     i32.nbytes() + scalar.nbytes());
}

TEST(Safetensors, ViewIsZeroCopyAndOutlivesTheFile) {
  TempDir dir;
  Tensor w = arange_f32({4, 4});
  write_safetensors(dir / "w.safetensors", {{"w", w}});
  Tensor v1, v2;
  {
    SafetensorsFile f(dir / "w.safetensors");
    v1 = f.view("w");
    v2 = f.view("w");
  }
  EXPECT_EQ(v1.raw(), v2.raw());   // both point into the one mapping
  EXPECT_TRUE(same_bytes(v1, w));  // still readable after the SafetensorsFile is gone
}

TEST(Safetensors, MisalignedDataGivesAnAlignedCopy) {
  TempDir dir;
  Tensor h = arange_f32({3}).to(DType::F16);  // 6 bytes: the next tensor starts at offset 6
  Tensor w = arange_f32({2}, 1.0f, 10.0f);
  write_safetensors(dir / "m.safetensors", {{"h", h}, {"w", w}});
  SafetensorsFile f(dir / "m.safetensors");
  EXPECT_EQ(f.info("w").begin, 6u);
  Tensor v = f.view("w");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.raw()) % 4, 0u);
  EXPECT_TRUE(same_bytes(v, w));
  EXPECT_TRUE(same_bytes(f.read_rows_f32("w", 1, 1), w.rows(1, 1).clone()));
}

TEST(Safetensors, ReadRowsEqualsFullRows) {
  TempDir dir;
  Rng rng(3);
  Tensor w = Tensor::empty({7, 5});
  rng.fill_normal(w, 0.0f, 1.0f);
  write_safetensors(dir / "r.safetensors", {{"w.bf16", w.to(DType::BF16)}, {"w.f32", w}});
  SafetensorsFile f(dir / "r.safetensors");
  for (const char* name : {"w.bf16", "w.f32"}) {
    SCOPED_TRACE(name);
    Tensor full = f.read_f32(name);
    for (auto [start, len] : std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {2, 3}, {6, 1}, {7, 0}}) {
      Tensor part = f.read_rows_f32(name, start, len);
      EXPECT_EQ(part.shape(), (Shape{len, 5}));
      EXPECT_TRUE(same_bytes(part, full.rows(start, len).clone()));
    }
  }
  std::string msg = error_of([&] { f.read_rows_f32("w.f32", 5, 3); });
  EXPECT_CONTAINS(msg, "out of range");
  EXPECT_CONTAINS(msg, "[7, 5]");
}

TEST(Safetensors, ReadsFileWrittenByPython) {
  SafetensorsFile f(std::string(MT_SOURCE_DIR) + "/tests/assets/safetensors/py_written.safetensors");
  EXPECT_EQ(f.metadata().at("made_by"), "tools/make_safetensors_fixture.py");
  EXPECT_EQ(f.names().size(), 4u);

  EXPECT_EQ(f.info("weight.f32").dtype, DType::F32);
  EXPECT_EQ(f.info("weight.f32").shape, (Shape{2, 3}));
  Tensor a = f.read_f32("weight.f32");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(a.data<float>()[i], 0.5f * float(i) - 1.0f);

  EXPECT_EQ(f.info("weight.bf16").dtype, DType::BF16);
  Tensor b = f.view("weight.bf16");
  EXPECT_EQ(b.dtype(), DType::BF16);
  const float want_b[4] = {1.0f, -2.5f, 3.140625f, 65280.0f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bf16_to_f32(b.data<uint16_t>()[i]), want_b[i]);

  EXPECT_EQ(f.info("weight.f16").dtype, DType::F16);
  EXPECT_EQ(f.info("weight.f16").shape, (Shape{2, 2}));
  Tensor h = f.read_f32("weight.f16");
  const float want_h[4] = {0.333251953125f, -65504.0f, std::ldexp(1.0f, -24), 7.0f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(h.data<float>()[i], want_h[i]);

  Tensor s = f.view("steps.i64");
  EXPECT_EQ(s.dtype(), DType::I64);
  EXPECT_EQ(s.data<int64_t>()[0], 0);
  EXPECT_EQ(s.data<int64_t>()[1], -7);
  EXPECT_EQ(s.data<int64_t>()[2], int64_t(1) << 40);
}

TEST(Safetensors, TruncatedFileNamesTensorAndSizes) {
  TempDir dir;
  std::string path = dir / "t.safetensors";
  write_safetensors(path, {{"first", arange_f32({4})}, {"second", arange_f32({8})}});
  const uint64_t full = fs::file_size(path);
  fs::resize_file(path, full - 4);
  std::string msg = error_of([&] { SafetensorsFile f(path); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "truncated");
  EXPECT_CONTAINS(msg, "'second'");
  EXPECT_CONTAINS(msg, "ends at byte " + std::to_string(full));
  EXPECT_CONTAINS(msg, "has " + std::to_string(full - 4) + " bytes");

  fs::resize_file(path, 20);  // now even the header is cut
  msg = error_of([&] { SafetensorsFile f(path); });
  EXPECT_CONTAINS(msg, "truncated: the header needs");
  EXPECT_CONTAINS(msg, "has 20 bytes");
}

TEST(Safetensors, BadHeadersAreReported) {
  TempDir dir;
  std::string p = dir / "bad.safetensors";
  {
    std::ofstream out(p, std::ios::binary);
    out << "abc";
  }
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(p); }), "too short");

  {
    std::ofstream out(p, std::ios::binary);
    out << "GARBAGE GARBAGE GARBAGE";  // header length decodes to a huge number
  }
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(p); }), "not plausible");

  write_raw(p, "{\"a\": [1, 2", 0);
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(p); }), "not valid JSON");

  write_raw(p, R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})", 16);
  std::string msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, "'w' has dtype F64");
  EXPECT_CONTAINS(msg, "supported: F32, BF16, F16, I32, I64");

  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24);
  msg = error_of([&] { SafetensorsFile f(p); });
  EXPECT_CONTAINS(msg, "'w' (F32 [2, 3]) needs 24 bytes");
  EXPECT_CONTAINS(msg, "span 20");

  write_raw(p, R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(p); }), "non-negative");

  write_raw(p, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(p); }), "data_offsets");

  EXPECT_CONTAINS(error_of([&] { SafetensorsFile f(dir / "absent.safetensors"); }), "cannot open");
}

TEST(Safetensors, MissingTensorNamesIt) {
  TempDir dir;
  write_safetensors(dir / "x.safetensors", {{"w", arange_f32({2})}});
  SafetensorsFile f(dir / "x.safetensors");
  EXPECT_TRUE(f.has("w"));
  EXPECT_FALSE(f.has("v"));
  std::string msg = error_of([&] { f.read_f32("v"); });
  EXPECT_CONTAINS(msg, "'v' not found");
  EXPECT_CONTAINS(msg, dir / "x.safetensors");
}

TEST(Safetensors, WriterRejectsDuplicatesAndUnwritablePaths) {
  TempDir dir;
  Tensor w = arange_f32({2});
  EXPECT_CONTAINS(error_of([&] {
                    write_safetensors(dir / "d.safetensors", {{"w", w}, {"w", w}});
                  }),
                  "'w' appears twice");
  std::string bad = dir / "no/such/dir/x.safetensors";
  EXPECT_CONTAINS(error_of([&] { write_safetensors(bad, {{"w", w}}); }), "no/such/dir/x.safetensors.tmp");
  EXPECT_FALSE(fs::exists(dir / "d.safetensors"));
}

TEST(Checkpoint, ShardedRoundTripAndRewriteAsSingleFile) {
  TempDir dir;
  NamedTensors in;
  for (int i = 0; i < 5; ++i) in.push_back({"layer." + std::to_string(i), arange_f32({16, 16}, 1.0f, float(i))});
  in.push_back({"small.bf16", arange_f32({3}).to(DType::BF16)});
  const size_t each = 16 * 16 * 4;  // 1 KiB
  write_safetensors_sharded(dir.path.string(), in, 2 * each + 100);

  // 1 KiB tensors packed two per shard, the small one joining the last: 3 shards.
  for (const char* f : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                        "model-00003-of-00003.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  std::ifstream idx(dir / "model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(idx);
  EXPECT_EQ(index["metadata"]["total_size"].get<size_t>(), 5 * each + 6);
  EXPECT_EQ(index["weight_map"]["layer.2"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["small.bf16"], "model-00003-of-00003.safetensors");

  CheckpointReader r(dir.path.string());
  EXPECT_EQ(r.num_files(), 3u);
  EXPECT_EQ(r.names().size(), in.size());
  for (auto& [name, t] : in) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(r.has(name));
    EXPECT_EQ(r.info(name).shape, t.shape());
    EXPECT_TRUE(same_bytes(r.view(name), t));
    EXPECT_TRUE(same_bytes(r.read_f32(name), t.to(DType::F32)));
  }
  EXPECT_TRUE(same_bytes(r.read_rows_f32("layer.4", 3, 2), in[4].second.rows(3, 2).clone()));

  // Saving again under the limit leaves one file and removes the index and the old shards.
  write_safetensors_sharded(dir.path.string(), in, 1 << 20);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  CheckpointReader r2(dir.path.string());
  EXPECT_EQ(r2.num_files(), 1u);
  EXPECT_TRUE(same_bytes(r2.view("layer.3"), in[3].second));
}

TEST(Checkpoint, MissingTensorAndMissingFilesAreNamed) {
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { CheckpointReader r(dir.path.string()); }),
                  "no checkpoint in '" + dir.path.string() + "'");
  EXPECT_CONTAINS(error_of([&] { CheckpointReader r(dir / "nowhere"); }), "does not exist");

  write_safetensors_sharded(dir.path.string(), {{"a", arange_f32({4})}, {"b", arange_f32({4})}}, 16);
  CheckpointReader r(dir.path.string());
  std::string msg = error_of([&] { r.read_f32("model.layers.0.mlp.gate.weight"); });
  EXPECT_CONTAINS(msg, "'model.layers.0.mlp.gate.weight' not found");
  EXPECT_CONTAINS(msg, dir.path.string());

  // An index that points at a file without the tensor, or at a file that is not there.
  {
    std::ofstream out(dir / "model.safetensors.index.json");
    out << R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}})";
  }
  msg = error_of([&] { CheckpointReader r2(dir.path.string()); });
  EXPECT_CONTAINS(msg, "tensor 'c' is in 'model-00001-of-00002.safetensors'");
  {
    std::ofstream out(dir / "model.safetensors.index.json");
    out << R"({"weight_map": {"a": "gone.safetensors"}})";
  }
  EXPECT_CONTAINS(error_of([&] { CheckpointReader r2(dir.path.string()); }), "'gone.safetensors'");
}

TEST(Checkpoint, ReadsASingleFilePath) {
  TempDir dir;
  write_safetensors(dir / "one.safetensors", {{"w", arange_f32({2, 2})}});
  CheckpointReader r(dir / "one.safetensors");
  EXPECT_EQ(r.names(), std::vector<std::string>{"w"});
  EXPECT_EQ(r.read_f32("w").data<float>()[3], 3.0f);
}
