// The two-phase schedule on CUDA (docs/DESIGN.md, "The two phases"; the CPU
// kernels are src/cpu/two_phase.cc, the per-token math core/token_math.h, shared
// by both). attnres::CudaTwoPhase turns a validated attnres_params into launches
// on the caller's stream.
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
// Kernels.
//   Phase 1: one CTA per token (Phase1Kernel). Pass 1 reads each block row once
//     from memory and forms its S + 1 dot products (2S + 1 backward: u_s, g_s,
//     the sum of squares), queries in groups of kQueryGroup so that a chunk of
//     the row is converted once per group; each warp leaves its partial sums in
//     the statistics (no barrier per row), summed in warp order after the last
//     row. Thread s then runs query s's softmax over the N logits (and its
//     backward); pass 2 rereads the token's rows (from L1/L2) for the S outputs,
//     or for the dv_i (kSourceGroup rows at a time, so that g_s and u_s are read
//     once per group) and the U_s.
//   Phase 2: one warp per token (Phase2Kernel): a few passes over the token's o,
//     p (and g) rows, warp-shuffle reductions only; h is recomputed, never stored.
//     With the fused update the first pass forms p' = partial + y and stores it
//     to new_partial; the later passes read p' back from there (each lane rereads
//     the chunks it wrote itself, so no barrier), as the CPU's pre-pass does.
//   Rows are read in 16-byte chunks (common.cuh: Chunk), chunk c owned by thread
//     c % threads; the width of each access follows the row's alignment, never
//     which thread computes what. float64 takes one element per chunk.
//
// Determinism. Every per-token value depends on the problem only (the thread
// count of a phase-1 CTA is a function of dim). Weight gradients: tokens are cut
// into fixed items of TokensPerItem() tokens (a function of num_tokens, S and
// dim); the CTA (phase 1) or warp (phase 2) that takes an item adds its tokens'
// contributions, in token order, into the item's own partial rows, one thread
// per element; ReduceRowsKernel (common.cuh) then sums the rows in a fixed
// order. No float atomics: the bits of dw, dgamma and dnorm_weight depend on
// the problem only, never on the grid, the SM count, the GPU model or timing.
//
// Scratch (u_s rows, pointer tables beyond the inline ones, the statistics when
// they do not fit in shared memory, the partial rows) comes from the library's
// pool, stream-ordered: a call never synchronises the host and can be captured
// into a CUDA graph.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"
#include "cuda/runtime.h"

