// Durable runs: manifests that catch missing, truncated and corrupted files; training-state shards
// that reshard to any layout; and `moetrain train --resume` end to end — byte-exact on one CPU process,
// the same losses after changing the layout, the previous checkpoint after a corrupt one or a run
// killed while saving, and errors that name the path when the disk refuses.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/manifest.h"
#include "io/safetensors.h"
#include "io/tensorboard.h"
#include "parallel/launch_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/train_config.h"

using namespace mt;
using namespace mt::test;
namespace fs = std::filesystem;

namespace {

std::string fresh_dir(const std::string& name) {
  const std::string d = tmp_path("ckpt", name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void flip_byte(const fs::path& p, size_t at) {
  std::string b = read_bytes(p);
  ASSERT_LT(at, b.size());
  b[at] = char(b[at] ^ 0x01);
  std::ofstream(p, std::ios::binary | std::ios::trunc) << b;
}

// The tiny model on the CPU, 10 steps (the LR schedule spans them all), one thread per process.
std::string train_cmd(const std::string& run_dir, const std::string& extra = "") {
  return kMoetrainBin +
         " train --model tiny --device cpu --steps 10 --micro-batch-size 2 --grad-accum 2 --seq-len 32"
         " --warmup-steps 2 --eval-problems 0 --threads 1 --tensorboard 0 --log-every 1 --run-dir " +
         run_dir + " " + extra;
}

std::vector<double> losses(const std::string& run_dir) {
  std::vector<double> v;
  for (const auto& j : read_step_metrics(run_dir + "/metrics.jsonl")) v.push_back(j["loss"].get<double>());
  return v;
}

// This process's scratch directory goes when the process ends (the reference run lives there).
struct RemoveScratchAtExit {
  ~RemoveScratchAtExit() { fs::remove_all(fs::path(tmp_path("ckpt", "x")).parent_path()); }
} remove_scratch_at_exit;

// The straight 10-step run every resume is compared with (run once per test process).
const std::string& reference_run() {
  static const std::string dir = [] {
    const std::string d = fresh_dir("reference");
    ShellRun r = sh(train_cmd(d));
    EXPECT_EQ(r.code, 0) << r.out;
    return d;
  }();
  return dir;
}

}  // namespace

TEST(Manifest, Crc32cMatchesTheKnownValueAndTheTableVersion) {
  EXPECT_EQ(crc32c_hw("123456789", 9), 0xE3069283u);
  std::mt19937 rng(7);
  std::string data(100003, '\0');
  for (char& c : data) c = char(rng());
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), size_t(4097), data.size()})
    EXPECT_EQ(crc32c_hw(data.data(), n), crc32c(data.data(), n)) << n;
  // Continued in two parts = in one.
  EXPECT_EQ(crc32c_hw(data.data() + 13, data.size() - 13, crc32c_hw(data.data(), 13)),
            crc32c_hw(data.data(), data.size()));
}

TEST(Manifest, FindsMissingTruncatedGrownAndCorruptedFiles) {
  const std::string d = fresh_dir("manifest");
  EXPECT_NE(verify_manifest(d).find("no manifest.json"), std::string::npos) << verify_manifest(d);
  write_bytes(fs::path(d) / "a.bin", std::string(5000, 'a'));
  write_bytes(fs::path(d) / "sub" / "b.bin", "hello world");
  const std::vector<ManifestEntry> m = write_manifest(d);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].path, "a.bin");
  EXPECT_EQ(m[1].path, "sub/b.bin");
  EXPECT_EQ(m[1].size, 11u);
  EXPECT_EQ(verify_manifest(d), "");

  flip_byte(fs::path(d) / "a.bin", 4321);
  std::string why = verify_manifest(d);
  EXPECT_NE(why.find("a.bin has CRC32C"), std::string::npos) << why;
  EXPECT_NE(why.find("corrupted"), std::string::npos) << why;
  EXPECT_EQ(verify_manifest(d, /*check_hashes=*/false), "");  // the size is right
  flip_byte(fs::path(d) / "a.bin", 4321);
  EXPECT_EQ(verify_manifest(d), "");

  fs::resize_file(fs::path(d) / "a.bin", 4000);
  why = verify_manifest(d, false);
  EXPECT_NE(why.find("a.bin has 4000 bytes, the manifest says 5000"), std::string::npos) << why;
  write_bytes(fs::path(d) / "a.bin", std::string(5001, 'a'));
  EXPECT_NE(verify_manifest(d).find("a.bin has 5001 bytes"), std::string::npos);
  write_bytes(fs::path(d) / "a.bin", std::string(5000, 'a'));
  fs::remove(fs::path(d) / "sub" / "b.bin");
  EXPECT_NE(verify_manifest(d).find("sub/b.bin is missing"), std::string::npos) << verify_manifest(d);
  write_bytes(fs::path(d) / "manifest.json", "{\"format\": ");
  EXPECT_NE(verify_manifest(d).find("not valid JSON"), std::string::npos) << verify_manifest(d);
  fs::remove_all(d);
}

