#include "validate/validator.h"

#include <algorithm>
#include <cmath>

namespace attnres::validate {

std::ostream& operator<<(std::ostream& os, const Name& name) {
  os << name.base;
  if (name.index >= 0) os << '[' << name.index << ']';
  return os;
}

// Sorted sweep: the span that ends last among earlier inputs/outputs is the one a
// later span can overlap.
void Validator::NoOverlap() {
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
      Check(false, ATTNRES_ERROR_OVERLAP, s.is_output ? s.name : hit->name, " overlaps ",
            s.is_output ? hit->name : s.name,
            " (outputs must not share memory with inputs or other outputs)");
      return;
    }
    const Span*& last = s.is_output ? last_output : last_input;
    if (last == nullptr || s.end > last->end) last = &s;
  }
}

attnres_status Run(const char* function, const attnres_params* p, const OpRules& op,
                   bool backward) {
  Validator v(function);
  op.inputs(v, p);
  if (v.ok()) (backward ? op.backward : op.forward)(v, p);
  v.NoOverlap();
  return v.Finish();
}

void ValidateHeader(Validator& v, const attnres_params* p) {
  v.NotNull(p, "params");
  if (!v.ok()) return;
  v.Check(p->abi_version == ATTNRES_ABI_VERSION, ATTNRES_ERROR_INVALID_ARGUMENT,
          "params.abi_version must be ", ATTNRES_ABI_VERSION,
          " (initialise params with attnres_params_init), got ", p->abi_version);
  v.Check(p->dtype >= 0 && p->dtype < ATTNRES_DTYPE_COUNT, ATTNRES_ERROR_UNSUPPORTED_DTYPE,
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
  v.Flag(p->rmsnorm, "rmsnorm");
  v.Check(std::isfinite(p->scale), ATTNRES_ERROR_INVALID_ARGUMENT, "scale must be finite, got ",
          p->scale);
  v.Check(std::isfinite(p->eps) && p->eps >= 0, ATTNRES_ERROR_INVALID_ARGUMENT,
          "eps must be finite and >= 0, got ", p->eps);
}

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

void AddWeights(Validator& v, const attnres_params* p, int64_t rows) {
  const int64_t elem = ElementBytes(p->dtype), dim = p->dim;
  v.AddRows(p->proj_weight, rows, dim, dim, elem, "proj_weight", false);
  v.AddRows(p->gamma, rows, dim, dim, elem, "gamma", false);
}

void AddWeightGrads(Validator& v, const attnres_params* p, int64_t rows) {
  const int64_t elem = ElementBytes(p->dtype), dim = p->dim;
  v.AddRows(p->grad_proj_weight, rows, dim, dim, elem, "grad_proj_weight", true);
  v.AddRows(p->grad_gamma, rows, dim, dim, elem, "grad_gamma", true);
}

bool AnyGradBlock(const attnres_params* p) {
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    if (p->grad_blocks[i] != nullptr) return true;
  }
  return false;
}

void AddGradBlocks(Validator& v, const attnres_params* p) {
  for (int64_t i = 0; p->grad_blocks != nullptr && i < p->num_blocks; ++i) {
    v.AddRows(p->grad_blocks[i], p->num_tokens, p->grad_source_row_stride, p->dim,
              ElementBytes(p->dtype), Name("grad_blocks", i), true);
  }
}

void CheckGradGamma(Validator& v, const attnres_params* p) {
  v.Check(p->grad_gamma == nullptr || p->rmsnorm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_gamma must be NULL when rmsnorm is 0 (gamma is not used)");
}

void CheckGradPartial(Validator& v, const attnres_params* p) {
  v.Check(p->grad_partial == nullptr || p->partial != nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_partial must be NULL when there is no partial block");
}

void ValidateGradOut(Validator& v, const attnres_params* p) {
  v.RequiredRows(p->grad_out, p->num_tokens, p->grad_out_row_stride, p->dim,
                 ElementBytes(p->dtype), "grad_out", "grad_out_row_stride", false);
  CheckGradGamma(v, p);
}

void AddColumn(Validator& v, const attnres_params* p, const void* column, Name name,
               bool is_output) {
  v.AddRows(column, p->num_tokens, 1, 1, AccumBytes(p->dtype), name, is_output);
}

}  // namespace attnres::validate
