#!/usr/bin/env bash
# Builds the libFuzzer target of the C ABI (clang, ASan + UBSan) into build-fuzz/
# and runs it for N seconds (default 60) from the shipped seeds in
# tests/fuzz/corpus/ (new inputs go to a scratch directory, so the seeds do not
# grow). Prints the number of executions; exits non-zero on any finding, whose
# reproducer is left in build-fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS]      ATTNRES_BUILD_JOBS sets the build's -j.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"

cc="" cxx=""
for v in -16 -17 -18 ""; do  # _Float16 on x86 needs clang >= 15
  if command -v "clang++$v" >/dev/null 2>&1 && command -v "clang$v" >/dev/null 2>&1; then
    cc="clang$v" cxx="clang++$v"
    break
  fi
done
if [ -z "$cxx" ]; then
  echo "fuzz.sh: clang not found (scripts/setup.sh installs clang-16 and its runtime)" >&2
  exit 1
fi

cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DATTNRES_FUZZ=ON \
  -DATTNRES_BUILD_TESTS=OFF -DATTNRES_BUILD_TOOLS=OFF -DATTNRES_CUDA=OFF >/dev/null
cmake --build build-fuzz --target attnres_fuzz_abi -j"${ATTNRES_BUILD_JOBS:-$(nproc)}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p build-fuzz/artifacts
log=build-fuzz/fuzz.log
status=0
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" ATTNRES_FUZZ_STATS=1 \
  ./build-fuzz/attnres_fuzz_abi -max_total_time="$seconds" -max_len=2048 -timeout=30 \
  -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/ \
  "$work" tests/fuzz/corpus >"$log" 2>&1 || status=$?
execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
if [ "$status" -ne 0 ]; then
  tail -n 60 "$log"
  echo "fuzz: FAILED after ${execs:-?} executions (exit $status); reproducer in build-fuzz/artifacts/" >&2
  exit "$status"
fi
grep -E "^attnres fuzz outcomes" "$log" || true
echo "fuzz: ${execs:-?} executions in ${seconds} s, no findings (log: $log)"
