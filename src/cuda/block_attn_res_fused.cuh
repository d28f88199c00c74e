// The fast CUDA kernels: one *token group* of W warps per token, the token's row
// of D elements spread over the group so that each thread owns kChunks chunks of
// kVec elements (chunk c of the row belongs to thread c % G of the group).
//
// Forward (per token): one pass over the L sources, each row read once from HBM.
//   For source i: partial dot(wg, v_i) and sum(v_i^2) per thread, reduced over
//   the group; z_i = scale * dot / r_i; online softmax in fp32 (running max m,
//   running denominator s, accumulator acc rescaled by exp(m_old - m_new)), so
//   h = acc / s needs no second read. The next source's row is loaded before the
//   current one is reduced, to keep two rows per thread in flight.
// Backward (per token): two passes.
//   Pass 1 reads every v_i once (ld.global.cg: keep it in L2 for pass 2) and
//   computes ga_i = dot(g, v_i), dot(wg, v_i) and sum(v_i^2) together; per-warp
//   partials go to shared memory without a barrier per source.
//   Per-source stats (ga, z, r, alpha, then a, b) live in shared memory (or in a
//   global scratch when L is too large for it).
//   Pass 2 rereads the sources newest-first (the rows pass 1 touched last are the
//   likeliest to still be in L2) and writes each dv_i once, evict-first, straight
//   into the caller's gradient buffer. U = sum a_i v_i accumulates in registers
//   across all tokens a group handles; each group writes its fp32 partial of U
//   to a scratch row, reduced later in a fixed order (no float atomics).
#ifndef ATTNRES_SRC_CUDA_FUSED_KERNELS_CUH_
#define ATTNRES_SRC_CUDA_FUSED_KERNELS_CUH_

#include <cstdint>

#include "cuda/common.cuh"

namespace attnres::cuda {

struct FusedForwardArgs {
  PointerTable<const void*> sources;  // L rows of [num_tokens, source_row_stride]
  const void* w;                      // [dim]
  const void* gamma;                  // [dim]; null: ones (always null without rmsnorm)
  void* out;
  float* rms_cache;    // [num_tokens, L] or null
  float* alpha_cache;  // [num_tokens, L] or null
  int64_t num_tokens;
  int64_t source_row_stride;
  int64_t out_row_stride;
  int dim;
  int num_sources;
  int group_threads;  // G = 32 * W
  float scale;
  float eps;
  bool rmsnorm;
};

struct FusedBackwardArgs {
  PointerTable<const void*> sources;
  PointerTable<void*> grads;  // entries may be null: that gradient is skipped
  const void* w;
  const void* gamma;
  const void* grad_out;
  const float* rms_cache;    // or null: recomputed
  const float* alpha_cache;  // or null: recomputed
  float* stats_scratch;      // null: stats in dynamic shared memory
  float* u_partials;         // [gridDim.x * groups per CTA, dim], or null (no dw/dgamma)
  int64_t num_tokens;
  int64_t source_row_stride;
  int64_t grad_out_row_stride;
  int64_t grad_row_stride;
  int dim;
  int num_sources;
  int group_threads;
  int stats_floats;  // per group: 4 L (+ 3 W L partials when W > 1)
  float scale;
  float eps;
  bool rmsnorm;
};

// Floats of per-token statistics the backward keeps for one group.
inline int64_t FusedBackwardStatsFloats(int64_t num_sources, int group_warps) {
  return 4 * num_sources + (group_warps > 1 ? 3 * group_warps * num_sources : 0);
}

// Where this thread sits: group `index` of the CTA, `thread` within the group.
struct Group {
  int threads;
  int warps;
  int index;
  int thread;
  int warp;
  int lane;
  int per_cta;
};

__device__ __forceinline__ Group MakeGroup(int group_threads) {
  Group g;
  g.threads = group_threads;
  g.warps = group_threads / kWarpSize;
  g.index = threadIdx.x / group_threads;
  g.thread = threadIdx.x % group_threads;
  g.warp = g.thread / kWarpSize;
  g.lane = threadIdx.x % kWarpSize;
  g.per_cta = blockDim.x / group_threads;
  return g;
}

// Sums K values over a token group; every thread of the group gets the same bits.
// With W > 1 the warp partials pass through `slots` (kMaxWarpsPerCta x K), so a
// barrier separates this call's reads from the next write to the same slots:
// callers alternate two slot arrays or put a __syncthreads() in between. All
// groups of the CTA call it together (W is uniform across the CTA).
template <int K>
__device__ __forceinline__ void GroupSum(float (&v)[K], const Group& g, float (*slots)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = WarpSum(v[k]);
  if (g.warps == 1) return;
  float(*mine)[K] = slots + g.index * g.warps;
  if (g.lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) mine[g.warp][k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total = 0.f;
    for (int w = 0; w < g.warps; ++w) total += mine[w][k];
    v[k] = total;
  }
}

// Max over a token group, then a barrier so the slots can be reused at once.
__device__ __forceinline__ float GroupMaxSync(float v, const Group& g, float* slots) {
  v = WarpMax(v);
  if (g.warps > 1) {
    if (g.lane == 0) slots[g.index * g.warps + g.warp] = v;
    __syncthreads();
    v = -INFINITY;
    for (int w = 0; w < g.warps; ++w) v = fmaxf(v, slots[g.index * g.warps + w]);
  }
  __syncthreads();
  return v;
}

__device__ __forceinline__ float GroupSumSync(float v, const Group& g, float* slots) {
  float one[1] = {v};
  GroupSum<1>(one, g, reinterpret_cast<float(*)[1]>(slots));
  __syncthreads();
  return one[0];
}

// This thread's chunks of a row: chunk k sits at element offset[k], and exists
// when in_row[k] (the last chunks of the group may fall past dim).
template <int kVec, int kChunks>
struct RowSlice {
  int offset[kChunks];
  bool in_row[kChunks];

