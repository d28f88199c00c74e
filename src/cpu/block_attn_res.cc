// Block AttnRes CPU kernels (the single op): forward and backward of a range of
// tokens.
//
// Compiled once per ISA (CMakeLists.txt: ATTNRES_ISAS, each with its -march flags;
// the SIMD building blocks are in simd-inl.h) and backend.cc picks one variant at
// run time. Everything is in an unnamed namespace: no inline function of one
// variant may be merged into another.
//
// Per token, with L sources v_i of D elements and wg = w * gamma, a tile of tokens
// is done in two passes:
//   pass 1 - reads every source row of the tile once from memory, source by source
//            (all of the tile's rows of source 0, then of source 1, ...), each row
//            prefetching the next; it computes sum(v^2), dot(wg, v) and, in the
//            backward, dot(g, v); long rows a span at a time, every row's span in
//            turn (kernel_table.h: PassOneSpan). A tile is small (backend.cc:
//            k*TileSourceBytes) so that pass 2 finds its rows in L1/L2.
//   then   - the softmax (forward) or its backward, a few scalars per source;
//   pass 2 - token by token, rereads the tile's sources from cache, a chunk of a few
//            vectors of every source at a time with the sums in registers:
//            forward  out = sum_i alpha_i v_i, written once;
//            backward dv_i = alpha_i g + a_i wg + b_i v_i written once per source,
//                     and U += sum_i a_i v_i (dw = gamma U, dgamma = w U).
//            Nothing but the outputs is stored: an accumulator row in memory would
//            be read and written once per source (3x the source bytes in cache
//            traffic).
// The backward overlaps the two: pass 1 of the next tile runs inside pass 2 of
// this one (BackwardPipeline).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/token_math.h"
#include "cpu/kernel_table.h"
#include "cpu/simd-inl.h"

namespace attnres::cpu {
namespace {

// The rows of the block op: Row plus its two pass-2 loops.
template <typename T>
struct BlockRow : Row<T> {
  using R = Row<T>;
  using typename R::A;
  using typename R::V;
  using R::kLanes;
  using R::ForEachChunk;
  using R::LoadA;
  using R::Splat;
  using R::StoreA;

  // Pass 2 reads only from cache, so memory would idle while it computes: it asks
  // for the rows that pass 1 of this thread's next tile reads, at the pace and
  // positions it reads its own (token j's chunk d of source i: the next tile's
  // token j, chunk d of source i), into L2; the row's last chunk asks for its
  // last line too. `prefetch_offset` < 0: none.
  template <int K>
  static void PrefetchChunk(const void* source, int64_t prefetch_offset, int64_t d, int64_t dim) {
    if (prefetch_offset < 0) return;
    const T* p = static_cast<const T*>(source) + prefetch_offset;
    R::template PrefetchSpan<K * kLanes, 2>(p + d);
    if (d + K * kLanes >= dim) R::template PrefetchRowEnd<2>(p, dim);
  }

  // Forward pass 2 of one token: out = sum_i alpha_i v_i over the L source rows at
  // `offset` elements into each source, a chunk of every row at a time, the sum in
  // registers. `stream`: out is aligned for StoreStream2.
  [[gnu::noinline]] static void WeightedSum(T* out, const void* const* sources, int64_t offset,
                                            int64_t prefetch_offset, const A* alpha,
                                            int64_t num_sources, int64_t dim, bool stream) {
    ForEachChunk(0, dim, dim, [&](int64_t d, auto vectors, int64_t n) ATTNRES_INLINE {
      constexpr int K = decltype(vectors)::value;
      V sum[K] = {};
      for (int64_t i = 0; i < num_sources; ++i) {
        BlockRow::template PrefetchChunk<K>(sources[i], prefetch_offset, d, dim);
        const T* x = static_cast<const T*>(sources[i]) + offset + d;
        const V weight = Splat(alpha[i]);
        V xv[K];
        R::template LoadChunk<K>(x, n, xv);
        for (int k = 0; k < K; ++k) sum[k] += weight * xv[k];
      }
      R::template StoreChunk<K>(out + d, sum, n, stream);
    });
  }

