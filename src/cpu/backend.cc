// CPU backend: picks the kernel variant for this CPU, splits tokens into tiles
// and chunks over OpenMP threads, and reduces dw/dgamma deterministically.
//
// Determinism: the backward splits tokens into chunks whose size depends only on
// the problem (tokens, dim, L, dtype), never on the thread count. Each chunk sums its
// share of U = sum_{t,i} a_i v_i into its own row of a partials buffer, and the
// rows are then added in chunk order. So dw = gamma * U and dgamma = w * U are
// bitwise identical for any number of threads, with no atomics.
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "cpu/kernel_table.h"
#include "cpu/scalar_types.h"

namespace attnres {
namespace cpu {
namespace {

// The widest vector of any variant; scratch rows are padded to two of them (the
// kernels load and store vectors in pairs).
constexpr int64_t kMaxVectorBytes = 64;
// Bytes of all sources' rows of one tile: pass 2 rereads them, so they should
// still be in L1 or L2 then. The software prefetch keeps memory streaming even
// with one row per source per tile: on a Xeon (2 MB L2), tiles of one token
// (52 KB of rows at L = 17, D = 1536, bf16) ran the forward 1.3x faster than
// 48 KB runs of every source (832 KB tiles), and larger budgets were never faster.
// The backward keeps three tiles in L2 (block_attn_res.cc: BackwardPipeline) and ran 4%
// faster with two tokens per tile there (128 KB; 256 KB was slower again).
constexpr int64_t kForwardTileSourceBytes = 64 * 1024;
constexpr int64_t kBackwardTileSourceBytes = 128 * 1024;
constexpr int64_t kMaxTileTokens = 64;
// Tokens per backward chunk (one row of U partials each), at most: a multiple of
// the tile. Fewer when the call has few tokens (BackwardChunkTokens).
constexpr int64_t kChunkTokens = 256;
// A backward call is cut into at least this many chunks when it has the tokens,
// so that a decode- or small-batch-sized backward (64 tokens) still gives every
// thread work. A function of the problem only, never of the thread count, so the
// chunk-order sums of dw and dgamma stay bitwise identical for any thread count.
constexpr int64_t kMinChunks = 16;

// Tokens per chunk: ceil(tokens / kMinChunks) rounded up to whole tiles, capped at
// kChunkTokens (a multiple of every tile size).
int64_t BackwardChunkTokens(int64_t num_tokens, int64_t tile_tokens) {
  const int64_t want = std::max<int64_t>(1, (num_tokens + kMinChunks - 1) / kMinChunks);
  return std::min(kChunkTokens, (want + tile_tokens - 1) / tile_tokens * tile_tokens);
}
// Outputs larger than this are written with non-temporal stores: they will not be
// read from cache again, and normal stores would read every line first. Smaller
// outputs stay in cache for whoever reads them next.
constexpr int64_t kStreamStoreBytes = 16 << 20;

#if defined(__x86_64__) || defined(__i386__)
// What the CPU and the OS (saved register state, via xgetbv) support, from cpuid
// directly: GCC's and clang's __builtin_cpu_supports disagree on feature names.
struct X86Features {
  bool avx2 = false, avx512 = false, avx512bf16 = false;
};

X86Features DetectX86() {
  X86Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & bit_FMA, f16c = c & bit_F16C, osxsave = c & bit_OSXSAVE;
  if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6) == 0x6;      // SSE and AVX state
  const bool os_zmm = (xcr0_lo & 0xE6) == 0xE6;    // plus opmask and ZMM state
  f.avx2 = os_ymm && fma && f16c && (b & bit_AVX2) && (b & bit_BMI2);
  f.avx512 = f.avx2 && os_zmm && (b & bit_AVX512F) && (b & bit_AVX512BW) &&
             (b & bit_AVX512DQ) && (b & bit_AVX512VL) && (b & bit_AVX512CD);
  // AVX512_BF16 is leaf 7, sub-leaf 1, EAX bit 5.
  f.avx512bf16 = f.avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  return f;
}
#endif

bool CpuHas(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  static const X86Features features = DetectX86();
  if (std::strcmp(isa, "avx512bf16") == 0) return features.avx512bf16;
  if (std::strcmp(isa, "avx512") == 0) return features.avx512;
  if (std::strcmp(isa, "avx2") == 0) return features.avx2;
#endif
  return std::strcmp(isa, "baseline") == 0;
}

const KernelTable* FindTable(const char* name) {
  for (const KernelTable* t : CompiledTables()) {
    if (std::strcmp(t->name, name) == 0 && CpuHas(t->name)) return t;
  }
  return nullptr;
}

const KernelTable* BestTable() {
  if (const char* forced = std::getenv("ATTNRES_CPU_ISA")) {
    if (const KernelTable* t = FindTable(forced)) return t;
  }
  for (const KernelTable* t : CompiledTables()) {
    if (CpuHas(t->name)) return t;
  }
  return CompiledTables().back();  // the baseline
}

std::atomic<const KernelTable*> g_table{nullptr};
std::atomic<int> g_num_threads{0};  // 0: the default below

const KernelTable& Table() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = BestTable();
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

int PositiveEnv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  return (end != value && *end == '\0' && n > 0 && n < 1 << 16) ? static_cast<int>(n) : 0;
}

int DefaultThreads() {
  static const int n = [] {
    if (int env = PositiveEnv("ATTNRES_NUM_THREADS")) return env;
    if (int env = PositiveEnv("OMP_NUM_THREADS")) return env;
    return std::max(1, omp_get_num_procs());
  }();
  return n;
}

double LoadScalar(const void* base, int64_t index, int32_t dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: return static_cast<const double*>(base)[index];
    case ATTNRES_DTYPE_FLOAT32: return static_cast<const float*>(base)[index];
    case ATTNRES_DTYPE_BFLOAT16: return ToFloat(static_cast<const Bf16*>(base)[index]);
    case ATTNRES_DTYPE_FLOAT16: return ToFloat(static_cast<const F16*>(base)[index]);
  }
  return 0;
}

