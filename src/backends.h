// The internal boundary between the C ABI (src/abi.cc, which validates through
// src/validate/) and the backends (src/cpu/, src/cuda/), which trust the params
// they are given.
#ifndef ATTNRES_SRC_BACKENDS_H_
#define ATTNRES_SRC_BACKENDS_H_

#include <string>

#include "attnres/attnres.h"

namespace attnres {

// Number of sources L = N + (partial != nullptr).
inline int64_t NumSources(const attnres_params& p) {
  return p.num_blocks + (p.partial != nullptr ? 1 : 0);
}

// Bytes of one element of a dtype, and of the accumulation type (caches,
// scratch): double for float64, float otherwise.
inline int64_t ElementBytes(int32_t dtype) {
  return dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : dtype == ATTNRES_DTYPE_FLOAT32 ? 4 : 2;
}
inline int64_t AccumBytes(int32_t dtype) { return dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : 4; }
// "f32", "f64", "bf16", "f16" (messages, kernel names, tools).
inline const char* DtypeName(int32_t dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT32: return "f32";
    case ATTNRES_DTYPE_FLOAT64: return "f64";
    case ATTNRES_DTYPE_BFLOAT16: return "bf16";
    case ATTNRES_DTYPE_FLOAT16: return "f16";
  }
  return "?";
}

// Records the message returned by attnres_last_error() on this thread and
// passes `status` through, so that backends can `return Fail(...)`.
attnres_status Fail(attnres_status status, const std::string& message);

// Backends. `p` has been validated: sizes positive, pointers non-null where
// required, no output overlaps an input. num_tokens may be 0.
attnres_status CpuForward(const attnres_params& p);
attnres_status CpuBackward(const attnres_params& p);
// The two-phase ops: phase 1 or 2, forward or backward.
attnres_status CpuTwoPhase(const attnres_params& p, int phase, bool backward);
const char* CpuIsaName();

namespace cpu {
int GetNumThreads();
void SetNumThreads(int n);  // n <= 0: the default
bool SetIsa(const char* name);  // nullptr: the best for this CPU
const char* RunnableIsaNames();  // attnres_cpu_isas(): what SetIsa accepts, best first
}  // namespace cpu

// Implemented in src/cuda/ when built with ATTNRES_CUDA; src/abi.cc reports
// ATTNRES_ERROR_UNSUPPORTED_DEVICE otherwise.
bool CudaAvailable();
attnres_status CudaForward(const attnres_params& p);
attnres_status CudaBackward(const attnres_params& p);
attnres_status CudaTwoPhase(const attnres_params& p, int phase, bool backward);

}  // namespace attnres

#endif  // ATTNRES_SRC_BACKENDS_H_
