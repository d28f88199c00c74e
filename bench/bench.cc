// `attnres bench`: Block AttnRes against this machine's memory bandwidth and
// against the seed's structure, side by side in one process.
//
// For every shape it prints the minimal bytes (forward: read L*D, write D per
// token; backward: read L*D + D, write L*D), GB/s, the fraction of the streaming
// bandwidth measured in the same run (read-only for forward, read+write copy for
// backward), and the speed-up over a plain C++ version of the seed's structure
// (stack the blocks into a new buffer, then one pass each for RMSNorm, logits,
// softmax and the weighted sum; in the backward, split the stacked gradient back
// out). Times are medians.
#include "bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnres/attnres.h"
#include "ref/harness.h"

namespace attnres::bench {
namespace {

using harness::Case;
using harness::CaseSpec;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double TimeMs(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Streaming bandwidth with the same threads as the kernels, over buffers far
// larger than the caches. This VM's bandwidth drifts by 2x within minutes, so a
// stream pass is timed next to every kernel run (see Paired), never once per run.
class Streams {
 public:
  static constexpr int64_t kWords = int64_t{1} << 27;  // 1 GiB per buffer
  static constexpr double kBytes = double(kWords) * sizeof(uint64_t);

  Streams() : a_(new uint64_t[kWords]), b_(new uint64_t[kWords]) {
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < kWords; ++k) {
      a_[k] = uint64_t(k);
      b_[k] = 0;
    }
  }

  // The strongest read and copy loops on this CPU, chosen once (best median of
  // three passes each), so that no reference is weaker than what a plain loop at the
  // CPU's own vector width reaches: the bench itself is compiled for baseline
  // x86-64, whose 16-byte loop measured ~half of torch.sum on a Zen 4 EPYC.
  void ChooseStrongest(int threads) {
    const auto best = [&](int variants, const auto& pass) {
      int winner = 0;
      double winner_gbs = 0;
      for (int v = 0; v < variants; ++v) {
        if (!Supported(v)) continue;
        std::vector<double> gbs;
        for (int r = 0; r < 3; ++r) gbs.push_back(pass(v));
        if (Median(gbs) > winner_gbs) winner = v, winner_gbs = Median(gbs);
      }
      return winner;
    };
    read_variant_ = best(kReadVariants, [&](int v) { return Read(v, threads); });
    copy_variant_ = best(kCopyVariants, [&](int v) { return Copy(v, threads); });
  }
  const char* ReadName() const { return kReadNames[read_variant_]; }
  const char* CopyName() const { return kCopyNames[copy_variant_]; }

  double ReadGbs(int threads) { return Read(read_variant_, threads); }
  double CopyGbs(int threads) { return Copy(copy_variant_, threads); }

 private:
  static constexpr int kReadVariants = 3, kCopyVariants = 2;
  static constexpr const char* kReadNames[kReadVariants] = {"sum4x-prefetch", "sum-avx2",
                                                            "sum-avx512"};
  static constexpr const char* kCopyNames[kCopyVariants] = {"memcpy", "copy-avx2-nt"};

  // Variant v (of reads: 1 = AVX2, 2 = AVX-512; of copies: 1 = AVX2) runs here.
  static bool Supported(int v) {
#if defined(__x86_64__)
    if (v == 1) return __builtin_cpu_supports("avx2");
    if (v == 2) return __builtin_cpu_supports("avx512f");
    return true;
#else
    return v == 0;
#endif
  }

  // One read-only pass of variant v.
  //  0: an integer sum into 8 independent accumulators, which the compiler
  //     vectorises (a float sum would be one dependent add per element and measure
  //     the adder; one accumulator measured ~15% less on the EPYC), over 4 quarters
  //     of the thread's share read side by side, each line prefetched 1 KB ahead,
  //     as the kernels read L rows at once with a software prefetch. On a Xeon (2
  //     threads) one plain sequential stream measured 26 GB/s, 4 quarters 30, with
  //     the prefetch 33.
  //  1, 2: one sequential stream summed with 4 vector accumulators of 32 / 64 bytes.
  double Read(int v, int threads) {
    uint64_t total = 0;
    const double ms = TimeMs([&] {
#pragma omp parallel num_threads(threads) reduction(+ : total)
      {
        const auto [begin, end] = Share(omp_get_thread_num(), threads);
        total += v == 0 ? SumQuarters(a_.get() + begin, end - begin)
                        : SumVectors(v, a_.get() + begin, end - begin);
      }
    });
    sink_ = total;
    return kBytes / ms / 1e6;
  }

  static uint64_t SumQuarters(const uint64_t* a, int64_t n) {
    constexpr int kParts = 4;
    constexpr int64_t kAheadWords = 1024 / sizeof(uint64_t);
    const int64_t part = n / kParts / 8 * 8;
    uint64_t sums[8] = {};
    for (int64_t k = 0; k < part; k += 8) {
      for (int q = 0; q < kParts; ++q) {
        __builtin_prefetch(&a[k + q * part + kAheadWords]);  // one line per 8 words
        for (int j = 0; j < 8; ++j) sums[j] += a[k + q * part + j];
      }
    }
    for (int64_t k = kParts * part; k < n; ++k) sums[0] += a[k];
    uint64_t total = 0;
    for (uint64_t s : sums) total += s;
    return total;
  }

  static uint64_t SumVectors(int v, const uint64_t* a, int64_t n) {
#if defined(__x86_64__)
    return v == 1 ? SumAvx2(a, n) : SumAvx512(a, n);
#else
    (void)v;
    return SumQuarters(a, n);
#endif
  }

#if defined(__x86_64__)
  __attribute__((target("avx2"))) static uint64_t SumAvx2(const uint64_t* a, int64_t n) {
    __m256i acc[4] = {};
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
      for (int j = 0; j < 4; ++j) {
        acc[j] = _mm256_add_epi64(acc[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k + 4 * j)));
      }
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                       _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3])));
    uint64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; k < n; ++k) total += a[k];
    return total;
  }

  __attribute__((target("avx512f"))) static uint64_t SumAvx512(const uint64_t* a, int64_t n) {
    __m512i acc[4] = {};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
      for (int j = 0; j < 4; ++j) {
        acc[j] = _mm512_add_epi64(acc[j], _mm512_loadu_si512(a + k + 8 * j));
      }
    }
    uint64_t total = _mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3])));
    for (; k < n; ++k) total += a[k];
    return total;
  }

  // 32-byte loads and non-temporal stores (the kernels' large outputs take them too).
  __attribute__((target("avx2"))) static void CopyAvx2(uint64_t* b, const uint64_t* a, int64_t n) {
    int64_t k = 0;
    for (; k < n && reinterpret_cast<uintptr_t>(b + k) % 32 != 0; ++k) b[k] = a[k];
    for (; k + 4 <= n; k += 4) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(b + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k)));
    }
    for (; k < n; ++k) b[k] = a[k];
    _mm_sfence();
  }
