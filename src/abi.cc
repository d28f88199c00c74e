// The C ABI: validates every argument once, before any memory is touched, then
// hands the params to a backend. Backends trust what arrives here.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "backends.h"

namespace attnres {
namespace {

thread_local std::string g_last_error;

// An argument's name for messages, "blocks" or "blocks[3]": composed only when a
// message is written, so that a call that passes costs no string building.
struct Name {
  Name(const char* base, int64_t index = -1) : base(base), index(index) {}  // NOLINT: implicit
  const char* base;
  int64_t index;  // -1: not an array element
};

std::ostream& operator<<(std::ostream& os, const Name& name) {
  os << name.base;
  if (name.index >= 0) os << '[' << name.index << ']';
  return os;
}

// The byte range [begin, end) a buffer spans, with its name for messages.
struct Span {
  uintptr_t begin, end;
  Name name;
  bool is_output;
};

// The spans of this thread's current call, kept between calls so that a warm call
// allocates nothing: a backward over 10 sources records ~25 spans, and a fresh
// vector grown past its first 16 cost a malloc of over 1 KB (and a consolidation
// of glibc's fast bins) per call: 0.25 of 2.2 us of a 1-token backward at D = 64.
std::vector<Span>& ThreadSpans() {
  thread_local std::vector<Span> spans;
  return spans;
}

// Checks arguments in order and keeps the first failure. One per call (never
// nested: it shares the thread's spans).
class Validator {
 public:
  explicit Validator(const char* function) : function_(function), spans_(ThreadSpans()) {
    spans_.clear();
  }
  // A call over thousands of sources does not leave its list behind in the thread.
  ~Validator() {
    if (spans_.capacity() > kKeptSpans) std::vector<Span>().swap(spans_);
  }

  bool ok() const { return status_ == ATTNRES_OK; }

  attnres_status Finish() {
    if (!ok()) Fail(status_, message_);
    return status_;
  }

  template <typename... Args>
  void Check(bool condition, attnres_status status, const Args&... parts) {
    if (!ok() || condition) return;
    std::ostringstream os;
    os << function_ << ": ";
    (os << ... << parts);
    status_ = status;
    message_ = os.str();
  }

  void NotNull(const void* p, Name name) {
    Check(p != nullptr, ATTNRES_ERROR_NULL_POINTER, name, " must not be NULL");
  }

  void Aligned(const void* p, int64_t alignment, Name name) {
    Check(reinterpret_cast<uintptr_t>(p) % alignment == 0, ATTNRES_ERROR_INVALID_ARGUMENT, name,
          " must be aligned to ", alignment, " bytes (its element size), got address ", p);
  }

  void RowStride(int64_t stride, int64_t dim, const char* name) {
    Check(stride >= dim, ATTNRES_ERROR_INVALID_ARGUMENT, name, " must be >= dim (", dim,
          "), got ", stride);
  }

  // Records the span of a [rows, stride] buffer whose rows hold `cols` elements.
  void AddRows(const void* p, int64_t rows, int64_t stride, int64_t cols, int64_t elem,
               Name name, bool is_output) {
    if (!ok() || p == nullptr || rows == 0) return;
    Aligned(p, elem, name);
    int64_t elems = 0, bytes = 0;
    const bool overflow = __builtin_mul_overflow(rows - 1, stride, &elems) ||
                          __builtin_add_overflow(elems, cols, &elems) ||
                          __builtin_mul_overflow(elems, elem, &bytes);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    Check(!overflow && bytes >= 0 && begin + static_cast<uintptr_t>(bytes) >= begin,
          ATTNRES_ERROR_INVALID_ARGUMENT, name, " spans more than the address space (", rows,
          " rows, row stride ", stride, ")");
    if (ok()) spans_.push_back({begin, begin + static_cast<uintptr_t>(bytes), name, is_output});
  }

