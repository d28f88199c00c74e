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
#include <vector>

#include "backends.h"
#include "cpu/kernel_table.h"

namespace attnres {
namespace cpu {
namespace {

// The widest vector of any variant; scratch rows are padded to two of them (the
// kernels load and store vectors in pairs).
constexpr int64_t kMaxVectorBytes = 64;
// Bytes of all sources' rows of one tile: pass 2 rereads them, so they should
// still be in L1 or L2 then. The software prefetch keeps memory streaming even
// with one row per source per tile, so a small tile loses nothing and keeps pass 2
// in cache; larger budgets are no faster. The backward keeps three tiles in L2
// (block_attn_res.cc: BackwardPipeline), and two tokens per tile suit it better
// than one.
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
                  /*num_sources=*/0, /*tile_tokens=*/0, /*pass_one_span=*/0, /*sources=*/nullptr,
                  /*grad_sources=*/nullptr, /*stream_stores=*/false};
}

// What the two-phase kernels read of the problem (kernel_table.h: PhaseInfo).
PhaseInfo PhaseProblem(const attnres_params& p) {
  return PhaseInfo{RowsProblem(p), p.num_blocks, p.num_queries, p.norm_eps, p.input_norm != 0,
                   p.accumulate_grads != 0, /*stream_stores=*/false,
                   // Phase 1.
                   p.blocks, p.query_outs, p.query_lses, p.grad_query_outs, p.grad_query_lses,
                   p.grad_blocks,
                   // Phase 2, and its fused update.
                   p.query_out, p.query_lse, p.partial, p.grad_query_out, p.grad_query_lse,
                   p.grad_partial, p.partial_update, p.new_partial, p.grad_partial_in,
                   // Prepared by CpuTwoPhase.
                   /*norm_weight=*/nullptr};
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
    // Pass 1 reads x with wg, the backward with g too. The forward's 16-bit rows,
    // two per call and bound by their widening rather than by L1, stay whole (in
    // spans they are slower), while long fp32 rows gain from spans. (The backward
    // counts one g row, not all of its tile's: those would make small rows span
    // too, which is slower.)
    const int64_t elem = ElementBytes(dtype);
    info_.pass_one_span = backward    ? PassOneSpan(p_.dim, elem + 2 * acc_bytes_)
                          : elem == 2 ? p_.dim
                                      : PassOneSpan(p_.dim, elem + acc_bytes_);

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
    // Pass 1's sums between the spans of its rows (kernel_table.h: PassOneSpan).
    const bool spans = info_.pass_one_span < p_.dim;
    carry_elems_ = spans ? tiles_in_flight * tile * L * kDotsCarryBytes / acc_bytes_ : 0;
    per_thread_ = acc_elems_ + carry_elems_ + (stats_elems + 15) / 16 * 16;  // keep 64-byte alignment
    const int64_t elems = padded + threads * per_thread_ + chunks * padded;
    base_ = static_cast<char*>(ThreadArena(elems * acc_bytes_));
    if (base_ == nullptr) {
      return Fail(ATTNRES_ERROR_OUT_OF_MEMORY, "attnres: could not allocate " +
                                                   std::to_string(elems * acc_bytes_) +
                                                   " bytes of scratch");
    }
    table_->weight_row[p_.dtype](p_.proj_weight, p_.rmsnorm ? p_.gamma : nullptr, p_.dim, padded,
                                 base_);
    info_.wg = base_;
    u_rows_ = base_ + (padded + threads * per_thread_) * acc_bytes_;
    std::memset(u_rows_, 0, chunks * padded * acc_bytes_);
    return ATTNRES_OK;
  }

  Scratch ThreadScratch(int thread) const {
    char* base = base_ + (info_.padded_dim + thread * per_thread_) * acc_bytes_;
    char* carry = base + acc_elems_ * acc_bytes_;
    return Scratch{base, carry + carry_elems_ * acc_bytes_, nullptr, carry_elems_ > 0 ? carry : nullptr};
  }

  void* ChunkU(int64_t chunk) const { return u_rows_ + chunk * info_.padded_dim * acc_bytes_; }

  const CallInfo& info() const { return info_; }
  const KernelTable& table() const { return *table_; }