void StoreScalar(void* base, int64_t index, int32_t dtype, double value) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: static_cast<double*>(base)[index] = value; return;
    case ATTNRES_DTYPE_FLOAT32: static_cast<float*>(base)[index] = float(value); return;
    case ATTNRES_DTYPE_BFLOAT16:
      static_cast<Bf16*>(base)[index] = ToBf16(float(value));
      return;
    case ATTNRES_DTYPE_FLOAT16: static_cast<F16*>(base)[index] = ToF16(float(value)); return;
  }
}

// Reads the [dim] vector as A (float or double), as the kernels do.
double AsAcc(double value, int32_t dtype) {
  return dtype == ATTNRES_DTYPE_FLOAT64 ? value : static_cast<double>(float(value));
}

// Where element d of a row sits in the kernels' rows of A (w * gamma, U): the
// bf16 kernels keep each pair of vectors in unpack order (simd-inl.h, Elem<Bf16>):
// words 0-3 of every 16-byte lane of the pair's 2 * lanes values in the first
// vector, words 4-7 in the second. With 16-byte vectors that is the identity.
bool KernelRowIsNatural(const KernelTable& table, int32_t dtype) {
  return dtype != ATTNRES_DTYPE_BFLOAT16 || table.vector_bytes <= 16;
}

int64_t KernelRowIndex(const KernelTable& table, int32_t dtype, int64_t d) {
  if (KernelRowIsNatural(table, dtype)) return d;
  const int64_t lanes = table.vector_bytes / 4;  // a power of two: masks, not divisions
  const int64_t e = d & (2 * lanes - 1), word = e & 7;
  return d - e + (word / 4) * lanes + (e / 8) * 4 + word % 4;
}