#endif

  // One copy, 1 GiB read + 1 GiB written (counted as 2 GiB). 0: the C library's
  // memcpy, which writes this size with non-temporal stores as the kernels write
  // large outputs (a plain loop of stores, STREAM's Copy, also reads every
  // destination line first: ~30% less here, and not what the kernels do); 1: an
  // AVX2 loop of non-temporal stores.
  double Copy(int v, int threads) {
    const double ms = TimeMs([&] {
#pragma omp parallel num_threads(threads)
      {
        const auto [begin, end] = Share(omp_get_thread_num(), threads);
#if defined(__x86_64__)
        if (v == 1) {
          CopyAvx2(b_.get() + begin, a_.get() + begin, end - begin);
        } else
#endif
        {
          std::memcpy(b_.get() + begin, a_.get() + begin, (end - begin) * sizeof(uint64_t));
        }
      }
    });
    return 2 * kBytes / ms / 1e6;
  }

  // Thread t's words: a contiguous share, a multiple of 8 long.
  static std::pair<int64_t, int64_t> Share(int t, int threads) {
    return {kWords / 8 * t / threads * 8, kWords / 8 * (t + 1) / threads * 8};
  }

  std::unique_ptr<uint64_t[]> a_, b_;
  volatile uint64_t sink_ = 0;
  int read_variant_ = 0, copy_variant_ = 0;  // ChooseStrongest
};

