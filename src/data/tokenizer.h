// Tokenizer: Hugging Face `tokenizer.json` byte-level BPE (GPT-2 / Qwen2 / Qwen3 family), encoding and decoding
// id for id as the `tokenizers` library does (docs/tokenizer.md; tests/data/test_tokenizer.cpp holds it to
// goldens made by `tokenizers`).
//
// Encode, in the library's order: invalid UTF-8 bytes become U+FFFD (see below); added tokens whose
// `normalized` is false are split out of the raw text (leftmost-longest, with their lstrip / rstrip /
// single_word rules); the pieces between them are normalised (NFC when the file asks for it) and the
// `normalized` added tokens split out of those; every remaining piece is pre-tokenised by the file's split
// regex (PCRE2 with Unicode properties, JIT-compiled), mapped to bytes and merged by BPE rank.
// Decode: each id's token (added tokens first, then the model's vocabulary) through the ByteLevel decoder;
// bytes that are not valid UTF-8 come out as U+FFFD, as the library's from_utf8_lossy does.
//
// Supported file contents (anything else is refused at load, naming the field and value): model BPE
// (no dropout, no byte_fallback, no subword prefix/suffix; unk_token and ignore_merges honoured);
// normalizer null, NFC or a Sequence of those; pre_tokenizer Split (Regex or String pattern, behavior
// Isolated, not inverted), ByteLevel (use_regex: the GPT-2 regex; add_prefix_space) or a Sequence of those;
// decoder ByteLevel; post_processor null or ByteLevel (no ids added).
//
// Input bytes that are not valid UTF-8: the library's Python API takes str, so there is no reference
// behaviour; this one replaces each maximal ill-formed subpart with U+FFFD (as Python's
// bytes.decode("utf-8", "replace") does) and encodes that, so `encode(b)` equals the library's
// `encode(b.decode("utf-8", "replace"))`.
//
// One Tokenizer is not safe to use from several threads at once (its word cache and regex match data are
// its own); copies share the immutable vocabulary and merges and get fresh caches, one per thread.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

class Tokenizer {
 public:
  // Reads a tokenizer.json; errors name the file and what in it is wrong or unsupported.
  static Tokenizer from_file(const std::string& path);
  // The same from the file's text; `source` names it in errors.
  static Tokenizer from_json(std::string_view json_text, const std::string& source);

  Tokenizer(const Tokenizer& other);
  Tokenizer& operator=(const Tokenizer& other);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<uint32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<uint32_t>& ids) const;  // appends to ids
  // Ids outside the vocabulary are an error naming the id and its position (the library drops them
  // silently). skip_special drops the special added tokens, as decode(ids, skip_special_tokens=True) does.
  std::string decode(std::span<const uint32_t> ids, bool skip_special = false) const;

  // One past the largest id of the vocabulary and the added tokens.
  uint32_t vocab_size() const;
  // The id of a token string (added tokens first, then the model's vocabulary), or -1.
  int64_t token_to_id(std::string_view token) const;
  // The token string of an id as the file spells it (byte-level characters), or "" when none.
  std::string id_to_token(uint32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;
  const std::string& source() const;  // the file it came from

 private:
  struct Model;
  struct Scratch;
  Tokenizer(std::shared_ptr<const Model> model);
  void encode_piece(std::string_view piece, std::vector<uint32_t>& ids) const;  // after added tokens
  void encode_word(std::string_view word, std::vector<uint32_t>& ids) const;    // one pre-token, raw bytes
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace mt