// A row of A: w[d] * gamma[d] (w == nullptr: ones; gamma == nullptr: w alone), zeros
// from dim to padded, in the kernels' row order. Once per call and query, so at one
// token of a wide model it was most of the call (50 of 70 us at D = 7168): loops the
// compiler vectorises where the order is natural; for the bf16 pairs each entry
// reads its source element (the inverse of KernelRowIndex), so the writes stay
// sequential. The product of two floats rounded to float is the float product, so
// these are the bits of the double-precision form.
template <typename T, typename Acc>
void StoreWeightRowAs(const KernelTable& table, int32_t dtype, const void* weight,
                      const void* gamma_or_null, int64_t dim, int64_t padded, void* out) {
  const T* w = static_cast<const T*>(weight);
  const T* gamma = static_cast<const T*>(gamma_or_null);
  Acc* row = static_cast<Acc*>(out);
  const auto acc = [](T x) -> Acc {
    if constexpr (std::is_same_v<T, Bf16> || std::is_same_v<T, F16>) {
      return ToFloat(x);
    } else {
      return Acc(x);
    }
  };
  if (KernelRowIsNatural(table, dtype)) {
    if (w == nullptr) {
      std::fill(row, row + dim, Acc(1));
    } else if (gamma == nullptr) {
      for (int64_t d = 0; d < dim; ++d) row[d] = acc(w[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) row[d] = acc(w[d]) * acc(gamma[d]);
    }
    std::fill(row + dim, row + padded, Acc(0));
    return;
  }
  const int64_t lanes = table.vector_bytes / 4;
  for (int64_t k = 0; k < padded; ++k) {
    const int64_t in_pair = k & (2 * lanes - 1), in_vector = in_pair & (lanes - 1);
    const int64_t d = k - in_pair + (in_vector / 4) * 8 + (in_pair >= lanes ? 4 : 0) + in_vector % 4;
    Acc value = 0;
    if (d < dim) {
      value = w != nullptr ? acc(w[d]) : Acc(1);
      if (gamma != nullptr) value *= acc(gamma[d]);
    }
    row[k] = value;
  }
}

void StoreWeightRow(const KernelTable& table, int32_t dtype, const void* w, const void* gamma,
                    int64_t dim, int64_t padded, void* row) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64:
      return StoreWeightRowAs<double, double>(table, dtype, w, gamma, dim, padded, row);
    case ATTNRES_DTYPE_FLOAT32:
      return StoreWeightRowAs<float, float>(table, dtype, w, gamma, dim, padded, row);
    case ATTNRES_DTYPE_BFLOAT16:
      return StoreWeightRowAs<Bf16, float>(table, dtype, w, gamma, dim, padded, row);
    case ATTNRES_DTYPE_FLOAT16:
      return StoreWeightRowAs<F16, float>(table, dtype, w, gamma, dim, padded, row);
  }
}

