// The general CUDA kernels of the block op: one CTA per token, scalar loads, any
// dim, any L, accumulation in Traits<T>::Acc. They serve float64 (fp64
// accumulation, where bandwidth is not the point) and rows too wide for the
// fused kernels' registers. Simple on purpose: each pass is a plain strided
// loop, so every source is read twice (forward: logits, then h; backward: the
// dot products, then the gradients). The per-token math is core/token_math.h's.
//
// Per-token statistics live in a global scratch, one slice per CTA; a thread
// reads what another wrote only after a __syncthreads(), which orders global
// memory within the CTA.
#ifndef ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_GENERIC_CUH_
#define ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_GENERIC_CUH_

#include <cstdint>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"

namespace attnres::cuda {

constexpr int kGenericThreads = 256;

struct GenericArgs {
  PointerTable<const void*> sources;
  PointerTable<void*> grads;  // backward only; entries may be null
  const void* w;
  const void* gamma;  // null: ones (always null without rmsnorm)
  const void* grad_out;
  void* out;
  void* rms_cache;      // Acc [num_tokens, L] or null
  void* alpha_cache;    // Acc [num_tokens, L] or null
  void* stats_scratch;  // Acc [gridDim.x, 4 L]
  void* u_partials;     // Acc [NumPartialRows(num_tokens), dim]; null: no dw/dgamma
  int64_t num_tokens;
  int64_t num_chunks;  // backward: plan::NumPartialRows(num_tokens)
  int64_t dim;
  RowStrides strides;
  int num_sources;
  double scale;
  double eps;
  bool rmsnorm;
};

// Sums K values over the CTA in warp order; every thread gets the result. Ends
// with a barrier so `slots` can be reused immediately.
template <int K, typename Acc>
__device__ __forceinline__ void BlockSum(Acc (&v)[K], Acc (*slots)[K]) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = WarpSum(v[k]);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) slots[warp][k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    Acc total = slots[0][k];
    for (int w = 1; w < num_warps; ++w) total += slots[w][k];
    v[k] = total;
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ typename Traits<T>::Acc WeightTimesGamma(const GenericArgs& args,
                                                                    int64_t d) {
  using Acc = typename Traits<T>::Acc;
  const Acc w = LoadAcc<T>(args.w, d);
  return args.gamma != nullptr ? w * LoadAcc<T>(args.gamma, d) : w;
}

// A CTA's statistics of its current token, as rows of L: its slice of the
// scratch, 4 L values of Acc (the host allocates one slice per CTA). One layout
// for both kernels; the forward uses z and alpha only.
template <typename Acc>
struct CtaStats {
  Acc* ga;     // backward: dot(g, v_i), then gz_i, then a_i
  Acc* z;      // z_i (backward: dot(wg, v_i) first, b_i last)
  Acc* r;      // backward: sum(v_i^2), then r_i
  Acc* alpha;  // alpha_i

  __device__ __forceinline__ explicit CtaStats(const GenericArgs& args) {
    const int L = args.num_sources;
    ga = static_cast<Acc*>(args.stats_scratch) + static_cast<int64_t>(blockIdx.x) * 4 * L;
    z = ga + L;
    r = ga + 2 * L;
    alpha = ga + 3 * L;
  }
};

template <typename T>
__global__ void __launch_bounds__(kGenericThreads)
    GenericForwardKernel(const __grid_constant__ GenericArgs args) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc slots[kMaxWarpsPerCta][2];
  const int L = args.num_sources;
  const Acc scale = static_cast<Acc>(args.scale), eps = static_cast<Acc>(args.eps);
  const CtaStats<Acc> stats(args);
  Acc* z = stats.z;
  Acc* alpha = stats.alpha;
  Acc* rms_cache = static_cast<Acc*>(args.rms_cache);
  Acc* alpha_cache = static_cast<Acc*>(args.alpha_cache);

  for (int64_t token = blockIdx.x; token < args.num_tokens; token += gridDim.x) {
    const int64_t row = token * args.strides.source;
    for (int i = 0; i < L; ++i) {
      const void* src = args.sources.Get(i);
      Acc part[2] = {0, 0};  // dot(wg, v_i), sum(v_i^2)
      for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
        const Acc v = LoadAcc<T>(src, row + d);
        part[0] += WeightTimesGamma<T>(args, d) * v;
        part[1] += v * v;
      }
      BlockSum<2>(part, slots);
      const Acc rms = args.rmsnorm ? math::Rms(part[1], args.dim, eps) : Acc(1);
      if (threadIdx.x == 0) {
        z[i] = scale * (part[0] / rms);
        if (rms_cache != nullptr) rms_cache[token * L + i] = rms;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) math::Softmax(z, alpha, L);
    __syncthreads();
    if (alpha_cache != nullptr) {
      for (int i = threadIdx.x; i < L; i += blockDim.x) alpha_cache[token * L + i] = alpha[i];
    }
    // h = sum_i alpha_i v_i: the second read of every source.
    for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
      Acc h = 0;
      for (int i = 0; i < L; ++i) h += alpha[i] * LoadAcc<T>(args.sources.Get(i), row + d);
      StoreAcc<T>(args.out, token * args.strides.out + d, h);
    }
    __syncthreads();
  }
}

