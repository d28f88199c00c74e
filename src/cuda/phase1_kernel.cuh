// Phase 1 of the two-phase schedule on CUDA: one CTA per token (the math is in
// two_phase_common.cuh's header; two_phase.cu plans and launches).
//
// Pass 1 reads each block row once from memory and forms its S + 1 dot products
// (2S + 1 backward: u_s, g_s, the sum of squares), queries in groups of
// kQueryGroup so that a chunk of the row is converted once per group; each warp
// leaves its partial sums in the statistics (no barrier per row), summed in warp
// order after the last row. Thread s then runs query s's softmax over the N
// logits (and its backward); pass 2 rereads the token's rows (from L1/L2) for
// the S outputs, or for the dv_i (kSourceGroup rows at a time, so that g_s and
// u_s are read once per group) and the U_s.
//
// Layout: Phase1Args is all the kernel receives; Phase1Traits<T, kBackward>
// holds its compile-time shape; Phase1Kernel is the one launch template, whose
// token loop runs the steps both directions share (Phase1Cta::DotProducts,
// SumWarps) and then Phase1Cta::Forward or Phase1Cta::Backward.
#ifndef ATTNRES_SRC_CUDA_PHASE1_KERNEL_CUH_
#define ATTNRES_SRC_CUDA_PHASE1_KERNEL_CUH_

#include <cstdint>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/two_phase_common.cuh"

namespace attnres::cuda {

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
inline int64_t Phase1StatsElems(int64_t N, int64_t S, int warps, bool backward) {
  const int64_t K = backward ? 2 * S + 1 : S + 1;
  return warps * N * K + N + 2 * S * N + (backward ? 2 * S * N + N : 0);
}

// The compile-time shape of a phase-1 kernel.
template <typename T, bool kBackwardT>
struct Phase1Traits : TwoPhaseTraits<T> {
  static constexpr bool kBackward = kBackwardT;
  static constexpr int kMaxThreads = kPhase1MaxThreads;
  // Dot products per query and block row: u_s (and g_s in the backward).
  static constexpr int kDotsPerQuery = kBackward ? 2 : 1;
};

// Sum_i coef_{s,i} v_i over the token's N block rows, in block order, for each
// of this thread's chunks c and each query s, handed to use(s, c, sum). That is
// o_s in the forward (coef = a) and the token's share of U_s in the backward
// (coef = c). The rows are reread from cache (pass 1 just read them), each chunk
// converted once per group of kQueryGroup queries. (N, S and dim come from the
// kernel rather than from args: reading them here again costs registers.)
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

// A phase-1 CTA: what its threads hold for the whole launch (the call's sizes,
// each thread's place in the CTA, where the statistics of the current token
// lie: Phase1StatsElems gives the layout, in shared memory or the CTA's slice
// of stats_global), and the steps of a token, each ending where the next needs
// a barrier.
template <typename KT>
class Phase1Cta {
 public:
  __device__ __forceinline__ Phase1Cta(const Phase1Args& args, unsigned char* shared_stats) {
    const PhaseShape& shape = args.shape;
    N = args.num_blocks;
    S = args.num_queries;
    dim = shape.dim;
    K = KT::kDotsPerQuery * S + 1;
    padded = shape.row_chunks * kVec;
    num_warps = blockDim.x / kWarpSize;
    warp = threadIdx.x / kWarpSize;
    lane = threadIdx.x % kWarpSize;
    scale = static_cast<Acc>(args.scale);
    eps = static_cast<Acc>(args.eps);
    u = static_cast<const Acc*>(args.u);
    slots = args.stats_global != nullptr
                ? static_cast<Acc*>(args.stats_global) + blockIdx.x * args.stats_elems
                : reinterpret_cast<Acc*>(shared_stats);
    r = slots + num_warps * N * K;
    z = r + N;
    a = z + S * N;
    dz = a + S * N;
    bz = dz + S * N;
    b = bz + S * N;
  }