// Rows of A padded to two of the widest vectors (the kernels load pairs).
int64_t PaddedDim(int64_t dim, int32_t dtype) {
  const int64_t lanes = 2 * kMaxVectorBytes / AccumBytes(dtype);
  return (dim + lanes - 1) / lanes * lanes;
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// Scratch memory of the calling thread, kept between calls and grown on demand:
// a small call then costs no allocation (the Python-side overhead target is tens
// of microseconds). Returns nullptr when the memory cannot be had.
void* ThreadArena(int64_t bytes) {
  thread_local std::unique_ptr<void, AlignedFree> arena;
  thread_local int64_t capacity = 0;
  if (bytes > capacity) {
    const int64_t rounded = (bytes + kMaxVectorBytes - 1) / kMaxVectorBytes * kMaxVectorBytes;
    arena.reset(std::aligned_alloc(kMaxVectorBytes, rounded));
    capacity = arena != nullptr ? rounded : 0;
  }
  return arena.get();
}

// Runs fn(thread, item) for items [0, n): inline when one thread is enough,
// otherwise over OpenMP with a static schedule.
template <typename Fn>
void ParallelFor(int threads, int64_t n, const Fn& fn) {
  if (threads <= 1) {
    for (int64_t item = 0; item < n; ++item) fn(0, item);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < n; ++item) fn(omp_get_thread_num(), item);
}

// What both ops' kernels read of the problem (kernel_table.h: RowsInfo); the
// dispatcher fills padded_dim and wg.
RowsInfo RowsProblem(const attnres_params& p) {
  return RowsInfo{p.dim,       p.source_row_stride, p.out_row_stride, p.grad_out_row_stride,
                  p.grad_source_row_stride, p.scale, p.eps, p.rmsnorm != 0,
                  p.out,       p.grad_out,          /*padded_dim=*/0, /*wg=*/nullptr};
}

// What the single op's kernels read of the problem (kernel_table.h: CallInfo).
CallInfo CallProblem(const attnres_params& p) {
  return CallInfo{RowsProblem(p), p.num_tokens, p.rms_cache, p.alpha_cache,
                  // Prepared by Call::Prepare.
                  /*num_sources=*/0, /*tile_tokens=*/0, /*sources=*/nullptr,
                  /*grad_sources=*/nullptr, /*stream_stores=*/false};
}

// What the two-phase kernels read of the problem (kernel_table.h: PhaseInfo).
PhaseInfo PhaseProblem(const attnres_params& p) {
  PhaseInfo info{};
  static_cast<RowsInfo&>(info) = RowsProblem(p);
  info.num_blocks = p.num_blocks;
  info.num_queries = p.num_queries;
  info.norm_eps = p.norm_eps;
  info.input_norm = p.input_norm != 0;
  info.accumulate_grads = p.accumulate_grads != 0;
  info.blocks = p.blocks;
  info.query_outs = p.query_outs;
  info.query_lses = p.query_lses;
  info.grad_query_outs = p.grad_query_outs;
  info.grad_query_lses = p.grad_query_lses;
  info.grad_blocks = p.grad_blocks;
  info.query_out = p.query_out;
  info.query_lse = p.query_lse;
  info.partial = p.partial;
  info.grad_query_out = p.grad_query_out;
  info.grad_query_lse = p.grad_query_lse;
  info.grad_partial = p.grad_partial;
  return info;
}

// Everything one call needs besides the kernels: sources, wg, scratch.
class Call {
 public:
  explicit Call(const attnres_params& p) : p_(p) {}

  void Prepare(bool backward) {
    backward_ = backward;
    const int32_t dtype = p_.dtype;
    acc_bytes_ = AccumBytes(dtype);
    info_ = CallProblem(p_);
    table_ = &Table();
    info_.num_sources = NumSources(p_);
    info_.padded_dim = PaddedDim(p_.dim, dtype);
    // (Divided in two steps: num_sources * dim * bytes can exceed int64.)
    const int64_t tile_bytes = backward ? kBackwardTileSourceBytes : kForwardTileSourceBytes;
    const int64_t tile_rows_per_source = tile_bytes / (p_.dim * ElementBytes(dtype));
    info_.tile_tokens =
        std::clamp<int64_t>(tile_rows_per_source / info_.num_sources, 1, kMaxTileTokens);
    while (kChunkTokens % info_.tile_tokens != 0) --info_.tile_tokens;

    const int64_t row_bytes = p_.num_tokens * p_.dim * ElementBytes(dtype);
    info_.stream_stores = (backward ? info_.num_sources : 1) * row_bytes > kStreamStoreBytes;
    sources_.assign(p_.blocks, p_.blocks + p_.num_blocks);
    if (p_.partial != nullptr) sources_.push_back(p_.partial);
    info_.sources = sources_.data();
    if (backward) {
      grad_sources_.assign(info_.num_sources, nullptr);
      for (int64_t i = 0; i < p_.num_blocks && p_.grad_blocks != nullptr; ++i) {
        grad_sources_[i] = p_.grad_blocks[i];
      }
      if (p_.partial != nullptr) grad_sources_[p_.num_blocks] = p_.grad_partial;
      info_.grad_sources = grad_sources_.data();
    }
  }

  // One block of the thread arena: w * gamma, then per-thread scratch, then, for
  // the backward, `chunks` zeroed rows of U.
  attnres_status AllocateScratch(int threads, int64_t chunks) {
    const int64_t tile = info_.tile_tokens, L = info_.num_sources, padded = info_.padded_dim;
    // The backward pipelines two tiles (block_attn_res.cc: BackwardPipeline), each with
    // its widened grad_out rows and stats.
    const int64_t tiles_in_flight = backward_ ? 2 : 1;
    acc_elems_ = backward_ ? tiles_in_flight * tile * padded : 0;
    const int64_t stats_elems = tiles_in_flight * 4 * tile * L;
    per_thread_ = acc_elems_ + (stats_elems + 15) / 16 * 16;  // keep 64-byte alignment
    const int64_t elems = padded + threads * per_thread_ + chunks * padded;
    base_ = static_cast<char*>(ThreadArena(elems * acc_bytes_));
    if (base_ == nullptr) {
      return Fail(ATTNRES_ERROR_OUT_OF_MEMORY, "attnres: could not allocate " +
                                                   std::to_string(elems * acc_bytes_) +
                                                   " bytes of scratch");
    }
    StoreWeightRow(*table_, p_.dtype, p_.proj_weight, p_.rmsnorm ? p_.gamma : nullptr, p_.dim,
                   padded, base_);
    info_.wg = base_;
    u_rows_ = base_ + (padded + threads * per_thread_) * acc_bytes_;
    std::memset(u_rows_, 0, chunks * padded * acc_bytes_);
    return ATTNRES_OK;
  }

  Scratch ThreadScratch(int thread) const {
    char* base = base_ + (info_.padded_dim + thread * per_thread_) * acc_bytes_;
    return Scratch{base, base + acc_elems_ * acc_bytes_, nullptr};
  }

  void* ChunkU(int64_t chunk) const { return u_rows_ + chunk * info_.padded_dim * acc_bytes_; }

  // U[d] of one chunk.
  double ChunkUValue(int64_t chunk, int64_t d) const {
    const void* u = ChunkU(chunk);
    const int64_t k = KernelRowIndex(d);
    return acc_bytes_ == 8 ? static_cast<const double*>(u)[k]
                           : static_cast<const float*>(u)[k];
  }

  const CallInfo& info() const { return info_; }
  const KernelTable& table() const { return *table_; }

 private:
  int64_t KernelRowIndex(int64_t d) const { return cpu::KernelRowIndex(*table_, p_.dtype, d); }

  const attnres_params& p_;
  CallInfo info_{};
  std::vector<const void*> sources_;
  std::vector<void*> grad_sources_;
  int64_t acc_bytes_ = 4;
  bool backward_ = false;
  const KernelTable* table_ = nullptr;  // the variant this call runs
  int64_t acc_elems_ = 0, per_thread_ = 0;
  char* base_ = nullptr;    // the thread arena
  char* u_rows_ = nullptr;  // [chunks, padded_dim]
};

int ThreadsFor(int64_t work_items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(GetNumThreads(), work_items)));
}

}  // namespace

