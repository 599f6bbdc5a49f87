// The Jinja2 subset of jinja.h: a scanner (text and tags, with Jinja's whitespace rules as transformers sets them:
// trim_blocks, lstrip_blocks), a recursive-descent parser to a small tree, and a tree-walking evaluator over JSON
// values. Every error carries the template line.
#include "data/jinja.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "core/error.h"
#include "data/chat_template.h"

namespace mt::jinja {

namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------------------------
// Scanning: the template as chunks (text, {{ }} and {% %}), the tags' contents as tokens.

enum class Tok { Name, Str, Int, Float, Op };
struct Token {
  Tok type;
  std::string text;  // name, operator, or the string literal's value
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

enum class ChunkKind { Text, Output, Stmt };
struct Chunk {
  ChunkKind kind;
  std::string text;  // Text
  std::vector<Token> toks;
  int line = 0;
};

struct Scanner {
  const std::string& src;
  const std::string& origin;
  size_t pos = 0;
  int line = 1;

  [[noreturn]] void fail(int at, const std::string& msg) const { MT_THROW(origin, " line ", at, ": ", msg); }

  void advance(size_t to) {
    for (; pos < to; ++pos)
      if (src[pos] == '\n') ++line;
  }

  // The tokens of a tag's inside up to its closing delimiter `close` ("}}" or "%}"); sets *strip_after when it
  // closes with "-}}" / "-%}".
  std::vector<Token> lex(const std::string& close, bool* strip_after, int open_line) {
    std::vector<Token> out;
    static const char* kOps[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+", "-", "*", "/", "%",
                                 "~",  "|",  ".",  ",",  ":",  "(",  ")", "[", "]", "{", "}", "="};
    for (;;) {
      while (pos < src.size() && std::isspace((unsigned char)src[pos])) advance(pos + 1);
      if (pos >= src.size()) fail(open_line, "a tag opened here is never closed (no \"" + close + "\")");
      if (src.compare(pos, close.size() + 1, "-" + close) == 0) {
        *strip_after = true;
        advance(pos + close.size() + 1);
        return out;
      }
      if (src.compare(pos, close.size(), close) == 0) {
        *strip_after = false;
        advance(pos + close.size());
        return out;
      }
      Token t;
      t.line = line;
      const char c = src[pos];
      if (std::isalpha((unsigned char)c) || c == '_') {
        size_t e = pos;
        while (e < src.size() && (std::isalnum((unsigned char)src[e]) || src[e] == '_')) ++e;
        t.type = Tok::Name;
        t.text = src.substr(pos, e - pos);
        advance(e);
      } else if (std::isdigit((unsigned char)c)) {
        size_t e = pos;
        while (e < src.size() && std::isdigit((unsigned char)src[e])) ++e;
        bool is_float = false;
        if (e + 1 < src.size() && src[e] == '.' && std::isdigit((unsigned char)src[e + 1])) {
          is_float = true;
          ++e;
          while (e < src.size() && std::isdigit((unsigned char)src[e])) ++e;
        }
        const std::string num = src.substr(pos, e - pos);
        t.type = is_float ? Tok::Float : Tok::Int;
        if (is_float)
          t.f = std::stod(num);
        else
          t.i = std::stoll(num);
        t.text = num;
        advance(e);
      } else if (c == '\'' || c == '"') {
        size_t e = pos + 1;
        std::string s;
        for (;; ++e) {
          if (e >= src.size()) fail(t.line, "a string literal is never closed");
          if (src[e] == c) break;
          if (src[e] == '\\' && e + 1 < src.size()) {
            const char n = src[++e];
            switch (n) {
              case 'n':
                s += '\n';
                break;
              case 't':
                s += '\t';
                break;
              case 'r':
                s += '\r';
                break;
              case '\\':
                s += '\\';
                break;
              case '\'':
                s += '\'';
                break;
              case '"':
                s += '"';
                break;
              case '\n':
                break;
              default:
                s += '\\';
                s += n;
            }
          } else {
            s += src[e];
          }
        }
        t.type = Tok::Str;
        t.text = std::move(s);
        advance(e + 1);
      } else {
        const char* op = nullptr;
        for (const char* o : kOps)
          if (src.compare(pos, std::strlen(o), o) == 0) {
            op = o;
            break;
          }
        if (!op) fail(line, str("unexpected character '", std::string(1, c), "' in a tag"));
        t.type = Tok::Op;
        t.text = op;
        advance(pos + std::strlen(op));
      }
      out.push_back(std::move(t));
    }
  }

