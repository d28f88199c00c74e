#!/usr/bin/env bash
# Every test: set up, build, C++ tests on every CPU kernel variant, the random
# check against the reference on every variant, a phase 1 run checked against the
# reference, the same for aarch64 under qemu (cross-built), the CUDA kernels in CPU
# emulation against the reference (when the CUDA headers are installed; no GPU
# needed), a smoke run of the benchmark, the Python tests, then the C++ tests again
# under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/) and a 60-second
# libFuzzer run of the C ABI (build-fuzz/). Any sanitizer report fails the run.
# ATTNRES_BUILD_JOBS sets -j of the sanitizer and fuzz builds (default: all
# cores); ATTNRES_FUZZ_SECONDS the length of the fuzz run (default 60).
#
# --quick, the tier for iterating: set up, build, the C++ tests without the ones that
# run large problems once per CPU variant (QUICK_GTEST_EXCLUDE), and the Python tests
# without those marked slow (tests/python/conftest.py, SLOW_TESTS). What it leaves out
# runs in the full run, which is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=false
case "$*" in
  "") ;;
  --quick) quick=true ;;
  *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
ATTNRES_WHEEL_CUDA=OFF bash scripts/build.sh
if $quick; then
  # ForEachIsa/ForEachBackend (tests/cpp/test_util.cc) run every CPU variant this CPU
  # runs and have no switch for the best one only, so the quick tier leaves out the
  # tests whose problems are large: streaming stores past the cache, the sharp logits
  # through both phases, determinism over 3000 tokens.
  QUICK_GTEST_EXCLUDE="StreamingStores.*:Sharp.TwoPhasesComposeToTheSingleOp:Determinism.F32ManyTokens"
  echo "== C++ tests (quick: without $QUICK_GTEST_EXCLUDE)"
  ./build/attnres_tests --gtest_brief=1 --gtest_filter="-$QUICK_GTEST_EXCLUDE"
  echo "== Python tests (quick: without the slow marks)"
  python3 -m pytest -q tests/python -m "not slow"
  exit 0
fi
echo "== C++ tests"
./build/attnres_tests --gtest_brief=1
echo "== attnres check on every CPU variant"
for isa in $(./build/attnres isas); do  # those compiled in that this CPU runs
  ATTNRES_CPU_ISA=$isa ./build/attnres check --cases 200
done
echo "== attnres run of phase 1 (checks a slice against the reference)"
./build/attnres run --tokens 256 --dim 2304 --blocks 9 --queries 6 --repeat 1
echo "== aarch64 cross build, C++ tests and attnres check under qemu"
bash scripts/test_aarch64.sh
echo "== CUDA kernels in CPU emulation against the float64 reference"
if [ -f "${CUDA_INCLUDE:-/usr/local/cuda/include}/cuda_runtime.h" ]; then
  bash scripts/cuda_emulate.sh
else
  echo "skipped: no CUDA headers (the CUDA backend is not built either)"
fi
echo "== attnres bench smoke run (headline shape, one repeat; numbers not judged here)"
./build/attnres bench --json --headline --no-baseline --repeat 1 | python3 -c '
import json, sys
report = json.load(sys.stdin)
(row,) = report["rows"]
assert (row["dtype"], row["dim"], row["sources"], row["tokens"]) == ("bf16", 1536, 17, 65536), row
for key in ("fwd_ms", "bwd_ms", "read_gbs", "copy_gbs", "fwd_fraction", "bwd_fraction"):
    assert row[key] > 0, (key, row)
assert all(report["scaling"][k] > 0 for k in ("fwd", "bwd", "read", "copy")), report
assert report["read_reference"] and report["copy_reference"], report
print("bench json ok:", {k: row[k] for k in ("fwd_fraction", "bwd_fraction")})'
echo "== Python tests"
python3 -m pytest -q tests/python
echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNRES_SANITIZE=ON \
  -DATTNRES_CUDA=OFF -DATTNRES_BUILD_TOOLS=OFF >/dev/null
cmake --build build-asan -j"${ATTNRES_BUILD_JOBS:-$(nproc)}"
# -fno-sanitize-recover=all makes every UBSan report fatal; ASan reports always are.
ASAN_OPTIONS=detect_leaks=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ./build-asan/attnres_tests --gtest_brief=1
echo "== libFuzzer run of the C ABI"
bash scripts/fuzz.sh "${ATTNRES_FUZZ_SECONDS:-60}"