namespace attnres {
namespace cuda {
namespace {

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
int64_t TokensPerItem(int64_t num_tokens, int64_t rows_per_item, int64_t dim, int64_t acc_bytes) {
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

// ---------------------------------------------------------------------------
// Phase 1.

struct Phase1Args {
  PointerTable<const void*> blocks;      // N rows of [num_tokens, strides.source]
  PointerTable<void*> grad_blocks;       // backward: N entries, null = not wanted
  QueryTable<void*> outs;                // forward: o_s [num_tokens, strides.out]
  QueryTable<void*> lses;                // forward: lse_s, Acc [num_tokens]
  QueryTable<const void*> grad_outs;     // backward: g_s, null = zero
  QueryTable<const void*> grad_lses;     // backward: e_s, Acc [num_tokens], null = zero
  const void* u;                         // Acc [S, row_chunks * kVec]
  void* stats_global;                    // Acc [gridDim.x, stats_elems], or null: shared
  void* u_partials;                      // backward: Acc [num_items, S, dim], or null
  PhaseShape shape;
  int64_t stats_elems;
  int64_t num_blocks;   // N
  int64_t num_queries;  // S
  double scale;
  double eps;
  bool rmsnorm;
  bool accumulate;
  bool any_grad_block;
};

// The pointer tables travel by value: stay within the classic 4 KiB of kernel
// parameters.
static_assert(sizeof(Phase1Args) <= 4096, "Phase1Args exceeds 4 KiB of kernel parameters");

// Elements of Acc one phase-1 CTA of `warps` warps keeps per token: the warps'
// partial dot products [W, N, K] (slot 0 receives the totals), r [N], z and a
// [S, N]; backward also dz (then c) and the b terms [S, N], and b [N].
int64_t Phase1StatsElems(int64_t N, int64_t S, int warps, bool backward) {
  const int64_t K = backward ? 2 * S + 1 : S + 1;
  return warps * N * K + N + 2 * S * N + (backward ? 2 * S * N + N : 0);
}

// Pass 2 of a token's phase 1, for each of this thread's chunks c and each
// query s: chunk c of sum_i coef_{s,i} v_i over the token's N block rows, in
// block order, handed to use(s, c, sum). That is o_s in the forward (coef = a)
// and the token's share of U_s in the backward (coef = c). The rows are
// reread from cache (pass 1 just read them), each chunk converted once per
// group of kQueryGroup queries. (N, S and dim come from the kernel rather than
// from args: reading them here again costs registers.)
template <typename T, typename Use>
__device__ __forceinline__ void ForEachWeightedRowSum(const Phase1Args& args, int64_t N, int64_t S,
                                                      int64_t dim, int64_t t,
                                                      const typename Io<T>::Acc* coef,
                                                      const Use& use) {
  using IO = Io<T>;
  using Acc = typename IO::Acc;
  using Bits = typename IO::Bits;
  constexpr int kVec = IO::kVec;
  for (int64_t c = threadIdx.x; c < args.shape.row_chunks; c += blockDim.x) {
    for (int64_t s0 = 0; s0 < S; s0 += kQueryGroup) {
      Acc acc[kQueryGroup][kVec] = {};
      for (int64_t i = 0; i < N; ++i) {
        const Bits* v =
            IO::Row(args.blocks.Get(static_cast<int>(i)), t, args.shape.strides.source);
        Acc x[kVec];
        IO::Load(v, AccessBytes(v), c, dim, x);
#pragma unroll
        for (int q = 0; q < kQueryGroup; ++q) {
          if (s0 + q >= S) break;
          const Acc weight = coef[(s0 + q) * N + i];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[q][e] += weight * x[e];
        }
      }
#pragma unroll
      for (int q = 0; q < kQueryGroup; ++q) {
        if (s0 + q >= S) break;
        use(s0 + q, c, acc[q]);
      }
    }
  }
}

template <typename T, bool kBackward>
__global__ void __launch_bounds__(kPhase1MaxThreads)
    Phase1Kernel(const __grid_constant__ Phase1Args args) {
  using IO = Io<T>;
  using Acc = typename IO::Acc;
  using Bits = typename IO::Bits;
  constexpr int kVec = IO::kVec;
  extern __shared__ __align__(16) unsigned char shared_stats[];

  const PhaseShape& shape = args.shape;
  const int64_t N = args.num_blocks, S = args.num_queries, dim = shape.dim;
  const int64_t K = kBackward ? 2 * S + 1 : S + 1;  // dots per row: u_s, (g_s,) sum of squares
  const int64_t padded = shape.row_chunks * kVec;
  const int num_warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const Acc scale = static_cast<Acc>(args.scale), eps = static_cast<Acc>(args.eps);
  const Acc* u = static_cast<const Acc*>(args.u);

  Acc* slots = args.stats_global != nullptr
                   ? static_cast<Acc*>(args.stats_global) + blockIdx.x * args.stats_elems
                   : reinterpret_cast<Acc*>(shared_stats);
  Acc* r = slots + num_warps * N * K;  // [N]
  Acc* z = r + N;                      // [S, N]
  Acc* a = z + S * N;                  // [S, N]
  Acc* dz = a + S * N;                 // backward [S, N]: dot(g_s, v_i), dz, then c_{s,i}
  Acc* bz = dz + S * N;                // backward [S, N]: dz_{s,i} * KeyChain b, summed into b_i
  Acc* b = bz + S * N;                 // backward [N]

  for (int64_t item = blockIdx.x; item < shape.num_items; item += gridDim.x) {
    const int64_t first = item * shape.tokens_per_item;
    const int64_t end = shape.ItemEnd(first);
    for (int64_t t = first; t < end; ++t) {
      // Pass 1: every block row once from memory; per warp, its partial sums.
      for (int64_t i = 0; i < N; ++i) {
        const Bits* v = IO::Row(args.blocks.Get(static_cast<int>(i)), t, shape.strides.source);
        const int v_bytes = AccessBytes(v);
        Acc* slot = slots + (warp * N + i) * K;
        for (int64_t s0 = 0; s0 < S; s0 += kQueryGroup) {
          const Bits* g[kQueryGroup] = {};
          int g_bytes[kQueryGroup] = {};
          if constexpr (kBackward) {
#pragma unroll
            for (int q = 0; q < kQueryGroup; ++q) {
              const void* base = s0 + q < S ? args.grad_outs.Get(s0 + q) : nullptr;
              if (base != nullptr) {
                g[q] = IO::Row(base, t, shape.strides.grad_out);
                g_bytes[q] = AccessBytes(g[q]);
              }
            }
          }
          Acc dot_u[kQueryGroup] = {}, dot_g[kQueryGroup] = {}, sum_sq = 0;
          for (int64_t c = threadIdx.x; c < shape.row_chunks; c += blockDim.x) {
            Acc x[kVec];
            IO::Load(v, v_bytes, c, dim, x);
            if (s0 == 0) sum_sq += Dot(x, x);
#pragma unroll
            for (int q = 0; q < kQueryGroup; ++q) {
              if (s0 + q >= S) break;
              Acc y[kVec];
              IO::LoadWeights(u + (s0 + q) * padded, c, y);
              dot_u[q] += Dot(y, x);
              if (kBackward && g[q] != nullptr) {
                IO::Load(g[q], g_bytes[q], c, dim, y);
                dot_g[q] += Dot(y, x);
              }
            }
          }
#pragma unroll
          for (int q = 0; q < kQueryGroup; ++q) {
            if (s0 + q >= S) break;
            dot_u[q] = WarpSum(dot_u[q]);
            if (kBackward) dot_g[q] = WarpSum(dot_g[q]);
          }
          if (s0 == 0) sum_sq = WarpSum(sum_sq);
          if (lane == 0) {
#pragma unroll
            for (int q = 0; q < kQueryGroup; ++q) {
              if (s0 + q >= S) break;
              slot[s0 + q] = dot_u[q];
              if (kBackward) slot[S + s0 + q] = dot_g[q];
            }
            if (s0 == 0) slot[K - 1] = sum_sq;
          }
        }
      }
      __syncthreads();
      // The warps' partials summed in warp order (into warp 0's slots), and r_i.
      for (int64_t k = threadIdx.x; k < N * K; k += blockDim.x) {
        Acc total = slots[k];
        for (int w = 1; w < num_warps; ++w) total += slots[w * N * K + k];
        slots[k] = total;
        if (k % K == K - 1) r[k / K] = args.rmsnorm ? math::Rms(total, dim, eps) : Acc(1);
      }
      __syncthreads();
      // Query s: its logits, lse and weights (and their backward), by one thread.
      for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
        Acc* z_s = z + s * N;
        Acc* a_s = a + s * N;
        for (int64_t i = 0; i < N; ++i) z_s[i] = scale * (slots[i * K + s] / r[i]);
        const Acc lse = math::LogSumExp(z_s, N);
        for (int64_t i = 0; i < N; ++i) a_s[i] = math::Exp(z_s[i] - lse);
        if constexpr (!kBackward) {
          static_cast<Acc*>(args.lses.Get(s))[t] = lse;
        } else {
          Acc* dz_s = dz + s * N;
          for (int64_t i = 0; i < N; ++i) dz_s[i] = slots[i * K + S + s];
          const void* lse_grad = args.grad_lses.Get(s);
          const Acc e = lse_grad != nullptr ? static_cast<const Acc*>(lse_grad)[t] : Acc(0);
          math::SoftmaxBackward(a_s, dz_s, N, e, dz_s);
          for (int64_t i = 0; i < N; ++i) {
            const math::KeyChain<Acc> chain =
                math::KeyGradient(z_s[i], r[i], scale, dim, args.rmsnorm);
            bz[s * N + i] = dz_s[i] * chain.b;
            dz_s[i] *= chain.a;  // c_{s,i}
          }
        }
      }
      __syncthreads();
      if constexpr (!kBackward) {
        // Pass 2: o_s = sum_i a_{s,i} v_i.
        ForEachWeightedRowSum<T>(args, N, S, dim, t, a,
                                 [&](int64_t s, int64_t c, const Acc (&o_s)[kVec]) {
                                   Bits* o = IO::Row(args.outs.Get(s), t, shape.strides.out);
                                   IO::Store(o, AccessBytes(o), c, dim, o_s);
                                 });
      } else {
        // b_i = sum_s dz_{s,i} b_{s,i}, in query order.
        for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
          Acc sum = 0;
          for (int64_t s = 0; s < S; ++s) sum += bz[s * N + i];
          b[i] = sum;
        }
        __syncthreads();
        // Pass 2a: dv_i = b_i v_i + sum_s (a_{s,i} g_s + c_{s,i} u_s), kSourceGroup rows
        // at a time so that each g_s and u_s chunk is converted once per group.
        for (int64_t c = threadIdx.x; args.any_grad_block && c < shape.row_chunks;
             c += blockDim.x) {
          for (int64_t i0 = 0; i0 < N; i0 += kSourceGroup) {
            Bits* dst[kSourceGroup] = {};
            bool any = false;
#pragma unroll
            for (int k = 0; k < kSourceGroup; ++k) {
              void* base = i0 + k < N ? args.grad_blocks.Get(static_cast<int>(i0 + k)) : nullptr;
              if (base != nullptr) dst[k] = IO::Row(base, t, shape.strides.grad_source);
              any |= base != nullptr;
            }
            if (!any) continue;
            Acc acc[kSourceGroup][kVec] = {};
#pragma unroll
            for (int k = 0; k < kSourceGroup; ++k) {
              if (dst[k] == nullptr) continue;
              const Bits* v =
                  IO::Row(args.blocks.Get(static_cast<int>(i0 + k)), t, shape.strides.source);
              Acc x[kVec];
              IO::Load(v, AccessBytes(v), c, dim, x);
#pragma unroll
              for (int e = 0; e < kVec; ++e) acc[k][e] = b[i0 + k] * x[e];
            }
            for (int64_t s = 0; s < S; ++s) {
              Acc u_s[kVec], g_s[kVec];
              IO::LoadWeights(u + s * padded, c, u_s);
              const void* g_base = args.grad_outs.Get(s);
              if (g_base != nullptr) {
                const Bits* g = IO::Row(g_base, t, shape.strides.grad_out);
                IO::Load(g, AccessBytes(g), c, dim, g_s);
              }
#pragma unroll
              for (int k = 0; k < kSourceGroup; ++k) {
                if (dst[k] == nullptr) continue;
                const Acc alpha = a[s * N + i0 + k], coef = dz[s * N + i0 + k];
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                  acc[k][e] += g_base != nullptr ? alpha * g_s[e] + coef * u_s[e] : coef * u_s[e];
                }
              }
            }
#pragma unroll
            for (int k = 0; k < kSourceGroup; ++k) {
              if (dst[k] == nullptr) continue;
              const int bytes = AccessBytes(dst[k]);
              if (args.accumulate) {
                Acc old[kVec];
                IO::Load(dst[k], bytes, c, dim, old);
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc[k][e] += old[e];
              }
              IO::Store(dst[k], bytes, c, dim, acc[k]);
            }
          }
        }
        // Pass 2b: U_s += sum_i c_{s,i} v_i into this item's partial rows.
        if (args.u_partials != nullptr) {
          Acc* rows = static_cast<Acc*>(args.u_partials) + item * S * dim;
          const bool first_token = t == first;
          ForEachWeightedRowSum<T>(args, N, S, dim, t, dz,
                                   [&](int64_t s, int64_t c, const Acc (&u_s)[kVec]) {
                                     AddToItemRow<kVec>(rows + s * dim, c, dim, first_token,
                                                        [&](int e) { return u_s[e]; });
                                   });
        }
      }
      __syncthreads();  // the statistics are the next token's
    }
  }
}

// ---------------------------------------------------------------------------
// Phase 2.

struct Phase2Args {
  const void* o;            // phase 1's o, [num_tokens, strides.source]
  const void* partial;      // or null: h = o
  const void* partial_update;  // forward, optional: y, [num_tokens, strides.source]
  void* new_partial;  // forward, with partial_update: p' = partial + y, [num_tokens, strides.out]
  const void* lse;          // Acc [num_tokens]; read only with a partial block
  const void* weights;      // Acc [1 + input_norm, row_chunks * kVec]: u, then the norm weight
  void* out;                // forward
  const void* grad_out;     // backward
  void* grad_o;             // backward, optional
  void* grad_lse;           // backward, optional, Acc [num_tokens]
  void* grad_partial;       // backward, optional
  const void* grad_partial_in;  // backward, optional: [num_tokens, strides.grad_out]
  void* u_partials;         // backward: Acc [num_items, dim], or null
  void* norm_partials;      // backward: Acc [num_items, dim], or null
  PhaseShape shape;
  double scale;
  double eps;
  double norm_eps;
  bool rmsnorm;
  bool input_norm;
};

// kFused: the fused partial-block update (forward: partial_update and new_partial;
// backward: grad_partial_in), in kernels of its own so that the plain merge keeps
// its registers (with the update inline, the 16-bit forward held 55-56 registers
// rather than 40 on sm_90: 4 CTAs of 256 threads per SM instead of 6).
template <typename T, bool kBackward, bool kFused>
__global__ void __launch_bounds__(kPhase2Threads)
    Phase2Kernel(const __grid_constant__ Phase2Args args) {
  using IO = Io<T>;
  using Acc = typename IO::Acc;
  using Bits = typename IO::Bits;
  constexpr int kVec = IO::kVec;
  const int lane = threadIdx.x % kWarpSize;
  const PhaseShape& shape = args.shape;
  const int64_t dim = shape.dim, padded = shape.row_chunks * kVec;
  const Acc* u = static_cast<const Acc*>(args.weights);
  const Acc* norm_weight = args.input_norm ? u + padded : nullptr;
  const Acc scale = static_cast<Acc>(args.scale);

  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kPhase2Warps + threadIdx.x / kWarpSize;
       item < shape.num_items; item += static_cast<int64_t>(gridDim.x) * kPhase2Warps) {
    const int64_t first = item * shape.tokens_per_item;
    const int64_t end = shape.ItemEnd(first);
    for (int64_t t = first; t < end; ++t) {
      const bool first_token = t == first;
      const Bits* o = IO::Row(args.o, t, shape.strides.source);
      const Bits* p = args.partial != nullptr ? IO::Row(args.partial, t, shape.strides.source)
                                              : nullptr;
      const int o_bytes = AccessBytes(o);
      int p_bytes = p != nullptr ? AccessBytes(p) : 16;
      // The merge weight.
      Acc beta = 1, keep = 0, z = 0, r = 1;  // keep = 1 - beta, formed on its own (token_math.h)
      if (p != nullptr) {
        // The fused forward: p' = partial + y, each element rounded to T as a separate
        // addition would round it, is what the token merges.
        constexpr bool kUpdate = kFused && !kBackward;
        const Bits* update = nullptr;
        Bits* p_new = nullptr;
        int update_bytes = 16, p_new_bytes = 16;
        if constexpr (kUpdate) {
          update = IO::Row(args.partial_update, t, shape.strides.source);
          p_new = IO::Row(args.new_partial, t, shape.strides.out);
          update_bytes = AccessBytes(update);
          p_new_bytes = AccessBytes(p_new);
        }
        Acc dot = 0, sum_sq = 0;
        for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
          Acc x[kVec], y[kVec];
          IO::Load(p, p_bytes, c, dim, x);
          if constexpr (kUpdate) {
            IO::Load(update, update_bytes, c, dim, y);
#pragma unroll
            for (int e = 0; e < kVec; ++e) x[e] += y[e];
            IO::StoreRounded(p_new, p_new_bytes, c, dim, x);  // x is now p'
          }
          IO::LoadWeights(u, c, y);
          dot += Dot(y, x);
          sum_sq += Dot(x, x);
        }
        if constexpr (kUpdate) {  // every later pass merges p' (this lane's own stores)
          p = p_new;
          p_bytes = p_new_bytes;
        }
        dot = WarpSum(dot);
        sum_sq = WarpSum(sum_sq);
        r = args.rmsnorm ? math::Rms(sum_sq, dim, static_cast<Acc>(args.eps)) : Acc(1);
        z = scale * (dot / r);
        const math::MergeWeights<Acc> weights = math::MergeWeightsOf(static_cast<const Acc*>(args.lse)[t], z);
        beta = weights.beta;
        keep = weights.keep;
      }
      // h over chunk c.
      const auto h_of = [&](int64_t c, Acc (&h)[kVec]) {
        IO::Load(o, o_bytes, c, dim, h);
        if (p == nullptr) return;
        Acc x[kVec];
        IO::Load(p, p_bytes, c, dim, x);
#pragma unroll
        for (int e = 0; e < kVec; ++e) h[e] = beta * h[e] + keep * x[e];
      };

      if constexpr (!kBackward) {
        Acc inv_rms = 1;
        if (args.input_norm) {
          Acc sum_sq = 0;
          for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
            Acc h[kVec];
            h_of(c, h);
            sum_sq += Dot(h, h);
          }
          inv_rms = Acc(1) / math::Rms(WarpSum(sum_sq), dim, static_cast<Acc>(args.norm_eps));
        }
        Bits* out = IO::Row(args.out, t, shape.strides.out);
        const int out_bytes = AccessBytes(out);
        for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
          Acc h[kVec];
          h_of(c, h);
          if (args.input_norm) {
            Acc nw[kVec];
            IO::LoadWeights(norm_weight, c, nw);
#pragma unroll
            for (int e = 0; e < kVec; ++e) h[e] = h[e] * inv_rms * nw[e];
          }
          IO::Store(out, out_bytes, c, dim, h);
        }
      } else {
        const Bits* g = IO::Row(args.grad_out, t, shape.strides.grad_out);
        const int g_bytes = AccessBytes(g);
        // With the input norm, h' = h / r_h: dh = (g nw - h' dot(g nw, h') / dim) / r_h.
        Acc inv_rms = 1, proj = 0;
        if (args.input_norm) {
          Acc sum_sq = 0, gh = 0;
          for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
            Acc h[kVec], gx[kVec], nw[kVec];
            h_of(c, h);
            IO::Load(g, g_bytes, c, dim, gx);
            IO::LoadWeights(norm_weight, c, nw);
            sum_sq += Dot(h, h);
#pragma unroll
            for (int e = 0; e < kVec; ++e) gh += gx[e] * nw[e] * h[e];
          }
          inv_rms = Acc(1) / math::Rms(WarpSum(sum_sq), dim, static_cast<Acc>(args.norm_eps));
          proj = WarpSum(gh) * inv_rms / static_cast<Acc>(dim);
        }
        // dh over chunk c, given h there (ignored without the norm) and g.
        const auto dh_of = [&](int64_t c, const Acc (&h)[kVec], Acc (&dh)[kVec]) {
          IO::Load(g, g_bytes, c, dim, dh);
          if (!args.input_norm) return;
          Acc nw[kVec];
          IO::LoadWeights(norm_weight, c, nw);
#pragma unroll
          for (int e = 0; e < kVec; ++e) dh[e] = (dh[e] * nw[e] - h[e] * inv_rms * proj) * inv_rms;
        };
        // do = beta dh, dbeta = dot(dh, o - p), dnorm_weight += g h / r_h.
        Bits* grad_o = args.grad_o != nullptr ? IO::Row(args.grad_o, t, shape.strides.grad_source)
                                              : nullptr;
        const int grad_o_bytes = grad_o != nullptr ? AccessBytes(grad_o) : 16;
        Acc* norm_row =
            args.norm_partials != nullptr ? static_cast<Acc*>(args.norm_partials) + item * dim : nullptr;
        Acc dbeta = 0;
        for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
          Acc h[kVec] = {}, dh[kVec];
          if (args.input_norm || norm_row != nullptr) h_of(c, h);
          dh_of(c, h, dh);
          if (p != nullptr) {
            Acc ox[kVec], px[kVec];
            IO::Load(o, o_bytes, c, dim, ox);
            IO::Load(p, p_bytes, c, dim, px);
#pragma unroll
            for (int e = 0; e < kVec; ++e) dbeta += dh[e] * (ox[e] - px[e]);
          }
          if (grad_o != nullptr) {
            Acc x[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) x[e] = beta * dh[e];
            IO::Store(grad_o, grad_o_bytes, c, dim, x);
          }
          if (norm_row != nullptr) {
            Acc gx[kVec];
            IO::Load(g, g_bytes, c, dim, gx);
            AddToItemRow<kVec>(norm_row, c, dim, first_token,
                               [&](int e) { return gx[e] * h[e] * inv_rms; });
          }
        }
        const Acc dlse = p != nullptr ? WarpSum(dbeta) * (beta * keep) : Acc(0);
        if (args.grad_lse != nullptr && lane == 0) static_cast<Acc*>(args.grad_lse)[t] = dlse;
        // dp = keep dh + c u + b p and U += c p, (c, b) = -dlse * the key chain of z_p.
        Acc* u_row =
            args.u_partials != nullptr ? static_cast<Acc*>(args.u_partials) + item * dim : nullptr;
        if (p == nullptr) {
          if (u_row != nullptr && first_token) {  // no partial block: U = 0
            for (int64_t d = lane; d < dim; d += kWarpSize) u_row[d] = 0;
          }
          continue;
        }
        if (args.grad_partial == nullptr && u_row == nullptr) continue;
        const math::KeyChain<Acc> chain = math::KeyGradient(z, r, scale, dim, args.rmsnorm);
        const Acc coef_u = -dlse * chain.a, coef_p = -dlse * chain.b;
        Bits* grad_p = args.grad_partial != nullptr
                           ? IO::Row(args.grad_partial, t, shape.strides.grad_source)
                           : nullptr;
        const int grad_p_bytes = grad_p != nullptr ? AccessBytes(grad_p) : 16;
        // The fused backward: what p receives from its other uses (the fused update's
        // p'), added before the one rounding to T.
        const Bits* grad_p_in =
            kFused ? IO::Row(args.grad_partial_in, t, shape.strides.grad_out) : nullptr;
        const int grad_p_in_bytes = kFused ? AccessBytes(grad_p_in) : 16;
        for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
          Acc px[kVec];
          IO::Load(p, p_bytes, c, dim, px);
          if (u_row != nullptr) {
            AddToItemRow<kVec>(u_row, c, dim, first_token, [&](int e) { return coef_u * px[e]; });
          }
          if (grad_p == nullptr) continue;
          Acc h[kVec] = {}, dh[kVec], uc[kVec];
          if (args.input_norm) h_of(c, h);
          dh_of(c, h, dh);
          IO::LoadWeights(u, c, uc);
