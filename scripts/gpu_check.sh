#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine: a Release build for the
# GPU's own architecture, every GoogleTest (the property tests run on each CPU
# variant and on CUDA), a short case list under
# compute-sanitizer (memcheck, racecheck, synccheck), the Python front ends on CUDA
# tensors (tests/python/test_cuda.py), then the benchmark against PyTorch eager /
# torch.compile / Liger and the two phases (bench/bench_cuda.py).
# Prints one JSON document, writes it to ${OUT:-$BUILD_DIR}/gpu_check.json with
# the logs next to it, and exits 1 unless every stage passed. Every stage is
# time-boxed; with the defaults the whole run stays under 9 minutes.
#
# Usage: scripts/gpu_check.sh [--prebuilt DIR] [--build-only] [--no-bench] [--bench-only]
#   --prebuilt DIR   skip the build: DIR holds attnres_tests and libattnres.so*
#                    built elsewhere (e.g. `--build-only` with CUDA_ARCHS=90 on a
#                    machine without a GPU, then carried over), or by a previous run
#   --build-only     configure and build, nothing else (no GPU needed)
#   --no-bench       stop after the tests and the sanitizer
#   --bench-only     only the benchmark (with --prebuilt: a second, separate call)
# Environment knobs:
#   BUILD_DIR        build directory (default build-gpu-check)
#   CUDA_ARCHS       architectures to compile; default: the compute capability
#                    nvidia-smi reports (e.g. 90), else "native"
#   SANITIZE         0 skips compute-sanitizer (reported as skipped, not passed)
#   BUILD_TIMEOUT_S  seconds for the build (480; 3600 with --build-only)
#   TEST_TIMEOUT_S   seconds for the GoogleTests (300)
#   GTEST_SHARDS     GoogleTest processes run side by side (1)
#   SANITIZER_TIMEOUT_S  seconds for each compute-sanitizer tool (120)
#   SANITIZER_TOOLS  the compute-sanitizer tools to run ("memcheck racecheck synccheck")
#   PYTEST_TIMEOUT_S seconds for the Python tests on CUDA tensors (150)
#   BENCH_BUDGET_S   seconds after which bench baselines are skipped (150)
#   BENCH_ARGS       extra arguments for bench/bench_cuda.py
#   DEADLINE_S       wall-clock seconds for the whole run (default: none): every
#                    stage's time box is cut to what is left, a stage with less
#                    than 20 s left is not started (and counts as a failure), and
#                    the report is always written. Use it when the caller kills
#                    the command at a limit (e.g. DEADLINE_S=560 under 600 s).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREBUILT="" BUILD_ONLY=0 RUN_BENCH=1 RUN_TESTS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) PREBUILT="$(cd "$2" && pwd)"; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --no-bench) RUN_BENCH=0; shift ;;
    --bench-only) RUN_TESTS=0; shift ;;
    *) echo "usage: $0 [--prebuilt DIR] [--build-only] [--no-bench] [--bench-only]" >&2; exit 2 ;;
  esac
done
BUILD_DIR="${BUILD_DIR:-$ROOT/build-gpu-check}"
[ -n "$PREBUILT" ] && BUILD_DIR="$PREBUILT"
OUT_DIR="${OUT:-$BUILD_DIR}"
LOG_DIR="$OUT_DIR/gpu_check_logs"
mkdir -p "$LOG_DIR"
START=$(date +%s)
NOT_RUN=""
# The time box of a stage: its own, cut to what DEADLINE_S leaves (15 s kept for
# the report); prints 0 when fewer than 20 s would be left.
time_box() {
  local want=$1
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$(( DEADLINE_S - ($(date +%s) - START) - 15 ))
    [ "$left" -lt "$want" ] && want=$left
  fi
  [ "$want" -lt 20 ] && want=0
  echo "$want"
}

for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) export PATH="$PATH:$d" ;; esac
done

# --- 0. What the machine has ----------------------------------------------------
GPU_LIST="$(nvidia-smi -L 2>&1)" || { SMI_ERROR="$GPU_LIST"; GPU_LIST=""; }
# nvidia-smi installed but failing (no driver loaded, a wedged GPU) is a finding
# of its own, not "no GPU here".
SMI_INSTALLED=0; command -v nvidia-smi >/dev/null 2>&1 && SMI_INSTALLED=1
GPU_COUNT=$(printf '%s\n' "$GPU_LIST" | grep -c '^GPU ' || true)
# "9.0" -> "90", one entry per distinct GPU model.
DETECTED_ARCHS="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
  tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd ';' -)"