  // Pass 1 of token t: every block row once from memory; per warp, its partial
  // sums of dot(u_s, v_i) (and dot(g_s, v_i)) and sum(v_i^2) into its slots.
  __device__ __forceinline__ void DotProducts(const Phase1Args& args, int64_t t) const {
    const PhaseShape& shape = args.shape;
    for (int64_t i = 0; i < N; ++i) {
      const Bits* v = IO::Row(args.blocks.Get(static_cast<int>(i)), t, shape.strides.source);
      const int v_bytes = AccessBytes(v);
      Acc* slot = slots + (warp * N + i) * K;
      for (int64_t s0 = 0; s0 < S; s0 += kQueryGroup) {
        const Bits* g[kQueryGroup] = {};
        int g_bytes[kQueryGroup] = {};
        if constexpr (KT::kBackward) {
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
            if (KT::kBackward && g[q] != nullptr) {
              IO::Load(g[q], g_bytes[q], c, dim, y);
              dot_g[q] += Dot(y, x);
            }
          }
        }
#pragma unroll
        for (int q = 0; q < kQueryGroup; ++q) {
          if (s0 + q >= S) break;
          dot_u[q] = WarpSum(dot_u[q]);
          if (KT::kBackward) dot_g[q] = WarpSum(dot_g[q]);
        }
        if (s0 == 0) sum_sq = WarpSum(sum_sq);
        if (lane == 0) {
#pragma unroll
          for (int q = 0; q < kQueryGroup; ++q) {
            if (s0 + q >= S) break;
            slot[s0 + q] = dot_u[q];
            if (KT::kBackward) slot[S + s0 + q] = dot_g[q];
          }
          if (s0 == 0) slot[K - 1] = sum_sq;
        }
      }
    }
  }

  // The warps' partials summed in warp order (into warp 0's slots), and r_i.
  __device__ __forceinline__ void SumWarps(const Phase1Args& args) const {
    for (int64_t k = threadIdx.x; k < N * K; k += blockDim.x) {
      Acc total = slots[k];
      for (int w = 1; w < num_warps; ++w) total += slots[w * N * K + k];
      slots[k] = total;
      if (k % K == K - 1) r[k / K] = args.rmsnorm ? math::Rms(total, dim, eps) : Acc(1);
    }
  }