#pragma unroll
          for (int e = 0; e < kVec; ++e) dh[e] = keep * dh[e] + coef_u * uc[e] + coef_p * px[e];
          if constexpr (kFused) {
            Acc g_in[kVec];
            IO::Load(grad_p_in, grad_p_in_bytes, c, dim, g_in);
#pragma unroll
            for (int e = 0; e < kVec; ++e) dh[e] += g_in[e];
          }
          IO::Store(grad_p, grad_p_bytes, c, dim, dh);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

std::string Indexed(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// The S entries of a query pointer array, or S nulls for a null array.
template <typename Ptr>
std::vector<Ptr> QueryPointers(Ptr const* array, int64_t S) {
  return array != nullptr ? std::vector<Ptr>(array, array + S) : std::vector<Ptr>(S, nullptr);
}

// Every pointer the call will touch must be memory of the current device.
attnres_status CheckPointers(const attnres_params& p, int phase, bool backward,
                             const Device& device) {
  std::vector<std::pair<const void*, std::string>> ptrs;
  ptrs.emplace_back(p.proj_weight, "proj_weight");
  if (p.rmsnorm) ptrs.emplace_back(p.gamma, "gamma");
  if (phase == 1) {
    const int64_t S = p.num_queries;
    for (int64_t i = 0; i < p.num_blocks; ++i) ptrs.emplace_back(p.blocks[i], Indexed("blocks", i));
    if (!backward) {
      for (int64_t s = 0; s < S; ++s) {
        ptrs.emplace_back(p.query_outs[s], Indexed("query_outs", s));
        ptrs.emplace_back(p.query_lses[s], Indexed("query_lses", s));
      }
    } else {
      for (int64_t s = 0; s < S; ++s) {
        ptrs.emplace_back(p.grad_query_outs[s], Indexed("grad_query_outs", s));
        if (p.grad_query_lses != nullptr) {
          ptrs.emplace_back(p.grad_query_lses[s], Indexed("grad_query_lses", s));
        }
      }
      for (int64_t i = 0; p.grad_blocks != nullptr && i < p.num_blocks; ++i) {
        ptrs.emplace_back(p.grad_blocks[i], Indexed("grad_blocks", i));
      }
    }
  } else {
    ptrs.emplace_back(p.query_out, "query_out");
    ptrs.emplace_back(p.partial, "partial");
    if (p.partial != nullptr) ptrs.emplace_back(p.query_lse, "query_lse");
    if (p.input_norm) ptrs.emplace_back(p.norm_weight, "norm_weight");
    if (!backward) {
      ptrs.emplace_back(p.out, "out");
      ptrs.emplace_back(p.partial_update, "partial_update");
      ptrs.emplace_back(p.new_partial, "new_partial");
    } else {
      ptrs.emplace_back(p.grad_out, "grad_out");
      ptrs.emplace_back(p.grad_query_out, "grad_query_out");
      ptrs.emplace_back(p.grad_query_lse, "grad_query_lse");
      ptrs.emplace_back(p.grad_partial, "grad_partial");
      ptrs.emplace_back(p.grad_partial_in, "grad_partial_in");
      ptrs.emplace_back(p.grad_norm_weight, "grad_norm_weight");
    }
  }
  if (backward) {
    ptrs.emplace_back(p.grad_proj_weight, "grad_proj_weight");
    ptrs.emplace_back(p.grad_gamma, "grad_gamma");
  }
  for (const auto& [ptr, name] : ptrs) {
    if (attnres_status s = CheckDevicePointer(ptr, name, device); s != ATTNRES_OK) return s;
  }
  return ATTNRES_OK;
}

// The call as the kernels see it.
struct Call {
  const attnres_params& p;
  int phase;
  bool backward;
  Device device;
  cudaStream_t stream;
  int64_t S;  // rows of proj_weight: num_queries in phase 1, 1 in phase 2
  bool weight_grads;
};

// The call's PhaseShape, for either phase: an item writes rows_per_item
// partial rows of dim Acc (phase 1: the S rows of U; phase 2: U and the norm
// weight's), so the budget of TokensPerItem knows their size.
template <typename T>
PhaseShape ShapeOf(const Call& call, int64_t rows_per_item) {
  constexpr int kVec = Io<T>::kVec;
  const attnres_params& p = call.p;
  const int64_t tokens_per_item =
      call.weight_grads ? TokensPerItem(p.num_tokens, rows_per_item, p.dim,
                                        sizeof(typename Traits<T>::Acc))
                        : 1;
  return {p.num_tokens, tokens_per_item, (p.num_tokens + tokens_per_item - 1) / tokens_per_item,
          p.dim, (p.dim + kVec - 1) / kVec, RowStridesOf(p)};
}

std::string KernelName(const char* kernel, const Call& call) {
  return std::string(kernel) + "<" + DtypeName(call.p.dtype) +
         (call.backward ? ", backward>" : ", forward>");
}

// dw = (rmsnorm ? gamma : 1) * U and dgamma = w * U from the partial rows
// [rows, width] (width = S * dim: the S rows of U of an item are contiguous, as
// w and gamma are); and dnorm_weight from its own rows.
template <typename T>
attnres_status ReducePartials(const Call& call, const void* u_rows, const void* norm_rows,
                              int64_t rows) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  const dim3 block(plan::kReduceColumns, plan::kReduceRowLanes);
  const auto launch = [&](const void* partials, int64_t width, const void* scale_by,
                          const void* times, void* grad_scaled, void* grad_times) {
    const int64_t grid = (width + plan::kReduceColumns - 1) / plan::kReduceColumns;
    if (grid > INT_MAX) {
      return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                  "attnres CUDA backend: the weight gradients need num_queries * dim <= " +
                      std::to_string(int64_t{INT_MAX} * plan::kReduceColumns) + ", got " +
                      std::to_string(width));
    }
    ReduceRowsKernel<T><<<static_cast<unsigned>(grid), block, 0, call.stream>>>(
        static_cast<const Acc*>(partials), rows, width, scale_by, times, grad_scaled, grad_times);
    return CheckLaunch("ReduceRowsKernel");
  };
  if (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr) {
    if (attnres_status s = launch(u_rows, call.S * p.dim, p.rmsnorm ? p.gamma : nullptr,
                                  p.proj_weight, p.grad_proj_weight, p.grad_gamma);
        s != ATTNRES_OK) {
      return s;
    }
  }
  if (call.phase == 2 && p.grad_norm_weight != nullptr) {
    return launch(norm_rows, p.dim, nullptr, nullptr, p.grad_norm_weight, nullptr);
  }
  return ATTNRES_OK;
}