  std::vector<Chunk> scan() {
    std::vector<Chunk> chunks;
    bool strip_next = false;  // the previous tag closed with '-': the text's leading whitespace goes
    for (;;) {
      size_t open = src.find('{', pos);
      while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
             src[open + 1] != '#')
        open = src.find('{', open + 1);
      if (open + 1 >= src.size()) open = std::string::npos;
      std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      if (strip_next) {
        size_t a = 0;
        while (a < text.size() && std::isspace((unsigned char)text[a])) ++a;
        text.erase(0, a);
      }
      if (open == std::string::npos) {
        if (!text.empty()) chunks.push_back({ChunkKind::Text, std::move(text), {}, line});
        advance(src.size());
        return chunks;
      }
      const char kind = src[open + 1];
      const char mod = open + 2 < src.size() ? src[open + 2] : '\0';
      if (mod == '-') {
        while (!text.empty() && std::isspace((unsigned char)text.back())) text.pop_back();
      } else if (kind != '{' && mod != '+') {
        // lstrip_blocks: a block or comment tag alone after the line's indentation takes the indentation away.
        size_t b = open;
        while (b > 0 && (src[b - 1] == ' ' || src[b - 1] == '\t')) --b;
        if (b == 0 || src[b - 1] == '\n') {
          const size_t n = std::min(open - b, text.size());
          text.erase(text.size() - n);
        }
      }
      const int text_line = line;
      if (!text.empty()) chunks.push_back({ChunkKind::Text, std::move(text), {}, text_line});
      advance(open + 2 + ((mod == '-' || mod == '+') ? 1 : 0));
      const int tag_line = line;
      bool strip_after = false;
      if (kind == '#') {
        const size_t end = src.find("#}", pos);
        if (end == std::string::npos) fail(tag_line, "a comment opened here is never closed (no \"#}\")");
        strip_after = end > pos && src[end - 1] == '-';
        advance(end + 2);
      } else {
        Chunk c{kind == '{' ? ChunkKind::Output : ChunkKind::Stmt,
                {},
                lex(kind == '{' ? "}}" : "%}", &strip_after, tag_line),
                tag_line};
        if (c.toks.empty()) fail(tag_line, kind == '{' ? "an empty {{ }}" : "an empty {% %}");
        chunks.push_back(std::move(c));
      }
      strip_next = strip_after;
      if (!strip_after && kind != '{' && pos < src.size() && src[pos] == '\n') advance(pos + 1);  // trim_blocks
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The tree.

enum class E { Lit, Name, Attr, Item, Slice, Call, Filter, Test, Not, Neg, Bin, And, Or, Cond, List, Dict };
struct Expr {
  E kind = E::Lit;
  std::string op;  // name, attribute, operator, filter or test
  ojson lit;
  std::vector<Expr> a;
  std::vector<std::string> kw;  // Call/Filter: per argument after the first, its keyword ("" positional)
  bool neg = false;             // Test: `is not`
  int line = 0;
};

enum class S { Text, Out, If, For, Set, Break, Continue };
struct Stmt {
  S kind = S::Text;
  std::string text;         // Text
  std::vector<Expr> exprs;  // Out: [value]; If: conditions; For: [iterable]; Set: [value] (+ [object] for ns.attr)
  std::vector<std::vector<Stmt>> bodies;  // If: one per condition, then else; For: body, else
  std::vector<std::string> names;         // For: loop variables; Set: [name] or [ns, attr]
  int line = 0;
};

}  // namespace

struct Program {
  std::string origin;
  std::vector<Stmt> body;
};

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Parsing.

const std::set<std::string> kFilters = {"trim",  "tojson", "length", "count",   "string", "lower", "upper",
                                        "first", "last",   "join",   "default", "d",      "list",  "items"};
const std::set<std::string> kTests = {"defined", "undefined", "none",  "string",  "number",   "integer", "float",
                                      "boolean", "true",      "false", "mapping", "sequence", "iterable"};

std::string joined(const std::set<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

class Parser {
 public:
  Parser(std::vector<Chunk> chunks, const std::string& origin) : chunks_(std::move(chunks)), origin_(origin) {}

  std::vector<Stmt> parse_all() {
    std::string end;
    std::vector<Stmt> body = parse_body({}, &end);
    return body;
  }

 private:
  std::vector<Chunk> chunks_;
  const std::string& origin_;
  size_t ci_ = 0;  // current chunk
  const std::vector<Token>* t_ = nullptr;
  size_t ti_ = 0;
  int line_ = 0;

  [[noreturn]] void fail(int line, const std::string& msg) const { MT_THROW(origin_, " line ", line, ": ", msg); }

  bool at_end() const { return ti_ >= t_->size(); }
  const Token& peek() const { return (*t_)[ti_]; }
  int cur_line() const { return at_end() ? line_ : peek().line; }
  bool is_op(const char* o) const { return !at_end() && peek().type == Tok::Op && peek().text == o; }
  bool is_name(const char* n) const { return !at_end() && peek().type == Tok::Name && peek().text == n; }
  bool is_name_at(size_t k, const char* n) const {
    return ti_ + k < t_->size() && (*t_)[ti_ + k].type == Tok::Name && (*t_)[ti_ + k].text == n;
  }
  std::string describe() const { return at_end() ? "the end of the tag" : "'" + peek().text + "'"; }
  void expect_op(const char* o) {
    if (!is_op(o)) fail(cur_line(), str("expected '", o, "', found ", describe()));
    ++ti_;
  }
  std::string expect_name() {
    if (at_end() || peek().type != Tok::Name) fail(cur_line(), str("expected a name, found ", describe()));
    return (*t_)[ti_++].text;
  }
  void expect_end(const std::string& what) {
    if (!at_end()) fail(cur_line(), str("unexpected ", describe(), " in ", what));
  }

  // Statements until one of `ends` (its keyword in *end; "" at the template's end, allowed only when ends is
  // empty).
  std::vector<Stmt> parse_body(const std::set<std::string>& ends, std::string* end, int open_line = 0) {
    std::vector<Stmt> body;
    while (ci_ < chunks_.size()) {
      const Chunk& c = chunks_[ci_++];
      if (c.kind == ChunkKind::Text) {
        Stmt s;
        s.kind = S::Text;
        s.text = c.text;
        s.line = c.line;
        body.push_back(std::move(s));
        continue;
      }
      t_ = &c.toks;
      ti_ = 0;
      line_ = c.line;
      if (c.kind == ChunkKind::Output) {
        Stmt s;
        s.kind = S::Out;
        s.line = c.line;
        s.exprs.push_back(parse_expr());
        expect_end("{{ }}");
        body.push_back(std::move(s));
        continue;
      }
      const std::string kw = peek().text;
      if (ends.count(kw)) {
        ++ti_;
        *end = kw;
        return body;
      }
      ++ti_;
      if (kw == "if") {
        body.push_back(parse_if(c.line));
      } else if (kw == "for") {
        body.push_back(parse_for(c.line));
      } else if (kw == "set") {
        body.push_back(parse_set(c.line));
      } else if (kw == "break" || kw == "continue") {
        expect_end("{% " + kw + " %}");
        Stmt s;
        s.kind = kw == "break" ? S::Break : S::Continue;
        s.line = c.line;
        body.push_back(std::move(s));
      } else if (kw == "generation") {  // transformers' assistant-mask marker: the body as is
        expect_end("{% generation %}");
        std::string e;
        std::vector<Stmt> inner = parse_body({"endgeneration"}, &e, c.line);
        expect_end("{% endgeneration %}");
        for (Stmt& s : inner) body.push_back(std::move(s));
      } else if (kw == "elif" || kw == "else" || kw.rfind("end", 0) == 0) {
        fail(c.line, str("{% ", kw, " %} without a matching opening tag"));
      } else {
        fail(c.line, str("{% ", kw,
                         " %} is not supported by this Jinja subset (supported statements: if, for, set, "
                         "break, continue, generation)"));
      }
    }
    if (!ends.empty()) {
      std::string want;
      for (const std::string& e : ends) want += (want.empty() ? "" : " or ") + ("{% " + e + " %}");
      fail(open_line, str("the block opened here is never closed: expected ", want, " before the end of the template"));
    }
    *end = "";
    return body;
  }

  Stmt parse_if(int line) {
    Stmt s;
    s.kind = S::If;
    s.line = line;
    s.exprs.push_back(parse_expr());
    expect_end("{% if %}");
    for (;;) {
      std::string end;
      s.bodies.push_back(parse_body({"elif", "else", "endif"}, &end, line));
      if (end == "elif") {
        s.exprs.push_back(parse_expr());
        expect_end("{% elif %}");
      } else if (end == "else") {
        expect_end("{% else %}");
        std::string e2;
        s.bodies.push_back(parse_body({"endif"}, &e2, line));
        expect_end("{% endif %}");
        return s;
      } else {
        expect_end("{% endif %}");
        return s;
      }
    }
  }

  Stmt parse_for(int line) {
    Stmt s;
    s.kind = S::For;
    s.line = line;
    s.names.push_back(expect_name());
    while (is_op(",")) {
      ++ti_;
      s.names.push_back(expect_name());
    }
    if (!is_name("in")) fail(cur_line(), str("expected 'in' in {% for %}, found ", describe()));
    ++ti_;
    s.exprs.push_back(parse_or());  // as Jinja: no `x if c` here, the `if` would be a loop filter
    if (is_name("if"))
      fail(cur_line(), "a loop filter ({% for x in xs if cond %}) is not supported by this Jinja subset");
    if (is_name("recursive")) fail(cur_line(), "recursive loops are not supported by this Jinja subset");
    expect_end("{% for %}");
    std::string end;
    s.bodies.push_back(parse_body({"else", "endfor"}, &end, line));
    if (end == "else") {
      expect_end("{% else %}");
      std::string e2;
      s.bodies.push_back(parse_body({"endfor"}, &e2, line));
    } else {
      s.bodies.emplace_back();
    }
    expect_end("{% endfor %}");
    return s;
  }

  Stmt parse_set(int line) {
    Stmt s;
    s.kind = S::Set;
    s.line = line;
    s.names.push_back(expect_name());
    if (is_op(".")) {
      ++ti_;
      s.names.push_back(expect_name());
    }
    if (!is_op("=")) fail(cur_line(), "a block {% set x %}...{% endset %} is not supported by this Jinja subset");
    ++ti_;
    s.exprs.push_back(parse_expr());
    expect_end("{% set %}");
    return s;
  }

  // Expressions, lowest precedence first (Jinja's order).
  Expr make(E k, int line, std::string op = {}) {
    Expr e;
    e.kind = k;
    e.line = line;
    e.op = std::move(op);
    return e;
  }

  Expr parse_expr() {
    Expr x = parse_or();
    if (is_name("if")) {
      const int line = cur_line();
      ++ti_;
      Expr c = make(E::Cond, line);
      Expr cond = parse_or();
      Expr other = make(E::Lit, line);  // no else: Jinja's undefined (a literal marked so)
      other.op = "undefined";
      if (is_name("else")) {
        ++ti_;
        other = parse_expr();
      }
      c.a = {std::move(cond), std::move(x), std::move(other)};
      return c;
    }
    return x;
  }

  Expr parse_or() {
    Expr x = parse_and();
    while (is_name("or")) {
      Expr e = make(E::Or, cur_line());
      ++ti_;
      e.a = {std::move(x), parse_and()};
      x = std::move(e);
    }
    return x;
  }
  Expr parse_and() {
    Expr x = parse_not();
    while (is_name("and")) {
      Expr e = make(E::And, cur_line());
      ++ti_;
      e.a = {std::move(x), parse_not()};
      x = std::move(e);
    }
    return x;
  }
  Expr parse_not() {
    if (is_name("not")) {
      Expr e = make(E::Not, cur_line());
      ++ti_;
      e.a = {parse_not()};
      return e;
    }
    return parse_compare();
  }
  Expr parse_compare() {
    Expr x = parse_math1();
    for (;;) {
      std::string op;
      const int line = cur_line();
      if (!at_end() && peek().type == Tok::Op &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
           peek().text == ">" || peek().text == ">=")) {
        op = peek().text;
        ++ti_;
      } else if (is_name("in")) {
        op = "in";
        ++ti_;
      } else if (is_name("not") && is_name_at(1, "in")) {
        op = "not in";
        ti_ += 2;
      } else {
        return x;
      }
      Expr e = make(E::Bin, line, op);
      e.a = {std::move(x), parse_math1()};
      x = std::move(e);
    }
  }
  Expr parse_math1() {
    Expr x = parse_concat();
    while (is_op("+") || is_op("-")) {
      Expr e = make(E::Bin, cur_line(), peek().text);
      ++ti_;
      e.a = {std::move(x), parse_concat()};
      x = std::move(e);
    }
    return x;
  }
  Expr parse_concat() {
    Expr x = parse_math2();
    while (is_op("~")) {
      Expr e = make(E::Bin, cur_line(), "~");
      ++ti_;
      e.a = {std::move(x), parse_math2()};
      x = std::move(e);
    }
    return x;
  }
  Expr parse_math2() {
    Expr x = parse_unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Expr e = make(E::Bin, cur_line(), peek().text);
      ++ti_;
      e.a = {std::move(x), parse_unary()};
      x = std::move(e);
    }
    return x;
  }
  Expr parse_unary() {
    if (is_op("-")) {
      Expr e = make(E::Neg, cur_line());
      ++ti_;
      e.a = {parse_unary()};
      return e;
    }
    if (is_op("+")) {
      ++ti_;
      return parse_unary();
    }
    if (is_op("**")) fail(cur_line(), "the operator '**' is not supported by this Jinja subset");
    return parse_filters(parse_postfix(parse_primary()));
  }

