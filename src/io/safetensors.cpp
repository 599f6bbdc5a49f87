// safetensors reading (mmap, validated at open) and writing (atomic: tmp file, fsync, rename),
// and checkpoint directories with or without a shard index. See safetensors.h for the format.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/posix_file.h"

namespace mt {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The Rust reference implementation refuses headers above 100 MB; a real header is kilobytes to
// a few megabytes (about 100 bytes per tensor).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kSupportedDtypes = "F32, BF16, F16, I32, I64";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F16", DType::F16}, {"I32", DType::I32}, {"I64", DType::I64}};
  for (const auto& [name, t] : kNames) {
    if (s == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

// Converts n elements starting at src (any alignment) to f32.
void convert_to_f32(const char* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::F32:
      std::memcpy(dst, src, size_t(n) * 4);
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    case DType::I32:
      for (int64_t i = 0; i < n; ++i) {
        int32_t v;
        std::memcpy(&v, src + 4 * i, 4);
        dst[i] = float(v);
      }
      return;
    case DType::I64:
      for (int64_t i = 0; i < n; ++i) {
        int64_t v;
        std::memcpy(&v, src + 8 * i, 8);
        dst[i] = float(v);
      }
      return;
  }
  MT_CHECK(false, "unknown dtype ", int(dtype));
}

using io::Fd;
using io::throw_errno;

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; loop over partial writes and EINTR.
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_errno("cannot write", path);
    }
    p += w;
    n -= size_t(w);
  }
}

// Writes `path` through `path.tmp` + fsync + rename; `body` writes the content to the fd.
template <class F>
void write_atomically(const std::string& path, F&& body) {
  std::string tmp = path + ".tmp";
  try {
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.fd < 0) throw_errno("cannot create", tmp);
    body(f.fd, tmp);
    if (::fsync(f.fd) != 0) throw_errno("cannot fsync", tmp);
    int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) throw_errno("cannot close", tmp);
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno(str("cannot rename '", tmp, "' to"), path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable; failing to sync a directory is not worth failing the save.
  std::string dir = fs::path(path).parent_path().string();
  Fd d;
  d.fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd >= 0) (void)::fsync(d.fd);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MT_THROW("cannot open '", path, "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  MT_CHECK(false, "unknown dtype ", int(t));
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Mapping {
  void* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base) ::munmap(base, size);
  }
};

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("cannot open safetensors file", path);
  struct stat st;
  if (::fstat(f.fd, &st) != 0) throw_errno("cannot stat", path);
  if (!S_ISREG(st.st_mode)) MT_THROW("'", path, "' is not a regular file");
  const uint64_t file_size = uint64_t(st.st_size);
  if (file_size < 8)
    MT_THROW(path, ": file has ", file_size, " bytes, too short for a safetensors file (8-byte header length)");

  map_ = std::make_shared<Mapping>();
  void* base = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (base == MAP_FAILED) throw_errno("cannot mmap", path);
  map_->base = base;
  map_->size = file_size;
  const char* bytes = static_cast<const char*>(base);

  uint64_t header_len;
  std::memcpy(&header_len, bytes, 8);
  if (header_len > kMaxHeaderBytes)
    MT_THROW(path, ": header length ", header_len, " is not plausible (at most ", kMaxHeaderBytes,
             " bytes); not a safetensors file?");
  if (8 + header_len > file_size)
    MT_THROW(path, ": file is truncated: the header needs ", 8 + header_len, " bytes but the file has ", file_size,
             " bytes");
  data_ = bytes + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    MT_THROW(path, ": header is not valid JSON (", e.what(), "); not a safetensors file?");
  }
  if (!header.is_object()) MT_THROW(path, ": header must be a JSON object, got ", header.type_name());

  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      if (!e.is_object()) MT_THROW(path, ": __metadata__ must be an object of strings, got ", e.dump());
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string()) MT_THROW(path, ": __metadata__ value for '", k, "' must be a string, got ", v.dump());
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) { MT_THROW(path, ": tensor '", name, "': ", why, " in entry ", e.dump()); };
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      bad("expected an object with dtype, shape and data_offsets");
    SafetensorsEntry entry;
    if (!e["dtype"].is_string()) bad("dtype must be a string");
    std::string dtype = e["dtype"].get<std::string>();
    if (!parse_dtype(dtype, &entry.dtype))
      MT_THROW(path, ": tensor '", name, "' has dtype ", dtype,
               ", which is not supported (supported: ", kSupportedDtypes, ")");
    if (!e["shape"].is_array()) bad("shape must be a list of non-negative integers");
    uint64_t numel = 1;
    for (const json& d : e["shape"]) {
      if (!d.is_number_unsigned()) bad("shape must be a list of non-negative integers");
      uint64_t v = d.get<uint64_t>();
      if (v > uint64_t(INT64_MAX) || __builtin_mul_overflow(numel, v, &numel)) bad("shape is too large");
      entry.shape.push_back(int64_t(v));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("data_offsets must be two non-negative integers [begin, end]");
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    uint64_t want;
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(entry.dtype)), &want)) bad("shape is too large");
    if (end < begin || end - begin != want)
      MT_THROW(path, ": tensor '", name, "' (", dtype, " ", shape_str(entry.shape), ") needs ", want,
               " bytes but its data_offsets [", begin, ", ", end, "] span ", end < begin ? 0 : end - begin);
    if (end > data_size)
      MT_THROW(path, ": file is truncated: tensor '", name, "' ends at byte ", 8 + header_len + end, " (data_offsets [",
               begin, ", ", end, "] after the ", 8 + header_len, "-byte header) but the file has ", file_size,
               " bytes");
    entry.begin = size_t(begin);
    entry.end = size_t(end);
    entries_.emplace(name, std::move(entry));
  }
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::pair<size_t, std::string>> by_offset;
  for (const auto& [name, e] : entries_) by_offset.emplace_back(e.begin, name);
  std::sort(by_offset.begin(), by_offset.end());
  std::vector<std::string> out;
  for (auto& p : by_offset) out.push_back(std::move(p.second));
  return out;
}

