// CharTokenizer: see char_tokenizer.h for the vocabulary.
#include "data/char_tokenizer.h"

#include "core/error.h"

namespace mt {

namespace {

// Printable form of a character for error messages ('\n' and control bytes are invisible).
std::string describe_char(char c) {
  unsigned char u = static_cast<unsigned char>(c);
  if (c == '\n') return "'\\n'";
  if (c == '\t') return "'\\t'";
  if (c == '\r') return "'\\r'";
  if (u < 32 || u >= 127) {
    static const char* hex = "0123456789abcdef";
    return str("byte 0x", hex[u >> 4], hex[u & 15]);
  }
  return str("'", c, "'");
}

std::string allowed_chars() {
  std::string out;
  for (char c : CharTokenizer::kChars) out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out;
}

}  // namespace

int64_t CharTokenizer::char_id(char c) const {
  size_t pos = kChars.find(c);
  return pos == std::string_view::npos ? -1 : kFirstDigit + int64_t(pos);
}

std::vector<int64_t> CharTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    int64_t id = char_id(text[i]);
    if (id < 0)
      MT_THROW("char tokenizer: unknown character ", describe_char(text[i]), " at position ", i,
               "; the vocabulary has only \"", allowed_chars(), "\"");
    ids.push_back(id);
  }
  return ids;
}

std::string CharTokenizer::token_str(int64_t id) const {
  if (id == kPad) return "<pad>";
  if (id == kBos) return "<bos>";
  if (id == kEos) return "<eos>";
  if (id < kFirstDigit || id >= kVocabSize)
    MT_THROW("char tokenizer: token id ", id, " is outside the vocabulary [0, ", kVocabSize, ")");
  return std::string(1, kChars[size_t(id - kFirstDigit)]);
}

std::string CharTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t id = ids[i];
    if (id < 0 || id >= kVocabSize)
      MT_THROW("char tokenizer: token id ", id, " at position ", i, " is outside the vocabulary [0, ", kVocabSize, ")");
    if (id < kFirstDigit) {
      if (!skip_special) out += token_str(id);
    } else {
      out += kChars[size_t(id - kFirstDigit)];
    }
  }
  return out;
}

}  // namespace mt
