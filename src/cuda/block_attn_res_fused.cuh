// The fast CUDA kernels of the block op (bf16, fp16, fp32): one *token group* of
// W warps per token, the token's row of D elements cut into 16-byte chunks
// (plan.h: Layout), chunk c owned by thread c % G of the group, kChunks chunks
// per thread. The per-token math is core/token_math.h's, as on the CPU.
// plan.h's shapes cover rows of up to 2048 chunks (16384 16-bit or 8192 fp32
// elements); the widest (the 8-chunk forward, the 4-chunk backward) run one
// token per CTA with wg = w * gamma in shared memory above the 48 KiB default.
//
// Forward (per token): one pass over the L sources, each row read once from HBM.
//   For source i: partial dot(wg, v_i) and sum(v_i^2) per thread, reduced over
//   the group; r_i = math::Rms, z_i = scale * dot / r_i; math::OnlineSoftmax
//   folds z_i in (the accumulator of h rescaled as the running max moves), so
//   h = acc / s needs no second read. The next source's row is loaded into
//   registers before the current one is reduced (two rows per thread in
//   flight), or, in the pipelined kernels, rows travel by asynchronous copies
//   through a ring in shared memory, several rows ahead and across tokens.
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
//   into the caller's gradient buffer. wg stays in registers, or in shared
//   memory for the 4-chunk kernel (BackwardWeights). U = sum a_i v_i
//   accumulates in registers over the group's chunk of plan::kTokensPerRow
//   tokens, in token order, and is written as that chunk's partial row (plan.h:
//   why that makes dw/dgamma independent of the grid and the GPU).
#ifndef ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_
#define ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_

#include <cstdint>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"

namespace attnres::cuda {

struct FusedForwardArgs {
  PointerTable<const void*> sources;  // L rows of [num_tokens, strides.source]
  const void* w;                      // [dim]
  const void* gamma;                  // [dim]; null: ones (always null without rmsnorm)
  void* out;
  float* rms_cache;    // [num_tokens, L] or null
  float* alpha_cache;  // [num_tokens, L] or null
  int64_t num_tokens;
  RowStrides strides;  // source, out
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
  RowStrides strides;        // source, grad_out, grad_source
  int dim;
  int num_sources;
  int group_threads;
  int stats_floats;   // per group: plan::BackwardStatsFloats
  int weight_floats;  // wg at the start of shared memory (plan::BackwardSharesWeights), else 0
  int ring_offset;    // pipelined kernels: where the row ring starts in shared memory, in 16 B
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
// Two CTAs of the 4-chunk forward per SM (at most 128 registers a thread); the
// 8-chunk one (the widest rows) needs more than 128 for its accumulator and two
// rows in flight.
constexpr int ForwardMinCtas(int chunks) { return chunks == 4 ? 2 : 1; }
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
  static constexpr int kElems = kVec * kChunks;  // this thread's elements of a row
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

