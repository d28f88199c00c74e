// The fast CUDA kernels of the block op (bf16, fp16, fp32): one *token group* of
// W warps per token, the token's row of D elements cut into 16-byte chunks
// (plan.h: Layout), chunk c owned by thread c % G of the group, kChunks chunks
// per thread. The per-token math is core/token_math.h's, as on the CPU.
//
// Forward (per token): one pass over the L sources, each row read once from HBM.
//   For source i: partial dot(wg, v_i) and sum(v_i^2) per thread, reduced over
//   the group; r_i = math::Rms, z_i = scale * dot / r_i; math::OnlineSoftmax
//   folds z_i in (the accumulator of h rescaled as the running max moves), so
//   h = acc / s needs no second read. The next source's row is loaded before the
//   current one is reduced, to keep two rows per thread in flight.
// Backward (per token): two passes.
//   Pass 1 reads every v_i once (ld.global.cg: keep it in L2 for pass 2) and
//   computes ga_i = dot(g, v_i), dot(wg, v_i) and sum(v_i^2) together; per-warp
//   partials go to shared memory without a barrier per source.
//   Per-source statistics (ga, z, r, alpha) live in shared memory (or in a global
//   scratch when L is too large for it). One thread of the group runs the
//   softmax (without an alpha cache) and math::SoftmaxBackward, the pivot form,
//   over the token's L sources (a few flops per source against the 2 D bytes
//   each source moves); math::KeyGradient turns each gz_i into a_i, b_i.
//   Pass 2 rereads the sources newest-first (the rows pass 1 touched last are the
//   likeliest to still be in L2) and writes each dv_i once, evict-first, straight
//   into the caller's gradient buffer. U = sum a_i v_i accumulates in registers
//   over the group's chunk of plan::kTokensPerRow tokens, in token order, and is
//   written as that chunk's partial row (plan.h: why that makes dw/dgamma
//   independent of the grid and the GPU).
#ifndef ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_
#define ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_

#include <cstdint>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"

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
  int padded_dim;  // row_chunks * kVec: the floats of wg in shared memory
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
  float* stats_scratch;      // [gridDim.x * groups per CTA, stats_floats], or null: shared
  float* u_partials;         // [NumPartialRows(num_tokens), dim], or null (no dw/dgamma)
  int64_t num_tokens;
  int64_t num_items;         // plan::NumWorkItems
  int64_t source_row_stride;
  int64_t grad_out_row_stride;
  int64_t grad_row_stride;
  int dim;
  int num_sources;
  int group_threads;
  int stats_floats;  // per group: plan::BackwardStatsFloats
  float scale;
  float eps;
  bool rmsnorm;
};

// Launch bounds, from plan.h's shapes (the host plans with the same numbers).
// Registers are capped at 65536 / (threads * min CTAs), so that enough rows stay
// in flight per SM.
template <size_t N>
constexpr int MaxThreadsOf(const plan::KernelShape (&shapes)[N], int chunks) {
  for (const plan::KernelShape& s : shapes) {
    if (s.chunks == chunks) return s.max_threads;
  }
  return 0;
}
constexpr int ForwardMaxThreads(int chunks) { return MaxThreadsOf(plan::kForwardShapes, chunks); }
constexpr int ForwardMinCtas(int chunks) { return chunks >= 4 ? 2 : 1; }
constexpr int BackwardMaxThreads(int chunks) {
  return MaxThreadsOf(plan::kBackwardShapes, chunks);
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

// This thread's chunks of a row: chunk k starts at element offset[k] and holds
// count[k] elements (kVec; fewer for the row's last chunk; 0 past the row).
template <typename T, int kChunks>
struct RowSlice {
  using C = Chunk<T>;
  using Bits = typename C::Bits;
  using Raw = typename C::Raw;
  static constexpr int kVec = C::kVec;
  int offset[kChunks];
  int count[kChunks];

  __device__ __forceinline__ RowSlice(const Group& g, int dim) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      offset[k] = (g.thread + k * g.threads) * kVec;
      count[k] = min(max(dim - offset[k], 0), kVec);
    }
  }

  // The chunks of the row at `row`; zeros where `valid` is false or past the row.
  template <Hint kHint>
  __device__ __forceinline__ void Load(const Bits* row, bool valid, Raw (&raw)[kChunks]) const {
    const int bytes = AccessBytes(row);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (!valid || count[k] == 0) {
        raw[k] = C::Zero();
      } else if (count[k] == kVec) {
        raw[k] = C::template Load<kHint>(row + offset[k], bytes);
      } else {
        raw[k] = C::template LoadPartial<kHint>(row + offset[k], count[k]);
      }
    }
  }

  template <Hint kHint>
  __device__ __forceinline__ void Store(Bits* row, int k, const Raw& raw, int bytes) const {
    if (count[k] == kVec) {
      C::template Store<kHint>(row + offset[k], raw, bytes);
    } else if (count[k] > 0) {
      C::template StorePartial<kHint>(row + offset[k], raw, count[k]);
    }
  }
};

