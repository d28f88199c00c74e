#!/usr/bin/env bash
# Builds the library, the attnres tool and the C++ tests into build/, and
# installs the Python package. Extra arguments go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
# The wheel builds the CUDA backend too when nvcc is found; ATTNRES_WHEEL_CUDA=OFF
# skips that second CUDA compile (CI: the CMake build above already compiles and
# links it, and there is no GPU to route tensors to).
if ! log=$(python3 -m pip install -q --no-build-isolation \
    -C cmake.define.ATTNRES_CUDA="${ATTNRES_WHEEL_CUDA:-ON}" . 2>&1); then
  echo "$log"
  exit 1
fi
python3 -c "import block_attnres, attnres" # fails loudly if the install (or its alias) did not work
