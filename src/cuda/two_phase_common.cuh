// The device code both phases of the two-phase schedule share (docs/DESIGN.md,
// "The two phases"; the kernels are phase1_kernel.cuh and phase2_kernel.cuh, the
// host code that plans and launches them two_phase.cu, the per-token math
// core/token_math.h, shared with the CPU kernels of src/cpu/two_phase.cc).
//
// Per token, with u_s = w_s * gamma_s and r_i the RMS of block i:
//   phase 1  z_{s,i} = scale * dot(u_s, v_i) / r_i,   lse_s = logsumexp_i z_{s,i}
//            a_{s,i} = exp(z_{s,i} - lse_s),           o_s = sum_i a_{s,i} v_i
//     backward (g_s = dL/do_s, e_s = dL/dlse_s; o_s and lse_s are not read):
//            dz_{s,i} = a_{s,i} (dot(g_s, v_i) - dot(g_s, o_s) + e_s)   (pivot form)
//            c_{s,i} = dz_{s,i} scale / r_i,   b_i = sum_s dz_{s,i} (-z_{s,i} / (D r_i^2))
//            dv_i = b_i v_i + sum_s (a_{s,i} g_s + c_{s,i} u_s)  (+ dv_i with accumulate_grads)
//            U_s += sum_i c_{s,i} v_i;   dw_s = gamma_s U_s,  dgamma_s = w_s U_s
//   phase 2  z_p = scale * dot(u, p) / r_p,  beta = sigmoid(lse - z_p),
//            keep = 1 - beta = sigmoid(z_p - lse) (each from its own exponent)
//            h = beta o + keep p,  out = h or h / rms(h) * norm_weight
//            (fused update: p = partial + y rounded to T, also written to new_partial)
//     backward: dh through the norm, do = beta dh, dlse = dot(dh, o - p) beta keep,
//            dp = keep dh + c u + b p (+ grad_partial_in),  U += c p,
//            dnorm_weight += g h / r_h
//
// Rows are read in 16-byte chunks (common.cuh: Chunk, here through Io), chunk c
// owned by thread c % threads; the width of each access follows the row's
// alignment, never which thread computes what. float64 takes one element per
// chunk.
//
// Determinism. Every per-token value depends on the problem only (the thread
// count of a phase-1 CTA is a function of dim). Weight gradients: tokens are cut
// into fixed items of TokensPerItem() tokens (a function of num_tokens, S and
// dim); the CTA (phase 1) or warp (phase 2) that takes an item adds its tokens'
// contributions, in token order, into the item's own partial rows, one thread
// per element (AddToItemRow); ReduceRowsKernel (common.cuh) then sums the rows
// in a fixed order. No float atomics: the bits of dw, dgamma and dnorm_weight
// depend on the problem only, never on the grid, the SM count, the GPU model or
// timing.
#ifndef ATTNRES_SRC_CUDA_TWO_PHASE_COMMON_CUH_
#define ATTNRES_SRC_CUDA_TWO_PHASE_COMMON_CUH_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"

