// TensorBoard event files without protobuf or TensorFlow: scalars written as `Event` protobufs encoded
// by hand, in TFRecord framing, so `tensorboard --logdir` shows the curves; and a reader that checks
// every record (for tests and tools).
//
// Record framing (TFRecord): uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes, the
// data, uint32 masked CRC32C of the data; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8.
// Event (tensorflow/core/util/event.proto): wall_time double = 1, step int64 = 2, file_version string
// = 3 (the first record says "brain.Event:2"), summary Summary = 5; Summary.value (repeated) = 1;
// Summary.Value: tag string = 1, simple_value float = 2.
//
// The writer promises: a new file `events.out.tfevents.<unix seconds>.<hostname>` per writer (never
// an existing file overwritten: a suffix is added when the name is taken), one Event per
// add_scalars call, flushed at once, so a run that is killed keeps every step it logged.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace mt {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), software table. `crc` continues a
// running value (0 to start): crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// The TFRecord mask of crc32c(data).
uint32_t masked_crc32c(const void* data, size_t n);

struct TbScalar {
  std::string tag;
  float value = 0;
};

struct TbEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;       // set only on the file's first record
  std::vector<TbScalar> scalars;  // the summary's simple values, in file order
};

class TensorBoardWriter {
 public:
  // Creates `dir` (and parents) and a new event file in it, and writes the file_version record.
  // Throws mt::Error naming the path when the file cannot be created.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event holding every scalar, written and flushed. wall_time < 0: now. Throws mt::Error naming
  // the file when the write fails (a full disk, say).
  void add_scalars(int64_t step, const std::vector<TbScalar>& scalars, double wall_time = -1);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* f_ = nullptr;
};

// Every number in a JSON value as a scalar: object keys joined with '/' ("time_s/forward"), array
// elements by index ("experts/imbalance_per_layer/0"), booleans as 0/1; strings and nulls are left
// out. `prefix` is put before every tag ("eval" gives "eval/exact_match").
std::vector<TbScalar> json_scalars(const nlohmann::json& j, const std::string& prefix = "");

// The encoding of one Event (exposed for tests). file_version non-empty: a version record, no summary.
std::string encode_tb_event(const TbEvent& e);

// Every record of an event file, both CRCs checked and each Event decoded (unknown fields skipped).
// Throws mt::Error naming the file, the record index and its byte offset on a CRC mismatch, a record
// cut short (a writer killed mid-record leaves one) or an Event that does not decode.
std::vector<TbEvent> read_tb_events(const std::string& path);

// The event files (names containing "tfevents") directly in `dir`, sorted by name.
std::vector<std::string> tb_event_files(const std::string& dir);

}  // namespace mt
