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
# The sources are copied to a temp dir and rewritten there (src/cuda is not touched):
#   - `extern __shared__ [__align__(N)] T name[];` -> a pointer to the emulator's
#     dynamic shared memory;
#   - the device half of two_phase.cu (everything before its "// Host side."
#     banner) becomes cuda/two_phase_kernels.h.
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

mkdir -p "$WORK/src"
cp -r "$ROOT/src/." "$WORK/src/"
for f in "$WORK"/src/cuda/*.cu "$WORK"/src/cuda/*.cuh; do
  perl -0pi -e 's/extern __shared__ (?:__align__\(\d+\) )?([\w:]+(?: [\w:]+)*) (\w+)\[\];/$1* $2 = reinterpret_cast<$1*>(emu::DynSmem());/g' "$f"
done
if grep -n "extern __shared__" "$WORK"/src/cuda/*.cu "$WORK"/src/cuda/*.cuh >&2; then
  echo "cuda_emulate: an extern __shared__ declaration the rewrite does not handle (above)" >&2
  exit 2
fi
if ! grep -q '^// Host side\.' "$WORK/src/cuda/two_phase.cu"; then
  echo "cuda_emulate: two_phase.cu has no '// Host side.' banner to cut at" >&2
  exit 2
fi
{
  perl -0ne 'print $1 if /\A(.*?)\/\/ -+\n\/\/ Host side\./s' "$WORK/src/cuda/two_phase.cu"
  printf '}  // namespace\n}  // namespace cuda\n}  // namespace attnres\n'
} > "$WORK/src/cuda/two_phase_kernels.h"

echo "cuda_emulate: building (g++ against $CUDA_INCLUDE) ..."
start=$(date +%s)
# The reference is built in the background while the driver compiles.
"$CXX" -std=c++17 -O2 -c -I"$WORK/src" -I"$ROOT/include" "$WORK/src/ref/reference.cc" -o "$WORK/reference.o" &
ref1=$!
"$CXX" -std=c++17 -O2 -c -I"$WORK/src" -I"$ROOT/include" "$WORK/src/ref/two_phase_reference.cc" -o "$WORK/two_phase_reference.o" &
ref2=$!
if ! "$CXX" -std=c++17 -O2 -w -I"$CUDA_INCLUDE" -I"$ROOT/include" -I"$WORK/src" \
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