CUDA_ARCHS="${CUDA_ARCHS:-${DETECTED_ARCHS:-native}}"
nvidia-smi >"$LOG_DIR/nvidia-smi.log" 2>&1 || true
{ nvcc --version; command -v compute-sanitizer; } >"$LOG_DIR/toolkit.log" 2>&1 || true

# --- 1. Configure + build -------------------------------------------------------
CONFIGURE_RC=-1 BUILD_RC=-1 TESTS_BUILT=0 CUDA_IN_BUILD=0
if [ -z "$PREBUILT" ]; then
  GENERATOR=()
  command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
  configure() {
    cmake -S "$ROOT" -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DATTNRES_CUDA=ON \
      -DATTNRES_CUDA_ARCHITECTURES="$CUDA_ARCHS" -DATTNRES_BUILD_TOOLS=OFF "$@" \
      >"$LOG_DIR/configure.log" 2>&1
  }
  TESTS_BUILT=1
  configure -DATTNRES_BUILD_TESTS=ON
  CONFIGURE_RC=$?
  if [ $CONFIGURE_RC -ne 0 ]; then
    # Most likely GoogleTest is missing on this machine: build the library alone.
    TESTS_BUILT=0
    configure -DATTNRES_BUILD_TESTS=OFF
    CONFIGURE_RC=$?
  fi
  # cmake/cuda.cmake prints this line when the CUDA backend is part of the build.
  if grep -q "attnres: CUDA backend on" "$LOG_DIR/configure.log"; then CUDA_IN_BUILD=1; fi
  if [ $CONFIGURE_RC -eq 0 ]; then
    BOX=$(time_box "${BUILD_TIMEOUT_S:-$([ "$BUILD_ONLY" -eq 1 ] && echo 3600 || echo 480)}")
    if [ "$BOX" -gt 0 ]; then
      timeout "$BOX" cmake --build "$BUILD_DIR" -j"$(nproc)" >"$LOG_DIR/build.log" 2>&1
      BUILD_RC=$?
    else
      NOT_RUN="$NOT_RUN build"
    fi
  fi
else
  CONFIGURE_RC=0 BUILD_RC=0
  [ -x "$BUILD_DIR/attnres_tests" ] && TESTS_BUILT=1
  # A copy of a build folder may have lost the library's symlinks.
  for lib in "$BUILD_DIR"/libattnres.so.*.*.*; do
    [ -e "$lib" ] || continue
    [ -e "$BUILD_DIR/libattnres.so.0" ] || ln -s "$(basename "$lib")" "$BUILD_DIR/libattnres.so.0"
    [ -e "$BUILD_DIR/libattnres.so" ] || ln -s "$(basename "$lib")" "$BUILD_DIR/libattnres.so"
  done
  # A string only the CUDA backend's code contains (src/cuda/runtime.cu).
  if grep -qa "ATTNRES_CUDA_MAX_CTAS" "$BUILD_DIR"/libattnres.so* 2>/dev/null; then CUDA_IN_BUILD=1; fi
fi
export LD_LIBRARY_PATH="$BUILD_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- 2. GPU GoogleTests ----------------------------------------------------------
TEST_RC=-1
GPU_TESTS=0
[ "$BUILD_ONLY" -eq 0 ] && [ "$GPU_COUNT" -gt 0 ] && GPU_TESTS=1
if [ "$BUILD_ONLY" -eq 0 ] && [ "$RUN_TESTS" -eq 1 ] && [ $BUILD_RC -eq 0 ] && [ $TESTS_BUILT -eq 1 ]; then
  # The whole suite: the property tests (reference, determinism, NaN isolation,
  # finite differences, ...) run on every backend present (tests/cpp/test_util.h:
  # ForEachBackend), CUDA among them. With a GPU listed, "no device" is a failure
  # (CudaBackend.DeviceIsPresentWhenExpected), so they cannot pass on the CPU alone.
  BOX=$(time_box "${TEST_TIMEOUT_S:-300}")
  if [ "$BOX" -gt 0 ]; then
    # GoogleTest's own sharding: GTEST_SHARDS processes side by side, each a disjoint
    # slice of the tests (the float64 references are CPU work, one core each).
    SHARDS=${GTEST_SHARDS:-1} PIDS=()
    for ((i = 0; i < SHARDS; i++)); do
      ATTNRES_EXPECT_CUDA=$GPU_TESTS GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i \
        timeout "$BOX" "$BUILD_DIR/attnres_tests" --gtest_output="json:$LOG_DIR/gtest_$i.json" \
        >"$LOG_DIR/gtest_$i.log" 2>&1 &
      PIDS+=($!)
    done
    TEST_RC=0
    for pid in "${PIDS[@]}"; do
      wait "$pid"; rc=$?
      [ "$rc" -gt "$TEST_RC" ] && TEST_RC=$rc
    done
  else
    NOT_RUN="$NOT_RUN tests"
  fi