// A kernel timed `repeat` times after a warm-up (page faults, caches), each run
// right after the stream, timed as the faster of two passes. Its fraction of the
// bandwidth is the median of the per-pair ratios, so a drift of the machine's
// bandwidth between shapes, or during one, does not show up as a change in the
// kernel. One pass alone measured as low as 10.6 GB/s right after the headline
// forward's warm-up on the Xeon, whose read stream runs at 31-32 back to back: the
// smoke run's one pair then reported the forward at 1.3-2.5 of read. Noise only
// slows a pass, so the faster of two is the stronger reference.
struct Paired {
  double ms = 0;          // median kernel time
  double stream_gbs = 0;  // median stream bandwidth
  double fraction = 0;    // median of (kernel GB/s / adjacent stream GB/s)
};

Paired TimePaired(const std::function<void()>& kernel, double kernel_bytes,
                  const std::function<double()>& stream_gbs, int repeat) {
  kernel();
  std::vector<double> ms, gbs, fractions;
  for (int r = 0; r < repeat; ++r) {
    gbs.push_back(std::max(stream_gbs(), stream_gbs()));
    ms.push_back(TimeMs(kernel));
    fractions.push_back(kernel_bytes / ms.back() / 1e6 / gbs.back());
  }
  return {Median(ms), Median(gbs), Median(fractions)};
}

// ---- The seed's structure, in plain C++ (fp32 compute) -------------------------
// Values move between the passes through memory, as in the seed's PyTorch/PyPTO
// code: stacked v [T, L, D] and stacked grad_v in the input dtype (S), rms and
// logits/alpha [T, L] in fp32.
template <typename S, typename Load, typename Store>
struct SeedStructure {
  const attnres_params& p;
  Load load;    // (const void* base, int64_t index) -> float
  Store store;  // (void* base, int64_t index, float value)
  int threads;

  int64_t L() const { return p.num_blocks + (p.partial ? 1 : 0); }
  const void* Source(int64_t i) const { return i < p.num_blocks ? p.blocks[i] : p.partial; }