  // Backward pass 2 of elements [d_begin, d_end) (as ForEachChunk) of one token:
  // dv_i = alpha_i g + a_i wg + b_i v_i for every source i with a gradient row
  // (kWrite; grad_sources[i] may be null), and u += sum_i a_i v_i (kAccumulateU).
  // Sources are read at `offset` elements, their gradients written at
  // `grad_offset`; g, wg and the chunk's U stay in registers across the sources.
  // kStream: every gradient row is aligned for StoreStream2.
  template <bool kWrite, bool kAccumulateU, bool kStream>
  [[gnu::noinline]] static void SourceGrads(void* const* grad_sources, int64_t grad_offset,
                                            const void* const* sources, int64_t offset,
                                            int64_t prefetch_offset, const A* g, const A* wg, const A* alpha,
                                            const A* a, const A* b, int64_t num_sources,
                                            A* u, int64_t d_begin, int64_t d_end, int64_t dim) {
    ForEachChunk(d_begin, d_end, dim, [&](int64_t d, auto vectors, int64_t n) ATTNRES_INLINE {
      constexpr int K = decltype(vectors)::value;
      V gv[K], wgv[K], uv[K] = {};
      for (int k = 0; k < K; ++k) {
        gv[k] = LoadA(g + d + k * kLanes);
        wgv[k] = LoadA(wg + d + k * kLanes);
      }
      for (int64_t i = 0; i < num_sources; ++i) {
        BlockRow::template PrefetchChunk<K>(sources[i], prefetch_offset, d, dim);
        const T* x = static_cast<const T*>(sources[i]) + offset + d;
        V xv[K];
        R::template LoadChunk<K>(x, n, xv);
        const V va = Splat(a[i]);
        if (kAccumulateU) {
          for (int k = 0; k < K; ++k) uv[k] += va * xv[k];
        }
        if (kWrite && grad_sources[i] != nullptr) {
          const V valpha = Splat(alpha[i]), vb = Splat(b[i]);
          V dv[K];
          for (int k = 0; k < K; ++k) dv[k] = valpha * gv[k] + va * wgv[k] + vb * xv[k];
          R::template StoreChunk<K>(static_cast<T*>(grad_sources[i]) + grad_offset + d, dv, n, kStream);
        }
      }
      if (kAccumulateU) {
        for (int k = 0; k < K; ++k) StoreA(u + d + k * kLanes, LoadA(u + d + k * kLanes) + uv[k]);
      }
    });
  }
};

template <typename A>
struct Stats {
  A* z = nullptr;      // [tile, L] logits; in backward pass 2, b_i
  A* r = nullptr;      // [tile, L] rms (1 without rmsnorm); in backward pass 2, a_i
  A* alpha = nullptr;  // [tile, L]
  A* ga = nullptr;     // [tile, L] dot(g, v_i) (backward)
  Stats() = default;
  Stats(void* base, int64_t tile, int64_t num_sources) {
    A* p = static_cast<A*>(base);
    const int64_t n = tile * num_sources;
    z = p; r = p + n; alpha = p + 2 * n; ga = p + 3 * n;
  }
};

// The first row of this thread's next tile under the static schedule (this tile's
// own when it is the last): what pass 1 prefetches after its last row.
template <typename T>
const T* NextTileRow(const CallInfo& info, int64_t begin, int64_t end) {
  return static_cast<const T*>(info.sources[0]) +
         (end < info.num_tokens ? end : begin) * info.source_row_stride;
}

// Where row j of this thread's next tile starts in every source (elements), or -1
// when there is no such row.
inline int64_t NextTileOffset(const CallInfo& info, int64_t begin, int64_t end, int64_t j) {
  const int64_t t = end + j;
  const bool in_next_tile = t < info.num_tokens && j < end - begin;
  return in_next_tile ? t * info.source_row_stride : -1;
}

template <typename T, bool kRmsNorm>
void ForwardTileImpl(const CallInfo& info, const Scratch& scratch, int64_t begin,
                     int64_t end) {
  using R = BlockRow<T>;
  using A = typename R::A;
  const int64_t dim = info.dim, L = info.num_sources;
  const int64_t n = end - begin;
  const A scale = static_cast<A>(info.scale), eps = static_cast<A>(info.eps);
  const A* wg = static_cast<const A*>(info.wg);
  Stats<A> st(scratch.stats, info.tile_tokens, L);

  // Pass 1: the logits, row by row in source-major order (row r: source r / n,
  // token r % n), rows longer than info.pass_one_span a span at a time, every row's
  // span in turn (so that the span of wg stays in L1). 16-bit rows go two per Dots
  // call, sharing its loads of wg: their widening makes the one-row loop load- and
  // shuffle-bound; fp32 rows, twice the bytes, go one at a time (pairs are slower
  // for them).
  const T* after_last = NextTileRow<T>(info, begin, end);
  const int64_t rows = L * n;
  const int64_t span = info.pass_one_span, spans = (dim + span - 1) / span;
  auto* carry = static_cast<typename R::V*>(scratch.carry);  // null when spans == 1
  const auto row = [&](int64_t r) {
    return r < rows ? static_cast<const T*>(info.sources[r / n]) + (begin + r % n) * info.source_row_stride
                    : after_last;
  };
  const auto logits = [&](int64_t k, int64_t r, auto row_count) {
    constexpr int kRows = decltype(row_count)::value;
    const int64_t d_begin = k * span, d_end = std::min(d_begin + span, dim);
    const T* x[kRows];
    const T* next[kRows];  // each row prefetches the row kRows after it in this span
    for (int q = 0; q < kRows; ++q) {
      x[q] = row(r + q);
      next[q] = r + kRows + q < rows || d_end == dim ? row(r + kRows + q) : x[q];
    }
    A sum_sq[kRows] = {}, dot[kRows];
    R::template Dots<kRows, kRmsNorm, false>(x, next, nullptr, wg, nullptr, d_begin, d_end, dim,
                                             spans > 1 ? carry + r * R::kDotsCarry : nullptr,
                                             sum_sq, dot, nullptr);
    if (d_end < dim) return;
    for (int q = 0; q < kRows; ++q) {
      const int64_t i = (r + q) / n, j = (r + q) % n;
      const A rms = kRmsNorm ? math::Rms(sum_sq[q], dim, eps) : A(1);
      st.z[j * L + i] = scale * (dot[q] / rms);
      st.r[j * L + i] = rms;
    }
  };
  for (int64_t k = 0; k < spans; ++k) {
    int64_t r = 0;
    if constexpr (sizeof(T) == 2) {
      for (; r + 2 <= rows; r += 2) logits(k, r, std::integral_constant<int, 2>{});
    }
    for (; r < rows; ++r) logits(k, r, std::integral_constant<int, 1>{});
  }

  // Softmax, caches, and pass 2: the weighted sum, token by token.
  T* out = static_cast<T*>(info.out);
  A* rms_cache = static_cast<A*>(info.rms_cache);
  A* alpha_cache = static_cast<A*>(info.alpha_cache);
  const bool stream = info.stream_stores && RowsStreamable<T>(out, info.out_row_stride);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = begin + j;
    A* alpha = st.alpha + j * L;
    math::Softmax(st.z + j * L, alpha, L);
    for (int64_t i = 0; i < L; ++i) {
      if (rms_cache != nullptr) rms_cache[t * L + i] = st.r[j * L + i];
      if (alpha_cache != nullptr) alpha_cache[t * L + i] = alpha[i];
    }
    R::WeightedSum(out + t * info.out_row_stride, info.sources, t * info.source_row_stride,
                   NextTileOffset(info, begin, end, j), alpha, L, dim, stream);
  }
  if (stream) R::FenceStreams();
}

// The backward of one range of tokens (a chunk, backend.cc), as a pipeline of
// tiles. Pass 2 of a tile is memory-bound (it writes every dv row and prefetches
// a tile's rows) while pass 1 runs from L2 with memory idle: a quarter of the time
// when they took turns. So pass 1 of tile k + 1 runs *inside* pass 2 of tile k, a
// unit of pass 1 (a row, or a span of one) between slices of pass 2's chunks,
// spread evenly, and pass 2 of tile k
// prefetches the rows of tile k + 2 (pass 1 of tile k + 1 finds its rows in L2,
// requested one tile earlier). Two tiles are in flight, each with its own half of
// the scratch (grad_out rows, stats). The arithmetic and its order per element
// are those of the two passes run one after the other.
template <typename T, bool kRmsNorm>
class BackwardPipeline {
  using R = BlockRow<T>;
  using A = typename R::A;
  using V = typename R::V;