template <typename T>
attnres_status PrepareWeights(const Call& call, int64_t padded, Scratch* storage,
                              const void** weights) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  const bool norm = call.phase == 2 && p.input_norm;
  const int64_t total = (call.S + (norm ? 1 : 0)) * padded;
  if (attnres_status s = storage->Allocate(total * sizeof(Acc), "the query rows w * gamma");
      s != ATTNRES_OK) {
    return s;
  }
  // The kernels read these rows with 16-byte loads (Io::LoadWeights).
  if (reinterpret_cast<uintptr_t>(storage->get<void>()) % 16 != 0) {
    return Fail(ATTNRES_ERROR_INTERNAL,
                "attnres CUDA backend: scratch memory from the pool is not 16-byte aligned");
  }
  const int64_t grid = std::clamp<int64_t>((total + 255) / 256, 1, 4096);
  PrepareWeightsKernel<T><<<static_cast<unsigned>(grid), 256, 0, call.stream>>>(
      p.proj_weight, p.rmsnorm ? p.gamma : nullptr, norm ? p.norm_weight : nullptr, norm, call.S,
      p.dim, padded, storage->get<Acc>());
  *weights = storage->get<const void>();
  return CheckLaunch("PrepareWeightsKernel");
}

template <typename T>
attnres_status RunPhase1(const Call& call) {
  using Acc = typename Traits<T>::Acc;
  constexpr int kVec = Io<T>::kVec;
  const attnres_params& p = call.p;
  const int64_t N = p.num_blocks, S = p.num_queries, tokens = p.num_tokens;
  Scratch weights(call.device, call.stream), block_table(call.device, call.stream),
      grad_table(call.device, call.stream), table_a(call.device, call.stream),
      table_b(call.device, call.stream), stats(call.device, call.stream),
      partials(call.device, call.stream);

  Phase1Args args;
  args.shape = ShapeOf<T>(call, S);
  const int64_t padded = args.shape.row_chunks * kVec;
  if (call.weight_grads) {
    // Every item writes all of its rows (its first token stores, the rest add).
    if (attnres_status s = partials.Allocate(args.shape.num_items * S * p.dim * sizeof(Acc),
                                             "the dw/dgamma partial rows");
        s != ATTNRES_OK) {
      return s;
    }
  }
  if (tokens == 0) {  // dw = dgamma = 0, as on the CPU
    return call.weight_grads ? ReducePartials<T>(call, partials.get<void>(), nullptr, 0)
                             : ATTNRES_OK;
  }
  if (attnres_status s = PrepareWeights<T>(call, padded, &weights, &args.u); s != ATTNRES_OK) {
    return s;
  }
  if (attnres_status s = FillPointerTable(std::vector<const void*>(p.blocks, p.blocks + N),
                                          call.stream, &block_table, &args.blocks);
      s != ATTNRES_OK) {
    return s;
  }
  std::vector<void*> grad_ptrs;
  if (call.backward) grad_ptrs = QueryPointers<void*>(p.grad_blocks, N);
  if (attnres_status s = FillPointerTable(grad_ptrs, call.stream, &grad_table, &args.grad_blocks);
      s != ATTNRES_OK) {
    return s;
  }
  args.any_grad_block =
      std::any_of(grad_ptrs.begin(), grad_ptrs.end(), [](void* ptr) { return ptr != nullptr; });
  attnres_status s = ATTNRES_OK;
  if (!call.backward) {
    s = FillPointerTable(QueryPointers<void*>(p.query_outs, S), call.stream, &table_a, &args.outs);
    if (s == ATTNRES_OK) {
      s = FillPointerTable(QueryPointers<void*>(p.query_lses, S), call.stream, &table_b, &args.lses);
    }
    args.grad_outs = {};  // all null
    args.grad_lses = {};  // all null
  } else {
    args.outs = {};  // all null
    args.lses = {};  // all null
    s = FillPointerTable(QueryPointers<const void*>(p.grad_query_outs, S), call.stream, &table_a,
                         &args.grad_outs);
    if (s == ATTNRES_OK) {
      s = FillPointerTable(QueryPointers<const void*>(p.grad_query_lses, S), call.stream,
                           &table_b, &args.grad_lses);
    }
  }
  if (s != ATTNRES_OK) return s;

  // One thread per 16-byte chunk of a row, in whole warps, up to kPhase1MaxThreads.
  const int threads = static_cast<int>(std::clamp<int64_t>(
      (args.shape.row_chunks + kWarpSize - 1) / kWarpSize * kWarpSize, kWarpSize,
      kPhase1MaxThreads));
  args.stats_elems = Phase1StatsElems(N, S, threads / kWarpSize, call.backward);
  const size_t stats_bytes = static_cast<size_t>(args.stats_elems) * sizeof(Acc);
  const bool shared = stats_bytes <= kSharedStatsBudget;
  const auto kernel = call.backward ? Phase1Kernel<T, true> : Phase1Kernel<T, false>;
  const std::string name = KernelName("Phase1Kernel", call);
  int grid = 0;
  if (attnres_status st = PersistentGrid(kernel, threads, shared ? stats_bytes : 0,
                                         args.shape.num_items, name, call.device, &grid);
      st != ATTNRES_OK) {
    return st;
  }
  args.stats_global = nullptr;
  if (!shared) {
    grid = static_cast<int>(std::clamp<int64_t>(
        kGlobalStatsBudgetBytes / static_cast<int64_t>(stats_bytes), 1, grid));
    if (attnres_status st = stats.Allocate(grid * stats_bytes, "phase 1 statistics");
        st != ATTNRES_OK) {
      return st;
    }
    args.stats_global = stats.get<void>();
  }
  args.u_partials = call.weight_grads ? partials.get<void>() : nullptr;
  args.num_blocks = N;
  args.num_queries = S;
  args.scale = p.scale;
  args.eps = p.eps;
  args.rmsnorm = p.rmsnorm != 0;
  args.accumulate = call.backward && p.accumulate_grads != 0;

  kernel<<<grid, threads, shared ? stats_bytes : 0, call.stream>>>(args);
  if (attnres_status st = CheckLaunch(name); st != ATTNRES_OK) return st;
  if (!call.weight_grads) return ATTNRES_OK;
  return ReducePartials<T>(call, partials.get<void>(), nullptr, args.shape.num_items);
}