int GetNumThreads() {
  const int n = g_num_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : DefaultThreads();
}

void SetNumThreads(int n) { g_num_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

const char* IsaName() { return Table().name; }

bool SetIsa(const char* name) {
  if (name == nullptr) {
    g_table.store(BestTable(), std::memory_order_release);
    return true;
  }
  const KernelTable* t = FindTable(name);
  if (t == nullptr) return false;
  g_table.store(t, std::memory_order_release);
  return true;
}

const char* RunnableIsaNames() {
  static const std::string names = [] {
    std::string list;
    for (const KernelTable* t : CompiledTables()) {
      if (CpuHas(t->name)) list += (list.empty() ? "" : " ") + std::string(t->name);
    }
    return list;
  }();
  return names.c_str();
}

}  // namespace cpu

attnres_status CpuForward(const attnres_params& p) {
  if (p.num_tokens == 0) return ATTNRES_OK;
  cpu::Call call(p);
  call.Prepare(/*backward=*/false);
  const int64_t tile = call.info().tile_tokens;
  const int64_t num_tiles = (p.num_tokens + tile - 1) / tile;
  const int threads = cpu::ThreadsFor(num_tiles);
  if (attnres_status s = call.AllocateScratch(threads, 0); s != ATTNRES_OK) return s;
  const cpu::RangeFn forward = call.table().forward[p.dtype];
  cpu::ParallelFor(threads, num_tiles, [&](int thread, int64_t tile_index) {
    const int64_t begin = tile_index * tile;
    forward(call.info(), call.ThreadScratch(thread), begin, std::min(begin + tile, p.num_tokens));
  });
  return ATTNRES_OK;
}