 public:
  BackwardPipeline(const CallInfo& info, const Scratch& scratch)
      : info_(info), dim_(info.dim), L_(info.num_sources),
        padded_(info.padded_dim), tile_tokens_(info.tile_tokens),
        span_(info.pass_one_span), spans_((info.dim + span_ - 1) / span_),
        wg_(static_cast<const A*>(info.wg)), u_(static_cast<A*>(scratch.u)),
        grad_out_(static_cast<const T*>(info_.grad_out)),
        rms_cache_(static_cast<const A*>(info_.rms_cache)),
        alpha_cache_(static_cast<const A*>(info_.alpha_cache)) {
    for (int k = 0; k < 2; ++k) {
      tiles_[k].g = static_cast<A*>(scratch.acc) + k * tile_tokens_ * padded_;
      tiles_[k].st = Stats<A>(static_cast<A*>(scratch.stats) + k * 4 * tile_tokens_ * L_,
                              tile_tokens_, L_);
      if (spans_ > 1) tiles_[k].carry = static_cast<V*>(scratch.carry) + k * tile_tokens_ * L_ * R::kDotsCarry;
    }
    bool stream = info.stream_stores;
    for (int64_t i = 0; i < L_; ++i) {
      if (info.grad_sources[i] == nullptr) continue;
      write_ = true;
      stream = stream && RowsStreamable<T>(info.grad_sources[i], info_.grad_source_row_stride);
    }
    stream_ = stream && write_;
  }

