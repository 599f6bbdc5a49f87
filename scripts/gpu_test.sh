#!/usr/bin/env bash
# The GPU test command: builds moetrain for Hopper (sm_90a) and runs every test, the CUDA ones
# included (they compare each CUDA op with the CPU op, the model with the transformers goldens and
# the CPU loss curve). For machines without a package manager: the dependencies come from
# .deps/device (made by scripts/device_deps.sh on a development machine and carried over).
# usage: scripts/gpu_test.sh [BUILD_DIR] [ctest -R regex]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
regex=${2:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The Python module too when nanobind is there (.deps/pip, or the machine's Python).
python_module=OFF
if [ -f .deps/pip/nanobind/cmake/nanobind-config.cmake ] || python3 -c "import nanobind" 2>/dev/null; then python_module=ON; fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DMT_BUILD_TESTS=ON \
  -DMT_PYTHON=$python_module > "$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; exit 1; }
grep "moetrain:" "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)" 2>&1 | grep -E "error|warning: .*(unused|uninit)" || true
test -x "$build/moetrain_tests" || { echo "build failed"; cmake --build "$build" -j "$(nproc)"; exit 1; }
cd "$build"
ctest --output-on-failure -j 4 -R "$regex" --timeout 600