  // A [rows, stride] buffer the call must have: not NULL, stride >= cols, span recorded.
  void RequiredRows(const void* p, int64_t rows, int64_t stride, int64_t cols, int64_t elem,
                    const char* name, const char* stride_name, bool is_output) {
    NotNull(p, name);
    RowStride(stride, cols, stride_name);
    AddRows(p, rows, stride, cols, elem, name, is_output);
  }

  // No output may overlap an input or another output (inputs may share memory).
  // Sorted sweep: the span that ends last among earlier inputs/outputs is the one
  // a later span can overlap.
  void NoOverlap() {
    if (!ok()) return;
    std::sort(spans_.begin(), spans_.end(),
              [](const Span& a, const Span& b) { return a.begin < b.begin; });
    const Span* last_input = nullptr;
    const Span* last_output = nullptr;
    for (const Span& s : spans_) {
      const Span* hit = nullptr;
      if (last_output != nullptr && s.begin < last_output->end) hit = last_output;
      if (hit == nullptr && s.is_output && last_input != nullptr && s.begin < last_input->end) {
        hit = last_input;
      }
      if (hit != nullptr) {
        Check(false, ATTNRES_ERROR_OVERLAP, s.is_output ? s.name : hit->name,
              " overlaps ", s.is_output ? hit->name : s.name,
              " (outputs must not share memory with inputs or other outputs)");
        return;
      }
      const Span*& last = s.is_output ? last_output : last_input;
      if (last == nullptr || s.end > last->end) last = &s;
    }
  }