  void Run(int64_t begin, int64_t end) {
    const int64_t num_tiles = (end - begin + tile_tokens_ - 1) / tile_tokens_;
    const int64_t chunks = (dim_ + R::kChunkElems - 1) / R::kChunkElems;
    Tile* first = Start(0, begin, end);
    PassOnePos at;
    for (int64_t u = 0; u < L_ * first->n * spans_; ++u) {  // pass 1 of tile 0, on its own,
      const int64_t t = first->begin + tile_tokens_ + at.j;   // asking for tile 1
      PassOneUnit(*first, at, t < info_.num_tokens ? Source(at.i) + t * info_.source_row_stride : nullptr);
    }
    for (int64_t k = 0; k < num_tiles; ++k) {
      Tile& cur = tiles_[k % 2];
      Coefficients(cur);
      Tile* next = k + 1 < num_tiles ? Start(k + 1, begin, end) : nullptr;
      // Tile k + 2 starts at after_next: pass 2 of `cur` asks for its source rows,
      // pass 1 of `next` for its grad_out rows (beside source 0's rows). Past this
      // range's end, that is the chunk this thread most likely does next under the
      // static schedule; nothing past the last token is asked for.
      const int64_t after_next = cur.begin + cur.n + tile_tokens_;
      // Pass 2 of `cur` in units of one chunk of one token; before unit u, the
      // first pass1_units * u / units units of the next tile's pass 1 are done.
      const int64_t pass1_units = next != nullptr ? L_ * next->n * spans_ : 0;
      const int64_t units = cur.n * chunks;
      int64_t pass1_done = 0;
      PassOnePos at;
      for (int64_t j = 0; j < cur.n; ++j) {
        for (int64_t c = 0; c < chunks;) {
          const int64_t unit = j * chunks + c;
          for (; pass1_done < pass1_units * unit / units; ++pass1_done) {
            // Source 0's row of token j asks for tile k + 2's grad_out row j.
            const int64_t t = after_next + at.j;
            PassOneUnit(*next, at, at.i == 0 && t < info_.num_tokens
                                       ? grad_out_ + t * info_.grad_out_row_stride
                                       : nullptr);
          }
          // Up to the unit where the next pass-1 unit is due (at least one chunk).
          const int64_t due = pass1_done < pass1_units
                                  ? ((pass1_done + 1) * units + pass1_units - 1) / pass1_units
                                  : units;
          const int64_t c_end = std::min(chunks, std::max(c + 1, due - j * chunks));
          const int64_t t = after_next + j;
          PassTwo(cur, j, c * R::kChunkElems, std::min(c_end * R::kChunkElems, dim_),
                  t < info_.num_tokens ? t * info_.source_row_stride : -1);
          c = c_end;
        }
      }
      for (; pass1_done < pass1_units; ++pass1_done) PassOneUnit(*next, at, nullptr);
    }
    if (stream_) R::FenceStreams();
  }

