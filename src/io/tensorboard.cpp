// TensorBoard event files (tensorboard.h): CRC32C, the hand-written protobuf encoding of Event and
// Summary, TFRecord framing, and the checking reader.
#include "io/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"

namespace mt {

namespace {

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // Castagnoli, reflected

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}
void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, uint64_t(field) << 3 | uint64_t(wire_type));
}
template <class T>
void put_fixed(std::string& out, T v) {  // little-endian, as protobuf's fixed32/fixed64 (x86 and ARM alike)
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// A protobuf message being read; every failure names what it was reading.
struct ProtoReader {
  const uint8_t* p;
  const uint8_t* end;
  const char* what;

  bool done() const { return p >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) MT_THROW(what, ": varint runs past the end of the message");
      const uint8_t b = *p++;
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    MT_THROW(what, ": varint longer than 10 bytes");
  }
  template <class T>
  T fixed() {
    if (size_t(end - p) < sizeof(T)) MT_THROW(what, ": fixed", 8 * sizeof(T), " field runs past the end");
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > uint64_t(end - p)) MT_THROW(what, ": length ", n, " runs past the end (", end - p, " bytes left)");
    std::string_view s(reinterpret_cast<const char*>(p), size_t(n));
    p += n;
    return s;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case kVarint:
        varint();
        break;
      case kFixed64:
        fixed<uint64_t>();
        break;
      case kLengthDelimited:
        bytes();
        break;
      case kFixed32:
        fixed<uint32_t>();
        break;
      default:
        MT_THROW(what, ": wire type ", wire_type, " is not supported (0, 1, 2 and 5 are)");
    }
  }
};

TbScalar decode_value(std::string_view msg) {
  ProtoReader r{reinterpret_cast<const uint8_t*>(msg.data()), reinterpret_cast<const uint8_t*>(msg.data()) + msg.size(),
                "Summary.Value"};
  TbScalar s;
  while (!r.done()) {
    const uint64_t key = r.varint();
    const int field = int(key >> 3), wt = int(key & 7);
    if (field == 1 && wt == kLengthDelimited)
      s.tag = std::string(r.bytes());
    else if (field == 2 && wt == kFixed32)
      s.value = r.fixed<float>();
    else
      r.skip(wt);
  }
  return s;
}

TbEvent decode_event(std::string_view msg) {
  ProtoReader r{reinterpret_cast<const uint8_t*>(msg.data()), reinterpret_cast<const uint8_t*>(msg.data()) + msg.size(),
                "Event"};
  TbEvent e;
  while (!r.done()) {
    const uint64_t key = r.varint();
    const int field = int(key >> 3), wt = int(key & 7);
    if (field == 1 && wt == kFixed64)
      e.wall_time = r.fixed<double>();
    else if (field == 2 && wt == kVarint)
      e.step = int64_t(r.varint());
    else if (field == 3 && wt == kLengthDelimited)
      e.file_version = std::string(r.bytes());
    else if (field == 5 && wt == kLengthDelimited) {
      const std::string_view summary = r.bytes();
      ProtoReader s{reinterpret_cast<const uint8_t*>(summary.data()),
                    reinterpret_cast<const uint8_t*>(summary.data()) + summary.size(), "Summary"};
      while (!s.done()) {
        const uint64_t k = s.varint();
        if (int(k >> 3) == 1 && int(k & 7) == kLengthDelimited)
          e.scalars.push_back(decode_value(s.bytes()));
        else
          s.skip(int(k & 7));
      }
    } else
      r.skip(wt);
  }
  return e;
}

