// The two-phase schedule's CPU kernels (docs/DESIGN.md, "The two phases"):
// phase 1 mixes the N completed blocks for the S queries of a block of sub-layers
// in one read of the blocks; phase 2 merges one query's result with the partial
// block, optionally followed by the sub-layer's input RMSNorm.
//
// Per token, with u_s = w_s * gamma_s (the rows `wg`) and r_i the RMS of block i:
//   phase 1  z_{s,i} = scale * dot(u_s, v_i) / r_i,   lse_s = logsumexp_i z_{s,i}
//            a_{s,i} = exp(z_{s,i} - lse_s),           o_s = sum_i a_{s,i} v_i
//     pass 1 reads each block row once from memory (S + 1 dot products per
//            element, queries in groups of kGroup so that x is widened once per
//            group); pass 2 rereads the token's rows from cache for the S outputs.
//     backward (g_s = dL/do_s, e_s = dL/dlse_s): pass 1 also forms dot(g_s, v_i);
//            dz_{s,i} = a_{s,i} (dot(g_s, v_i) - dot(g_s, o_s) + e_s)  (pivot form)
//            dv_i = sum_s (a_{s,i} g_s + c_{s,i} u_s) + b_i v_i,   c_{s,i} = dz_{s,i} scale / r_i
//            U_s += sum_i c_{s,i} v_i  (dw_s = gamma_s U_s, dgamma_s = w_s U_s)
//            dot(g_s, o_s) = sum_i a_{s,i} dot(g_s, v_i): o_s and lse_s are not read.
//   phase 2  z_p = scale * dot(u, p) / r_p,  beta = sigmoid(lse - z_p),
//            keep = 1 - beta = sigmoid(z_p - lse) (each from its own exponent)
//            h = beta o + keep p,  out = h or h / rms(h) * norm_weight
//     A few passes over the token's o, p (and g) rows, which stay in L1.
//
// Compiled once per ISA, like block_attn_res.cc; kernels in an unnamed namespace.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/token_math.h"
#include "cpu/kernel_table.h"
#include "cpu/simd-inl.h"

namespace attnres::cpu {
namespace {

// Queries whose accumulators share one read of a row: kGroup queries x 2 vectors of
// sums, the row's 2 vectors and the loads fit in the registers (16 on AVX2, 32 on
// AVX-512, where 8 queries read each row once at S = 6 or 8 instead of twice).
constexpr int kGroup = kVectorBytes == 64 ? 8 : 4;

// f(std::integral_constant<int, Q>{}) with Q = q, for 1 <= q <= kGroup.
template <int Q = kGroup, typename F>
inline void WithGroupSize(int64_t q, const F& f) {
  if constexpr (Q > 1) {
    if (q < Q) return WithGroupSize<Q - 1>(q, f);
  }
  f(std::integral_constant<int, Q>{});
}

template <typename T>
struct PhaseRow : Row<T> {
  using R = Row<T>;
  using typename R::A;
  using typename R::V;
  using R::kLanes;
  using R::kPair;
  using R::LoadA;
  using R::Splat;
  using R::StoreA;
  using R::Sum;

  // Adds the products over elements [d_begin, d_end) (as ForEachPair) to the
  // running sums in `sums` (Q + 1 pairs of vectors of A, kept between calls; the
  // call with d_begin = 0 starts them from zero): pair q, dot(rows[q], x); pair Q,
  // sum(x^2) when kSumSq. `ahead` (or null) is asked into L2 at the same pace.
  // Whole pairs and the short pair that may end a row run in separate bodies: with
  // one body for both, GCC keeps the sums in a stack array, zeroes it with `rep stos`
  // and copies it in and out on every call (GroupDots is called once per block and
  // tile of 512 elements).
  template <int Q, bool kSumSq>
  [[gnu::noinline]] static void GroupDots(const T* x, const T* ahead, const A* const* rows,
                                          int64_t d_begin, int64_t d_end, int64_t dim, A* sums) {
    const int64_t whole_end = d_begin + (d_end - d_begin) / kPair * kPair;
    if (whole_end > d_begin) {
      DotsSpan<Q, kSumSq>(x, ahead, rows, d_begin, whole_end,
                          std::integral_constant<int64_t, kPair>{}, sums);
    }
    if (whole_end < d_end) ShortPairDots<Q, kSumSq>(x, rows, whole_end, dim - whole_end, sums);
    if (ahead != nullptr && d_end == dim) R::template PrefetchRowEnd<2>(ahead, dim);
  }

  template <int Q, bool kSumSq>
  [[gnu::noinline]] static void ShortPairDots(const T* x, const A* const* rows, int64_t d,
                                              int64_t n, A* sums) {
    DotsSpan<Q, kSumSq>(x, nullptr, rows, d, d + kPair, n, sums);
  }

