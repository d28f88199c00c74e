// Block AttnRes CPU kernels: forward and backward of one tile of tokens.
//
// This file is compiled once per ISA (CMakeLists.txt: ATTNRES_ISA = baseline, avx2,
// avx512, each with its -march flags) and backend.cc picks one table at run time.
// The SIMD code uses the compiler's generic vector extensions, so each variant is
// the same source with the vector width of its ISA. Everything is in an unnamed
// namespace: no inline function of one variant may be merged into another.
//
// Per token, with L sources v_i of D elements and wg = w * gamma, a tile of tokens
// is done in two passes:
//   pass 1 - reads every source row of the tile once from memory, source by source
//            (all of the tile's rows of source 0, then of source 1, ...), each row
//            prefetching the next; it computes sum(v^2), dot(wg, v) and, in the
//            backward, dot(g, v). A tile is small (backend.cc: k*TileSourceBytes)
//            so that pass 2 finds its rows in L1/L2.
//   then   - the softmax (forward) or its backward, a few scalars per source;
//   pass 2 - token by token, rereads the tile's sources from cache, a chunk of a few
//            vectors of every source at a time with the sums in registers:
//            forward  out = sum_i alpha_i v_i, written once;
//            backward dv_i = alpha_i g + a_i wg + b_i v_i written once per source,
//                     and U += sum_i a_i v_i (dw = gamma U, dgamma = w U).
//            Nothing but the outputs is stored: an accumulator row in memory would
//            be read and written once per source (3x the source bytes in cache
//            traffic), which is what limited the single-pass forward.
// The backward overlaps the two: pass 1 of the next tile runs inside pass 2 of
// this one (BackwardPipeline).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/kernel_table.h"
#include "cpu/scalar_types.h"

#ifndef ATTNRES_ISA
#error "kernels.cc is compiled with -DATTNRES_ISA=<baseline|avx2|avx512>"
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
typedef _Float16 VecH __attribute__((vector_size(kVectorBytes / 2)));

// Inlines a loop helper and its lambda into the row function: left out of line,
// the chunk loop read every captured variable through the closure on each
// source (15 loads and moves per source and chunk in the backward's pass 2).
#define ATTNRES_INLINE __attribute__((always_inline))

// Math through builtins, not <cmath>'s inline std:: overloads, which the linker
// could share between variants.
inline float Exp(float x) { return __builtin_expf(x); }
inline double Exp(double x) { return __builtin_exp(x); }
inline float Sqrt(float x) { return __builtin_sqrtf(x); }
inline double Sqrt(double x) { return __builtin_sqrt(x); }


// Elem<T>: how a storage type is loaded into, and stored from, vectors and
// scalars of its accumulation type A.
template <typename T> struct Elem;

template <> struct Elem<float> {
  using A = float;
  using V = VecF;
  static V Load(const float* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }
  static void Store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
  static void Load2(const float* p, V& lo, V& hi) { lo = Load(p); hi = Load(p + sizeof(V) / sizeof(float)); }
  static void Store2(float* p, V lo, V hi) { Store(p, lo); Store(p + sizeof(V) / sizeof(float), hi); }
};

template <> struct Elem<double> {
  using A = double;
  using V = VecD;
  static V Load(const double* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }
  static void Store(double* p, V v) { std::memcpy(p, &v, sizeof(v)); }
  static void Load2(const double* p, V& lo, V& hi) { lo = Load(p); hi = Load(p + sizeof(V) / sizeof(double)); }
  static void Store2(double* p, V lo, V hi) { Store(p, lo); Store(p + sizeof(V) / sizeof(double), hi); }
};

// bfloat16 is the top half of a float: widening puts its bits in the top half of a
// 32-bit lane; narrowing rounds to nearest even and keeps NaN a (quiet) NaN and
// subnormals exact, as ToBf16 does.
//
// Vectors come in pairs, in the "unpack" lane order: of the 2 * kLanes values
// loaded, lo holds words 0-3 of every 16-byte lane of the input and hi words 4-7,
// which is where vpunpcklwd / vpunpckhwd against zero put them (one instruction per
// vector, no shift), and vpackusdw puts them back. The kernels keep w * gamma, g
// and U in the same order (backend.cc: KernelRowIndex); with 16-byte vectors the
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
  // The bf16 bits of each lane, in the low half of a 32-bit lane.
  static VecU32 Bits(V v) {
    const VecU32 u = reinterpret_cast<VecU32>(v);
    const VecU32 high = u >> 16;
    const VecU32 rounded = (u + 0x7FFFu + (high & 1u)) >> 16;
    return v != v ? (high | 0x40u) : rounded;  // v != v: NaN lanes, made quiet
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
    const __m256i packed = _mm256_packus_epi32(reinterpret_cast<__m256i>(Bits(lo)),
                                               reinterpret_cast<__m256i>(Bits(hi)));
    std::memcpy(p, &packed, sizeof(packed));
#else
    Store(p, lo);
    Store(p + kLanes, hi);
#endif
  }
};