  // torch.stack(blocks + [partial], dim=2): a new [T, L, D] buffer.
  void Stack(std::vector<S>& v) const {
    const int64_t T = p.num_tokens, D = p.dim, n = L();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(&v[(t * n + i) * D], static_cast<const S*>(Source(i)) + t * p.source_row_stride,
                    D * sizeof(S));
      }
    }
  }
  float V(const std::vector<S>& v, int64_t k) const { return load(v.data(), k); }

  // rms, logits and softmax, one pass each over the stacked buffer.
  void Attention(const std::vector<S>& v, std::vector<float>& rms,
                 std::vector<float>& alpha) const {
    const int64_t T = p.num_tokens, D = p.dim, n = L();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < T * n; ++r) {
      float sum_sq = 0;
      for (int64_t d = 0; d < D; ++d) sum_sq += V(v, r * D + d) * V(v, r * D + d);
      rms[r] = p.rmsnorm ? std::sqrt(sum_sq / D + float(p.eps)) : 1.0f;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < T * n; ++r) {
      float dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        const float gamma = p.rmsnorm && p.gamma ? load(p.gamma, d) : 1.0f;
        dot += load(p.proj_weight, d) * gamma * V(v, r * D + d) / rms[r];
      }
      alpha[r] = float(p.scale) * dot;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float max_z = alpha[t * n];
      for (int64_t i = 1; i < n; ++i) max_z = std::max(max_z, alpha[t * n + i]);
      float denom = 0;
      for (int64_t i = 0; i < n; ++i) denom += alpha[t * n + i] = std::exp(alpha[t * n + i] - max_z);
      for (int64_t i = 0; i < n; ++i) alpha[t * n + i] /= denom;
    }
  }

  void Forward() const {
    const int64_t T = p.num_tokens, D = p.dim, n = L();
    std::vector<S> v(T * n * D);
    std::vector<float> rms(T * n), alpha(T * n);
    Stack(v);
    Attention(v, rms, alpha);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d) {
        float h = 0;
        for (int64_t i = 0; i < n; ++i) h += alpha[t * n + i] * V(v, (t * n + i) * D + d);
        store(p.out, t * p.out_row_stride + d, h);
      }
    }
  }

  void Backward() const {
    const int64_t T = p.num_tokens, D = p.dim, n = L();
    std::vector<S> v(T * n * D), grad_v(T * n * D);
    std::vector<float> rms(T * n), alpha(T * n), gz(T * n);
    Stack(v);
    Attention(v, rms, alpha);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < T * n; ++r) {  // grad_alpha = dot(g, v)
      const int64_t t = r / n;
      float dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        dot += load(p.grad_out, t * p.grad_out_row_stride + d) * V(v, r * D + d);
      }
      gz[r] = dot;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {  // softmax backward, in place
      float mean = 0;
      for (int64_t i = 0; i < n; ++i) mean += alpha[t * n + i] * gz[t * n + i];
      for (int64_t i = 0; i < n; ++i) gz[t * n + i] = alpha[t * n + i] * (gz[t * n + i] - mean);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < T * n; ++r) {  // RMSNorm backward into the stacked grad_v
      const int64_t t = r / n;
      float c = 0;
      for (int64_t d = 0; d < D; ++d) {
        const float gamma = p.rmsnorm && p.gamma ? load(p.gamma, d) : 1.0f;
        c += gamma * float(p.scale) * gz[r] * load(p.proj_weight, d) * V(v, r * D + d);
      }
      for (int64_t d = 0; d < D; ++d) {
        const float gamma = p.rmsnorm && p.gamma ? load(p.gamma, d) : 1.0f;
        const float gk = float(p.scale) * gz[r] * load(p.proj_weight, d);
        const float x = V(v, r * D + d), rr = rms[r];
        store(grad_v.data(), r * D + d,
              alpha[r] * load(p.grad_out, t * p.grad_out_row_stride + d) +
                  (p.rmsnorm ? gamma * gk / rr - x * c / (D * rr * rr * rr) : gk));
      }
    }
    std::vector<float> dw(D, 0.0f);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t d = 0; d < D; ++d) {  // dw: a reduction over every token and source
      const float gamma = p.rmsnorm && p.gamma ? load(p.gamma, d) : 1.0f;
      for (int64_t r = 0; r < T * n; ++r) {
        dw[d] += float(p.scale) * gz[r] * gamma * V(v, r * D + d) / rms[r];
      }
    }
    for (int64_t d = 0; d < D; ++d) store(p.grad_proj_weight, d, dw[d]);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {  // split the stacked gradient back out
      for (int64_t i = 0; i < n; ++i) {
        void* dst = i < p.num_blocks ? p.grad_blocks[i] : p.grad_partial;
        std::memcpy(static_cast<S*>(dst) + t * p.grad_source_row_stride,
                    &grad_v[(t * n + i) * D], D * sizeof(S));
      }
    }
  }
};

