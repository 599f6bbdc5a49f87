#!/usr/bin/env bash
# Prepares .deps/device: copies of the dependencies a GPU machine without a package manager lacks
# (nlohmann-json headers, GoogleTest sources, cudnn-frontend and CUTLASS headers, PCRE2's header and static
# library for the tokenizer), to be carried there
# by the device tool (carry: [".deps/device"]). Run on a development machine after install_deps.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
out=.deps/device
rm -rf "$out" && mkdir -p "$out/include"
cp -r /usr/include/nlohmann "$out/include/"
cp -r /usr/src/googletest "$out/googletest"
cp -r .deps/pip/include/* "$out/include/"
mkdir -p "$out/cutlass"
cp -r .deps/pip/cutlass_library/source/include "$out/cutlass/include"
cp -r .deps/pip/cutlass_library/source/tools/util/include "$out/cutlass/util_include"
mkdir -p "$out/pcre2/include" "$out/pcre2/lib"
cp /usr/include/pcre2.h "$out/pcre2/include/"
cp "$(find /usr/lib -name libpcre2-8.a | head -1)" "$out/pcre2/lib/"
du -sh "$out"