attnres_status CpuBackward(const attnres_params& p) {
  cpu::Call call(p);
  call.Prepare(/*backward=*/true);
  const int64_t chunk_tokens = cpu::BackwardChunkTokens(p.num_tokens, call.info().tile_tokens);
  const int64_t num_chunks = (p.num_tokens + chunk_tokens - 1) / chunk_tokens;
  const int threads = cpu::ThreadsFor(num_chunks);
  const bool weight_grads = p.grad_proj_weight != nullptr || p.grad_gamma != nullptr;
  const int64_t u_rows = weight_grads ? num_chunks : 0;
  if (attnres_status s = call.AllocateScratch(threads, u_rows); s != ATTNRES_OK) return s;
  const cpu::RangeFn backward = call.table().backward[p.dtype];
  cpu::ParallelFor(threads, num_chunks, [&](int thread, int64_t chunk) {
    cpu::Scratch scratch = call.ThreadScratch(thread);
    scratch.u = weight_grads ? call.ChunkU(chunk) : nullptr;
    const int64_t chunk_end = std::min((chunk + 1) * chunk_tokens, p.num_tokens);
    backward(call.info(), scratch, chunk * chunk_tokens, chunk_end);
  });

  if (weight_grads) {
    // U summed over chunks in chunk order; dw = gamma * U, dgamma = w * U.
    const bool has_gamma = p.rmsnorm && p.gamma != nullptr;
    cpu::ParallelFor(cpu::ThreadsFor(p.dim / 256 + 1), p.dim, [&](int, int64_t d) {
      double u = 0;
      if (p.dtype == ATTNRES_DTYPE_FLOAT64) {
        for (int64_t c = 0; c < num_chunks; ++c) u += call.ChunkUValue(c, d);
      } else {
        float u32 = 0;  // float accumulation, as everywhere else for these dtypes
        for (int64_t c = 0; c < num_chunks; ++c) u32 += float(call.ChunkUValue(c, d));
        u = u32;
      }
      if (p.grad_proj_weight != nullptr) {
        const double gamma = has_gamma ? cpu::LoadScalar(p.gamma, d, p.dtype) : 1.0;
        cpu::StoreScalar(p.grad_proj_weight, d, p.dtype, cpu::AsAcc(gamma * u, p.dtype));
      }
      if (p.grad_gamma != nullptr) {
        const double w = cpu::LoadScalar(p.proj_weight, d, p.dtype);
        cpu::StoreScalar(p.grad_gamma, d, p.dtype, cpu::AsAcc(w * u, p.dtype));
      }
    });
  }
  return ATTNRES_OK;
}