namespace attnres::cuda {

// ---------------------------------------------------------------------------
// Shapes and limits.

constexpr int kPhase1MaxThreads = 256;
constexpr int kPhase2Threads = 256;
constexpr int kPhase2Warps = kPhase2Threads / kWarpSize;
// Queries whose dot products (or outputs) share one conversion of a row chunk.
constexpr int kQueryGroup = 4;
// Block rows whose gradients share one read of the g_s and u_s chunks.
constexpr int kSourceGroup = 4;
// Up to this many queries, the query pointer tables travel by value.
constexpr int kMaxInlineQueries = 32;
// Weight-gradient items: at least kMinItemTokens tokens each, at most kMaxItems
// of them, and their partial rows within kPartialBudgetBytes.
constexpr int64_t kMinItemTokens = 8;
constexpr int64_t kMaxItems = 1024;
constexpr int64_t kPartialBudgetBytes = int64_t{64} << 20;
// Statistics that do not fit in shared memory go to a global scratch of at most
// this many bytes (fewer CTAs when needed: the grid changes the speed only).
constexpr size_t kSharedStatsBudget = plan::kSharedStatsBudget;
constexpr int64_t kGlobalStatsBudgetBytes = int64_t{256} << 20;
// Keeps every statistics index (W N (2S + 1) + 5 S N + 2 N) far inside int64.
constexpr int64_t kMaxQueryBlockProduct = int64_t{1} << 40;

// Tokens per weight-gradient item (a function of the problem only): items of
// kMinItemTokens for short calls; for long ones, few enough items that their
// partial rows ([items, rows_per_item, dim] of Acc) stay within the budget.
inline int64_t TokensPerItem(int64_t num_tokens, int64_t rows_per_item, int64_t dim,
                             int64_t acc_bytes) {
  const int64_t row_bytes = std::max<int64_t>(1, rows_per_item * dim * acc_bytes);
  const int64_t max_items = std::clamp<int64_t>(kPartialBudgetBytes / row_bytes, 1, kMaxItems);
  return std::max(kMinItemTokens, (num_tokens + max_items - 1) / max_items);
}

// ---------------------------------------------------------------------------
// Row access.

template <typename Ptr>
using QueryTable = InlinePointerTable<Ptr, kMaxInlineQueries>;

// A row of T in chunks of kVec elements (16 bytes; one element for float64),
// converted to Acc. Chunks past dim read as zero and are not written.
template <typename T>
struct Io {
  using Acc = typename Traits<T>::Acc;
  using Bits = typename Traits<T>::Bits;
  static constexpr bool kScalar = std::is_same_v<T, double>;
  static constexpr int kVec = kScalar ? 1 : 16 / static_cast<int>(sizeof(Bits));

  static __device__ __forceinline__ const Bits* Row(const void* base, int64_t t, int64_t stride) {
    return static_cast<const Bits*>(base) + t * stride;
  }
  static __device__ __forceinline__ Bits* Row(void* base, int64_t t, int64_t stride) {
    return static_cast<Bits*>(base) + t * stride;
  }

  // `bytes` is AccessBytes(row): every chunk of a row shares its alignment.
  static __device__ __forceinline__ void Load(const Bits* row, int bytes, int64_t c, int64_t dim,
                                              Acc (&x)[kVec]) {
    if constexpr (kScalar) {
      x[0] = Traits<T>::ToAcc(row[c]);
    } else {
      const Bits* p = row + c * kVec;
      const int64_t left = dim - c * kVec;
      const typename Chunk<T>::Raw raw =
          left >= kVec ? Chunk<T>::template Load<Hint::kDefault>(p, bytes)
                       : Chunk<T>::template LoadPartial<Hint::kDefault>(p, static_cast<int>(left));
      Chunk<T>::Unpack(raw, x);
    }
  }

  // Evict-first by default: most rows are written once and read by the next op only.
  template <Hint kHint = Hint::kStreaming>
  static __device__ __forceinline__ void Store(Bits* row, int bytes, int64_t c, int64_t dim,
                                               const Acc (&x)[kVec]) {
    if constexpr (kScalar) {
      StoreHinted<kHint>(row + c, Traits<T>::FromAcc(x[0]));
    } else {
      Bits* p = row + c * kVec;
      const int64_t left = dim - c * kVec;
      const typename Chunk<T>::Raw raw = Chunk<T>::Pack(x);
      if (left >= kVec) {
        Chunk<T>::template Store<kHint>(p, raw, bytes);
      } else {
        Chunk<T>::template StorePartial<kHint>(p, raw, static_cast<int>(left));
      }
    }
  }

  // Stores x rounded to T and leaves the rounded values in x: what a later
  // load of the chunk returns. Not evict-first: the kernel that writes such a
  // row rereads it, and so does the next op.
  static __device__ __forceinline__ void StoreRounded(Bits* row, int bytes, int64_t c, int64_t dim,
                                                      Acc (&x)[kVec]) {
    Store<Hint::kDefault>(row, bytes, c, dim, x);
    if constexpr (kScalar) {
      x[0] = Traits<T>::ToAcc(Traits<T>::FromAcc(x[0]));
    } else {
      Chunk<T>::Unpack(Chunk<T>::Pack(x), x);
    }
  }

