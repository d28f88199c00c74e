// The C ABI: validates every argument once, before any memory is touched
// (src/validate/, one file per op), then hands the params to a backend. Backends
// trust what arrives here.
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>

#include "attnres/attnres.h"
#include "backends.h"
#include "validate/validate.h"

namespace attnres {
namespace {

thread_local std::string g_last_error;

// Runs a backend, turning any escaped C++ exception into a status.
template <typename Fn>
attnres_status Guarded(const char* function, Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return Fail(ATTNRES_ERROR_OUT_OF_MEMORY, std::string(function) + ": out of memory");
  } catch (const std::exception& e) {
    return Fail(ATTNRES_ERROR_INTERNAL, std::string(function) + ": internal error: " + e.what());
  }
}

// Validates (the op's forward or backward rules), then runs `cpu` or `cuda`,
// whichever the params' device is.
template <typename Cpu, typename Cuda>
attnres_status Run(const char* function, const validate::OpRules& op, bool backward,
                   const attnres_params* params, const Cpu& cpu, const Cuda& cuda) {
  if (attnres_status s = validate::Run(function, params, op, backward); s != ATTNRES_OK) return s;
  return Guarded(function, [&] {
    return params->device == ATTNRES_DEVICE_CUDA ? cuda(*params) : cpu(*params);
  });
}

// One phase of the two-phase schedule.
attnres_status RunPhase(const char* function, const validate::OpRules& op, int phase,
                        bool backward, const attnres_params* params) {
  return Run(
      function, op, backward, params,
      [&](const attnres_params& p) { return CpuTwoPhase(p, phase, backward); },
      [&](const attnres_params& p) { return CudaTwoPhase(p, phase, backward); });
}

}  // namespace

attnres_status Fail(attnres_status status, const std::string& message) {
  g_last_error = message;
  return status;
}

#ifndef ATTNRES_WITH_CUDA
bool CudaAvailable() { return false; }
attnres_status CudaForward(const attnres_params&) {
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DEVICE, "attnres was built without CUDA");
}
attnres_status CudaBackward(const attnres_params&) {
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DEVICE, "attnres was built without CUDA");
}
attnres_status CudaTwoPhase(const attnres_params&, int, bool) {
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DEVICE, "attnres was built without CUDA");
}
#endif

}  // namespace attnres

extern "C" {

namespace validate = attnres::validate;
using attnres::Run;
using attnres::RunPhase;

const char* attnres_version(void) {
#define ATTNRES_STR_(x) #x
#define ATTNRES_STR(x) ATTNRES_STR_(x)
  return ATTNRES_STR(ATTNRES_VERSION_MAJOR) "." ATTNRES_STR(ATTNRES_VERSION_MINOR) "." ATTNRES_STR(
      ATTNRES_VERSION_PATCH);
}

const char* attnres_cpu_isa(void) { return attnres::CpuIsaName(); }

const char* attnres_cpu_isas(void) { return attnres::cpu::RunnableIsaNames(); }

attnres_status attnres_set_cpu_isa(const char* name) {
  if (attnres::cpu::SetIsa(name)) return ATTNRES_OK;
  return attnres::Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                       std::string("attnres_set_cpu_isa: name must be a variant compiled in "
                                   "that this CPU runs (") +
                           attnres::cpu::RunnableIsaNames() + "), got \"" + name + "\"");
}

void attnres_params_init(attnres_params* params) {
  if (params == nullptr) return;
  *params = attnres_params{};
  params->abi_version = ATTNRES_ABI_VERSION;
  params->dtype = ATTNRES_DTYPE_FLOAT32;
  params->device = ATTNRES_DEVICE_CPU;
  params->scale = 1.0;
  params->eps = 1e-6;
  params->rmsnorm = 1;
  params->num_queries = 1;
  params->norm_eps = 1e-6;
}