fi

# --- 3. compute-sanitizer on the short case list --------------------------------
SANITIZER_RESULTS=""
if [ "$RUN_TESTS" -eq 1 ] && [ "$GPU_TESTS" -eq 1 ] && [ $BUILD_RC -eq 0 ] && [ $TESTS_BUILT -eq 1 ]; then
  if [ "${SANITIZE:-1}" = "0" ]; then
    SANITIZER_RESULTS="all=skipped-by-request"
  elif ! command -v compute-sanitizer >/dev/null 2>&1; then
    SANITIZER_RESULTS="all=unavailable"
  else
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
      BOX=$(time_box "${SANITIZER_TIMEOUT_S:-120}")
      if [ "$BOX" -eq 0 ]; then NOT_RUN="$NOT_RUN sanitizer-$tool"; continue; fi
      timeout "$BOX" compute-sanitizer --tool "$tool" --error-exitcode 86 --print-limit 20 \
        "$BUILD_DIR/attnres_tests" --gtest_filter='CudaBackend.SanitizerCases' \
        >"$LOG_DIR/sanitizer_$tool.log" 2>&1
      SANITIZER_RESULTS="$SANITIZER_RESULTS $tool=$?"
    done
  fi
fi

LIB="$(ls "$BUILD_DIR"/libattnres.so 2>/dev/null | head -n1)"

# --- 4. The Python front ends on CUDA tensors ------------------------------------
PYTEST_RC=-1
if [ "$RUN_TESTS" -eq 1 ] && [ "$GPU_TESTS" -eq 1 ] && [ $BUILD_RC -eq 0 ] && [ -n "$LIB" ]; then
  BOX=$(time_box "${PYTEST_TIMEOUT_S:-150}")
  if [ "$BOX" -gt 0 ]; then
    ATTNRES_EXPECT_CUDA=1 ATTNRES_LIBRARY="$LIB" PYTHONPATH="$ROOT/python" timeout "$BOX" \
      python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/python/test_cuda.py" \
      --junitxml="$LOG_DIR/pytest.xml" >"$LOG_DIR/pytest.log" 2>&1
    PYTEST_RC=$?
  else
    NOT_RUN="$NOT_RUN pytest"
  fi
fi

# --- 5. Benchmark -------------------------------------------------------------
BENCH_RC=-1
if [ "$BUILD_ONLY" -eq 0 ] && [ "$RUN_BENCH" -eq 1 ] && [ "$GPU_TESTS" -eq 1 ] && [ $BUILD_RC -eq 0 ] && [ -n "$LIB" ]; then
  BOX=$(time_box $(( ${BENCH_BUDGET_S:-150} + 90 )))
  if [ "$BOX" -gt 0 ]; then
    # Baselines stop once the budget is spent; attnres's own rows continue.
    BUDGET=$(( BOX - 90 > 0 ? BOX - 90 : 0 ))
    [ "$BUDGET" -gt "${BENCH_BUDGET_S:-150}" ] && BUDGET=${BENCH_BUDGET_S:-150}
    # shellcheck disable=SC2086
    PYTHONPATH="$ROOT/python" timeout "$BOX" python3 "$ROOT/bench/bench_cuda.py" \
      --lib "$LIB" --budget-s "$BUDGET" ${BENCH_ARGS:-} \
      >"$LOG_DIR/bench.json" 2>"$LOG_DIR/bench.log"
    BENCH_RC=$?
  else
    NOT_RUN="$NOT_RUN bench"
  fi
fi

# --- Report -------------------------------------------------------------------
export GC_CONFIGURE_RC=$CONFIGURE_RC GC_BUILD_RC=$BUILD_RC GC_TESTS_BUILT=$TESTS_BUILT
export GC_TEST_RC=$TEST_RC GC_BENCH_RC=$BENCH_RC GC_LOG_DIR="$LOG_DIR" GC_PYTEST_RC=$PYTEST_RC
export GC_WALL=$(( $(date +%s) - START )) GC_CUDA_IN_BUILD=$CUDA_IN_BUILD
export GC_GPU_COUNT=$GPU_COUNT GC_GPU_LIST="$GPU_LIST" GC_SMI_ERROR="${SMI_ERROR:-}" GC_ARCHS="$CUDA_ARCHS"
export GC_DETECTED_ARCHS="$DETECTED_ARCHS" GC_SANITIZER="$SANITIZER_RESULTS"
export GC_BUILD_ONLY=$BUILD_ONLY GC_RUN_BENCH=$RUN_BENCH GC_RUN_TESTS=$RUN_TESTS GC_PREBUILT="$PREBUILT"
export GC_NOT_RUN="$NOT_RUN" GC_SMI_INSTALLED=$SMI_INSTALLED
python3 - "$OUT_DIR/gpu_check.json" <<'EOF'
import glob, json, os, re, sys
import xml.etree.ElementTree as ET

