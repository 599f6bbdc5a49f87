#!/usr/bin/env python3
"""Golden data for moetrain's Jinja subset (src/data/jinja.*): small templates, each rendered by transformers'
apply_chat_template (its Jinja environment: trim_blocks, lstrip_blocks, its tojson, raise_exception), so the C++
interpreter is held to the same whitespace rules, scoping, filters, tests and Python-style printing.

Writes tests/assets/tokenizer/jinja.json: {"cases": [{"name", "template", "messages", "kwargs", "text"}]}, where
kwargs are the extra names the template sees (add_generation_prompt among them). Deterministic.
  /tmp/trl-venv/bin/python tools/make_jinja_goldens.py --out tests/assets/tokenizer/jinja.json
"""
import argparse
import json

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

WHITESPACE = """{% for m in messages %}
  {% if m.role == 'user' %}
    U: {{ m.content }}
  {% else %}
    A: {{ m.content|trim }}
  {% endif %}
{% endfor %}
{# a comment #}
X
  {#- stripped -#}
  Y
{% if true %}
  Z
{%+ endif %}
D {{- ' E ' -}} F
"""

LOOPS = """{%- set ns = namespace(n=0, roles='') -%}
{%- set outer = 'o' -%}
{%- for m in messages -%}
{%- set outer = 'inner' -%}
{%- set ns.n = ns.n + 1 -%}
{%- set ns.roles = ns.roles ~ m.role[0] -%}
[{{ loop.index0 }}/{{ loop.index }}/{{ loop.length }}/{{ loop.revindex0 }}{% if loop.first %} first{% endif %}{% if loop.last %} last{% endif %}:{{ m.role }}]
{%- endfor -%}
{{ outer }} {{ ns.n }} {{ ns.roles }}
{%- for m in messages -%}{%- if m.role == 'system' -%}{%- continue -%}{%- elif m.role == 'tool' -%}{%- break -%}{%- else -%}{{ m.role }};{%- endif -%}{%- endfor -%}
{%- for x in [] -%}no{%- else -%}empty{%- endfor -%}
{%- for k, v in extra.d.items() %} {{ k }}={{ v }}{% endfor %}
"""

EXPRESSIONS = ("{{ messages[::-1][0].content }}|{{ messages[-1].role }}|{{ 'ab' in 'xaby' }}|{{ 3 not in [1, 2] }}|"
               "{{ 1 ~ 'a' ~ none }}|{{ 7 // -2 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 * 3 + 1 }}|{{ 'x' if 1 > 2 else 'y' }}|"
               "{{ messages | length }}|{{ '日本' | length }}|{{ extra | tojson }}|{{ extra.missing is defined }}|"
               "{{ extra.n is none }}|{{ extra.s is string }}|{{ extra.l | join(',') }}|{{ '  pad ' | trim }}|"
               "{{ 'a,b,,c'.split(',') }}|{{ 'xxhixx'.strip('x') }}|{{ '\\nq\\n'.lstrip('\\n') }}|{{ 'Ab'.upper() }}"
               "{{ 'Ab'.lower() }}|{{ [1, 'a', none, true, 2.5] }}|{{ extra.d }}|{{ not extra.e }}|{{ extra.get('s') }}|"
               "{{ (1 + 2) * 3 }}|{{ 'a' < 'b' and 2 >= 2 }}|{{ 'abc'[1:] }}{{ 'abc'[-1] }}|{{ [1, 2, 3, 4][1:3] }}|"
               "{{ undefined_name }}|{{ 0.1 + 0.2 }}|{{ extra.s ~ 1.0 }}|{{ extra.l | length - 1 }}|{{ not 1 == 2 }}|"
               "{{ extra.missing | default('dflt') }}|{{ extra.n is not none }}|{{ 'it\\'s' }}|{{ extra.d | tojson }}|"
               "{{ 'a' + 'b' if extra.s else 'c' }}|{{ extra.l[0] is number }}|{{ extra.d is mapping }}|{{ extra.d.a }}")

# Templates in the styles of other model families (written here, not copied): a system-prompt default and tool
# calls in a ChatML template, a BOS token and role checks with raise_exception, `not x is defined`.
TOOLS_CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

BOS_ROLES = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
<|header|>system<|end_header|>

Today Date: {{ date_string }}
{{ system_message }}<|eot|>
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|header|>' + message['role'] + '<|end_header|>\\n\\n' + message['content'] | trim + '<|eot|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|header|>assistant<|end_header|>\\n\\n' }}
{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CASES = [
    {"name": "chatml", "template": CHATML,
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "多语言 😀"}],
     "kwargs": {"add_generation_prompt": True}},
    {"name": "chatml_no_prompt", "template": CHATML,
     "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
     "kwargs": {"add_generation_prompt": False}},
    {"name": "whitespace", "template": WHITESPACE,
     "messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "  a1 \n"}],
     "kwargs": {}},
    {"name": "loops", "template": LOOPS,
     "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
                  {"role": "user", "content": "u2"}],
     "kwargs": {"extra": {"d": {"b": 2, "a": "x"}}}},
    {"name": "expressions", "template": EXPRESSIONS,
     "messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "last"}],
     "kwargs": {"extra": {"n": None, "s": "str", "l": [1, 2, 3], "d": {"a": 1, "b": "é\"q"}, "e": []}}},
]


CASES += [
    {"name": "tools_chatml", "template": TOOLS_CHATML,
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "{\"temp\": 22}"},
                  {"role": "assistant", "content": "21 °C."}],
     "kwargs": {"tools": [WEATHER_TOOL], "add_generation_prompt": True}},
    {"name": "tools_chatml_no_tools", "template": TOOLS_CHATML,
     "messages": [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"}],
     "kwargs": {"add_generation_prompt": True}},
    {"name": "bos_roles", "template": BOS_ROLES,
     "messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi "},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
     "kwargs": {"bos_token": "<|begin|>", "add_generation_prompt": True}},
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    out = []
    for c in CASES:
        text = tok.apply_chat_template(c["messages"], chat_template=c["template"], tokenize=False, **c["kwargs"])
        out.append(dict(c, text=text))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"made_by": "transformers apply_chat_template", "cases": out}, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
