#!/usr/bin/env python3
"""Golden data for moetrain's tokenizer (src/data/tokenizer.*), made by Hugging Face `tokenizers`.

Writes into --out (tests/assets/tokenizer/):
  trained/tokenizer.json   a byte-level BPE (vocab ~3000) trained here with the Qwen2 normalizer (NFC),
                           pre-tokenizer (Split by the Qwen2 regex, Isolated; ByteLevel without regex) and
                           decoder, with Qwen's special tokens and a few added tokens that exercise the
                           lstrip / rstrip / single_word / normalized flags
  qwen/tokenizer.json      the real Qwen2/Qwen3 vocabulary (151,643 BPE tokens from the qwen.tiktoken ranks
                           shipped in the PyPI package `dashscope`, converted to vocab + merges the standard way,
                           with Qwen3's 26 added tokens) CUT DOWN to the tokens and merges the test strings can
                           reach: every merge whose result is a substring of some test string is kept, with its
                           real id and rank, so every test string encodes exactly as with the full file (checked
                           here with `tokenizers` for every case). --full-qwen PATH also writes the full file
                           (~11 MB, for `moetrain tokenize --bench`; not committed).
  <name>/goldens.json      {"cases": [{"text" | "bytes_hex", "ids", "decoded", "decoded_skip"}],
                            "decode_cases": [{"ids", "decoded", "decoded_skip"}]}: encode(text).ids, and
                           decode(ids, skip_special_tokens=False / True) of those ids and of random id lists
                           (broken UTF-8 among them). "bytes_hex" cases hold bytes that are not valid UTF-8;
                           their ids are encode(bytes.decode("utf-8", "replace")).
  nfc.json                 [[input, unicodedata.normalize("NFC", input)], ...] for tricky strings.

Needs `tokenizers` (made with 0.23.3) and the `dashscope` package's qwen.tiktoken (pip install --no-deps dashscope;
only the data file is read). Deterministic: a second run writes identical bytes.
  /tmp/gv/bin/python tools/make_tokenizer_goldens.py --out tests/assets/tokenizer [--full-qwen /tmp/qwen_tokenizer.json]
"""
import argparse
import base64
import importlib.util
import json
import os
import random
import sys
import unicodedata

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# Qwen3's added tokens, ids from 151643 (tokenizer_config.json's added_tokens_decoder): (content, special).
QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
              ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
              ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
              ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
              ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
              ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
              ("<think>", False), ("</think>", False)]


# Qwen3's chat template, as in the tokenizer_config.json of the Qwen3 models (e.g. Qwen/Qwen3-30B-A3B).
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}
CHAT_CASES = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": True, "enable_thinking": False},
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": True, "enable_thinking": True},
    {"messages": [{"role": "user", "content": "1+1?"},
                  {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2"},
                  {"role": "user", "content": "and 2+2?"},
                  {"role": "assistant", "content": "<think>\n\nagain\n\n</think>\n\n4"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "\nwhy\n"},
                  {"role": "user", "content": "q2"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                  {"function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "{\"temp\": 19}"},
                  {"role": "assistant", "content": "Paris 21 °C, Lyon 19 °C."}],
     "tools": [WEATHER_TOOL], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "東京", "days": 3, "metric": True, "x": None}}]},
                  {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}],
     "tools": [WEATHER_TOOL], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "多语言 😀\ttab"}],
     "add_generation_prompt": True, "enable_thinking": False},
    {"messages": [{"role": "system", "content": "s\n\n"}, {"role": "user", "content": "x"},
                  {"role": "assistant", "content": "no think here"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "partial</think>answer"},
                  {"role": "assistant", "content": "<think>r</think>tail"}]},
    {"messages": [{"role": "user", "content": ["not", "a string"]}, {"role": "assistant", "content": None}],
     "add_generation_prompt": True},
]