env = os.environ
log = env["GC_LOG_DIR"]

def read_json(name):
    try:
        with open(os.path.join(log, name)) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        return {"unavailable": str(e)}

def read_lines(name):
    try:
        with open(os.path.join(log, name), errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []

def tail(name, n=40):
    return read_lines(name)[-n:]

rc = lambda name: int(env[name])
gpu_count = int(env["GC_GPU_COUNT"])
build_only = env["GC_BUILD_ONLY"] == "1"
failures = [f"{stage} not run: DEADLINE_S reached" for stage in env["GC_NOT_RUN"].split()]
if env["GC_SMI_INSTALLED"] == "1" and env["GC_SMI_ERROR"]:
    failures.append(f"nvidia-smi is installed but failed: {env['GC_SMI_ERROR'][:300]}")

if rc("GC_CONFIGURE_RC") != 0:
    failures.append(f"configure failed (exit {rc('GC_CONFIGURE_RC')})")
if rc("GC_BUILD_RC") != 0:
    failures.append(f"build failed (exit {rc('GC_BUILD_RC')}; 124: timed out)")
if env["GC_CUDA_IN_BUILD"] != "1":
    failures.append("the CUDA backend is not part of the build (nvcc not found, or ATTNRES_CUDA off)")
run_tests = env["GC_RUN_TESTS"] == "1"
if not build_only and run_tests and gpu_count > 0 and env["GC_TESTS_BUILT"] != "1":
    failures.append("a GPU is listed but the GoogleTests were not built (GoogleTest missing?)")

# Each test: passed / failed / skipped, with the skip reason (which carries the
# CUDA runtime's own error when the device was not usable).
tests = {}
shard_files = sorted(glob.glob(os.path.join(log, "gtest_*.json")))
suites = [s for f in shard_files for s in read_json(os.path.basename(f)).get("testsuites", [])]
for suite in suites:
    for t in suite.get("testsuite", []):
        name = f"{suite['name']}.{t['name']}"
        if t.get("failures"):
            tests[name] = "failed"
        elif t.get("result") == "SKIPPED":
            tests[name] = "skipped"
        else:
            tests[name] = "passed"
# The reason gtest prints after "<file>:<line>: Skipped", per test: for "no CUDA
# device" it carries the CUDA runtime's own error.
skip_reasons, current = {}, None
shard_logs = [os.path.basename(f) for f in sorted(glob.glob(os.path.join(log, "gtest_*.log")))]
lines = [line for name in shard_logs for line in read_lines(name)]
for i, line in enumerate(lines):
    m = re.match(r"\[ RUN      \] (\S+)", line)
    if m:
        current = m.group(1)
    elif line.rstrip().endswith(": Skipped") and i + 1 < len(lines) and current:
        skip_reasons[current] = lines[i + 1].strip()
skipped_because = {}  # reason -> tests, for the report
for name, reason in skip_reasons.items():
    skipped_because.setdefault(reason, []).append(name)
# With a device present, no CUDA test may skip but these, the tests of what happens
# without one. (CPU-only tests may skip for reasons of the host, e.g. LargeOffsets
# without a large mapping.)
expected_skips = {"CudaBackend.UnavailableDeviceIsReported", "CudaTwoPhase.UnavailableDeviceIsReported",
                  "AbiErrors.CudaDeviceWhenUnavailable"}
if not build_only and run_tests and gpu_count > 0 and env["GC_TESTS_BUILT"] == "1":
    if not tests:
        failures.append(f"the GoogleTests did not report (exit {rc('GC_TEST_RC')}; 124: timed out)")
    failed = sorted(n for n, s in tests.items() if s == "failed")
    skipped = sorted(n for n, s in tests.items() if s == "skipped" and "Cuda" in n
                     and n not in expected_skips)
    if failed:
        failures.append(f"{len(failed)} test(s) failed: {', '.join(failed)}")
    if skipped:
        failures.append(f"{len(skipped)} CUDA test(s) skipped although a GPU is listed: "
                        f"{', '.join(skipped)}; first reason: {skip_reasons.get(skipped[0], '?')}")
    if rc("GC_TEST_RC") not in (0,) and not failed:
        failures.append(f"attnres_tests exited {rc('GC_TEST_RC')} (124: timed out, 134/139: crashed)")

sanitizer = dict(item.split("=", 1) for item in env["GC_SANITIZER"].split())
for tool, result in sanitizer.items():
    if result == "skipped-by-request":
        continue
    if result == "unavailable":
        failures.append("compute-sanitizer not found (set SANITIZE=0 to skip it knowingly)")
    elif result != "0":
        failures.append(f"compute-sanitizer --tool {tool} exited {result} (86: reported errors; "
                        f"124: timed out): see sanitizer_{tool}.log")
# The Python tests: counts from pytest's JUnit XML, each failure by name.
pytest_report = None
if rc("GC_PYTEST_RC") != -1:
    try:
        cases = ET.parse(os.path.join(log, "pytest.xml")).getroot().iter("testcase")
        outcome = {}
        for case in cases:
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            outcome.setdefault(kind, []).append(f"{case.get('classname')}::{case.get('name')}")
        pytest_report = {k: len(v) for k, v in outcome.items()}
        pytest_report["not_passed"] = sorted(outcome.get("failure", []) + outcome.get("error", []))
    except (OSError, ET.ParseError) as e:
        pytest_report = {"unreadable": str(e)}
    if rc("GC_PYTEST_RC") != 0:
        failures.append(f"the Python tests on CUDA exited {rc('GC_PYTEST_RC')} (124: timed out): "
                        "see pytest.log")
if (not build_only and gpu_count > 0 and env["GC_RUN_BENCH"] == "1" and "bench" not in env["GC_NOT_RUN"]
        and rc("GC_BENCH_RC") != 0):
    failures.append(f"bench_cuda.py exited {rc('GC_BENCH_RC')}")
bench = read_json("bench.json") if rc("GC_BENCH_RC") != -1 else None
for row in (bench or {}).get("results", []) if isinstance(bench, dict) else []:
    for direction in ("fwd", "bwd"):
        if row.get(f"pipelined_{direction}_bits_equal") is False:
            failures.append(f"the pipelined {direction}'s bits differ from the register kernels' at "
                            f"T={row['tokens']} D={row['dim']} L={row['sources']}")

report = {
    "ok": not failures,
    "failures": failures,
    "gpus": env["GC_GPU_LIST"].splitlines(),
    "nvidia_smi_error": env["GC_SMI_ERROR"] or None,
    "architectures_built": env["GC_ARCHS"],
    "architectures_detected": env["GC_DETECTED_ARCHS"],
    "prebuilt": env["GC_PREBUILT"] or None,
    "wall_s": int(env["GC_WALL"]),
    "cuda_backend_compiled": env["GC_CUDA_IN_BUILD"] == "1",
    "tests_built": env["GC_TESTS_BUILT"] == "1",
    "gtest_exit": rc("GC_TEST_RC"),
    "gtests": tests,
    "skipped_because": skipped_because,
    "gtest_log_tails": {name: tail(name, 40) for name in shard_logs} if rc("GC_TEST_RC") != 0 else {},
    "sanitizer": sanitizer,
    "sanitizer_log_tails": {t: tail(f"sanitizer_{t}.log", 30) for t, r in sanitizer.items()
                            if r not in ("0", "skipped-by-request", "unavailable")},
    "pytest_exit": rc("GC_PYTEST_RC"),
    "pytest": pytest_report,
    "pytest_log_tail": tail("pytest.log", 60) if rc("GC_PYTEST_RC") not in (-1, 0) else [],
    "bench_exit": rc("GC_BENCH_RC"),
    "bench": bench,
    "bench_log_tail": tail("bench.log", 20) if rc("GC_BENCH_RC") not in (-1, 0) else [],
    "configure_log_tail": tail("configure.log", 30) if rc("GC_CONFIGURE_RC") != 0 else [],
    "build_log_tail": tail("build.log", 40) if rc("GC_BUILD_RC") != 0 else [],
}
text = json.dumps(report, indent=2)
print(text)
# The verdict once more, last: a caller that keeps only the output's tail sees it.
counts = {s: sum(1 for v in tests.values() if v == s) for s in ("passed", "failed", "skipped")}
print(json.dumps({"ok": report["ok"], "failures": failures, "gtests": counts,
                  "pytest": pytest_report, "sanitizer": sanitizer}))
with open(sys.argv[1], "w") as f:
    f.write(text + "\n")
sys.exit(0 if report["ok"] else 1)
EOF