  __device__ __forceinline__ RowSlice(const Group& g, int dim) {
    const int num_chunks = dim / kVec;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = g.thread + k * g.threads;
      in_row[k] = c < num_chunks;
      offset[k] = c * kVec;
    }
  }

  template <typename T, Hint kHint>
  __device__ __forceinline__ void Load(const typename Traits<T>::Bits* row, bool valid,
                                       typename Chunk<T, kVec>::Raw (&raw)[kChunks]) const {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      raw[k] = valid && in_row[k] ? Chunk<T, kVec>::template Load<kHint>(row + offset[k])
                                  : Chunk<T, kVec>::Zero();
    }
  }
};

// wg = w * gamma in fp32, this thread's elements (0 outside the row).
template <typename T, int kVec, int kChunks>
__device__ __forceinline__ void LoadWeights(const RowSlice<kVec, kChunks>& slice,
                                            const void* w, const void* gamma,
                                            float (&wg)[kVec * kChunks]) {
  using C = Chunk<T, kVec>;
  using Bits = typename Traits<T>::Bits;
  typename C::Raw raw[kChunks];
  slice.template Load<T, Hint::kDefault>(static_cast<const Bits*>(w), true, raw);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float x[kVec];
    C::Unpack(raw[k], x);
#pragma unroll
    for (int j = 0; j < kVec; ++j) wg[k * kVec + j] = x[j];
  }
  if (gamma != nullptr) {
    slice.template Load<T, Hint::kDefault>(static_cast<const Bits*>(gamma), true, raw);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      float x[kVec];
      C::Unpack(raw[k], x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) wg[k * kVec + j] *= x[j];
    }
  }
}

// wg = w * gamma for the whole row, into shared memory (the forward keeps it
// there rather than in registers: registers decide how many rows are in flight).
template <typename T>
__device__ __forceinline__ void FillSharedWeights(const void* w, const void* gamma, int dim,
                                                  float* shared_wg) {
  using Bits = typename Traits<T>::Bits;
  const Bits* w_bits = static_cast<const Bits*>(w);
  const Bits* gamma_bits = static_cast<const Bits*>(gamma);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    const float wd = Traits<T>::ToAcc(w_bits[d]);
    shared_wg[d] = gamma_bits != nullptr ? wd * Traits<T>::ToAcc(gamma_bits[d]) : wd;
  }
  __syncthreads();
}

