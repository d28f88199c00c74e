# The CUDA backend of attnres. Included from the top-level CMakeLists.txt after
# the `attnres` (and, with ATTNRES_BUILD_TESTS, `attnres_tests`) targets exist,
# when ATTNRES_CUDA is ON and check_language(CUDA) found nvcc.
#
# Cache variables:
#   ATTNRES_CUDA_ARCHITECTURES  GPU architectures to build for (default "80;90":
#                               SASS for A100 and H100/H200, plus compute_90 PTX
#                               that later GPUs JIT-compile).

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(ATTNRES_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "CUDA architectures of the attnres CUDA backend")

set(_attnres_cuda_dir ${CMAKE_CURRENT_LIST_DIR}/../src/cuda)
target_sources(attnres PRIVATE ${_attnres_cuda_dir}/block_attn_res.cu)
set_source_files_properties(${_attnres_cuda_dir}/block_attn_res.cu PROPERTIES
  OBJECT_DEPENDS "${_attnres_cuda_dir}/common.cuh;${_attnres_cuda_dir}/block_attn_res_fused.cuh;${_attnres_cuda_dir}/block_attn_res_generic.cuh")

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
target_compile_definitions(attnres PRIVATE ATTNRES_WITH_CUDA=1)
# The static runtime: libattnres.so carries its own cudart and needs only the
# driver (libcuda.so) at run time, whatever runtime the host process uses.
target_link_libraries(attnres PRIVATE CUDA::cudart_static)

if(TARGET attnres_tests)
  # tests/cpp/test_cuda.cc allocates device buffers itself.
  target_compile_definitions(attnres_tests PRIVATE ATTNRES_WITH_CUDA=1)
  target_link_libraries(attnres_tests PRIVATE CUDA::cudart_static)
endif()

unset(_attnres_cuda_dir)