def chat_goldens():
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=QWEN3_CHAT_TEMPLATE)
    out = []
    for c in CHAT_CASES:
        kw = {k: c[k] for k in ("add_generation_prompt", "enable_thinking") if k in c}
        text = tok.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=False, **kw)
        out.append(dict(c, text=text))
    return out


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()


def bl(b):
    return "".join(B2U[x] for x in b)


def qwen_shell(vocab, merges, added):
    """A tokenizer.json dict in the layout of Qwen's own file."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, c, s in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def qwen_ranks():
    spec = importlib.util.find_spec("dashscope")
    if spec is None:
        sys.exit("needs the dashscope package for qwen.tiktoken: pip install --no-deps dashscope")
    path = os.path.join(spec.submodule_search_locations[0], "resources", "qwen.tiktoken")
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def merges_from_ranks(ranks):
    """The BPE merge of each multi-byte token: the last merge tiktoken's rank-ordered BPE makes on its bytes
    when only lower ranks are allowed; merges ordered by the rank of their result."""
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = [bytes([b]) for b in tok]
        while len(parts) > 2:
            best, best_i = None, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            sys.exit("token %r (rank %d) is not reachable by merges" % (tok, rank))
    return merges


# ---------------------------------------------------------------------------------------------- test strings

WORDS = ("the quick brown fox jumps over lazy dog tokenizer model training expert router gradient "
         "hello world language learning mixture of experts attention layer norm optimizer").split()
CONTRACTIONS = ["don't", "DON'T", "Don'T", "I'Ll", "i'LL", "we'VE", "she's", "SHE'S", "they'Re", "I'M", "you'd",
                "YOU'D", "it'S", "'s", "'S", "'t", "'ll", "'LL", "'Re", "x'y", "rock'n'roll", "'''", "IT'ſ", "'ſ",
                "o'clock", "ma'am"]
CODE = ["def f(x):\n    return x**2 + 1\n", "int main() {\n\treturn 0;\n}\n", "for (int i = 0; i < n; ++i) a[i] += b[i];",
        '{"key": [1, 2, 3], "nested": {"a": null}}', "#include <vector>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
        "x = y if z else w  # comment", "SELECT * FROM t WHERE id = 42;", "console.log(`${a}+${b}`);",
        "    if x:\n        pass\n\n\n", "\tindented\twith\ttabs\n", "a_b_c = __init__(self, *args, **kw)",
        "<div class=\"x\">&amp;</div>", "std::vector<std::pair<int, int>> v{{1, 2}};", "fn main() -> Result<(), E> {}"]
CJK = ["你好，世界！", "混合专家模型的训练", "我们在2024年发布了Qwen3。", "東京は日本の首都です。", "カタカナとひらがな",
       "안녕하세요 세계", "한국어 텍스트입니다.", "中文English混合text", "数字１２３和全角ＡＢＣ", "「引用」と『二重』"]
EMOJI = ["👍", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵🇺🇸", "❤️", "😀😃😄", "🤖 robot", "emoji🎉in🎉text", "⭐️⭐", "🏳️‍🌈"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "a  \n  b", "x \t y", "end   ",
          "   start", "\u00a0", "a\u00a0b", "\u3000全角", "thin\u2009space", "\u180e", "nel\u0085x", "zw\u200bsp",
          "\ufeffbom", "\x0b\x0c", " \r \n", "\n \n", "word \n\nword", "  \t  \n\t  "]
DIGITS = ["0", "12345", "3.14159", "1,000,000", "2024-01-01", "٣٤٥", "①②③", "Ⅻ", "x1y22z333", "0x1F", "1e-10",
          "१२३", "１２３", "½¾", "²³"]
NFC_CASES = ["e\u0301", "a\u0308\u0304", "\u1100\u1161\u11a8", "\u1100\u1161", "\uac00\u11a8", "\u0958",
             "\u212b", "\u2126", "\u0344", "a\u0323\u0302", "a\u0302\u0323", "\u1e9b\u0323", "o\u0328\u0304",
             "\u0041\u030a", "\u00c5", "\u1e0b\u0323", "q\u0307\u0323", "\u0301a", "e\u0301\u0301", "\u0915\u093c",
             "\u09c7\u09be", "\u0b47\u0b3e", "\u0fb2\u0f80", "\uf900", "\u2000", "\u0340", "\u0f73", "\u2adc",
             "\U0001d15e", "\u1fee", "\u3099\u304b", "\u304b\u3099", "\u306f\u309a", "Ko\u0308ln", "Cafe\u0301",
             "n\u0303o", "\u0391\u0301\u03b9", "\u1f80", "\u03b1\u0313\u0300\u0345"]
SPECIAL_IN_TEXT = ["hello<|im_end|>world", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                   "<|endoftext|><|endoftext|>", "<|im_start|", "<<|im_end|>>", "a <|im_end|> b",
                   "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>{\"a\": 1}</tool_call>", "<|im_end", "|>",
                   "text<|endoftext|>", "<|im_start|>system\nYou are helpful.<|im_end|>", "x<|fim_prefix|>y<|fim_suffix|>z"]
# Tokens only the trained tokenizer has, with their flags (content, special, lstrip, rstrip, single_word, normalized).
TRAINED_EXTRA = [("[MASK]", True, True, True, False, False), ("<sep>", False, False, False, False, False),
                 ("word", False, False, False, True, False), ("café", False, False, False, False, True),
                 ("<R>", False, False, True, False, False)]
TRAINED_IN_TEXT = ["a [MASK] b", "a   [MASK]   b", "[MASK][MASK]", "x[MASK]y", " \n[MASK]\n ", "one<sep>two",
                   "word", "a word here", "words", "sword", "word!", "_word_", "éword", "word\u0301", "café",
                   "cafe\u0301", "CAFÉ café cafe\u0301s", "<R>   tail", "<R>\n\nx", "[MASK]<R>  <sep>"]


def random_unicode(rng, n):
    out = []
    while len(out) < n:
        block = rng.choice([(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF),
                            (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x1E00, 0x1FFF),
                            (0x2000, 0x206F), (0x2100, 0x27BF), (0x3000, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00),
                            (0xFF00, 0xFFEF), (0x1F300, 0x1F6FF), (0x1D400, 0x1D7FF), (0x10000, 0x1007F), (0, 0x1F)])
        cp = rng.randint(*block)
        if 0xD800 <= cp <= 0xDFFF or unicodedata.category(chr(cp)) == "Cn":
            continue
        out.append(chr(cp))
    return "".join(out)


def test_strings(rng, specials):
    pool = WORDS + CONTRACTIONS + CODE + CJK + EMOJI + SPACES + DIGITS + NFC_CASES + SPECIAL_IN_TEXT + specials
    cases = [""] + pool
    for _ in range(1500):  # mixtures of fragments
        k = rng.randint(1, 8)
        parts = []
        for _ in range(k):
            p = rng.choice(pool)
            if rng.random() < 0.3:
                p = p.upper() if rng.random() < 0.5 else p.capitalize()
            parts.append(p)
            parts.append(rng.choice(["", " ", "  ", "\n", "\t", "", " ", "\r\n", ", ", ". "]))
        cases.append("".join(parts))
    for _ in range(600):
        cases.append(random_unicode(rng, rng.randint(1, 40)))
    for _ in range(200):  # sentences
        cases.append(" ".join(rng.choice(WORDS + CONTRACTIONS) for _ in range(rng.randint(3, 20))) + rng.choice([".", "?", "!\n", ""]))
    cases += ["a" * 1000, "9" * 300, " " * 5000, "\n" * 300, "ab" * 400 + "\r\n", "x" + " " * 999 + "y",
              "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(500)), "😀" * 200, "'s" * 100]
    return cases


def invalid_byte_cases(rng):
    fixed = [b"\xff", b"abc\x80def", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98", b"\xed\xa0\x80",
             b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"hello \xfe\xfe world", b"\xf8\x88\x80\x80\x80",
             b"<|im_end|>\xff<|im_end|>", b"\x80\x80\x80", "é".encode() + b"\xcc", b"don\x92t"]
    for _ in range(100):
        s = bytearray(rng.choice(CJK + EMOJI + WORDS).encode())
        for _ in range(rng.randint(1, 3)):
            pos = rng.randint(0, len(s))
            s[pos:pos] = bytes([rng.randint(0x80, 0xFF)])
        fixed.append(bytes(s))
    return fixed


def goldens(tok, rng, strings, bad_bytes):
    cases = []
    for s in strings:
        ids = tok.encode(s).ids
        cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                      "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    for b in bad_bytes:
        ids = tok.encode(b.decode("utf-8", "replace")).ids
        cases.append({"bytes_hex": b.hex(), "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                      "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    # Random id lists: single bytes' tokens among them make broken UTF-8 that decodes to U+FFFD.
    ids_pool = sorted(set(i for c in cases for i in c["ids"]))
    byte_ids = [tok.token_to_id(B2U[b]) for b in range(0x80, 0x100) if tok.token_to_id(B2U[b]) is not None]
    decode_cases = []
    for _ in range(300):
        ids = [rng.choice(ids_pool if rng.random() < 0.6 else byte_ids) for _ in range(rng.randint(1, 12))]
        decode_cases.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                             "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    return {"tokenizers_version": tokenizers.__version__, "cases": cases, "decode_cases": decode_cases}


def dump(obj, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=True, separators=(",", ":"))
        f.write("\n")


def train_tokenizer(rng):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = []
    for _ in range(4000):
        corpus.append(" ".join(rng.choice(WORDS + CONTRACTIONS + CJK + DIGITS + EMOJI) for _ in range(rng.randint(3, 15))))
    syllables = ["ka", "lo", "mi", "tren", "sto", "ver", "qu", "ing", "tion", "ex", "pre", "al", "ment", "ly", "er", "th"]
    for _ in range(20000):
        corpus.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) + rng.choice([" ", ", ", ".\n"]))
    corpus += CODE * 50 + CJK * 50 + [random_unicode(rng, 30) for _ in range(500)]
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(c, special=s, lstrip=l, rstrip=r, single_word=w, normalized=n)
                    for c, s, l, r, w, n in TRAINED_EXTRA if not s])
    tok.add_special_tokens([AddedToken(c, special=s, lstrip=l, rstrip=r, single_word=w, normalized=n)
                            for c, s, l, r, w, n in TRAINED_EXTRA if s] + ["<think>", "</think>"])
    return tok


def nfc_cases(rng):
    out = [[s, unicodedata.normalize("NFC", s)] for s in NFC_CASES]
    marks = [chr(c) for c in list(range(0x300, 0x370)) + [0x1AB0, 0x1DC0, 0x20D0, 0x302A, 0x3099, 0x093C, 0x05B0]]
    for _ in range(400):
        s = "".join(rng.choice(["a", "e", "o", "A", "\u1100", "\u1161", "\u11a8", "\uac00", "\u0915", "\u3046", "ω",
                                "\u212b", "\u00c5", "u"] + marks) for _ in range(rng.randint(1, 8)))
        out.append([s, unicodedata.normalize("NFC", s)])
    for _ in range(200):
        s = random_unicode(rng, rng.randint(1, 20))
        out.append([s, unicodedata.normalize("NFC", s)])
    return {"unicode_version": unicodedata.unidata_version, "cases": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--full-qwen", help="also write the full Qwen tokenizer.json here (for benchmarks)")
    args = ap.parse_args()
    rng = random.Random(20240611)

    trained = train_tokenizer(random.Random(1))
    trained_specials = [c for c, *_ in TRAINED_EXTRA] + TRAINED_IN_TEXT
    chats = chat_goldens()
    strings = test_strings(random.Random(2), trained_specials) + [c["text"] for c in chats]
    bad_bytes = invalid_byte_cases(random.Random(3))
    path = os.path.join(args.out, "trained", "tokenizer.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    trained.save(path)
    trained = Tokenizer.from_file(path)
    dump(goldens(trained, random.Random(4), strings, bad_bytes), os.path.join(args.out, "trained", "goldens.json"))
    print("trained: vocab %d, %d cases" % (trained.get_vocab_size(), len(strings) + len(bad_bytes)))

    ranks = qwen_ranks()
    merges = merges_from_ranks(ranks)
    vocab = {bl(t): r for t, r in ranks.items()}
    added = [(151643 + i, c, s) for i, (c, s) in enumerate(QWEN_ADDED)]
    full = qwen_shell(vocab, [[bl(a), bl(b)] for a, b in merges], added)
    full_tok = Tokenizer.from_str(json.dumps(full))
    if args.full_qwen:
        with open(args.full_qwen, "w", encoding="utf-8") as f:
            json.dump(full, f, ensure_ascii=False)
    # The subset: merges whose result occurs in some (normalised or replaced) test string.
    texts = [s.encode() for s in strings] + [unicodedata.normalize("NFC", s).encode() for s in strings]
    texts += [b.decode("utf-8", "replace").encode() for b in bad_bytes]
    corpus = b"\x00".join(texts)
    bigrams = {corpus[i:i + 2] for i in range(len(corpus) - 1)}
    keep = [(a, b) for a, b in merges if (a + b)[:2] in bigrams and (a + b) in corpus]
    keep_set = {a + b for a, b in keep}
    sub_vocab = {bl(t): r for t, r in ranks.items() if len(t) == 1 or t in keep_set}
    sub = qwen_shell(sub_vocab, [[bl(a), bl(b)] for a, b in keep], added)
    path = os.path.join(args.out, "qwen", "tokenizer.json")
    dump(sub, path)
    sub_tok = Tokenizer.from_file(path)
    g = goldens(full_tok, random.Random(5), strings, bad_bytes)
    # `tokenizers` renumbers added tokens after the last vocabulary entry when it loads a file whose ids have
    # holes (it ignores the file's added-token ids), so the check compares tokens, and ids of the rest.
    added_ids = {i for i, _, _ in added}
    for c in g["cases"]:
        text = c["text"] if "text" in c else bytes.fromhex(c["bytes_hex"]).decode("utf-8", "replace")
        e_sub, e_full = sub_tok.encode(text), full_tok.encode(text)
        if e_sub.tokens != e_full.tokens or any(a != b for a, b in zip(e_sub.ids, e_full.ids) if b not in added_ids):
            sys.exit("the cut-down Qwen vocabulary encodes %r differently from the full one" % text)
    # Decode cases must only use ids the subset has.
    sub_ids = set(sub_vocab.values()) | added_ids
    g["decode_cases"] = [d for d in g["decode_cases"] if all(i in sub_ids for i in d["ids"])]
    dump(g, os.path.join(args.out, "qwen", "goldens.json"))
    print("qwen: full vocab %d, merges %d; subset vocab %d, merges %d; %d cases" %
          (full_tok.get_vocab_size(), len(merges), len(sub_vocab), len(keep), len(g["cases"])))
    dump(nfc_cases(random.Random(6)), os.path.join(args.out, "nfc.json"))
    for c in chats:
        c["ids"] = full_tok.encode(c["text"]).ids
    dump({"template": "Qwen3 tokenizer_config.json chat_template, rendered by transformers apply_chat_template",
          "cases": chats}, os.path.join(args.out, "chat.json"))


if __name__ == "__main__":
    main()