  // Forward: lse_s, then pass 2, o_s = sum_i a_{s,i} v_i.
  __device__ __forceinline__ void Forward(const Phase1Args& args, int64_t t) const {
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
      static_cast<Acc*>(args.lses.Get(s))[t] = QuerySoftmax(s);
    }
    __syncthreads();
    ForEachWeightedRowSum<typename KT::Element>(
        args, N, S, dim, t, a, [&](int64_t s, int64_t c, const Acc (&o_s)[kVec]) {
          Bits* o = IO::Row(args.outs.Get(s), t, args.shape.strides.out);
          IO::Store(o, AccessBytes(o), c, dim, o_s);
        });
  }

  // Backward: every query's softmax backward, b_i = sum_s dz_{s,i} b_{s,i} in
  // query order, then pass 2: the dv_i (2a) and U_s += sum_i c_{s,i} v_i into
  // the item's partial rows (2b). `first`: the item's first token.
  __device__ __forceinline__ void Backward(const Phase1Args& args, int64_t item, int64_t first,
                                           int64_t t) const {
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
      QuerySoftmax(s);
      QueryBackward(args, s, t);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
      Acc sum = 0;
      for (int64_t s = 0; s < S; ++s) sum += bz[s * N + i];
      b[i] = sum;
    }
    __syncthreads();
    // Pass 2a: dv_i = b_i v_i + sum_s (a_{s,i} g_s + c_{s,i} u_s), kSourceGroup
    // rows at a time so that each g_s and u_s chunk is converted once per group.
    // It stays in this body: as a function of its own, nvcc compiles the
    // float64 kernel's a g + c u to fma(c, u, a g) rather than fma(a, g, c u),
    // which changes the bits of dv.
    const PhaseShape& shape = args.shape;
    for (int64_t c = threadIdx.x; args.any_grad_block && c < shape.row_chunks; c += blockDim.x) {
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
    if (args.u_partials != nullptr) {
      Acc* rows = static_cast<Acc*>(args.u_partials) + item * S * dim;
      const bool first_token = t == first;
      ForEachWeightedRowSum<typename KT::Element>(
          args, N, S, dim, t, dz, [&](int64_t s, int64_t c, const Acc (&u_s)[kVec]) {
            AddToItemRow<kVec>(rows + s * dim, c, dim, first_token, [&](int e) { return u_s[e]; });
          });
    }
  }

 private:
  using IO = typename KT::IO;
  using Acc = typename KT::Acc;
  using Bits = typename KT::Bits;
  static constexpr int kVec = KT::kVec;

  // Query s's logits z_s and weights a_s over the N blocks; returns lse_s.
  __device__ __forceinline__ Acc QuerySoftmax(int64_t s) const {
    Acc* z_s = z + s * N;
    Acc* a_s = a + s * N;
    for (int64_t i = 0; i < N; ++i) z_s[i] = scale * (slots[i * K + s] / r[i]);
    const Acc lse = math::LogSumExp(z_s, N);
    for (int64_t i = 0; i < N; ++i) a_s[i] = math::Exp(z_s[i] - lse);
    return lse;
  }

  // Query s's softmax backward (pivot form) and key chain: dz_s becomes
  // c_{s,i}, bz_s the b terms dz_{s,i} b_{s,i}.
  __device__ __forceinline__ void QueryBackward(const Phase1Args& args, int64_t s,
                                                int64_t t) const {
    const Acc* z_s = z + s * N;
    Acc* dz_s = dz + s * N;
    for (int64_t i = 0; i < N; ++i) dz_s[i] = slots[i * K + S + s];
    const void* lse_grad = args.grad_lses.Get(s);
    const Acc e = lse_grad != nullptr ? static_cast<const Acc*>(lse_grad)[t] : Acc(0);
    math::SoftmaxBackward(a + s * N, dz_s, N, e, dz_s);
    for (int64_t i = 0; i < N; ++i) {
      const math::KeyChain<Acc> chain = math::KeyGradient(z_s[i], r[i], scale, dim, args.rmsnorm);
      bz[s * N + i] = dz_s[i] * chain.b;
      dz_s[i] *= chain.a;  // c_{s,i}
    }
  }

  int64_t N, S, dim;
  int64_t K;  // dots per row: u_s, (g_s,) sum of squares
  int64_t padded;
  int num_warps, warp, lane;
  Acc scale, eps;
  const Acc* u;
  Acc* slots;  // [W, N, K]
  Acc* r;      // [N]
  Acc* z;      // [S, N]
  Acc* a;      // [S, N]
  Acc* dz;     // backward [S, N]: dot(g_s, v_i), dz, then c_{s,i}
  Acc* bz;     // backward [S, N]: dz_{s,i} * KeyChain b, summed into b_i
  Acc* b;      // backward [N]
};

// ---------------------------------------------------------------------------
// The launch template: persistent CTAs over the weight-gradient items, one
// token at a time.

template <typename T, bool kBackward>
__global__ void __launch_bounds__(Phase1Traits<T, kBackward>::kMaxThreads)
    Phase1Kernel(const __grid_constant__ Phase1Args args) {
  using KT = Phase1Traits<T, kBackward>;
  ATTNRES_DYNAMIC_SHARED(unsigned char, shared_stats);
  const Phase1Cta<KT> cta(args, shared_stats);
  const PhaseShape& shape = args.shape;
  for (int64_t item = blockIdx.x; item < shape.num_items; item += gridDim.x) {
    const int64_t first = item * shape.tokens_per_item;
    const int64_t end = shape.ItemEnd(first);
    for (int64_t t = first; t < end; ++t) {
      cta.DotProducts(args, t);
      __syncthreads();
      cta.SumWarps(args);
      __syncthreads();
      if constexpr (kBackward) {
        cta.Backward(args, item, first, t);
      } else {
        cta.Forward(args, t);
      }
      __syncthreads();  // the statistics are the next token's
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_PHASE1_KERNEL_CUH_