 private:
  struct Tile {
    int64_t begin = 0, n = 0;  // tokens [begin, begin + n)
    A* g = nullptr;            // [tile_tokens, padded_dim]: the grad_out rows, widened
    Stats<A> st;
    V* carry = nullptr;        // [tile_tokens * L, kDotsCarry]: pass 1's sums between spans
  };

  const T* Source(int64_t i) const { return static_cast<const T*>(info_.sources[i]); }

  // Tile k of [begin, end): its tokens and its grad_out rows widened.
  Tile* Start(int64_t k, int64_t begin, int64_t end) {
    Tile& tile = tiles_[k % 2];
    tile.begin = begin + k * tile_tokens_;
    tile.n = std::min(tile_tokens_, end - tile.begin);
    for (int64_t j = 0; j < tile.n; ++j) {
      R::Widen(tile.g + j * padded_, grad_out_ + (tile.begin + j) * info_.grad_out_row_stride, dim_);
    }
    return &tile;
  }

  // Where pass 1 of a tile is: span k of the row of source i, token j. The units
  // go row by row, source by source (all n tokens of source 0, then of source 1),
  // span by span; the position is carried from unit to unit rather than divided
  // out of a unit count (three 64-bit divisions per unit are a visible share of a
  // backward with short rows).
  struct PassOnePos {
    int64_t k = 0, i = 0, j = 0;
  };

  // Pass 1 of the unit at `at` (then `at` moves to the next unit): one span of one
  // row, so that every row reads the same span of wg and of its g row from L1
  // (whole long rows of x, wg and g together overflow it). The last span of a row
  // ends its three dot products. The next row's same span is prefetched into L1
  // (the last row's own, a no-op), `ahead` (or null) into L2, over the same span.
  void PassOneUnit(Tile& tile, PassOnePos& at, const T* ahead) {
    const int64_t i = at.i, j = at.j, r = i * tile.n + j;
    const int64_t d_begin = at.k * span_, d_end = std::min(d_begin + span_, dim_);
    const T* x = Source(i) + (tile.begin + j) * info_.source_row_stride;
    PassOnePos after = at;  // the next unit: the next row, or the next span's first
    if (++after.j == tile.n) {
      after.j = 0;
      if (++after.i == L_) after = PassOnePos{at.k + 1, 0, 0};
    }
    const T* next = after.k == at.k ? Source(after.i) + (tile.begin + after.j) * info_.source_row_stride : x;
    at = after;
    const A* g = tile.g + j * padded_;
    V* carry = spans_ > 1 ? tile.carry + r * R::kDotsCarry : nullptr;
    const bool need_sum_sq = kRmsNorm && rms_cache_ == nullptr;
    A sum_sq = 0, dot_wg = 0, dot_g = 0;
    if (need_sum_sq) {
      R::template Dots<1, true, true>(&x, &next, ahead, wg_, g, d_begin, d_end, dim_, carry, &sum_sq,
                                      &dot_wg, &dot_g);
    } else {
      R::template Dots<1, false, true>(&x, &next, ahead, wg_, g, d_begin, d_end, dim_, carry, nullptr,
                                       &dot_wg, &dot_g);
    }
    if (d_end < dim_) return;
    A rms = 1;
    if (kRmsNorm) {
      rms = need_sum_sq ? math::Rms(sum_sq, dim_, static_cast<A>(info_.eps))
                        : rms_cache_[(tile.begin + j) * L_ + i];
    }
    tile.st.z[j * L_ + i] = static_cast<A>(info_.scale) * (dot_wg / rms);
    tile.st.r[j * L_ + i] = rms;
    tile.st.ga[j * L_ + i] = dot_g;
  }

