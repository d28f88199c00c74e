// SIMD building blocks of the CPU kernels, shared by every op's kernel file
// (block_attn_res.cc, two_phase.cc): storage types loaded into and stored from
// vectors of their accumulation type, row loops with register accumulators,
// non-temporal stores and prefetches.
//
// An "-inl.h" file in Highway's sense: included only by sources compiled once per
// ISA (ATTNRES_ISA), and everything is in an unnamed namespace, so that no inline
// function of one variant may be merged by the linker into another.
//
// The vectors are the compiler's generic vector extensions, so each variant is the
// same source with the vector width of its ISA.
#ifndef ATTNRES_SRC_CPU_SIMD_INL_H_
#define ATTNRES_SRC_CPU_SIMD_INL_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/scalar_types.h"

#ifndef ATTNRES_ISA
#error "simd-inl.h is included by kernel sources compiled with -DATTNRES_ISA=<variant>"
#endif

namespace attnres::cpu {
namespace {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif

typedef float VecF __attribute__((vector_size(kVectorBytes)));
typedef double VecD __attribute__((vector_size(kVectorBytes)));
typedef uint32_t VecU32 __attribute__((vector_size(kVectorBytes)));
typedef uint16_t VecU16 __attribute__((vector_size(kVectorBytes / 2)));
typedef Half VecH __attribute__((vector_size(kVectorBytes / 2)));  // scalar_types.h

// Inlines a loop helper and its lambda into the row function: left out of line,
// the chunk loop read every captured variable through the closure on each
// source (15 loads and moves per source and chunk in the backward's pass 2).
#define ATTNRES_INLINE __attribute__((always_inline))



// Elem<T>: how a storage type is loaded into, and stored from, vectors and
// scalars of its accumulation type A.
template <typename T> struct Elem;

// float and double are their own accumulation type: loads and stores are copies.
template <typename T, typename Vec>
struct SameTypeElem {
  using A = T;
  using V = Vec;
  static constexpr int kLanes = sizeof(V) / sizeof(T);
  static V Load(const T* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }
  static void Store(T* p, V v) { std::memcpy(p, &v, sizeof(v)); }
  static void Load2(const T* p, V& lo, V& hi) { lo = Load(p); hi = Load(p + kLanes); }
  static void Store2(T* p, V lo, V hi) { Store(p, lo); Store(p + kLanes, hi); }
};
template <> struct Elem<float> : SameTypeElem<float, VecF> {};
template <> struct Elem<double> : SameTypeElem<double, VecD> {};

// bfloat16 is the top half of a float: widening puts its bits in the top half of a
// 32-bit lane; narrowing rounds to nearest even and keeps NaN a (quiet) NaN and
// subnormals exact, as ToBf16 does.
//
// Vectors come in pairs, in the "unpack" lane order: of the 2 * kLanes values
// loaded, lo holds words 0-3 of every 16-byte lane of the input and hi words 4-7,
// which is where vpunpcklwd / vpunpckhwd against zero put them (one instruction per
// vector, no shift), and vpackusdw puts them back. The kernels keep w * gamma, g
// and U in the same order (Row::WeightRow, Row::WeightGrad); with 16-byte vectors the
// order is the identity.
template <> struct Elem<Bf16> {
  using A = float;
  using V = VecF;
  static constexpr int kLanes = sizeof(V) / sizeof(float);
  static V Load(const Bf16* p) {
    VecU16 h;
    std::memcpy(&h, p, sizeof(h));
    return reinterpret_cast<V>(__builtin_convertvector(h, VecU32) << 16);
  }
  static void Load2(const Bf16* p, V& lo, V& hi) {
#if defined(__AVX512F__)
    const __m512i x = _mm512_loadu_si512(p), zero = _mm512_setzero_si512();
    lo = reinterpret_cast<V>(_mm512_unpacklo_epi16(zero, x));
    hi = reinterpret_cast<V>(_mm512_unpackhi_epi16(zero, x));
#elif defined(__AVX2__)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                  zero = _mm256_setzero_si256();
    lo = reinterpret_cast<V>(_mm256_unpacklo_epi16(zero, x));
    hi = reinterpret_cast<V>(_mm256_unpackhi_epi16(zero, x));
#else
    lo = Load(p);
    hi = Load(p + kLanes);
#endif
  }
  // The bf16 bits of each lane, in the low half of a 32-bit lane: rounded to
  // nearest even (RoundedBits, right for every lane but NaN), NaN made quiet.
  static VecU32 RoundedBits(V v) {
    const VecU32 u = reinterpret_cast<VecU32>(v);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  }
  static VecU32 Bits(V v) {
    const VecU32 quiet_nan = (reinterpret_cast<VecU32>(v) >> 16) | 0x40u;
    return v != v ? quiet_nan : RoundedBits(v);
  }
  static void Store(Bf16* p, V v) {
    const VecU16 h = __builtin_convertvector(Bits(v), VecU16);
    std::memcpy(p, &h, sizeof(h));
  }
  // A pair in unpack order narrowed back to 2 * kLanes values in memory order.
  static void Store2(Bf16* p, V lo, V hi) {
#if defined(__AVX512BF16__)
    // vcvtne2ps2bf16 rounds like Bits but flushes subnormals to zero. A normal
    // float never rounds to a bf16 zero, so only a pair with a zero result can
    // have lost one: then vfpclassps (category 0x20: denormal) tells, and a pair
    // holding a non-zero subnormal (rare) takes the integer path to stay exact.
    // One test of the result instead of two vfpclassps per pair: both run on the
    // shuffle port, which the backward's pass 2 keeps busy.
    const __m512i rounded = reinterpret_cast<__m512i>(
        _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi), reinterpret_cast<__m512>(lo)));
    const bool exact = _mm512_testn_epi16_mask(rounded, _mm512_set1_epi16(0x7FFF)) == 0 ||
                       (_mm512_fpclass_ps_mask(reinterpret_cast<__m512>(lo), 0x20) |
                        _mm512_fpclass_ps_mask(reinterpret_cast<__m512>(hi), 0x20)) == 0;
    if (exact) {
      // Quadword k < 4 of the result holds lo's lanes 4k..4k+3, elements 8k..8k+3
      // of memory, and quadword 4 + k hi's, elements 8k+4..8k+7: vpermq (one
      // shuffle; vpermw takes two) puts them in memory order.
      const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
      const __m512i ordered = _mm512_permutexvar_epi64(order, rounded);
      std::memcpy(p, &ordered, sizeof(ordered));
      return;
    }
#endif
#if defined(__AVX512F__)
    const __m512i packed = _mm512_packus_epi32(reinterpret_cast<__m512i>(Bits(lo)),
                                               reinterpret_cast<__m512i>(Bits(hi)));
    std::memcpy(p, &packed, sizeof(packed));
#elif defined(__AVX2__)
    // NaN lanes are rare: one compare of the pair tells whether any lane needs Bits'
    // NaN select (a compare, an or and a blend per vector, a large share of the
    // backward's pass 2 if done always).
    const __m256 unordered = _mm256_cmp_ps(reinterpret_cast<__m256>(lo),
                                           reinterpret_cast<__m256>(hi), _CMP_UNORD_Q);
    if (__builtin_expect(_mm256_testz_ps(unordered, unordered), 1)) {
      const __m256i packed = _mm256_packus_epi32(reinterpret_cast<__m256i>(RoundedBits(lo)),
                                                 reinterpret_cast<__m256i>(RoundedBits(hi)));
      std::memcpy(p, &packed, sizeof(packed));
      return;
    }
    const __m256i packed = _mm256_packus_epi32(reinterpret_cast<__m256i>(Bits(lo)),
                                               reinterpret_cast<__m256i>(Bits(hi)));
    std::memcpy(p, &packed, sizeof(packed));
#else
    Store(p, lo);
    Store(p + kLanes, hi);
#endif
  }
};