// wg = w * gamma in fp32, this thread's elements (0 outside the row).
template <typename T, int kChunks>
__device__ __forceinline__ void LoadWeights(const RowSlice<T, kChunks>& slice, const void* w,
                                            const void* gamma,
                                            float (&wg)[Chunk<T>::kVec * kChunks]) {
  using C = Chunk<T>;
  using Bits = typename C::Bits;
  constexpr int kVec = C::kVec;
  typename C::Raw raw[kChunks];
  slice.template Load<Hint::kDefault>(static_cast<const Bits*>(w), true, raw);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float x[kVec];
    C::Unpack(raw[k], x);
#pragma unroll
    for (int j = 0; j < kVec; ++j) wg[k * kVec + j] = x[j];
  }
  if (gamma != nullptr) {
    slice.template Load<Hint::kDefault>(static_cast<const Bits*>(gamma), true, raw);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      float x[kVec];
      C::Unpack(raw[k], x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) wg[k * kVec + j] *= x[j];
    }
  }
}

// wg = w * gamma for the whole row into shared memory, zeros up to padded_dim
// (the forward keeps it there rather than in registers: registers decide how
// many rows are in flight).
template <typename T>
__device__ __forceinline__ void FillSharedWeights(const void* w, const void* gamma, int dim,
                                                  int padded_dim, float* shared_wg) {
  using Bits = typename Traits<T>::Bits;
  const Bits* w_bits = static_cast<const Bits*>(w);
  const Bits* gamma_bits = static_cast<const Bits*>(gamma);
  for (int d = threadIdx.x; d < padded_dim; d += blockDim.x) {
    float wg = 0.f;
    if (d < dim) {
      wg = Traits<T>::ToAcc(w_bits[d]);
      if (gamma_bits != nullptr) wg *= Traits<T>::ToAcc(gamma_bits[d]);
    }
    shared_wg[d] = wg;
  }
  __syncthreads();
}

template <int kVec>
__device__ __forceinline__ void LoadSharedChunk(const float* p, float (&x)[kVec]) {
#pragma unroll
  for (int q = 0; q < kVec / 4; ++q) {
    const float4 f = reinterpret_cast<const float4*>(p)[q];
    x[4 * q] = f.x;
    x[4 * q + 1] = f.y;
    x[4 * q + 2] = f.z;
    x[4 * q + 3] = f.w;
  }
}