  // The same chunks, copied asynchronously (common.cuh: AsyncCopyChunk) into
  // this thread's slots of one ring stage, chunk k at stage[k * blockDim.x +
  // threadIdx.x]. The row must be 16-byte aligned.
  __device__ __forceinline__ void LoadAsync(const Bits* row, bool valid, uint4* stage) const {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int n = valid ? count[k] : 0;
      AsyncCopyChunk(stage + k * blockDim.x + threadIdx.x, n > 0 ? row + offset[k] : row,
                     n * static_cast<int>(sizeof(Bits)));
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

// This thread's elements of the row at p, in fp32 (0 outside the row).
template <typename T, int kChunks>
__device__ __forceinline__ void LoadRowFloats(const RowSlice<T, kChunks>& slice, const void* p,
                                              float (&x)[RowSlice<T, kChunks>::kElems]) {
  using C = Chunk<T>;
  constexpr int kVec = C::kVec;
  typename C::Raw raw[kChunks];
  slice.template Load<Hint::kDefault>(static_cast<const typename C::Bits*>(p), true, raw);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float v[kVec];
    C::Unpack(raw[k], v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) x[k * kVec + j] = v[j];
  }
}

// wg = w * gamma in fp32, this thread's elements (0 outside the row).
template <typename T, int kChunks>
__device__ __forceinline__ void LoadWeights(const RowSlice<T, kChunks>& slice, const void* w,
                                            const void* gamma,
                                            float (&wg)[RowSlice<T, kChunks>::kElems]) {
  LoadRowFloats(slice, w, wg);
  if (gamma != nullptr) {
    float g[RowSlice<T, kChunks>::kElems];
    LoadRowFloats(slice, gamma, g);
#pragma unroll
    for (int e = 0; e < RowSlice<T, kChunks>::kElems; ++e) wg[e] *= g[e];
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

// wg = w * gamma as the backward reads it, a chunk at a time: this thread's
// elements in registers, or, for the kernels that would spill with them there
// (plan::BackwardSharesWeights), the whole row in shared memory, zero-padded to
// the group's chunk slots so that every chunk's read stays inside it.
template <typename T, int kChunks>
struct BackwardWeights {
  static constexpr bool kShared = plan::BackwardSharesWeights(kChunks);
  static constexpr int kVec = Chunk<T>::kVec;
  float regs[kShared ? 1 : RowSlice<T, kChunks>::kElems];
  const float* shared = nullptr;

  __device__ __forceinline__ BackwardWeights(const RowSlice<T, kChunks>& slice,
                                             const FusedBackwardArgs& args, float* shared_row) {
    const void* gamma = args.rmsnorm ? args.gamma : nullptr;
    if constexpr (kShared) {
      FillSharedWeights<T>(args.w, gamma, args.dim, args.weight_floats, shared_row);
      shared = shared_row;
    } else {
      LoadWeights<T, kChunks>(slice, args.w, gamma, regs);
    }
  }

  __device__ __forceinline__ void Get(const RowSlice<T, kChunks>& slice, int k,
                                      float (&wg)[kVec]) const {
    if constexpr (kShared) {
      LoadSharedChunk<kVec>(shared + slice.offset[k], wg);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) wg[j] = regs[k * kVec + j];
    }
  }
};

// ---------------------------------------------------------------------------
// Forward, in steps. A token's sources go by one at a time; the row of source
// i stays packed in registers (unpacking is a shift; registers are what limits
// the rows in flight) and is unpacked where it is used, twice.

// This thread's part of dot(wg, v_i) and sum(v_i^2), from the packed row.
template <typename T, int kChunks>
__device__ __forceinline__ void ForwardPartials(const RowSlice<T, kChunks>& slice,
                                                const typename Chunk<T>::Raw (&row)[kChunks],
                                                const float* shared_wg, float (&part)[2]) {
  using C = Chunk<T>;
  constexpr int kVec = C::kVec;
  part[0] = 0.f;  // dot(wg, v_i)
  part[1] = 0.f;  // sum(v_i^2)
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (slice.count[k] == 0) continue;  // keeps shared_wg reads inside [0, padded_dim)
    float v[kVec], wg[kVec];
    C::Unpack(row[k], v);
    LoadSharedChunk<kVec>(shared_wg + slice.offset[k], wg);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      part[0] = fmaf(wg[j], v[j], part[0]);
      part[1] = fmaf(v[j], v[j], part[1]);
    }
  }
}

// Folds the packed row of source i into the token's accumulator of h, as
// math::OnlineSoftmax's step says: acc <- acc * rescale + weight * v_i (the
// running max moved, so what was summed so far is rescaled).
template <typename T, int kChunks>
__device__ __forceinline__ void AccumulateRow(const typename Chunk<T>::Raw (&row)[kChunks],
                                              const math::OnlineSoftmax<float>::Step& s,
                                              float (&acc)[RowSlice<T, kChunks>::kElems]) {
  using C = Chunk<T>;
  constexpr int kVec = C::kVec;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float v[kVec];
    C::Unpack(row[k], v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      acc[k * kVec + j] = fmaf(acc[k * kVec + j], s.rescale, s.weight * v[j]);
    }
  }
}

// h = acc / denom: this thread's chunks of the token's output row.
template <typename T, int kChunks>
__device__ __forceinline__ void StoreOutput(const RowSlice<T, kChunks>& slice,
                                            const float (&acc)[RowSlice<T, kChunks>::kElems],
                                            float denom, typename Chunk<T>::Bits* out) {
  using C = Chunk<T>;
  constexpr int kVec = C::kVec;
  const int bytes = AccessBytes(out);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = acc[k * kVec + j] / denom;
    slice.template Store<Hint::kDefault>(out, k, C::Pack(h), bytes);
  }
}

