// Phase 1's rules (attnres_phase1_forward, attnres_phase1_backward): N >= 1
// blocks and no partial block, S = num_queries queries with w and gamma of
// [S, dim], per query an output and an LSE (their gradients backward).
#include "validate/validator.h"

namespace attnres::validate {
namespace {

void Inputs(Validator& v, const attnres_params* p) {
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
  AddWeights(v, p, p->num_queries);
}

// Whether any grad_query_outs[s] is given.
bool AnyGradOut(const attnres_params* p) {
  for (int64_t s = 0; s < p->num_queries; ++s) {
    if (p->grad_query_outs[s] != nullptr) return true;
  }
  return false;
}

// attnres_phase1_forward: each query's output and LSE.
void ForwardOutputs(Validator& v, const attnres_params* p) {
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
}

// attnres_phase1_backward: the queries' output and LSE gradients in, the block and
// weight gradients out.
void BackwardOutputs(Validator& v, const attnres_params* p) {
  v.NotNull(p->grad_query_outs, "grad_query_outs");
  v.Flag(p->accumulate_grads, "accumulate_grads");
  CheckGradGamma(v, p);
  if (!v.ok()) return;
  if (AnyGradOut(p)) v.RowStride(p->grad_out_row_stride, p->dim, "grad_out_row_stride");
  if (AnyGradBlock(p)) v.RowStride(p->grad_source_row_stride, p->dim, "grad_source_row_stride");
  for (int64_t s = 0; s < p->num_queries; ++s) {
    v.AddRows(p->grad_query_outs[s], p->num_tokens, p->grad_out_row_stride, p->dim,
              ElementBytes(p->dtype), Name("grad_query_outs", s), false);
    if (p->grad_query_lses != nullptr) {
      AddColumn(v, p, p->grad_query_lses[s], Name("grad_query_lses", s), false);
    }
  }
  AddGradBlocks(v, p);
  AddWeightGrads(v, p, p->num_queries);
}

}  // namespace

extern const OpRules kPhase1 = {Inputs, ForwardOutputs, BackwardOutputs};

}  // namespace attnres::validate