// float16 goes through the compiler's _Float16 (F16C vcvtph2ps/vcvtps2ph on avx2
// and avx512, libgcc's conversions on the baseline).
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
  // instead of 16, which the row loops waited on): results depend only on the ISA.
  static A Sum(V v) {
    A t[kLanes];
    std::memcpy(t, &v, sizeof(v));
    for (int64_t w = kLanes / 2; w > 0; w /= 2) {
      for (int64_t k = 0; k < w; ++k) t[k] += t[k + w];
    }
    return t[0];
  }

  // Asks for the cache lines of p[0, count), count a compile-time multiple of a
  // vector: one prefetch per 64 bytes (at least one), no run-time tests.
  // kLocality 3 asks for L1 (the row read next), 2 for L2 (rows read a tile later).
  static constexpr int64_t kLineElems = 64 / sizeof(T);
  template <int64_t kCount, int kLocality = 3>
  static void PrefetchSpan(const T* p) {
    for (int64_t e = 0; e < kCount; e += kLineElems) __builtin_prefetch(p + e, 0, kLocality);
  }

  // One read of x: sum(x^2) (if kSumSq), dot(wg, x), and dot(g, x) (if kDotG),
  // prefetching `next`, the row the caller reads after this one, at the same pace,
  // into L1, and `ahead` (a row read a tile or two later, or null) into L2.
  // The hardware prefetchers alone leave too few lines in flight once a loop does
  // more than load (in a standalone test, 0.7-0.9 of a plain sum's bandwidth, and
  // 0.98 with this prefetch); one row ahead (1.5-16 KB) covers the latency.
  // The row functions are not inlined: inside the tile loops the compiler ran out
  // of registers and kept accumulators on the stack, a store-to-load chain per
  // iteration that cost ~3x. One call per row of D elements is free in comparison.
  template <bool kSumSq, bool kDotG>
  [[gnu::noinline]] static void Dots(const T* x, const T* next, const T* ahead, const A* wg,
                                     const A* g, int64_t dim, A* sum_sq, A* dot_wg, A* dot_g) {
    // Independent accumulators, so that no FMA waits for the one before it: one
    // per vector of an iteration where there are registers for them (two chained
    // FMAs per accumulator and iteration had made the loop latency-bound).
    constexpr int kAcc = kVectorBytes == 64 ? 4 : 2;
    V sq[kAcc] = {}, w[kAcc] = {}, gx[kAcc] = {};
    auto add = [&](int a, int64_t d, V x0, V x1) {
      w[a] += x0 * LoadA(wg + d);
      w[a + 1] += x1 * LoadA(wg + d + kLanes);
      if (kSumSq) { sq[a] += x0 * x0; sq[a + 1] += x1 * x1; }
      if (kDotG) { gx[a] += x0 * LoadA(g + d); gx[a + 1] += x1 * LoadA(g + d + kLanes); }
    };
    int64_t d = 0;
    // Four vectors per iteration (a whole line of bf16 on AVX2): fewer loop and
    // prefetch-test instructions per byte.
    for (; d + 4 * kLanes <= dim; d += 4 * kLanes) {
      PrefetchSpan<4 * kLanes>(next + d);
      if (ahead != nullptr) PrefetchSpan<4 * kLanes, 2>(ahead + d);
      V x0, x1, x2, x3;
      E::Load2(x + d, x0, x1);
      E::Load2(x + d + 2 * kLanes, x2, x3);
      add(0, d, x0, x1);
      add(kAcc - 2, d + 2 * kLanes, x2, x3);
    }
    for (; d < dim; d += kPair) {  // the last pair, whole or short
      PrefetchSpan<kPair>(next + d);
      if (ahead != nullptr) PrefetchSpan<kPair, 2>(ahead + d);
      V x0, x1;
      Load2(x + d, dim - d, x0, x1);
      add(0, d, x0, x1);
    }
    const auto total = [](const V (&acc)[kAcc]) {
      V t = acc[0];
      for (int a = 1; a < kAcc; ++a) t += acc[a];
      return Sum(t);
    };
    *dot_wg = total(w);
    if (kSumSq) *sum_sq = total(sq);
    if (kDotG) *dot_g = total(gx);
  }

  // Pass 2 reads only from cache, so memory would idle while it computes: it asks
  // for the rows that pass 1 of this thread's next tile reads, at the pace and
  // positions it reads its own (token j's chunk d of source i: the next tile's
  // token j, chunk d of source i), into L2. `prefetch_offset` < 0: none.
  template <int K>
  static void PrefetchChunk(const void* source, int64_t prefetch_offset, int64_t d) {
    if (prefetch_offset < 0) return;
    const T* p = static_cast<const T*>(source) + prefetch_offset;
    PrefetchSpan<K * kLanes, 2>(p + d);
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
        PrefetchChunk<K>(sources[i], prefetch_offset, d);
        const T* x = static_cast<const T*>(sources[i]) + offset + d;
        const V weight = Splat(alpha[i]);
        V xv[K];
        LoadChunk<K>(x, n, xv);
        for (int k = 0; k < K; ++k) sum[k] += weight * xv[k];
      }
      StoreChunk<K>(out + d, sum, n, stream);
    });
  }

  static void Widen(A* dst, const T* src, int64_t dim) {
    for (int64_t d = 0; d < dim; d += kPair) {
      V lo, hi;
      Load2(src + d, dim - d, lo, hi);
      StoreA(dst + d, lo);
      StoreA(dst + d + kLanes, hi);
    }
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
        PrefetchChunk<K>(sources[i], prefetch_offset, d);
        const T* x = static_cast<const T*>(sources[i]) + offset + d;
        V xv[K];
        LoadChunk<K>(x, n, xv);
        const V va = Splat(a[i]);
        if (kAccumulateU) {
          for (int k = 0; k < K; ++k) uv[k] += va * xv[k];
        }
        if (kWrite && grad_sources[i] != nullptr) {
          const V valpha = Splat(alpha[i]), vb = Splat(b[i]);
          V dv[K];
          for (int k = 0; k < K; ++k) dv[k] = valpha * gv[k] + va * wgv[k] + vb * xv[k];
          StoreChunk<K>(static_cast<T*>(grad_sources[i]) + grad_offset + d, dv, n, kStream);
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

// Pass 1 reads source 0's rows of the tile, then source 1's, and so on. NextRow
// is the row read after row j (of the tile starting at `begin`) of source i: the
// next row of the run, else the first row of the next source's run, else
// `after_last`.
template <typename T>
const T* NextRow(const CallInfo& info, int64_t i, int64_t j, int64_t begin, int64_t end,
                 const T* after_last) {
  const int64_t stride = info.params->source_row_stride;
  if (begin + j + 1 < end) return static_cast<const T*>(info.sources[i]) + (begin + j + 1) * stride;
  if (i + 1 < info.num_sources) return static_cast<const T*>(info.sources[i + 1]) + begin * stride;
  return after_last;
}

// The first row of this thread's next tile under the static schedule (this tile's
// own when it is the last): what pass 1 prefetches after its last row.
template <typename T>
const T* NextTileRow(const CallInfo& info, int64_t begin, int64_t end) {
  const attnres_params& p = *info.params;
  return static_cast<const T*>(info.sources[0]) +
         (end < p.num_tokens ? end : begin) * p.source_row_stride;
}

// Where row j of this thread's next tile starts in every source (elements), or -1
// when there is no such row.
inline int64_t NextTileOffset(const CallInfo& info, int64_t begin, int64_t end, int64_t j) {
  const int64_t t = end + j;
  const bool in_next_tile = t < info.params->num_tokens && j < end - begin;
  return in_next_tile ? t * info.params->source_row_stride : -1;
}

// Whether rows at base + k * row_stride (elements of T) may take non-temporal stores.
// (In elements: a valid stride of a one-row buffer can be any int64, too large to
// convert to bytes.)
template <typename T>
bool RowsStreamable(const void* base, int64_t row_stride) {
  return Row<T>::Streamable(static_cast<const T*>(base)) &&
         row_stride % (Row<T>::kStreamBytes / static_cast<int64_t>(sizeof(T))) == 0;
}

// alpha = softmax(z) over one token's L logits, as the reference: exp(z - max z),
// so a NaN or infinite logit makes the token's weights NaN (that token only).
template <typename A>
void Softmax(const A* z, A* alpha, int64_t num_sources) {
  A max_z = z[0];
  for (int64_t i = 1; i < num_sources; ++i) max_z = z[i] > max_z ? z[i] : max_z;
  A denom = 0;
  for (int64_t i = 0; i < num_sources; ++i) denom += alpha[i] = Exp(z[i] - max_z);
  const A inv_denom = A(1) / denom;
  for (int64_t i = 0; i < num_sources; ++i) alpha[i] *= inv_denom;
}

template <typename T, bool kRmsNorm>
void ForwardTileImpl(const CallInfo& info, const Scratch& scratch, int64_t begin,
                     int64_t end) {
  using R = Row<T>;
  using A = typename R::A;
  const attnres_params& p = *info.params;
  const int64_t dim = p.dim, L = info.num_sources;
  const int64_t n = end - begin;
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  const A* wg = static_cast<const A*>(info.wg);
  Stats<A> st(scratch.stats, info.tile_tokens, L);

  // Pass 1: the logits.
  const T* after_last = NextTileRow<T>(info, begin, end);
  for (int64_t i = 0; i < L; ++i) {
    const T* src = static_cast<const T*>(info.sources[i]) + begin * p.source_row_stride;
    for (int64_t j = 0; j < n; ++j) {
      const T* x = src + j * p.source_row_stride;
      A sum_sq = 0, dot = 0;
      R::template Dots<kRmsNorm, false>(x, NextRow(info, i, j, begin, end, after_last), nullptr, wg,
                                        nullptr, dim, &sum_sq, &dot, nullptr);
      const A rms = kRmsNorm ? Sqrt(sum_sq / static_cast<A>(dim) + eps) : A(1);
      st.z[j * L + i] = scale * (dot / rms);
      st.r[j * L + i] = rms;
    }
  }

  // Softmax, caches, and pass 2: the weighted sum, token by token.
  T* out = static_cast<T*>(p.out);
  A* rms_cache = static_cast<A*>(p.rms_cache);
  A* alpha_cache = static_cast<A*>(p.alpha_cache);
  const bool stream = info.stream_stores && RowsStreamable<T>(out, p.out_row_stride);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = begin + j;
    A* alpha = st.alpha + j * L;
    Softmax(st.z + j * L, alpha, L);
    for (int64_t i = 0; i < L; ++i) {
      if (rms_cache != nullptr) rms_cache[t * L + i] = st.r[j * L + i];
      if (alpha_cache != nullptr) alpha_cache[t * L + i] = alpha[i];
    }
    R::WeightedSum(out + t * p.out_row_stride, info.sources, t * p.source_row_stride,
                   NextTileOffset(info, begin, end, j), alpha, L, dim, stream);
  }
  if (stream) R::FenceStreams();
}

// The backward of one range of tokens (a chunk of kChunkTokens), as a pipeline of
// tiles. Pass 2 of a tile is memory-bound (it writes every dv row and prefetches
// a tile's rows) while pass 1 runs from L2 with memory idle: a quarter of the time
// when they took turns. So pass 1 of tile k + 1 runs *inside* pass 2 of tile k, a
// row between slices of pass 2's chunks, spread evenly, and pass 2 of tile k
// prefetches the rows of tile k + 2 (pass 1 of tile k + 1 finds its rows in L2,
// requested one tile earlier). Two tiles are in flight, each with its own half of
// the scratch (grad_out rows, stats). The arithmetic and its order per element
// are those of the two passes run one after the other.
template <typename T, bool kRmsNorm>
class BackwardPipeline {
  using R = Row<T>;
  using A = typename R::A;

 public:
  BackwardPipeline(const CallInfo& info, const Scratch& scratch)
      : info_(info), p_(*info.params), dim_(p_.dim), L_(info.num_sources),
        padded_(info.padded_dim), tile_tokens_(info.tile_tokens),
        wg_(static_cast<const A*>(info.wg)), u_(static_cast<A*>(scratch.u)),
        grad_out_(static_cast<const T*>(p_.grad_out)),
        rms_cache_(static_cast<const A*>(p_.rms_cache)),
        alpha_cache_(static_cast<const A*>(p_.alpha_cache)) {
    for (int k = 0; k < 2; ++k) {
      tiles_[k].g = static_cast<A*>(scratch.acc) + k * tile_tokens_ * padded_;
      tiles_[k].st = Stats<A>(static_cast<A*>(scratch.stats) + k * 4 * tile_tokens_ * L_,
                              tile_tokens_, L_);
    }
    bool stream = info.stream_stores;
    for (int64_t i = 0; i < L_; ++i) {
      if (info.grad_sources[i] == nullptr) continue;
      write_ = true;
      stream = stream && RowsStreamable<T>(info.grad_sources[i], p_.grad_source_row_stride);
    }
    stream_ = stream && write_;
  }

  void Run(int64_t begin, int64_t end) {
    const int64_t num_tiles = (end - begin + tile_tokens_ - 1) / tile_tokens_;
    const int64_t chunks = (dim_ + R::kChunkElems - 1) / R::kChunkElems;
    Tile* first = Start(0, begin, end);
    for (int64_t r = 0; r < L_ * first->n; ++r) {  // pass 1 of tile 0, on its own,
      const int64_t t = first->begin + tile_tokens_ + r % first->n;  // asking for tile 1
      PassOneRow(*first, r, t < p_.num_tokens ? Source(r / first->n) + t * p_.source_row_stride : nullptr);
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
      // first rows * u / units rows of the next tile's pass 1 are done.
      const int64_t rows = next != nullptr ? L_ * next->n : 0, units = cur.n * chunks;
      int64_t rows_done = 0;
      for (int64_t j = 0; j < cur.n; ++j) {
        for (int64_t c = 0; c < chunks;) {
          const int64_t unit = j * chunks + c;
          for (; rows_done < rows * unit / units; ++rows_done) {
            // Rows r < next->n are source 0's, of token r: tile k + 2's token r.
            const int64_t t = after_next + rows_done;
            const bool source_0 = rows_done < next->n;
            PassOneRow(*next, rows_done, source_0 && t < p_.num_tokens
                                             ? grad_out_ + t * p_.grad_out_row_stride
                                             : nullptr);
          }
          // Up to the unit where the next row is due (at least one chunk).
          const int64_t due = rows_done < rows ? ((rows_done + 1) * units + rows - 1) / rows : units;
          const int64_t c_end = std::min(chunks, std::max(c + 1, due - j * chunks));
          const int64_t t = after_next + j;
          PassTwo(cur, j, c * R::kChunkElems, std::min(c_end * R::kChunkElems, dim_),
                  t < p_.num_tokens ? t * p_.source_row_stride : -1);
          c = c_end;
        }
      }
      for (; rows_done < rows; ++rows_done) PassOneRow(*next, rows_done, nullptr);
    }
    if (stream_) R::FenceStreams();
  }

 private:
  struct Tile {
    int64_t begin = 0, n = 0;  // tokens [begin, begin + n)
    A* g = nullptr;            // [tile_tokens, padded_dim]: the grad_out rows, widened
    Stats<A> st;
  };

  const T* Source(int64_t i) const { return static_cast<const T*>(info_.sources[i]); }

  // Tile k of [begin, end): its tokens and its grad_out rows widened.
  Tile* Start(int64_t k, int64_t begin, int64_t end) {
    Tile& tile = tiles_[k % 2];
    tile.begin = begin + k * tile_tokens_;
    tile.n = std::min(tile_tokens_, end - tile.begin);
    for (int64_t j = 0; j < tile.n; ++j) {
      R::Widen(tile.g + j * padded_, grad_out_ + (tile.begin + j) * p_.grad_out_row_stride, dim_);
    }
    return &tile;
  }

  // Pass 1 of row r of a tile, source by source (i = r / n, token j = r % n): its
  // three dot products. The next row is prefetched into L1, `ahead` (or null)
  // into L2.
  void PassOneRow(Tile& tile, int64_t r, const T* ahead) {
    const int64_t i = r / tile.n, j = r % tile.n;
    const T* x = Source(i) + (tile.begin + j) * p_.source_row_stride;
    const T* next = r + 1 < L_ * tile.n
                        ? Source((r + 1) / tile.n) + (tile.begin + (r + 1) % tile.n) * p_.source_row_stride
                        : x;
    const A* g = tile.g + j * padded_;
    const bool need_sum_sq = kRmsNorm && rms_cache_ == nullptr;
    A sum_sq = 0, dot_wg = 0, dot_g = 0;
    if (need_sum_sq) {
      R::template Dots<true, true>(x, next, ahead, wg_, g, dim_, &sum_sq, &dot_wg, &dot_g);
    } else {
      R::template Dots<false, true>(x, next, ahead, wg_, g, dim_, nullptr, &dot_wg, &dot_g);
    }
    A rms = 1;
    if (kRmsNorm) {
      rms = need_sum_sq ? Sqrt(sum_sq / static_cast<A>(dim_) + static_cast<A>(p_.eps))
                        : rms_cache_[(tile.begin + j) * L_ + i];
    }
    tile.st.z[j * L_ + i] = static_cast<A>(p_.scale) * (dot_wg / rms);
    tile.st.r[j * L_ + i] = rms;
    tile.st.ga[j * L_ + i] = dot_g;
  }

  // Softmax backward per token; turns (z, r) into the pass-2 coefficients (b, a).
  void Coefficients(Tile& tile) {
    const A scale = static_cast<A>(p_.scale);
    for (int64_t j = 0; j < tile.n; ++j) {
      A* z = tile.st.z + j * L_;
      A* r = tile.st.r + j * L_;
      A* alpha = tile.st.alpha + j * L_;
      const A* ga = tile.st.ga + j * L_;
      if (alpha_cache_ != nullptr) {
        for (int64_t i = 0; i < L_; ++i) alpha[i] = alpha_cache_[(tile.begin + j) * L_ + i];
      } else {
        Softmax(z, alpha, L_);
      }
      // gz_i = alpha_i (ga_i - sum_k alpha_k ga_k), computed relative to the source
      // with the largest alpha: when the softmax is peaked, ga_i - mean is a small
      // difference of two large numbers, while the ga_k - ga_pivot are exact inputs.
      int64_t pivot = 0;
      for (int64_t i = 1; i < L_; ++i) pivot = alpha[i] > alpha[pivot] ? i : pivot;
      const A ga_pivot = ga[pivot];
      A mean_delta = 0;
      for (int64_t i = 0; i < L_; ++i) mean_delta += alpha[i] * (ga[i] - ga_pivot);
      for (int64_t i = 0; i < L_; ++i) {
        const A gz = alpha[i] * ((ga[i] - ga_pivot) - mean_delta);
        const A b = kRmsNorm ? -gz * z[i] / (static_cast<A>(dim_) * r[i] * r[i]) : A(0);
        r[i] = scale * gz / r[i];  // a_i
        z[i] = b;
      }
    }
  }

  // Pass 2 of elements [d_begin, d_end) of token j of a tile: its dv rows written,
  // U on the way; prefetches the rows at `prefetch_offset` (< 0: none).
  void PassTwo(const Tile& tile, int64_t j, int64_t d_begin, int64_t d_end, int64_t prefetch_offset) {
    const int64_t t = tile.begin + j;
    const auto grads = [&](auto kernel) {
      // (grad_source_row_stride is only validated when a gradient row is written.)
      kernel(info_.grad_sources, write_ ? t * p_.grad_source_row_stride : 0, info_.sources,
             t * p_.source_row_stride, prefetch_offset, tile.g + j * padded_, wg_,
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
  const attnres_params& p_;
  const int64_t dim_, L_, padded_, tile_tokens_;
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
  if (info.params->rmsnorm) {
    ForwardTileImpl<T, true>(info, s, begin, end);
  } else {
    ForwardTileImpl<T, false>(info, s, begin, end);
  }
}

template <typename T>
void BackwardRange(const CallInfo& info, const Scratch& s, int64_t begin, int64_t end) {
  if (info.params->rmsnorm) {
    BackwardPipeline<T, true>(info, s).Run(begin, end);
  } else {
    BackwardPipeline<T, false>(info, s).Run(begin, end);
  }
}

#define ATTNRES_STRINGIFY_(x) #x
#define ATTNRES_STRINGIFY(x) ATTNRES_STRINGIFY_(x)

// Indexed by attnres_dtype: FLOAT32, FLOAT64, BFLOAT16, FLOAT16.
const KernelTable kTable = {
    ATTNRES_STRINGIFY(ATTNRES_ISA),
    kVectorBytes,
    {ForwardTile<float>, ForwardTile<double>, ForwardTile<Bf16>, ForwardTile<F16>},
    {BackwardRange<float>, BackwardRange<double>, BackwardRange<Bf16>, BackwardRange<F16>},
};

}  // namespace

#define ATTNRES_TABLE_GETTER_(isa) isa##Kernels
#define ATTNRES_TABLE_GETTER(isa) ATTNRES_TABLE_GETTER_(isa)
const KernelTable* ATTNRES_TABLE_GETTER(ATTNRES_ISA_GETTER)() { return &kTable; }

}  // namespace attnres::cpu