  // GroupDots' body over [d_begin, d_end) in steps of kPair, each step loading `n`
  // elements of x (kPair, or fewer at a row's end, as ForEachPair's step).
  template <int Q, bool kSumSq, typename Count>
  ATTNRES_INLINE static void DotsSpan(const T* x, const T* ahead, const A* const* rows,
                                      int64_t d_begin, int64_t d_end, Count n, A* sums) {
    constexpr int kSums = kSumSq ? Q + 1 : Q;
    V acc[kSums][2];
    for (int q = 0; q < kSums; ++q) {
      for (int h = 0; h < 2; ++h) {
        acc[q][h] = d_begin != 0 ? LoadA(sums + (2 * q + h) * kLanes) : Splat(A(0));
      }
    }
    for (int64_t d = d_begin; d < d_end; d += kPair) {
      if (ahead != nullptr) R::template PrefetchSpan<kPair, 2>(ahead + d);
      V lo, hi;
      R::Load2(x + d, n, lo, hi);
      if (kSumSq) {
        acc[Q][0] += lo * lo;
        acc[Q][1] += hi * hi;
      }
      for (int q = 0; q < Q; ++q) {
        acc[q][0] += lo * LoadA(rows[q] + d);
        acc[q][1] += hi * LoadA(rows[q] + d + kLanes);
      }
    }
    for (int q = 0; q < kSums; ++q) {
      for (int h = 0; h < 2; ++h) StoreA(sums + (2 * q + h) * kLanes, acc[q][h]);
    }
  }

  // The total of running sum k of `sums`.
  static A Total(const A* sums, int k) {
    return Sum(LoadA(sums + 2 * k * kLanes) + LoadA(sums + (2 * k + 1) * kLanes));
  }

  // sum(x^2) and dot(wg, x) of one whole row.
  static void RowDots(const T* x, const A* wg, int64_t dim, A* sum_sq, A* dot) {
    A sums[4 * kLanes];
    GroupDots<1, true>(x, nullptr, &wg, 0, dim, dim, sums);
    *dot = Total(sums, 0);
    *sum_sq = Total(sums, 1);
  }

  // For the Q queries of a group: sum_i weights[q][i] v_i over the n rows `src`,
  // stored to the rows out[q] of T (kToA false) or added to the rows of A (kToA).
  // Normal stores: non-temporal ones for phase 1's outputs gain nothing at small S
  // and are much slower from S = 7 on, or when a token's outputs take more than one
  // group.
  template <int Q, bool kToA>
  [[gnu::noinline]] static void GroupMix(const T* const* src, int64_t n, const A* const* weights,
                                         void* const* out, int64_t dim) {
    R::ForEachPair(0, dim, dim, [&](int64_t d, auto m) ATTNRES_INLINE {
      V acc[Q][2] = {};
      for (int64_t i = 0; i < n; ++i) {
        V lo, hi;
        R::Load2(src[i] + d, m, lo, hi);
        for (int q = 0; q < Q; ++q) {
          const V w = Splat(weights[q][i]);
          acc[q][0] += w * lo;
          acc[q][1] += w * hi;
        }
      }
      for (int q = 0; q < Q; ++q) {
        if (kToA) {
          A* u = static_cast<A*>(out[q]) + d;
          StoreA(u, LoadA(u) + acc[q][0]);
          StoreA(u + kLanes, LoadA(u + kLanes) + acc[q][1]);
        } else {
          R::Store2(static_cast<T*>(out[q]) + d, acc[q][0], acc[q][1], m);
        }
      }
    });
  }

  template <bool kToA>
  static void Mix(const T* const* src, int64_t n, const A* const* weights, void* const* out,
                  int64_t count, int64_t dim) {
    for (int64_t k = 0; k < count; k += kGroup) {
      WithGroupSize(std::min<int64_t>(kGroup, count - k), [&](auto group) {
        GroupMix<decltype(group)::value, kToA>(src, n, weights + k, out + k, dim);
      });
    }
  }

