// Token shards: writer, memory-mapped reader and the windowed dataset (see token_shards.h).
#include "data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "data/char_tokenizer.h"

namespace mt {

static_assert(std::endian::native == std::endian::little, "token shards are read in place as little-endian");

namespace {

constexpr uint32_t kDtypeU16 = 1, kDtypeU32 = 2;
constexpr uint64_t kShuffleSalt = 0x73687566666c6521ull;

std::string bytes_str(const unsigned char* p, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ' ';
    out += hex[p[i] >> 4];
    out += hex[p[i] & 15];
  }
  return out;
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool use_u16) {
  if (use_u16) {
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] > 0xffff)
        MT_THROW("token shard '", path, "': token ", tokens[i], " at offset ", i,
                 " does not fit in uint16 (max 65535); write the shard with uint32 tokens");
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) MT_THROW("token shard '", path, "': cannot open for writing: ", std::strerror(errno));
  unsigned char header[kTokenShardHeaderBytes] = {};
  std::memcpy(header, kTokenShardMagic, 8);
  uint32_t code = use_u16 ? kDtypeU16 : kDtypeU32;
  std::memcpy(header + 8, &code, 4);
  f.write(reinterpret_cast<const char*>(header), sizeof header);
  if (use_u16) {
    std::vector<uint16_t> small(tokens.begin(), tokens.end());
    f.write(reinterpret_cast<const char*>(small.data()), std::streamsize(small.size() * 2));
  } else {
    f.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
  }
  f.close();
  if (!f) MT_THROW("token shard '", path, "': write failed: ", std::strerror(errno));
}

std::vector<uint32_t> read_token_shard(const std::string& path) {
  TokenShard shard(path);
  std::vector<uint32_t> out(size_t(shard.size()));
  for (int64_t i = 0; i < shard.size(); ++i) out[size_t(i)] = shard.at(i);
  return out;
}

void tokenize_text_file_to_shard(const std::string& text_path, const std::string& shard_path) {
  std::ifstream f(text_path, std::ios::binary);
  if (!f) MT_THROW("cannot open text file '", text_path, "': ", std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  std::vector<int64_t> ids;
  try {
    ids = CharTokenizer().encode(ss.str());
  } catch (const Error& e) {
    MT_THROW("text file '", text_path, "': ", e.what());
  }
  write_token_shard(shard_path, std::vector<uint32_t>(ids.begin(), ids.end()), true);
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) MT_THROW("token shard '", path, "': cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    MT_THROW("token shard '", path, "': cannot stat: ", std::strerror(err));
  }
  int64_t file_bytes = int64_t(st.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    ::close(fd);
    MT_THROW("token shard '", path, "' is truncated: ", file_bytes, " bytes, shorter than the ", kTokenShardHeaderBytes,
             "-byte header");
  }
  void* p = ::mmap(nullptr, size_t(file_bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping stays valid after close
  if (p == MAP_FAILED)
    MT_THROW("token shard '", path, "': mmap of ", file_bytes, " bytes failed: ", std::strerror(err));
  size_t len = size_t(file_bytes);
  map_ = std::shared_ptr<const unsigned char>(static_cast<const unsigned char*>(p), [len](const unsigned char* q) {
    ::munmap(const_cast<unsigned char*>(q), len);
  });
  const unsigned char* base = map_.get();
  if (std::memcmp(base, kTokenShardMagic, 8) != 0)
    MT_THROW("token shard '", path, "' has a bad magic: bytes 0..7 are [", bytes_str(base, 8), "], expected [",
             bytes_str(reinterpret_cast<const unsigned char*>(kTokenShardMagic), 8), "] (\"MTTOK\\0\\0\\1\")");
  uint32_t code;
  std::memcpy(&code, base + 8, 4);
  if (code != kDtypeU16 && code != kDtypeU32)
    MT_THROW("token shard '", path, "' has dtype code ", code, "; allowed: 1 (uint16 tokens), 2 (uint32 tokens)");
  u16_ = code == kDtypeU16;
  int64_t elem = u16_ ? 2 : 4, payload = file_bytes - kTokenShardHeaderBytes;
  if (payload % elem != 0)
    MT_THROW("token shard '", path, "' is truncated: ", file_bytes, " bytes = ", kTokenShardHeaderBytes,
             "-byte header + ", payload, " bytes, not a whole number of ", elem, "-byte tokens");
  tokens_ = base + kTokenShardHeaderBytes;
  n_tokens_ = payload / elem;
}

uint32_t TokenShard::at(int64_t i) const {
  MT_CHECK(i >= 0 && i < n_tokens_, "token offset ", i, " out of range for '", path_, "' (", n_tokens_, " tokens)");
  if (u16_) {
    uint16_t v;
    std::memcpy(&v, tokens_ + 2 * i, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, tokens_ + 4 * i, 4);
  return v;
}

void TokenShard::copy_to(int64_t start, int64_t n, int64_t* out) const {
  MT_CHECK(start >= 0 && n >= 0 && start + n <= n_tokens_, "tokens [", start, ", ", start + n, ") out of range for '",
           path_, "' (", n_tokens_, " tokens)");
  for (int64_t i = 0; i < n; ++i) {
    if (u16_) {
      uint16_t v;
      std::memcpy(&v, tokens_ + 2 * (start + i), 2);
      out[i] = v;
    } else {
      uint32_t v;
      std::memcpy(&v, tokens_ + 4 * (start + i), 4);
      out[i] = v;
    }
  }
}

void TokenShard::check_vocab(int64_t vocab_size) const {
  MT_CHECK(vocab_size > 0, "vocab_size must be > 0, got ", vocab_size);
  for (int64_t i = 0; i < n_tokens_; ++i) {
    uint32_t v;
    if (u16_) {
      uint16_t s;
      std::memcpy(&s, tokens_ + 2 * i, 2);
      v = s;
    } else {
      std::memcpy(&v, tokens_ + 4 * i, 4);
    }
    if (int64_t(v) >= vocab_size)
      MT_THROW("token shard '", path_, "': token ", v, " at offset ", i, " (byte ",
               kTokenShardHeaderBytes + i * (u16_ ? 2 : 4),
               ") is outside the model's vocabulary: vocab_size = ", vocab_size);
  }
}

std::vector<std::string> list_token_shards(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) MT_THROW("token shards: path '", path, "' does not exist");
  if (!fs::is_directory(path, ec)) return {path};
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path, ec))
    if (entry.path().extension() == ".bin" && !fs::is_directory(entry.path())) files.push_back(entry.path().string());
  if (ec) MT_THROW("token shards: cannot list directory '", path, "': ", ec.message());
  if (files.empty()) MT_THROW("token shards: directory '", path, "' has no *.bin files");
  std::sort(files.begin(), files.end());
  return files;
}