 private:
  const char* function_;
  attnres_status status_ = ATTNRES_OK;
  std::string message_;
  static constexpr size_t kKeptSpans = 1024;
  std::vector<Span>& spans_;
};

// Bounds that keep every size the backends derive (padded rows, scratch of a tile
// times L, S x N stats) inside int64; no buffer that large can exist anyway.
constexpr int64_t kMaxDim = int64_t{1} << 48, kMaxBlocks = int64_t{1} << 40;

// Checks of every call: the struct, dtype, device, sizes and scalars.
void ValidateHeader(Validator& v, const attnres_params* p) {
  v.NotNull(p, "params");
  if (!v.ok()) return;
  v.Check(p->abi_version == ATTNRES_ABI_VERSION, ATTNRES_ERROR_INVALID_ARGUMENT,
          "params.abi_version must be ", ATTNRES_ABI_VERSION,
          " (initialise params with attnres_params_init), got ", p->abi_version);
  v.Check(p->dtype >= 0 && p->dtype < ATTNRES_DTYPE_COUNT,
          ATTNRES_ERROR_UNSUPPORTED_DTYPE,
          "dtype must be one of float32 (0), float64 (1), bfloat16 (2), float16 (3), got ",
          p->dtype);
  v.Check(p->device == ATTNRES_DEVICE_CPU || p->device == ATTNRES_DEVICE_CUDA,
          ATTNRES_ERROR_UNSUPPORTED_DEVICE, "device must be CPU (0) or CUDA (1), got ",
          p->device);
  v.Check(p->device != ATTNRES_DEVICE_CUDA || CudaAvailable(), ATTNRES_ERROR_UNSUPPORTED_DEVICE,
          "device is CUDA, but this build of attnres has no CUDA backend or no CUDA device is "
          "present");
  v.Check(p->num_tokens >= 0, ATTNRES_ERROR_INVALID_ARGUMENT, "num_tokens must be >= 0, got ",
          p->num_tokens);
  v.Check(p->dim >= 1 && p->dim <= kMaxDim, ATTNRES_ERROR_INVALID_ARGUMENT,
          "dim must be in [1, 2^48], got ", p->dim);
  v.Check(p->num_blocks >= 0 && p->num_blocks <= kMaxBlocks, ATTNRES_ERROR_INVALID_ARGUMENT,
          "num_blocks must be in [0, 2^40], got ", p->num_blocks);
  v.Check(p->rmsnorm == 0 || p->rmsnorm == 1, ATTNRES_ERROR_INVALID_ARGUMENT,
          "rmsnorm must be 0 or 1, got ", p->rmsnorm);
  v.Check(std::isfinite(p->scale), ATTNRES_ERROR_INVALID_ARGUMENT, "scale must be finite, got ",
          p->scale);
  v.Check(std::isfinite(p->eps) && p->eps >= 0, ATTNRES_ERROR_INVALID_ARGUMENT,
          "eps must be finite and >= 0, got ", p->eps);
}

// The blocks' stride and pointers.
void CheckBlocks(Validator& v, const attnres_params* p) {
  v.RowStride(p->source_row_stride, p->dim, "source_row_stride");
  if (p->num_blocks > 0) v.NotNull(p->blocks, "blocks");
  for (int64_t i = 0; v.ok() && i < p->num_blocks; ++i) {
    v.NotNull(p->blocks[i], Name("blocks", i));
  }
}

void AddBlockSpans(Validator& v, const attnres_params* p) {
  for (int64_t i = 0; v.ok() && i < p->num_blocks; ++i) {
    v.AddRows(p->blocks[i], p->num_tokens, p->source_row_stride, p->dim, ElementBytes(p->dtype),
              Name("blocks", i), false);
  }
}

// Checks shared by the single op's forward and backward, then the spans of the inputs.
void ValidateCommon(Validator& v, const attnres_params* p) {
  ValidateHeader(v, p);
  if (!v.ok()) return;
  v.Check(NumSources(*p) >= 1, ATTNRES_ERROR_INVALID_ARGUMENT,
          "at least one source is needed (num_blocks >= 1 or a partial block), got num_blocks = ",
          p->num_blocks, " and no partial block");
  CheckBlocks(v, p);
  v.NotNull(p->proj_weight, "proj_weight");
  v.Check(p->rms_cache == nullptr || p->rmsnorm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "rms_cache must be NULL when rmsnorm is 0 (there is no rms to cache)");
  if (!v.ok()) return;
  AddBlockSpans(v, p);

  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  v.AddRows(p->partial, rows, p->source_row_stride, dim, elem, "partial", false);
  v.AddRows(p->proj_weight, 1, dim, dim, elem, "proj_weight", false);
  v.AddRows(p->gamma, 1, dim, dim, elem, "gamma", false);
}

void AddCaches(Validator& v, const attnres_params* p, bool are_outputs) {
  const int64_t L = NumSources(*p), acc = AccumBytes(p->dtype);
  v.AddRows(p->rms_cache, p->num_tokens, L, L, acc, "rms_cache", are_outputs);
  v.AddRows(p->alpha_cache, p->num_tokens, L, L, acc, "alpha_cache", are_outputs);
}

attnres_status ValidateForward(const attnres_params* p) {
  Validator v("attnres_forward");
  ValidateCommon(v, p);
  if (v.ok()) {
    v.RequiredRows(p->out, p->num_tokens, p->out_row_stride, p->dim, ElementBytes(p->dtype),
                   "out", "out_row_stride", true);
    AddCaches(v, p, /*are_outputs=*/true);
    v.NoOverlap();
  }
  return v.Finish();
}

// The upstream gradient of the single op and of phase 2, and grad_gamma only with
// RMSNorm.
void ValidateGradOut(Validator& v, const attnres_params* p) {
  v.RequiredRows(p->grad_out, p->num_tokens, p->grad_out_row_stride, p->dim,
                 ElementBytes(p->dtype), "grad_out", "grad_out_row_stride", false);
  v.Check(p->grad_gamma == nullptr || p->rmsnorm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_gamma must be NULL when rmsnorm is 0 (gamma is not used)");
}

attnres_status ValidateBackward(const attnres_params* p) {
  Validator v("attnres_backward");
  ValidateCommon(v, p);
  if (!v.ok()) return v.Finish();
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  ValidateGradOut(v, p);
  bool any_source_grad = p->grad_partial != nullptr && p->partial != nullptr;
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    any_source_grad |= p->grad_blocks[i] != nullptr;
  }
  v.Check(p->grad_partial == nullptr || p->partial != nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_partial must be NULL when there is no partial block");
  if (any_source_grad) v.RowStride(p->grad_source_row_stride, dim, "grad_source_row_stride");
  AddCaches(v, p, /*are_outputs=*/false);
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    v.AddRows(p->grad_blocks[i], rows, p->grad_source_row_stride, dim, elem,
              Name("grad_blocks", i), true);
  }
  v.AddRows(p->grad_partial, rows, p->grad_source_row_stride, dim, elem, "grad_partial", true);
  v.AddRows(p->grad_proj_weight, 1, dim, dim, elem, "grad_proj_weight", true);
  v.AddRows(p->grad_gamma, 1, dim, dim, elem, "grad_gamma", true);
  v.NoOverlap();
  return v.Finish();
}

// ---- The two-phase ops ----

// A [num_tokens] column of the accumulation type (LSEs and their gradients).
void AddColumn(Validator& v, const attnres_params* p, const void* column, Name name,
               bool is_output) {
  v.AddRows(column, p->num_tokens, 1, 1, AccumBytes(p->dtype), name, is_output);
}

// Phase 1: N >= 1 blocks, no partial block, S queries.
void ValidatePhase1Inputs(Validator& v, const attnres_params* p) {
  ValidateHeader(v, p);
  if (!v.ok()) return;
  v.Check(p->num_blocks >= 1, ATTNRES_ERROR_INVALID_ARGUMENT,
          "num_blocks must be >= 1 (phase 1 mixes the completed blocks), got ", p->num_blocks);
  v.Check(p->partial == nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "partial must be NULL in phase 1 (phase 2 merges the partial block)");
  v.Check(p->num_queries >= 1 && p->num_queries <= kMaxBlocks, ATTNRES_ERROR_INVALID_ARGUMENT,
          "num_queries must be in [1, 2^40], got ", p->num_queries);
  CheckBlocks(v, p);
  v.NotNull(p->proj_weight, "proj_weight");
  if (!v.ok()) return;
  AddBlockSpans(v, p);
  const int64_t elem = ElementBytes(p->dtype);
  v.AddRows(p->proj_weight, p->num_queries, p->dim, p->dim, elem, "proj_weight", false);
  v.AddRows(p->gamma, p->num_queries, p->dim, p->dim, elem, "gamma", false);
}

attnres_status ValidatePhase1Forward(const attnres_params* p) {
  Validator v("attnres_phase1_forward");
  ValidatePhase1Inputs(v, p);
  if (!v.ok()) return v.Finish();
  v.NotNull(p->query_outs, "query_outs");
  v.NotNull(p->query_lses, "query_lses");
  v.RowStride(p->out_row_stride, p->dim, "out_row_stride");
  for (int64_t s = 0; v.ok() && s < p->num_queries; ++s) {
    v.NotNull(p->query_outs[s], Name("query_outs", s));
    v.NotNull(p->query_lses[s], Name("query_lses", s));
  }
  for (int64_t s = 0; v.ok() && s < p->num_queries; ++s) {
    v.AddRows(p->query_outs[s], p->num_tokens, p->out_row_stride, p->dim, ElementBytes(p->dtype),
              Name("query_outs", s), true);
    AddColumn(v, p, p->query_lses[s], Name("query_lses", s), true);
  }
  v.NoOverlap();
  return v.Finish();
}

attnres_status ValidatePhase1Backward(const attnres_params* p) {
  Validator v("attnres_phase1_backward");
  ValidatePhase1Inputs(v, p);
  if (!v.ok()) return v.Finish();
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  v.NotNull(p->grad_query_outs, "grad_query_outs");
  v.Check(p->accumulate_grads == 0 || p->accumulate_grads == 1, ATTNRES_ERROR_INVALID_ARGUMENT,
          "accumulate_grads must be 0 or 1, got ", p->accumulate_grads);
  v.Check(p->grad_gamma == nullptr || p->rmsnorm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_gamma must be NULL when rmsnorm is 0 (gamma is not used)");
  if (!v.ok()) return v.Finish();
  bool any_grad_out = false, any_source_grad = false;
  for (int64_t s = 0; s < p->num_queries; ++s) any_grad_out |= p->grad_query_outs[s] != nullptr;
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    any_source_grad |= p->grad_blocks[i] != nullptr;
  }
  if (any_grad_out) v.RowStride(p->grad_out_row_stride, dim, "grad_out_row_stride");
  if (any_source_grad) v.RowStride(p->grad_source_row_stride, dim, "grad_source_row_stride");
  for (int64_t s = 0; s < p->num_queries; ++s) {
    v.AddRows(p->grad_query_outs[s], rows, p->grad_out_row_stride, dim, elem,
              Name("grad_query_outs", s), false);
    if (p->grad_query_lses != nullptr) {
      AddColumn(v, p, p->grad_query_lses[s], Name("grad_query_lses", s), false);
    }
  }
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    v.AddRows(p->grad_blocks[i], rows, p->grad_source_row_stride, dim, elem,
              Name("grad_blocks", i), true);
  }
  v.AddRows(p->grad_proj_weight, p->num_queries, dim, dim, elem, "grad_proj_weight", true);
  v.AddRows(p->grad_gamma, p->num_queries, dim, dim, elem, "grad_gamma", true);
  v.NoOverlap();
  return v.Finish();
}

// Phase 2: one query's o and lse, an optional partial block, the optional norm.
void ValidatePhase2Inputs(Validator& v, const attnres_params* p) {
  ValidateHeader(v, p);
  if (!v.ok()) return;
  v.Check(p->num_blocks == 0, ATTNRES_ERROR_INVALID_ARGUMENT,
          "num_blocks must be 0 in phase 2 (it reads phase 1's query_out, not the blocks), got ",
          p->num_blocks);
  v.Check(p->input_norm == 0 || p->input_norm == 1, ATTNRES_ERROR_INVALID_ARGUMENT,
          "input_norm must be 0 or 1, got ", p->input_norm);
  v.Check(std::isfinite(p->norm_eps) && p->norm_eps >= 0, ATTNRES_ERROR_INVALID_ARGUMENT,
          "norm_eps must be finite and >= 0, got ", p->norm_eps);
  v.Check(p->norm_weight == nullptr || p->input_norm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "norm_weight must be NULL when input_norm is 0");
  v.RowStride(p->source_row_stride, p->dim, "source_row_stride");
  v.NotNull(p->query_out, "query_out");
  if (p->partial != nullptr) v.NotNull(p->query_lse, "query_lse");
  v.NotNull(p->proj_weight, "proj_weight");
  if (!v.ok()) return;
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  v.AddRows(p->query_out, rows, p->source_row_stride, dim, elem, "query_out", false);
  v.AddRows(p->partial, rows, p->source_row_stride, dim, elem, "partial", false);
  AddColumn(v, p, p->query_lse, "query_lse", false);
  v.AddRows(p->proj_weight, 1, dim, dim, elem, "proj_weight", false);
  v.AddRows(p->gamma, 1, dim, dim, elem, "gamma", false);
  v.AddRows(p->norm_weight, 1, dim, dim, elem, "norm_weight", false);
}

attnres_status ValidatePhase2Forward(const attnres_params* p) {
  Validator v("attnres_phase2_forward");
  ValidatePhase2Inputs(v, p);
  if (!v.ok()) return v.Finish();
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  v.RequiredRows(p->out, rows, p->out_row_stride, dim, elem, "out", "out_row_stride", true);
  // The fused update: y added into the partial block, p' written beside out.
  v.Check(p->partial_update == nullptr || p->partial != nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "partial_update must be NULL when there is no partial block (it is added into it)");
  v.Check(p->new_partial == nullptr || p->partial_update != nullptr,
          ATTNRES_ERROR_INVALID_ARGUMENT,
          "new_partial must be NULL without partial_update (it receives partial + partial_update)");
  if (p->partial_update != nullptr && v.ok()) {
    v.AddRows(p->partial_update, rows, p->source_row_stride, dim, elem, "partial_update", false);
    v.RequiredRows(p->new_partial, rows, p->out_row_stride, dim, elem, "new_partial",
                   "out_row_stride", true);
  }
  v.NoOverlap();
  return v.Finish();
}

attnres_status ValidatePhase2Backward(const attnres_params* p) {
  Validator v("attnres_phase2_backward");
  ValidatePhase2Inputs(v, p);
  if (!v.ok()) return v.Finish();
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  ValidateGradOut(v, p);
  v.Check(p->grad_partial == nullptr || p->partial != nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_partial must be NULL when there is no partial block");
  v.Check(p->grad_norm_weight == nullptr || p->input_norm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_norm_weight must be NULL when input_norm is 0");
  v.Check(p->partial_update == nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "partial_update must be NULL in the backward (pass the forward's new_partial as "
          "partial: the backward reads only the updated partial block)");
  v.Check(p->grad_partial_in == nullptr || p->grad_partial != nullptr,
          ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_partial_in must be NULL when grad_partial is NULL (it is added into grad_partial)");
  v.AddRows(p->grad_partial_in, rows, p->grad_out_row_stride, dim, elem, "grad_partial_in", false);
  if (p->grad_partial != nullptr || p->grad_query_out != nullptr) {
    v.RowStride(p->grad_source_row_stride, dim, "grad_source_row_stride");
  }
  v.AddRows(p->grad_query_out, rows, p->grad_source_row_stride, dim, elem, "grad_query_out", true);
  v.AddRows(p->grad_partial, rows, p->grad_source_row_stride, dim, elem, "grad_partial", true);
  AddColumn(v, p, p->grad_query_lse, "grad_query_lse", true);
  v.AddRows(p->grad_proj_weight, 1, dim, dim, elem, "grad_proj_weight", true);
  v.AddRows(p->grad_gamma, 1, dim, dim, elem, "grad_gamma", true);
  v.AddRows(p->grad_norm_weight, 1, dim, dim, elem, "grad_norm_weight", true);
  v.NoOverlap();
  return v.Finish();
}

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
  if (attnres_status s = attnres::ValidateForward(params); s != ATTNRES_OK) return s;
  return attnres::Guarded("attnres_forward", [&] {
    return params->device == ATTNRES_DEVICE_CUDA ? attnres::CudaForward(*params)
                                                 : attnres::CpuForward(*params);
  });
}

attnres_status attnres_backward(const attnres_params* params) {
  if (attnres_status s = attnres::ValidateBackward(params); s != ATTNRES_OK) return s;
  return attnres::Guarded("attnres_backward", [&] {
    return params->device == ATTNRES_DEVICE_CUDA ? attnres::CudaBackward(*params)
                                                 : attnres::CpuBackward(*params);
  });
}

namespace {
// Validates, then runs one phase on the params' device.
attnres_status RunTwoPhase(const char* function, attnres_status (*validate)(const attnres_params*),
                           const attnres_params* params, int phase, bool backward) {
  if (attnres_status s = validate(params); s != ATTNRES_OK) return s;
  return attnres::Guarded(function, [&] {
    return params->device == ATTNRES_DEVICE_CUDA ? attnres::CudaTwoPhase(*params, phase, backward)
                                                 : attnres::CpuTwoPhase(*params, phase, backward);
  });
}
}  // namespace

attnres_status attnres_phase1_forward(const attnres_params* params) {
  return RunTwoPhase("attnres_phase1_forward", attnres::ValidatePhase1Forward, params, 1, false);
}
attnres_status attnres_phase1_backward(const attnres_params* params) {
  return RunTwoPhase("attnres_phase1_backward", attnres::ValidatePhase1Backward, params, 1, true);
}
attnres_status attnres_phase2_forward(const attnres_params* params) {
  return RunTwoPhase("attnres_phase2_forward", attnres::ValidatePhase2Forward, params, 2, false);
}
attnres_status attnres_phase2_backward(const attnres_params* params) {
  return RunTwoPhase("attnres_phase2_backward", attnres::ValidatePhase2Backward, params, 2, true);
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