void RunSeedStructure(const attnres_params& p, bool backward, int threads) {
  if (p.dtype == ATTNRES_DTYPE_FLOAT32) {
    auto load = [](const void* b, int64_t k) { return static_cast<const float*>(b)[k]; };
    auto store = [](void* b, int64_t k, float x) { static_cast<float*>(b)[k] = x; };
    SeedStructure<float, decltype(load), decltype(store)> s{p, load, store, threads};
    backward ? s.Backward() : s.Forward();
  } else {  // bfloat16
    auto load = [](const void* b, int64_t k) {
      const uint32_t u = uint32_t{static_cast<const uint16_t*>(b)[k]} << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    };
    auto store = [](void* b, int64_t k, float x) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      static_cast<uint16_t*>(b)[k] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    };
    SeedStructure<uint16_t, decltype(load), decltype(store)> s{p, load, store, threads};
    backward ? s.Backward() : s.Forward();
  }
}

struct Row {
  CaseSpec spec;
  double fwd_bytes = 0, bwd_bytes = 0;
  Paired fwd, bwd;                          // against the read and the copy stream
  double seed_fwd_ms = 0, seed_bwd_ms = 0;  // 0: not run
};

// Median over `repeat` back-to-back pairs of slow() / fast(), each timed once:
// a ratio of two neighbours, like Paired's fractions.
double PairedRatio(const std::function<double()>& slow, const std::function<double()>& fast,
                   int repeat) {
  slow();
  fast();
  std::vector<double> ratios;
  for (int r = 0; r < repeat; ++r) ratios.push_back(slow() / fast());
  return Median(ratios);
}

// The shapes a run covers.
struct Grid {
  std::vector<attnres_dtype> dtypes = {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32};
  std::vector<int64_t> token_counts = {4096, 65536}, dims = {512, 1536, 4096},
                       sources = {4, 9, 17, 33, 128};
};

Grid GridFor(const Options& options) {
  Grid grid;
  if (options.quick || options.headline) {
    grid.dims = {1536};
    grid.sources = {4, 17, 33};
    grid.token_counts = {65536};
  }
  if (options.headline) {
    grid.sources = {17};
    grid.dtypes = {ATTNRES_DTYPE_BFLOAT16};
  }
  return grid;
}

// Largest problem run (sources + gradients) and largest extra memory of the
// seed-structure baseline (a stacked copy and a stacked gradient): the machines
// here have 24 GiB, and docs/SPEC.md §4's largest shape is 68 GB of bf16 sources alone.
constexpr double kMaxBytes = 14e9, kMaxSeedBytes = 7e9;

// One shape: the op forward and backward against the streams, and the seed's
// structure when it fits and is asked for.
Row MeasureRow(const CaseSpec& spec, const Options& options, int threads, int repeat,
               const std::function<double()>& read_gbs,
               const std::function<double()>& copy_gbs) {
  Row row;
  row.spec = spec;
  const double elem = double(harness::ElementBytes(spec.dtype)), L = double(spec.num_sources());
  const double source_bytes = double(spec.tokens) * spec.dim * L * elem;
  Case one(spec);
  attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
  fwd.rms_cache = fwd.alpha_cache = bwd.rms_cache = bwd.alpha_cache = nullptr;
  row.fwd_bytes = double(spec.tokens) * spec.dim * (L + 1) * elem;
  row.bwd_bytes = double(spec.tokens) * spec.dim * (2 * L + 1) * elem;
  row.fwd = TimePaired([&] { attnres_forward(&fwd); }, row.fwd_bytes, read_gbs, repeat);
  row.bwd = TimePaired([&] { attnres_backward(&bwd); }, row.bwd_bytes, copy_gbs, repeat);
  if (options.baseline && 2 * source_bytes <= kMaxSeedBytes) {
    // The baseline allocates its own buffers on every call, as the seed does, and
    // takes seconds: one cold run each is what a caller sees.
    row.seed_fwd_ms = TimeMs([&] { RunSeedStructure(fwd, false, threads); });
    row.seed_bwd_ms = TimeMs([&] { RunSeedStructure(bwd, true, threads); });
  }
  return row;
}