  Expr parse_primary() {
    if (at_end()) fail(line_, "expected an expression, found the end of the tag");
    const Token& t = peek();
    const int line = t.line;
    if (t.type == Tok::Str) {
      Expr e = make(E::Lit, line);
      e.lit = t.text;
      ++ti_;
      while (!at_end() && peek().type == Tok::Str) e.lit = e.lit.get<std::string>() + (*t_)[ti_++].text;  // "a" "b"
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      Expr e = make(E::Lit, line);
      if (t.type == Tok::Int)
        e.lit = t.i;
      else
        e.lit = t.f;
      ++ti_;
      return e;
    }
    if (t.type == Tok::Name) {
      ++ti_;
      Expr e = make(E::Lit, line);
      if (t.text == "true" || t.text == "True") {
        e.lit = true;
      } else if (t.text == "false" || t.text == "False") {
        e.lit = false;
      } else if (t.text == "none" || t.text == "None") {
        e.lit = nullptr;
      } else {
        e.kind = E::Name;
        e.op = t.text;
      }
      return e;
    }
    if (is_op("(")) {
      ++ti_;
      Expr x = parse_expr();
      if (is_op(",")) fail(cur_line(), "tuples are not supported by this Jinja subset");
      expect_op(")");
      return x;
    }
    if (is_op("[")) {
      ++ti_;
      Expr e = make(E::List, line);
      while (!is_op("]")) {
        e.a.push_back(parse_expr());
        if (!is_op(",")) break;
        ++ti_;
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      ++ti_;
      Expr e = make(E::Dict, line);
      while (!is_op("}")) {
        e.a.push_back(parse_expr());
        expect_op(":");
        e.a.push_back(parse_expr());
        if (!is_op(",")) break;
        ++ti_;
      }
      expect_op("}");
      return e;
    }
    fail(line, str("unexpected ", describe(), " where an expression was expected"));
  }

  // Call arguments after '(' up to ')': into e.a (after what is there) with their keywords in e.kw.
  void parse_args(Expr& e) {
    while (!is_op(")")) {
      std::string key;
      if (!at_end() && peek().type == Tok::Name && ti_ + 1 < t_->size() && (*t_)[ti_ + 1].type == Tok::Op &&
          (*t_)[ti_ + 1].text == "=") {
        key = peek().text;
        ti_ += 2;
      }
      e.a.push_back(parse_expr());
      e.kw.push_back(key);
      if (!is_op(",")) break;
      ++ti_;
    }
    expect_op(")");
  }

  Expr parse_postfix(Expr x) {
    for (;;) {
      const int line = cur_line();
      if (is_op(".")) {
        ++ti_;
        Expr e = make(E::Attr, line, expect_name());
        e.a = {std::move(x)};
        x = std::move(e);
      } else if (is_op("[")) {
        ++ti_;
        Expr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          parts[k] = make(E::Lit, line);  // null: the default
          if (!is_op(":") && !is_op("]")) parts[k] = parse_expr();
          if (k < 2 && is_op(":")) {
            slice = true;
            ++ti_;
          } else {
            break;
          }
        }
        expect_op("]");
        Expr e = make(slice ? E::Slice : E::Item, line);
        e.a = {std::move(x), std::move(parts[0])};
        if (slice) {
          e.a.push_back(std::move(parts[1]));
          e.a.push_back(std::move(parts[2]));
        }
        x = std::move(e);
      } else if (is_op("(")) {
        ++ti_;
        Expr e = make(E::Call, line);
        e.a = {std::move(x)};
        e.kw = {""};
        parse_args(e);
        x = std::move(e);
      } else {
        return x;
      }
    }
  }