const attnres_field* attnres_params_fields(int32_t* count) {
#define ATTNRES_FIELD(name) \
  attnres_field{#name, int64_t(offsetof(attnres_params, name)), int64_t(sizeof(attnres_params::name))}
  static const attnres_field kFields[] = {
      ATTNRES_FIELD(abi_version), ATTNRES_FIELD(num_tokens), ATTNRES_FIELD(dim),
      ATTNRES_FIELD(num_blocks), ATTNRES_FIELD(dtype), ATTNRES_FIELD(device),
      ATTNRES_FIELD(stream), ATTNRES_FIELD(blocks), ATTNRES_FIELD(partial),
      ATTNRES_FIELD(source_row_stride), ATTNRES_FIELD(proj_weight), ATTNRES_FIELD(gamma),
      ATTNRES_FIELD(scale), ATTNRES_FIELD(eps), ATTNRES_FIELD(rmsnorm), ATTNRES_FIELD(out),
      ATTNRES_FIELD(out_row_stride), ATTNRES_FIELD(rms_cache), ATTNRES_FIELD(alpha_cache),
      ATTNRES_FIELD(grad_out), ATTNRES_FIELD(grad_out_row_stride), ATTNRES_FIELD(grad_blocks),
      ATTNRES_FIELD(grad_partial), ATTNRES_FIELD(grad_source_row_stride),
      ATTNRES_FIELD(grad_proj_weight), ATTNRES_FIELD(grad_gamma), ATTNRES_FIELD(num_queries),
      ATTNRES_FIELD(query_outs), ATTNRES_FIELD(query_lses), ATTNRES_FIELD(grad_query_outs),
      ATTNRES_FIELD(grad_query_lses), ATTNRES_FIELD(accumulate_grads), ATTNRES_FIELD(query_out),
      ATTNRES_FIELD(query_lse), ATTNRES_FIELD(grad_query_out), ATTNRES_FIELD(grad_query_lse),
      ATTNRES_FIELD(input_norm), ATTNRES_FIELD(norm_eps), ATTNRES_FIELD(norm_weight),
      ATTNRES_FIELD(grad_norm_weight), ATTNRES_FIELD(partial_update), ATTNRES_FIELD(new_partial),
      ATTNRES_FIELD(grad_partial_in),
  };
#undef ATTNRES_FIELD
  if (count != nullptr) *count = int32_t(sizeof(kFields) / sizeof(kFields[0]));
  return kFields;
}

int64_t attnres_params_size(void) { return int64_t(sizeof(attnres_params)); }

attnres_status attnres_forward(const attnres_params* params) {
  return Run("attnres_forward", validate::kBlockAttnRes, false, params, attnres::CpuForward,
             attnres::CudaForward);
}
attnres_status attnres_backward(const attnres_params* params) {
  return Run("attnres_backward", validate::kBlockAttnRes, true, params, attnres::CpuBackward,
             attnres::CudaBackward);
}
attnres_status attnres_phase1_forward(const attnres_params* params) {
  return RunPhase("attnres_phase1_forward", validate::kPhase1, 1, false, params);
}
attnres_status attnres_phase1_backward(const attnres_params* params) {
  return RunPhase("attnres_phase1_backward", validate::kPhase1, 1, true, params);
}
attnres_status attnres_phase2_forward(const attnres_params* params) {
  return RunPhase("attnres_phase2_forward", validate::kPhase2, 2, false, params);
}
attnres_status attnres_phase2_backward(const attnres_params* params) {
  return RunPhase("attnres_phase2_backward", validate::kPhase2, 2, true, params);
}

const char* attnres_last_error(void) { return attnres::g_last_error.c_str(); }

const char* attnres_status_string(attnres_status status) {
  switch (status) {
    case ATTNRES_OK: return "ok";
    case ATTNRES_ERROR_NULL_POINTER: return "null pointer";
    case ATTNRES_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case ATTNRES_ERROR_UNSUPPORTED_DTYPE: return "unsupported dtype";
    case ATTNRES_ERROR_OVERLAP: return "overlapping buffers";
    case ATTNRES_ERROR_OUT_OF_MEMORY: return "out of memory";
    case ATTNRES_ERROR_UNSUPPORTED_DEVICE: return "unsupported device";
    case ATTNRES_ERROR_DEVICE_FAILURE: return "device failure";
    case ATTNRES_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

void attnres_set_num_threads(int n) { attnres::cpu::SetNumThreads(n); }
int attnres_get_num_threads(void) { return attnres::cpu::GetNumThreads(); }
int attnres_cuda_available(void) { return attnres::CudaAvailable() ? 1 : 0; }

}  // extern "C"
