#!/usr/bin/env bash
# moetrain's tokenizer vs Hugging Face `tokenizers`, one thread each, on the same text: checks the ids line by
# line, then prints both benchmarks' JSON lines. Usage:
#   bench/tokenize_compare.sh TOKENIZER_JSON [PYTHON_WITH_TOKENIZERS] [TEXT_FILE]
# Without TEXT_FILE it builds one (~6 MB) from this repository's docs and sources and the tokenizer goldens'
# multilingual strings. The full Qwen tokenizer.json comes from
#   tools/make_tokenizer_goldens.py --out /tmp/tok_goldens --full-qwen /tmp/qwen_full_tokenizer.json
set -euo pipefail
cd "$(dirname "$0")/.."
tok=${1:?tokenizer.json}
py=${2:-python3}
text=${3:-}
if [ -z "$text" ]; then
  text=/tmp/moetrain_tokenize_bench.txt
  "$py" - "$text" <<'PY'
import glob, json, sys
parts = []
for pat in ["README.md", "docs/*.md", "src/*/*.h", "src/*/*.cpp", "src/*/*/*.cpp", "tests/*/*.cpp"]:
    for p in sorted(glob.glob(pat)):
        if "unicode_tables" in p:
            continue
        parts.append(open(p, encoding="utf-8", errors="replace").read())
cases = json.load(open("tests/assets/tokenizer/qwen/goldens.json"))["cases"]
multi = "\n".join(c["text"].replace("\n", " ") for c in cases if "text" in c and len(c["text"]) < 2000)
text = ("\n".join(parts) + "\n" + multi + "\n") * 2
open(sys.argv[1], "w", encoding="utf-8").write(text)
PY
fi
ids=/tmp/moetrain_tokenize_bench.ids
${MOETRAIN:-build/moetrain} tokenize --tokenizer "$tok" < "$text" > "$ids" 2>/dev/null
${MOETRAIN:-build/moetrain} tokenize --tokenizer "$tok" --bench --file "$text"
RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$py" bench/tokenize_peer.py --tokenizer "$tok" --file "$text" --check "$ids"
