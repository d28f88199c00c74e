#!/usr/bin/env bash
# Runs the CUDA kernels of src/cuda on the CPU (tests/cuda_emulation/emu.h,
# a fiber-per-thread emulator) and checks them against the float64 reference.
# Needs g++ (C++17) and the CUDA headers (CUDA_INCLUDE, default /usr/local/cuda/include);
# no GPU, no nvcc. scripts/test.sh (CI) runs it when the headers are there; not in CMake.
#
#   scripts/cuda_emulate.sh [family ...] [-v]
#     families: block_fused block_generic phase1 phase2 (default: all)
#
# Exit status: 0 when every check passes, 1 on any mismatch, 2 on a build error.
# The kernels build from src/cuda as they are: the driver includes their headers
# (block_attn_res_*.cuh, phase1_kernel.cuh, phase2_kernel.cuh) after emu.h, and
# common.cuh's ATTNRES_DYNAMIC_SHARED points the dynamic shared memory at the
# emulator's. Objects go to a fresh temp dir (under TMPDIR), removed on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_INCLUDE="${CUDA_INCLUDE:-/usr/local/cuda/include}"
CXX="${CXX:-g++}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/attnres_cuda_emu.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if [[ ! -f "$CUDA_INCLUDE/cuda_runtime.h" ]]; then
  echo "cuda_emulate: no CUDA headers at $CUDA_INCLUDE (set CUDA_INCLUDE)" >&2
  exit 2
fi

echo "cuda_emulate: building (g++ against $CUDA_INCLUDE) ..."
start=$(date +%s)
# The reference is built in the background while the driver compiles.
"$CXX" -std=c++17 -O2 -c -I"$ROOT/src" -I"$ROOT/include" "$ROOT/src/ref/reference.cc" -o "$WORK/reference.o" &
ref1=$!
"$CXX" -std=c++17 -O2 -c -I"$ROOT/src" -I"$ROOT/include" "$ROOT/src/ref/two_phase_reference.cc" -o "$WORK/two_phase_reference.o" &
ref2=$!
if ! "$CXX" -std=c++17 -O2 -w -I"$CUDA_INCLUDE" -I"$ROOT/include" -I"$ROOT/src" \
    -I"$ROOT/tests/cuda_emulation" -include emu.h \
    -c "$ROOT/tests/cuda_emulation/driver.cc" -o "$WORK/driver.o"; then
  echo "cuda_emulate: build failed" >&2
  exit 2
fi
wait $ref1 && wait $ref2 || { echo "cuda_emulate: reference build failed" >&2; exit 2; }
"$CXX" "$WORK/driver.o" "$WORK/reference.o" "$WORK/two_phase_reference.o" -o "$WORK/cuda_emulate" || exit 2
echo "cuda_emulate: built in $(( $(date +%s) - start )) s; running ..."
start=$(date +%s)
status=0
"$WORK/cuda_emulate" "$@" || status=$?
echo "cuda_emulate: ran in $(( $(date +%s) - start )) s; $([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit $status
