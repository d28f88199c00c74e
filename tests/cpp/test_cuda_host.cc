// The CUDA backend's host-side logic, on the CPU (no device, no CUDA headers):
// the layout of a row over a token group, where the backward's statistics go,
// which tokens each dw/dgamma partial row sums (and that this does not depend
// on the grid), persistent grid sizes (src/cuda/plan.h), and the online softmax
// of the CUDA forward against the softmax of the CPU kernels
// (core/token_math.h). The kernels call these same functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "core/token_math.h"
#include "cuda/plan.h"

namespace attnres_test {
namespace {

namespace plan = attnres::cuda::plan;

constexpr int kVec16 = plan::ChunkElements(2);  // bf16, fp16
constexpr int kVec32 = plan::ChunkElements(4);  // fp32

template <size_t N>
int MaxThreads(const plan::KernelShape (&shapes)[N], int chunks) {
  for (const plan::KernelShape& s : shapes) {
    if (s.chunks == chunks) return s.max_threads;
  }
  return 0;
}

// Every layout covers the row with whole warps, within its kernel's launch
// bound, and no smaller group of whole warps would do.
template <size_t N>
void ExpectLayoutInvariants(const plan::KernelShape (&shapes)[N], int64_t dim, int vec) {
  SCOPED_TRACE("dim " + std::to_string(dim) + " vec " + std::to_string(vec));
  plan::Layout l;
  if (!plan::ChooseLayout(dim, vec, shapes, &l)) return;
  EXPECT_EQ(l.row_chunks, (dim + vec - 1) / vec);
  EXPECT_EQ(l.group_threads % plan::kWarpSize, 0);
  EXPECT_LE(l.group_threads, MaxThreads(shapes, l.chunks));
  EXPECT_GE(int64_t{l.group_threads} * l.chunks, l.row_chunks);
  EXPECT_LT(int64_t{l.group_threads - plan::kWarpSize} * l.chunks, l.row_chunks);
  EXPECT_EQ(l.groups_per_cta, std::max(1, plan::kTargetCtaThreads / l.group_threads));
}

TEST(CudaPlan, LayoutInvariants) {
  for (int64_t dim = 1; dim <= 9000; dim += (dim < 300 ? 1 : 37)) {
    for (int vec : {kVec16, kVec32}) {
      ExpectLayoutInvariants(plan::kForwardShapes, dim, vec);
      ExpectLayoutInvariants(plan::kBackwardShapes, dim, vec);
    }
  }
}

TEST(CudaPlan, LayoutsOfTheHeadlineShapes) {
  plan::Layout l;
  // bf16 D = 1536: 192 chunks; 4 per thread would leave 64 of 256 slots idle,
  // 2 per thread over 96 threads leave none.
  ASSERT_TRUE(plan::ChooseLayout(1536, kVec16, plan::kForwardShapes, &l));
  EXPECT_EQ(l.chunks, 2);
  EXPECT_EQ(l.group_threads, 96);
  EXPECT_EQ(l.groups_per_cta, 2);
  ASSERT_TRUE(plan::ChooseLayout(4096, kVec16, plan::kForwardShapes, &l));
  EXPECT_EQ(l.chunks, 4);
  EXPECT_EQ(l.group_threads, 128);
  ASSERT_TRUE(plan::ChooseLayout(4096, kVec16, plan::kBackwardShapes, &l));
  EXPECT_EQ(l.chunks, 2);
  EXPECT_EQ(l.group_threads, 256);
  EXPECT_EQ(l.groups_per_cta, 1);
  // A partial last chunk: 1539 bf16 elements are 193 chunks.
  ASSERT_TRUE(plan::ChooseLayout(1539, kVec16, plan::kForwardShapes, &l));
  EXPECT_EQ(l.row_chunks, 193);
  // Tiny rows: one chunk per thread, one warp.
  ASSERT_TRUE(plan::ChooseLayout(1, kVec16, plan::kForwardShapes, &l));
  EXPECT_EQ(l.chunks, 1);
  EXPECT_EQ(l.group_threads, 32);
  EXPECT_EQ(l.groups_per_cta, 8);
}

// The widest rows the fused kernels take; one element more goes to the generic
// kernels (docs/CUDA.md states these limits).
TEST(CudaPlan, FusedRowLimits) {
  plan::Layout l;
  for (const auto& [vec, limit] : {std::pair<int, int64_t>{kVec16, 16384}, {kVec32, 8192}}) {
    SCOPED_TRACE("vec " + std::to_string(vec));
    EXPECT_TRUE(plan::ChooseLayout(limit, vec, plan::kForwardShapes, &l));
    EXPECT_FALSE(plan::ChooseLayout(limit + 1, vec, plan::kForwardShapes, &l));
    EXPECT_TRUE(plan::ChooseLayout(limit, vec, plan::kBackwardShapes, &l));
    EXPECT_FALSE(plan::ChooseLayout(limit + 1, vec, plan::kBackwardShapes, &l));
  }
}

// The wide-row shapes (the last of each list) take only rows the others cannot:
// every row of up to 1024 chunks keeps the layout it had before they existed,
// and every wider row gets them.
template <size_t N>
void ExpectWideShapeOnlyPastTheOthers(const plan::KernelShape (&shapes)[N]) {
  const plan::KernelShape wide = shapes[N - 1];
  plan::KernelShape others[N - 1];
  std::copy(shapes, shapes + N - 1, others);
  for (int64_t chunks = 1; chunks <= 2048; ++chunks) {
    SCOPED_TRACE("row chunks " + std::to_string(chunks));
    plan::Layout with_wide, without;
    ASSERT_TRUE(plan::ChooseLayout(chunks, 1, shapes, &with_wide));
    if (plan::ChooseLayout(chunks, 1, others, &without)) {
      EXPECT_EQ(with_wide.chunks, without.chunks);
      EXPECT_EQ(with_wide.group_threads, without.group_threads);
    } else {
      EXPECT_EQ(with_wide.chunks, wide.chunks);
      EXPECT_GT(chunks, 1024);
    }
  }
}

TEST(CudaPlan, WideShapesOnlyForWideRows) {
  ExpectWideShapeOnlyPastTheOthers(plan::kForwardShapes);
  ExpectWideShapeOnlyPastTheOthers(plan::kBackwardShapes);
}

TEST(CudaPlan, BackwardStatsPlacement) {
  plan::Layout l;
  ASSERT_TRUE(plan::ChooseLayout(1536, kVec16, plan::kBackwardShapes, &l));  // G = 96, W = 3
  plan::Layout small = l;
  plan::StatsPlacement s = plan::PlaceBackwardStats(33, kVec16, &small);
  EXPECT_TRUE(s.shared);
  EXPECT_EQ(s.bytes_per_group, (4 * 33 + 3 * 3 * 33) * sizeof(float));
  EXPECT_EQ(small.groups_per_cta, l.groups_per_cta);
  EXPECT_EQ(s.weight_bytes, 0u);  // the 2-chunk backward keeps wg in registers
  EXPECT_EQ(s.dynamic_shared_bytes, small.groups_per_cta * s.bytes_per_group);
  EXPECT_LE(s.dynamic_shared_bytes, plan::kSharedStatsBudget);

  // L = 1024 with 3 warps: 13 K floats per group, more than the budget.
  plan::Layout big = l;
  s = plan::PlaceBackwardStats(1024, kVec16, &big);
  EXPECT_FALSE(s.shared);
  EXPECT_EQ(s.dynamic_shared_bytes, 0u);
  EXPECT_EQ(big.groups_per_cta, l.groups_per_cta);

  // One warp per group, L = 1024: 16 KiB per group fits, but only 2 groups.
  ASSERT_TRUE(plan::ChooseLayout(64, kVec16, plan::kBackwardShapes, &l));
  ASSERT_EQ(l.group_threads, 32);
  s = plan::PlaceBackwardStats(1024, kVec16, &l);
  EXPECT_TRUE(s.shared);
  EXPECT_EQ(l.groups_per_cta, 2);
  EXPECT_LE(s.dynamic_shared_bytes, plan::kSharedStatsBudget);
}

// The 4-chunk backward puts wg (its group's chunk slots, zero-padded) first and
// the statistics after it, within plan::kOptInSharedBytes.
TEST(CudaPlan, WideBackwardSharedMemory) {
  plan::Layout l;
  ASSERT_TRUE(plan::ChooseLayout(16384, kVec16, plan::kBackwardShapes, &l));
  ASSERT_EQ(l.chunks, 4);
  ASSERT_EQ(l.group_threads, 512);  // W = 16
  ASSERT_TRUE(plan::BackwardSharesWeights(l.chunks));
  plan::Layout shared = l;
  plan::StatsPlacement s = plan::PlaceBackwardStats(33, kVec16, &shared);
  EXPECT_EQ(s.weight_bytes, 512u * 4 * 8 * sizeof(float));  // 64 KiB
  EXPECT_TRUE(s.shared);
  EXPECT_EQ(s.dynamic_shared_bytes, s.weight_bytes + s.bytes_per_group);
  EXPECT_GT(s.dynamic_shared_bytes, plan::kDefaultSharedBytes);  // needs the opt-in
  EXPECT_LE(s.dynamic_shared_bytes, plan::kOptInSharedBytes);
  // 52 L floats per group: past 32 KiB (what the 64 KiB of wg leave) at L = 158.
  plan::Layout global = l;
  s = plan::PlaceBackwardStats(158, kVec16, &global);
  EXPECT_FALSE(s.shared);
  EXPECT_EQ(s.dynamic_shared_bytes, s.weight_bytes);
  s = plan::PlaceBackwardStats(157, kVec16, &global);
  EXPECT_TRUE(s.shared);
  EXPECT_LE(s.dynamic_shared_bytes, plan::kOptInSharedBytes);
  // The forward's wg row of the widest layout fits the opt-in too.
  ASSERT_TRUE(plan::ChooseLayout(16384, kVec16, plan::kForwardShapes, &l));
  EXPECT_EQ(l.chunks, 8);
  EXPECT_LE(l.row_chunks * kVec16 * sizeof(float), plan::kOptInSharedBytes);
}

// Runs the fused backward's loops (CTA b takes items b, b + grid, ...; group k
// of an item takes chunk ChunkOfItem(item, K, k), tokens from
// FirstTokenOfChunk) for a given grid, and records, per partial row, the
// tokens that were added into it in order.
std::vector<std::vector<int64_t>> RowsAsSummed(int64_t num_tokens, int groups_per_cta,
                                               int64_t grid) {
  std::vector<std::vector<int64_t>> rows(plan::NumPartialRows(num_tokens));
  const int64_t items = plan::NumWorkItems(num_tokens, groups_per_cta);
  for (int64_t cta = 0; cta < grid; ++cta) {
    for (int64_t item = cta; item < items; item += grid) {
      for (int k = 0; k < groups_per_cta; ++k) {
        const int64_t chunk = plan::ChunkOfItem(item, groups_per_cta, k);
        const int64_t first = plan::FirstTokenOfChunk(chunk);
        if (first >= num_tokens) continue;  // the kernel writes no row for it
        EXPECT_LT(chunk, static_cast<int64_t>(rows.size()));
        EXPECT_TRUE(rows[chunk].empty()) << "row " << chunk << " written twice";
        for (int64_t j = 0; j < plan::kTokensPerRow && first + j < num_tokens; ++j) {
          rows[chunk].push_back(first + j);
        }
      }
    }
  }
  return rows;
}

// The pipelined forward's shared memory (wg, then the ring of row slots) for
// every row a pipelined shape takes stays within what the launch plans without
// falling back (plan::kOptInSharedBytes; sm_80 and newer grant more), so an
// aligned call never trades the pipeline for the generic kernels. The 8-chunk
// shape is not pipelined.
TEST(CudaPlan, PipelinedForwardSharedMemory) {
  EXPECT_FALSE(plan::ForwardCanPipeline(8));
  for (int vec : {kVec16, kVec32}) {
    for (int64_t dim = 1; dim <= 8192; dim += (dim < 300 ? 1 : 29)) {
      plan::Layout l;
      if (!plan::ChooseLayout(dim, vec, plan::kForwardShapes, &l) ||
          !plan::ForwardCanPipeline(l.chunks)) {
        continue;
      }
      SCOPED_TRACE("dim " + std::to_string(dim) + " vec " + std::to_string(vec));
      const int threads = l.group_threads * l.groups_per_cta;
      const size_t wg = static_cast<size_t>(l.row_chunks) * vec * sizeof(float);
      const size_t ring = plan::ForwardRingBytes(l.chunks, threads);
      EXPECT_EQ(ring, size_t{16} * plan::ForwardStages(l.chunks) * l.chunks * threads);
      EXPECT_GE(plan::ForwardStages(l.chunks), 3);
      EXPECT_LE(wg + ring, plan::kOptInSharedBytes);
    }
  }
}

// What makes dw/dgamma independent of the GPU: each row's tokens, and their
// order, are the same for every grid size, and every token is in exactly one row.
TEST(CudaPlan, PartialRowsDoNotDependOnTheGrid) {
  for (int64_t tokens : {1, 7, 8, 9, 20000, 65536 + 3}) {
    for (int groups_per_cta : {1, 2, 3, 8}) {
      SCOPED_TRACE("tokens " + std::to_string(tokens) + " groups " + std::to_string(groups_per_cta));
      const auto expected = RowsAsSummed(tokens, groups_per_cta, 1);
      int64_t covered = 0;
      for (size_t r = 0; r < expected.size(); ++r) {
        ASSERT_FALSE(expected[r].empty()) << "row " << r << " never written";
        for (size_t j = 0; j < expected[r].size(); ++j) {
          EXPECT_EQ(expected[r][j], static_cast<int64_t>(r) * plan::kTokensPerRow +
                                        static_cast<int64_t>(j));
        }
        covered += static_cast<int64_t>(expected[r].size());
      }
      EXPECT_EQ(covered, tokens);
      for (int64_t grid : {2, 7, 132, 528, 100000}) {
        EXPECT_EQ(RowsAsSummed(tokens, groups_per_cta, grid), expected) << "grid " << grid;
      }
    }
  }
}

TEST(CudaPlan, PersistentGridSize) {
  EXPECT_EQ(plan::PersistentGridSize(1000000, 4, 132, 0), 528);
  EXPECT_EQ(plan::PersistentGridSize(100, 4, 132, 0), 100);
  EXPECT_EQ(plan::PersistentGridSize(1000000, 4, 132, 3), 3);
  EXPECT_EQ(plan::PersistentGridSize(2, 4, 132, 3), 2);
  EXPECT_EQ(plan::PersistentGridSize(0, 4, 132, 0), 1);
}

// ---------------------------------------------------------------------------
// The online softmax of the CUDA forward against the CPU kernels' softmax:
// the same weights and the same h = sum alpha_i v_i, accumulated the way the
// kernel does it, with the same non-finite cases.

struct OnlineResult {
  std::vector<float> alpha;
  float h;
};

OnlineResult RunOnline(const std::vector<float>& z, const std::vector<float>& v) {
  attnres::math::OnlineSoftmax<float> softmax;
  float acc = 0.f;
  for (size_t i = 0; i < z.size(); ++i) {
    const auto step = softmax.Add(z[i]);
    acc = std::fma(acc, step.rescale, step.weight * v[i]);
  }
  OnlineResult r;
  for (float zi : z) r.alpha.push_back(softmax.Alpha(zi));
  r.h = acc / softmax.denom;
  return r;
}

OnlineResult RunTwoPass(const std::vector<float>& z, const std::vector<float>& v) {
  OnlineResult r;
  r.alpha.resize(z.size());
  attnres::math::Softmax(z.data(), r.alpha.data(), static_cast<int64_t>(z.size()));
  r.h = 0.f;
  for (size_t i = 0; i < z.size(); ++i) r.h += r.alpha[i] * v[i];
  return r;
}

void ExpectSameOrBothNan(float online, float two_pass, const std::string& what) {
  if (std::isnan(two_pass)) {
    EXPECT_TRUE(std::isnan(online)) << what << ": " << online;
  } else {
    EXPECT_NEAR(online, two_pass, 1e-6f * (1.f + std::fabs(two_pass))) << what;
  }
}

TEST(CudaMath, OnlineSoftmaxMatchesSoftmax) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> cases = {
      {0.5f, -1.f, 2.f, 0.f},
      {-1e4f, 1e4f, 0.f, 9999.f},     // the running max jumps: rescale underflows to 0
      {-inf, 0.3f, 1.f},              // leading -inf: alpha 0, finite h
      {0.3f, -inf, 1.f},              // -inf in the middle
      {-inf, -inf, 2.f},              // two leading -inf
      {-inf, -inf, -inf},             // no finite logit: NaN, as Softmax gives
      {nan, 1.f, 2.f},                // NaN first
      {1.f, nan, 2.f},                // NaN later
      {1.f, inf, 2.f},                // +inf: NaN
      {-inf},                         // L = 1
      {3.f},
  };
  const std::vector<float> values = {1.5f, -2.f, 0.25f, 4.f};
  for (const auto& z : cases) {
    std::string what = "z =";
    for (float x : z) what += " " + std::to_string(x);
    SCOPED_TRACE(what);
    const std::vector<float> v(values.begin(), values.begin() + z.size());
    const OnlineResult online = RunOnline(z, v), two_pass = RunTwoPass(z, v);
    for (size_t i = 0; i < z.size(); ++i) {
      ExpectSameOrBothNan(online.alpha[i], two_pass.alpha[i], "alpha " + std::to_string(i));
    }
    ExpectSameOrBothNan(online.h, two_pass.h, "h");
  }
}

// The case the issue names: a leading -inf logit. The two-pass softmax gives
// alpha_0 = 0 and a finite h; the old online update computed exp(-inf - -inf).
TEST(CudaMath, LeadingMinusInfinityGivesZeroWeight) {
  const float inf = std::numeric_limits<float>::infinity();
  const OnlineResult r = RunOnline({-inf, 0.f, 0.f}, {-3e38f, 1.f, 3.f});
  EXPECT_EQ(r.alpha[0], 0.f);
  EXPECT_FLOAT_EQ(r.alpha[1], 0.5f);
  EXPECT_FLOAT_EQ(r.h, 2.f);
}

}  // namespace
}  // namespace attnres_test