  // dv_i = b_i v_i + sum_s (alpha_{s,i} g_s + c_{s,i} u_s) (+ dv_i when kAccumulate)
  // for the Q block rows i0 .. i0 + Q - 1 (v, dv, b offset to i0; alpha, c are [S, n]
  // offset to column i0; dv[j] null: row j not wanted, its sums are dropped), over
  // the elements [d_begin, d_end) (as ForEachChunk's range), the rows g_s and u_s of
  // A being `padded` apart. Runs of kGradVectors vectors outermost: within a tile of
  // SourceGrads, every group of rows after the first reads g_s and u_s from L1.
  // Each run of g_s and u_s loaded serves the Q rows, with the weights broadcast
  // from memory: 2Q + 2K loads for 2QK multiply-adds (K vectors per run: 0.5 loads
  // per multiply-add at Q = K = 4), where one row and pair at a time took 2, and
  // this core sustains about one vector load per cycle against two multiply-adds.
  // kStream: every wanted dv row is aligned for StoreStream2 (and not accumulated into).
  static constexpr int kGradVectors = kVectorBytes == 64 ? 4 : 2;
  template <int Q, bool kAccumulate, bool kStream>
  [[gnu::noinline]] static void GroupSourceGrads(T* const* dv, const T* const* v, const A* b,
                                                 const A* g, const A* u, int64_t padded,
                                                 const A* alpha, const A* c, int64_t count,
                                                 int64_t n, int64_t d_begin, int64_t d_end,
                                                 int64_t dim) {
    static_assert(!(kAccumulate && kStream));
    const auto run = [&](int64_t d, auto vectors, int64_t m) ATTNRES_INLINE {
      constexpr int K = decltype(vectors)::value;
      V acc[Q][K];
      for (int j = 0; j < Q; ++j) {
        R::template LoadChunk<K>(v[j] + d, m, acc[j]);
        const V vb = Splat(b[j]);
        for (int k = 0; k < K; ++k) acc[j][k] *= vb;
      }
      for (int64_t s = 0; s < count; ++s) {
        V gs[K], us[K];
        for (int k = 0; k < K; ++k) {
          gs[k] = R::LoadAOnce(g + s * padded + d + k * kLanes);
          us[k] = R::LoadAOnce(u + s * padded + d + k * kLanes);
        }
        for (int j = 0; j < Q; ++j) {
          const V va = Splat(alpha[s * n + j]), vc = Splat(c[s * n + j]);
          for (int k = 0; k < K; ++k) acc[j][k] += va * gs[k];
          for (int k = 0; k < K; ++k) acc[j][k] += vc * us[k];
        }
      }
      for (int j = 0; j < Q; ++j) {
        if (dv[j] == nullptr) continue;
        if (kAccumulate) {
          V old[K];
          R::template LoadChunk<K>(dv[j] + d, m, old);
          for (int k = 0; k < K; ++k) acc[j][k] += old[k];
        }
        R::template StoreChunk<K>(dv[j] + d, acc[j], m, kStream);
      }
    };
    if constexpr (kGradVectors == R::kChunkVectors) {
      R::ForEachChunk(d_begin, d_end, dim, run);
    } else {
      R::ForEachPair(d_begin, d_end, dim, [&](int64_t d, auto m) ATTNRES_INLINE {
        run(d, std::integral_constant<int, 2>{}, m);
      });
    }
  }

  // GroupSourceGrads over the n rows in groups of at most kGradRows (the registers of
  // AVX-512 hold 4 rows' sums, those of 16-register ISAs 2), as even as they go (9
  // rows: 3 + 3 + 3, not 4 + 4 + 1: a group of one row loads twice as much per
  // multiply-add), skipping groups with no row wanted. Tiles of the rows outermost,
  // sized so that the tiles of the 2 * count rows g_s and u_s (24 KB) stay in L1 for
  // every group: whole, those rows (110 KB at S = 6, D = 2304) would come from L2
  // once per group. At least 4 chunks per tile: fewer (S = 24 allows 2 in 24 KB)
  // are slower.
  template <bool kAccumulate, bool kStream>
  static void SourceGrads(T* const* dv, const T* const* v, const A* b, const A* g, const A* u,
                          int64_t padded, const A* alpha, const A* c, int64_t count, int64_t n,
                          int64_t dim) {
    constexpr int kGradRows = kVectorBytes == 64 ? 4 : 2;
    constexpr int64_t kTileBytes = 24 * 1024;
    const int64_t tile = std::max<int64_t>(
        4, kTileBytes / (2 * count * static_cast<int64_t>(sizeof(A))) / R::kChunkElems) *
        R::kChunkElems;
    for (int64_t d = 0; d < dim; d += tile) {
      const int64_t d_end = std::min(d + tile, dim);
      for (int64_t i = 0, groups = (n + kGradRows - 1) / kGradRows; i < n; --groups) {
        const int64_t rows = (n - i + groups - 1) / groups;
        if (std::any_of(dv + i, dv + i + rows, [](const T* p) { return p != nullptr; })) {
          WithGroupSize<kGradRows>(rows, [&](auto group) {
            GroupSourceGrads<decltype(group)::value, kAccumulate, kStream>(
                dv + i, v + i, b + i, g, u, padded, alpha + i, c + i, count, n, d, d_end, dim);
          });
        }
        i += rows;
      }
    }
  }
};

template <typename T>
const T* RowOf(const void* base, int64_t t, int64_t stride) {
  return static_cast<const T*>(base) + t * stride;
}

// One thread's scratch (kernel_table.h: PhaseScratchBytes), carved in order.
template <typename T>
struct PhaseScratch {
  using A = typename Row<T>::A;
  const A** rows;     // [2S]: the u_s rows, then the g_s rows (backward)
  const A** weights;  // [S]: per query, its N weights a_{s,i} (or c_{s,i})
  void** outs;        // [S]: output rows of T, or U_s rows of A
  const T** src;      // [N]: this token's block rows
  T** dv;             // [N]: this token's block gradient rows (null: not wanted)
  const T** later;    // [S]: the next token's grad_out rows (backward; null: none)
  A* g;               // [S, padded_dim]: the grad_out rows, widened
  A *z, *a, *dz;      // [S, N], query-major
  A *r, *b;           // [N]
  A* sums;            // [N, kPhaseGroupSumsBytes]: GroupDots' running sums per block row