const SafetensorsEntry& SafetensorsFile::info(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) MT_THROW("tensor '", name, "' not found in '", path_, "' (", entries_.size(), " tensors)");
  return it->second;
}

Tensor SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = info(name);
  const char* p = data_ + e.begin;
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) != 0) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    std::memcpy(t.raw(), p, e.end - e.begin);
    return t;
  }
  // The tensor's owner is the mapping, so the memory stays valid after this SafetensorsFile is gone.
  return Tensor(std::shared_ptr<void>(map_), const_cast<char*>(p), e.shape, e.dtype, Device::CPU);
}

Tensor SafetensorsFile::read_f32(const std::string& name) const {
  const SafetensorsEntry& e = info(name);
  Tensor t = Tensor::empty(e.shape, DType::F32);
  convert_to_f32(data_ + e.begin, e.dtype, t.numel(), t.data<float>());
  return t;
}

Tensor SafetensorsFile::read_rows_f32(const std::string& name, int64_t dim0_start, int64_t dim0_len) const {
  const SafetensorsEntry& e = info(name);
  if (e.shape.empty()) MT_THROW(path_, ": tensor '", name, "' is a scalar; read_rows_f32 needs at least one dim");
  const int64_t rows = e.shape[0];
  if (dim0_start < 0 || dim0_len < 0 || dim0_start > rows || dim0_len > rows - dim0_start)
    MT_THROW(path_, ": rows [", dim0_start, ", ", dim0_start, " + ", dim0_len, ") are out of range for tensor '", name,
             "' of shape ", shape_str(e.shape));
  Shape s = e.shape;
  s[0] = dim0_len;
  Tensor t = Tensor::empty(s, DType::F32);
  const int64_t row_elems = rows == 0 ? 0 : shape_numel(e.shape) / rows;
  const size_t row_bytes = size_t(row_elems) * dtype_size(e.dtype);
  convert_to_f32(data_ + e.begin + size_t(dim0_start) * row_bytes, e.dtype, t.numel(), t.data<float>());
  return t;
}

// ---------------------------------------------------------------------------------------------
// CheckpointReader

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  auto add_file = [&](const std::string& file) {
    files_.push_back(std::make_unique<SafetensorsFile>(file));
    return files_.size() - 1;
  };
  if (fs::is_regular_file(path)) {
    size_t i = add_file(path);
    for (const std::string& n : files_[i]->names()) where_[n] = i;
    return;
  }
  if (!fs::is_directory(path)) MT_THROW("checkpoint '", path, "' does not exist (expected a directory or a file)");
  // transformers prefers model.safetensors when both forms are present; so do we.
  fs::path single = fs::path(path) / kSingleFile, index = fs::path(path) / kIndexFile;
  if (fs::exists(single)) {
    size_t i = add_file(single.string());
    for (const std::string& n : files_[i]->names()) where_[n] = i;
    return;
  }
  if (!fs::exists(index)) MT_THROW("no checkpoint in '", path, "': expected ", kSingleFile, " or ", kIndexFile);

  json j;
  try {
    j = json::parse(read_text(index.string()));
  } catch (const json::exception& e) {
    MT_THROW(index.string(), ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    MT_THROW(index.string(), ": expected an object with a \"weight_map\" object (tensor name -> file)");
  std::map<std::string, size_t> file_index;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string())
      MT_THROW(index.string(), ": weight_map entry for '", name, "' must be a file name, got ", file.dump());
    std::string fname = file.get<std::string>();
    auto it = file_index.find(fname);
    if (it == file_index.end()) {
      fs::path fp = fs::path(path) / fname;
      if (!fs::exists(fp))
        MT_THROW(index.string(), " lists '", fname, "' (for tensor '", name, "'), which does not exist");
      it = file_index.emplace(fname, add_file(fp.string())).first;
    }
    if (!files_[it->second]->has(name))
      MT_THROW(index.string(), " says tensor '", name, "' is in '", fname, "', but that file does not contain it");
    where_[name] = it->second;
  }
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafetensorsFile& CheckpointReader::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    MT_THROW("tensor '", name, "' not found in checkpoint '", path_, "' (", where_.size(), " tensors in ",
             files_.size(), " file(s))");
  return *files_[it->second];
}