template <typename T, int kChunks>
__global__ void __launch_bounds__(ForwardMaxThreads(kChunks), ForwardMinCtas(kChunks))
    FusedForwardKernel(const __grid_constant__ FusedForwardArgs args) {
  using Slice = RowSlice<T, kChunks>;
  using C = typename Slice::C;
  using Bits = typename Slice::Bits;
  using Raw = typename Slice::Raw;
  constexpr int kVec = Slice::kVec;
  constexpr int kElems = kVec * kChunks;
  // Two slot arrays, alternated per source, so one barrier per source suffices.
  __shared__ float slots[2][kMaxWarpsPerCta][2];
  extern __shared__ float4 shared_wg_storage[];  // [padded_dim] floats, 16-byte aligned
  float* shared_wg = reinterpret_cast<float*>(shared_wg_storage);

  const Group g = MakeGroup(args.group_threads);
  const Slice slice(g, args.dim);
  const int num_sources = args.num_sources;

  FillSharedWeights<T>(args.w, args.rmsnorm ? args.gamma : nullptr, args.dim, args.padded_dim,
                       shared_wg);

  const int64_t num_steps = (args.num_tokens + g.per_cta - 1) / g.per_cta;
  int phase = 0;
  for (int64_t step = blockIdx.x; step < num_steps; step += gridDim.x) {
    const int64_t token = step * g.per_cta + g.index;
    const bool valid = token < args.num_tokens;
    const int64_t row = valid ? token * args.source_row_stride : 0;
    const auto source_row = [&](int i) { return static_cast<const Bits*>(args.sources.Get(i)) + row; };

    float acc[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
    math::OnlineSoftmax<float> softmax;

    Raw cur[kChunks], next[kChunks];
    slice.template Load<Hint::kStreaming>(source_row(0), valid, cur);
    for (int i = 0; i < num_sources; ++i) {
      if (i + 1 < num_sources) slice.template Load<Hint::kStreaming>(source_row(i + 1), valid, next);
      // Rows stay packed in registers and are unpacked where used (twice):
      // unpacking is a shift, registers are what limits rows in flight.
      float part[2] = {0.f, 0.f};  // dot(wg, v_i), sum(v_i^2)
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        if (slice.count[k] == 0) continue;  // keeps shared_wg reads inside [0, padded_dim)
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
      const float rms = args.rmsnorm ? math::Rms(part[1], args.dim, args.eps) : 1.f;
      const float z = args.scale * (part[0] / rms);
      if (valid && g.thread == 0) {
        const int64_t at = token * num_sources + i;
        if (args.rms_cache != nullptr) args.rms_cache[at] = rms;
        // The raw logit for now; rewritten as alpha once the max and sum are known.
        if (args.alpha_cache != nullptr) args.alpha_cache[at] = z;
      }
      const math::OnlineSoftmax<float>::Step s = softmax.Add(z);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        float v[kVec];
        C::Unpack(cur[k], v);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          acc[k * kVec + j] = fmaf(acc[k * kVec + j], s.rescale, s.weight * v[j]);
        }
      }
#pragma unroll
      for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
    }

    if (valid) {
      Bits* out = static_cast<Bits*>(args.out) + token * args.out_row_stride;
      const int bytes = AccessBytes(out);
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        float h[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) h[j] = acc[k * kVec + j] / softmax.denom;
        slice.template Store<Hint::kDefault>(out, k, C::Pack(h), bytes);
      }
    }
    if (args.alpha_cache != nullptr) {
      __syncthreads();  // makes thread 0's logit writes visible to its group
      if (valid) {
        float* alpha = args.alpha_cache + token * num_sources;
        for (int i = g.thread; i < num_sources; i += g.threads) alpha[i] = softmax.Alpha(alpha[i]);
      }
    }
  }
}