  PhaseScratch(void* base, int64_t S, int64_t N, int64_t padded) {
    char* bytes = static_cast<char*>(base);
    const int64_t pointer = sizeof(void*);
    rows = reinterpret_cast<const A**>(bytes);
    weights = reinterpret_cast<const A**>(bytes + 2 * S * pointer);
    outs = reinterpret_cast<void**>(bytes + 3 * S * pointer);
    src = reinterpret_cast<const T**>(bytes + 4 * S * pointer);
    dv = reinterpret_cast<T**>(bytes + (4 * S + N) * pointer);
    later = reinterpret_cast<const T**>(bytes + (4 * S + 2 * N) * pointer);
    const int64_t pointer_bytes = (5 * S + 2 * N) * pointer;
    sums = reinterpret_cast<A*>(bytes + (pointer_bytes + 63) / 64 * 64);
    g = sums + N * kPhaseGroupSumsBytes / static_cast<int64_t>(sizeof(A));
    z = g + S * padded;
    a = z + S * N;
    dz = a + S * N;
    r = dz + S * N;
    b = r + N;
  }
};

// ---- Phase 1 ----------------------------------------------------------------

// Asks for lines [begin, end) of `rows` (row_lines lines each, counted row after
// row; line k of a row is the one holding byte min(64 k, row_bytes - 1)) into L2.
template <typename T>
void PrefetchLines(const T* const* rows, int64_t row_lines, int64_t row_bytes, int64_t begin,
                   int64_t end) {
  for (int64_t line = begin; line < end; ++line) {
    const char* row = reinterpret_cast<const char*>(rows[line / row_lines]);
    if (row != nullptr) __builtin_prefetch(row + std::min(line % row_lines * 64, row_bytes - 1), 0, 2);
  }
}

// Pass 1 of token t: r_i and z_{s,i} for every block i, with the backward's
// dot(g_s, v_i) into dz when rows holds the g rows after the u rows (num_rows = 2S).
// The rows of a group of queries (S rows of A: 55 KB at S = 6, D = 2304 fp32) do not
// fit in L1 beside the blocks, and would be read from L2 once per block row: so the
// blocks are read a tile of kTile elements at a time, every block's tile with the
// group's tile of the rows from L1, each block's sums kept in `ws.sums` between
// tiles (the same sums in the same order as whole rows). The first group also asks
// for token t + 1's rows when it is below `end`, this chunk's end, and the last
// spreads over its calls the requests for the S rows `later` (the backward: token
// t + 1's gradient rows; null: none), a share of their lines per call.
template <typename T>
void Phase1Logits(const PhaseInfo& info, int64_t t, int64_t end, int64_t num_rows,
                  const T* const* later, PhaseScratch<T>& ws) {
  using R = PhaseRow<T>;
  using A = typename R::A;
  constexpr int64_t kTile = 16 * R::kPair;
  constexpr int64_t kSumsStride = kPhaseGroupSumsBytes / sizeof(A);
  static_assert((kGroup + 1) * 2 * kVectorBytes <= kPhaseGroupSumsBytes);
  const int64_t S = info.num_queries, N = info.num_blocks, dim = info.dim;
  const A scale = static_cast<A>(info.scale), eps = static_cast<A>(info.eps);
  const int64_t stride = info.source_row_stride;
  for (int64_t i = 0; i < N; ++i) ws.src[i] = RowOf<T>(info.blocks[i], t, stride);
  // A row that does not start on a line spans one line more.
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  bool misaligned = false;
  for (int64_t s = 0; later != nullptr && s < S; ++s) {
    misaligned = misaligned || reinterpret_cast<uintptr_t>(later[s]) % 64 != 0;
  }
  const int64_t row_lines = (row_bytes + 63) / 64 + (misaligned ? 1 : 0);
  const int64_t calls = (dim + kTile - 1) / kTile * N;
  // At most kMaxLinesPerCall requests per call, or none: asking for all of the next
  // token's rows when they are many (344 KB at S = 24, D = 7168) slows the backward
  // (the token's own rows, 1.5 MB there, are in L2 too).
  constexpr int64_t kMaxLinesPerCall = 16;
  const int64_t later_lines = S * row_lines;
  if (later_lines > kMaxLinesPerCall * calls) later = nullptr;
  for (int64_t k = 0; k < num_rows; k += kGroup) {
    const bool first = k == 0, last = k + kGroup >= num_rows;
    WithGroupSize(std::min<int64_t>(kGroup, num_rows - k), [&](auto group) {
      constexpr int Q = decltype(group)::value;
      int64_t call = 0;
      for (int64_t d = 0; d < dim; d += kTile) {
        const int64_t d_end = std::min(d + kTile, dim);
        for (int64_t i = 0; i < N; ++i, ++call) {
          if (last && later != nullptr) {
            PrefetchLines(later, row_lines, row_bytes, later_lines * call / calls,
                          later_lines * (call + 1) / calls);
          }
          A* sums = ws.sums + i * kSumsStride;
          if (first) {
            const T* ahead = t + 1 < end ? ws.src[i] + stride : nullptr;
            R::template GroupDots<Q, true>(ws.src[i], ahead, ws.rows, d, d_end, dim, sums);
          } else {
            R::template GroupDots<Q, false>(ws.src[i], nullptr, ws.rows + k, d, d_end, dim, sums);
          }
        }
      }
      for (int64_t i = 0; i < N; ++i) {
        const A* sums = ws.sums + i * kSumsStride;
        if (first) ws.r[i] = info.rmsnorm ? math::Rms(R::Total(sums, Q), dim, eps) : A(1);
        for (int j = 0; j < Q; ++j) {
          const int64_t s = k + j;
          const A dot = R::Total(sums, j);
          if (s < S) {
            ws.z[s * N + i] = scale * (dot / ws.r[i]);
          } else {
            ws.dz[(s - S) * N + i] = dot;
          }
        }
      }
    });
  }
}

// lse_s of one token, and a_{s,i} = exp(z_{s,i} - lse_s) into ws.a.
template <typename T>
typename Row<T>::A Phase1Weights(PhaseScratch<T>& ws, int64_t s, int64_t N) {
  using A = typename Row<T>::A;
  const A lse = math::LogSumExp(ws.z + s * N, N);
  for (int64_t i = 0; i < N; ++i) ws.a[s * N + i] = math::Exp(ws.z[s * N + i] - lse);
  return lse;
}

template <typename T>
void Phase1Forward(const PhaseInfo& info, void* scratch, void*, int64_t begin, int64_t end) {
  using A = typename Row<T>::A;
  const int64_t S = info.num_queries, N = info.num_blocks, padded = info.padded_dim;
  PhaseScratch<T> ws(scratch, S, N, padded);
  for (int64_t s = 0; s < S; ++s) {
    ws.rows[s] = static_cast<const A*>(info.wg) + s * padded;
    ws.weights[s] = ws.a + s * N;
  }
  for (int64_t t = begin; t < end; ++t) {
    Phase1Logits<T>(info, t, end, S, nullptr, ws);
    for (int64_t s = 0; s < S; ++s) {
      static_cast<A*>(info.query_lses[s])[t] = Phase1Weights(ws, s, N);
      ws.outs[s] = static_cast<T*>(info.query_outs[s]) + t * info.out_row_stride;
    }
    PhaseRow<T>::template Mix<false>(ws.src, N, ws.weights, ws.outs, S, info.dim);
  }
}

template <typename T>
void Phase1Backward(const PhaseInfo& info, void* scratch, void* partials, int64_t begin,
                    int64_t end) {
  using R = PhaseRow<T>;
  using A = typename R::A;
  const int64_t S = info.num_queries, N = info.num_blocks, padded = info.padded_dim, dim = info.dim;
  const A scale = static_cast<A>(info.scale);
  PhaseScratch<T> ws(scratch, S, N, padded);
  bool stream = info.stream_stores && info.grad_blocks != nullptr;
  for (int64_t i = 0; stream && i < N; ++i) {
    stream = info.grad_blocks[i] == nullptr ||
             RowsStreamable<T>(info.grad_blocks[i], info.grad_source_row_stride);
  }
  for (int64_t s = 0; s < S; ++s) {
    ws.rows[s] = static_cast<const A*>(info.wg) + s * padded;
    ws.rows[S + s] = ws.g + s * padded;
    ws.weights[s] = ws.dz + s * N;  // c_{s,i}, for U_s
    ws.outs[s] = partials != nullptr ? static_cast<A*>(partials) + s * padded : nullptr;
  }
  const auto grad_row = [&](int64_t s, int64_t t) -> const T* {
    return info.grad_query_outs[s] != nullptr
               ? RowOf<T>(info.grad_query_outs[s], t, info.grad_out_row_stride)
               : nullptr;
  };
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      if (const T* g = grad_row(s, t); g != nullptr) {
        R::Widen(ws.g + s * padded, g, dim);
      } else {
        std::memset(ws.g + s * padded, 0, padded * sizeof(A));
      }
      // Asked for a token ahead (Phase1Logits): read from memory on demand, these
      // rows would stall the backward.
      ws.later[s] = t + 1 < end ? grad_row(s, t + 1) : nullptr;
    }
    Phase1Logits<T>(info, t, end, 2 * S, ws.later, ws);
    for (int64_t i = 0; i < N; ++i) ws.b[i] = 0;
    for (int64_t s = 0; s < S; ++s) {
      Phase1Weights(ws, s, N);
      const A* lse_grad = info.grad_query_lses != nullptr
                              ? static_cast<const A*>(info.grad_query_lses[s])
                              : nullptr;
      const A e = lse_grad != nullptr ? lse_grad[t] : A(0);
      A* dz = ws.dz + s * N;  // dot(g_s, v_i) in, dz_{s,i} out
      math::SoftmaxBackward(ws.a + s * N, dz, N, e, dz);
      for (int64_t i = 0; i < N; ++i) {
        const math::KeyChain<A> chain =
            math::KeyGradient(ws.z[s * N + i], ws.r[i], scale, dim, info.rmsnorm != 0);
        ws.b[i] += dz[i] * chain.b;
        dz[i] *= chain.a;  // c_{s,i}
      }
    }
    if (info.grad_blocks != nullptr) {
      for (int64_t i = 0; i < N; ++i) {
        ws.dv[i] = info.grad_blocks[i] != nullptr
                       ? static_cast<T*>(info.grad_blocks[i]) + t * info.grad_source_row_stride
                       : nullptr;
      }
      const auto grads = info.accumulate_grads ? R::template SourceGrads<true, false>
                         : stream             ? R::template SourceGrads<false, true>
                                              : R::template SourceGrads<false, false>;
      grads(ws.dv, ws.src, ws.b, ws.g, static_cast<const A*>(info.wg), padded, ws.a, ws.dz, S,
            N, dim);
    }
    if (partials != nullptr) R::template Mix<true>(ws.src, N, ws.weights, ws.outs, S, dim);
  }
  if (stream) R::FenceStreams();
}