template <int kVec>
__device__ __forceinline__ void LoadSharedChunk(const float* p, float (&x)[kVec]) {
  if constexpr (kVec % 4 == 0) {
#pragma unroll
    for (int q = 0; q < kVec / 4; ++q) {
      const float4 f = reinterpret_cast<const float4*>(p)[q];
      x[4 * q] = f.x;
      x[4 * q + 1] = f.y;
      x[4 * q + 2] = f.z;
      x[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[j] = p[j];
  }
}

// Launch bounds cap registers (65536 / (threads * min CTAs)) so that enough
// rows stay in flight per SM; the host reads the resulting thread limit back
// (cudaFuncGetAttributes) and picks fewer chunks per thread for wider rows.
constexpr int ForwardMaxThreads(int chunks) { return chunks >= 4 ? 256 : chunks == 2 ? 512 : 1024; }
constexpr int ForwardMinCtas(int chunks) { return chunks >= 4 ? 2 : 1; }
constexpr int kBackwardMaxThreads = 512;

template <typename T, int kVec, int kChunks>
__global__ void __launch_bounds__(ForwardMaxThreads(kChunks), ForwardMinCtas(kChunks))
    FusedForwardKernel(const __grid_constant__ FusedForwardArgs args) {
  using C = Chunk<T, kVec>;
  using Bits = typename Traits<T>::Bits;
  using Raw = typename C::Raw;
  constexpr int kElems = kVec * kChunks;
  // Two slot arrays, alternated per source, so one barrier per source suffices.
  __shared__ float slots[2][kMaxWarpsPerCta][2];
  extern __shared__ float4 shared_wg_storage[];  // [dim] floats, 16-byte aligned
  float* shared_wg = reinterpret_cast<float*>(shared_wg_storage);

  const Group g = MakeGroup(args.group_threads);
  const RowSlice<kVec, kChunks> slice(g, args.dim);
  const int num_sources = args.num_sources;
  const float inv_dim = 1.0f / static_cast<float>(args.dim);

  FillSharedWeights<T>(args.w, args.rmsnorm ? args.gamma : nullptr, args.dim, shared_wg);

  const int64_t num_steps = (args.num_tokens + g.per_cta - 1) / g.per_cta;
  int phase = 0;
  for (int64_t step = blockIdx.x; step < num_steps; step += gridDim.x) {
    const int64_t token = step * g.per_cta + g.index;
    const bool valid = token < args.num_tokens;
    const int64_t row = valid ? token * args.source_row_stride : 0;

    float acc[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
    float running_max = -INFINITY;
    float denom = 0.f;

    Raw cur[kChunks], next[kChunks];
    slice.template Load<T, Hint::kStreaming>(
        static_cast<const Bits*>(args.sources.Get(0)) + row, valid, cur);
    for (int i = 0; i < num_sources; ++i) {
      if (i + 1 < num_sources) {
        slice.template Load<T, Hint::kStreaming>(
            static_cast<const Bits*>(args.sources.Get(i + 1)) + row, valid, next);
      }
      // Rows stay packed in registers and are unpacked where used (twice):
      // unpacking is a shift, registers are what limits rows in flight.
      float part[2] = {0.f, 0.f};  // dot(wg, v_i), sum(v_i^2)
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (!slice.in_row[k]) continue;  // keeps shared_wg reads inside [0, dim)
        float v[kVec], wg[kVec];
        C::Unpack(cur[k], v);
        LoadSharedChunk<kVec>(shared_wg + slice.offset[k], wg);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          part[0] = fmaf(wg[j], v[j], part[0]);
          part[1] = fmaf(v[j], v[j], part[1]);
        }
      }
      GroupSum<2>(part, g, slots[phase]);
      phase ^= 1;
      const float rms = args.rmsnorm ? sqrtf(part[1] * inv_dim + args.eps) : 1.f;
      const float z = args.scale * (part[0] / rms);
      if (valid && g.thread == 0) {
        const int64_t at = token * num_sources + i;
        if (args.rms_cache != nullptr) args.rms_cache[at] = rms;
        // The raw logit for now; rewritten as alpha once the max and sum are known.
        if (args.alpha_cache != nullptr) args.alpha_cache[at] = z;
      }
      // Online softmax. exp(-inf - finite) = 0 handles the first source; a NaN
      // logit makes p (and so h) NaN for this token only.
      const float new_max = fmaxf(running_max, z);
      const float rescale = expf(running_max - new_max);
      const float p = expf(z - new_max);
      denom = fmaf(denom, rescale, p);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        float v[kVec];
        C::Unpack(cur[k], v);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          acc[k * kVec + j] = fmaf(acc[k * kVec + j], rescale, p * v[j]);
        }
      }
      running_max = new_max;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
    }

    if (valid) {
      Bits* out = static_cast<Bits*>(args.out) + token * args.out_row_stride;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (!slice.in_row[k]) continue;
        float h[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) h[j] = acc[k * kVec + j] / denom;
        C::template Store<Hint::kDefault>(out + slice.offset[k], C::Pack(h));
      }
    }
    if (args.alpha_cache != nullptr) {
      __syncthreads();  // makes thread 0's logit writes visible to its group
      if (valid) {
        float* alpha = args.alpha_cache + token * num_sources;
        for (int i = g.thread; i < num_sources; i += g.threads) {
          alpha[i] = expf(alpha[i] - running_max) / denom;
        }
      }
    }
  }
}