template <typename T, int kChunks>
__global__ void __launch_bounds__(BackwardMaxThreads(kChunks))
    FusedBackwardKernel(const __grid_constant__ FusedBackwardArgs args) {
  using Slice = RowSlice<T, kChunks>;
  using C = typename Slice::C;
  using Bits = typename Slice::Bits;
  using Raw = typename Slice::Raw;
  constexpr int kVec = Slice::kVec;
  constexpr int kElems = kVec * kChunks;
  extern __shared__ float shared_stats[];

  const Group g = MakeGroup(args.group_threads);
  const Slice slice(g, args.dim);
  const int L = args.num_sources;

  float* stats = args.stats_scratch != nullptr
                     ? args.stats_scratch +
                           (static_cast<int64_t>(blockIdx.x) * g.per_cta + g.index) *
                               args.stats_floats
                     : shared_stats + g.index * args.stats_floats;
  float* stat_ga = stats;             // dot(g, v_i), then gz_i, then a_i
  float* stat_z = stats + L;          // dot(wg, v_i), then z_i, then b_i
  float* stat_r = stats + 2 * L;      // sum(v_i^2), then r_i
  float* stat_alpha = stats + 3 * L;  // alpha_i
  float* partials = stats + 4 * L;    // [L][W][3] warp partials when W > 1

  float wg[kElems];
  LoadWeights<T, kChunks>(slice, args.w, args.rmsnorm ? args.gamma : nullptr, wg);
  const bool want_u = args.u_partials != nullptr;

  for (int64_t item = blockIdx.x; item < args.num_items; item += gridDim.x) {
    const int64_t chunk = plan::ChunkOfItem(item, g.per_cta, g.index);
    const int64_t first_token = plan::FirstTokenOfChunk(chunk);
    float u[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) u[e] = 0.f;

    // Every group of the CTA runs kTokensPerRow steps (the barriers below are
    // CTA-wide); tokens past the end are computed as zeros and dropped.
    for (int j = 0; j < plan::kTokensPerRow; ++j) {
      const int64_t token = first_token + j;
      const bool valid = token < args.num_tokens;
      const int64_t row = valid ? token * args.source_row_stride : 0;
      const auto source_row = [&](int i) { return static_cast<const Bits*>(args.sources.Get(i)) + row; };
      __syncthreads();  // the previous token's pass 2 is done reading the stats

      Raw grad[kChunks];
      slice.template Load<Hint::kStreaming>(
          static_cast<const Bits*>(args.grad_out) + (valid ? token * args.grad_out_row_stride : 0),
          valid, grad);

      // Pass 1: ga_i, dot(wg, v_i), sum(v_i^2) from one read of each source.
      Raw cur[kChunks], next[kChunks];
      slice.template Load<Hint::kKeepInL2>(source_row(0), valid, cur);
      for (int i = 0; i < L; ++i) {
        if (i + 1 < L) slice.template Load<Hint::kKeepInL2>(source_row(i + 1), valid, next);
        float part[3] = {0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          float v[kVec], gv[kVec];
          C::Unpack(cur[k], v);
          C::Unpack(grad[k], gv);
#pragma unroll
          for (int jj = 0; jj < kVec; ++jj) {
            part[0] = fmaf(gv[jj], v[jj], part[0]);
            part[1] = fmaf(wg[k * kVec + jj], v[jj], part[1]);
            part[2] = fmaf(v[jj], v[jj], part[2]);
          }
        }
#pragma unroll
        for (int q = 0; q < 3; ++q) part[q] = WarpSum(part[q]);
        if (g.lane == 0) {
          float* dst = g.warps == 1 ? nullptr : partials + (i * g.warps + g.warp) * 3;
          if (dst == nullptr) {
            stat_ga[i] = part[0];
            stat_z[i] = part[1];
            stat_r[i] = part[2];
          } else {
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
          ga = stat_ga[i];
          dot = stat_z[i];
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
          rms = math::Rms(sum_sq, args.dim, args.eps);
        }
        stat_ga[i] = ga;
        stat_z[i] = args.scale * (dot / rms);
        stat_r[i] = rms;
        if (args.alpha_cache != nullptr) {
          stat_alpha[i] = valid ? args.alpha_cache[token * L + i] : 0.f;
        }
      }
      __syncthreads();

      // The softmax (unless cached) and its backward over the token's L sources,
      // in the pivot form, by one thread: gz replaces ga.
      if (g.thread == 0) {
        if (args.alpha_cache == nullptr) math::Softmax(stat_z, stat_alpha, L);
        math::SoftmaxBackward(stat_alpha, stat_ga, L, 0.f, stat_ga);
      }
      __syncthreads();

      for (int i = g.thread; i < L; i += g.threads) {
        const math::KeyChain<float> chain =
            math::KeyGradient(stat_z[i], stat_r[i], args.scale, args.dim, args.rmsnorm);
        const float gz = stat_ga[i];
        stat_ga[i] = gz * chain.a;
        stat_z[i] = gz * chain.b;
      }
      __syncthreads();

      // Pass 2: dv_i = alpha_i g + a_i wg + b_i v_i, newest-read source first.
      const float* stat_a = stat_ga;
      const float* stat_b = stat_z;
      auto needed = [&](int i) { return want_u || args.grads.Get(i) != nullptr; };
      int i = L - 1;
      while (i >= 0 && !needed(i)) --i;
      if (i >= 0) slice.template Load<Hint::kStreaming>(source_row(i), valid, cur);
      while (i >= 0) {
        int next_i = i - 1;
        while (next_i >= 0 && !needed(next_i)) --next_i;
        if (next_i >= 0) slice.template Load<Hint::kStreaming>(source_row(next_i), valid, next);
        const float alpha = stat_alpha[i], a = stat_a[i], b = stat_b[i];
        Bits* dst = static_cast<Bits*>(args.grads.Get(i));
        const bool write = dst != nullptr && valid;
        if (write) dst += token * args.grad_row_stride;
        const int bytes = write ? AccessBytes(dst) : 16;
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
          float v[kVec], gv[kVec], dv[kVec];
          C::Unpack(cur[k], v);
          C::Unpack(grad[k], gv);
#pragma unroll
          for (int jj = 0; jj < kVec; ++jj) {
            dv[jj] = fmaf(alpha, gv[jj], fmaf(a, wg[k * kVec + jj], b * v[jj]));
          }
          if (write) slice.template Store<Hint::kStreaming>(dst, k, C::Pack(dv), bytes);
          // Tokens past the end hold garbage stats: keep them out of U.
          if (want_u && valid) {
#pragma unroll
            for (int jj = 0; jj < kVec; ++jj) {
              u[k * kVec + jj] = fmaf(a, v[jj], u[k * kVec + jj]);
            }
          }
        }
#pragma unroll
        for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
        i = next_i;
      }
    }

    if (want_u && first_token < args.num_tokens) {
      float* dst = args.u_partials + chunk * args.dim;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int jj = 0; jj < kVec; ++jj) {
          if (jj < slice.count[k]) dst[slice.offset[k] + jj] = u[k * kVec + jj];
        }
      }
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_
