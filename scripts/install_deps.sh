#!/usr/bin/env bash
# Installs what building and testing moetrain needs on Debian 12 (or Ubuntu): compilers, CMake,
# GoogleTest, OpenBLAS, nlohmann-json, Gloo, libnuma, PCRE2 from apt; and, when the CUDA toolkit is present, the
# header-only CUDA libraries Debian lacks (cudnn-frontend, CUTLASS) from PyPI into .deps/pip; and nanobind (the
# Python module's binding headers, PyPI) into .deps/pip, so every configure of the tree (make, pip install .) uses
# the same copy.
# Idempotent: does nothing when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential cmake libgtest-dev libopenblas-dev nlohmann-json3-dev python3 python3-pip python3-dev python3-venv
      libgloo-dev libnuma-dev libpcre2-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  if [ ! -f .deps/pip/include/cudnn_frontend.h ] || [ ! -d .deps/pip/cutlass_library/source/include/cutlass ]; then
    echo "install_deps: fetching header packages nvidia-cudnn-frontend, nvidia-cutlass into .deps/pip"
    python3 -m pip install -q --no-deps --target .deps/pip nvidia-cudnn-frontend==1.32.0 nvidia-cutlass==4.2.0.0 \
      || python3 -m pip install -q --break-system-packages --no-deps --target .deps/pip \
           nvidia-cudnn-frontend==1.32.0 nvidia-cutlass==4.2.0.0
  fi
fi
if [ ! -f .deps/pip/nanobind/cmake/nanobind-config.cmake ]; then
  echo "install_deps: fetching the header package nanobind into .deps/pip"
  python3 -m pip install -q --no-deps --target .deps/pip nanobind==2.9.2 \
    || python3 -m pip install -q --break-system-packages --no-deps --target .deps/pip nanobind==2.9.2
fi
