// Durable directories: a manifest that lists every file of a directory with its size and CRC32C,
// written last, and the file-system steps that make a directory appear whole or not at all (fsync of
// files and directories, rename).
//
// Promises: verify_manifest finds a missing, truncated, grown or corrupted file (any change of size,
// and any change of content that CRC32C sees: every burst of up to 32 bits and every odd number of
// flipped bits) and says which file and how; a directory without a readable manifest is reported as
// such. Errors while writing (a full disk, a read-only directory) name the path and the system's reason.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

inline constexpr const char* kManifestFile = "manifest.json";

// CRC32C (Castagnoli, as iSCSI and TFRecord use it) continued from `crc` (0 to start):
// crc32c_hw("123456789") == 0xE3069283. Uses the CPU's crc32 instruction where there is one (x86 SSE4.2,
// about 10 GB/s on one core), else a table.
uint32_t crc32c_hw(const void* data, size_t n, uint32_t crc = 0);

struct ManifestEntry {
  std::string path;  // relative to the directory, '/'-separated
  uint64_t size = 0;
  uint32_t crc32c = 0;
};

// Hashes every regular file under `dir` (recursively, except the manifest itself), fsyncs each, and
// writes `dir`/manifest.json atomically ({"format": "moetrain-manifest-1", "files": [{"path", "size",
// "crc32c"}...]}), then fsyncs `dir`. Returns the entries in path order.
std::vector<ManifestEntry> write_manifest(const std::string& dir);

// "" when `dir` holds a manifest and every file it lists with the listed size and CRC32C; else what is
// wrong, e.g. "train_state/rank-0.safetensors has 1200 bytes, the manifest says 4096". With
// check_hashes false only the sizes are compared (a fast check of completeness).
std::string verify_manifest(const std::string& dir, bool check_hashes = true);

// Writes `text` to `path` through `path`.tmp, fsync and rename; errors name the path and the reason.
void write_file_atomic(const std::string& path, const std::string& text);
// fsync of a file or a directory; errors name the path and the reason.
void fsync_path(const std::string& path, bool directory);
// rename(2) of `from` to `to` (a directory onto a missing name), then fsync of `to`'s parent.
void rename_durable(const std::string& from, const std::string& to);

}  // namespace mt
