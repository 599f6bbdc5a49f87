// Byte-level BPE from a Hugging Face tokenizer.json (contract in tokenizer.h). The BPE runs on raw bytes:
// the vocabulary's byte-level strings are mapped back to bytes once at load, words are looked up in a
// per-Tokenizer cache keyed by their bytes, and a miss is merged with a heap ordered by (rank, position),
// exactly as the library's Word::merge_all does (including its check that a queued merge still yields the
// same id).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "data/unicode_tables.h"

namespace mt {

namespace {

using json = nlohmann::json;

// GPT-2's split regex, which the ByteLevel pre-tokenizer uses when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The GPT-2 byte <-> character map: printable Latin-1 bytes map to themselves, the others to U+0100 onwards.
std::array<char32_t, 256> byte_to_char() {
  std::array<char32_t, 256> m{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  int n = 0;
  for (int b = 0; b < 256; ++b) m[b] = direct[b] ? char32_t(b) : char32_t(256 + n++);
  return m;
}

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xFF51AFD7ED558CCDull);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0xFF51AFD7ED558CCDull;
  h ^= h >> 32;
  return h;
}

// Merges: (left id, right id) -> (rank, merged id), open addressing over 64-bit keys.
class MergeTable {
 public:
  struct Value {
    uint32_t rank, id;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, {});
    mask_ = cap - 1;
  }
  void insert_or_assign(uint32_t a, uint32_t b, Value v) {
    const uint64_t k = key(a, b);
    size_t i = slot(k);
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask_;
    keys_[i] = k;
    vals_[i] = v;
  }
  const Value* find(uint32_t a, uint32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }
  size_t slot(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  std::vector<uint64_t> keys_;
  std::vector<Value> vals_;
  size_t mask_ = 0;
};

// Added tokens of one kind (normalized or not), matched leftmost-longest with a byte trie.
struct AddedMatcher {
  struct Node {
    std::vector<std::pair<unsigned char, int>> next;
    int token = -1;  // index into Model::added
  };
  std::vector<Node> nodes{Node{}};
  std::array<bool, 256> first{};
  bool empty() const { return nodes.size() == 1; }
  void add(std::string_view pattern, int token) {
    if (pattern.empty()) return;
    int n = 0;
    for (unsigned char c : pattern) {
      auto& nx = nodes[size_t(n)].next;
      auto it = std::find_if(nx.begin(), nx.end(), [&](const auto& p) { return p.first == c; });
      if (it != nx.end()) {
        n = it->second;
      } else {
        nodes.push_back(Node{});
        const int id = int(nodes.size()) - 1;
        nodes[size_t(n)].next.push_back({c, id});
        n = id;
      }
    }
    nodes[size_t(n)].token = token;
    first[static_cast<unsigned char>(pattern[0])] = true;
  }
  // The longest pattern starting at s[i]: (token index, length), or token -1.
  std::pair<int, size_t> longest_at(std::string_view s, size_t i) const {
    int n = 0, best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < s.size(); ++k) {
      const auto& nx = nodes[size_t(n)].next;
      const unsigned char c = static_cast<unsigned char>(s[k]);
      auto it = std::find_if(nx.begin(), nx.end(), [&](const auto& p) { return p.first == c; });
      if (it == nx.end()) break;
      n = it->second;
      if (nodes[size_t(n)].token >= 0) best = nodes[size_t(n)].token, best_len = k + 1 - i;
    }
    return {best, best_len};
  }
};

struct Regex {
  pcre2_code* code = nullptr;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

struct PreStep {
  enum Kind { kSplit, kPrefixSpace } kind;
  std::shared_ptr<Regex> regex;  // kSplit
};

}  // namespace

struct Tokenizer::Model {
  std::string source;
  std::vector<std::string> tokens;                      // id -> token string as in the file ("" for holes)
  std::vector<std::string> id_bytes;                    // id -> what the decoder writes for it
  std::vector<uint8_t> valid, special;                  // per id
  std::unordered_map<std::string, uint32_t> vocab;      // model vocabulary: token string -> id
  std::unordered_map<std::string, uint32_t> raw_vocab;  // byte-level tokens by their bytes (ignore_merges)
  std::array<int64_t, 256> byte_id{};                   // id of each single byte's token, or -1
  MergeTable merges;
  int64_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;
  bool nfc = false;
  bool byte_level_decoder = true;
  std::vector<PreStep> pre;
  std::vector<AddedToken> added;
  AddedMatcher added_raw, added_normalized;
  std::unordered_map<std::string, uint32_t> added_by_content;
};

