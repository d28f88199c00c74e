# Cross-compiling for aarch64 Linux with Debian's g++-aarch64-linux-gnu
# (scripts/test_aarch64.sh):
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
# The target's libraries and headers are under /usr/aarch64-linux-gnu; programs
# run under qemu-user (qemu-aarch64 -L /usr/aarch64-linux-gnu), which CMake also
# uses as the emulator (ctest, try_run). Packages built for the target elsewhere
# (GoogleTest) are found through their <Pkg>_DIR or by adding their install
# prefix to CMAKE_FIND_ROOT_PATH.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(ATTNRES_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${ATTNRES_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${ATTNRES_CROSS_TRIPLE}-g++)

list(APPEND CMAKE_FIND_ROOT_PATH /usr/${ATTNRES_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

find_program(ATTNRES_QEMU_AARCH64 qemu-aarch64)
if(ATTNRES_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${ATTNRES_QEMU_AARCH64} -L /usr/${ATTNRES_CROSS_TRIPLE})
endif()
