// Command-line options, declared once: each option binds a name to the field it sets, and carries its
// type, range, help text and group. The field's value before parsing is the default, so every default
// lives in one place (the struct the command fills) and the help shows it as it is, presets included.
//
// One syntax for every command:
//   --key value and --key=value ('-' and '_' alike in keys: --max-new-tokens, --max_new_tokens);
//   booleans as on/off, true/false, 1/0, yes/no, or bare (--flag alone is on);
//   the last of a repeated option wins;
//   an unknown option is an error that suggests the nearest names ("did you mean --lr?");
//   -h / --help asks for the long help (grouped, every default shown); errors end with the short usage.
// Values are checked as they are parsed (the error names the option, the value and what is allowed);
// rules over several options are declared beside them (rule()) and run by check(), so a command's whole
// option surface can be tested without starting it.
// It lives in core (it needs nothing above it) so that a library's settings can be declared with it too:
// TrainConfig's (train/train_config.h) are, and its JSON file goes through the same declarations (set()).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mt::cli {

enum class Kind { Int, Real, Text, Bool };

struct Option {
  std::vector<std::string> names;  // canonical first, '-' spelling, no leading dashes
  std::string group, help, metavar;
  Kind kind = Kind::Text;
  // Parses and assigns a value given as text (after the range and choice checks).
  std::function<void(const std::string&)> set;
  std::function<std::string()> get;  // the field's value as text (the default, in the help); reads back exactly
  // Numbers: the allowed range; text: the allowed values (empty: any).
  std::optional<double> lo, hi;
  bool lo_open = false, hi_open = false;
  std::vector<std::string> choices;
  std::string note;                     // appended to the range in errors and help, e.g. "0: off"
  std::optional<std::string> implicit;  // a value-taking option given bare takes this (--resume: latest)
  bool needed = false;                  // check() refuses a command line without it
  bool nonempty = false;                // text: "" is refused

  // Fluent settings, for declarations that read as one line.
  Option& at_least(double v) {
    lo = v;
    lo_open = false;
    return *this;
  }
  Option& above(double v) {
    lo = v;
    lo_open = true;
    return *this;
  }
  Option& at_most(double v) {
    hi = v;
    hi_open = false;
    return *this;
  }
  Option& below(double v) {
    hi = v;
    hi_open = true;
    return *this;
  }
  Option& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  Option& says(std::string n) {
    note = std::move(n);
    return *this;
  }
  Option& bare_means(std::string v) {
    implicit = std::move(v);
    return *this;
  }
  Option& var(std::string m) {
    metavar = std::move(m);
    return *this;
  }
  Option& required() {
    needed = true;
    return *this;
  }
  Option& not_empty() {
    nonempty = true;
    return *this;
  }

  std::string flag() const { return "--" + names.front(); }
  // What the range or choices allow, in words ("> 0", "0..1", "one of a, b"); "" when anything goes.
  std::string allowed() const;
  // Why the choices, the range or not_empty() refuse `value` ("need > 0", "allowed: one of a, b", "must not
  // be empty"); "" when they allow it. A number that does not parse throws (naming the flag), as set does.
  std::string refusal(const std::string& value) const;
};

// "on", "true", "1", "yes" -> true; "off", "false", "0", "no" -> false; else an error naming the flag.
bool parse_bool(const std::string& flag, const std::string& v);

class Options {
 public:
  // command: "grpo" (errors start with it); synopsis: the usage line's arguments.
  Options(std::string command, std::string synopsis, std::string summary = "");

  // Later options belong to this group (its title in the help).
  void group(const std::string& title) { group_ = title; }

  // names: "lr", or aliases "out-dir|run-dir". The field must outlive the Options.
  Option& add(const std::string& names, int64_t* field, const std::string& help);
  Option& add(const std::string& names, int* field, const std::string& help);
  Option& add(const std::string& names, double* field, const std::string& help);
  Option& add(const std::string& names, float* field, const std::string& help);
  Option& add(const std::string& names, std::string* field, const std::string& help);
  Option& add(const std::string& names, bool* field, const std::string& help);
  // An optional number: unset shows `unset` in the help.
  Option& add(const std::string& names, std::optional<double>* field, const std::string& help,
              const std::string& unset);
  // Anything else: the setter parses the text itself; `shown` is the default the help shows.
  Option& custom(const std::string& names, Kind kind, const std::string& help,
                 std::function<void(const std::string&)> set, std::function<std::string()> shown);

  // A rule over several options, run by check() after parsing; it throws (MT_THROW) when broken.
  void rule(std::function<void()> r) { rules_.push_back(std::move(r)); }

  // Parses args into the fields. Returns false when help was asked for (nothing else is parsed then).
  // Positional arguments are refused unless allow_positional(); after "--" everything is positional.
  bool parse(const std::vector<std::string>& args);
  // Sets one option from its text as the command line would: checked (refusal), set, and counted as given.
  // `name` is any of its names or spellings; an unknown one is parse's error. (A config file's values go
  // through here.)
  void set(const std::string& name, const std::string& value);
  void allow_positional(const std::string& what) { positional_what_ = what; }
  const std::vector<std::string>& positional() const { return positional_; }
  void check() const;  // the required options, then the rules

  // Whether the option (any of its names) appeared on the command line or was set().
  bool given(const std::string& name) const;
  const Option* find(const std::string& name) const;  // by any name or spelling; null if none
  Option& at(const std::string& name);                // the same, to amend (e.g. required()); throws if none
  const std::vector<Option>& options() const { return options_; }

  std::string usage() const;  // one line plus where the long help is
  std::string help() const;   // the synopsis, the summary and every group's options with their defaults

 private:
  Option& declare(const std::string& names, Kind kind, const std::string& help);
  [[noreturn]] void unknown(const std::string& arg) const;
  void assign(Option& o, const std::string& value);  // set's work, on a found option
  std::string command_, synopsis_, summary_, group_, positional_what_;
  std::vector<Option> options_;
  std::vector<std::function<void()>> rules_;
  std::vector<std::string> given_, positional_;
};

// The canonical spelling of a key: leading dashes dropped, '_' as '-'.
std::string canonical_key(const std::string& key);
// Names within a small edit distance of `key` (or containing it), nearest first: the "did you mean" list.
std::vector<std::string> near_names(const std::string& key, const std::vector<std::string>& names);

}  // namespace mt::cli
