// A small Jinja2 interpreter for chat templates: enough of the language to run ChatML-style templates and
// Qwen3's own, with the environment transformers' apply_chat_template uses (trim_blocks and lstrip_blocks on,
// tojson as Python's json.dumps(ensure_ascii=False), raise_exception).
//
// Supported: text, {{ expr }}, {# comments #}, whitespace control ({%- -%}, {{- -}}, {%+), {% if/elif/else/endif %},
// {% for x in xs %} / {% for k, v in d.items() %} with an optional {% else %}, loop.index/index0/first/last/length/
// revindex/revindex0, {% break %}/{% continue %}, {% set x = ... %} / {% set ns.attr = ... %}, namespace(...),
// {% generation %} (transformers' marker, rendered as its body). Expressions: literals (strings, numbers, true/false/
// none, lists, dicts), names, attributes, subscripts and slices ([::-1]), `x if c else y`, or/and/not, == != < <= >
// >=, in / not in, + - * / // %, ~, unary -, filters (trim, tojson, length/count, string, lower, upper, first, last,
// join, default, list, items), tests (defined, undefined, none, string, number, integer, boolean, true, false,
// mapping, sequence, iterable), string methods (startswith, endswith, split, strip, lstrip, rstrip, upper, lower,
// replace), dict methods (items, keys, values, get), raise_exception(msg).
//
// Not supported (an error naming the construct and the template line): macros, call blocks, includes, imports,
// extends/blocks, filter blocks, with, other filters and tests. Undefined values behave as Jinja's default
// Undefined: empty when printed, false when tested, an error when used in arithmetic or looked into.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace mt::jinja {

struct Program;

class Template {
 public:
  // Parses `source`; `origin` names it in errors ("tokenizer_config.json chat_template"). A syntax error or an
  // unsupported construct throws mt::Error naming the construct and its line.
  Template(const std::string& source, const std::string& origin);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with `context` (an object: its keys are the template's global names). Errors (an undefined value
  // used, a type mismatch, raise_exception) name the template line.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::unique_ptr<Program> program_;
};

}  // namespace mt::jinja
