// Phase 2's rules (attnres_phase2_forward, attnres_phase2_backward): no blocks;
// one query's o (query_out) and LSE, the optional partial block, w and gamma of
// [dim], the optional input norm and the optional fused partial-block update.
#include <cmath>

#include "validate/validator.h"

namespace attnres::validate {
namespace {

void Inputs(Validator& v, const attnres_params* p) {
  ValidateHeader(v, p);
  if (!v.ok()) return;
  v.Check(p->num_blocks == 0, ATTNRES_ERROR_INVALID_ARGUMENT,
          "num_blocks must be 0 in phase 2 (it reads phase 1's query_out, not the blocks), got ",
          p->num_blocks);
  v.Flag(p->input_norm, "input_norm");
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
  AddWeights(v, p, 1);
  v.AddRows(p->norm_weight, 1, dim, dim, elem, "norm_weight", false);
}

// The fused update: y added into the partial block, p' written beside out.
void FusedUpdate(Validator& v, const attnres_params* p) {
  v.Check(p->partial_update == nullptr || p->partial != nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "partial_update must be NULL when there is no partial block (it is added into it)");
  v.Check(p->new_partial == nullptr || p->partial_update != nullptr,
          ATTNRES_ERROR_INVALID_ARGUMENT,
          "new_partial must be NULL without partial_update (it receives partial + partial_update)");
  if (p->partial_update == nullptr || !v.ok()) return;
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  v.AddRows(p->partial_update, rows, p->source_row_stride, dim, elem, "partial_update", false);
  v.RequiredRows(p->new_partial, rows, p->out_row_stride, dim, elem, "new_partial",
                 "out_row_stride", true);
}

// The backward's flags: what must be NULL given the others.
void BackwardFlags(Validator& v, const attnres_params* p) {
  CheckGradPartial(v, p);
  v.Check(p->grad_norm_weight == nullptr || p->input_norm, ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_norm_weight must be NULL when input_norm is 0");
  v.Check(p->partial_update == nullptr, ATTNRES_ERROR_INVALID_ARGUMENT,
          "partial_update must be NULL in the backward (pass the forward's new_partial as "
          "partial: the backward reads only the updated partial block)");
  v.Check(p->grad_partial_in == nullptr || p->grad_partial != nullptr,
          ATTNRES_ERROR_INVALID_ARGUMENT,
          "grad_partial_in must be NULL when grad_partial is NULL (it is added into grad_partial)");
}

// attnres_phase2_forward: out, and the fused update.
void ForwardOutputs(Validator& v, const attnres_params* p) {
  v.RequiredRows(p->out, p->num_tokens, p->out_row_stride, p->dim, ElementBytes(p->dtype), "out",
                 "out_row_stride", true);
  FusedUpdate(v, p);
}

// attnres_phase2_backward: grad_out (and grad_partial_in) in, the gradients out.
void BackwardOutputs(Validator& v, const attnres_params* p) {
  const int64_t elem = ElementBytes(p->dtype), rows = p->num_tokens, dim = p->dim;
  ValidateGradOut(v, p);
  BackwardFlags(v, p);
  v.AddRows(p->grad_partial_in, rows, p->grad_out_row_stride, dim, elem, "grad_partial_in", false);
  if (p->grad_partial != nullptr || p->grad_query_out != nullptr) {
    v.RowStride(p->grad_source_row_stride, dim, "grad_source_row_stride");
  }
  v.AddRows(p->grad_query_out, rows, p->grad_source_row_stride, dim, elem, "grad_query_out", true);
  v.AddRows(p->grad_partial, rows, p->grad_source_row_stride, dim, elem, "grad_partial", true);
  AddColumn(v, p, p->grad_query_lse, "grad_query_lse", true);
  AddWeightGrads(v, p, 1);
  v.AddRows(p->grad_norm_weight, 1, dim, dim, elem, "grad_norm_weight", true);
}

}  // namespace

extern const OpRules kPhase2 = {Inputs, ForwardOutputs, BackwardOutputs};

}  // namespace attnres::validate