TEST(Manifest, AFullDiskIsAnErrorNamingThePath) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const std::string d = fresh_dir("full");
  // The writers go through PATH.tmp: pointing it at /dev/full makes every write fail with ENOSPC.
  const std::string p = d + "/train_state.json";
  fs::create_symlink("/dev/full", p + ".tmp");
  std::string e = testutil::error_of([&] { write_file_atomic(p, std::string(100000, 'x')); });
  EXPECT_NE(e.find(p + ".tmp"), std::string::npos) << e;
  EXPECT_NE(e.find("No space left on device"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(p));
  const std::string s = d + "/rank-0.safetensors";
  fs::create_symlink("/dev/full", s + ".tmp");
  e = testutil::error_of([&] { write_safetensors(s, {{"master", Tensor::zeros({100000})}}); });
  EXPECT_NE(e.find(s + ".tmp"), std::string::npos) << e;
  EXPECT_NE(e.find("No space left on device"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(s));
  fs::remove_all(d);
}

// Two "ranks" save pieces of a 100-element flat layout (one piece held by both, as HSDP replicas do);
// three ranks of another layout and one process read theirs back.
TEST(TrainCheckpoint, ShardsReshardToAnyLayout) {
  const std::string d = fresh_dir("reshard");
  const int64_t total = 100;
  auto value = [](int k, int64_t i) { return float(k * 1000 + i); };  // k: master, exp_avg, exp_avg_sq
  struct Saved {
    std::vector<FlatRange> pieces;
    int64_t numel;
  };
  const Saved saved[2] = {{{{0, 30, 5}, {60, 80, 35}}, 60}, {{{30, 60, 0}, {60, 70, 30}, {80, 100, 40}}, 60}};
  for (int r = 0; r < 2; ++r) {
    Tensor t[3];
    for (int k = 0; k < 3; ++k) {
      t[k] = Tensor::zeros({saved[r].numel});
      for (const FlatRange& p : saved[r].pieces)
        for (int64_t i = p.begin; i < p.end; ++i) t[k].data<float>()[p.dst_offset + i - p.begin] = value(k, i);
    }
    save_train_state_shard(d, r, t[0], t[1], t[2], saved[r].pieces);
  }
  write_file_atomic(d + "/train_state.json", "{\"step\": 3, \"flat_numel\": 100, \"layout\": {\"world_size\": 2}}");
  const std::vector<std::vector<FlatRange>> layouts = {
      {{0, 34, 0}}, {{34, 67, 2}}, {{67, 100, 1}, {10, 11, 40}}, {{0, 100, 0}}};
  for (const auto& pieces : layouts) {
    Tensor t[3];
    for (int k = 0; k < 3; ++k) t[k] = Tensor::zeros({110});
    ReshardReport rep = load_train_state_shards(d, total, pieces, t[0], t[1], t[2]);
    EXPECT_EQ(rep.shards, 2);
    int64_t n = 0;
    for (const FlatRange& p : pieces) {
      n += p.end - p.begin;
      for (int k = 0; k < 3; ++k)
        for (int64_t i = p.begin; i < p.end; ++i)
          ASSERT_EQ(t[k].data<float>()[p.dst_offset + i - p.begin], value(k, i)) << "tensor " << k << " element " << i;
    }
    EXPECT_EQ(rep.elements, n);
  }
  Tensor a = Tensor::zeros({200}), b = Tensor::zeros({200}), c = Tensor::zeros({200});
  std::string e = testutil::error_of([&] { load_train_state_shards(d, 120, {{0, 120, 0}}, a, b, c); });
  EXPECT_NE(e.find("holds a training state of 100 parameters, this model has 120"), std::string::npos) << e;
  fs::remove(d + "/train_state/rank-1.safetensors");
  e = testutil::error_of([&] { load_train_state_shards(d, total, {{0, 100, 0}}, a, b, c); });
  EXPECT_NE(e.find("no saved shard holds flat elements from 30"), std::string::npos) << e;
  fs::remove_all(d);
}

TEST(TrainCheckpoint, ConfigKeysForResume) {
  TrainConfig c = train_config_from_args(
      {"--run-dir", "runs/x", "--resume", "--max-steps", "5", "--steps", "10", "--warmup-steps", "2"});
  EXPECT_EQ(c.out_dir, "runs/x");
  EXPECT_EQ(c.resume, "latest");
  EXPECT_EQ(c.max_steps, 5);
  EXPECT_EQ(train_config_from_args({"--resume"}).resume, "latest");
  EXPECT_EQ(train_config_from_args({"--resume", "runs/x/checkpoint-4"}).resume, "runs/x/checkpoint-4");
  std::string e = testutil::error_of([] {
    train_config_from_args({"--steps", "10", "--max-steps", "11", "--warmup-steps", "2"});
  });
  EXPECT_NE(e.find("max_steps = 11 is not allowed: must be <= steps = 10"), std::string::npos) << e;
  TrainConfig saved;
  TrainConfig now = saved;
  now.lr = 1e-3;
  now.dp_shard = 4;  // a layout change is not a change of the run
  EXPECT_EQ(train_config_changes(nlohmann::json::parse(to_json(saved)), now), "lr 0.0007 -> 0.001");
}

// 10 steps straight = 5 steps, save, a new process, --resume to 10: the same losses (bit for bit in
// the JSON) and the same weight and training-state files, byte for byte.
TEST(Resume, FiveThenFiveEqualsTenByteForByte) {
  const std::string& ref = reference_run();
  const std::string d = fresh_dir("exact");
  ShellRun r = sh(train_cmd(d, "--max-steps 5"));
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_TRUE(fs::is_directory(d + "/checkpoint-5"));
  EXPECT_FALSE(fs::exists(d + "/checkpoint-5.tmp"));
  EXPECT_EQ(verify_manifest(d + "/checkpoint-5"), "");
  const nlohmann::json st = read_train_state(d + "/checkpoint-5");
  EXPECT_EQ(st["step"], 5);
  EXPECT_EQ(st["data_position"], 10);  // 5 steps x 2 micro-batches
  EXPECT_EQ(st["optimizer_steps"], 5);
  r = sh(train_cmd(d, "--resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step 5 from " + d + "/checkpoint-5"), std::string::npos) << r.out;
  const std::vector<double> want = losses(ref), got = losses(d);
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(got.size(), 10u);  // steps 1-5 kept in metrics.jsonl, 6-10 appended
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
  for (const char* f : {"model.safetensors", "train_state/rank-0.safetensors"})
    EXPECT_EQ(read_bytes(ref + "/checkpoint-10/" + f), read_bytes(d + "/checkpoint-10/" + f)) << f;
  // Resuming a finished run is an error that says what to do.
  r = sh(train_cmd(d, "--resume"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("is at step 10, which is not before the end of this run (steps 10)"), std::string::npos)
      << r.out;
  fs::remove_all(d);
}

// A corrupt newest checkpoint is reported and the one before it is used; keep_last prunes only after
// a new checkpoint is complete.
TEST(Resume, CorruptNewestCheckpointFallsBackToThePreviousOne) {
  const std::string& ref = reference_run();
  const std::string d = fresh_dir("corrupt");
  ShellRun r = sh(train_cmd(d, "--max-steps 6 --save-every 2 --keep-last 2"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(list_checkpoints(d), (std::vector<int64_t>{6, 4}));  // checkpoint-2 pruned
  flip_byte(d + "/checkpoint-6/train_state/rank-0.safetensors", 5000);
  ResumePoint rp = find_resume_checkpoint(d, "latest");
  EXPECT_EQ(rp.step, 4);
  ASSERT_EQ(rp.rejected.size(), 1u);
  EXPECT_NE(rp.rejected[0].find("checkpoint-6: train_state/rank-0.safetensors has CRC32C"), std::string::npos)
      << rp.rejected[0];
  r = sh(train_cmd(d, "--resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: not using checkpoint-6: train_state/rank-0.safetensors has CRC32C"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("resume: step 4 from"), std::string::npos) << r.out;
  EXPECT_EQ(losses(d), losses(ref));  // steps 5 and 6 of the first run were dropped from metrics.jsonl
  EXPECT_EQ(read_bytes(ref + "/checkpoint-10/model.safetensors"), read_bytes(d + "/checkpoint-10/model.safetensors"));
  // An explicit checkpoint that does not verify is an error naming it and the file.
  fs::resize_file(d + "/checkpoint-10/model.safetensors", 1000);
  r = sh(train_cmd(d, "--resume " + d + "/checkpoint-10"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("cannot resume from '" + d + "/checkpoint-10': model.safetensors has 1000 bytes"),
            std::string::npos)
      << r.out;
  fs::remove_all(d);
}

// kill -9 in the middle of writing checkpoint 4: checkpoint 2 is intact and the run continues from it.
TEST(Resume, RunKilledWhileSavingLeavesTheLastGoodCheckpoint) {
  const std::string& ref = reference_run();
  const std::string d = fresh_dir("killed");
  ShellRun r = sh("MOETRAIN_DEBUG_SAVE_KILL=4 " + train_cmd(d, "--save-every 2"));
  EXPECT_EQ(r.code, 128 + 9) << r.out;
  EXPECT_TRUE(fs::is_regular_file(d + "/checkpoint-4.tmp/model.safetensors"));  // half written
  EXPECT_FALSE(fs::exists(d + "/checkpoint-4"));
  EXPECT_EQ(verify_manifest(d + "/checkpoint-2"), "");
  r = sh(train_cmd(d, "--resume"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume: step 2 from"), std::string::npos) << r.out;
  EXPECT_EQ(losses(d), losses(ref));
  EXPECT_FALSE(fs::exists(d + "/checkpoint-4.tmp"));  // the new checkpoint-4 replaced it
  EXPECT_EQ(read_bytes(ref + "/checkpoint-10/model.safetensors"), read_bytes(d + "/checkpoint-10/model.safetensors"));
  fs::remove_all(d);
}

TEST(Resume, AnUnwritableRunDirIsAnErrorNamingThePath) {
  const std::string d = fresh_dir("unwritable");
  write_bytes(fs::path(d) / "file", "x");  // a run dir below a regular file cannot be created (even by root)
  const std::string run = d + "/file/run";
  ShellRun r = sh(train_cmd(run));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find(run), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  fs::remove_all(d);
}

// Saved under one layout, resumed under another: the same losses (within the layouts' 1e-6).
TEST(Resume, ReshardsBetweenLayouts) {
  MT_SKIP_WITHOUT_GLOO();
  const std::vector<double> want = losses(reference_run());
  struct Case {
    std::string save, resume;
  };
  const std::string launch2 = kMoetrainBin + " launch --nproc-per-node 2 -- ";
  auto cmd = [&](const std::string& layout, const std::string& dir, const std::string& extra) {
    std::string c = train_cmd(dir, layout + " " + extra);
    return layout.empty() ? c : launch2 + c.substr(kMoetrainBin.size() + 1);
  };
  for (const Case& k : {Case{"--dp-shard 2", ""}, Case{"", "--ep 2"}}) {
    const std::string d = fresh_dir("layout");
    ShellRun r = sh(cmd(k.save, d, "--max-steps 5"));
    ASSERT_EQ(r.code, 0) << r.out;
    r = sh(cmd(k.resume, d, "--resume"));
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<double> got = losses(d);
    ASSERT_EQ(got.size(), want.size()) << k.save << " -> " << k.resume;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::abs(want[i])) << k.save << " -> " << k.resume << ", step " << i + 1;
    fs::remove_all(d);
  }
}

// The example: saved under dp_shard 4 x ep 2 (4 ranks; the experts' ep groups fold over the
// data-parallel ranks), resumed in one process and under dp_shard 2.
TEST(Resume, FromDpShard4Ep2ToOneProcessAndToDpShard2) {
  MT_SKIP_WITHOUT_GLOO();
  const std::string batch = "--micro-batch-size 4 --grad-accum 1";  // 4 data-parallel ranks: 4 rows
  const std::string ref = fresh_dir("ref4");
  ShellRun r = sh(train_cmd(ref, batch));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<double> want = losses(ref);
  const std::string saved = fresh_dir("saved4");
  const std::string launch = kMoetrainBin + " launch --nproc-per-node ";
  auto under_launch = [&](int n, const std::string& dir, const std::string& extra) {
    return launch + std::to_string(n) + " -- " + train_cmd(dir, batch + " " + extra).substr(kMoetrainBin.size() + 1);
  };
  r = sh(under_launch(4, saved, "--ep 2 --max-steps 5"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_train_state(saved + "/checkpoint-5")["layout"]["dp_shard"], 4);
  for (int ranks : {1, 2}) {
    const std::string d = fresh_dir("resume4_" + std::to_string(ranks));
    fs::copy(saved + "/checkpoint-5", d + "/checkpoint-5", fs::copy_options::recursive);
    fs::copy(saved + "/metrics.jsonl", d + "/metrics.jsonl");
    r = sh(ranks == 1 ? train_cmd(d, batch + " --resume") : under_launch(2, d, "--dp-shard 2 --resume"));
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<double> got = losses(d);
    ASSERT_EQ(got.size(), want.size()) << ranks;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::abs(want[i])) << ranks << " rank(s), step " << i + 1;
    fs::remove_all(d);
  }
  fs::remove_all(saved);
  fs::remove_all(ref);
}