// float16 goes through the compiler's binary16 type (scalar_types.h: Half):
// _Float16 on x86-64 (F16C vcvtph2ps/vcvtps2ph on avx2 and avx512, libgcc's
// conversions on the baseline), __fp16 on aarch64 (fcvt per lane).
template <> struct Elem<F16> {
  using A = float;
  using V = VecF;
  static V Load(const F16* p) {
    VecH h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, V);
  }
  static void Store(F16* p, V v) {
    const VecH h = __builtin_convertvector(v, VecH);
    std::memcpy(p, &h, sizeof(h));
  }
  static void Load2(const F16* p, V& lo, V& hi) { lo = Load(p); hi = Load(p + sizeof(V) / sizeof(float)); }
  static void Store2(F16* p, V lo, V hi) { Store(p, lo); Store(p + sizeof(V) / sizeof(float), hi); }
};

// Row helpers. Rows of T have exactly D elements: the last vector of a row is
// staged through a small zero-padded buffer (no scalar tail loop). Rows of A in
// scratch are padded to a whole number of vectors with zeros, so they are always
// read and written as full vectors.
template <typename T>
struct Row {
  using E = Elem<T>;
  using A = typename E::A;
  using V = typename E::V;
  static constexpr int64_t kLanes = kVectorBytes / sizeof(A);