 private:
  const attnres_params& p_;
  CallInfo info_{};
  std::vector<const void*> sources_;
  std::vector<void*> grad_sources_;
  int64_t acc_bytes_ = 4;
  bool backward_ = false;
  const KernelTable* table_ = nullptr;  // the variant this call runs
  int64_t acc_elems_ = 0, carry_elems_ = 0, per_thread_ = 0;
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

const KernelTable* KernelTableForTesting(const char* name) { return FindTable(name); }

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
  const cpu::RangeFn forward = call.table().block_attn_res->forward[p.dtype];
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
  const cpu::RangeFn backward = call.table().block_attn_res->backward[p.dtype];
  cpu::ParallelFor(threads, num_chunks, [&](int thread, int64_t chunk) {
    cpu::Scratch scratch = call.ThreadScratch(thread);
    scratch.u = weight_grads ? call.ChunkU(chunk) : nullptr;
    const int64_t chunk_end = std::min((chunk + 1) * chunk_tokens, p.num_tokens);
    backward(call.info(), scratch, chunk * chunk_tokens, chunk_end);
  });

  if (weight_grads) {
    // U summed over chunks in chunk order; dw = gamma * U, dgamma = w * U. On the
    // calling thread: at few tokens an OpenMP fork costs more than the sum, and at
    // many the sum (at most one row per 256 tokens) is a negligible part of the call.
    const cpu::WeightGradFn grad = call.table().weight_grad[p.dtype];
    const int64_t padded = call.info().padded_dim;
    if (p.grad_proj_weight != nullptr) {
      grad(call.ChunkU(0), num_chunks, padded, p.rmsnorm ? p.gamma : nullptr, p.grad_proj_weight,
           p.dim);
    }
    if (p.grad_gamma != nullptr) {
      grad(call.ChunkU(0), num_chunks, padded, p.proj_weight, p.grad_gamma, p.dim);
    }
  }
  return ATTNRES_OK;
}

// ---- The two-phase ops ----------------------------------------------------------
//
// The same scheme as the single op: tokens split into chunks whose size depends on
// the problem only, per-chunk rows of weight-gradient partial sums added in chunk
// order afterwards, so every output is bitwise identical for any thread count.
namespace cpu {
namespace {

// Row s of a [S, dim] tensor of the dtype (the per-query weights and their gradients).
const char* QueryRow(const void* v, int64_t s, const attnres_params& p) {
  return static_cast<const char*>(v) + s * p.dim * ElementBytes(p.dtype);
}
char* QueryRow(void* v, int64_t s, const attnres_params& p) {
  return static_cast<char*>(v) + s * p.dim * ElementBytes(p.dtype);
}

// The sizes of one two-phase call, and where its arena's parts start.
struct PhasePlan {
  int64_t S, N, padded, acc;
  bool norm, has_gamma, weight_grads;
  int64_t chunk_tokens, num_chunks;
  int threads;
  int64_t rows_bytes, scratch_bytes, partial_bytes;

  PhasePlan(const attnres_params& p, int phase, bool backward)
      : S(phase == 1 ? p.num_queries : 1), N(phase == 1 ? p.num_blocks : 0),
        padded(PaddedDim(p.dim, p.dtype)), acc(AccumBytes(p.dtype)),
        norm(phase == 2 && p.input_norm), has_gamma(p.rmsnorm && p.gamma != nullptr),
        weight_grads(backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr ||
                                  (phase == 2 && p.grad_norm_weight != nullptr))),
        // Chunks of a few tokens even for small calls, so that both threads work on a
        // decode-sized backward; at most 256 (the partial rows stay few and small).
        chunk_tokens(std::clamp<int64_t>((p.num_tokens + 31) / 32, 4, 256)),
        num_chunks((p.num_tokens + chunk_tokens - 1) / chunk_tokens),
        threads(ThreadsFor(num_chunks)),
        rows_bytes(Round64((S + (norm ? 1 : 0)) * padded * acc)),
        scratch_bytes(Round64(PhaseScratchBytes(S, N, padded, acc))),
        partial_bytes((weight_grads ? PhasePartialRows(phase, S) : 0) * padded * acc) {}

  // The arena: the weight rows, each thread's scratch, each chunk's partial rows.
  int64_t Bytes() const {
    return rows_bytes + threads * scratch_bytes + num_chunks * partial_bytes;
  }

  static int64_t Round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }
};