// ---- Phase 2 ----------------------------------------------------------------

// One token of phase 2: its rows and merge weight.
template <typename T>
struct MergeToken {
  using A = typename Row<T>::A;
  const T* o;
  const T* p;  // null: no partial block (h = o)
  A beta = 1, keep = 0, z = 0, r = 1;  // keep = 1 - beta, formed on its own (token_math.h)

  // With the fused update, p is the row of new_partial, which the caller has written.
  MergeToken(const PhaseInfo& info, int64_t t) {
    o = RowOf<T>(info.query_out, t, info.source_row_stride);
    p = info.partial_update != nullptr ? RowOf<T>(info.new_partial, t, info.out_row_stride)
        : info.partial != nullptr      ? RowOf<T>(info.partial, t, info.source_row_stride)
                                       : nullptr;
    if (p == nullptr) return;
    const A* wg = static_cast<const A*>(info.wg);
    A sum_sq = 0, dot = 0;
    PhaseRow<T>::RowDots(p, wg, info.dim, &sum_sq, &dot);
    r = info.rmsnorm ? math::Rms(sum_sq, info.dim, static_cast<A>(info.eps)) : A(1);
    z = static_cast<A>(info.scale) * (dot / r);
    const math::MergeWeights<A> weights = math::MergeWeightsOf(static_cast<const A*>(info.query_lse)[t], z);
    beta = weights.beta;
    keep = weights.keep;
  }

