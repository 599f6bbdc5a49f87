// Unicode data for the tokenizer: canonical combining classes, canonical decompositions, primary compositions
// and the NFC quick-check ranges, generated from Python's unicodedata by tools/gen_unicode_tables.py
// (unicode_tables.cpp), and the NFC normaliser and UTF-8 helpers built on them (unicode.cpp). No ICU.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace mt::unicode {

struct CccEntry {
  char32_t cp;
  uint8_t ccc;
};
struct DecompEntry {
  char32_t cp;
  uint32_t offset;  // into kDecompPool
  uint32_t length;
};
struct ComposeEntry {
  char32_t first, second, composite;
};
struct RangeEntry {
  char32_t lo, hi;  // inclusive
};

extern const char* const kUnicodeVersion;
extern const CccEntry kCcc[];
extern const int kCccCount;
extern const DecompEntry kDecomp[];
extern const int kDecompCount;
extern const char32_t kDecompPool[];
extern const ComposeEntry kCompose[];
extern const int kComposeCount;
extern const RangeEntry kNfcUnsafe[];
extern const int kNfcUnsafeCount;
extern const RangeEntry kWordChars[];
extern const int kWordCharsCount;

// True when text (valid UTF-8) is surely in NFC already: no character of it can change or combine.
bool nfc_quick_check(std::string_view text);
// Canonical decomposition, canonical ordering, canonical composition (UAX #15), of valid UTF-8.
std::string nfc(std::string_view text);

// Valid UTF-8 as it is, or a copy with every ill-formed sequence replaced by U+FFFD, one per maximal
// subpart (the Unicode "substitution of maximal subparts" practice that Python's errors="replace" and
// Rust's from_utf8_lossy follow). Returns true in *changed when something was replaced.
std::string utf8_lossy(std::string_view bytes, bool* changed = nullptr);
// Length of the valid UTF-8 prefix of bytes (== bytes.size() when all of it is valid).
size_t utf8_valid_prefix(std::string_view bytes);
// Decodes one code point of valid UTF-8 at text[i] and advances i.
char32_t next_code_point(std::string_view text, size_t& i);
void append_utf8(std::string& out, char32_t cp);

// Rust's char::is_whitespace (the White_Space property) and regex `\w` (alphabetic, marks, decimal digits,
// connector punctuation, join controls; approximated from general categories: see unicode.cpp), for the
// added tokens' lstrip/rstrip/single_word rules.
bool is_white_space(char32_t cp);
bool is_word_char(char32_t cp);

}  // namespace mt::unicode
