// CharTokenizer: a fixed character-level vocabulary for the built-in synthetic tasks. It is small
// enough (kVocabSize <= 32) to fit the `demo` model's vocabulary of 32, and fixed so that a
// checkpoint trained on synthetic data decodes the same way forever.
//
// Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3..12 '0'..'9', then '+', '=', ' ', '-', '*', '\n', '.', ',', '?'.
// Special tokens have no character; encode() never produces them and decode() writes their names.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

class CharTokenizer {
 public:
  static constexpr int64_t kPad = 0;
  static constexpr int64_t kBos = 1;
  static constexpr int64_t kEos = 2;
  static constexpr int64_t kFirstDigit = 3;                           // '0'; '9' is kFirstDigit + 9
  static constexpr std::string_view kChars = "0123456789+= -*\n.,?";  // ids kFirstDigit.. in order
  static constexpr int64_t kVocabSize = kFirstDigit + int64_t(kChars.size());
  static_assert(kVocabSize <= 32, "the demo model's vocabulary is 32");

  int64_t vocab_size() const { return kVocabSize; }
  int64_t pad_id() const { return kPad; }
  int64_t bos_id() const { return kBos; }
  int64_t eos_id() const { return kEos; }

  // Unknown characters are an error naming the character, its position and the allowed set.
  std::vector<int64_t> encode(std::string_view text) const;
  int64_t char_id(char c) const;  // -1 when c is not in the vocabulary
  // Ids outside [0, vocab) are an error. Special ids are written "<pad>", "<bos>", "<eos>"
  // unless skip_special, in which case they are dropped.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special = false) const;
  // One id as text (a character or a special token's name), for logs and error messages.
  std::string token_str(int64_t id) const;
};

}  // namespace mt