// One source of a token: its reduced statistics, the caches, and the row folded
// into the accumulator. `cur` is this thread's part of source i's row.
template <typename T, int kChunks>
__device__ __forceinline__ void ForwardSource(const FusedForwardArgs& args, const Group& g,
                                              const RowSlice<T, kChunks>& slice,
                                              const typename Chunk<T>::Raw (&cur)[kChunks], int i,
                                              int64_t token, bool valid, const float* shared_wg,
                                              float (*slots)[2], math::OnlineSoftmax<float>& softmax,
                                              float (&acc)[RowSlice<T, kChunks>::kElems]) {
  float part[2];
  ForwardPartials(slice, cur, shared_wg, part);
  GroupSum<2>(part, g, slots);
  const float rms = args.rmsnorm ? math::Rms(part[1], args.dim, args.eps) : 1.f;
  const float z = args.scale * (part[0] / rms);
  if (valid && g.thread == 0) {
    const int64_t at = token * args.num_sources + i;
    if (args.rms_cache != nullptr) args.rms_cache[at] = rms;
    // The raw logit for now; rewritten as alpha once the max and sum are known.
    if (args.alpha_cache != nullptr) args.alpha_cache[at] = z;
  }
  AccumulateRow<T, kChunks>(cur, softmax.Add(z), acc);
}

// After a token's last source: h, and the alpha cache's logits turned into alpha.
template <typename T, int kChunks>
__device__ __forceinline__ void FinishToken(const FusedForwardArgs& args, const Group& g,
                                            const RowSlice<T, kChunks>& slice, int64_t token,
                                            bool valid, const math::OnlineSoftmax<float>& softmax,
                                            const float (&acc)[RowSlice<T, kChunks>::kElems]) {
  using Bits = typename Chunk<T>::Bits;
  if (valid) {
    StoreOutput(slice, acc, softmax.denom, static_cast<Bits*>(args.out) + token * args.strides.out);
  }
  if (args.alpha_cache != nullptr) {
    __syncthreads();  // makes thread 0's logit writes visible to its group
    if (valid) {
      float* alpha = args.alpha_cache + token * args.num_sources;
      for (int i = g.thread; i < args.num_sources; i += g.threads) alpha[i] = softmax.Alpha(alpha[i]);
    }
  }
}