struct Tokenizer::Scratch {
  pcre2_match_data* match = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  // Word cache: open addressing, keys and values in pools; cleared when full.
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0, val_off = 0, val_len = 0;
    bool used = false;
  };
  std::vector<Slot> slots = std::vector<Slot>(size_t(1) << 17);
  size_t count = 0;
  std::string keys;
  std::vector<uint32_t> vals;
  // BPE work space.
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    uint32_t len;
  };
  struct Merge {
    uint32_t rank, pos, id;
  };
  std::vector<Symbol> symbols;
  std::vector<Merge> heap;
  std::string prefixed;

  Scratch() {
    match = pcre2_match_data_create(4, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
  }
  ~Scratch() {
    pcre2_match_data_free(match);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(jit_stack);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  const Slot* find(std::string_view w, uint64_t h) const {
    const size_t mask = slots.size() - 1;
    for (size_t i = size_t(h) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (!s.used) return nullptr;
      if (s.hash == h && s.key_len == w.size() && std::memcmp(keys.data() + s.key_off, w.data(), w.size()) == 0)
        return &s;
    }
  }
  void insert(std::string_view w, uint64_t h, const uint32_t* ids, size_t n) {
    if (count * 2 >= slots.size() || keys.size() > (size_t(64) << 20)) {
      std::fill(slots.begin(), slots.end(), Slot{});
      count = 0;
      keys.clear();
      vals.clear();
    }
    const size_t mask = slots.size() - 1;
    size_t i = size_t(h) & mask;
    while (slots[i].used) i = (i + 1) & mask;
    slots[i] = Slot{h, uint32_t(keys.size()), uint32_t(w.size()), uint32_t(vals.size()), uint32_t(n), true};
    keys.append(w);
    vals.insert(vals.end(), ids, ids + n);
    ++count;
  }
};

namespace {

[[noreturn]] void bad(const std::string& source, const std::string& what) {
  MT_THROW("tokenizer ", source, ": ", what);
}

// The library's regexes run on Oniguruma, whose `\s` is the White_Space property; PCRE2's (with UCP) also matches
// U+180E MONGOLIAN VOWEL SEPARATOR. So `\s` and `\S` become explicit classes of White_Space (inside a class `\s`
// becomes its members; a `\S` inside a class is left as it is).
std::string onig_white_space(const std::string& p) {
  static const std::string kWs =
      R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[++i];
      if (d == 's')
        out += in_class ? kWs : "[" + kWs + "]";
      else if (d == 'S' && !in_class)
        out += "[^" + kWs + "]";
      else
        out += {c, d};
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);  // a leading ']' is literal
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t e = p.find(":]", i + 2);
      if (e != std::string::npos) {
        out.append(p, i, e + 2 - i);
        i = e + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

std::shared_ptr<Regex> compile_regex(const std::string& file_pattern, const std::string& source) {
  int err = 0;
  PCRE2_SIZE where = 0;
  auto r = std::make_shared<Regex>();
  const std::string pattern = onig_white_space(file_pattern);
  r->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                          &where, nullptr);
  if (!r->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    bad(source, str("split regex '", file_pattern, "' does not compile (offset ", where, " of '", pattern,
                    "'): ", reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(r->code, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) the interpreter runs it
  return r;
}

std::string escape_regex(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::strchr("\\^$.|?*+()[]{}", c) && c != 0) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?";
}

}  // namespace

namespace {

void parse_pre_tokenizer(const json& j, std::vector<PreStep>& steps, const std::string& src) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "Sequence") {
    for (const json& s : j.at("pretokenizers")) parse_pre_tokenizer(s, steps, src);
  } else if (t == "Split") {
    const json& p = j.at("pattern");
    std::string pattern;
    if (p.contains("Regex"))
      pattern = p["Regex"].get<std::string>();
    else if (p.contains("String"))
      pattern = escape_regex(p["String"].get<std::string>());
    else
      bad(src, str("pre_tokenizer Split pattern ", p.dump(), " is neither {\"Regex\": ...} nor {\"String\": ...}"));
    const std::string behavior = j.value("behavior", std::string("Isolated"));
    if (behavior != "Isolated")
      bad(src, str("pre_tokenizer Split behavior '", behavior, "' is not supported (supported: Isolated)"));
    if (j.value("invert", false)) bad(src, "pre_tokenizer Split with invert true is not supported");
    steps.push_back({PreStep::kSplit, compile_regex(pattern, src)});
  } else if (t == "ByteLevel") {
    if (j.value("add_prefix_space", false)) steps.push_back({PreStep::kPrefixSpace, nullptr});
    if (j.value("use_regex", true)) steps.push_back({PreStep::kSplit, compile_regex(kGpt2Pattern, src)});
  } else {
    bad(src, str("pre_tokenizer type '", t, "' is not supported (supported: Split, ByteLevel, Sequence)"));
  }
}

}  // namespace

namespace {
void parse_normalizer(const json& j, bool& nfc, const std::string& src) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "NFC") {
    nfc = true;
  } else if (t == "Sequence") {
    for (const json& s : j.at("normalizers")) parse_normalizer(s, nfc, src);
  } else {
    bad(src, str("normalizer type '", t, "' is not supported (supported: NFC, Sequence, none)"));
  }
}
}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) MT_THROW("tokenizer ", path, ": cannot open the file (", std::strerror(errno), ")");
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    bad(src, str("not valid JSON: ", e.what()));
  }
  if (!j.is_object()) bad(src, "the top level is not a JSON object");
  auto m = std::make_shared<Model>();
  m->source = src;
  try {
    const json& model = j.contains("model") ? j["model"] : json();
    if (!model.is_object()) bad(src, "no \"model\" object");
    const std::string model_type = model.value("type", std::string(model.contains("merges") ? "BPE" : "?"));
    if (model_type != "BPE") bad(src, str("model type '", model_type, "' is not supported (supported: BPE)"));
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      bad(src, "BPE dropout is not supported (encoding would be random)");
    if (model.value("byte_fallback", false)) bad(src, "BPE byte_fallback is not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && model[k].is_string() && !model[k].get<std::string>().empty())
        bad(src, str("BPE ", k, " '", model[k].get<std::string>(), "' is not supported (byte-level BPE has none)"));
    m->ignore_merges = model.value("ignore_merges", false);
    m->fuse_unk = model.value("fuse_unk", false);
    const json& vocab = model.at("vocab");
    if (!vocab.is_object()) bad(src, "model.vocab is not an object of token -> id");
    uint32_t size = 0;
    m->vocab.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= (1ll << 31))
        bad(src, str("model.vocab[\"", it.key(), "\"] is ", it.value().dump(), ", not an id in [0, 2^31)"));
      const uint32_t id = it.value().get<uint32_t>();
      m->vocab[it.key()] = id;
      size = std::max(size, id + 1);
    }
    for (const json& a : j.value("added_tokens", json::array())) {
      AddedToken t;
      t.content = a.at("content").get<std::string>();
      t.id = a.at("id").get<uint32_t>();
      t.special = a.value("special", false);
      t.single_word = a.value("single_word", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.normalized = a.value("normalized", !t.special);
      if (t.content.empty()) bad(src, str("added token ", t.id, " has empty content"));
      size = std::max(size, t.id + 1);
      m->added.push_back(t);
    }
    m->tokens.assign(size, "");
    m->valid.assign(size, 0);
    m->special.assign(size, 0);
    for (const auto& [tok, id] : m->vocab) m->tokens[id] = tok, m->valid[id] = 1;
    std::unordered_set<std::string> special_contents;
    for (size_t i = 0; i < m->added.size(); ++i) {
      const AddedToken& t = m->added[i];
      m->tokens[t.id] = t.content;  // the added vocabulary wins in decode, as in the library
      m->valid[t.id] = 1;
      m->added_by_content[t.content] = t.id;
      if (t.special) special_contents.insert(t.content);
    }
    for (uint32_t id = 0; id < size; ++id) m->special[id] = m->valid[id] && special_contents.count(m->tokens[id]);

    // Byte-level strings <-> bytes.
    const std::array<char32_t, 256> b2c = byte_to_char();
    std::unordered_map<char32_t, unsigned char> c2b;
    for (int b = 0; b < 256; ++b) c2b[b2c[size_t(b)]] = static_cast<unsigned char>(b);
    auto to_bytes = [&](const std::string& tok, std::string& out) {
      out.clear();
      if (unicode::utf8_valid_prefix(tok) != tok.size()) return false;
      for (size_t i = 0; i < tok.size();) {
        auto it = c2b.find(unicode::next_code_point(tok, i));
        if (it == c2b.end()) return false;
        out.push_back(char(it->second));
      }
      return true;
    };
    m->id_bytes.assign(size, "");
    std::string raw;
    for (uint32_t id = 0; id < size; ++id) {
      if (!m->valid[id]) continue;
      m->id_bytes[id] = to_bytes(m->tokens[id], raw) ? raw : m->tokens[id];
    }
    m->byte_id.fill(-1);
    for (int b = 0; b < 256; ++b) {
      std::string s;
      unicode::append_utf8(s, b2c[size_t(b)]);
      auto it = m->vocab.find(s);
      if (it != m->vocab.end()) m->byte_id[size_t(b)] = it->second;
    }
    if (m->ignore_merges)
      for (const auto& [tok, id] : m->vocab)
        if (to_bytes(tok, raw)) m->raw_vocab.emplace(raw, id);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = m->vocab.find(model["unk_token"].get<std::string>());
      if (it == m->vocab.end())
        bad(src, str("unk_token '", model["unk_token"].get<std::string>(), "' is not in the vocabulary"));
      m->unk_id = it->second;
    }

    const json& merges = model.at("merges");
    if (!merges.is_array()) bad(src, "model.merges is not an array");
    m->merges.reserve(merges.size());
    std::string a, b;
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& e = merges[rank];
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          bad(src, str("merge ", rank, " '", s, "' is not two tokens separated by one space"));
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>(), b = e[1].get<std::string>();
      } else {
        bad(src, str("merge ", rank, " is ", e.dump(), ", neither \"a b\" nor [\"a\", \"b\"]"));
      }
      auto ia = m->vocab.find(a), ib = m->vocab.find(b), iab = m->vocab.find(a + b);
      for (auto [it, name] : {std::pair{ia, &a}, std::pair{ib, &b}})
        if (it == m->vocab.end()) bad(src, str("merge ", rank, " uses '", *name, "', which is not in the vocabulary"));
      if (iab == m->vocab.end()) bad(src, str("merge ", rank, " makes '", a + b, "', which is not in the vocabulary"));
      m->merges.insert_or_assign(ia->second, ib->second, {uint32_t(rank), iab->second});
    }

    parse_normalizer(j.contains("normalizer") ? j["normalizer"] : json(), m->nfc, src);
    parse_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), m->pre, src);
    const json dec = j.contains("decoder") ? j["decoder"] : json();
    if (dec.is_null())
      m->byte_level_decoder = false;
    else if (type_of(dec) != "ByteLevel")
      bad(src, str("decoder type '", type_of(dec), "' is not supported (supported: ByteLevel)"));
    const json pp = j.contains("post_processor") ? j["post_processor"] : json();
    if (!pp.is_null() && type_of(pp) != "ByteLevel")
      bad(src, str("post_processor type '", type_of(pp), "' is not supported (supported: ByteLevel, none)"));

    for (size_t i = 0; i < m->added.size(); ++i) {
      const AddedToken& t = m->added[i];
      if (t.normalized)
        m->added_normalized.add(m->nfc ? unicode::nfc(t.content) : t.content, int(i));
      else
        m->added_raw.add(t.content, int(i));
    }
  } catch (const json::exception& e) {
    bad(src, str("unexpected content: ", e.what()));
  }
  return Tokenizer(std::move(m));
}

