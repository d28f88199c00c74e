#!/usr/bin/env bash
# Every test: set up, build, C++ tests on every CPU kernel variant, the random
# check against the reference, and the Python tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ATTNRES_WHEEL_CUDA=OFF bash scripts/build.sh
echo "== C++ tests"
./build/attnres_tests --gtest_brief=1
echo "== attnres check on every CPU variant"
for isa in avx512 avx2 baseline; do
  if ATTNRES_CPU_ISA=$isa ./build/attnres --version | grep -q "isa $isa"; then
    ATTNRES_CPU_ISA=$isa ./build/attnres check --cases 200
  else
    echo "skipped: this CPU does not run the $isa variant"
  fi
done
echo "== Python tests"
python3 -m pytest -q tests/python