// kStages = 0: the next source's row is loaded into registers before the
// current one is reduced, so two rows per thread are in flight (any alignment).
// kStages > 0 (plan::ForwardStages; every source row 16-byte aligned): rows go
// through a ring of kStages slots per thread in shared memory by asynchronous
// copies, kStages - 1 rows ahead of the one being reduced, and the run ahead
// crosses from one token to the next, so the memory system always has rows of
// this thread to fetch. Same arithmetic in the same order: the same bits.
template <typename T, int kChunks, int kStages>
__global__ void __launch_bounds__(ForwardMaxThreads(kChunks), ForwardMinCtas(kChunks))
    FusedForwardKernel(const __grid_constant__ FusedForwardArgs args) {
  using Slice = RowSlice<T, kChunks>;
  using Bits = typename Slice::Bits;
  using Raw = typename Slice::Raw;
  // Two slot arrays, alternated per source, so one barrier per source suffices.
  __shared__ float slots[2][kMaxWarpsPerCta][2];
  // [padded_dim] floats of wg, then (kStages > 0) the ring: slot s of chunk k of
  // thread t at ring[(s * kChunks + k) * blockDim.x + t], so a warp's 16-byte
  // reads of one slot are consecutive (no bank conflicts).
  ATTNRES_DYNAMIC_SHARED(float4, shared_storage);
  float* shared_wg = reinterpret_cast<float*>(shared_storage);

  const Group g = MakeGroup(args.group_threads);
  const Slice slice(g, args.dim);
  const int num_sources = args.num_sources;

  FillSharedWeights<T>(args.w, args.rmsnorm ? args.gamma : nullptr, args.dim, args.padded_dim,
                       shared_wg);

  const int64_t num_steps = (args.num_tokens + g.per_cta - 1) / g.per_cta;
  const auto token_of = [&](int64_t step) { return step * g.per_cta + g.index; };
  const auto source_row = [&](int i, int64_t token, bool valid) {
    return static_cast<const Bits*>(args.sources.Get(i)) + (valid ? token * args.strides.source : 0);
  };

  [[maybe_unused]] uint4* ring = reinterpret_cast<uint4*>(shared_storage + args.padded_dim / 4);
  // The next row to fetch (kStages > 0): source `ahead_i` of step `ahead_step`.
  [[maybe_unused]] int64_t ahead_step = blockIdx.x;
  [[maybe_unused]] int ahead_i = 0;
  [[maybe_unused]] int ahead_slot = 0;
  [[maybe_unused]] int slot = 0;
  // Starts the copy of the next row into its slot, one commit group per row (an
  // empty group past the last row keeps the count of groups per row uniform).
  [[maybe_unused]] const auto fetch_ahead = [&] {
    if (ahead_step < num_steps) {
      const int64_t token = token_of(ahead_step);
      const bool valid = token < args.num_tokens;
      slice.LoadAsync(source_row(ahead_i, token, valid), valid,
                      ring + ahead_slot * kChunks * blockDim.x);
      if (++ahead_i == num_sources) {
        ahead_i = 0;
        ahead_step += gridDim.x;
      }
      if (++ahead_slot == kStages) ahead_slot = 0;
    }
    AsyncCommit();
  };
  if constexpr (kStages > 0) {
    for (int s = 0; s + 1 < kStages; ++s) fetch_ahead();
  }

  int phase = 0;
  for (int64_t step = blockIdx.x; step < num_steps; step += gridDim.x) {
    const int64_t token = token_of(step);
    const bool valid = token < args.num_tokens;

    float acc[Slice::kElems];
#pragma unroll
    for (int e = 0; e < Slice::kElems; ++e) acc[e] = 0.f;
    math::OnlineSoftmax<float> softmax;

    if constexpr (kStages == 0) {
      Raw cur[kChunks], next[kChunks];
      slice.template Load<Hint::kStreaming>(source_row(0, token, valid), valid, cur);
      for (int i = 0; i < num_sources; ++i) {
        if (i + 1 < num_sources) {
          slice.template Load<Hint::kStreaming>(source_row(i + 1, token, valid), valid, next);
        }
        ForwardSource<T, kChunks>(args, g, slice, cur, i, token, valid, shared_wg, slots[phase],
                                  softmax, acc);
        phase ^= 1;
#pragma unroll
        for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
      }
    } else {
      for (int i = 0; i < num_sources; ++i) {
        // The slot fetch_ahead refills now was read into registers one source ago.
        fetch_ahead();
        AsyncWait<kStages - 1>();  // this row's group, kStages - 1 groups back
        Raw cur[kChunks];
#pragma unroll
        for (int k = 0; k < kChunks; ++k) cur[k] = ring[(slot * kChunks + k) * blockDim.x + threadIdx.x];
        if (++slot == kStages) slot = 0;
        ForwardSource<T, kChunks>(args, g, slice, cur, i, token, valid, shared_wg, slots[phase],
                                  softmax, acc);
        phase ^= 1;
      }
    }
    FinishToken<T, kChunks>(args, g, slice, token, valid, softmax, acc);
  }
}

// ---------------------------------------------------------------------------
// Backward, in steps. A token group's statistics (plan::BackwardStatsFloats
// floats: in shared memory, or in the global scratch when L is too large for
// it) are four rows of L, each reused as the computation moves on, then the
// warp partials of pass 1.
struct BackwardStats {
  float* ga;        // dot(g, v_i), then gz_i, then a_i
  float* z;         // dot(wg, v_i), then z_i, then b_i
  float* r;         // sum(v_i^2), then r_i
  float* alpha;     // alpha_i
  float* partials;  // [L][W][3] warp partials when W > 1
};

__device__ __forceinline__ BackwardStats GroupStats(const FusedBackwardArgs& args, const Group& g,
                                                    float* shared) {
  const int L = args.num_sources;
  float* stats = args.stats_scratch != nullptr
                     ? args.stats_scratch +
                           (static_cast<int64_t>(blockIdx.x) * g.per_cta + g.index) *
                               args.stats_floats
                     : shared + args.weight_floats + g.index * args.stats_floats;
  return {stats, stats + L, stats + 2 * L, stats + 3 * L, stats + 4 * L};
}