  Expr parse_filters(Expr x) {
    for (;;) {
      const int line = cur_line();
      if (is_op("|")) {
        ++ti_;
        Expr e = make(E::Filter, line, expect_name());
        if (!kFilters.count(e.op))
          fail(line, str("the filter '", e.op, "' is not supported by this Jinja subset (supported: ", joined(kFilters),
                         ")"));
        e.a = {std::move(x)};
        e.kw = {""};
        if (is_op("(")) {
          ++ti_;
          parse_args(e);
        }
        x = parse_postfix(std::move(e));
      } else if (is_name("is")) {
        ++ti_;
        Expr e = make(E::Test, line);
        if (is_name("not")) {
          e.neg = true;
          ++ti_;
        }
        // `is none`, `is true`, ... are names here, not literals.
        if (at_end() || peek().type != Tok::Name)
          fail(cur_line(), str("expected a test name after 'is', found ", describe()));
        e.op = (*t_)[ti_++].text;
        if (!kTests.count(e.op))
          fail(line,
               str("the test 'is ", e.op, "' is not supported by this Jinja subset (supported: ", joined(kTests), ")"));
        e.a = {std::move(x)};
        if (is_op("("))
          fail(cur_line(), str("tests with arguments ('is ", e.op,
                               "(...)') are not supported by this "
                               "Jinja subset"));
        x = std::move(e);
      } else {
        return x;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Evaluation.

// A value: JSON data, Jinja's undefined (with what it stood for), a namespace (shared and mutable), or a callable
// global (namespace, raise_exception). JSON data is not copied when looked into: a value points at its data and
// holds the value it came from alive (`owner`; none for the render context, which outlives the evaluation), so
// `messages[i].content` costs no copy of the messages.
struct Value {
  enum class K { Json, Undefined, Namespace, Function };
  K k = K::Json;
  std::shared_ptr<const ojson> owner;
  const ojson* ref = nullptr;
  std::shared_ptr<ojson> ns;
  std::string name;  // Undefined: what was looked up; Function: its name

  const ojson& j() const { return *ref; }
  static Value of(ojson v) {
    Value x;
    x.owner = std::make_shared<const ojson>(std::move(v));
    x.ref = x.owner.get();
    return x;
  }
  // Data inside `parent`'s (or the context's, parent null).
  static Value inside(const Value* parent, const ojson& data) {
    Value x;
    if (parent) x.owner = parent->owner;
    x.ref = &data;
    return x;
  }
  static Value undefined(std::string what) {
    Value x;
    x.k = K::Undefined;
    x.name = std::move(what);
    return x;
  }
  bool is_undefined() const { return k == K::Undefined; }
};

std::string type_name(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined:
      return "undefined (" + v.name + ")";
    case Value::K::Namespace:
      return "namespace";
    case Value::K::Function:
      return "function " + v.name;
    default:
      break;
  }
  if (v.j().is_string()) return "string";
  if (v.j().is_number_integer()) return "integer";
  if (v.j().is_number_float()) return "float";
  if (v.j().is_boolean()) return "boolean";
  if (v.j().is_null()) return "none";
  if (v.j().is_array()) return "list";
  return "dict";
}

bool truthy(const Value& v) {
  if (v.k == Value::K::Undefined) return false;
  if (v.k != Value::K::Json) return true;
  const ojson& j = v.j();
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  if (j.is_array() || j.is_object()) return !j.empty();
  if (j.is_number_integer()) return j.get<int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0;
  return true;
}

std::string float_repr(double d) {  // Python's repr: the shortest text that reads back, with a '.0' when integral
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[32];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// Python's str() of a value, which {{ }} and ~ print: strings as they are, None/True/False, lists and dicts as
// Python's repr.
std::string py_repr(const ojson& j);
std::string py_str(const ojson& j) {
  if (j.is_string()) return j.get<std::string>();
  return py_repr(j);
}
std::string py_repr(const ojson& j) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_integer()) return j.dump();
  if (j.is_number_float()) return float_repr(j.get<double>());
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, q);
    for (char c : s) {
      if (c == q || c == '\\')
        out += '\\', out += c;
      else if (c == '\n')
        out += "\\n";
      else if (c == '\t')
        out += "\\t";
      else if (c == '\r')
        out += "\\r";
      else
        out += c;
    }
    return out + q;
  }
  std::string out;
  if (j.is_array()) {
    out = "[";
    for (size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + py_repr(j[i]);
    return out + "]";
  }
  out = "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    out += (first ? "" : ", ") + py_repr(ojson(it.key())) + ": " + py_repr(it.value());
    first = false;
  }
  return out + "}";
}

struct LoopSignal {
  bool brk = false, cont = false;
};

class Evaluator {
 public:
  Evaluator(const Program& p, const ojson& context) : p_(p) {
    if (!context.is_object()) MT_THROW(p.origin, ": the render context must be an object, got ", context.type_name());
    scopes_.emplace_back();
    for (auto it = context.begin(); it != context.end(); ++it)
      scopes_.back()[it.key()] = Value::inside(nullptr, it.value());
    for (const char* f : {"namespace", "raise_exception"}) {
      if (scopes_.back().count(f)) continue;
      Value v;
      v.k = Value::K::Function;
      v.name = f;
      scopes_.back()[f] = v;
    }
  }

