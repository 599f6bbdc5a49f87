// NFC (UAX #15: decompose, order by combining class, compose) over the generated tables, and the UTF-8
// helpers the tokenizer uses. Hangul syllables are decomposed and composed algorithmically.
#include <algorithm>
#include <vector>

#include "data/unicode_tables.h"

namespace mt::unicode {

namespace {

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr int kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

bool in_ranges(const RangeEntry* r, int n, char32_t cp) {
  const RangeEntry* end = r + n;
  const RangeEntry* it = std::upper_bound(r, end, cp, [](char32_t c, const RangeEntry& e) { return c < e.lo; });
  return it != r && cp <= (it - 1)->hi;
}

int ccc_of(char32_t cp) {
  if (cp < 0x300) return 0;
  const CccEntry* end = kCcc + kCccCount;
  const CccEntry* it = std::lower_bound(kCcc, end, cp, [](const CccEntry& e, char32_t c) { return e.cp < c; });
  return it != end && it->cp == cp ? it->ccc : 0;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const int s = int(cp - kSBase);
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const DecompEntry* end = kDecomp + kDecompCount;
  const DecompEntry* it = std::lower_bound(kDecomp, end, cp, [](const DecompEntry& e, char32_t c) { return e.cp < c; });
  if (it != end && it->cp == cp)
    out.insert(out.end(), kDecompPool + it->offset, kDecompPool + it->offset + it->length);
  else
    out.push_back(cp);
}

// The primary composite of (a, b), or 0.
char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const ComposeEntry* end = kCompose + kComposeCount;
  const ComposeEntry* it = std::lower_bound(kCompose, end, std::pair{a, b}, [](const ComposeEntry& e, auto key) {
    return e.first < key.first || (e.first == key.first && e.second < key.second);
  });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = [&](size_t k) { return char32_t(static_cast<unsigned char>(s[k])); };
  const char32_t c = b(i);
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    i += 2;
    return ((c & 0x1F) << 6) | (b(i - 1) & 0x3F);
  }
  if (c < 0xF0) {
    i += 3;
    return ((c & 0x0F) << 12) | ((b(i - 2) & 0x3F) << 6) | (b(i - 1) & 0x3F);
  }
  i += 4;
  return ((c & 0x07) << 18) | ((b(i - 3) & 0x3F) << 12) | ((b(i - 2) & 0x3F) << 6) | (b(i - 1) & 0x3F);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Length of the well-formed sequence at s[i] (1..4), or 0 with *bad set to the length of the maximal
// subpart of an ill-formed one (>= 1) — Table 3-7 of the Unicode standard.
size_t sequence_at(std::string_view s, size_t i, size_t* bad) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  size_t k = 1;
  for (; k <= size_t(need); ++k) {
    if (i + k >= s.size()) break;
    const unsigned char x = b(i + k);
    if (k == 1 ? (x < lo || x > hi) : (x < 0x80 || x > 0xBF)) break;
  }
  if (k == size_t(need) + 1) return k;
  *bad = k;
  return 0;
}

}  // namespace

size_t utf8_valid_prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    const size_t n = sequence_at(s, i, &bad);
    if (n == 0) return i;
    i += n;
  }
  return i;
}

std::string utf8_lossy(std::string_view s, bool* changed) {
  size_t i = utf8_valid_prefix(s);
  if (changed) *changed = i != s.size();
  if (i == s.size()) return std::string(s);
  std::string out(s.substr(0, i));
  while (i < s.size()) {
    size_t bad = 0;
    const size_t n = sequence_at(s, i, &bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

bool nfc_quick_check(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0xCC) {  // below U+0300: nothing there combines or changes
      i += static_cast<unsigned char>(text[i]) < 0x80 ? 1 : 2;
      continue;
    }
    if (in_ranges(kNfcUnsafe, kNfcUnsafeCount, next_code_point(text, i))) return false;
  }
  return true;
}

std::string nfc(std::string_view text) {
  if (nfc_quick_check(text)) return std::string(text);
  std::vector<char32_t> cps;
  cps.reserve(text.size());
  for (size_t i = 0; i < text.size();) decompose(next_code_point(text, i), cps);
  // Canonical ordering: a stable sort of each run of non-starters by class.
  std::vector<int> cls(cps.size());
  for (size_t k = 0; k < cps.size(); ++k) cls[k] = ccc_of(cps[k]);
  for (size_t k = 0; k < cps.size();) {
    if (cls[k] == 0) {
      ++k;
      continue;
    }
    size_t e = k;
    while (e < cps.size() && cls[e] != 0) ++e;
    if (e - k > 1) {
      std::vector<std::pair<int, char32_t>> run;
      for (size_t j = k; j < e; ++j) run.push_back({cls[j], cps[j]});
      std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t j = k; j < e; ++j) cls[j] = run[j - k].first, cps[j] = run[j - k].second;
    }
    k = e;
  }
  // Canonical composition: each character joins the last starter unless blocked by a character of the same or
  // a higher class in between (or by an uncombined starter).
  std::vector<char32_t> out;
  out.reserve(cps.size());
  long starter = -1;  // index into out
  int last_cls = -1;  // class of the last character kept after the starter (-1: none; never 0)
  for (size_t k = 0; k < cps.size(); ++k) {
    const char32_t c = cps[k];
    const int cc = cls[k];
    if (starter >= 0 && (last_cls == -1 || last_cls < cc)) {
      if (const char32_t comp = compose_pair(out[size_t(starter)], c)) {
        out[size_t(starter)] = comp;
        continue;
      }
    }
    out.push_back(c);
    if (cc == 0) {
      starter = long(out.size()) - 1;
      last_cls = -1;
    } else {
      last_cls = cc;
    }
  }
  std::string s;
  s.reserve(text.size());
  for (char32_t c : out) append_utf8(s, c);
  return s;
}

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  return in_ranges(kWordChars, kWordCharsCount, c);
}

}  // namespace mt::unicode