std::string host_name() {
  char h[256] = {};
  if (gethostname(h, sizeof h - 1) != 0 || !h[0]) return "localhost";
  std::string s(h);
  std::replace(s.begin(), s.end(), '/', '_');
  return s;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void flatten(const nlohmann::json& j, const std::string& tag, std::vector<TbScalar>& out) {
  auto join = [&](const std::string& k) { return tag.empty() ? k : tag + "/" + k; };
  if (j.is_object())
    for (auto it = j.begin(); it != j.end(); ++it) flatten(it.value(), join(it.key()), out);
  else if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i) flatten(j[i], join(std::to_string(i)), out);
  else if (j.is_boolean())
    out.push_back({tag, j.get<bool>() ? 1.0f : 0.0f});
  else if (j.is_number() && !tag.empty())
    out.push_back({tag, float(j.get<double>())});
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = kCrcTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_tb_event(const TbEvent& e) {
  std::string out;
  put_key(out, 1, kFixed64);
  put_fixed<double>(out, e.wall_time);
  put_key(out, 2, kVarint);
  put_varint(out, uint64_t(e.step));
  if (!e.file_version.empty()) {
    put_bytes(out, 3, e.file_version);
    return out;
  }
  std::string summary;
  for (const TbScalar& s : e.scalars) {
    std::string value;
    put_bytes(value, 1, s.tag);
    put_key(value, 2, kFixed32);
    put_fixed<float>(value, s.value);
    put_bytes(summary, 1, value);
  }
  put_bytes(out, 5, summary);
  return out;
}

std::vector<TbScalar> json_scalars(const nlohmann::json& j, const std::string& prefix) {
  std::vector<TbScalar> out;
  flatten(j, prefix, out);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir.empty() ? "." : dir, ec);
  if (ec) MT_THROW("cannot create the TensorBoard directory ", dir, ": ", ec.message());
  const double now = unix_now();
  const std::string base =
      (fs::path(dir.empty() ? "." : dir) / ("events.out.tfevents." + std::to_string(int64_t(now)) + "." + host_name()))
          .string();
  // "x": fail rather than overwrite when another writer (this second, this host) took the name.
  for (int k = 0; !f_; ++k) {
    path_ = k == 0 ? base : base + "." + std::to_string(getpid()) + (k == 1 ? "" : "." + std::to_string(k));
    f_ = std::fopen(path_.c_str(), "wbx");
    if (!f_ && (errno != EEXIST || k > 100))
      MT_THROW("cannot create the TensorBoard event file ", path_, ": ", std::strerror(errno));
  }
  TbEvent v;
  v.wall_time = now;
  v.file_version = "brain.Event:2";
  write_record(encode_tb_event(v));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<TbScalar>& scalars, double wall_time) {
  TbEvent e;
  e.wall_time = wall_time < 0 ? unix_now() : wall_time;
  e.step = step;
  e.scalars = scalars;
  write_record(encode_tb_event(e));
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string rec;
  rec.reserve(data.size() + 16);
  put_fixed<uint64_t>(rec, data.size());
  put_fixed<uint32_t>(rec, masked_crc32c(rec.data(), 8));
  rec += data;
  put_fixed<uint32_t>(rec, masked_crc32c(data.data(), data.size()));
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size() || std::fflush(f_) != 0)
    MT_THROW("cannot write the TensorBoard event file ", path_, ": ", std::strerror(errno));
}

std::vector<TbEvent> read_tb_events(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("cannot open the TensorBoard event file ", path);
  const std::string buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<TbEvent> events;
  size_t off = 0;
  for (size_t index = 0; off < buf.size(); ++index) {
    auto where = [&] { return str(path, ": record ", index, " at byte ", off); };
    if (buf.size() - off < 12)
      MT_THROW(where(), ": the header is cut short (", buf.size() - off, " of 12 bytes; a writer stopped mid-record?)");
    uint64_t len;
    uint32_t len_crc;
    std::memcpy(&len, buf.data() + off, 8);
    std::memcpy(&len_crc, buf.data() + off + 8, 4);
    if (len_crc != masked_crc32c(buf.data() + off, 8))
      MT_THROW(where(), ": the length's CRC does not match (stored 0x", std::hex, len_crc, ", computed 0x",
               masked_crc32c(buf.data() + off, 8), std::dec, ")");
    if (len > buf.size() - off - 12 || buf.size() - off - 12 - len < 4)
      MT_THROW(where(), ": the record of ", len, " data bytes is cut short (", buf.size() - off - 12,
               " bytes left with its CRC; a writer stopped mid-record?)");
    const char* data = buf.data() + off + 12;
    uint32_t data_crc;
    std::memcpy(&data_crc, data + len, 4);
    if (data_crc != masked_crc32c(data, size_t(len)))
      MT_THROW(where(), ": the data's CRC does not match (stored 0x", std::hex, data_crc, ", computed 0x",
               masked_crc32c(data, size_t(len)), std::dec, ")");
    try {
      events.push_back(decode_event(std::string_view(data, size_t(len))));
    } catch (const Error& e) {
      MT_THROW(where(), ": ", e.what());
    }
    off += 12 + len + 4;
  }
  return events;
}

std::vector<std::string> tb_event_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().filename().string().find("tfevents") != std::string::npos)
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace mt