template <typename T, int kVec, int kChunks>
__global__ void __launch_bounds__(kBackwardMaxThreads)
    FusedBackwardKernel(const __grid_constant__ FusedBackwardArgs args) {
  using C = Chunk<T, kVec>;
  using Bits = typename Traits<T>::Bits;
  using Raw = typename C::Raw;
  constexpr int kElems = kVec * kChunks;
  extern __shared__ float shared_stats[];
  __shared__ float slots[kMaxWarpsPerCta];

  const Group g = MakeGroup(args.group_threads);
  const RowSlice<kVec, kChunks> slice(g, args.dim);
  const int L = args.num_sources;
  const float inv_dim = 1.0f / static_cast<float>(args.dim);

  float* stats = args.stats_scratch != nullptr
                     ? args.stats_scratch +
                           (static_cast<int64_t>(blockIdx.x) * g.per_cta + g.index) *
                               args.stats_floats
                     : shared_stats + g.index * args.stats_floats;
  float* stat_a = stats;              // ga_i, then a_i = scale * gz_i / r_i
  float* stat_b = stats + L;          // dot(wg, v_i), then z_i, then b_i
  float* stat_r = stats + 2 * L;      // sum(v_i^2), then r_i
  float* stat_alpha = stats + 3 * L;  // alpha_i
  float* partials = stats + 4 * L;    // [L][W][3] warp partials when W > 1

  float wg[kElems];
  LoadWeights<T, kVec, kChunks>(slice, args.w, args.rmsnorm ? args.gamma : nullptr, wg);
  const bool want_u = args.u_partials != nullptr;
  float u[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) u[e] = 0.f;

  const int64_t num_steps = (args.num_tokens + g.per_cta - 1) / g.per_cta;
  for (int64_t step = blockIdx.x; step < num_steps; step += gridDim.x) {
    const int64_t token = step * g.per_cta + g.index;
    const bool valid = token < args.num_tokens;
    const int64_t row = valid ? token * args.source_row_stride : 0;
    __syncthreads();  // the previous token's pass 2 is done reading the stats

    Raw grad[kChunks];
    slice.template Load<T, Hint::kStreaming>(
        static_cast<const Bits*>(args.grad_out) + (valid ? token * args.grad_out_row_stride : 0),
        valid, grad);

    // Pass 1: ga_i, dot(wg, v_i), sum(v_i^2) from one read of each source.
    Raw cur[kChunks], next[kChunks];
    slice.template Load<T, Hint::kKeepInL2>(
        static_cast<const Bits*>(args.sources.Get(0)) + row, valid, cur);
    for (int i = 0; i < L; ++i) {
      if (i + 1 < L) {
        slice.template Load<T, Hint::kKeepInL2>(
            static_cast<const Bits*>(args.sources.Get(i + 1)) + row, valid, next);
      }
      float part[3] = {0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        float v[kVec], gv[kVec];
        C::Unpack(cur[k], v);
        C::Unpack(grad[k], gv);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          part[0] = fmaf(gv[j], v[j], part[0]);
          part[1] = fmaf(wg[k * kVec + j], v[j], part[1]);
          part[2] = fmaf(v[j], v[j], part[2]);
        }
      }
#pragma unroll
      for (int q = 0; q < 3; ++q) part[q] = WarpSum(part[q]);
      if (g.lane == 0) {
        if (g.warps == 1) {
          stat_a[i] = part[0];
          stat_b[i] = part[1];
          stat_r[i] = part[2];
        } else {
          float* dst = partials + (i * g.warps + g.warp) * 3;
          dst[0] = part[0];
          dst[1] = part[1];
          dst[2] = part[2];
        }
      }
#pragma unroll
      for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
    }
    __syncthreads();

    // Per-source statistics, one source per thread of the group.
    for (int i = g.thread; i < L; i += g.threads) {
      float ga, dot, sum_sq;
      if (g.warps == 1) {
        ga = stat_a[i];
        dot = stat_b[i];
        sum_sq = stat_r[i];
      } else {
        ga = dot = sum_sq = 0.f;
        for (int w = 0; w < g.warps; ++w) {  // warp order: deterministic
          const float* src = partials + (i * g.warps + w) * 3;
          ga += src[0];
          dot += src[1];
          sum_sq += src[2];
        }
      }
      float rms = 1.f;
      if (args.rms_cache != nullptr) {
        rms = valid ? args.rms_cache[token * L + i] : 1.f;
      } else if (args.rmsnorm) {
        rms = sqrtf(sum_sq * inv_dim + args.eps);
      }
      stat_a[i] = ga;
      stat_b[i] = args.scale * (dot / rms);
      stat_r[i] = rms;
      if (args.alpha_cache != nullptr) {
        stat_alpha[i] = valid ? args.alpha_cache[token * L + i] : 0.f;
      }
    }
    __syncthreads();

    if (args.alpha_cache == nullptr) {
      float local_max = -INFINITY;
      for (int i = g.thread; i < L; i += g.threads) local_max = fmaxf(local_max, stat_b[i]);
      const float z_max = GroupMaxSync(local_max, g, slots);
      float local_sum = 0.f;
      for (int i = g.thread; i < L; i += g.threads) local_sum += expf(stat_b[i] - z_max);
      const float denom = GroupSumSync(local_sum, g, slots);
      for (int i = g.thread; i < L; i += g.threads) {
        stat_alpha[i] = expf(stat_b[i] - z_max) / denom;
      }
      __syncthreads();
    }

    // Softmax backward: gz_i = alpha_i (ga_i - sum_j alpha_j ga_j).
    float local_mean = 0.f;
    for (int i = g.thread; i < L; i += g.threads) local_mean += stat_alpha[i] * stat_a[i];
    const float ga_mean = GroupSumSync(local_mean, g, slots);
    for (int i = g.thread; i < L; i += g.threads) {
      const float gz = stat_alpha[i] * (stat_a[i] - ga_mean);
      const float rms = stat_r[i];
      const float z = stat_b[i];
      stat_a[i] = args.scale * gz / rms;
      // d r_i / d v_i = v_i / (D r_i) gives the -gz z / (D r^2) v_i term.
      stat_b[i] = args.rmsnorm ? -gz * z * inv_dim / (rms * rms) : 0.f;
    }
    __syncthreads();

    // Pass 2: dv_i = alpha_i g + a_i wg + b_i v_i, newest-read source first.
    auto needed = [&](int i) { return want_u || args.grads.Get(i) != nullptr; };
    int i = L - 1;
    while (i >= 0 && !needed(i)) --i;
    if (i >= 0) {
      slice.template Load<T, Hint::kStreaming>(
          static_cast<const Bits*>(args.sources.Get(i)) + row, valid, cur);
    }
    while (i >= 0) {
      int j = i - 1;
      while (j >= 0 && !needed(j)) --j;
      if (j >= 0) {
        slice.template Load<T, Hint::kStreaming>(
            static_cast<const Bits*>(args.sources.Get(j)) + row, valid, next);
      }
      const float alpha = stat_alpha[i], a = stat_a[i], b = stat_b[i];
      Bits* dst = static_cast<Bits*>(args.grads.Get(i));
      const bool write = dst != nullptr && valid;
      if (write) dst += token * args.grad_row_stride;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        float v[kVec], gv[kVec], dv[kVec];
        C::Unpack(cur[k], v);
        C::Unpack(grad[k], gv);
#pragma unroll
        for (int jj = 0; jj < kVec; ++jj) {
          dv[jj] = fmaf(alpha, gv[jj], fmaf(a, wg[k * kVec + jj], b * v[jj]));
        }
        if (write && slice.in_row[k]) {
          C::template Store<Hint::kStreaming>(dst + slice.offset[k], C::Pack(dv));
        }
        // Tail groups (valid == false) hold garbage stats: keep them out of U.
        if (want_u && valid) {
#pragma unroll
          for (int jj = 0; jj < kVec; ++jj) u[k * kVec + jj] = fmaf(a, v[jj], u[k * kVec + jj]);
        }
      }
#pragma unroll
      for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
      i = j;
    }
  }

  if (want_u) {
    float* dst = args.u_partials +
                 (static_cast<int64_t>(blockIdx.x) * g.per_cta + g.index) * args.dim;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (!slice.in_row[k]) continue;
#pragma unroll
      for (int j = 0; j < kVec; ++j) dst[slice.offset[k] + j] = u[k * kVec + j];
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_FUSED_KERNELS_CUH_
