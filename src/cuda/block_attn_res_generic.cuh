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

// What a CTA holds for the whole launch: the call's constants, the statistics
// of its current token as rows of L (its slice of the scratch, 4 L values of
// Acc: the host allocates one slice per CTA; one layout for both directions,
// the forward uses z and alpha only) and the caches.
template <typename Acc>
struct GenericCta {
  int L;
  Acc scale, eps;
  Acc* ga;           // backward: dot(g, v_i), then gz_i, then a_i
  Acc* z;            // z_i (backward: dot(wg, v_i) first, b_i last)
  Acc* r;            // backward: sum(v_i^2), then r_i
  Acc* alpha;        // alpha_i
  Acc* rms_cache;    // [num_tokens, L] or null
  Acc* alpha_cache;  // [num_tokens, L] or null

  __device__ __forceinline__ explicit GenericCta(const GenericArgs& args) {
    L = args.num_sources;
    scale = static_cast<Acc>(args.scale);
    eps = static_cast<Acc>(args.eps);
    ga = static_cast<Acc*>(args.stats_scratch) + static_cast<int64_t>(blockIdx.x) * 4 * L;
    z = ga + L;
    r = ga + 2 * L;
    alpha = ga + 3 * L;
    rms_cache = static_cast<Acc*>(args.rms_cache);
    alpha_cache = static_cast<Acc*>(args.alpha_cache);
  }
};

// Forward: one CTA per token; each source is read twice (logits, then h).
template <typename T, typename Acc>
__device__ __forceinline__ void GenericForward(const GenericArgs& args, const GenericCta<Acc>& cta,
                                               Acc (*slots)[2]) {
  for (int64_t token = blockIdx.x; token < args.num_tokens; token += gridDim.x) {
    const int64_t row = token * args.strides.source;
    for (int i = 0; i < cta.L; ++i) {
      const void* src = args.sources.Get(i);
      Acc part[2] = {0, 0};  // dot(wg, v_i), sum(v_i^2)
      for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
        const Acc v = LoadAcc<T>(src, row + d);
        part[0] += WeightTimesGamma<T>(args, d) * v;
        part[1] += v * v;
      }
      BlockSum<2>(part, slots);
      const Acc rms = args.rmsnorm ? math::Rms(part[1], args.dim, cta.eps) : Acc(1);
      if (threadIdx.x == 0) {
        cta.z[i] = cta.scale * (part[0] / rms);
        if (cta.rms_cache != nullptr) cta.rms_cache[token * cta.L + i] = rms;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) math::Softmax(cta.z, cta.alpha, cta.L);
    __syncthreads();
    if (cta.alpha_cache != nullptr) {
      for (int i = threadIdx.x; i < cta.L; i += blockDim.x) {
        cta.alpha_cache[token * cta.L + i] = cta.alpha[i];
      }
    }
    // h = sum_i alpha_i v_i: the second read of every source.
    for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
      Acc h = 0;
      for (int i = 0; i < cta.L; ++i) h += cta.alpha[i] * LoadAcc<T>(args.sources.Get(i), row + d);
      StoreAcc<T>(args.out, token * args.strides.out + d, h);
    }
    __syncthreads();
  }
}

// Backward: one CTA per chunk of plan::kTokensPerRow tokens, whose U partial
// row it owns: each thread adds its own columns, token after token, so the row
// needs no atomics and no zeroing beforehand.
template <typename T, typename Acc>
__device__ __forceinline__ void GenericBackward(const GenericArgs& args,
                                                const GenericCta<Acc>& cta, Acc (*slots)[3]) {
  for (int64_t chunk = blockIdx.x; chunk < args.num_chunks; chunk += gridDim.x) {
    Acc* u_row = args.u_partials != nullptr ? static_cast<Acc*>(args.u_partials) + chunk * args.dim
                                            : nullptr;
    for (int j = 0; j < plan::kTokensPerRow; ++j) {
      const int64_t token = plan::FirstTokenOfChunk(chunk) + j;
      if (token >= args.num_tokens) break;  // uniform across the CTA
      const int64_t row = token * args.strides.source;
      const int64_t grad_row = token * args.strides.grad_out;
      // Pass 1.
      for (int i = 0; i < cta.L; ++i) {
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
          cta.ga[i] = part[0];
          cta.z[i] = part[1];
          cta.r[i] = part[2];
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < cta.L; i += blockDim.x) {
        Acc rms = 1;
        if (cta.rms_cache != nullptr) {
          rms = cta.rms_cache[token * cta.L + i];
        } else if (args.rmsnorm) {
          rms = math::Rms(cta.r[i], args.dim, cta.eps);
        }
        cta.z[i] = cta.scale * (cta.z[i] / rms);
        cta.r[i] = rms;
        if (cta.alpha_cache != nullptr) cta.alpha[i] = cta.alpha_cache[token * cta.L + i];
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        if (cta.alpha_cache == nullptr) math::Softmax(cta.z, cta.alpha, cta.L);
        math::SoftmaxBackward(cta.alpha, cta.ga, cta.L, Acc(0), cta.ga);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < cta.L; i += blockDim.x) {
        const math::KeyChain<Acc> chain =
            math::KeyGradient(cta.z[i], cta.r[i], cta.scale, args.dim, args.rmsnorm);
        const Acc gz = cta.ga[i];
        cta.ga[i] = gz * chain.a;
        cta.z[i] = gz * chain.b;
      }
      __syncthreads();
      // Pass 2: d-major; every thread owns the same columns of u_row for every token.
      for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
        const Acc g = LoadAcc<T>(args.grad_out, grad_row + d);
        const Acc wg = WeightTimesGamma<T>(args, d);
        Acc u = 0;
        for (int i = 0; i < cta.L; ++i) {
          void* dst = args.grads.Get(i);
          if (dst == nullptr && u_row == nullptr) continue;
          const Acc v = LoadAcc<T>(args.sources.Get(i), row + d);
          if (dst != nullptr) {
            StoreAcc<T>(dst, token * args.strides.grad_source + d,
                        cta.alpha[i] * g + cta.ga[i] * wg + cta.z[i] * v);
          }
          u += cta.ga[i] * v;
        }
        if (u_row != nullptr) u_row[d] = j == 0 ? u : u_row[d] + u;
      }
      __syncthreads();
    }
  }
}

// The launch template of both directions: the shared setup, then
// GenericForward or GenericBackward.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kGenericThreads)
    GenericKernel(const __grid_constant__ GenericArgs args) {
  using Acc = typename Traits<T>::Acc;
  // BlockSum's cross-warp slots: 2 sums per source forward, 3 backward.
  __shared__ Acc slots[kMaxWarpsPerCta][kBackward ? 3 : 2];
  const GenericCta<Acc> cta(args);
  if constexpr (kBackward) {
    GenericBackward<T>(args, cta, slots);
  } else {
    GenericForward<T>(args, cta, slots);
  }
}

template <typename T>
constexpr auto GenericForwardKernel = GenericKernel<T, false>;
template <typename T>
constexpr auto GenericBackwardKernel = GenericKernel<T, true>;

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_GENERIC_CUH_