// Source i's share of pass 1: ga_i = dot(g, v_i), dot(wg, v_i) and sum(v_i^2)
// over this thread's chunks, summed over the warp. Lane 0 of each warp leaves
// the warp's sums in the statistics (with one warp per group) or in its
// partial slots, with no barrier per source: GatherSourceStats adds the warps
// up after the last one.
template <typename T, int kChunks>
__device__ __forceinline__ void Pass1Source(const RowSlice<T, kChunks>& slice, const Group& g,
                                            int i, const typename Chunk<T>::Raw (&row)[kChunks],
                                            const typename Chunk<T>::Raw (&grad)[kChunks],
                                            const BackwardWeights<T, kChunks>& weights,
                                            const BackwardStats& st) {
  using C = Chunk<T>;
  constexpr int kVec = C::kVec;
  float part[3] = {0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float v[kVec], gv[kVec], wg[kVec];
    C::Unpack(row[k], v);
    C::Unpack(grad[k], gv);
    weights.Get(slice, k, wg);
#pragma unroll
    for (int jj = 0; jj < kVec; ++jj) {
      part[0] = fmaf(gv[jj], v[jj], part[0]);
      part[1] = fmaf(wg[jj], v[jj], part[1]);
      part[2] = fmaf(v[jj], v[jj], part[2]);
    }
  }
#pragma unroll
  for (int q = 0; q < 3; ++q) part[q] = WarpSum(part[q]);
  if (g.lane == 0) {
    float* dst = g.warps == 1 ? nullptr : st.partials + (i * g.warps + g.warp) * 3;
    if (dst == nullptr) {
      st.ga[i] = part[0];
      st.z[i] = part[1];
      st.r[i] = part[2];
    } else {
      dst[0] = part[0];
      dst[1] = part[1];
      dst[2] = part[2];
    }
  }
}

// Pass 1 of the register kernels: one read of each source (ld.global.cg: keep
// it in L2 for pass 2), the next row loaded before the current one is reduced.
template <typename T, int kChunks, typename SourceRow>
__device__ __forceinline__ void BackwardPass1(const RowSlice<T, kChunks>& slice, const Group& g,
                                              int L, const SourceRow& source_row, bool valid,
                                              const typename Chunk<T>::Raw (&grad)[kChunks],
                                              const BackwardWeights<T, kChunks>& weights,
                                              const BackwardStats& st) {
  typename Chunk<T>::Raw cur[kChunks], next[kChunks];
  slice.template Load<Hint::kKeepInL2>(source_row(0), valid, cur);
  for (int i = 0; i < L; ++i) {
    if (i + 1 < L) slice.template Load<Hint::kKeepInL2>(source_row(i + 1), valid, next);
    Pass1Source(slice, g, i, cur, grad, weights, st);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
  }
}