// One CTA per chunk of plan::kTokensPerRow tokens, whose U partial row it owns:
// each thread adds its own columns, token after token, so the row needs no
// atomics and no zeroing beforehand.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads)
    GenericBackwardKernel(const __grid_constant__ GenericArgs args) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc slots[kMaxWarpsPerCta][3];
  const int L = args.num_sources;
  const Acc scale = static_cast<Acc>(args.scale), eps = static_cast<Acc>(args.eps);
  const CtaStats<Acc> stats(args);
  Acc* stat_ga = stats.ga;
  Acc* stat_z = stats.z;
  Acc* stat_r = stats.r;
  Acc* stat_alpha = stats.alpha;
  const Acc* rms_cache = static_cast<const Acc*>(args.rms_cache);
  const Acc* alpha_cache = static_cast<const Acc*>(args.alpha_cache);

  for (int64_t chunk = blockIdx.x; chunk < args.num_chunks; chunk += gridDim.x) {
    Acc* u_row = args.u_partials != nullptr ? static_cast<Acc*>(args.u_partials) + chunk * args.dim
                                            : nullptr;
    for (int j = 0; j < plan::kTokensPerRow; ++j) {
      const int64_t token = plan::FirstTokenOfChunk(chunk) + j;
      if (token >= args.num_tokens) break;  // uniform across the CTA
      const int64_t row = token * args.strides.source;
      const int64_t grad_row = token * args.strides.grad_out;
      // Pass 1.
      for (int i = 0; i < L; ++i) {
        const void* src = args.sources.Get(i);
        Acc part[3] = {0, 0, 0};
        for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
          const Acc v = LoadAcc<T>(src, row + d);
          part[0] += LoadAcc<T>(args.grad_out, grad_row + d) * v;
          part[1] += WeightTimesGamma<T>(args, d) * v;
          part[2] += v * v;
        }
        BlockSum<3>(part, slots);
        if (threadIdx.x == 0) {
          stat_ga[i] = part[0];
          stat_z[i] = part[1];
          stat_r[i] = part[2];
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < L; i += blockDim.x) {
        Acc rms = 1;
        if (rms_cache != nullptr) {
          rms = rms_cache[token * L + i];
        } else if (args.rmsnorm) {
          rms = math::Rms(stat_r[i], args.dim, eps);
        }
        stat_z[i] = scale * (stat_z[i] / rms);
        stat_r[i] = rms;
        if (alpha_cache != nullptr) stat_alpha[i] = alpha_cache[token * L + i];
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        if (alpha_cache == nullptr) math::Softmax(stat_z, stat_alpha, L);
        math::SoftmaxBackward(stat_alpha, stat_ga, L, Acc(0), stat_ga);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < L; i += blockDim.x) {
        const math::KeyChain<Acc> chain =
            math::KeyGradient(stat_z[i], stat_r[i], scale, args.dim, args.rmsnorm);
        const Acc gz = stat_ga[i];
        stat_ga[i] = gz * chain.a;
        stat_z[i] = gz * chain.b;
      }
      __syncthreads();
      // Pass 2: d-major; every thread owns the same columns of u_row for every token.
      for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
        const Acc g = LoadAcc<T>(args.grad_out, grad_row + d);
        const Acc wg = WeightTimesGamma<T>(args, d);
        Acc u = 0;
        for (int i = 0; i < L; ++i) {
          void* dst = args.grads.Get(i);
          if (dst == nullptr && u_row == nullptr) continue;
          const Acc v = LoadAcc<T>(args.sources.Get(i), row + d);
          if (dst != nullptr) {
            StoreAcc<T>(dst, token * args.strides.grad_source + d,
                        stat_alpha[i] * g + stat_ga[i] * wg + stat_z[i] * v);
          }
          u += stat_ga[i] * v;
        }
        if (u_row != nullptr) u_row[d] = j == 0 ? u : u_row[d] + u;
      }
      __syncthreads();
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_GENERIC_CUH_