Tokenizer::Tokenizer(std::shared_ptr<const Model> model) : model_(std::move(model)), scratch_(new Scratch) {}
Tokenizer::Tokenizer(const Tokenizer& o) : model_(o.model_), scratch_(new Scratch) {}
Tokenizer& Tokenizer::operator=(const Tokenizer& o) {
  model_ = o.model_;
  scratch_.reset(new Scratch);
  return *this;
}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

uint32_t Tokenizer::vocab_size() const {
  return uint32_t(model_->tokens.size());
}
const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return model_->added;
}
const std::string& Tokenizer::source() const {
  return model_->source;
}

int64_t Tokenizer::token_to_id(std::string_view token) const {
  const std::string t(token);
  if (auto it = model_->added_by_content.find(t); it != model_->added_by_content.end()) return it->second;
  if (auto it = model_->vocab.find(t); it != model_->vocab.end()) return it->second;
  return -1;
}

std::string Tokenizer::id_to_token(uint32_t id) const {
  return id < model_->tokens.size() ? model_->tokens[id] : "";
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  encode_append(text, ids);
  return ids;
}

namespace {

// The added-token splits of `s` (the library's AddedVocabulary::find_matches): calls piece(sub) for text
// between tokens and token(id) for each match.
template <class Piece, class Token>
void split_added(std::string_view s, const AddedMatcher& m, const std::vector<AddedToken>& added, Piece piece,
                 Token token) {
  size_t start_offset = 0;
  for (size_t i = 0; i < s.size();) {
    if (!m.first[static_cast<unsigned char>(s[i])]) {
      ++i;
      continue;
    }
    const auto [k, len] = m.longest_at(s, i);
    if (k < 0) {
      ++i;
      continue;
    }
    const AddedToken& t = added[size_t(k)];
    size_t start = i, stop = i + len;
    i = stop;  // the scan goes on after the match, whatever lstrip/rstrip take
    if (t.single_word) {
      bool start_ok = start == 0, stop_ok = stop == s.size();
      if (!start_ok) {
        size_t p = start - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t q = p;
        start_ok = !unicode::is_word_char(unicode::next_code_point(s, q));
      }
      if (!stop_ok) {
        size_t q = stop;
        stop_ok = !unicode::is_word_char(unicode::next_code_point(s, q));
      }
      if (!start_ok || !stop_ok) continue;
    }
    if (t.lstrip) {
      size_t newstart = start;
      while (newstart > 0) {
        size_t p = newstart - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t q = p;
        if (!unicode::is_white_space(unicode::next_code_point(s, q))) break;
        newstart = p;
      }
      start = std::max(newstart, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        size_t q = stop;
        if (!unicode::is_white_space(unicode::next_code_point(s, q))) break;
        stop = q;
      }
    }
    if (start_offset < start) piece(s.substr(start_offset, start - start_offset));
    token(t.id);
    start_offset = stop;
  }
  if (start_offset < s.size()) piece(s.substr(start_offset));
}

}  // namespace