// ---- The two-phase ops ----------------------------------------------------------
//
// The same scheme as the single op: tokens split into chunks whose size depends on
// the problem only, per-chunk rows of weight-gradient partial sums added in chunk
// order afterwards, so every output is bitwise identical for any thread count.
attnres_status CpuTwoPhase(const attnres_params& p, int phase, bool backward) {
  using namespace cpu;
  const KernelTable& table = Table();
  const PhaseKernels& kernels = *table.two_phase;
  const PhaseRangeFn run =
      (phase == 1 ? (backward ? kernels.phase1_backward : kernels.phase1_forward)
                  : (backward ? kernels.phase2_backward : kernels.phase2_forward))[p.dtype];
  const int32_t dtype = p.dtype;
  const int64_t S = phase == 1 ? p.num_queries : 1, N = phase == 1 ? p.num_blocks : 0;
  const int64_t dim = p.dim, padded = PaddedDim(dim, dtype), acc = AccumBytes(dtype);
  const bool norm = phase == 2 && p.input_norm;
  const bool has_gamma = p.rmsnorm && p.gamma != nullptr;
  const bool weight_grads =
      backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr ||
                   (phase == 2 && p.grad_norm_weight != nullptr));
  // Chunks of a few tokens even for small calls, so that both threads work on a
  // decode-sized backward; at most 256 (the partial rows stay few and small).
  const int64_t chunk_tokens = std::clamp<int64_t>((p.num_tokens + 31) / 32, 4, 256);
  const int64_t num_chunks = (p.num_tokens + chunk_tokens - 1) / chunk_tokens;
  const int threads = ThreadsFor(num_chunks);
  const auto round64 = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t rows_bytes = round64((S + (norm ? 1 : 0)) * padded * acc);
  const int64_t scratch_bytes = round64(PhaseScratchBytes(S, N, padded, acc));
  const int64_t partial_rows = weight_grads ? PhasePartialRows(phase, S) : 0;
  const int64_t partial_bytes = partial_rows * padded * acc;
  const int64_t bytes = rows_bytes + threads * scratch_bytes + num_chunks * partial_bytes;
  char* base = static_cast<char*>(ThreadArena(bytes));
  if (base == nullptr) {
    return Fail(ATTNRES_ERROR_OUT_OF_MEMORY,
                "attnres: could not allocate " + std::to_string(bytes) + " bytes of scratch");
  }
  const int64_t elem = ElementBytes(dtype);
  for (int64_t s = 0; s < S; ++s) {  // u_s = w_s * gamma_s
    const auto query = [&](const void* v) { return static_cast<const char*>(v) + s * dim * elem; };
    StoreWeightRow(table, dtype, query(p.proj_weight), has_gamma ? query(p.gamma) : nullptr, dim,
                   padded, base + s * padded * acc);
  }
  if (norm) {  // the input norm's weight (ones without one)
    StoreWeightRow(table, dtype, p.norm_weight, nullptr, dim, padded, base + S * padded * acc);
  }
  char* scratch = base + rows_bytes;
  char* partials = scratch + threads * scratch_bytes;
  std::memset(partials, 0, num_chunks * partial_bytes);
  PhaseInfo info = PhaseProblem(p);
  info.padded_dim = padded;
  info.wg = base;
  info.norm_weight = norm ? base + S * padded * acc : nullptr;
  ParallelFor(threads, num_chunks, [&](int thread, int64_t c) {
    run(info, scratch + thread * scratch_bytes, weight_grads ? partials + c * partial_bytes : nullptr,
        c * chunk_tokens, std::min((c + 1) * chunk_tokens, p.num_tokens));
  });
  if (!weight_grads) return ATTNRES_OK;

  // Row r of the partials summed in chunk order, in the accumulation type.
  const auto total = [&](int64_t r, int64_t d) {
    const int64_t offset = r * padded + KernelRowIndex(table, dtype, d);
    if (acc == 8) {
      double u = 0;
      for (int64_t c = 0; c < num_chunks; ++c) u += reinterpret_cast<const double*>(partials + c * partial_bytes)[offset];
      return u;
    }
    float u = 0;
    for (int64_t c = 0; c < num_chunks; ++c) u += reinterpret_cast<const float*>(partials + c * partial_bytes)[offset];
    return double(u);
  };
  ParallelFor(ThreadsFor(S * dim / 256 + 1), S * dim, [&](int, int64_t k) {
    const int64_t s = k / dim, d = k % dim;
    const double u = total(s, d);  // dL/du_s[d]: dw = gamma * u, dgamma = w * u
    if (p.grad_proj_weight != nullptr) {
      const double gamma = has_gamma ? LoadScalar(p.gamma, k, dtype) : 1.0;
      StoreScalar(p.grad_proj_weight, k, dtype, AsAcc(gamma * u, dtype));
    }
    if (p.grad_gamma != nullptr) {
      StoreScalar(p.grad_gamma, k, dtype, AsAcc(LoadScalar(p.proj_weight, k, dtype) * u, dtype));
    }
    if (phase == 2 && p.grad_norm_weight != nullptr) StoreScalar(p.grad_norm_weight, d, dtype, total(1, d));
  });
  return ATTNRES_OK;
}

const char* CpuIsaName() { return cpu::IsaName(); }

}  // namespace attnres