  // A pair of vectors: 2 * kLanes elements, or the n < 2 * kLanes left at the end
  // of a row, staged through a zero-padded buffer (no scalar tail loop).
  static constexpr int64_t kPair = 2 * kLanes;
  static void Load2(const T* p, int64_t n, V& lo, V& hi) {
    if (n >= kPair) return E::Load2(p, lo, hi);
    T buf[kPair] = {};
    std::memcpy(buf, p, n * sizeof(T));
    E::Load2(buf, lo, hi);
  }
  static void Store2(T* p, V lo, V hi, int64_t n) {
    if (n >= kPair) return E::Store2(p, lo, hi);
    T buf[kPair];
    E::Store2(buf, lo, hi);
    std::memcpy(p, buf, n * sizeof(T));
  }

  // Two whole vectors stored past the caches (p aligned to kStreamBytes): a large
  // output is not read again soon, and a normal store would first read every
  // destination line into the cache (read-for-ownership), a third stream. Pairs
  // make each non-temporal store at least 16 bytes (32 on AVX2) wide, so the
  // write-combining buffers fill whole lines.
  static constexpr int kPairBytes = 2 * kLanes * sizeof(T);
  static constexpr int kStreamBytes = kPairBytes < kVectorBytes ? kPairBytes : kVectorBytes;
  static void StoreStream2(T* p, V lo, V hi) {
#if defined(__x86_64__)
    alignas(64) T buf[2 * kLanes];
    E::Store2(buf, lo, hi);
    char* dst = reinterpret_cast<char*>(p);
    const char* src = reinterpret_cast<const char*>(buf);
    for (int k = 0; k < kPairBytes; k += kStreamBytes) {
      if constexpr (kStreamBytes == 64) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + k),
                            _mm512_load_si512(reinterpret_cast<const __m512i*>(src + k)));
      } else if constexpr (kStreamBytes == 32) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(src + k)));
      } else {
        static_assert(kStreamBytes == 16);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k),
                         _mm_load_si128(reinterpret_cast<const __m128i*>(src + k)));
      }
    }
#else
    E::Store2(p, lo, hi);