// The rows u_s = w_s * gamma_s at `rows`, then the input norm's weight (ones
// without one).
void PhaseWeightRows(const KernelTable& table, const attnres_params& p, const PhasePlan& plan,
                     char* rows) {
  const WeightRowFn weight_row = table.weight_row[p.dtype];
  for (int64_t s = 0; s < plan.S; ++s) {
    weight_row(QueryRow(p.proj_weight, s, p), plan.has_gamma ? QueryRow(p.gamma, s, p) : nullptr,
               p.dim, plan.padded, rows + s * plan.padded * plan.acc);
  }
  if (plan.norm) {
    weight_row(p.norm_weight, nullptr, p.dim, plan.padded, rows + plan.S * plan.padded * plan.acc);
  }
}

// Row r of the partials summed in chunk order (chunks partial_bytes apart), times
// a factor: dw_s = gamma_s * U_s, dgamma_s = w_s * U_s, the norm weight's U alone.
// On the calling thread unless the partials pass 4 MB (then the queries are
// split over threads): an OpenMP fork costs more than the sum of a small call.
void PhaseWeightGrads(const KernelTable& table, const attnres_params& p, int phase,
                      const PhasePlan& plan, const char* partials) {
  const WeightGradFn weight_grad = table.weight_grad[p.dtype];
  const auto grad = [&](int64_t r, const void* factor, void* out) {
    weight_grad(partials + r * plan.padded * plan.acc, plan.num_chunks,
                plan.partial_bytes / plan.acc, factor, out, p.dim);
  };
  const bool large = plan.num_chunks * plan.partial_bytes > (4 << 20);
  ParallelFor(large ? ThreadsFor(plan.S) : 1, plan.S, [&](int, int64_t s) {
    if (p.grad_proj_weight != nullptr) {
      grad(s, plan.has_gamma ? QueryRow(p.gamma, s, p) : nullptr,
           QueryRow(p.grad_proj_weight, s, p));
    }
    if (p.grad_gamma != nullptr) {
      grad(s, QueryRow(p.proj_weight, s, p), QueryRow(p.grad_gamma, s, p));
    }
  });
  if (phase == 2 && p.grad_norm_weight != nullptr) grad(1, nullptr, p.grad_norm_weight);
}

}  // namespace
}  // namespace cpu

attnres_status CpuTwoPhase(const attnres_params& p, int phase, bool backward) {
  using namespace cpu;
  const KernelTable& table = Table();
  const PhaseKernels& kernels = *table.two_phase;
  const PhaseRangeFn run =
      (phase == 1 ? (backward ? kernels.phase1_backward : kernels.phase1_forward)
                  : (backward ? kernels.phase2_backward : kernels.phase2_forward))[p.dtype];
  const PhasePlan plan(p, phase, backward);
  char* base = static_cast<char*>(ThreadArena(plan.Bytes()));
  if (base == nullptr) {
    return Fail(ATTNRES_ERROR_OUT_OF_MEMORY,
                "attnres: could not allocate " + std::to_string(plan.Bytes()) +
                    " bytes of scratch");
  }
  PhaseWeightRows(table, p, plan, base);
  char* scratch = base + plan.rows_bytes;
  char* partials = scratch + plan.threads * plan.scratch_bytes;
  std::memset(partials, 0, plan.num_chunks * plan.partial_bytes);
  PhaseInfo info = PhaseProblem(p);
  // Phase 1 backward's block gradients when large (the forward's S query rows are
  // written with normal stores: two_phase.cc, GroupMix).
  info.stream_stores = phase == 1 && backward && !p.accumulate_grads &&
                       plan.N * p.num_tokens * p.dim * ElementBytes(p.dtype) > kStreamStoreBytes;
  info.padded_dim = plan.padded;
  info.wg = base;
  info.norm_weight = plan.norm ? base + plan.S * plan.padded * plan.acc : nullptr;
  const int64_t chunk_tokens = plan.chunk_tokens;
  ParallelFor(plan.threads, plan.num_chunks, [&](int thread, int64_t c) {
    run(info, scratch + thread * plan.scratch_bytes,
        plan.weight_grads ? partials + c * plan.partial_bytes : nullptr, c * chunk_tokens,
        std::min((c + 1) * chunk_tokens, p.num_tokens));
  });
  if (plan.weight_grads) PhaseWeightGrads(table, p, phase, plan, partials);
  return ATTNRES_OK;
}

const char* CpuIsaName() { return cpu::IsaName(); }

}  // namespace attnres
