#!/usr/bin/env bash
# aarch64 portability check: cross-compiles the library, the C++ tests and the
# attnres tool for aarch64 Linux with Debian's g++-aarch64-linux-gnu into
# build-aarch64/ (the baseline kernels: the compiler's generic vectors, NEON
# there; no CUDA, no Python) and runs the C++ tests and `attnres check` under
# qemu-user. GoogleTest is built for the target from Debian's sources
# (/usr/src/googletest) once, into build-aarch64/googletest/.
# Idempotent: a second run only rebuilds what changed.
# ATTNRES_BUILD_JOBS sets -j (default: all cores).
#
# Under qemu the whole C++ suite takes ~5.5 min (2 cores); by default it leaves out
# the three slowest tests (~3.2 min of it), whose code is the same C++ on every
# ISA and runs natively in scripts/test.sh: StreamingStores (non-temporal stores,
# plain stores outside x86), LargeOffsets (64-bit row offsets beyond 2^31
# elements) and Determinism.F32ManyTokens (Determinism.Bf16OddTokenCountNoPartial
# stays). ATTNRES_AARCH64_GTEST_FILTER='*' runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."

triple=aarch64-linux-gnu
sysroot=/usr/$triple
build=build-aarch64
jobs=${ATTNRES_BUILD_JOBS:-$(nproc)}
start=$SECONDS
gtest_filter=${ATTNRES_AARCH64_GTEST_FILTER-"-StreamingStores.*:LargeOffsets.*:Determinism.F32ManyTokens"}

bash scripts/apt_install.sh g++-aarch64-linux-gnu qemu-user googletest cmake ninja-build

toolchain=$PWD/cmake/aarch64-linux-gnu.cmake
gtest_prefix=$PWD/$build/googletest
gtest_version=$(dpkg-query -W -f='${Version}' googletest)
if [ "$(cat "$gtest_prefix/.version" 2>/dev/null)" != "$gtest_version" ]; then
  echo "== GoogleTest $gtest_version for $triple"
  rm -rf "$gtest_prefix" "$build/googletest-build"
  mkdir -p "$build"
  log=$build/googletest.log  # Debian's googletest sources warn under newer CMake: quiet unless it fails
  if ! { cmake -S /usr/src/googletest -B "$build/googletest-build" -G Ninja \
           -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_BUILD_TYPE=Release \
           -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX="$gtest_prefix" &&
         cmake --build "$build/googletest-build" -j"$jobs" &&
         cmake --install "$build/googletest-build"; } >"$log" 2>&1; then
    cat "$log"
    exit 1
  fi
  echo "$gtest_version" >"$gtest_prefix/.version"
fi

echo "== cross build for $triple ($build/)"
cmake -S . -B "$build" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$toolchain" \
  -DCMAKE_BUILD_TYPE=Release -DATTNRES_CUDA=OFF -DATTNRES_PYTHON=OFF \
  -DATTNRES_BUILD_TESTS=ON -DATTNRES_BUILD_TOOLS=ON \
  -DGTest_DIR="$gtest_prefix/lib/cmake/GTest" >/dev/null
cmake --build "$build" -j"$jobs" --target attnres_tests attnres_cli
echo "   built in $((SECONDS - start)) s"

qemu=(qemu-aarch64 -L "$sysroot")
"$triple-readelf" -h "$build/attnres" | grep -q "Machine: *AArch64" ||
  { echo "$build/attnres is not an aarch64 binary"; exit 1; }
version=$("${qemu[@]}" "$build/attnres" --version)
echo "$version"
grep -q "isa baseline" <<<"$version" || { echo "expected the baseline kernels on $triple"; exit 1; }

echo "== C++ tests under qemu-aarch64"
t=$SECONDS
"${qemu[@]}" "$build/attnres_tests" --gtest_brief=1 ${gtest_filter:+--gtest_filter="$gtest_filter"}
echo "   C++ tests took $((SECONDS - t)) s"

echo "== attnres check under qemu-aarch64"
t=$SECONDS
"${qemu[@]}" "$build/attnres" check --cases 200
echo "   check took $((SECONDS - t)) s"
echo "== aarch64: all passed in $((SECONDS - start)) s"