  std::string run() {
    LoopSignal sig;
    exec(p_.body, sig);
    return std::move(out_);
  }

 private:
  const Program& p_;
  std::vector<std::map<std::string, Value>> scopes_;
  std::string out_;

  [[noreturn]] void fail(int line, const std::string& msg) const { MT_THROW(p_.origin, " line ", line, ": ", msg); }

  const ojson& json_of(const Value& v, int line, const char* use) const {
    if (v.k == Value::K::Json) return v.j();
    if (v.k == Value::K::Namespace) return *v.ns;
    fail(line, str("cannot use ", type_name(v), " ", use));
  }

  std::string to_text(const Value& v, int line) const {
    if (v.is_undefined()) return "";
    if (v.k == Value::K::Namespace) return "<Namespace " + py_repr(*v.ns) + ">";
    if (v.k == Value::K::Function) fail(line, str("cannot print ", type_name(v)));
    return py_str(v.j());
  }

  Value lookup(const std::string& name) const {
    for (size_t k = scopes_.size(); k-- > 0;) {
      auto it = scopes_[k].find(name);
      if (it != scopes_[k].end()) return it->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  void exec(const std::vector<Stmt>& body, LoopSignal& sig) {
    for (const Stmt& s : body) {
      if (sig.brk || sig.cont) return;
      switch (s.kind) {
        case S::Text:
          out_ += s.text;
          break;
        case S::Out:
          out_ += to_text(eval(s.exprs[0]), s.line);
          break;
        case S::If: {
          size_t k = 0;
          for (; k < s.exprs.size(); ++k)
            if (truthy(eval(s.exprs[k]))) break;
          if (k < s.bodies.size()) exec(s.bodies[k], sig);
          break;
        }
        case S::For:
          exec_for(s, sig);
          break;
        case S::Set: {
          Value v = eval(s.exprs[0]);
          if (s.names.size() == 1) {
            scopes_.back()[s.names[0]] = std::move(v);
          } else {
            const Value target = lookup(s.names[0]);
            if (target.k != Value::K::Namespace)
              fail(s.line, str("{% set ", s.names[0], ".", s.names[1], " %}: '", s.names[0], "' is ", type_name(target),
                               ", not a namespace() (only a namespace's attributes can be set)"));
            (*target.ns)[s.names[1]] = json_of(v, s.line, "as a namespace attribute");
          }
          break;
        }
        case S::Break:
          sig.brk = true;
          return;
        case S::Continue:
          sig.cont = true;
          return;
      }
    }
  }

  void exec_for(const Stmt& s, LoopSignal& outer) {
    const Value seq = eval(s.exprs[0]);
    if (seq.k != Value::K::Json)
      fail(s.line, str("{% for %} over ", type_name(seq), " (a list, a dict or a string is needed)"));
    const ojson& j = json_of(seq, s.line, "in {% for %}");
    std::vector<Value> items;
    if (j.is_array()) {
      for (const ojson& x : j) items.push_back(Value::inside(&seq, x));
    } else if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) items.push_back(Value::of(it.key()));
    } else if (j.is_string()) {
      // Python iterates a string's characters: here its UTF-8 sequences.
      const std::string& t = j.get_ref<const std::string&>();
      for (size_t i = 0; i < t.size();) {
        size_t n = 1;
        const unsigned char c = (unsigned char)t[i];
        if (c >= 0xF0)
          n = 4;
        else if (c >= 0xE0)
          n = 3;
        else if (c >= 0xC0)
          n = 2;
        items.push_back(Value::of(t.substr(i, n)));
        i += n;
      }
    } else {
      fail(s.line, str("{% for %} over ", type_name(seq), " (a list, a dict or a string is needed)"));
    }
    if (items.empty()) {
      exec(s.bodies[1], outer);
      return;
    }
    const int64_t n = int64_t(items.size());
    for (int64_t i = 0; i < n; ++i) {
      scopes_.emplace_back();
      auto& scope = scopes_.back();
      ojson loop = ojson::object();
      loop["index0"] = i;
      loop["index"] = i + 1;
      loop["revindex0"] = n - 1 - i;
      loop["revindex"] = n - i;
      loop["first"] = i == 0;
      loop["last"] = i == n - 1;
      loop["length"] = n;
      if (i > 0) loop["previtem"] = items[size_t(i - 1)].j();  // absent (undefined) at the ends, as in Jinja
      if (i + 1 < n) loop["nextitem"] = items[size_t(i + 1)].j();
      scope["loop"] = Value::of(std::move(loop));
      const Value& item = items[size_t(i)];
      if (s.names.size() == 1) {
        scope[s.names[0]] = item;
      } else {
        if (!item.j().is_array() || item.j().size() != s.names.size())
          fail(s.line, str("{% for %} unpacks ", s.names.size(), " names from ", py_repr(item.j()).substr(0, 80)));
        for (size_t k = 0; k < s.names.size(); ++k) scope[s.names[k]] = Value::inside(&item, item.j()[k]);
      }
      LoopSignal sig;
      exec(s.bodies[0], sig);
      scopes_.pop_back();
      if (sig.brk) break;
    }
  }

  // ----- expressions

