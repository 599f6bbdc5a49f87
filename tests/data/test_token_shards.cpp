// Token shards: write/read round trips, window contents and shuffling, and every error a user can hit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "data/char_tokenizer.h"
#include "data/token_shards.h"
#include "test_util.h"

using namespace mt;
using mt::testutil::error_of;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
class DataTokenShards : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mt_data_shards_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::vector<uint32_t> iota_tokens(uint32_t n, uint32_t start = 0) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

std::vector<int64_t> row(const Tensor& t, int64_t r) {
  int64_t S = t.size(1);
  const int64_t* p = t.data<int64_t>() + r * S;
  return std::vector<int64_t>(p, p + S);
}

}  // namespace

TEST_F(DataTokenShards, RoundTripU16AndU32) {
  std::vector<uint32_t> small = {0, 1, 65535, 42, 7};
  write_token_shard(path("a.bin"), small, true);
  EXPECT_EQ(fs::file_size(path("a.bin")), 16u + 2 * small.size());
  EXPECT_EQ(read_token_shard(path("a.bin")), small);
  EXPECT_TRUE(TokenShard(path("a.bin")).is_u16());

  std::vector<uint32_t> big = {0, 65536, 151935, 4294967295u};
  write_token_shard(path("b.bin"), big, false);
  EXPECT_EQ(fs::file_size(path("b.bin")), 16u + 4 * big.size());
  EXPECT_EQ(read_token_shard(path("b.bin")), big);
  EXPECT_FALSE(TokenShard(path("b.bin")).is_u16());

  // The header bytes are exactly the documented format.
  std::ifstream f(path("a.bin"), std::ios::binary);
  unsigned char h[16];
  f.read(reinterpret_cast<char*>(h), 16);
  const unsigned char want[16] = {'M', 'T', 'T', 'O', 'K', 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(h[i], want[i]) << "header byte " << i;

  write_token_shard(path("empty.bin"), {}, true);
  EXPECT_EQ(TokenShard(path("empty.bin")).size(), 0);

  std::string msg = error_of([&] { write_token_shard(path("c.bin"), {1, 2, 70000}, true); });
  EXPECT_NE(msg.find("70000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 2"), std::string::npos) << msg;
}

TEST_F(DataTokenShards, WindowsHoldContiguousTokens) {
  // Two files: 100 and 45 tokens with S = 10 -> 10 + 4 windows; tails never used, no window crosses files.
  write_token_shard(path("00.bin"), iota_tokens(100, 0), true);
  write_token_shard(path("01.bin"), iota_tokens(45, 1000), false);
  write_token_shard(path("ignored.txt"), iota_tokens(50), true);  // not *.bin: not part of the dataset
  TokenShardDataset ds = TokenShardDataset::open(dir_.string(), 2, 10, 2000, 7);
  EXPECT_EQ(ds.shards().size(), 2u);
  EXPECT_EQ(ds.num_windows(), 14);
  EXPECT_EQ(ds.num_tokens(), 145);
  EXPECT_EQ(ds.batches_per_epoch(), 7);

  // One epoch visits every window exactly once.
  std::set<int64_t> starts;
  for (int64_t i = 0; i < ds.batches_per_epoch(); ++i) {
    Batch b = ds.batch(i);
    EXPECT_EQ(b.input_ids.shape(), (Shape{2, 10}));
    EXPECT_EQ(b.labels.shape(), (Shape{2, 10}));
    for (int64_t r = 0; r < 2; ++r) {
      std::vector<int64_t> ids = row(b.input_ids, r);
      EXPECT_EQ(row(b.labels, r), ids) << "labels are the window itself (the model shifts)";
      for (int64_t k = 1; k < 10; ++k) EXPECT_EQ(ids[size_t(k)], ids[0] + k) << "contiguous";
      int64_t start = ids[0];
      if (start < 1000) {
        EXPECT_EQ(start % 10, 0);
        EXPECT_LE(start, 90);
      } else {
        EXPECT_EQ((start - 1000) % 10, 0);
        EXPECT_LE(start, 1030);
      }
      starts.insert(start);
      auto [f, off] = ds.window_at(i * 2 + r);
      EXPECT_EQ(start, (f == 0 ? 0 : 1000) + off);
    }
  }
  EXPECT_EQ(starts.size(), 14u);

  // The order is shuffled, deterministic for a seed, and differs between epochs and seeds.
  std::vector<int64_t> epoch0, epoch1, same_seed, other_seed;
  TokenShardDataset again = TokenShardDataset::open(dir_.string(), 2, 10, 2000, 7);
  TokenShardDataset other = TokenShardDataset::open(dir_.string(), 2, 10, 2000, 8);
  for (int64_t p = 0; p < 14; ++p) {
    epoch0.push_back(ds.window_at(p).first * 1000 + ds.window_at(p).second);
    epoch1.push_back(ds.window_at(p + 14).first * 1000 + ds.window_at(p + 14).second);
    same_seed.push_back(again.window_at(p).first * 1000 + again.window_at(p).second);
    other_seed.push_back(other.window_at(p).first * 1000 + other.window_at(p).second);
  }
  EXPECT_EQ(epoch0, same_seed);
  EXPECT_NE(epoch0, epoch1);
  EXPECT_NE(epoch0, other_seed);
  std::vector<int64_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(epoch0, sorted);
  // next() walks batch indices.
  EXPECT_EQ(row(ds.next().input_ids, 1), row(again.batch(0).input_ids, 1));
  EXPECT_EQ(row(ds.next().input_ids, 0), row(again.batch(1).input_ids, 0));
}

TEST_F(DataTokenShards, TruncatedAndBadMagic) {
  write_token_shard(path("ok.bin"), iota_tokens(8), true);
  // Cut one byte: 16 + 15 bytes is not a whole number of 2-byte tokens.
  fs::copy_file(path("ok.bin"), path("cut.bin"));
  fs::resize_file(path("cut.bin"), 31);
  std::string msg = error_of([&] { TokenShard s(path("cut.bin")); });
  EXPECT_NE(msg.find("cut.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("31 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("15 bytes"), std::string::npos) << msg;

  fs::resize_file(path("cut.bin"), 9);
  msg = error_of([&] { TokenShard s(path("cut.bin")); });
  EXPECT_NE(msg.find("9 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("16-byte header"), std::string::npos) << msg;

  {
    std::ofstream f(path("magic.bin"), std::ios::binary);
    f << "NOTATOKENSHARD!!xxxx";
  }
  msg = error_of([&] { TokenShard s(path("magic.bin")); });
  EXPECT_NE(msg.find("magic.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad magic"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4e 4f 54"), std::string::npos) << msg;  // "NOT"

  // A valid magic with an unknown dtype code.
  fs::copy_file(path("ok.bin"), path("dtype.bin"));
  {
    std::fstream f(path("dtype.bin"), std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(8);
    f.put(char(3));
  }
  msg = error_of([&] { TokenShard s(path("dtype.bin")); });
  EXPECT_NE(msg.find("dtype code 3"), std::string::npos) << msg;

  msg = error_of([&] { TokenShard s(path("missing.bin")); });
  EXPECT_NE(msg.find("missing.bin"), std::string::npos) << msg;
}

TEST_F(DataTokenShards, VocabCheckNamesFileOffsetValue) {
  std::vector<uint32_t> t = iota_tokens(64);
  t[37] = 500;
  write_token_shard(path("v.bin"), t, false);
  std::string msg = error_of([&] { TokenShardDataset ds({path("v.bin")}, 1, 8, 100); });
  EXPECT_NE(msg.find("v.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 500"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 37"), std::string::npos) << msg;
  EXPECT_NE(msg.find("vocab_size = 100"), std::string::npos) << msg;
  EXPECT_NO_THROW(TokenShardDataset({path("v.bin")}, 1, 8, 501));
}

TEST_F(DataTokenShards, EmptyDatasetErrors) {
  write_token_shard(path("short.bin"), iota_tokens(5), true);
  std::string msg = error_of([&] { TokenShardDataset ds({path("short.bin")}, 1, 8, 100); });
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;
  EXPECT_NE(msg.find("short.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("seq_len = 8"), std::string::npos) << msg;

  fs::create_directories(dir_ / "none");
  msg = error_of([&] { TokenShardDataset::open(path("none"), 1, 8, 100); });
  EXPECT_NE(msg.find("no *.bin"), std::string::npos) << msg;
  msg = error_of([&] { TokenShardDataset::open(path("nowhere"), 1, 8, 100); });
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  EXPECT_THROW(TokenShardDataset(std::vector<std::string>{}, 1, 8, 100), Error);
}

TEST_F(DataTokenShards, TokenizeTextFile) {
  {
    std::ofstream f(path("t.txt"), std::ios::binary);
    f << "1+2=3\n40+2=24\n";
  }
  tokenize_text_file_to_shard(path("t.txt"), path("t.bin"));
  std::vector<uint32_t> got = read_token_shard(path("t.bin"));
  CharTokenizer tok;
  EXPECT_EQ(tok.decode(std::vector<int64_t>(got.begin(), got.end())), "1+2=3\n40+2=24\n");
  auto src = make_batch_source(path("t.bin"), 1, 4, tok.vocab_size(), 3, 1);
  EXPECT_EQ(src->seq_len(), 4);
  EXPECT_EQ(src->batch(0).input_ids.shape(), (Shape{1, 4}));

  {
    std::ofstream f(path("bad.txt"), std::ios::binary);
    f << "12\nab";
  }
  std::string msg = error_of([&] { tokenize_text_file_to_shard(path("bad.txt"), path("bad.bin")); });
  EXPECT_NE(msg.find("bad.txt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
}