void PrintRow(const Row& row) {
  char fs[32] = "   -", bs[32] = "   -";
  if (row.seed_fwd_ms > 0) {
    std::snprintf(fs, sizeof(fs), "%7.2fx", row.seed_fwd_ms / row.fwd.ms);
    std::snprintf(bs, sizeof(bs), "%7.2fx", row.seed_bwd_ms / row.bwd.ms);
  }
  std::printf("%-5s %5lld %4lld %6lld | %9.3f %7.1f %7.1f %5.2f %8s | %9.3f %7.1f %7.1f "
              "%5.2f %8s\n",
              harness::DtypeName(row.spec.dtype), (long long)row.spec.dim,
              (long long)row.spec.num_sources(), (long long)row.spec.tokens, row.fwd.ms,
              row.fwd_bytes / row.fwd.ms / 1e6, row.fwd.stream_gbs, row.fwd.fraction, fs,
              row.bwd.ms, row.bwd_bytes / row.bwd.ms / 1e6, row.bwd.stream_gbs,
              row.bwd.fraction, bs);
  std::fflush(stdout);
}

// Thread scaling on the headline shape: bf16, D=1536, 16 blocks + partial; 1 thread
// and all threads alternate, and so do the streams, which bound what any
// memory-bound kernel can scale (one core of a small VM may already draw most of
// its bandwidth).
struct Scaling {
  int64_t tokens;
  double fwd, bwd, read, copy;
};

Scaling MeasureScaling(const Options& options, int threads, int repeat, Streams& streams) {
  CaseSpec headline;
  headline.dtype = ATTNRES_DTYPE_BFLOAT16;
  headline.tokens = options.quick || options.headline ? 16384 : 65536;
  headline.dim = 1536;
  headline.num_blocks = 16;
  Case one(headline);
  attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
  fwd.rms_cache = fwd.alpha_cache = bwd.rms_cache = bwd.alpha_cache = nullptr;
  auto timed_with = [&](int n, const attnres_params& p, bool backward) {
    attnres_set_num_threads(n);
    const double ms = TimeMs([&] { backward ? attnres_backward(&p) : attnres_forward(&p); });
    attnres_set_num_threads(threads);
    return ms;
  };
  Scaling s{headline.tokens, 0, 0, 0, 0};
  s.fwd = PairedRatio([&] { return timed_with(1, fwd, false); },
                      [&] { return timed_with(threads, fwd, false); }, repeat);
  s.bwd = PairedRatio([&] { return timed_with(1, bwd, true); },
                      [&] { return timed_with(threads, bwd, true); }, repeat);
  s.read = PairedRatio([&] { return 1 / streams.ReadGbs(1); },
                       [&] { return 1 / streams.ReadGbs(threads); }, repeat);
  s.copy = PairedRatio([&] { return 1 / streams.CopyGbs(1); },
                       [&] { return 1 / streams.CopyGbs(threads); }, repeat);
  return s;
}