void Tokenizer::encode_append(std::string_view text, std::vector<uint32_t>& ids) const {
  const Model& m = *model_;
  std::string fixed;
  if (unicode::utf8_valid_prefix(text) != text.size()) {
    fixed = unicode::utf8_lossy(text);
    text = fixed;
  }
  auto push_id = [&](uint32_t id) { ids.push_back(id); };
  auto normalized_stage = [&](std::string_view piece) {
    std::string normalized;
    if (m.nfc && !unicode::nfc_quick_check(piece)) {
      normalized = unicode::nfc(piece);
      piece = normalized;
    }
    if (m.added_normalized.empty())
      encode_piece(piece, ids);
    else
      split_added(
          piece, m.added_normalized, m.added, [&](std::string_view p) { encode_piece(p, ids); }, push_id);
  };
  if (m.added_raw.empty())
    normalized_stage(text);
  else
    split_added(text, m.added_raw, m.added, normalized_stage, push_id);
}

namespace {

// Calls f(piece) for each piece of s split by the regex, matches and the gaps between them alike (Isolated).
template <class F>
void regex_split(std::string_view s, const Regex& re, pcre2_match_data* md, pcre2_match_context* mc, F f) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t prev = 0, off = 0;
  while (off < s.size()) {
    const int rc = pcre2_match(re.code, subject, s.size(), off, PCRE2_NO_UTF_CHECK, md, mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      MT_THROW("tokenizer: the split regex failed on a text of ", s.size(),
               " bytes: ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t a = ov[0], b = ov[1];
    if (a > prev) f(s.substr(prev, a - prev));
    if (b > a) {
      f(s.substr(a, b - a));
      prev = off = b;
    } else {  // an empty match: step over one character
      prev = a;
      off = b;
      unicode::next_code_point(s, off);
    }
  }
  if (prev < s.size()) f(s.substr(prev));
}

}  // namespace

void Tokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& ids) const {
  const Model& m = *model_;
  Scratch& sc = *scratch_;
  if (piece.empty()) return;
  if (m.pre.empty()) return encode_word(piece, ids);
  if (m.pre.size() == 1 && m.pre[0].kind == PreStep::kSplit) {
    regex_split(piece, *m.pre[0].regex, sc.match, sc.mctx, [&](std::string_view w) { encode_word(w, ids); });
    return;
  }
  // The general sequence: every step splits every piece further.
  std::vector<std::string> pieces{std::string(piece)}, next;
  for (const PreStep& step : m.pre) {
    next.clear();
    for (std::string& p : pieces) {
      if (step.kind == PreStep::kPrefixSpace) {
        next.push_back(p.starts_with(' ') ? std::move(p) : " " + p);
      } else {
        regex_split(p, *step.regex, sc.match, sc.mctx, [&](std::string_view w) { next.emplace_back(w); });
      }
    }
    std::swap(pieces, next);
  }
  for (const std::string& w : pieces) encode_word(w, ids);
}