  // h over the pair of vectors at d.
  void H(int64_t d, int64_t dim, typename Row<T>::V& lo, typename Row<T>::V& hi) const {
    using R = Row<T>;
    R::Load2(o + d, dim - d, lo, hi);
    if (p == nullptr) return;
    typename R::V p_lo, p_hi;
    R::Load2(p + d, dim - d, p_lo, p_hi);
    const auto vb = R::Splat(beta), vp = R::Splat(keep);
    lo = vb * lo + vp * p_lo;
    hi = vb * hi + vp * p_hi;
  }
};

template <typename T>
void Phase2Forward(const PhaseInfo& info, void*, void*, int64_t begin, int64_t end) {
  using R = Row<T>;
  using A = typename R::A;
  using V = typename R::V;
  const int64_t dim = info.dim, kLanes = R::kLanes;
  const A* nw = static_cast<const A*>(info.norm_weight);
  for (int64_t t = begin; t < end; ++t) {
    if (info.partial_update != nullptr) {  // p' = partial + y, rounded to T, read back below
      const T* p = RowOf<T>(info.partial, t, info.source_row_stride);
      const T* y = RowOf<T>(info.partial_update, t, info.source_row_stride);
      T* p_new = static_cast<T*>(info.new_partial) + t * info.out_row_stride;
      for (int64_t d = 0; d < dim; d += R::kPair) {
        V p_lo, p_hi, y_lo, y_hi;
        R::Load2(p + d, dim - d, p_lo, p_hi);
        R::Load2(y + d, dim - d, y_lo, y_hi);
        R::Store2(p_new + d, p_lo + y_lo, p_hi + y_hi, dim - d);
      }
    }
    const MergeToken<T> tok(info, t);
    T* out = static_cast<T*>(info.out) + t * info.out_row_stride;
    V scale = R::Splat(A(1));
    if (info.input_norm) {
      V sq0{}, sq1{};
      for (int64_t d = 0; d < dim; d += R::kPair) {
        V lo, hi;
        tok.H(d, dim, lo, hi);
        sq0 += lo * lo;
        sq1 += hi * hi;
      }
      scale = R::Splat(A(1) / math::Rms(R::Sum(sq0 + sq1), dim, static_cast<A>(info.norm_eps)));
    }
    for (int64_t d = 0; d < dim; d += R::kPair) {
      V lo, hi;
      tok.H(d, dim, lo, hi);
      if (info.input_norm) {
        lo = lo * scale * R::LoadA(nw + d);
        hi = hi * scale * R::LoadA(nw + d + kLanes);
      }
      R::Store2(out + d, lo, hi, dim - d);
    }
  }
}

