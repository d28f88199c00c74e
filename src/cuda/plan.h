// How the CUDA kernels of attnres cut up a call, in plain C++ (no CUDA headers),
// so that every choice below is unit-tested on any machine
// (tests/cpp/test_cuda_host.cc) and the GPU tests can assert what they cover:
//   - the layout of a token's row over a token group of the fused kernels,
//   - where the backward's per-token statistics live,
//   - which tokens each partial row of the dw/dgamma reduction sums,
//   - the size of a persistent grid.
// Everything here is a function of the problem (dtype, D, L, num_tokens) and of
// constants, except PersistentGridSize, whose device inputs decide how fast a
// call runs, never what it computes.
#ifndef ATTNRES_SRC_CUDA_PLAN_H_
#define ATTNRES_SRC_CUDA_PLAN_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

// The few functions that kernels call too (the work-item arithmetic) are
// host-and-device under nvcc, so the tested code is the code that runs.
#if defined(__CUDACC__)
#define ATTNRES_PLAN_HD __host__ __device__ inline
#else
#define ATTNRES_PLAN_HD inline
#endif

namespace attnres::cuda::plan {

constexpr int kWarpSize = 32;
// The fused kernels put several token groups in one CTA when a token needs fewer
// threads than this.
constexpr int kTargetCtaThreads = 256;
// Dynamic shared memory the backward uses without an opt-in: the 48 KiB every
// device grants a CTA, less room for the kernels' static reduction slots.
constexpr size_t kSharedStatsBudget = 46 * 1024;
// Dynamic shared memory every kernel may use, and what the wide-row kernels plan
// to use at most (wg = w * gamma for the whole row, plus the backward's
// statistics). Above 48 KiB a kernel must opt in (runtime.h: AllowSharedMemory);
// sm_80 and newer grant 99 KiB or more (163 KiB on sm_80, 227 KiB on sm_90), and
// where a device grants less the call takes the generic kernels.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kOptInSharedBytes = 96 * 1024;
// Keeps every per-token index of the statistics (4 L + 3 W L floats) inside int.
constexpr int64_t kMaxSources = int64_t{1} << 22;

// One compiled fused kernel: chunks per thread, and the threads per CTA its
// __launch_bounds__ allows (a compile-time constant: the layout never depends on
// how a particular compiler or architecture allocated registers).
struct KernelShape {
  int chunks;
  int max_threads;
};

// The fused kernels that exist, in the order ChooseLayout tries them. The first
// three of each list cover rows of up to 1024 chunks (8192 16-bit or 4096 fp32
// elements); the last one, wider rows of up to 2048 chunks, and is never chosen
// for a row the others take (its waste is never smaller: a row's waste with c
// chunks per thread is the row rounded up to a multiple of 32 c chunks).
// block_attn_res.cu instantiates exactly these and static_asserts its launch
// bounds against them. The backward keeps g and U in registers next to two rows
// in flight, so it stops at 2 chunks per thread with wg in registers, and at 4
// with wg in shared memory (BackwardSharesWeights).
inline constexpr KernelShape kForwardShapes[] = {{4, 256}, {2, 512}, {1, 1024}, {8, 256}};
inline constexpr KernelShape kBackwardShapes[] = {{2, 512}, {1, 512}, {4, 512}};

// The pipelined forward (block_attn_res_fused.cuh, kStages > 0) keeps each
// thread's next rows in a ring of ForwardStages(chunks) slots in shared memory,
// stages - 1 rows in flight per thread, where registers leave room for one:
// with the 2-chunk bf16 kernel's ~80 registers an H200 SM holds 768 threads,
// 24 KiB of rows in flight at one row each, while its share of the bandwidth
// times the loaded memory latency is 48 KiB or more. Per SM the rings take
// 4 x 16 B x chunks x threads: 96 KiB for 4 CTAs of the 2-chunk kernel; the
// 4-chunk kernel (two CTAs of 256 threads, wg up to 32 KiB each) takes 3 stages
// so that two CTAs still fit an A100's 164 KiB; the 8-chunk kernel (one CTA,
// wg up to 64 KiB) keeps its rows in registers. 0: not pipelined.
constexpr int ForwardStages(int chunks) { return chunks <= 2 ? 4 : chunks == 4 ? 3 : 0; }
constexpr bool ForwardCanPipeline(int chunks) { return ForwardStages(chunks) > 0; }
// The ring's bytes for a CTA of `cta_threads` threads (16-byte chunks).
constexpr size_t ForwardRingBytes(int chunks, int cta_threads) {
  return size_t{16} * ForwardStages(chunks) * chunks * cta_threads;
}

// The pipelined backward (block_attn_res_fused.cuh: BackwardRowStream) keeps
// the same kind of ring, for the 1- and 2-chunk kernels (the 4-chunk one has
// 64 KiB of wg in shared memory already). Its registers (the 2-chunk kernel
// runs at its cap of 128) leave an SM 384-512 threads, so stages - 1 = 3 rows
// ahead is 36-48 KiB in flight at D = 1536, and the copies run on through the
// per-token statistics, where the register kernels' memory traffic stops.
constexpr int BackwardStages(int chunks) { return chunks <= 2 ? 4 : 0; }
constexpr bool BackwardCanPipeline(int chunks) { return BackwardStages(chunks) > 0; }
constexpr size_t BackwardRingBytes(int chunks, int cta_threads) {
  return size_t{16} * BackwardStages(chunks) * chunks * cta_threads;
}

// Whether the backward kernel with `chunks` per thread reads wg = w * gamma from
// shared memory (the whole row, zero-padded to the group's chunk slots) rather
// than keeping its elements in registers.
constexpr bool BackwardSharesWeights(int chunks) { return chunks >= 4; }

// The largest wg row a shared-weights backward plans (16-byte chunks of up to 8
// elements) fits kOptInSharedBytes, so what it leaves for statistics is >= 0.
constexpr bool SharedWeightsFit() {
  for (const KernelShape& s : kBackwardShapes) {
    if (BackwardSharesWeights(s.chunks) &&
        size_t{1} * s.max_threads * s.chunks * 8 * sizeof(float) > kOptInSharedBytes) {
      return false;
    }
  }
  return true;
}
static_assert(SharedWeightsFit(), "a backward shape's shared wg exceeds kOptInSharedBytes");

// Elements per chunk: one 128-bit access of the storage type.
constexpr int ChunkElements(int element_bytes) { return 16 / element_bytes; }

// A token's row of `dim` elements cut into ceil(dim / vec) chunks of `vec`
// elements (the last one partial when vec does not divide dim); chunk c belongs
// to thread c % group_threads of the token's group, which owns `chunks` of them.
struct Layout {
  int chunks = 0;          // chunks per thread (a KernelShape's)
  int group_threads = 0;   // G, a multiple of 32
  int groups_per_cta = 0;  // tokens a CTA works on side by side
  int64_t row_chunks = 0;  // ceil(dim / vec)
};

// Picks the shape that spreads a row over the fewest idle lanes: the first shape
// (most chunks per thread) wasting at most 1/8 of its group's chunk slots wins,
// else the least wasteful. False when the row is too wide for every shape.
template <size_t N>
bool ChooseLayout(int64_t dim, int vec, const KernelShape (&shapes)[N], Layout* layout) {
  const int64_t row_chunks = (dim + vec - 1) / vec;
  int64_t best_waste = INT64_MAX;
  for (const KernelShape& shape : shapes) {
    const int64_t threads = (row_chunks + shape.chunks - 1) / shape.chunks;
    const int64_t group = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
    if (group > shape.max_threads) continue;
    const int64_t waste = group * shape.chunks - row_chunks;
    if (waste >= best_waste) continue;
    best_waste = waste;
    layout->chunks = shape.chunks;
    layout->group_threads = static_cast<int>(group);
    layout->groups_per_cta = std::max(1, kTargetCtaThreads / layout->group_threads);
    layout->row_chunks = row_chunks;
    if (waste * 8 <= row_chunks) break;
  }
  return best_waste != INT64_MAX;
}

// Floats of per-token statistics the fused backward keeps for one group: ga, z,
// r, alpha per source, plus the warps' partial sums (3 per source) when W > 1.
inline int64_t BackwardStatsFloats(int64_t num_sources, int group_warps) {
  return 4 * num_sources + (group_warps > 1 ? 3 * int64_t{group_warps} * num_sources : 0);
}

// The backward's statistics go to shared memory when one group's fit the
// default budget (with fewer groups per CTA if need be); otherwise to a global
// scratch, which costs 16 B per source and token against the 2 L D bytes the
// token moves anyway. A layout whose kernel reads wg from shared memory
// (BackwardSharesWeights) puts that row first: G * chunks * vec floats, and
// then the statistics only if both fit kOptInSharedBytes. Changes
// layout->groups_per_cta.
struct StatsPlacement {
  bool shared = true;
  size_t bytes_per_group = 0;
  size_t weight_bytes = 0;          // wg at the start of the CTA's shared memory, or 0
  size_t dynamic_shared_bytes = 0;  // per CTA: weights, then the statistics if shared
};
inline StatsPlacement PlaceBackwardStats(int64_t num_sources, int vec, Layout* layout) {
  StatsPlacement s;
  s.bytes_per_group = static_cast<size_t>(
      BackwardStatsFloats(num_sources, layout->group_threads / kWarpSize) * sizeof(float));
  if (BackwardSharesWeights(layout->chunks)) {
    s.weight_bytes = static_cast<size_t>(layout->group_threads) * layout->chunks * vec * sizeof(float);
  }
  const size_t stats_budget = std::min(kSharedStatsBudget, kOptInSharedBytes - s.weight_bytes);
  s.shared = s.bytes_per_group <= stats_budget;
  s.dynamic_shared_bytes = s.weight_bytes;
  if (s.shared) {
    layout->groups_per_cta = std::min<int>(layout->groups_per_cta,
                                           static_cast<int>(stats_budget / s.bytes_per_group));
    s.dynamic_shared_bytes += layout->groups_per_cta * s.bytes_per_group;
  }
  return s;
}

// dw/dgamma. Tokens are cut into fixed chunks of kTokensPerRow; partial row r
// of U = sum a_i v_i is the sum over chunk r's tokens [r C, r C + C), added in
// token order by one thread per element, whichever CTA runs it; the reduction
// then sums the rows in a fixed order. So the bits depend on the problem only,
// never on the grid, the SM count, the GPU model or timing (docs/CUDA.md).
// The size trades the scratch traffic (an fp32 row of D written and read back
// per chunk: 4 / (C (2L + 1)) of the backward's bytes in bf16) against the tail
// of the last wave of work items (fewer, bigger items).
constexpr int64_t kTokensPerRow = 8;

ATTNRES_PLAN_HD int64_t NumPartialRows(int64_t num_tokens) {
  return (num_tokens + kTokensPerRow - 1) / kTokensPerRow;
}

// A backward work item of the fused kernels is groups_per_cta consecutive
// chunks, one per group: group k of the CTA that takes item j handles chunk
// j * groups_per_cta + k, tokens [FirstTokenOfChunk(chunk), + kTokensPerRow).
// The generic kernels take one chunk per CTA (groups_per_cta = 1). Which CTA
// takes which item is the grid's business and changes nothing else.
ATTNRES_PLAN_HD int64_t NumWorkItems(int64_t num_tokens, int groups_per_cta) {
  return (NumPartialRows(num_tokens) + groups_per_cta - 1) / groups_per_cta;
}
ATTNRES_PLAN_HD int64_t ChunkOfItem(int64_t item, int groups_per_cta, int group) {
  return item * groups_per_cta + group;
}
ATTNRES_PLAN_HD int64_t FirstTokenOfChunk(int64_t chunk) { return chunk * kTokensPerRow; }

// The fixed order of the final reduction (ReduceRowsKernel): row lane y in
// [0, kReduceRowLanes) adds rows y, y + lanes, y + 2 lanes, ... in turn, then the
// lane sums are added in lane order.
constexpr int kReduceRowLanes = 8;
constexpr int kReduceColumns = 32;

// A persistent grid: as many CTAs as fit on the device at once (`per_sm` of
// them on each of `num_sms`), at most `work`, at most `cap` when cap > 0 (the
// ATTNRES_CUDA_MAX_CTAS test knob). At least 1.
inline int64_t PersistentGridSize(int64_t work, int per_sm, int num_sms, int64_t cap) {
  int64_t grid = std::min<int64_t>(work, int64_t{per_sm} * num_sms);
  if (cap > 0) grid = std::min(grid, cap);
  return std::max<int64_t>(grid, 1);
}

}  // namespace attnres::cuda::plan

#undef ATTNRES_PLAN_HD

#endif  // ATTNRES_SRC_CUDA_PLAN_H_
