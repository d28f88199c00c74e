// The single op's rules (attnres_forward, attnres_backward): L = N + (partial !=
// NULL) >= 1 sources of [num_tokens rows of dim], w and gamma of [dim], the
// optional [num_tokens, L] caches.
#include "validate/validator.h"

namespace attnres::validate {
namespace {

// Checks shared by the forward and the backward, then the spans of the inputs.
void Inputs(Validator& v, const attnres_params* p) {
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
  v.AddRows(p->partial, p->num_tokens, p->source_row_stride, p->dim, ElementBytes(p->dtype),
            "partial", false);
  AddWeights(v, p, 1);
}

// The caches: outputs of the forward, inputs of the backward.
void AddCaches(Validator& v, const attnres_params* p, bool are_outputs) {
  const int64_t L = NumSources(*p), acc = AccumBytes(p->dtype);
  v.AddRows(p->rms_cache, p->num_tokens, L, L, acc, "rms_cache", are_outputs);
  v.AddRows(p->alpha_cache, p->num_tokens, L, L, acc, "alpha_cache", are_outputs);
}

// attnres_forward: out, and the caches as outputs.
void ForwardOutputs(Validator& v, const attnres_params* p) {
  v.RequiredRows(p->out, p->num_tokens, p->out_row_stride, p->dim, ElementBytes(p->dtype), "out",
                 "out_row_stride", true);
  AddCaches(v, p, /*are_outputs=*/true);
}

// attnres_backward: grad_out and the caches in, the gradients out.
void BackwardOutputs(Validator& v, const attnres_params* p) {
  ValidateGradOut(v, p);
  const bool any_source_grad =
      (p->grad_partial != nullptr && p->partial != nullptr) || AnyGradBlock(p);
  CheckGradPartial(v, p);
  if (any_source_grad) v.RowStride(p->grad_source_row_stride, p->dim, "grad_source_row_stride");
  AddCaches(v, p, /*are_outputs=*/false);
  AddGradBlocks(v, p);
  v.AddRows(p->grad_partial, p->num_tokens, p->grad_source_row_stride, p->dim,
            ElementBytes(p->dtype), "grad_partial", true);
  AddWeightGrads(v, p, 1);
}

}  // namespace

extern const OpRules kBlockAttnRes = {Inputs, ForwardOutputs, BackwardOutputs};

}  // namespace attnres::validate
