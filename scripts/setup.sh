#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine with
# Python 3.11 and pip (idempotent: quick when everything is there).
set -euo pipefail

# clang-16 (with its compiler-rt and OpenMP) builds the libFuzzer target
# (scripts/fuzz.sh): the newest clang in Debian 12, and the first there that
# compiles _Float16 on x86-64.
bash "$(dirname "$0")/apt_install.sh" g++ cmake ninja-build libgtest-dev nlohmann-json3-dev \
  clang-16 libclang-rt-16-dev libomp-16-dev

# torch 2.13.0 is the CPU build on this machine's disk; any other version downloads GBs.
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q "pytest>=9" "scikit-build-core>=0.8" "cmake>=3.20" ninja matplotlib tqdm