// Per-source statistics after pass 1, one source per thread of the group: the
// warp partials summed in warp order (deterministic), r_i (from the cache, else
// math::Rms), z_i, and alpha_i when it is cached (else the softmax computes it).
__device__ __forceinline__ void GatherSourceStats(const FusedBackwardArgs& args, const Group& g,
                                                  int L, int64_t token, bool valid,
                                                  const BackwardStats& st) {
  for (int i = g.thread; i < L; i += g.threads) {
    float ga, dot, sum_sq;
    if (g.warps == 1) {
      ga = st.ga[i];
      dot = st.z[i];
      sum_sq = st.r[i];
    } else {
      ga = dot = sum_sq = 0.f;
      for (int w = 0; w < g.warps; ++w) {  // warp order: deterministic
        const float* src = st.partials + (i * g.warps + w) * 3;
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
    st.ga[i] = ga;
    st.z[i] = args.scale * (dot / rms);
    st.r[i] = rms;
    if (args.alpha_cache != nullptr) {
      st.alpha[i] = valid ? args.alpha_cache[token * L + i] : 0.f;
    }
  }
}

// Once gz_i has replaced ga_i: math::KeyGradient, one source per thread, turns
// it into a_i (in ga) and b_i (in z), the coefficients of pass 2.
__device__ __forceinline__ void KeyGradients(const FusedBackwardArgs& args, const Group& g, int L,
                                             const BackwardStats& st) {
  for (int i = g.thread; i < L; i += g.threads) {
    const math::KeyChain<float> chain =
        math::KeyGradient(st.z[i], st.r[i], args.scale, args.dim, args.rmsnorm);
    const float gz = st.ga[i];
    st.ga[i] = gz * chain.a;
    st.z[i] = gz * chain.b;
  }
}

// Source i's share of pass 2, over this thread's chunks of the packed row:
// dv_i = alpha_i g + a_i wg + b_i v_i, written evict-first straight into the
// caller's gradient buffer when it is not null, and U += a_i v_i when add_u
// (never for a token past the end: its statistics are garbage).
template <typename T, int kChunks>
__device__ __forceinline__ void SourceGradient(const FusedBackwardArgs& args,
                                               const RowSlice<T, kChunks>& slice,
                                               const BackwardStats& st, int i, int64_t token,
                                               bool valid, bool add_u,
                                               const typename Chunk<T>::Raw (&row)[kChunks],
                                               const typename Chunk<T>::Raw (&grad)[kChunks],
                                               const BackwardWeights<T, kChunks>& weights,
                                               float (&u)[RowSlice<T, kChunks>::kElems]) {
  using C = Chunk<T>;
  using Bits = typename C::Bits;
  constexpr int kVec = C::kVec;
  const float alpha = st.alpha[i], a = st.ga[i], b = st.z[i];  // ga holds a_i, z holds b_i
  Bits* dst = static_cast<Bits*>(args.grads.Get(i));
  const bool write = dst != nullptr && valid;
  if (write) dst += token * args.strides.grad_source;
  const int bytes = write ? AccessBytes(dst) : 16;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    float v[kVec], gv[kVec], wg[kVec], dv[kVec];
    C::Unpack(row[k], v);
    C::Unpack(grad[k], gv);
    weights.Get(slice, k, wg);
#pragma unroll
    for (int jj = 0; jj < kVec; ++jj) {
      dv[jj] = fmaf(alpha, gv[jj], fmaf(a, wg[jj], b * v[jj]));
    }
    if (write) slice.template Store<Hint::kStreaming>(dst, k, C::Pack(dv), bytes);
    if (add_u) {
#pragma unroll
      for (int jj = 0; jj < kVec; ++jj) u[k * kVec + jj] = fmaf(a, v[jj], u[k * kVec + jj]);
    }
  }
}

// Pass 2: the sources reread newest-first (those pass 1 touched last are the
// likeliest to still be in L2), the next needed row loaded before the current
// one is used, each dv_i written once. A source whose gradient is null is
// skipped, and not even reread unless U is wanted. (L and want_u come from the
// kernel rather than from args: reading them here again costs the backward
// registers.)
template <typename T, int kChunks, typename SourceRow>
__device__ __forceinline__ void BackwardPass2(const FusedBackwardArgs& args,
                                              const RowSlice<T, kChunks>& slice, int L,
                                              bool want_u, const SourceRow& source_row,
                                              int64_t token, bool valid,
                                              const typename Chunk<T>::Raw (&grad)[kChunks],
                                              const BackwardWeights<T, kChunks>& weights,
                                              const BackwardStats& st,
                                              float (&u)[RowSlice<T, kChunks>::kElems]) {
  auto needed = [&](int i) { return want_u || args.grads.Get(i) != nullptr; };
  typename Chunk<T>::Raw cur[kChunks], next[kChunks];
  int i = L - 1;
  while (i >= 0 && !needed(i)) --i;
  if (i >= 0) slice.template Load<Hint::kStreaming>(source_row(i), valid, cur);
  while (i >= 0) {
    int next_i = i - 1;
    while (next_i >= 0 && !needed(next_i)) --next_i;
    if (next_i >= 0) slice.template Load<Hint::kStreaming>(source_row(next_i), valid, next);
    SourceGradient(args, slice, st, i, token, valid, want_u && valid, cur, grad, weights, u);
#pragma unroll
    for (int k = 0; k < kChunks; ++k) cur[k] = next[k];
    i = next_i;
  }
}

// The group's chunk of plan::kTokensPerRow tokens is done: its U (summed in
// token order, in registers) goes to the chunk's own partial row, which
// ReduceRowsKernel adds to the others in a fixed order.
template <typename T, int kChunks>
__device__ __forceinline__ void StoreUPartialRow(const RowSlice<T, kChunks>& slice,
                                                 const float (&u)[RowSlice<T, kChunks>::kElems],
                                                 float* dst) {
  constexpr int kVec = Chunk<T>::kVec;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int jj = 0; jj < kVec; ++jj) {
      if (jj < slice.count[k]) dst[slice.offset[k] + jj] = u[k * kVec + jj];
    }
  }
}

