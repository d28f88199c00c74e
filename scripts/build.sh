#!/usr/bin/env bash
# Builds the library, the attnres tool and the C++ tests into build/, and
# installs the Python package. Extra arguments go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
python3 -m pip install -q --no-build-isolation . 2>&1 | grep -v -i "warning" || true
python3 -c "import attnres" # fails loudly if the install did not work