// Phase 2 backward, per token (g = dL/dout):
//   with input_norm  h' = h / r_h,  dh = (g nw - h' dot(g nw, h') / dim) / r_h,
//                    dnorm_weight += g h'
//   do = beta dh,  dbeta = dot(dh, o - p),  dlse = dbeta beta keep,  dz_p = -dlse
//   dp = keep dh + c u + b p  (c, b: the key chain of z_p),  U += c p
//   plus grad_partial_in when given (what p receives from its other uses)
// Three passes over the token's rows (in L1): p's RMS and logit (MergeToken); the
// sums that fix every scalar: r_h, dot(g nw, h) and, by linearity of dh in g nw and h,
// dbeta = (dot(g nw, o - p) - dot(h, o - p) dot(g nw, h') / (dim r_h)) / r_h; then
// every output row, reading each input row once.
template <typename T>
class Phase2Grads {
  using R = Row<T>;
  using A = typename R::A;
  using V = typename R::V;
  static constexpr int64_t kLanes = R::kLanes;

 public:
  Phase2Grads(const PhaseInfo& info, void* partials)
      : info_(info), dim_(info.dim), norm_(info.input_norm != 0),
        nw_(static_cast<const A*>(info.norm_weight)), wg_(static_cast<const A*>(info.wg)),
        u_sum_(partials != nullptr ? static_cast<A*>(partials) : nullptr),
        nw_sum_(partials != nullptr && norm_ ? static_cast<A*>(partials) + info.padded_dim
                                             : nullptr) {}

  // Every output of token t.
  ATTNRES_INLINE void Token(int64_t t) const {
    const MergeToken<T> tok(info_, t);
    const bool merge = tok.p != nullptr;
    const T* g = RowOf<T>(info_.grad_out, t, info_.grad_out_row_stride);
    const T* g_in = info_.grad_partial_in != nullptr
                        ? RowOf<T>(info_.grad_partial_in, t, info_.grad_out_row_stride)
                        : nullptr;
    const Scalars sc = TokenScalars(tok, g);
    const A beta = tok.beta;
    const A dlse = sc.dbeta * (beta * tok.keep);
    if (info_.grad_query_lse != nullptr) static_cast<A*>(info_.grad_query_lse)[t] = dlse;

    T* grad_o = info_.grad_query_out != nullptr
                    ? static_cast<T*>(info_.grad_query_out) + t * info_.grad_source_row_stride
                    : nullptr;
    T* grad_p = merge && info_.grad_partial != nullptr
                    ? static_cast<T*>(info_.grad_partial) + t * info_.grad_source_row_stride
                    : nullptr;
    A* u = merge ? u_sum_ : nullptr;
    if (grad_o == nullptr && grad_p == nullptr && u == nullptr && nw_sum_ == nullptr) return;
    const math::KeyChain<A> chain =
        merge ? math::KeyGradient(tok.z, tok.r, static_cast<A>(info_.scale), dim_,
                                  info_.rmsnorm != 0)
              : math::KeyChain<A>{0, 0};
    WriteRows(tok, g, g_in, grad_o, grad_p, u, sc, beta, dlse, chain);
  }

 private:
  // What the row sums fix: 1 / r_h, k = dot(gn, h) / (dim r_h^2) (1 and 0 without
  // the norm), and dbeta.
  struct Scalars {
    A inv_r, k, dbeta;
  };

  // g, or g * norm_weight with the input norm, over the pair at d.
  ATTNRES_INLINE void LoadG(const T* g, int64_t d, V& lo, V& hi) const {
    R::Load2(g + d, dim_ - d, lo, hi);
    if (!norm_) return;
    lo = lo * R::LoadA(nw_ + d);
    hi = hi * R::LoadA(nw_ + d + kLanes);
  }