void Tokenizer::encode_word(std::string_view w, std::vector<uint32_t>& ids) const {
  if (w.empty()) return;
  const Model& m = *model_;
  Scratch& sc = *scratch_;
  if (m.ignore_merges) {
    if (auto it = m.raw_vocab.find(std::string(w)); it != m.raw_vocab.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  const uint64_t h = hash_bytes(w);
  if (const Scratch::Slot* hit = sc.find(w, h)) {
    ids.insert(ids.end(), sc.vals.begin() + hit->val_off, sc.vals.begin() + hit->val_off + hit->val_len);
    return;
  }
  // The word's symbols: one per byte (one per byte-level character), unknown ones as unk or dropped.
  auto& sym = sc.symbols;
  sym.clear();
  int64_t pending_unk_len = -1;
  for (size_t i = 0; i < w.size();) {
    // Characters are whole UTF-8 sequences in the library; a byte-level character is one byte here.
    const int64_t id = m.byte_id[static_cast<unsigned char>(w[i])];
    if (id >= 0) {
      if (pending_unk_len >= 0)
        sym.push_back({uint32_t(m.unk_id), 0, 0, uint32_t(pending_unk_len)}), pending_unk_len = -1;
      sym.push_back({uint32_t(id), 0, 0, 1});
    } else if (m.unk_id >= 0) {
      if (pending_unk_len >= 0 && !m.fuse_unk)
        sym.push_back({uint32_t(m.unk_id), 0, 0, uint32_t(pending_unk_len)}), pending_unk_len = -1;
      pending_unk_len = pending_unk_len < 0 ? 1 : pending_unk_len + 1;
    }
    ++i;
  }
  if (pending_unk_len >= 0) sym.push_back({uint32_t(m.unk_id), 0, 0, uint32_t(pending_unk_len)});
  const int32_t n = int32_t(sym.size());
  for (int32_t i = 0; i < n; ++i) sym[size_t(i)].prev = i - 1, sym[size_t(i)].next = i + 1 < n ? i + 1 : -1;
  auto& heap = sc.heap;
  heap.clear();
  // std heap functions build a max-heap: "less" means a later merge (higher rank, then higher position).
  auto later = [](const Scratch::Merge& x, const Scratch::Merge& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const MergeTable::Value* v = m.merges.find(sym[size_t(i)].id, sym[size_t(i + 1)].id))
      heap.push_back({v->rank, uint32_t(i), v->id});
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Scratch::Merge top = heap.back();
    heap.pop_back();
    Scratch::Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Scratch::Symbol right = sym[size_t(next_pos)];
    const MergeTable::Value* v = m.merges.find(cur.id, right.id);
    if (!v || v->id != top.id) continue;  // an expired entry
    cur.id = top.id;
    cur.len += right.len;
    cur.next = right.next;
    sym[size_t(next_pos)].len = 0;
    if (right.next >= 0) sym[size_t(right.next)].prev = int32_t(top.pos);
    if (cur.prev >= 0)
      if (const MergeTable::Value* pv = m.merges.find(sym[size_t(cur.prev)].id, cur.id)) {
        heap.push_back({pv->rank, uint32_t(cur.prev), pv->id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    if (cur.next >= 0)
      if (const MergeTable::Value* nv = m.merges.find(cur.id, sym[size_t(cur.next)].id)) {
        heap.push_back({nv->rank, top.pos, nv->id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
  }
  const size_t first = ids.size();
  for (const Scratch::Symbol& s : sym)
    if (s.len) ids.push_back(s.id);
  if (w.size() < 256) sc.insert(w, h, ids.data() + first, ids.size() - first);
}

std::string Tokenizer::decode(std::span<const uint32_t> ids, bool skip_special) const {
  const Model& m = *model_;
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id >= m.tokens.size() || !m.valid[id])
      MT_THROW("tokenizer ", m.source, ": id ", id, " at position ", i, " is not in the vocabulary (", m.tokens.size(),
               " ids)");
    if (skip_special && m.special[id]) continue;
    if (m.byte_level_decoder) {
      bytes += m.id_bytes[id];
    } else {
      if (!bytes.empty()) bytes.push_back(' ');
      bytes += m.tokens[id];
    }
  }
  return unicode::utf8_lossy(bytes);
}

}  // namespace mt
