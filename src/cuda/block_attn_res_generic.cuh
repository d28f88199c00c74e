// The general CUDA kernels: one CTA per token (grid-stride), scalar loads, any
// dim, any L, accumulation in Traits<T>::Acc. They serve float64 (fp64
// accumulation, where bandwidth is not the point) and rows too wide for the
// fused kernels' registers. Simple on purpose: each pass is a plain strided
// loop, so every source is read twice (forward: logits, then h; backward: the
// dot products, then the gradients).
//
// Per-token statistics live in a global scratch, one slice per CTA; a thread
// reads what thread 0 wrote only after a __syncthreads(), which orders global
// memory within the CTA.
#ifndef ATTNRES_SRC_CUDA_GENERIC_KERNELS_CUH_
#define ATTNRES_SRC_CUDA_GENERIC_KERNELS_CUH_

#include <cstdint>

#include "cuda/common.cuh"

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
  void* u_partials;     // Acc [gridDim.x, dim], zeroed; null: no dw/dgamma
  int64_t num_tokens;
  int64_t dim;
  int64_t source_row_stride;
  int64_t out_row_stride;
  int64_t grad_out_row_stride;
  int64_t grad_row_stride;
  int num_sources;
  double scale;
  double eps;
  bool rmsnorm;
};

// Sums (or maxes) K values over the CTA in warp order; every thread gets the
// result. Ends with a barrier so `slots` can be reused immediately.
template <int K, bool kIsMax, typename Acc>
__device__ __forceinline__ void BlockReduce(Acc (&v)[K], Acc (*slots)[K]) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = kIsMax ? WarpMax(v[k]) : WarpSum(v[k]);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) slots[warp][k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    Acc total = slots[0][k];
    for (int w = 1; w < num_warps; ++w) {
      total = kIsMax ? Max(total, slots[w][k]) : total + slots[w][k];
    }
    v[k] = total;
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ typename Traits<T>::Acc LoadAcc(const void* base, int64_t index) {
  return Traits<T>::ToAcc(static_cast<const typename Traits<T>::Bits*>(base)[index]);
}

template <typename T>
__device__ __forceinline__ void StoreAcc(void* base, int64_t index, typename Traits<T>::Acc x) {
  static_cast<typename Traits<T>::Bits*>(base)[index] = Traits<T>::FromAcc(x);
}

template <typename T>
__device__ __forceinline__ typename Traits<T>::Acc WeightTimesGamma(const GenericArgs& args,
                                                                    int64_t d) {
  using Acc = typename Traits<T>::Acc;
  const Acc w = LoadAcc<T>(args.w, d);
  return args.gamma != nullptr ? w * LoadAcc<T>(args.gamma, d) : w;
}

// alpha = softmax(z) over L logits, written to `alpha` (and to the cache row
// of `token` when given). Ends with a barrier.
template <typename Acc>
__device__ __forceinline__ void BlockSoftmax(const Acc* z, Acc* alpha, int L, Acc* alpha_cache,
                                             int64_t token, Acc (*slots)[1]) {
  Acc m[1] = {-static_cast<Acc>(INFINITY)};
  for (int i = threadIdx.x; i < L; i += blockDim.x) m[0] = Max(m[0], z[i]);
  BlockReduce<1, true>(m, slots);
  Acc s[1] = {0};
  for (int i = threadIdx.x; i < L; i += blockDim.x) s[0] += Exp(z[i] - m[0]);
  BlockReduce<1, false>(s, slots);
  for (int i = threadIdx.x; i < L; i += blockDim.x) {
    const Acc a = Exp(z[i] - m[0]) / s[0];
    alpha[i] = a;
    if (alpha_cache != nullptr) alpha_cache[token * L + i] = a;
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kGenericThreads)
    GenericForwardKernel(const __grid_constant__ GenericArgs args) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc slots2[kMaxWarpsPerCta][2];
  __shared__ Acc slots1[kMaxWarpsPerCta][1];
  const int L = args.num_sources;
  const Acc scale = static_cast<Acc>(args.scale), eps = static_cast<Acc>(args.eps);
  const Acc dim = static_cast<Acc>(args.dim);
  Acc* stats = static_cast<Acc*>(args.stats_scratch) + static_cast<int64_t>(blockIdx.x) * 4 * L;
  Acc* rms_cache = static_cast<Acc*>(args.rms_cache);
  Acc* alpha_cache = static_cast<Acc*>(args.alpha_cache);

  for (int64_t token = blockIdx.x; token < args.num_tokens; token += gridDim.x) {
    const int64_t row = token * args.source_row_stride;
    // Logits: stats[i] = z_i.
    for (int i = 0; i < L; ++i) {
      const void* src = args.sources.Get(i);
      Acc part[2] = {0, 0};
      for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
        const Acc v = LoadAcc<T>(src, row + d);
        part[0] += WeightTimesGamma<T>(args, d) * v;
        part[1] += v * v;
      }
      BlockReduce<2, false>(part, slots2);
      const Acc rms = args.rmsnorm ? Sqrt(part[1] / dim + eps) : Acc(1);
      if (threadIdx.x == 0) {
        stats[i] = scale * (part[0] / rms);
        if (rms_cache != nullptr) rms_cache[token * L + i] = rms;
      }
    }
    __syncthreads();
    BlockSoftmax(stats, stats + L, L, alpha_cache, token, slots1);
    // h = sum_i alpha_i v_i: the second read of every source.
    for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
      Acc h = 0;
      for (int i = 0; i < L; ++i) h += stats[L + i] * LoadAcc<T>(args.sources.Get(i), row + d);
      StoreAcc<T>(args.out, token * args.out_row_stride + d, h);
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kGenericThreads)
    GenericBackwardKernel(const __grid_constant__ GenericArgs args) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc slots3[kMaxWarpsPerCta][3];
  __shared__ Acc slots1[kMaxWarpsPerCta][1];
  const int L = args.num_sources;
  const Acc scale = static_cast<Acc>(args.scale), eps = static_cast<Acc>(args.eps);
  const Acc dim = static_cast<Acc>(args.dim);
  Acc* stats = static_cast<Acc*>(args.stats_scratch) + static_cast<int64_t>(blockIdx.x) * 4 * L;
  Acc* stat_a = stats;              // ga_i, then a_i = scale * gz_i / r_i
  Acc* stat_b = stats + L;          // dot(wg, v_i), then z_i, then b_i
  Acc* stat_r = stats + 2 * L;      // sum(v_i^2), then r_i
  Acc* stat_alpha = stats + 3 * L;  // alpha_i
  const Acc* rms_cache = static_cast<const Acc*>(args.rms_cache);
  const Acc* alpha_cache = static_cast<const Acc*>(args.alpha_cache);
  Acc* u_row = args.u_partials != nullptr
                   ? static_cast<Acc*>(args.u_partials) + static_cast<int64_t>(blockIdx.x) * args.dim
                   : nullptr;

  for (int64_t token = blockIdx.x; token < args.num_tokens; token += gridDim.x) {
    const int64_t row = token * args.source_row_stride;
    const int64_t grad_row = token * args.grad_out_row_stride;
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
      BlockReduce<3, false>(part, slots3);
      if (threadIdx.x == 0) {
        stat_a[i] = part[0];
        stat_b[i] = part[1];
        stat_r[i] = part[2];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
      Acc rms = 1;
      if (rms_cache != nullptr) {
        rms = rms_cache[token * L + i];
      } else if (args.rmsnorm) {
        rms = Sqrt(stat_r[i] / dim + eps);
      }
      stat_b[i] = scale * (stat_b[i] / rms);
      stat_r[i] = rms;
      if (alpha_cache != nullptr) stat_alpha[i] = alpha_cache[token * L + i];
    }
    __syncthreads();
    if (alpha_cache == nullptr) BlockSoftmax<Acc>(stat_b, stat_alpha, L, nullptr, token, slots1);
    Acc mean[1] = {0};
    for (int i = threadIdx.x; i < L; i += blockDim.x) mean[0] += stat_alpha[i] * stat_a[i];
    BlockReduce<1, false>(mean, slots1);
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
      const Acc gz = stat_alpha[i] * (stat_a[i] - mean[0]);
      const Acc rms = stat_r[i];
      const Acc z = stat_b[i];
      stat_a[i] = scale * gz / rms;
      stat_b[i] = args.rmsnorm ? -gz * z / (dim * rms * rms) : Acc(0);
    }
    __syncthreads();
    // Pass 2: d-major, every thread owns the same columns of u_row for every token.
    for (int64_t d = threadIdx.x; d < args.dim; d += blockDim.x) {
      const Acc g = LoadAcc<T>(args.grad_out, grad_row + d);
      const Acc wg = WeightTimesGamma<T>(args, d);
      Acc u = 0;
      for (int i = 0; i < L; ++i) {
        void* dst = args.grads.Get(i);
        if (dst == nullptr && u_row == nullptr) continue;
        const Acc v = LoadAcc<T>(args.sources.Get(i), row + d);
        if (dst != nullptr) {
          StoreAcc<T>(dst, token * args.grad_row_stride + d,
                      stat_alpha[i] * g + stat_a[i] * wg + stat_b[i] * v);
        }
        u += stat_a[i] * v;
      }
      if (u_row != nullptr) u_row[d] += u;
    }
    __syncthreads();
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_GENERIC_KERNELS_CUH_
