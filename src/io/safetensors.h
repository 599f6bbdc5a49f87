// Reading and writing safetensors files (the Hugging Face weight format) and checkpoint
// directories (one model.safetensors, or shards listed in model.safetensors.index.json).
//
// Format: 8-byte little-endian header length N, N bytes of JSON header
//   {"__metadata__": {str: str}, "name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...},
// then the data; offsets are relative to the start of the data (byte 8 + N).
//
// Reading maps the file read-only (mmap) and validates the header against the file size when it
// is opened, so a truncated or corrupt file fails at open with the file, the tensor and the sizes.
// view() tensors point into the mapping and keep it alive; that memory is READ-ONLY (writing to it
// faults) — use read_f32() or Tensor::clone() for a mutable copy. read_rows_f32() reads only a slice
// of dim 0, which is how each rank loads just its own shard of a tensor.
//
// Writing goes to `path + ".tmp"`, is fsync'ed, then renamed, so a crash never leaves a truncated
// file under the final name.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mt {

struct SafetensorsEntry {
  DType dtype = DType::F32;
  Shape shape;
  size_t begin = 0, end = 0;  // byte range relative to the start of the data section
};

// Safetensors dtype names ("F32", "BF16", "F16", "I32", "I64") <-> DType.
const char* safetensors_dtype_name(DType t);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // maps and validates; throws mt::Error

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in the order of their data in the file
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const SafetensorsEntry& info(const std::string& name) const;  // throws naming the tensor and file
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Zero-copy, read-only view into the mapping, in the file's dtype. If the data is not aligned to
  // its element size (possible when a file mixes dtypes), this returns an aligned copy instead.
  Tensor view(const std::string& name) const;
  // Copies converted to f32 (any supported dtype; integers are converted by value).
  Tensor read_f32(const std::string& name) const;
  // Rows [dim0_start, dim0_start + dim0_len) along dim 0, converted to f32; reads only those bytes.
  Tensor read_rows_f32(const std::string& name, int64_t dim0_start, int64_t dim0_len) const;

 private:
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> map_;
  const char* data_ = nullptr;  // start of the data section inside the mapping
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, else model.safetensors.index.json ("weight_map":
// tensor name -> shard file). The same queries as SafetensorsFile, across all files; each file is
// opened (mapped) once. `path` may also name a single .safetensors file.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsEntry& info(const std::string& name) const;
  Tensor view(const std::string& name) const;
  Tensor read_f32(const std::string& name) const;
  Tensor read_rows_f32(const std::string& name, int64_t dim0_start, int64_t dim0_len) const;
  size_t num_files() const { return files_.size(); }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;  // throws naming tensor and directory
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes the tensors in the given order (CUDA tensors are copied to the host first). The header is
// padded with spaces to a multiple of 8 bytes, as the Python library does. `format: pt` is added to
// the metadata unless the caller sets "format": transformers refuses files whose metadata lacks it.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A tensor to be written whose data is produced only when the writer reaches it (so that a large
// checkpoint is written holding one tensor at a time). produce() must return a tensor of exactly
// `shape` and `dtype`; it is called once, in file order.
struct PendingTensor {
  std::string name;
  Shape shape;
  DType dtype = DType::F32;
  std::function<Tensor()> produce;
};
void write_safetensors_sharded_lazy(const std::string& dir, const std::vector<PendingTensor>& tensors,
                                    size_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

// Writes `dir`/model.safetensors when the total size is at most max_shard_bytes; otherwise
// model-00001-of-0000N.safetensors ... (tensors packed in order, a new shard started when the next
// tensor would overflow the current one) and model.safetensors.index.json
// ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Files of the other form and
// stale shards from an earlier save in `dir` are removed, so the directory reads back unambiguously.
void write_safetensors_sharded(const std::string& dir, const NamedTensors& tensors, size_t max_shard_bytes,
                               const std::map<std::string, std::string>& metadata = {});

}  // namespace mt