void PrintJson(const std::vector<Row>& rows, const Scaling& scaling, int threads, int repeat,
               const Streams& streams) {
  std::printf("{\"isa\": \"%s\", \"threads\": %d, \"repeat\": %d, \"read_reference\": \"%s\", "
              "\"copy_reference\": \"%s\", \"rows\": [",
              attnres_cpu_isa(), threads, repeat, streams.ReadName(), streams.CopyName());
  for (size_t k = 0; k < rows.size(); ++k) {
    const Row& r = rows[k];
    std::printf("%s\n  {\"dtype\": \"%s\", \"dim\": %lld, \"sources\": %lld, \"tokens\": %lld, "
                "\"fwd_ms\": %.4f, \"fwd_bytes\": %.0f, \"fwd_gbs\": %.2f, \"read_gbs\": %.2f, "
                "\"fwd_fraction\": %.3f, \"bwd_ms\": %.4f, \"bwd_bytes\": %.0f, "
                "\"bwd_gbs\": %.2f, \"copy_gbs\": %.2f, \"bwd_fraction\": %.3f, "
                "\"seed_fwd_ms\": %.4f, \"seed_bwd_ms\": %.4f}",
                k ? "," : "", harness::DtypeName(r.spec.dtype), (long long)r.spec.dim,
                (long long)r.spec.num_sources(), (long long)r.spec.tokens, r.fwd.ms, r.fwd_bytes,
                r.fwd_bytes / r.fwd.ms / 1e6, r.fwd.stream_gbs, r.fwd.fraction, r.bwd.ms,
                r.bwd_bytes, r.bwd_bytes / r.bwd.ms / 1e6, r.bwd.stream_gbs, r.bwd.fraction,
                r.seed_fwd_ms, r.seed_bwd_ms);
  }
  std::printf("\n], \"scaling\": {\"tokens\": %lld, \"fwd\": %.3f, \"bwd\": %.3f, "
              "\"read\": %.3f, \"copy\": %.3f}}\n",
              (long long)scaling.tokens, scaling.fwd, scaling.bwd, scaling.read, scaling.copy);
}

}  // namespace

int Main(const Options& options) {
  if (options.threads > 0) attnres_set_num_threads(options.threads);
  const int threads = attnres_get_num_threads();
  const int repeat = std::max(1, options.repeat);
  const bool json = options.json;
  Streams streams;
  streams.ChooseStrongest(threads);
  const std::function<double()> read_gbs = [&] { return streams.ReadGbs(threads); };
  const std::function<double()> copy_gbs = [&] { return streams.CopyGbs(threads); };

  if (!json) {
    std::printf("attnres bench: isa %s, %d threads, median of %d; frac = GB/s over the stream "
                "(read for fwd, copy for bwd), the faster of two passes just before each run; the strongest "
                "streams here: read %s, copy %s\n",
                attnres_cpu_isa(), threads, repeat, streams.ReadName(), streams.CopyName());
    std::printf("%-5s %5s %4s %6s | %9s %7s %7s %5s %8s | %9s %7s %7s %5s %8s\n", "dtype", "D",
                "L", "tokens", "fwd ms", "GB/s", "read", "frac", "vs seed", "bwd ms", "GB/s",
                "copy", "frac", "vs seed");
  }
  const Grid grid = GridFor(options);
  std::vector<Row> rows;
  for (attnres_dtype dtype : grid.dtypes) {
    for (int64_t tokens : grid.token_counts) {
      for (int64_t dim : grid.dims) {
        for (int64_t L : grid.sources) {
          CaseSpec spec;
          spec.dtype = dtype;
          spec.tokens = tokens;
          spec.dim = dim;
          spec.num_blocks = L - 1;
          spec.partial = true;
          const double bytes = 2.0 * tokens * dim * L * harness::ElementBytes(dtype);
          if (bytes > kMaxBytes) {
            if (!json) {
              std::printf("%-5s %5lld %4lld %6lld | skipped: %.1f GB of sources and gradients "
                          "exceed the %.0f GB budget\n",
                          harness::DtypeName(dtype), (long long)dim, (long long)L,
                          (long long)tokens, bytes / 1e9, kMaxBytes / 1e9);
            }
            continue;
          }
          rows.push_back(MeasureRow(spec, options, threads, repeat, read_gbs, copy_gbs));
          if (!json) PrintRow(rows.back());
        }
      }
    }
  }

  const Scaling scaling = MeasureScaling(options, threads, repeat, streams);
  if (json) {
    PrintJson(rows, scaling, threads, repeat, streams);
  } else {
    std::printf("thread scaling (bf16 D=1536 L=17 tokens=%lld): forward %.2fx, backward %.2fx "
                "with %d threads vs 1; the streams scale %.2fx (read) and %.2fx (copy)\n",
                (long long)scaling.tokens, scaling.fwd, scaling.bwd, threads, scaling.read,
                scaling.copy);
  }
  return 0;
}

}  // namespace attnres::bench