template <typename T>
attnres_status RunPhase2(const Call& call) {
  using Acc = typename Traits<T>::Acc;
  constexpr int kVec = Io<T>::kVec;
  const attnres_params& p = call.p;
  const int64_t tokens = p.num_tokens;
  Scratch weights(call.device, call.stream), partials(call.device, call.stream);

  Phase2Args args;
  args.shape = ShapeOf<T>(call, 2);
  const int64_t padded = args.shape.row_chunks * kVec;
  const bool want_u = call.backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr);
  const bool want_norm = call.backward && p.grad_norm_weight != nullptr;
  // [items, dim] of U, then [items, dim] of the norm weight's gradient.
  const int64_t rows_bytes = args.shape.num_items * p.dim * static_cast<int64_t>(sizeof(Acc));
  if (call.weight_grads) {
    if (attnres_status s = partials.Allocate(2 * rows_bytes, "the dw/dgamma/dnorm_weight partial rows");
        s != ATTNRES_OK) {
      return s;
    }
  }
  char* u_rows = partials.get<char>();
  char* norm_rows = u_rows != nullptr ? u_rows + rows_bytes : nullptr;
  if (tokens == 0) {  // the weight gradients are zero, as on the CPU
    return call.weight_grads ? ReducePartials<T>(call, u_rows, norm_rows, 0) : ATTNRES_OK;
  }
  if (attnres_status s = PrepareWeights<T>(call, padded, &weights, &args.weights);
      s != ATTNRES_OK) {
    return s;
  }
  args.o = p.query_out;
  args.partial = p.partial;
  args.partial_update = call.backward ? nullptr : p.partial_update;
  args.new_partial = call.backward ? nullptr : p.new_partial;
  args.lse = p.query_lse;
  args.out = call.backward ? nullptr : p.out;
  args.grad_out = call.backward ? p.grad_out : nullptr;
  args.grad_o = call.backward ? p.grad_query_out : nullptr;
  args.grad_lse = call.backward ? p.grad_query_lse : nullptr;
  args.grad_partial = call.backward ? p.grad_partial : nullptr;
  args.grad_partial_in = call.backward ? p.grad_partial_in : nullptr;
  args.u_partials = want_u ? u_rows : nullptr;
  args.norm_partials = want_norm ? norm_rows : nullptr;
  args.scale = p.scale;
  args.eps = p.eps;
  args.norm_eps = p.norm_eps;
  args.rmsnorm = p.rmsnorm != 0;
  args.input_norm = p.input_norm != 0;

  const bool fused = call.backward ? p.grad_partial_in != nullptr : p.partial_update != nullptr;
  const auto kernel =
      call.backward ? (fused ? Phase2Kernel<T, true, true> : Phase2Kernel<T, true, false>)
                    : (fused ? Phase2Kernel<T, false, true> : Phase2Kernel<T, false, false>);
  const std::string name =
      KernelName("Phase2Kernel", call) + (fused ? " (fused partial-block update)" : "");
  int grid = 0;
  const int64_t ctas = (args.shape.num_items + kPhase2Warps - 1) / kPhase2Warps;
  if (attnres_status s = PersistentGrid(kernel, kPhase2Threads, 0, ctas, name, call.device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  kernel<<<grid, kPhase2Threads, 0, call.stream>>>(args);
  if (attnres_status s = CheckLaunch(name); s != ATTNRES_OK) return s;
  if (!call.weight_grads) return ATTNRES_OK;
  return ReducePartials<T>(call, u_rows, norm_rows, args.shape.num_items);
}

template <typename T>
attnres_status Run(const Call& call) {
  return call.phase == 1 ? RunPhase1<T>(call) : RunPhase2<T>(call);
}

}  // namespace
}  // namespace cuda

