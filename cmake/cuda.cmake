# The CUDA backend of attnres. Included from the top-level CMakeLists.txt after
# the `attnres` (and, with ATTNRES_BUILD_TESTS, `attnres_tests`) targets exist,
# when ATTNRES_CUDA is ON and check_language(CUDA) found nvcc.
#
# Cache variables:
#   ATTNRES_CUDA_ARCHITECTURES  GPU architectures to build for (default "80;90":
#                               SASS for A100 and H100/H200, plus compute_90 PTX
#                               that later GPUs JIT-compile). "native" builds for
#                               the GPUs of this machine (CMake >= 3.24);
#                               scripts/gpu_check.sh passes the compute
#                               capability that nvidia-smi reports.

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(ATTNRES_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "CUDA architectures of the attnres CUDA backend")

# One .cu per op (block_attn_res.cu, ...) plus the shared runtime.cu; the
# headers are listed so that editing one rebuilds what includes it under any
# generator.
set(_attnres_cuda_dir ${CMAKE_CURRENT_LIST_DIR}/../src/cuda)
file(GLOB _attnres_cuda_sources CONFIGURE_DEPENDS ${_attnres_cuda_dir}/*.cu)
file(GLOB _attnres_cuda_headers CONFIGURE_DEPENDS ${_attnres_cuda_dir}/*.cuh ${_attnres_cuda_dir}/*.h)
list(APPEND _attnres_cuda_headers ${CMAKE_CURRENT_LIST_DIR}/../src/core/token_math.h)
target_sources(attnres PRIVATE ${_attnres_cuda_sources})
set_source_files_properties(${_attnres_cuda_sources} PROPERTIES
  OBJECT_DEPENDS "${_attnres_cuda_headers}")

set_target_properties(attnres PROPERTIES
  CUDA_ARCHITECTURES "${ATTNRES_CUDA_ARCHITECTURES}"
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  CUDA_VISIBILITY_PRESET hidden)
# Accurate expf/sqrtf/division (no --use_fast_math): SPEC §3 holds fp32 to 1e-5.
target_compile_options(attnres PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>)
# Register use and spills of every kernel (docs/CUDA.md: what to look for).
option(ATTNRES_CUDA_PTXAS_VERBOSE "Print ptxas register/spill statistics" OFF)
if(ATTNRES_CUDA_PTXAS_VERBOSE)
  target_compile_options(attnres PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()
# Error messages name the architectures the library carries code for, so that a
# GPU it was not built for is recognisable at once.
string(REPLACE ";" "," _attnres_cuda_archs_text "${ATTNRES_CUDA_ARCHITECTURES}")
target_compile_definitions(attnres PRIVATE ATTNRES_WITH_CUDA=1
  ATTNRES_CUDA_ARCHS="${_attnres_cuda_archs_text}")
# The static runtime: libattnres.so carries its own cudart and needs only the
# driver (libcuda.so) at run time, whatever runtime the host process uses.
target_link_libraries(attnres PRIVATE CUDA::cudart_static)
# scripts/gpu_check.sh looks for this line in the configure output.
message(STATUS "attnres: CUDA backend on, architectures ${ATTNRES_CUDA_ARCHITECTURES}")

if(TARGET attnres_tests)
  # The tests allocate device buffers themselves (tests/cpp/test_util.cc: the device
  # twins of AbiProblem, on which the property tests also run on CUDA).
  target_compile_definitions(attnres_tests PRIVATE ATTNRES_WITH_CUDA=1)
  target_link_libraries(attnres_tests PRIVATE CUDA::cudart_static)
endif()

unset(_attnres_cuda_dir)
unset(_attnres_cuda_sources)
unset(_attnres_cuda_headers)
unset(_attnres_cuda_archs_text)