// The pipelined backward's rows (kStages > 0), in the order the kernel uses
// them: for each token of each of this CTA's work items, grad_out's row, the
// sources for pass 1 (0 to L - 1), then the sources pass 2 needs (L - 1 down).
// Each thread's chunks of a row go by asynchronous copy into its slots of a
// ring in shared memory (the forward's layout: slot s of chunk k of thread t
// at ring[(s * kChunks + k) * blockDim.x + t]), kStages - 1 rows ahead of the
// one in use, so the copies run on through the per-token statistics (barriers,
// one thread's softmax) and from one token into the next.
template <typename T, int kChunks, int kStages>
struct BackwardRowStream {
  static_assert(kStages >= 2, "a ring of at least two slots");
  using Slice = RowSlice<T, kChunks>;
  using Bits = typename Slice::Bits;
  using Raw = typename Slice::Raw;
  enum Pass { kGradOut, kPass1, kPass2 };

  const FusedBackwardArgs& args;
  const Group& g;
  const Slice& slice;
  uint4* ring;
  bool want_u;
  // The next row to fetch: token j of work item `item`, in `pass`, source i.
  int64_t item;
  int j = 0;
  int pass = kGradOut;
  int i = 0;
  int fetch_slot = 0;
  int take_slot = 0;

  __device__ __forceinline__ BackwardRowStream(const FusedBackwardArgs& a, const Group& group,
                                               const Slice& s, uint4* shared_ring, bool u)
      : args(a), g(group), slice(s), ring(shared_ring), want_u(u), item(blockIdx.x) {
#pragma unroll 1
    for (int k = 0; k + 1 < kStages; ++k) Fetch();
  }

  // Whether pass 2 reads source i (the same answer on every thread of the CTA).
  __device__ __forceinline__ bool Needed(int source) const {
    return want_u || args.grads.Get(source) != nullptr;
  }
  __device__ __forceinline__ int NeededAtOrBelow(int source) const {
    while (source >= 0 && !Needed(source)) --source;
    return source;
  }

  // Starts the copy of the next row, one commit group per row; past this CTA's
  // last row an empty group, so the count of groups per row stays uniform.
  __device__ __forceinline__ void Fetch() {
    if (item < args.num_items) {
      const int64_t token =
          plan::FirstTokenOfChunk(plan::ChunkOfItem(item, g.per_cta, g.index)) + j;
      const bool valid = token < args.num_tokens;
      const Bits* row =
          pass == kGradOut
              ? static_cast<const Bits*>(args.grad_out) + (valid ? token * args.strides.grad_out : 0)
              : static_cast<const Bits*>(args.sources.Get(i)) +
                    (valid ? token * args.strides.source : 0);
      slice.LoadAsync(row, valid, ring + fetch_slot * kChunks * blockDim.x);
      if (++fetch_slot == kStages) fetch_slot = 0;
      if (pass == kGradOut) {
        pass = kPass1;
        i = 0;
      } else if (pass == kPass1 && ++i < args.num_sources) {
        // the next source of pass 1
      } else {
        i = NeededAtOrBelow(pass == kPass1 ? args.num_sources - 1 : i - 1);
        pass = kPass2;
        if (i < 0) {  // the token is done
          pass = kGradOut;
          if (++j == plan::kTokensPerRow) {
            j = 0;
            item += gridDim.x;
          }
        }
      }
    }
    AsyncCommit();
  }

  // The next row in use order, into registers. The slot that Fetch refills
  // here was read into registers one row ago.
  __device__ __forceinline__ void Take(Raw (&row)[kChunks]) {
    Fetch();
    AsyncWait<kStages - 1>();
#pragma unroll
    for (int k = 0; k < kChunks; ++k) row[k] = ring[(take_slot * kChunks + k) * blockDim.x + threadIdx.x];
    if (++take_slot == kStages) take_slot = 0;
  }
};

