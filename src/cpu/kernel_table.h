// The contract between the CPU dispatcher (backend.cc, compiled for the baseline
// ISA) and the kernel variants: each op's kernels (block_attn_res.cc, two_phase.cc)
// and the table of one variant (kernel_table.cc), all compiled once per ISA
// (CMakeLists.txt: ATTNRES_ISAS, ATTNRES_CPU_KERNEL_SOURCES).
//
// Only plain structs, declarations and integer size formulas live here: a function
// with floating-point or vector work defined in a header shared by translation
// units built with different -march flags could be merged by the linker into the
// baseline path and run AVX-512 code on a CPU without it.
#ifndef ATTNRES_SRC_CPU_KERNEL_TABLE_H_
#define ATTNRES_SRC_CPU_KERNEL_TABLE_H_

#include <cstdint>
#include <vector>

#include "attnres/attnres.h"

namespace attnres::cpu {

// Per-call constants, prepared once by the dispatcher. "A" below is the
// accumulation type: float, or double for float64 inputs. Vectors of length
// padded_dim are zero beyond dim so that kernels can run whole SIMD vectors.
// The kernels see only these structs (never attnres_params): the ABI may grow
// without touching them, and what a kernel reads is listed here.
//
// What every op reads (field meanings as in attnres.h), as validated by
// src/validate/: rows of dim elements, strides in elements.
struct RowsInfo {
  int64_t dim;
  int64_t source_row_stride, out_row_stride, grad_out_row_stride, grad_source_row_stride;
  double scale, eps;
  bool rmsnorm;
  void* out;             // forward output: h
  const void* grad_out;  // backward input: g = dLoss/dh
  // Prepared by the dispatcher.
  int64_t padded_dim;  // dim rounded up to two of the widest vectors (a pair)
  const void* wg;      // A[padded_dim] rows: w * gamma (w when rmsnorm is off or gamma
                       // is NULL); two-phase phase 1: one row per query
};

// The single op (block_attn_res.cc): per-call constants.
struct CallInfo : RowsInfo {
  int64_t num_tokens;
  void* rms_cache;             // [num_tokens, L] of A, forward output / backward input
  void* alpha_cache;           //   (null: not wanted / not given)
  // Prepared by the dispatcher.
  int64_t num_sources;         // L
  int64_t tile_tokens;         // tokens per tile: pass 2 rereads the tile's rows from cache
  int64_t pass_one_span;       // elements of a row pass 1 reads at a time (PassOneSpan)
  const void* const* sources;  // [L] blocks then partial
  void* const* grad_sources;   // [L] (backward; entries may be null)
  bool stream_stores;          // write out / dv rows with non-temporal stores
};

// Scratch of one thread, in units of A, 64-byte aligned (Call::AllocateScratch
// in backend.cc lays it out).
struct Scratch {
  void* acc;    // [2, tile, padded_dim] (backward): two tiles' grad_out rows in A
  void* stats;  // [4, tile, L] (forward), [2, 4, tile, L] (backward): z, r, alpha, dot(g, v)
  void* u;      // [padded_dim] (backward): this chunk's share of U, or null for no dw/dgamma
  void* carry;  // [tiles in flight (1 forward, 2 backward), tile, L] of kDotsCarryBytes,
                // when pass_one_span < dim: the sums of pass 1's rows between spans
};

// Pass 1 of the single op reads every row with wg (the backward with its g row too):
// `bytes_per_elem` bytes of rows per element for one Dots call. While a whole
// row's worth fits in 32 KB of L1 a row is read whole; past that, a span of 24 KB
// of it at a time, every row's span in turn (block_attn_res.cc), so that the spans
// of wg and g stay in L1. Spans are whole multiples of kPassOneSpanStep elements
// (of every variant's step: simd-inl.h checks).
constexpr int64_t kPassOneWholeRowBytes = 32 * 1024, kPassOneSpanBytes = 24 * 1024;
constexpr int64_t kPassOneSpanStep = 64;
inline int64_t PassOneSpan(int64_t dim, int64_t bytes_per_elem) {
  if (dim * bytes_per_elem <= kPassOneWholeRowBytes) return dim;
  const int64_t steps = kPassOneSpanBytes / bytes_per_elem / kPassOneSpanStep;
  return (steps > 1 ? steps : 1) * kPassOneSpanStep;
}
// One row's sums between spans (simd-inl.h: Row::Dots): 3 sums of 4 vectors of
// 64 bytes at most.
constexpr int64_t kDotsCarryBytes = 3 * 4 * 64;

// Tokens [begin, end) of one call. Forward: one tile (end - begin <= tile_tokens),
// writes out and the requested caches. Backward: one chunk (backend.cc, the unit
// of the deterministic dw/dgamma sum), tiled inside as a pipeline of two tiles;
// writes the requested source gradients and adds the chunk's U to scratch.u
// (which the caller zeroed).
using RangeFn = void (*)(const CallInfo& info, const Scratch& scratch, int64_t begin,
                         int64_t end);

struct BlockAttnResKernels {
  RangeFn forward[ATTNRES_DTYPE_COUNT];  // indexed by attnres_dtype
  RangeFn backward[ATTNRES_DTYPE_COUNT];
};

// The two-phase ops (two_phase.cc); rows of A are padded with zeros to padded_dim
// and in the kernels' row order.
struct PhaseInfo : RowsInfo {
  int64_t num_blocks, num_queries;
  double norm_eps;
  bool input_norm, accumulate_grads;
  bool stream_stores;  // phase 1 backward: write the dv rows with non-temporal stores
  // Phase 1: the blocks, and per query its output and LSE (gradients backward).
  const void* const* blocks;
  void* const* query_outs;
  void* const* query_lses;
  const void* const* grad_query_outs;  // entries may be null (zero gradient)
  const void* const* grad_query_lses;  // null, or entries that may be null
  void* const* grad_blocks;            // null, or entries that may be null
  // Phase 2: o, its LSE and the partial block in; h out (gradients backward).
  const void* query_out;
  const void* query_lse;
  const void* partial;
  void* grad_query_out;
  void* grad_query_lse;
  void* grad_partial;
  // Phase 2's fused partial-block update: y in, p' = partial + y out (forward); the
  // gradient p' receives elsewhere, added into grad_partial (backward).
  const void* partial_update;
  void* new_partial;
  const void* grad_partial_in;
  // Prepared by the dispatcher.
  const void* norm_weight;  // phase 2 with input_norm: A[padded_dim], ones for NULL
};

// Phase 1's running dot products of one block row with one group of queries: up
// to 8 queries and the sum of squares, 2 vectors of at most 64 bytes each
// (two_phase.cc: kGroup).
constexpr int64_t kPhaseGroupSumsBytes = (8 + 1) * 2 * 64;
// Bytes of scratch of one thread for the two-phase kernels: pointer tables
// (5S + 2N), the running sums of N block rows, then in A: the S grad_out rows
// widened (phase 1 backward) and the stats z, a, dz [S, N], r, b [N].
inline int64_t PhaseScratchBytes(int64_t num_queries, int64_t num_blocks, int64_t padded_dim,
                                 int64_t accum_bytes) {
  const int64_t S = num_queries, N = num_blocks;
  const int64_t pointers = (5 * S + 2 * N) * static_cast<int64_t>(sizeof(void*));
  return (pointers + 63) / 64 * 64 + N * kPhaseGroupSumsBytes +
         (S * padded_dim + 3 * S * N + 2 * N) * accum_bytes;
}
// Rows of weight-gradient partial sums per chunk of the backward: phase 1 U_s
// ([S, padded_dim]); phase 2 U and the norm weight's ([2, padded_dim]).
inline int64_t PhasePartialRows(int phase, int64_t num_queries) {
  return phase == 1 ? num_queries : 2;
}

// Tokens [begin, end): forward writes the outputs; backward writes the requested
// source gradients and adds this range's weight-gradient sums into `partials`
// (PhasePartialRows rows, zeroed by the caller; null when no weight gradient is
// requested).
using PhaseRangeFn = void (*)(const PhaseInfo& info, void* scratch, void* partials, int64_t begin,
                              int64_t end);

struct PhaseKernels {
  PhaseRangeFn phase1_forward[ATTNRES_DTYPE_COUNT];  // indexed by attnres_dtype
  PhaseRangeFn phase1_backward[ATTNRES_DTYPE_COUNT];
  PhaseRangeFn phase2_forward[ATTNRES_DTYPE_COUNT];
  PhaseRangeFn phase2_backward[ATTNRES_DTYPE_COUNT];
};

// Rows shared by every op's dispatcher, in the kernels' row order (the order of
// Row<T>::Load2 in simd-inl.h: with bf16 on vectors wider than 16 bytes, each pair
// of vectors holds its 2 * lanes elements in "unpack" order). Elements are of the
// op's dtype T, rows of A of padded_dim.
//
// WeightRowFn: row = w * gamma, zeros from dim to padded_dim (w null: ones; gamma
// null: w alone). Each entry is one product rounded to A, the bits of the scalar
// w[d] * gamma[d].
using WeightRowFn = void (*)(const void* w, const void* gamma, int64_t dim, int64_t padded_dim,
                             void* row);
// WeightGradFn: out[d] = factor[d] * U[d] for d < dim, in memory order (factor
// null: U[d]), where U is the sum of `rows` rows of A at u, row_stride elements
// apart, added in row order starting from zero: the backward's chunk order, so
// the bits do not depend on the thread count.
using WeightGradFn = void (*)(const void* u, int64_t rows, int64_t row_stride,
                              const void* factor, void* out, int64_t dim);

// Each op's kernels, one line per op: X(its kernels' struct, the KernelTable
// member, the table of them its source defines in namespace ATTNRES_ISA). A new op
// adds its line here and its source to ATTNRES_CPU_KERNEL_SOURCES (CMakeLists.txt).
#define ATTNRES_CPU_OPS(X)                                      \
  X(BlockAttnResKernels, block_attn_res, kBlockAttnResKernels) \
  X(PhaseKernels, two_phase, kTwoPhaseKernels)

// A table of functions indexed by attnres_dtype (FLOAT32, FLOAT64, BFLOAT16,
// FLOAT16), from a function template over the element type; expanded in the
// sources of the kernels, where Bf16 and F16 (scalar_types.h) are known.
#define ATTNRES_BY_DTYPE(Fn) {Fn<float>, Fn<double>, Fn<Bf16>, Fn<F16>}

// One variant: its shared rows and every op's kernels (kernel_table.cc).
struct KernelTable {
  const char* name;
  int vector_bytes;
  WeightRowFn weight_row[ATTNRES_DTYPE_COUNT];  // by attnres_dtype
  WeightGradFn weight_grad[ATTNRES_DTYPE_COUNT];
#define ATTNRES_CPU_OP_MEMBER(Type, member, symbol) const Type* member;
  ATTNRES_CPU_OPS(ATTNRES_CPU_OP_MEMBER)
#undef ATTNRES_CPU_OP_MEMBER
};

#ifdef ATTNRES_ISA
// One variant's tables, in a namespace named after the variant.
namespace ATTNRES_ISA {
#define ATTNRES_CPU_OP_DECLARE(Type, member, symbol) extern const Type symbol;
ATTNRES_CPU_OPS(ATTNRES_CPU_OP_DECLARE)
#undef ATTNRES_CPU_OP_DECLARE
const KernelTable* Kernels();
}  // namespace ATTNRES_ISA
#endif

// The variant `name` when this CPU runs it, else null. For the tests of the
// shared rows (tests/cpp/test_weight_rows.cc) only: the library hides everything
// else of its internals, and these rows cannot be observed through the C ABI.
__attribute__((visibility("default"))) const KernelTable* KernelTableForTesting(const char* name);

// The compiled variants' tables, best first; the last is the baseline. Generated by
// CMake from ATTNRES_ISAS (compiled_isas.cc.in); each variant's kernel_table.cc
// defines its ATTNRES_ISA::Kernels().
std::vector<const KernelTable*> CompiledTables();

}  // namespace attnres::cpu

#endif  // ATTNRES_SRC_CPU_KERNEL_TABLE_H_