  // The second pass: sums over the row (gn = g nw, or g) of h^2, gn h, gn (o - p)
  // and h (o - p), then the scalars they fix.
  ATTNRES_INLINE Scalars TokenScalars(const MergeToken<T>& tok, const T* g) const {
    const bool merge = tok.p != nullptr;
    V hh[2] = {}, gh[2] = {}, gd[2] = {}, hd[2] = {};
    if (norm_ || merge) {
      for (int64_t d = 0; d < dim_; d += R::kPair) {
        V h[2], gn[2];
        tok.H(d, dim_, h[0], h[1]);
        LoadG(g, d, gn[0], gn[1]);
        V diff[2] = {};
        if (merge) {
          V o[2], p[2];
          R::Load2(tok.o + d, dim_ - d, o[0], o[1]);
          R::Load2(tok.p + d, dim_ - d, p[0], p[1]);
          diff[0] = o[0] - p[0];
          diff[1] = o[1] - p[1];
        }
        for (int k = 0; k < 2; ++k) {
          if (norm_) {
            hh[k] += h[k] * h[k];
            gh[k] += gn[k] * h[k];
          }
          if (merge) {
            gd[k] += gn[k] * diff[k];
            if (norm_) hd[k] += h[k] * diff[k];
          }
        }
      }
    }
    // dh = (gn - h k) r with r = 1 / r_h; without the norm dh = g (r = 1, k = 0).
    A inv_r = 1, k = 0;
    if (norm_) {
      inv_r = A(1) / math::Rms(R::Sum(hh[0] + hh[1]), dim_, static_cast<A>(info_.norm_eps));
      k = R::Sum(gh[0] + gh[1]) * inv_r * inv_r / static_cast<A>(dim_);
    }
    const A dbeta = merge ? (R::Sum(gd[0] + gd[1]) - k * R::Sum(hd[0] + hd[1])) * inv_r : A(0);
    return Scalars{inv_r, k, dbeta};
  }

  // The third pass: every output row, reading each input row once.
  ATTNRES_INLINE void WriteRows(const MergeToken<T>& tok, const T* g, const T* g_in, T* grad_o,
                                T* grad_p, A* u, const Scalars& sc, A beta, A dlse,
                                const math::KeyChain<A>& chain) const {
    const V vr = R::Splat(sc.inv_r), vk = R::Splat(sc.k), vbeta = R::Splat(beta);
    const V vkeep = R::Splat(tok.keep);
    const V vc = R::Splat(-dlse * chain.a), vb = R::Splat(-dlse * chain.b);
    for (int64_t d = 0; d < dim_; d += R::kPair) {
      V h[2] = {}, dh[2];
      if (norm_) tok.H(d, dim_, h[0], h[1]);
      LoadG(g, d, dh[0], dh[1]);
      if (norm_) {
        for (int j = 0; j < 2; ++j) dh[j] = (dh[j] - h[j] * vk) * vr;
      }
      if (grad_o != nullptr) R::Store2(grad_o + d, vbeta * dh[0], vbeta * dh[1], dim_ - d);
      if (nw_sum_ != nullptr) {  // dnorm_weight += g h / r_h
        V g_lo, g_hi;
        R::Load2(g + d, dim_ - d, g_lo, g_hi);
        R::StoreA(nw_sum_ + d, R::LoadA(nw_sum_ + d) + g_lo * h[0] * vr);
        R::StoreA(nw_sum_ + d + kLanes, R::LoadA(nw_sum_ + d + kLanes) + g_hi * h[1] * vr);
      }
      if (grad_p == nullptr && u == nullptr) continue;
      V p[2];
      R::Load2(tok.p + d, dim_ - d, p[0], p[1]);
      if (u != nullptr) {
        R::StoreA(u + d, R::LoadA(u + d) + vc * p[0]);
        R::StoreA(u + d + kLanes, R::LoadA(u + d + kLanes) + vc * p[1]);
      }
      if (grad_p == nullptr) continue;
      V dp[2];
      for (int j = 0; j < 2; ++j) {
        dp[j] = vkeep * dh[j] + vc * R::LoadA(wg_ + d + j * kLanes) + vb * p[j];
      }
      if (g_in != nullptr) {
        V in_lo, in_hi;
        R::Load2(g_in + d, dim_ - d, in_lo, in_hi);
        dp[0] += in_lo;
        dp[1] += in_hi;
      }
      R::Store2(grad_p + d, dp[0], dp[1], dim_ - d);
    }
  }

  const PhaseInfo& info_;
  const int64_t dim_;
  const bool norm_;
  const A* nw_;
  const A* wg_;
  A* u_sum_;   // U, or null
  A* nw_sum_;  // the norm weight's sum, or null
};

template <typename T>
void Phase2Backward(const PhaseInfo& info, void*, void* partials, int64_t begin, int64_t end) {
  const Phase2Grads<T> grads(info, partials);
  for (int64_t t = begin; t < end; ++t) grads.Token(t);
}

}  // namespace

namespace ATTNRES_ISA {
extern const PhaseKernels kTwoPhaseKernels = {
    ATTNRES_BY_DTYPE(Phase1Forward),
    ATTNRES_BY_DTYPE(Phase1Backward),
    ATTNRES_BY_DTYPE(Phase2Forward),
    ATTNRES_BY_DTYPE(Phase2Backward),
};
}  // namespace ATTNRES_ISA

}  // namespace attnres::cpu