  // Chunk c of a row of Acc padded with zeros to a whole number of chunks
  // (the u_s rows and the norm weight; 16-byte aligned).
  static __device__ __forceinline__ void LoadWeights(const Acc* row, int64_t c, Acc (&x)[kVec]) {
    if constexpr (kScalar) {
      x[0] = row[c];
    } else {
      const float4* q = reinterpret_cast<const float4*>(row + c * kVec);
#pragma unroll
      for (int k = 0; k < kVec / 4; ++k) {
        const float4 f = q[k];
        x[4 * k] = f.x;
        x[4 * k + 1] = f.y;
        x[4 * k + 2] = f.z;
        x[4 * k + 3] = f.w;
      }
    }
  }
};

// The types and widths every two-phase kernel derives from its storage type T
// (the kernel traits of each phase build on these).
template <typename T>
struct TwoPhaseTraits {
  using Element = T;
  using IO = Io<T>;
  using Acc = typename IO::Acc;
  using Bits = typename IO::Bits;
  static constexpr int kVec = IO::kVec;
};

template <typename Acc, int kVec>
__device__ __forceinline__ Acc Dot(const Acc (&x)[kVec], const Acc (&y)[kVec]) {
  Acc sum = 0;
#pragma unroll
  for (int e = 0; e < kVec; ++e) sum += x[e] * y[e];
  return sum;
}

// How a call of either phase is cut up: its rows, in chunks of kVec elements,
// and their strides; tokens in weight-gradient items of tokens_per_item tokens
// (TokensPerItem). The host fills it in one place (ShapeOf).
struct PhaseShape {
  int64_t num_tokens;
  int64_t tokens_per_item;
  int64_t num_items;
  int64_t dim;
  int64_t row_chunks;  // ceil(dim / kVec)
  RowStrides strides;

  // The end of the item whose tokens start at `first`.
  __device__ __forceinline__ int64_t ItemEnd(int64_t first) const {
    return first + tokens_per_item < num_tokens ? first + tokens_per_item : num_tokens;
  }
};

// The weight-gradient items' partial rows: element e of chunk c of this
// item's row of dim Acc gets value(e), stored by the item's first token and
// added by the others. Each element belongs to one thread for all of the
// item's tokens: no atomics, no zeroing beforehand. value(e) is computed only
// for elements inside the row.
template <int kVec, typename Acc, typename Value>
__device__ __forceinline__ void AddToItemRow(Acc* row, int64_t c, int64_t dim, bool first_token,
                                             const Value& value) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const int64_t d = c * kVec + e;
    if (d >= dim) break;
    const Acc x = value(e);
    row[d] = first_token ? x : row[d] + x;
  }
}

// ---------------------------------------------------------------------------
// u_s = w_s * gamma_s (gamma_s = 1 when absent or without rmsnorm), rows padded
// with zeros to `padded`, then, for phase 2's input norm, the norm weight (ones
// when absent): Acc [rows + has_norm, padded]. The same rounding as the CPU's
// (one product in the accumulation type).
template <typename T>
__global__ void __launch_bounds__(256)
    PrepareWeightsKernel(const void* w, const void* gamma, const void* norm_weight, bool has_norm,
                         int64_t rows, int64_t dim, int64_t padded,
                         typename Traits<T>::Acc* out) {
  using Acc = typename Traits<T>::Acc;
  const int64_t total = (rows + (has_norm ? 1 : 0)) * padded;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / padded, d = k % padded;
    Acc value = 0;
    if (d < dim) {
      if (r < rows) {
        value = LoadAcc<T>(w, r * dim + d);
        if (gamma != nullptr) value *= LoadAcc<T>(gamma, r * dim + d);
      } else {
        value = norm_weight != nullptr ? LoadAcc<T>(norm_weight, d) : Acc(1);
      }
    }
    out[k] = value;
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_TWO_PHASE_COMMON_CUH_