  Value eval(const Expr& e) {
    switch (e.kind) {
      case E::Lit:
        if (e.op == "undefined") return Value::undefined("an 'if' expression without 'else'");
        return Value::of(e.lit);
      case E::Name:
        return lookup(e.op);
      case E::Attr:
        return attr(eval(e.a[0]), e.op, e.line);
      case E::Item:
        return item(eval(e.a[0]), eval(e.a[1]), e.line);
      case E::Slice:
        return slice(e);
      case E::Call:
        return call(e);
      case E::Filter:
        return filter(e);
      case E::Test: {
        const bool r = test(e.op, eval(e.a[0]), e.line);
        return Value::of(e.neg ? !r : r);
      }
      case E::Not:
        return Value::of(!truthy(eval(e.a[0])));
      case E::Neg: {
        const Value v = eval(e.a[0]);
        const ojson& j = json_of(v, e.line, "with unary '-'");
        if (j.is_number_integer()) return Value::of(-j.get<int64_t>());
        if (j.is_number()) return Value::of(-j.get<double>());
        fail(e.line, str("unary '-' on ", type_name(v)));
      }
      case E::And: {
        Value l = eval(e.a[0]);
        return truthy(l) ? eval(e.a[1]) : l;
      }
      case E::Or: {
        Value l = eval(e.a[0]);
        return truthy(l) ? l : eval(e.a[1]);
      }
      case E::Cond:
        return truthy(eval(e.a[0])) ? eval(e.a[1]) : eval(e.a[2]);
      case E::List: {
        ojson l = ojson::array();
        for (const Expr& x : e.a) l.push_back(json_of(eval(x), x.line, "in a list"));
        return Value::of(std::move(l));
      }
      case E::Dict: {
        ojson d = ojson::object();
        for (size_t k = 0; k + 1 < e.a.size(); k += 2) {
          const Value key = eval(e.a[k]);
          if (key.k != Value::K::Json || !key.j().is_string())
            fail(e.a[k].line, str("a dict key must be a string here, got ", type_name(key)));
          d[key.j().get<std::string>()] = json_of(eval(e.a[k + 1]), e.a[k + 1].line, "in a dict");
        }
        return Value::of(std::move(d));
      }
      case E::Bin:
        return binary(e);
    }
    fail(e.line, "unknown expression");
  }

  Value attr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) fail(line, str("'.", name, "' on ", type_name(obj)));
    if (obj.k == Value::K::Namespace) {
      auto it = obj.ns->find(name);
      return it == obj.ns->end() ? Value::undefined("namespace has no attribute '" + name + "'") : Value::of(*it);
    }
    const ojson& j = json_of(obj, line, "with '.'");
    if (j.is_object()) {
      auto it = j.find(name);
      if (it != j.end()) return Value::inside(&obj, *it);
    }
    return Value::undefined(str(type_name(obj), " has no attribute '", name, "'"));
  }

  static int64_t norm_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

