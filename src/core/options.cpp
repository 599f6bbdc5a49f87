// The option declarations and the one parser (core/options.h).
#include "core/options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/strings.h"

namespace mt::cli {

namespace {

// A number as people write it (%g: 0.0007, 2e-05, 1e+09) when that reads back to the same number, else the
// shortest text that does: the help shows the default as it is, and a config written from get() loses no bits.
template <typename T>
std::string number_text(T v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", double(v));
  T back{};
  const auto r = std::from_chars(buf, buf + std::strlen(buf), back);
  if (r.ec == std::errc() && back == v) return buf;
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

std::vector<std::string> split_names(const std::string& names) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : names + "|") {
    if (c != '|') {
      cur += c;
      continue;
    }
    if (!cur.empty()) out.push_back(canonical_key(cur));
    cur.clear();
  }
  if (out.empty()) MT_THROW("Options: an option needs a name");
  return out;
}

// Whole-text numbers only ("3x", "", "1e" are errors); integers refuse a fraction.
int64_t parse_int(const std::string& flag, const std::string& v) {
  int64_t x = 0;
  const char *b = v.data(), *e = v.data() + v.size();
  if (!v.empty() && *b == '+') ++b;
  const auto r = std::from_chars(b, e, x);
  if (v.empty() || r.ec != std::errc() || r.ptr != e) MT_THROW(flag, " '", v, "' is not a whole number");
  return x;
}

double parse_real(const std::string& flag, const std::string& v) {
  double x = 0;
  const char *b = v.data(), *e = v.data() + v.size();
  if (!v.empty() && *b == '+') ++b;
  const auto r = std::from_chars(b, e, x);
  if (v.empty() || r.ec != std::errc() || r.ptr != e || !std::isfinite(x)) MT_THROW(flag, " '", v, "' is not a number");
  return x;
}

}  // namespace

std::string canonical_key(const std::string& key) {
  size_t i = 0;
  while (i < key.size() && key[i] == '-') ++i;
  std::string k = key.substr(i);
  std::replace(k.begin(), k.end(), '_', '-');
  return k;
}

std::vector<std::string> near_names(const std::string& key, const std::vector<std::string>& names) {
  return mt::near_names(canonical_key(key), names);
}

bool parse_bool(const std::string& flag, const std::string& v) {
  if (const std::optional<bool> b = bool_word(v)) return *b;
  MT_THROW(flag, " '", v, "' is not on or off (on/off, true/false, 1/0, yes/no)");
}

std::string Option::allowed() const {
  std::string s;
  if (!choices.empty()) {
    s = "one of ";
    for (size_t i = 0; i < choices.size(); ++i) s += (i ? ", " : "") + choices[i];
  } else if (lo && hi) {
    s = (lo_open || hi_open)
            ? str(lo_open ? "> " : ">= ", number_text(*lo), " and ", hi_open ? "< " : "<= ", number_text(*hi))
            : str(number_text(*lo), "..", number_text(*hi));
  } else if (lo) {
    s = str(lo_open ? "> " : ">= ", number_text(*lo));
  } else if (hi) {
    s = str(hi_open ? "< " : "<= ", number_text(*hi));
  }
  if (!note.empty()) s += s.empty() ? note : "; " + note;
  return s;
}

std::string Option::refusal(const std::string& value) const {
  if (!choices.empty() && std::find(choices.begin(), choices.end(), value) == choices.end())
    return "allowed: " + allowed();
  if (nonempty && value.empty()) return "must not be empty";
  if ((kind == Kind::Int || kind == Kind::Real) && (lo || hi)) {
    const double x = kind == Kind::Int ? double(parse_int(flag(), value)) : parse_real(flag(), value);
    const bool ok = (!lo || (lo_open ? x > *lo : x >= *lo)) && (!hi || (hi_open ? x < *hi : x <= *hi));
    if (!ok) return "need " + allowed();
  }
  return "";
}

Options::Options(std::string command, std::string synopsis, std::string summary)
    : command_(std::move(command)), synopsis_(std::move(synopsis)), summary_(std::move(summary)) {}

Option& Options::declare(const std::string& names, Kind kind, const std::string& help) {
  Option o;
  o.names = split_names(names);
  for (const std::string& n : o.names)
    if (find(n)) MT_THROW("Options: --", n, " is declared twice in ", command_);
  o.kind = kind;
  o.group = group_;
  o.help = help;
  o.metavar = kind == Kind::Int ? "N" : kind == Kind::Real ? "X" : kind == Kind::Bool ? "on|off" : "TEXT";
  options_.push_back(std::move(o));
  return options_.back();
}