attnres_status CudaTwoPhase(const attnres_params& p, int phase, bool backward) {
  using namespace cuda;
  const char* function = phase == 1 ? (backward ? "attnres_phase1_backward" : "attnres_phase1_forward")
                                    : (backward ? "attnres_phase2_backward" : "attnres_phase2_forward");
  const bool weight_grads =
      backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr ||
                   (phase == 2 && p.grad_norm_weight != nullptr));
  if (p.num_tokens == 0 && !weight_grads) return ATTNRES_OK;
  if (phase == 1 &&
      (p.num_blocks > plan::kMaxSources || p.num_queries > plan::kMaxSources ||
       p.num_blocks * (2 * p.num_queries + 1) > kMaxQueryBlockProduct)) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                std::string(function) + ": the CUDA backend needs num_blocks and num_queries <= " +
                    std::to_string(plan::kMaxSources) + " and num_blocks * (2 num_queries + 1) <= " +
                    std::to_string(kMaxQueryBlockProduct) + ", got num_blocks = " +
                    std::to_string(p.num_blocks) + " and num_queries = " +
                    std::to_string(p.num_queries));
  }
  Call call{p, phase, backward, Device{}, static_cast<cudaStream_t>(p.stream),
            phase == 1 ? p.num_queries : 1, weight_grads};
  if (attnres_status s = CurrentDevice(call.stream, &call.device); s != ATTNRES_OK) return s;
  if (attnres_status s = CheckPointers(p, phase, backward, call.device); s != ATTNRES_OK) return s;
  switch (p.dtype) {
    case ATTNRES_DTYPE_FLOAT32: return Run<float>(call);
    case ATTNRES_DTYPE_FLOAT64: return Run<double>(call);
    case ATTNRES_DTYPE_BFLOAT16: return Run<__nv_bfloat16>(call);
    case ATTNRES_DTYPE_FLOAT16: return Run<__half>(call);
  }
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DTYPE,
              std::string(function) + ": unknown dtype " + std::to_string(p.dtype));
}

}  // namespace attnres