  // Softmax backward per token; turns (z, r) into the pass-2 coefficients (b, a).
  void Coefficients(Tile& tile) {
    const A scale = static_cast<A>(info_.scale);
    for (int64_t j = 0; j < tile.n; ++j) {
      A* z = tile.st.z + j * L_;
      A* r = tile.st.r + j * L_;
      A* alpha = tile.st.alpha + j * L_;
      A* ga = tile.st.ga + j * L_;
      if (alpha_cache_ != nullptr) {
        for (int64_t i = 0; i < L_; ++i) alpha[i] = alpha_cache_[(tile.begin + j) * L_ + i];
      } else {
        math::Softmax(z, alpha, L_);
      }
      A* gz = ga;  // dL/dz_i replaces dot(g, v_i)
      math::SoftmaxBackward(alpha, ga, L_, A(0), gz);
      for (int64_t i = 0; i < L_; ++i) {
        const math::KeyChain<A> chain = math::KeyGradient(z[i], r[i], scale, dim_, kRmsNorm);
        r[i] = gz[i] * chain.a;  // a_i
        z[i] = gz[i] * chain.b;  // b_i
      }
    }
  }

  // Pass 2 of elements [d_begin, d_end) of token j of a tile: its dv rows written,
  // U on the way; prefetches the rows at `prefetch_offset` (< 0: none).
  void PassTwo(const Tile& tile, int64_t j, int64_t d_begin, int64_t d_end, int64_t prefetch_offset) {
    const int64_t t = tile.begin + j;
    const auto grads = [&](auto kernel) {
      // (grad_source_row_stride is only validated when a gradient row is written.)
      kernel(info_.grad_sources, write_ ? t * info_.grad_source_row_stride : 0, info_.sources,
             t * info_.source_row_stride, prefetch_offset, tile.g + j * padded_, wg_,
             tile.st.alpha + j * L_, tile.st.r + j * L_, tile.st.z + j * L_, L_, u_, d_begin,
             d_end, dim_);
    };
    if (write_ && u_ != nullptr) {
      grads(stream_ ? R::template SourceGrads<true, true, true> : R::template SourceGrads<true, true, false>);
    } else if (write_) {
      grads(stream_ ? R::template SourceGrads<true, false, true> : R::template SourceGrads<true, false, false>);
    } else if (u_ != nullptr) {
      grads(R::template SourceGrads<false, true, false>);
    }
  }

  const CallInfo& info_;
  const int64_t dim_, L_, padded_, tile_tokens_;
  const int64_t span_, spans_;  // pass 1's span of a row (elements) and spans per row
  const A* wg_;
  A* u_;  // this chunk's U, or null
  const T* grad_out_;
  const A* rms_cache_;
  const A* alpha_cache_;
  bool write_ = false, stream_ = false;
  Tile tiles_[2];
};

template <typename T>
void ForwardTile(const CallInfo& info, const Scratch& s, int64_t begin, int64_t end) {
  if (info.rmsnorm) {
    ForwardTileImpl<T, true>(info, s, begin, end);
  } else {
    ForwardTileImpl<T, false>(info, s, begin, end);
  }
}

template <typename T>
void BackwardRange(const CallInfo& info, const Scratch& s, int64_t begin, int64_t end) {
  if (info.rmsnorm) {
    BackwardPipeline<T, true>(info, s).Run(begin, end);
  } else {
    BackwardPipeline<T, false>(info, s).Run(begin, end);
  }
}

}  // namespace

namespace ATTNRES_ISA {
extern const BlockAttnResKernels kBlockAttnResKernels = {ATTNRES_BY_DTYPE(ForwardTile),
                                                         ATTNRES_BY_DTYPE(BackwardRange)};
}  // namespace ATTNRES_ISA

}  // namespace attnres::cpu
