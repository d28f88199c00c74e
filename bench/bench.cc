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
#include <memory>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/harness.h"

namespace attnres::bench {
namespace {

using harness::Case;
using harness::CaseSpec;

double MedianMs(const std::function<void()>& fn, int repeat, bool warm_up = true) {
  if (warm_up) fn();  // page faults, caches
  std::vector<double> ms;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Streaming bandwidth with the same threads as the kernels, over buffers far
// larger than the caches.
struct Bandwidth {
  double read_gbs = 0, copy_gbs = 0;
};

Bandwidth MeasureBandwidth(int threads, int repeat) {
  const int64_t n = int64_t{1} << 27;  // 1 GiB per buffer
  std::unique_ptr<uint64_t[]> a(new uint64_t[n]), b(new uint64_t[n]);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t k = 0; k < n; ++k) {
    a[k] = uint64_t(k);
    b[k] = 0;
  }
  // Integer sums: the compiler vectorises them (a float sum would be one
  // dependent add per element and measure the adder, not the memory).
  volatile uint64_t sink = 0;
  const double read_ms = MedianMs([&] {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t k = 0; k < n; ++k) total += a[k];
    sink = total;
  }, repeat);
  const double copy_ms = MedianMs([&] {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < n; ++k) b[k] = a[k];
  }, repeat);
  (void)sink;
  const double bytes = double(n) * sizeof(uint64_t);
  return {bytes / read_ms / 1e6, 2 * bytes / copy_ms / 1e6};
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
  double fwd_ms = 0, bwd_ms = 0, fwd_bytes = 0, bwd_bytes = 0;
  double seed_fwd_ms = 0, seed_bwd_ms = 0;  // 0: not run
};

}  // namespace