TokenShardDataset::TokenShardDataset(const std::vector<std::string>& files, int64_t batch_size, int64_t seq_len,
                                     int64_t vocab_size, uint64_t seed)
    : B_(batch_size), S_(seq_len), seed_(seed) {
  if (files.empty()) MT_THROW("token shards: the dataset has no files");
  if (batch_size < 1) MT_THROW("token shards: micro_batch_size = ", batch_size, " must be >= 1");
  if (seq_len < 2) MT_THROW("token shards: seq_len = ", seq_len, " must be >= 2");
  if (vocab_size < 1) MT_THROW("token shards: vocab_size = ", vocab_size, " must be >= 1");
  first_window_.push_back(0);
  for (const auto& f : files) {
    shards_.emplace_back(f);
    shards_.back().check_vocab(vocab_size);
    windows_total_ += shards_.back().size() / S_;
    first_window_.push_back(windows_total_);
  }
  if (windows_total_ == 0) {
    std::string sizes;
    for (const auto& s : shards_) sizes += str(sizes.empty() ? "" : ", ", "'", s.path(), "' ", s.size(), " tokens");
    MT_THROW("token shards: the dataset is empty: no file holds a whole window of seq_len = ", S_, " tokens (", sizes,
             ")");
  }
}

TokenShardDataset TokenShardDataset::open(const std::string& path, int64_t batch_size, int64_t seq_len,
                                          int64_t vocab_size, uint64_t seed) {
  return TokenShardDataset(list_token_shards(path), batch_size, seq_len, vocab_size, seed);
}

int64_t TokenShardDataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& s : shards_) n += s.size();
  return n;
}

std::string TokenShardDataset::describe() const {
  return str("token shards: ", shards_.size(), " file(s), ", num_tokens(), " tokens, ", windows_total_, " windows of ",
             S_, " tokens, ", B_, " windows per micro-batch, seed ", seed_);
}

const std::vector<int64_t>& TokenShardDataset::permutation(int64_t epoch) const {
  if (perm_epoch_ != epoch) {
    perm_.resize(size_t(windows_total_));
    for (int64_t i = 0; i < windows_total_; ++i) perm_[size_t(i)] = i;
    Rng rng(mix64(mix64(seed_ ^ kShuffleSalt) + uint64_t(epoch)));
    for (int64_t i = windows_total_ - 1; i > 0; --i) std::swap(perm_[size_t(i)], perm_[size_t(rng.randint(0, i + 1))]);
    perm_epoch_ = epoch;
  }
  return perm_;
}

std::pair<int64_t, int64_t> TokenShardDataset::window_at(int64_t position) const {
  MT_CHECK(position >= 0, "window position must be >= 0, got ", position);
  int64_t w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = permutation(position / windows_total_)[size_t(position % windows_total_)];
  }
  int64_t f = int64_t(std::upper_bound(first_window_.begin(), first_window_.end(), w) - first_window_.begin()) - 1;
  return {f, (w - first_window_[size_t(f)]) * S_};
}

Batch TokenShardDataset::batch(int64_t index) const {
  MT_CHECK(index >= 0, "batch index must be >= 0, got ", index);
  Batch out{Tensor::empty({B_, S_}, DType::I64), Tensor::empty({B_, S_}, DType::I64), Tensor()};
  int64_t* ids = out.input_ids.data<int64_t>();
  for (int64_t r = 0; r < B_; ++r) {
    auto [f, off] = window_at(index * B_ + r);
    shards_[size_t(f)].copy_to(off, S_, ids + r * S_);
  }
  std::memcpy(out.labels.data<int64_t>(), ids, out.input_ids.nbytes());
  return out;
}

}  // namespace mt