const SafetensorsEntry& CheckpointReader::info(const std::string& name) const {
  return file_of(name).info(name);
}
Tensor CheckpointReader::view(const std::string& name) const {
  return file_of(name).view(name);
}
Tensor CheckpointReader::read_f32(const std::string& name) const {
  return file_of(name).read_f32(name);
}
Tensor CheckpointReader::read_rows_f32(const std::string& name, int64_t dim0_start, int64_t dim0_len) const {
  return file_of(name).read_rows_f32(name, dim0_start, dim0_len);
}

// ---------------------------------------------------------------------------------------------
// Writing

static std::vector<PendingTensor> eager(const NamedTensors& tensors) {
  std::vector<PendingTensor> v;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) MT_THROW("cannot write tensor '", name, "': it is undefined");
    v.push_back({name, t.shape(), t.dtype(), [t] { return t; }});
  }
  return v;
}

static size_t pending_bytes(const PendingTensor& p) { return size_t(shape_numel(p.shape)) * dtype_size(p.dtype); }

static void write_safetensors_lazy(const std::string& path, const std::vector<PendingTensor>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;  // keeps __metadata__ first and the tensors in the given order
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  if (!metadata.count("format")) meta["format"] = "pt";
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;

  std::set<std::string> seen;
  size_t offset = 0;
  for (const PendingTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") MT_THROW("cannot write '", path, "': invalid tensor name '", t.name, "'");
    if (!seen.insert(t.name).second) MT_THROW("cannot write '", path, "': tensor name '", t.name, "' appears twice");
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + pending_bytes(t)}}};
    offset += pending_bytes(t);
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // as the Python library: data starts 8-byte aligned
  const uint64_t header_len = h.size();

  write_atomically(path, [&](int fd, const std::string& tmp) {
    write_all(fd, &header_len, 8, tmp);
    write_all(fd, h.data(), h.size(), tmp);
    for (const PendingTensor& p : tensors) {
      Tensor t = p.produce();
      MT_CHECK(t.shape() == p.shape && t.dtype() == p.dtype, "tensor '", p.name, "' was announced as ",
               dtype_name(p.dtype), shape_str(p.shape), " but produced as ", t.desc());
      if (t.nbytes() == 0) continue;
      Tensor host = t.is_cpu() ? t : t.to(Device::CPU);
      write_all(fd, host.raw(), host.nbytes(), tmp);
    }
  });
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  for (const auto& [name, t] : tensors)
    if (!t.defined()) MT_THROW("cannot write '", path, "': tensor '", name, "' is undefined");
  write_safetensors_lazy(path, eager(tensors), metadata);
}

void write_safetensors_sharded(const std::string& dir, const NamedTensors& tensors, size_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata) {
  write_safetensors_sharded_lazy(dir, eager(tensors), max_shard_bytes, metadata);
}

void write_safetensors_sharded_lazy(const std::string& dir, const std::vector<PendingTensor>& tensors,
                                    size_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  if (max_shard_bytes == 0) MT_THROW("write_safetensors_sharded: max_shard_bytes must be > 0");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) MT_THROW("cannot create checkpoint directory '", dir, "': ", ec.message());

  // Pack in order; a tensor larger than the limit gets a shard of its own (as transformers does).
  std::vector<std::vector<PendingTensor>> shards(1);
  size_t total = 0, current = 0;
  for (const PendingTensor& t : tensors) {
    size_t n = pending_bytes(t);
    if (current > 0 && current + n > max_shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(t);
    current += n;
    total += n;
  }

  std::set<std::string> written;
  if (total <= max_shard_bytes) {
    write_safetensors_lazy((fs::path(dir) / kSingleFile).string(), tensors, metadata);
    written.insert(kSingleFile);
  } else {
    json weight_map = json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      char fname[64];
      std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", i + 1, n);
      write_safetensors_lazy((fs::path(dir) / fname).string(), shards[i], metadata);
      for (const PendingTensor& t : shards[i]) weight_map[t.name] = fname;
      written.insert(fname);
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::string text = index.dump(2) + "\n";
    write_atomically((fs::path(dir) / kIndexFile).string(),
                     [&](int fd, const std::string& tmp) { write_all(fd, text.data(), text.size(), tmp); });
    written.insert(kIndexFile);
  }

  // Remove what an earlier save left that would contradict this one (the other form, old shards).
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  for (const auto& de : fs::directory_iterator(dir)) {
    std::string fname = de.path().filename().string();
    bool ours = fname == kSingleFile || fname == kIndexFile || std::regex_match(fname, kShard);
    if (ours && !written.count(fname)) fs::remove(de.path(), ec);
  }
}

}  // namespace mt