// The register kernels load their own rows.
template <typename T, int kChunks>
struct BackwardRowStream<T, kChunks, 0> {
  __device__ __forceinline__ BackwardRowStream(const FusedBackwardArgs&, const Group&,
                                               const RowSlice<T, kChunks>&, uint4*, bool) {}
};

// kStages = 0: rows loaded into registers one ahead, any alignment. kStages > 0
// (plan::BackwardStages; source and grad_out rows 16-byte aligned): rows from a
// BackwardRowStream. Same arithmetic in the same order: the same bits.
template <typename T, int kChunks, int kStages>
__global__ void __launch_bounds__(BackwardMaxThreads(kChunks))
    FusedBackwardKernel(const __grid_constant__ FusedBackwardArgs args) {
  using Slice = RowSlice<T, kChunks>;
  using Bits = typename Slice::Bits;
  using Raw = typename Slice::Raw;
  // [wg,] then the groups' statistics, then (kStages > 0) the row ring.
  ATTNRES_DYNAMIC_SHARED(float4, shared_storage);
  float* shared = reinterpret_cast<float*>(shared_storage);

  const Group g = MakeGroup(args.group_threads);
  const Slice slice(g, args.dim);
  const int L = args.num_sources;
  const BackwardStats st = GroupStats(args, g, shared);
  const BackwardWeights<T, kChunks> weights(slice, args, shared);
  const bool want_u = args.u_partials != nullptr;
  [[maybe_unused]] BackwardRowStream<T, kChunks, kStages> rows(
      args, g, slice, reinterpret_cast<uint4*>(shared_storage) + args.ring_offset, want_u);

  for (int64_t item = blockIdx.x; item < args.num_items; item += gridDim.x) {
    const int64_t chunk = plan::ChunkOfItem(item, g.per_cta, g.index);
    const int64_t first_token = plan::FirstTokenOfChunk(chunk);
    float u[Slice::kElems];
#pragma unroll
    for (int e = 0; e < Slice::kElems; ++e) u[e] = 0.f;

    // Every group of the CTA runs kTokensPerRow steps (the barriers below are
    // CTA-wide); tokens past the end are computed as zeros and dropped.
    for (int j = 0; j < plan::kTokensPerRow; ++j) {
      const int64_t token = first_token + j;
      const bool valid = token < args.num_tokens;
      const int64_t row = valid ? token * args.strides.source : 0;
      const auto source_row = [&](int i) { return static_cast<const Bits*>(args.sources.Get(i)) + row; };
      __syncthreads();  // the previous token's pass 2 is done reading the stats

      Raw grad[kChunks];
      if constexpr (kStages == 0) {
        slice.template Load<Hint::kStreaming>(
            static_cast<const Bits*>(args.grad_out) + (valid ? token * args.strides.grad_out : 0),
            valid, grad);
        BackwardPass1(slice, g, L, source_row, valid, grad, weights, st);
      } else {
        rows.Take(grad);
        for (int i = 0; i < L; ++i) {
          Raw cur[kChunks];
          rows.Take(cur);
          Pass1Source(slice, g, i, cur, grad, weights, st);
        }
      }
      __syncthreads();
      GatherSourceStats(args, g, L, token, valid, st);
      __syncthreads();
      // The softmax (unless cached) and its backward over the token's L sources,
      // in the pivot form, by one thread (a few flops per source against the
      // 2 D bytes each source moves): gz replaces ga.
      if (g.thread == 0) {
        if (args.alpha_cache == nullptr) math::Softmax(st.z, st.alpha, L);
        math::SoftmaxBackward(st.alpha, st.ga, L, 0.f, st.ga);
      }
      __syncthreads();
      KeyGradients(args, g, L, st);
      __syncthreads();
      if constexpr (kStages == 0) {
        BackwardPass2(args, slice, L, want_u, source_row, token, valid, grad, weights, st, u);
      } else {
        for (int i = rows.NeededAtOrBelow(L - 1); i >= 0; i = rows.NeededAtOrBelow(i - 1)) {
          Raw cur[kChunks];
          rows.Take(cur);
          SourceGradient(args, slice, st, i, token, valid, want_u && valid, cur, grad, weights, u);
        }
      }
    }

    if (want_u && first_token < args.num_tokens) {
      StoreUPartialRow(slice, u, args.u_partials + chunk * args.dim);
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_BLOCK_ATTN_RES_FUSED_CUH_