#endif
  }
  static bool Streamable(const T* row) {
    return reinterpret_cast<uintptr_t>(row) % kStreamBytes == 0;
  }
  // Orders this thread's streaming stores before whatever the caller does next.
  static void FenceStreams() {
#if defined(__x86_64__)
    _mm_sfence();
#endif
  }

  static V LoadA(const A* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }
  // LoadA into a register that the loop then reuses: without the empty asm the
  // compiler may fold the load into every multiply-add that uses it (one load each),
  // undoing a kernel whose point is to load once for several multiply-adds.
  static V LoadAOnce(const A* p) {
    V v = LoadA(p);
#if defined(__x86_64__)
    __asm__("" : "+v"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#endif
    return v;
  }
  // x in every lane. (Not V{} + x: 0 + x is not x for x = -0, so that costs an add
  // and a register broadcast per use; x - 0 is x, and compiles to one broadcast load.)
  static V Splat(A x) { return x - V{}; }
  static void StoreA(A* p, V v) { std::memcpy(p, &v, sizeof(v)); }

  // step(d, vectors, n) for every chunk of elements [d_begin, d_end) of a row of
  // dim: kChunkVectors whole vectors at a time, then pairs, the last one with its
  // n <= kPair elements (n is the size of the chunk's last pair). d_begin and
  // d_end are multiples of kChunkElems, or d_end is dim. `vectors` is a
  // std::integral_constant, so each step sizes its register arrays at compile time.
  static constexpr int kChunkVectors = 4;
  static constexpr int64_t kChunkElems = kChunkVectors * kLanes;
  template <typename Step>
  ATTNRES_INLINE static void ForEachChunk(int64_t d_begin, int64_t d_end, int64_t dim,
                                          const Step& step) {
    int64_t d = d_begin;
    for (; d + kChunkElems <= d_end; d += kChunkElems) {
      step(d, std::integral_constant<int, kChunkVectors>{}, kPair);
    }
    for (; d < d_end; d += kPair) step(d, std::integral_constant<int, 2>{}, dim - d < kPair ? dim - d : kPair);
  }

  // step(d, n) for every pair of elements [d_begin, d_end) of a row of dim, in order: the whole pairs
  // with n = kPair as a compile-time constant, then the short last one (n < kPair).
  // Load2/Store2 stage only a short pair through a buffer (a memcpy call): kept out
  // of the loop, it no longer makes the compiler keep every accumulator of the
  // loop on the stack (a store per accumulator and pair; phase 1's dot products
  // ran at half speed on AVX-512).
  // [d_begin, d_end): d_begin a multiple of kPair, d_end one too or dim.
  template <typename Step>
  ATTNRES_INLINE static void ForEachPair(int64_t d_begin, int64_t d_end, int64_t dim,
                                         const Step& step) {
    int64_t d = d_begin;
    for (; d + kPair <= d_end; d += kPair) step(d, std::integral_constant<int64_t, kPair>{});
    if (d < d_end) step(d, dim - d);
  }

  // The K vectors of a chunk at p, as ForEachChunk's step gets them.
  template <int K>
  static void LoadChunk(const T* p, int64_t n, V (&v)[K]) {
    for (int k = 0; k < K; k += 2) Load2(p + k * kLanes, k + 2 == K ? n : kPair, v[k], v[k + 1]);
  }

  // Stores the K vectors of a chunk at p, past the caches when `stream` (the last
  // pair of a row, when short, takes normal stores).
  template <int K>
  static void StoreChunk(T* p, const V (&v)[K], int64_t n, bool stream) {
    for (int k = 0; k < K; k += 2) {
      const int64_t m = k + 2 == K ? n : kPair;
      if (stream && m == kPair) {
        StoreStream2(p + k * kLanes, v[k], v[k + 1]);
      } else {
        Store2(p + k * kLanes, v[k], v[k + 1], m);
      }
    }
  }

  // Lanes summed pairwise in a fixed order (a tree: 4 dependent adds for 16 lanes
  // instead of 16, which the row loops waited on): lane k gets lane k + n/2, then
  // k + n/4, ..., so results depend only on the ISA. As vectors (the low half plus
  // the high half, then again): written as a loop over lanes the compiler kept it
  // scalar, 15 adds through the stack, which phase 1 paid for every block and query.
  static A Sum(V v) { return TreeSum<sizeof(V)>(v); }
  template <int kBytes, typename W>
  static A TreeSum(W v) {
    if constexpr (kBytes == sizeof(A)) {
      return v[0];
    } else {
      typedef A Half __attribute__((vector_size(kBytes / 2)));
      Half lo, hi;
      std::memcpy(&lo, &v, sizeof(lo));
      std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
      return TreeSum<kBytes / 2>(lo + hi);
    }
  }

  // Asks for the cache lines of p[0, count), count a compile-time multiple of a
  // vector: one prefetch per 64 bytes (at least one), no run-time tests.
  // kLocality 3 asks for L1 (the row read next), 2 for L2 (rows read a tile later).
  // A row that does not start on a line has one line more than its spans ask for:
  // its last, which PrefetchRowEnd asks for. Left to a demand miss, that line
  // would stall every row for a full memory latency.
  static constexpr int64_t kLineElems = 64 / sizeof(T);
  template <int64_t kCount, int kLocality = 3>
  static void PrefetchSpan(const T* p) {
    for (int64_t e = 0; e < kCount; e += kLineElems) __builtin_prefetch(p + e, 0, kLocality);
  }
  template <int kLocality = 3>
  static void PrefetchRowEnd(const T* row, int64_t dim) {
    __builtin_prefetch(row + dim - 1, 0, kLocality);
  }

  // Independent accumulators per sum of Dots, so that no FMA waits for the one
  // before it: one per vector of an iteration where there are registers for them
  // (two chained FMAs per accumulator and iteration had made the loop
  // latency-bound). kDotsCarry vectors hold one row's sums between two spans.
  static constexpr int kDotsAcc = kVectorBytes == 64 ? 4 : 2;
  static constexpr int kDotsCarry = 3 * kDotsAcc;
  static_assert(kDotsCarry * sizeof(V) <= kDotsCarryBytes);
  static_assert(kPassOneSpanStep % (4 * kLanes) == 0, "a span ends on Dots' step");

  // One read of elements [d_begin, d_end) of each of the kRows rows x[r]: sum(x^2)
  // (if kSumSq), dot(wg, x), and dot(g, x) (if kDotG), prefetching next[r], the row
  // the caller reads after it, at the same pace and positions, into L1, and `ahead`
  // (one-row calls: a row read a tile or two later, or null) into L2. Each row's
  // sums are those of a one-row call over the whole row, bit for bit; two rows at
  // once share every load of wg (and g).
  // A row may be read in spans (d_begin and d_end multiples of 4 * kLanes, or d_end
  // = dim): the unfinished sums wait in carry[r * kDotsCarry, ...) between calls,
  // and the results are written by the call that reaches dim.
  // The hardware prefetchers alone leave too few lines in flight once a loop does
  // more than load (in a standalone test, 0.7-0.9 of a plain sum's bandwidth, and
  // 0.98 with this prefetch); one row (or span) ahead, 1.5-24 KB, covers the latency.
  // The row functions are not inlined: inside the tile loops the compiler ran out
  // of registers and kept accumulators on the stack, a store-to-load chain per
  // iteration that cost ~3x. One call per row of D elements is free in comparison.
  template <int kRows, bool kSumSq, bool kDotG>
  [[gnu::noinline]] static void Dots(const T* const* x, const T* const* next, const T* ahead,
                                     const A* wg, const A* g, int64_t d_begin, int64_t d_end,
                                     int64_t dim, V* carry, A* sum_sq, A* dot_wg, A* dot_g) {
    constexpr int kAcc = kDotsAcc;
    V sq[kRows][kAcc] = {}, w[kRows][kAcc] = {}, gx[kRows][kAcc] = {};
    if (d_begin > 0) {
      for (int r = 0; r < kRows; ++r) {
        for (int a = 0; a < kAcc; ++a) {
          sq[r][a] = carry[r * kDotsCarry + a];
          w[r][a] = carry[r * kDotsCarry + kAcc + a];
          gx[r][a] = carry[r * kDotsCarry + 2 * kAcc + a];
        }
      }
    }
    // With several rows, one load of wg (g) into a register for all of them; with one,
    // the load folded into its multiply-add.
    const auto load = [](const A* p) { return kRows > 1 ? LoadAOnce(p) : LoadA(p); };
    auto add = [&](int a, int64_t d, const V (&x0)[kRows], const V (&x1)[kRows]) {
      const V wg0 = load(wg + d), wg1 = load(wg + d + kLanes);
      for (int r = 0; r < kRows; ++r) {
        w[r][a] += x0[r] * wg0;
        w[r][a + 1] += x1[r] * wg1;
        if (kSumSq) { sq[r][a] += x0[r] * x0[r]; sq[r][a + 1] += x1[r] * x1[r]; }
      }
      if (kDotG) {
        const V g0 = load(g + d), g1 = load(g + d + kLanes);
        for (int r = 0; r < kRows; ++r) { gx[r][a] += x0[r] * g0; gx[r][a + 1] += x1[r] * g1; }
      }
    };
    if (d_end == dim) {
      for (int r = 0; r < kRows; ++r) PrefetchRowEnd(next[r], dim);
      if (ahead != nullptr) PrefetchRowEnd<2>(ahead, dim);
    }
    int64_t d = d_begin;
    // Four vectors per iteration (a whole line of bf16 on AVX2): fewer loop and
    // prefetch-test instructions per byte.
    for (; d + 4 * kLanes <= d_end; d += 4 * kLanes) {
      V x0[kRows], x1[kRows], x2[kRows], x3[kRows];
      for (int r = 0; r < kRows; ++r) {
        PrefetchSpan<4 * kLanes>(next[r] + d);
        E::Load2(x[r] + d, x0[r], x1[r]);
      }
      if (ahead != nullptr) PrefetchSpan<4 * kLanes, 2>(ahead + d);
      add(0, d, x0, x1);
      for (int r = 0; r < kRows; ++r) E::Load2(x[r] + d + 2 * kLanes, x2[r], x3[r]);
      add(kAcc - 2, d + 2 * kLanes, x2, x3);
    }
    if (d_end < dim) {
      for (int r = 0; r < kRows; ++r) {
        for (int a = 0; a < kAcc; ++a) {
          carry[r * kDotsCarry + a] = sq[r][a];
          carry[r * kDotsCarry + kAcc + a] = w[r][a];
          carry[r * kDotsCarry + 2 * kAcc + a] = gx[r][a];
        }
      }
      return;
    }
    for (; d < dim; d += kPair) {  // the last pair, whole or short
      V x0[kRows], x1[kRows];
      for (int r = 0; r < kRows; ++r) {
        PrefetchSpan<kPair>(next[r] + d);
        Load2(x[r] + d, dim - d, x0[r], x1[r]);
      }
      if (ahead != nullptr) PrefetchSpan<kPair, 2>(ahead + d);
      add(0, d, x0, x1);
    }
    const auto total = [](const V (&acc)[kAcc]) {
      V t = acc[0];
      for (int a = 1; a < kAcc; ++a) t += acc[a];
      return Sum(t);
    };
    for (int r = 0; r < kRows; ++r) {
      dot_wg[r] = total(w[r]);
      if (kSumSq) sum_sq[r] = total(sq[r]);
      if (kDotG) dot_g[r] = total(gx[r]);
    }
  }

  static void Widen(A* dst, const T* src, int64_t dim) {
    for (int64_t d = 0; d < dim; d += kPair) {
      V lo, hi;
      Load2(src + d, dim - d, lo, hi);
      StoreA(dst + d, lo);
      StoreA(dst + d + kLanes, hi);
    }
  }

  // The rows the dispatcher prepares and finishes (kernel_table.h: WeightRowFn,
  // WeightGradFn), a pair at a time: Load2 and Store2 give the kernels' row order,
  // so the vectors need no shuffles. Once per call (and query), but at one token of a
  // wide model scalar loops here would be a large part of the call. The
  // arithmetic per element is that of the scalar loops: one product of two A, and
  // sums in row order from zero, so the bits do not depend on the vector width.
  static void WeightRow(const T* w, const T* gamma, int64_t dim, int64_t padded, A* row) {
    T ones[kPair];
    E::Store2(ones, Splat(1), Splat(1));  // read in place of w when it is null
    for (int64_t d = 0; d < padded; d += kPair) {
      V lo{}, hi{};  // zeros past dim
      if (d < dim) {
        Load2(w != nullptr ? w + d : ones, dim - d, lo, hi);
        if (gamma != nullptr) {  // (not w * 1: that would quiet a signalling NaN)
          V g_lo, g_hi;
          Load2(gamma + d, dim - d, g_lo, g_hi);
          lo *= g_lo;
          hi *= g_hi;
        }
      }
      StoreA(row + d, lo);
      StoreA(row + d + kLanes, hi);
    }
  }

  static void WeightGrad(const A* u, int64_t rows, int64_t row_stride, const T* factor, T* out,
                         int64_t dim) {
    for (int64_t d = 0; d < dim; d += kPair) {
      V lo{}, hi{};
      for (int64_t r = 0; r < rows; ++r) {
        lo += LoadA(u + r * row_stride + d);
        hi += LoadA(u + r * row_stride + d + kLanes);
      }
      if (factor != nullptr) {
        V f_lo, f_hi;
        Load2(factor + d, dim - d, f_lo, f_hi);
        lo *= f_lo;
        hi *= f_hi;
      }
      Store2(out + d, lo, hi, dim - d);
    }
  }

};

// Whether rows at base + k * row_stride (elements of T) may take non-temporal stores.
// (In elements: a valid stride of a one-row buffer can be any int64, too large to
// convert to bytes.)
template <typename T>
bool RowsStreamable(const void* base, int64_t row_stride) {
  return Row<T>::Streamable(static_cast<const T*>(base)) &&
         row_stride % (Row<T>::kStreamBytes / static_cast<int64_t>(sizeof(T))) == 0;
}

}  // namespace
}  // namespace attnres::cpu

#endif  // ATTNRES_SRC_CPU_SIMD_INL_H_
