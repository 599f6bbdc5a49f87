// Pre-tokenized binary token shards for real data, and a dataset of fixed-length windows over them.
//
// Shard format (all little-endian):
//   bytes 0..7   magic "MTTOK\0\0\1"
//   bytes 8..11  uint32 dtype code: 1 = uint16 tokens, 2 = uint32 tokens
//   bytes 12..15 uint32 reserved (0)
//   bytes 16..   the tokens
// Documents are expected to be concatenated with the tokenizer's separator (e.g. <eos>) already in
// the stream; the dataset does not add any.
//
// The dataset cuts every file into non-overlapping windows of S tokens (windows never cross files;
// the tail of a file shorter than S is unused). A micro-batch is B windows: input_ids = the window,
// labels = the same window (Hugging Face semantics: the model shifts, so each window scores S - 1
// next-token predictions). The order of windows is a seeded shuffle, a new one each epoch.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/batch.h"

namespace mt {

inline constexpr char kTokenShardMagic[8] = {'M', 'T', 'T', 'O', 'K', '\0', '\0', '\1'};
inline constexpr int64_t kTokenShardHeaderBytes = 16;

// Writes a shard. use_u16 stores 2-byte tokens and requires every token < 65536 (else an error
// naming the first token that does not fit and its offset).
void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool use_u16);
// Reads a whole shard into memory (tests and tools; training uses TokenShard's mapping).
std::vector<uint32_t> read_token_shard(const std::string& path);
// Tokenizes a text file with the CharTokenizer and writes it as a u16 shard.
void tokenize_text_file_to_shard(const std::string& text_path, const std::string& shard_path);

// One shard, memory-mapped read-only. Opening checks the magic, the dtype code and that the size is
// a whole number of tokens; each failure names the file and the sizes.
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  const std::string& path() const { return path_; }
  int64_t size() const { return n_tokens_; }  // tokens
  bool is_u16() const { return u16_; }
  uint32_t at(int64_t i) const;
  void copy_to(int64_t start, int64_t n, int64_t* out) const;  // tokens [start, start+n) as i64
  // Every token must be < vocab_size; else an error naming the file, the token offset, the value and
  // the vocabulary size.
  void check_vocab(int64_t vocab_size) const;

 private:
  std::string path_;
  std::shared_ptr<const unsigned char> map_;  // the whole file; unmapped when the last user goes
  const unsigned char* tokens_ = nullptr;
  int64_t n_tokens_ = 0;
  bool u16_ = true;
};

// The shard files a data path names: the file itself, or the *.bin files of a directory sorted by
// name. A missing path or a directory without *.bin files is an error.
std::vector<std::string> list_token_shards(const std::string& path);

class TokenShardDataset : public BatchSource {
 public:
  // Opens and vocab-checks every file. No windows at all (every file shorter than seq_len) is an
  // error naming the files, their token counts and seq_len.
  TokenShardDataset(const std::vector<std::string>& files, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
                    uint64_t seed = 1234);
  // `path` is a shard file or a directory of *.bin shards.
  static TokenShardDataset open(const std::string& path, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
                                uint64_t seed = 1234);

  // Micro-batch i holds the windows at positions i*B .. i*B + B - 1 of the shuffled stream; position p
  // is window perm_e[p % W] of epoch e = p / W. A pure function of (seed, i), like SyntheticBatcher.
  Batch batch(int64_t index) const override;
  int64_t batch_size() const override { return B_; }
  int64_t seq_len() const override { return S_; }
  std::string describe() const override;

  int64_t num_windows() const { return windows_total_; }
  int64_t num_tokens() const;
  int64_t batches_per_epoch() const { return windows_total_ / B_; }  // whole batches
  const std::vector<TokenShard>& shards() const { return shards_; }
  // Where the window at stream position p starts: (shard index, token offset).
  std::pair<int64_t, int64_t> window_at(int64_t position) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;

  std::vector<TokenShard> shards_;
  std::vector<int64_t> first_window_;  // shard f owns global windows [first_window_[f], first_window_[f+1])
  int64_t B_, S_, windows_total_ = 0;
  uint64_t seed_;
  mutable std::mutex mu_;  // guards the cached permutation
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

}  // namespace mt
