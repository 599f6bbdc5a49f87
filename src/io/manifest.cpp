// Manifests and durable file-system steps (manifest.h).
#include "io/manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/posix_file.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace mt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "moetrain-manifest-1";

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t crc32c_table(const uint8_t* p, size_t n, uint32_t c) {
  static const std::array<uint32_t, 256> kTable = make_table();
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = uint32_t(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

using io::Fd;
using io::throw_errno;

// Size and CRC32C of a file, read in large blocks; fsyncs it when asked.
ManifestEntry hash_file(const fs::path& file, const std::string& rel, bool sync) {
  Fd f;
  f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("cannot open", file.string());
  std::vector<char> buf(size_t(8) << 20);
  ManifestEntry e;
  e.path = rel;
  for (;;) {
    ssize_t r = ::read(f.fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("cannot read", file.string());
    }
    if (r == 0) break;
    e.crc32c = crc32c_hw(buf.data(), size_t(r), e.crc32c);
    e.size += uint64_t(r);
  }
  if (sync && ::fsync(f.fd) != 0) throw_errno("cannot fsync", file.string());
  return e;
}

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

}  // namespace

uint32_t crc32c_hw(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  static const bool kHw = __builtin_cpu_supports("sse4.2");
  if (kHw) return ~crc32c_sse42(p, n, ~crc);
#endif
  return ~crc32c_table(p, n, ~crc);
}

void fsync_path(const std::string& path, bool directory) {
  Fd f;
  f.fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (f.fd < 0) throw_errno("cannot open", path);
  if (::fsync(f.fd) != 0) throw_errno("cannot fsync", path);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  try {
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.fd < 0) throw_errno("cannot create", tmp);
    const char* p = text.data();
    size_t n = text.size();
    while (n > 0) {
      ssize_t w = ::write(f.fd, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw_errno("cannot write", tmp);
      }
      p += w;
      n -= size_t(w);
    }
    if (::fsync(f.fd) != 0) throw_errno("cannot fsync", tmp);
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) throw_errno("cannot close", tmp);
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno(str("cannot rename '", tmp, "' to"), path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void rename_durable(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) throw_errno(str("cannot rename '", from, "' to"), to);
  const fs::path parent = fs::path(to).parent_path();
  fsync_path(parent.empty() ? "." : parent.string(), true);
}

std::vector<ManifestEntry> write_manifest(const std::string& dir) {
  std::vector<ManifestEntry> entries;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const std::string rel = fs::relative(it->path(), dir).generic_string();
    if (rel == kManifestFile) continue;
    entries.push_back(hash_file(it->path(), rel, /*sync=*/true));
  }
  if (ec) MT_THROW("cannot list '", dir, "': ", ec.message());
  std::sort(entries.begin(), entries.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["files"] = nlohmann::json::array();
  for (const ManifestEntry& e : entries)
    j["files"].push_back(nlohmann::ordered_json{{"path", e.path}, {"size", e.size}, {"crc32c", hex32(e.crc32c)}});
  // The subdirectories first, so that their entries are durable before the manifest vouches for them.
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec))
    if (it->is_directory()) fsync_path(it->path().string(), true);
  write_file_atomic((fs::path(dir) / kManifestFile).string(), j.dump(1) + "\n");
  fsync_path(dir, true);
  return entries;
}

std::string verify_manifest(const std::string& dir, bool check_hashes) {
  const fs::path mpath = fs::path(dir) / kManifestFile;
  std::error_code ec;
  if (!fs::is_regular_file(mpath, ec)) return str("no ", kManifestFile, " (an unfinished or foreign checkpoint)");
  nlohmann::json j;
  try {
    std::ifstream f(mpath);
    std::stringstream ss;
    ss << f.rdbuf();
    j = nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    return str(kManifestFile, " is not valid JSON (", e.what(), ")");
  }
  if (!j.is_object() || j.value("format", "") != kFormat || !j.contains("files") || !j["files"].is_array())
    return str(kManifestFile, " is not a ", kFormat, " manifest");
  for (const auto& f : j["files"]) {
    if (!f.is_object() || !f.contains("path") || !f["path"].is_string() || !f.contains("size") ||
        !f["size"].is_number_unsigned() || !f.contains("crc32c") || !f["crc32c"].is_string())
      return str(kManifestFile, " has a malformed entry: ", f.dump());
    const std::string rel = f["path"].get<std::string>();
    const fs::path p = fs::path(dir) / rel;
    if (!fs::is_regular_file(p, ec)) return str(rel, " is missing");
    const uint64_t want = f["size"].get<uint64_t>(), have = fs::file_size(p, ec);
    if (ec) return str(rel, ": cannot read its size (", ec.message(), ")");
    if (have != want) return str(rel, " has ", have, " bytes, the manifest says ", want);
    if (!check_hashes) continue;
    ManifestEntry e;
    try {
      e = hash_file(p, rel, false);
    } catch (const std::exception& ex) {
      return ex.what();
    }
    if (e.size != want) return str(rel, " has ", e.size, " bytes, the manifest says ", want);
    if (hex32(e.crc32c) != f["crc32c"].get<std::string>())
      return str(rel, " has CRC32C ", hex32(e.crc32c), ", the manifest says ", f["crc32c"].get<std::string>(),
                 " (corrupted)");
  }
  return "";
}

}  // namespace mt