// The setters capture the flag's name (for their errors), never the Options or the Option (options_ may
// reallocate while options are still being declared, and an Options may be moved).
Option& Options::add(const std::string& names, int64_t* field, const std::string& help) {
  Option& o = declare(names, Kind::Int, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) { *field = parse_int(flag, v); };
  o.get = [field] { return std::to_string(*field); };
  return o;
}

Option& Options::add(const std::string& names, int* field, const std::string& help) {
  Option& o = declare(names, Kind::Int, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) {
    const int64_t x = parse_int(flag, v);
    if (x < INT32_MIN || x > INT32_MAX) MT_THROW(flag, " '", v, "' is out of range");
    *field = int(x);
  };
  o.get = [field] { return std::to_string(*field); };
  return o;
}

Option& Options::add(const std::string& names, double* field, const std::string& help) {
  Option& o = declare(names, Kind::Real, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) { *field = parse_real(flag, v); };
  o.get = [field] { return number_text(*field); };
  return o;
}

Option& Options::add(const std::string& names, float* field, const std::string& help) {
  Option& o = declare(names, Kind::Real, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) { *field = float(parse_real(flag, v)); };
  o.get = [field] { return number_text(*field); };
  return o;
}

Option& Options::add(const std::string& names, std::string* field, const std::string& help) {
  Option& o = declare(names, Kind::Text, help);
  o.set = [field](const std::string& v) { *field = v; };
  o.get = [field] { return *field; };
  return o;
}

Option& Options::add(const std::string& names, bool* field, const std::string& help) {
  Option& o = declare(names, Kind::Bool, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) { *field = parse_bool(flag, v); };
  o.get = [field] { return std::string(*field ? "on" : "off"); };
  return o;
}

Option& Options::add(const std::string& names, std::optional<double>* field, const std::string& help,
                     const std::string& unset) {
  Option& o = declare(names, Kind::Real, help);
  const std::string flag = o.flag();
  o.set = [flag, field](const std::string& v) { *field = parse_real(flag, v); };
  o.get = [field, unset] { return *field ? number_text(**field) : unset; };
  return o;
}

Option& Options::custom(const std::string& names, Kind kind, const std::string& help,
                        std::function<void(const std::string&)> set, std::function<std::string()> shown) {
  Option& o = declare(names, kind, help);
  o.set = std::move(set);
  o.get = std::move(shown);
  return o;
}

const Option* Options::find(const std::string& name) const {
  const std::string k = canonical_key(name);
  for (const Option& o : options_)
    if (std::find(o.names.begin(), o.names.end(), k) != o.names.end()) return &o;
  return nullptr;
}

Option& Options::at(const std::string& name) {
  const Option* o = find(name);
  if (!o) MT_THROW("Options::at: ", command_, " has no option --", canonical_key(name));
  return options_[size_t(o - options_.data())];
}

bool Options::given(const std::string& name) const {
  const Option* o = find(name);
  if (!o) MT_THROW("Options::given: ", command_, " has no option --", canonical_key(name));
  return std::find(given_.begin(), given_.end(), o->names.front()) != given_.end();
}

void Options::unknown(const std::string& arg) const {
  std::vector<std::string> all;
  for (const Option& o : options_)
    for (const std::string& n : o.names) all.push_back(n);
  const std::string key = arg.substr(0, arg.find('='));
  const std::vector<std::string> near = near_names(key, all);
  std::string hint;
  for (size_t i = 0; i < near.size(); ++i) hint += (i ? ", --" : "--") + near[i];
  MT_THROW(command_, ": unknown option ", key, near.empty() ? "" : "; did you mean ", hint, near.empty() ? "" : "?",
           " (moetrain ", command_, " --help lists every option)");
}