  Value item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) fail(line, str("'[...]' on ", type_name(obj)));
    if (obj.k == Value::K::Namespace) return attr(obj, json_of(key, line, "as a key").get<std::string>(), line);
    const ojson& j = json_of(obj, line, "with '[...]'");
    const ojson& k = json_of(key, line, "as an index");
    if (j.is_object()) {
      if (!k.is_string()) fail(line, str("a dict index must be a string, got ", type_name(key)));
      auto it = j.find(k.get<std::string>());
      return it == j.end() ? Value::undefined("dict has no key " + py_repr(k)) : Value::inside(&obj, *it);
    }
    if (j.is_array() || j.is_string()) {
      if (!k.is_number_integer())
        fail(line, str("a ", type_name(obj), " index must be an integer, got ", type_name(key)));
      const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get_ref<const std::string&>().size());
      const int64_t i = norm_index(k.get<int64_t>(), n);
      if (i < 0 || i >= n) return Value::undefined(str(type_name(obj), " has no index ", k.get<int64_t>()));
      return j.is_array() ? Value::inside(&obj, j[size_t(i)])
                          : Value::of(std::string(1, j.get_ref<const std::string&>()[size_t(i)]));
    }
    fail(line, str("cannot index ", type_name(obj)));
  }

  Value slice(const Expr& e) {
    const Value obj = eval(e.a[0]);
    const ojson& j = json_of(obj, e.line, "with a slice");
    if (!j.is_array() && !j.is_string()) fail(e.line, str("cannot slice ", type_name(obj)));
    int64_t bound[3];
    bool given[3];
    for (int k = 0; k < 3; ++k) {
      const Value v = eval(e.a[size_t(k) + 1]);
      given[k] = !(v.k == Value::K::Json && v.j().is_null());
      if (given[k]) {
        if (v.k != Value::K::Json || !v.j().is_number_integer())
          fail(e.line, str("a slice bound must be an integer, got ", type_name(v)));
        bound[k] = v.j().get<int64_t>();
      }
    }
    const int64_t n = j.is_array() ? int64_t(j.size()) : int64_t(j.get_ref<const std::string&>().size());
    const int64_t step = given[2] ? bound[2] : 1;
    if (step == 0) fail(e.line, "slice step cannot be zero");
    auto clampi = [&](int64_t v, bool is_given, int64_t def) {
      if (!is_given) return def;
      if (v < 0) v += n;
      if (step > 0) return std::clamp<int64_t>(v, 0, n);
      return std::clamp<int64_t>(v, -1, n - 1);
    };
    const int64_t start = clampi(bound[0], given[0], step > 0 ? 0 : n - 1);
    const int64_t stop = clampi(bound[1], given[1], step > 0 ? n : -1);
    std::vector<int64_t> idx;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) idx.push_back(i);
    if (j.is_array()) {
      ojson out = ojson::array();
      for (int64_t i : idx) out.push_back(j[size_t(i)]);
      return Value::of(std::move(out));
    }
    std::string out;
    for (int64_t i : idx) out += j.get_ref<const std::string&>()[size_t(i)];
    return Value::of(out);
  }

  std::vector<Value> args_of(const Expr& e, size_t from, std::map<std::string, Value>* kwargs) {
    std::vector<Value> pos;
    for (size_t k = from; k < e.a.size(); ++k) {
      Value v = eval(e.a[k]);
      if (!e.kw[k].empty()) {
        if (!kwargs) fail(e.line, str("keyword argument '", e.kw[k], "' is not supported here"));
        (*kwargs)[e.kw[k]] = std::move(v);
      } else {
        pos.push_back(std::move(v));
      }
    }
    return pos;
  }

  std::string str_arg(const std::vector<Value>& a, size_t k, const std::string& what, int line) {
    if (k >= a.size() || a[k].k != Value::K::Json || !a[k].j().is_string())
      fail(line, str(what, " needs a string argument", k < a.size() ? ", got " + type_name(a[k]) : std::string()));
    return a[k].j().get<std::string>();
  }

  static std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
    auto in = [&](char c) { return chars.find(c) != std::string::npos; };
    size_t a = 0, b = s.size();
    if (left)
      while (a < b && in(s[a])) ++a;
    if (right)
      while (b > a && in(s[b - 1])) --b;
    return s.substr(a, b - a);
  }

  Value call(const Expr& e) {
    const Expr& callee = e.a[0];
    if (callee.kind == E::Attr) {  // a method of a string or a dict
      const Value obj = eval(callee.a[0]);
      const std::string& m = callee.op;
      std::vector<Value> a = args_of(e, 1, nullptr);
      if (obj.k == Value::K::Json && obj.j().is_string()) {
        const std::string& s = obj.j().get_ref<const std::string&>();
        if (m == "startswith" || m == "endswith") {
          const std::string x = str_arg(a, 0, m, e.line);
          return Value::of(m == "startswith" ? s.starts_with(x) : s.ends_with(x));
        }
        if (m == "strip" || m == "lstrip" || m == "rstrip") {
          const std::string chars = a.empty() || (a[0].k == Value::K::Json && a[0].j().is_null())
                                        ? std::string(" \t\n\r\f\v")
                                        : str_arg(a, 0, m, e.line);
          return Value::of(strip_chars(s, chars, m != "rstrip", m != "lstrip"));
        }
        if (m == "split") {
          ojson out = ojson::array();
          if (a.empty()) {  // Python's split(): runs of whitespace, no empty parts
            size_t i = 0;
            while (i < s.size()) {
              while (i < s.size() && std::isspace((unsigned char)s[i])) ++i;
              size_t k = i;
              while (k < s.size() && !std::isspace((unsigned char)s[k])) ++k;
              if (k > i) out.push_back(s.substr(i, k - i));
              i = k;
            }
            return Value::of(std::move(out));
          }
          const std::string sep = str_arg(a, 0, m, e.line);
          if (sep.empty()) fail(e.line, "split(): empty separator");
          size_t i = 0;
          for (size_t at; (at = s.find(sep, i)) != std::string::npos; i = at + sep.size())
            out.push_back(s.substr(i, at - i));
          out.push_back(s.substr(i));
          return Value::of(std::move(out));
        }
        if (m == "upper" || m == "lower") {
          std::string r = s;
          for (char& c : r) c = char(m == "upper" ? std::toupper((unsigned char)c) : std::tolower((unsigned char)c));
          return Value::of(r);
        }
        if (m == "replace") {
          const std::string from = str_arg(a, 0, m, e.line), to = str_arg(a, 1, m, e.line);
          if (from.empty()) fail(e.line, "replace(): empty search string");
          std::string r;
          size_t i = 0;
          for (size_t at; (at = s.find(from, i)) != std::string::npos; i = at + from.size())
            r += s.substr(i, at - i) + to;
          return Value::of(r + s.substr(i));
        }
        fail(e.line, str("the string method '", m,
                         "' is not supported by this Jinja subset (supported: startswith, "
                         "endswith, strip, lstrip, rstrip, split, upper, lower, replace)"));
      }
      if (obj.k == Value::K::Json && obj.j().is_object()) {
        const ojson& d = obj.j();
        if (m == "items" || m == "keys" || m == "values") {
          ojson out = ojson::array();
          for (auto it = d.begin(); it != d.end(); ++it)
            out.push_back(m == "items"  ? ojson::array({it.key(), it.value()})
                          : m == "keys" ? ojson(it.key())
                                        : it.value());
          return Value::of(std::move(out));
        }
        if (m == "get") {
          const std::string k = str_arg(a, 0, m, e.line);
          auto it = d.find(k);
          if (it != d.end()) return Value::inside(&obj, *it);
          return a.size() > 1 ? a[1] : Value::of(nullptr);
        }
        if (!d.contains(m))
          fail(e.line, str("the dict method '", m,
                           "' is not supported by this Jinja subset (supported: items, keys, "
                           "values, get)"));
      }
      if (obj.is_undefined()) fail(e.line, str("'.", m, "(...)' on ", type_name(obj)));
      fail(e.line, str("cannot call '", m, "' on ", type_name(obj)));
    }
    const Value f = eval(callee);
    if (f.k != Value::K::Function) fail(e.line, str("cannot call ", type_name(f)));
    std::map<std::string, Value> kwargs;
    std::vector<Value> a = args_of(e, 1, &kwargs);
    if (f.name == "raise_exception") {
      fail(e.line, str("the template raised an error: ", a.empty() ? std::string() : to_text(a[0], e.line)));
    }
    // namespace(...): a mutable object its keyword arguments start.
    if (!a.empty()) fail(e.line, "namespace() takes keyword arguments only");
    Value ns;
    ns.k = Value::K::Namespace;
    ns.ns = std::make_shared<ojson>(ojson::object());
    for (auto& [k, v] : kwargs) (*ns.ns)[k] = json_of(v, e.line, "in namespace()");
    return ns;
  }

  Value filter(const Expr& e) {
    const Value v = eval(e.a[0]);
    const std::string& f = e.op;
    std::map<std::string, Value> kwargs;
    std::vector<Value> a = args_of(e, 1, &kwargs);
    if (f == "default" || f == "d") {
      if (!v.is_undefined() && !(a.size() > 1 && truthy(a[1]) && !truthy(v))) return v;
      return a.empty() ? Value::of("") : a[0];
    }
    if (f == "string") return Value::of(to_text(v, e.line));
    if (v.is_undefined() && f != "length" && f != "count") fail(e.line, str("the filter '", f, "' on ", type_name(v)));
    const ojson& j = v.is_undefined() ? ojson() : json_of(v, e.line, str("with the filter '", f, "'").c_str());
    if (f == "tojson") {
      if (!a.empty() || !kwargs.empty()) {
        auto it = kwargs.find("indent");
        if (it != kwargs.end() || !a.empty())
          fail(e.line, "tojson with an indent is not supported by this Jinja subset (only tojson without arguments)");
      }
      return Value::of(python_json_dumps(j));
    }
    if (f == "length" || f == "count") {
      if (v.is_undefined()) return Value::of(0);
      if (j.is_string()) {
        int64_t n = 0;
        for (unsigned char c : j.get_ref<const std::string&>()) n += (c & 0xC0) != 0x80;
        return Value::of(n);
      }
      if (j.is_array() || j.is_object()) return Value::of(int64_t(j.size()));
      fail(e.line, str("the filter 'length' on ", type_name(v)));
    }
    if (f == "trim") {
      if (!j.is_string()) fail(e.line, str("the filter 'trim' on ", type_name(v), " (a string is needed)"));
      return Value::of(strip_chars(j.get<std::string>(), " \t\n\r\f\v", true, true));
    }
    if (f == "lower" || f == "upper") {
      std::string r = py_str(j);
      for (char& c : r) c = char(f == "upper" ? std::toupper((unsigned char)c) : std::tolower((unsigned char)c));
      return Value::of(r);
    }
    if (f == "first" || f == "last") {
      if (!j.is_array()) fail(e.line, str("the filter '", f, "' on ", type_name(v), " (a list is needed)"));
      if (j.empty()) return Value::undefined("'" + f + "' of an empty list");
      return Value::of(f == "first" ? j.front() : j.back());
    }
    if (f == "join") {
      if (!j.is_array()) fail(e.line, str("the filter 'join' on ", type_name(v), " (a list is needed)"));
      const std::string sep = a.empty() ? std::string() : str_arg(a, 0, "join", e.line);
      std::string r;
      for (size_t i = 0; i < j.size(); ++i) r += (i ? sep : "") + py_str(j[i]);
      return Value::of(r);
    }
    if (f == "list") {
      if (j.is_array()) return v;
      fail(e.line, str("the filter 'list' on ", type_name(v)));
    }
    if (f == "items") {
      if (!j.is_object()) fail(e.line, str("the filter 'items' on ", type_name(v), " (a dict is needed)"));
      ojson out = ojson::array();
      for (auto it = j.begin(); it != j.end(); ++it) out.push_back(ojson::array({it.key(), it.value()}));
      return Value::of(std::move(out));
    }
    fail(e.line, str("the filter '", f,
                     "' is not supported by this Jinja subset (supported: trim, tojson, length, "
                     "count, string, lower, upper, first, last, join, default, list, items)"));
  }

  bool test(const std::string& t, const Value& v, int line) {
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    const bool js = v.k == Value::K::Json;
    if (t == "none") return js && v.j().is_null();
    if (t == "string") return js && v.j().is_string();
    if (t == "number") return js && v.j().is_number();
    if (t == "integer") return js && v.j().is_number_integer();
    if (t == "float") return js && v.j().is_number_float();
    if (t == "boolean") return js && v.j().is_boolean();
    if (t == "true") return js && v.j().is_boolean() && v.j().get<bool>();
    if (t == "false") return js && v.j().is_boolean() && !v.j().get<bool>();
    if (t == "mapping") return (js && v.j().is_object()) || v.k == Value::K::Namespace;
    if (t == "sequence" || t == "iterable") return js && (v.j().is_array() || v.j().is_string() || v.j().is_object());
    fail(line, str("the test 'is ", t,
                   "' is not supported by this Jinja subset (supported: defined, undefined, none, "
                   "string, number, integer, float, boolean, true, false, mapping, sequence, iterable)"));
  }

  static bool contains(const ojson& hay, const ojson& needle) {
    if (hay.is_string())
      return needle.is_string() &&
             hay.get_ref<const std::string&>().find(needle.get<std::string>()) != std::string::npos;
    if (hay.is_array()) {
      for (const ojson& x : hay)
        if (x == needle) return true;
      return false;
    }
    if (hay.is_object()) return needle.is_string() && hay.contains(needle.get<std::string>());
    return false;
  }

  Value binary(const Expr& e) {
    const std::string& op = e.op;
    const Value l = eval(e.a[0]), r = eval(e.a[1]);
    if (op == "==" || op == "!=") {
      bool eq;
      if (l.is_undefined() || r.is_undefined())
        eq = l.is_undefined() && r.is_undefined();
      else if (l.k != Value::K::Json || r.k != Value::K::Json)
        eq = false;
      else
        eq = l.j() == r.j();
      return Value::of(op == "==" ? eq : !eq);
    }
    if (op == "~") return Value::of(to_text(l, e.line) + to_text(r, e.line));
    if (op == "in" || op == "not in") {
      if (r.is_undefined()) fail(e.line, str("'", op, "' with ", type_name(r)));
      const bool c = l.is_undefined() ? false
                                      : contains(json_of(r, e.line, str("with '", op, "'").c_str()),
                                                 json_of(l, e.line, "with 'in'"));
      if (r.k == Value::K::Json && !(r.j().is_string() || r.j().is_array() || r.j().is_object()))
        fail(e.line, str("'", op, "' needs a string, a list or a dict on its right, got ", type_name(r)));
      return Value::of(op == "in" ? c : !c);
    }
    if (l.is_undefined() || r.is_undefined())
      fail(e.line, str("'", op, "' with ", type_name(l.is_undefined() ? l : r)));
    const ojson& a = json_of(l, e.line, str("with '", op, "'").c_str());
    const ojson& b = json_of(r, e.line, str("with '", op, "'").c_str());
    auto mismatch = [&]() -> Value { fail(e.line, str("'", op, "' between ", type_name(l), " and ", type_name(r))); };
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int c;
      if (a.is_number() && b.is_number()) {
        const double x = a.get<double>(), y = b.get<double>();
        c = x < y ? -1 : x > y ? 1 : 0;
      } else if (a.is_string() && b.is_string()) {
        c = a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
      } else {
        return mismatch();
      }
      return Value::of(op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0);
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::of(a.get<std::string>() + b.get<std::string>());
      if (a.is_array() && b.is_array()) {
        ojson out = a;
        for (const ojson& x : b) out.push_back(x);
        return Value::of(std::move(out));
      }
    }
    const bool nums = (a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean());
    if (!nums) return mismatch();
    const bool ints = !a.is_number_float() && !b.is_number_float();
    auto as_i = [](const ojson& x) { return x.is_boolean() ? int64_t(x.get<bool>()) : x.get<int64_t>(); };
    auto as_d = [](const ojson& x) { return x.is_boolean() ? double(x.get<bool>()) : x.get<double>(); };
    if (op == "/") {
      if (as_d(b) == 0) fail(e.line, "division by zero");
      return Value::of(as_d(a) / as_d(b));
    }
    if (ints) {
      const int64_t x = as_i(a), y = as_i(b);
      if (op == "+") return Value::of(x + y);
      if (op == "-") return Value::of(x - y);
      if (op == "*") return Value::of(x * y);
      if (y == 0) fail(e.line, "division by zero");
      const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)));  // Python floors
      if (op == "//") return Value::of(q);
      if (op == "%") return Value::of(x - q * y);
    } else {
      const double x = as_d(a), y = as_d(b);
      if (op == "+") return Value::of(x + y);
      if (op == "-") return Value::of(x - y);
      if (op == "*") return Value::of(x * y);
      if (y == 0) fail(e.line, "division by zero");
      if (op == "//") return Value::of(std::floor(x / y));
      if (op == "%") return Value::of(x - std::floor(x / y) * y);
    }
    return mismatch();
  }
};

}  // namespace

Template::Template(const std::string& source, const std::string& origin) : program_(std::make_unique<Program>()) {
  program_->origin = origin;
  // Jinja drops one newline at the very end of a template (keep_trailing_newline is off).
  const std::string src =
      source.ends_with("\n") ? source.substr(0, source.size() - (source.ends_with("\r\n") ? 2 : 1)) : source;
  Scanner sc{src, program_->origin};
  Parser parser(sc.scan(), program_->origin);
  program_->body = parser.parse_all();
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const nlohmann::ordered_json& context) const {
  Evaluator ev(*program_, context);
  return ev.run();
}

}  // namespace mt::jinja