int Main(bool json, bool quick, int threads, int repeat) {
  if (threads > 0) attnres_set_num_threads(threads);
  threads = attnres_get_num_threads();
  repeat = std::max(1, repeat);
  const Bandwidth bw = MeasureBandwidth(threads, repeat);

  std::vector<int64_t> dims = {512, 1536, 4096}, sources = {4, 9, 17, 33, 128},
                       token_counts = {4096, 65536};
  std::vector<attnres_dtype> dtypes = {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32};
  if (quick) {
    dims = {1536};
    sources = {4, 17, 33};
    token_counts = {65536};
  }
  // Largest problem run (sources + gradients) and largest extra memory of the
  // seed-structure baseline (a stacked copy and a stacked gradient): the machines
  // here have 24 GiB, and SPEC §4's largest shape is 68 GB of bf16 sources alone.
  const double kMaxBytes = 14e9, kMaxSeedBytes = 7e9;

  std::vector<Row> rows;
  if (!json) {
    std::printf("attnres bench: isa %s, %d threads, median of %d; streaming bandwidth: read %.1f "
                "GB/s, copy (read+write) %.1f GB/s\n",
                attnres_cpu_isa(), threads, repeat, bw.read_gbs, bw.copy_gbs);
    std::printf("%-5s %5s %4s %6s | %9s %7s %5s %8s | %9s %7s %5s %8s\n", "dtype", "D", "L",
                "tokens", "fwd ms", "GB/s", "frac", "vs seed", "bwd ms", "GB/s", "frac", "vs seed");
  }
  for (attnres_dtype dtype : dtypes) {
    for (int64_t tokens : token_counts) {
      for (int64_t dim : dims) {
        for (int64_t L : sources) {
          Row row;
          row.spec.dtype = dtype;
          row.spec.tokens = tokens;
          row.spec.dim = dim;
          row.spec.num_blocks = L - 1;
          row.spec.partial = true;
          const double elem = double(harness::ElementBytes(dtype));
          const double source_bytes = double(tokens) * dim * L * elem;
          if (2 * source_bytes > kMaxBytes) {
            if (!json) {
              std::printf("%-5s %5lld %4lld %6lld | skipped: %.1f GB of sources and gradients "
                          "exceed the %.0f GB budget\n",
                          harness::DtypeName(dtype), (long long)dim, (long long)L,
                          (long long)tokens, 2 * source_bytes / 1e9, kMaxBytes / 1e9);
            }
            continue;
          }
          Case one(row.spec);
          attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
          fwd.rms_cache = fwd.alpha_cache = bwd.rms_cache = bwd.alpha_cache = nullptr;
          row.fwd_ms = MedianMs([&] { attnres_forward(&fwd); }, repeat);
          row.bwd_ms = MedianMs([&] { attnres_backward(&bwd); }, repeat);
          row.fwd_bytes = double(tokens) * dim * (L + 1) * elem;
          row.bwd_bytes = double(tokens) * dim * (2 * L + 1) * elem;
          if (2 * source_bytes <= kMaxSeedBytes) {
            // The baseline allocates its own buffers on every call, as the seed does,
            // and takes seconds: one cold run each is what a caller sees.
            row.seed_fwd_ms = MedianMs([&] { RunSeedStructure(fwd, false, threads); }, 1, false);
            row.seed_bwd_ms = MedianMs([&] { RunSeedStructure(bwd, true, threads); }, 1, false);
          }
          rows.push_back(row);
          if (!json) {
            const double fgbs = row.fwd_bytes / row.fwd_ms / 1e6, bgbs = row.bwd_bytes / row.bwd_ms / 1e6;
            char fs[32] = "   -", bs[32] = "   -";
            if (row.seed_fwd_ms > 0) {
              std::snprintf(fs, sizeof(fs), "%7.2fx", row.seed_fwd_ms / row.fwd_ms);
              std::snprintf(bs, sizeof(bs), "%7.2fx", row.seed_bwd_ms / row.bwd_ms);
            }
            std::printf("%-5s %5lld %4lld %6lld | %9.3f %7.1f %5.2f %8s | %9.3f %7.1f %5.2f %8s\n",
                        harness::DtypeName(dtype), (long long)dim, (long long)L, (long long)tokens,
                        row.fwd_ms, fgbs, fgbs / bw.read_gbs, fs, row.bwd_ms, bgbs,
                        bgbs / bw.copy_gbs, bs);
            std::fflush(stdout);
          }
        }
      }
    }
  }

  // Thread scaling on the headline shape: bf16, D=1536, 16 blocks + partial.
  CaseSpec headline;
  headline.dtype = ATTNRES_DTYPE_BFLOAT16;
  headline.tokens = quick ? 16384 : 65536;
  headline.dim = 1536;
  headline.num_blocks = 16;
  Case one(headline);
  attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
  fwd.rms_cache = fwd.alpha_cache = bwd.rms_cache = bwd.alpha_cache = nullptr;
  // One core of a small VM may already draw most of its memory bandwidth: the
  // streams at 1 and n threads bound what any memory-bound kernel can scale.
  const Bandwidth bw1 = MeasureBandwidth(1, repeat);
  attnres_set_num_threads(1);
  const double fwd1 = MedianMs([&] { attnres_forward(&fwd); }, repeat);
  const double bwd1 = MedianMs([&] { attnres_backward(&bwd); }, repeat);
  attnres_set_num_threads(threads);
  const double fwdn = MedianMs([&] { attnres_forward(&fwd); }, repeat);
  const double bwdn = MedianMs([&] { attnres_backward(&bwd); }, repeat);

  if (json) {
    std::printf("{\"isa\": \"%s\", \"threads\": %d, \"read_gbs\": %.2f, \"copy_gbs\": %.2f, "
                "\"rows\": [",
                attnres_cpu_isa(), threads, bw.read_gbs, bw.copy_gbs);
    for (size_t k = 0; k < rows.size(); ++k) {
      const Row& r = rows[k];
      std::printf("%s\n  {\"dtype\": \"%s\", \"dim\": %lld, \"sources\": %lld, \"tokens\": %lld, "
                  "\"fwd_ms\": %.4f, \"fwd_bytes\": %.0f, \"fwd_gbs\": %.2f, \"fwd_fraction\": %.3f, "
                  "\"bwd_ms\": %.4f, \"bwd_bytes\": %.0f, \"bwd_gbs\": %.2f, \"bwd_fraction\": %.3f, "
                  "\"seed_fwd_ms\": %.4f, \"seed_bwd_ms\": %.4f}",
                  k ? "," : "", harness::DtypeName(r.spec.dtype), (long long)r.spec.dim,
                  (long long)r.spec.num_sources(), (long long)r.spec.tokens, r.fwd_ms, r.fwd_bytes,
                  r.fwd_bytes / r.fwd_ms / 1e6, r.fwd_bytes / r.fwd_ms / 1e6 / bw.read_gbs,
                  r.bwd_ms, r.bwd_bytes, r.bwd_bytes / r.bwd_ms / 1e6,
                  r.bwd_bytes / r.bwd_ms / 1e6 / bw.copy_gbs, r.seed_fwd_ms, r.seed_bwd_ms);
    }
    std::printf("\n], \"scaling\": {\"tokens\": %lld, \"fwd_ms_1\": %.4f, \"fwd_ms_n\": %.4f, "
                "\"bwd_ms_1\": %.4f, \"bwd_ms_n\": %.4f, \"read_gbs_1\": %.2f, "
                "\"copy_gbs_1\": %.2f}}\n",
                (long long)headline.tokens, fwd1, fwdn, bwd1, bwdn, bw1.read_gbs, bw1.copy_gbs);
  } else {
    std::printf("thread scaling (bf16 D=1536 L=17 tokens=%lld): forward %.2fx, backward %.2fx "
                "with %d threads vs 1; the streams scale %.2fx (read) and %.2fx (copy)\n",
                (long long)headline.tokens, fwd1 / fwdn, bwd1 / bwdn, threads,
                bw.read_gbs / bw1.read_gbs, bw.copy_gbs / bw1.copy_gbs);
  }
  return 0;
}

}  // namespace attnres::bench