bool Options::parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") return false;
    if (a == "--") {
      if (positional_what_.empty()) MT_THROW(command_, ": '--' but the command takes no further arguments");
      positional_.insert(positional_.end(), args.begin() + std::ptrdiff_t(i) + 1, args.end());
      break;
    }
    if (a.size() < 3 || a.rfind("--", 0) != 0) {
      if (positional_what_.empty())
        MT_THROW(command_, ": unexpected argument '", a, "'; options are --key value or --key=value (moetrain ",
                 command_, " --help lists them)");
      positional_.push_back(a);
      continue;
    }
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq);
    const Option* found = find(key);
    if (!found) unknown(a);
    Option& o = options_[size_t(found - options_.data())];
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else if (o.kind == Kind::Bool) {
      // Bare means on; a following word that reads as a boolean is its value.
      value = "on";
      if (i + 1 < args.size() && bool_word(args[i + 1])) value = args[++i];
    } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
      value = args[++i];
    } else if (o.implicit) {
      value = *o.implicit;
    } else {
      const std::string what = o.allowed();
      MT_THROW(command_, ": ", o.flag(), " needs a value (", o.metavar, what.empty() ? "" : ": " + what, ")");
    }
    assign(o, value);
  }
  return true;
}

void Options::set(const std::string& name, const std::string& value) {
  const Option* found = find(name);
  if (!found) unknown("--" + canonical_key(name));
  assign(options_[size_t(found - options_.data())], value);
}

void Options::assign(Option& o, const std::string& value) {
  try {
    if (const std::string why = o.refusal(value); !why.empty())
      MT_THROW(o.flag(), " ", o.kind == Kind::Int || o.kind == Kind::Real ? value : "'" + value + "'", "; ", why);
    o.set(value);
  } catch (const Error& e) {  // every error of a value says whose command it is
    const std::string msg = e.what();
    if (msg.rfind(command_ + ":", 0) == 0) throw;
    MT_THROW(command_, ": ", msg);
  }
  if (std::find(given_.begin(), given_.end(), o.names.front()) == given_.end()) given_.push_back(o.names.front());
}

void Options::check() const {
  std::string missing;
  for (const Option& o : options_)
    if (o.needed && !given(o.names.front())) missing += (missing.empty() ? "" : ", ") + o.flag();
  if (!missing.empty())
    MT_THROW(command_, ": ", missing, missing.find(',') == std::string::npos ? " is" : " are", " required\n", usage());
  for (const auto& r : rules_) r();
}

std::string Options::usage() const {
  return str("usage: moetrain ", command_, " ", synopsis_, "\n(moetrain ", command_, " --help lists every option)");
}

std::string Options::help() const {
  std::ostringstream os;
  os << "usage: moetrain " << command_ << " " << synopsis_ << "\n";
  if (!summary_.empty()) os << summary_ << "\n";
  os << "Options take --key value or --key=value; on/off options also true/false, 1/0, or alone for on.\n";
  std::vector<std::string> groups;
  for (const Option& o : options_)
    if (std::find(groups.begin(), groups.end(), o.group) == groups.end()) groups.push_back(o.group);
  for (const std::string& g : groups) {
    os << "\n" << (g.empty() ? "options" : g) << ":\n";
    for (const Option& o : options_) {
      if (o.group != g) continue;
      std::string head = "  " + o.flag();
      for (size_t k = 1; k < o.names.size(); ++k) head += ", --" + o.names[k];
      head += " " + (o.choices.empty() ? o.metavar : [&] {
                std::string c;
                for (size_t k = 0; k < o.choices.size(); ++k) c += (k ? "|" : "") + o.choices[k];
                return c;
              }());
      std::string line = o.help;
      const std::string dflt = o.get ? o.get() : "";
      line += o.needed ? std::string(" (required") : str(" (default ", dflt.empty() ? "none" : dflt);
      const std::string allowed = o.choices.empty() ? o.allowed() : o.note;
      if (!allowed.empty()) line += "; " + allowed;
      line += ")";
      // The help text wrapped at 100 columns, indented under its own column.
      constexpr size_t kCol = 30, kWidth = 100;
      os << head;
      size_t at = head.size();
      if (at >= kCol) {
        os << "\n";
        at = 0;
      }
      os << std::string(kCol - at, ' ');
      at = kCol;
      std::istringstream words(line);
      std::string w;
      bool first = true;
      while (words >> w) {
        if (!first && at + 1 + w.size() > kWidth) {
          os << "\n" << std::string(kCol, ' ');
          at = kCol;
        } else if (!first) {
          os << ' ';
          ++at;
        }
        os << w;
        at += w.size();
        first = false;
      }
      os << "\n";
    }
  }
  return os.str();
}

}  // namespace mt::cli
