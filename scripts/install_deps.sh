#!/usr/bin/env bash
# Installs what building and testing moetrain needs on Debian 12 (or Ubuntu): compilers, CMake,
# GoogleTest, OpenBLAS, nlohmann-json. Idempotent: does nothing when everything is present.
set -euo pipefail
pkgs=(build-essential cmake libgtest-dev libopenblas-dev nlohmann-json3-dev python3)
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
