// CUDA kernels on the CPU, checked against the float64 reference (CI runs it:
// scripts/test.sh -> scripts/cuda_emulate.sh).
//
// What: runs the real device code of src/cuda (block_attn_res_fused.cuh,
// block_attn_res_generic.cuh, common.cuh's ReduceRowsKernel and the device
// half of two_phase.cu) in emu.h's fiber emulator and compares every output
// against src/ref (reference.h, two_phase_reference.h) with the tolerances of
// docs/SPEC.md §3 (ref::SpecTolerance, src/ref/reference.h: relative max error
// against the reference's max-abs). It also reruns each backward with a second
// (capped) grid size and requires identical bits for the source gradients and
// dw/dgamma (docs/CUDA.md: the bits depend on the problem only).
//
// Why: to find logic errors in the kernels (indexing, chunk layouts, W > 1
// warp partials, statistics placement, partial-row reduction) on a machine
// without a GPU. It is not a substitute for tests/cpp/test_cuda*.cc on a GPU:
// it cannot see data races, memory-model issues, launch/occupancy/register
// limits or device-math rounding (see emu.h).
//
// How: scripts/cuda_emulate.sh (copies src/cuda to a temp dir, rewrites
// `extern __shared__` arrays and cuts the device half out of two_phase.cu,
// builds this file with g++ against /usr/local/cuda/include, runs it).
// Arguments: [family ...] to run only some of block_fused, block_generic,
// phase1, phase2 (default: all); -v prints every case.
// Output: one line per failing check (kernel, configuration, tensor, worst
// element expected vs got), then one summary line per family; exit status 1
// on any mismatch.
//
// Coverage (the -v summary lists it): fused forward with 1/2/4 chunks per
// thread and fused backward with 1/2, each with W = 1 and W > 1 warps per token
// group, and the wide-row 8-chunk forward and 4-chunk backward (wg in shared
// memory), in bf16/fp16/fp32; the pipelined forward (1/2/4 chunks, W = 1 and
// W > 1) bit for bit against the register one where rows are 16-byte aligned;
// backward statistics in shared and in global memory;
// partial last chunks, misaligned rows (2-, 4-, 8-byte accesses), row padding,
// null source gradients, L > 128 (pointer tables in memory), with and without
// the forward's caches; generic kernels in all four dtypes incl. rows too wide
// for any fused layout; phase 1/2 forward and backward (accumulate, null
// gradients, S > 32, input norm, no partial block; phase 2's fused partial-block
// update: new_partial bit for bit round(partial + y), out bit for bit the plain
// merge of it, grad_partial_in added); every dw/dgamma/dnorm_weight
// through ReduceRowsKernel, with more partial rows than its 8 row lanes. Also
// checked: padding and guard bytes untouched, null gradients not written.
// Runtime: about 45 s to build and 85 s to run on 2 cores.
//
// The host-side choices (layouts, statistics placement, work items, grid
// shapes, ReduceRows launch) are made here the way src/cuda/*.cu makes them,
// from plan.h and the device half's own helpers, so a change to the host
// launch code of block_attn_res.cu / two_phase.cu must be mirrored here (that
// host code itself, runtime.cu and the C ABI are not exercised). One liberty:
// some phase-1 cases force the global statistics path at sizes where the host
// would use shared memory (the kernel takes whichever pointer it is given).
#include "emu.h"

#include <map>
#include <set>
#include <string>

#include "cuda/block_attn_res_fused.cuh"
#include "cuda/block_attn_res_generic.cuh"
#include "cuda/phase1_kernel.cuh"
#include "cuda/phase2_kernel.cuh"
#include "ref/reference.h"
#include "ref/two_phase_reference.h"

using namespace attnres::cuda;
namespace ref = attnres::ref;

static bool g_verbose = false;

// ---------------------------------------------------------------------------
// Bookkeeping.

struct Family {
  int cases = 0, checks = 0, failures = 0, det_failures = 0;
  int det_pairs = 0, det_distinct = 0;  // backward reruns; those whose two grids differ
  std::set<std::string> covered;
};
static std::map<std::string, Family> g_families;
static std::string g_family, g_case;
static bool g_case_failed = false;
static int g_last_grid = 0;  // the grid of the latest main kernel launch

// After a backward ran at two grid caps: counts the comparison, and whether
// the two grids really differed (else the bitwise check proves nothing).
static void CountDeterminism(int grid_a, int grid_b) {
  Family& f = g_families[g_family];
  ++f.det_pairs;
  if (grid_a != grid_b) ++f.det_distinct;
}

using ref::Tolerance;
static attnres_dtype DtypeOf(float*) { return ATTNRES_DTYPE_FLOAT32; }
static attnres_dtype DtypeOf(double*) { return ATTNRES_DTYPE_FLOAT64; }
static attnres_dtype DtypeOf(__half*) { return ATTNRES_DTYPE_FLOAT16; }
static attnres_dtype DtypeOf(__nv_bfloat16*) { return ATTNRES_DTYPE_BFLOAT16; }
template <typename T> Tolerance ToleranceOf() { return ref::SpecTolerance(DtypeOf(static_cast<T*>(nullptr))); }

static const char* Name(float*) { return "fp32"; }
static const char* Name(double*) { return "fp64"; }
static const char* Name(__half*) { return "fp16"; }
static const char* Name(__nv_bfloat16*) { return "bf16"; }
template <typename T> const char* DtypeName() { return Name(static_cast<T*>(nullptr)); }

static void Fail(const std::string& what) {
  if (!g_case_failed) printf("FAIL %s: %s\n", g_family.c_str(), g_case.c_str());
  g_case_failed = true;
  printf("    %s\n", what.c_str());
}

// tests/cpp/test_util.cc RelMaxError.
static void Check(const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want, double tol) {
  Family& f = g_families[g_family];
  ++f.checks;
  if (got.size() != want.size()) {
    ++f.failures;
    Fail(what + ": size " + std::to_string(got.size()) + " vs " + std::to_string(want.size()));
    return;
  }
  double max_ref = 0, max_err = 0;
  size_t worst = 0;
  bool nonfinite = false;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = got[i], e = want[i];
    if (!std::isfinite(e)) {
      if (!((std::isnan(e) && std::isnan(a)) || a == e)) { nonfinite = true; worst = i; }
      continue;
    }
    if (!std::isfinite(a)) { if (!nonfinite) worst = i; nonfinite = true; continue; }
    max_ref = std::max(max_ref, std::fabs(e));
    const double err = std::fabs(a - e);
    if (err > max_err) { max_err = err; if (!nonfinite) worst = i; }
  }
  const double rel = nonfinite ? INFINITY : (max_ref == 0 ? max_err : max_err / max_ref);
  if (rel <= tol) return;
  ++f.failures;
  char buf[512];
  snprintf(buf, sizeof buf,
           "%s: relative max error %.3g > %.3g (worst at element %zu: expected %.9g, got %.9g; "
           "max|expected| %.4g, %zu elements)",
           what.c_str(), rel, tol, worst, want[worst], got[worst], max_ref, got.size());
  Fail(buf);
}

// determinism = false: two different launches that must agree (not two grid sizes).
static void CheckBits(const std::string& what, const void* a, const void* b, size_t bytes,
                      bool determinism = true) {
  Family& f = g_families[g_family];
  ++f.checks;
  if (memcmp(a, b, bytes) == 0) return;
  if (determinism) ++f.det_failures;
  ++f.failures;
  const unsigned char* x = static_cast<const unsigned char*>(a);
  const unsigned char* y = static_cast<const unsigned char*>(b);
  size_t first = 0;
  while (x[first] == y[first]) ++first;
  Fail((determinism ? "determinism: " + what + " differs between the two grid sizes"
                     : what + ": the bits differ") +
       " (first differing byte " + std::to_string(first) + " of " + std::to_string(bytes) + ")");
}

// ---------------------------------------------------------------------------
// Data.

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }
  double Normal() {
    const double u = Uniform() + 1e-12, v = Uniform();
    return std::sqrt(-2 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

// Zero-initialized (poison where noted) 64-byte-aligned bytes.
struct Buf {
  std::vector<unsigned char> storage;
  unsigned char* p = nullptr;
  size_t bytes = 0;
  Buf() = default;
  explicit Buf(size_t n, unsigned char fill = 0) : storage(n + 64, fill), bytes(n) {
    p = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  }
  Buf(Buf&&) = default;
  Buf& operator=(Buf&&) = default;
  template <typename U> U* at() const { return reinterpret_cast<U*>(p); }
};

template <typename T> using BitsOf = typename Traits<T>::Bits;
template <typename T> using AccOf = typename Traits<T>::Acc;

template <typename T> double ToDouble(BitsOf<T> b) { return static_cast<double>(Traits<T>::ToAcc(b)); }
template <typename T> BitsOf<T> FromDouble(double x) { return Traits<T>::FromAcc(static_cast<AccOf<T>>(x)); }

// A [rows, stride] matrix of T whose data start `mis` elements into its buffer
// (misaligned rows when mis * sizeof(T) is not a multiple of 16); the padding
// holds a sentinel pattern that must survive.
template <typename T>
struct Mat {
  Buf buf;
  int64_t rows, dim, stride, mis;
  Mat(int64_t rows_, int64_t dim_, int64_t stride_, int64_t mis_)
      : buf((rows_ * stride_ + mis_ + 8) * sizeof(BitsOf<T>), 0x5C), rows(rows_), dim(dim_), stride(stride_), mis(mis_) {}
  BitsOf<T>* ptr() const { return buf.at<BitsOf<T>>() + mis; }
  void Fill(Rng& rng, double scale = 1.0, double offset = 0.0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < dim; ++d) ptr()[r * stride + d] = FromDouble<T>(offset + scale * rng.Normal());
  }
  std::vector<double> Dense() const {
    std::vector<double> v(rows * dim);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < dim; ++d) v[r * dim + d] = ToDouble<T>(ptr()[r * stride + d]);
    return v;
  }
  // The bytes outside the rows' first dim elements must be untouched.
  bool PaddingIntact() const {
    const unsigned char* base = buf.p;
    const size_t e = sizeof(BitsOf<T>);
    for (size_t i = 0; i < buf.bytes; ++i) {
      const int64_t el = static_cast<int64_t>(i / e) - mis;
      const bool inside = el >= 0 && el < rows * stride && el % stride < dim;
      if (!inside && base[i] != 0x5C) return false;
    }
    return true;
  }
};

template <typename A>
std::vector<double> AccVector(const Buf& b, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<double>(b.template at<A>()[i]);
  return v;
}

template <typename T>
static void CheckPadding(const std::string& what, const Mat<T>& m) {
  Family& f = g_families[g_family];
  ++f.checks;
  if (m.PaddingIntact()) return;
  ++f.failures;
  Fail(what + ": wrote outside its rows (padding or guard bytes changed)");
}

// ReduceRowsKernel exactly as block_attn_res.cu / two_phase.cu launch it.
template <typename T>
void ReduceRows(const void* partials, int64_t rows, int64_t width, const void* scale_by,
                const void* times, void* grad_scaled, void* grad_times) {
  using Acc = AccOf<T>;
  const dim3 block(plan::kReduceColumns, plan::kReduceRowLanes);
  const unsigned grid = static_cast<unsigned>((width + plan::kReduceColumns - 1) / plan::kReduceColumns);
  emu::Launch(dim3(grid), block, 0, [&] {
    ReduceRowsKernel<T>(static_cast<const Acc*>(partials), rows, width, scale_by, times, grad_scaled, grad_times);
  });
}

// ---------------------------------------------------------------------------
// The block op.

struct BlockCase {
  int64_t T;
  int64_t chunks;  // row chunks of 16 bytes (fp64: dim = chunks * 2)
  int64_t short_by;  // dim = chunks * vec - short_by: a partial last chunk when > 0
  int L;
  bool rmsnorm, caches;
  int mis, pad;
  int null_grads;  // bit i: grads[i] null (i < 30)
  bool want_dw;
  bool fused;
  int caps[2];  // two grid caps for the determinism check
};

template <typename T, typename Args>
void FillTables(int L, const std::vector<const void*>& sp, const std::vector<void*>* gp, Args& a) {
  a.sources.device_ptrs = nullptr;
  if (L > kMaxInlineSources) a.sources.device_ptrs = sp.data();
  else for (int i = 0; i < L; ++i) a.sources.inline_ptrs[i] = sp[i];
  if constexpr (!std::is_same_v<Args, FusedForwardArgs>) {
    a.grads.device_ptrs = nullptr;
    if (gp == nullptr) return;
    if (L > kMaxInlineSources) a.grads.device_ptrs = gp->data();
    else for (int i = 0; i < L; ++i) a.grads.inline_ptrs[i] = (*gp)[i];
  }
}

template <typename T>
void RunBlock(const BlockCase& c, uint64_t seed) {
  using Acc = AccOf<T>;
  constexpr bool kF64 = std::is_same_v<T, double>;
  using CacheT = std::conditional_t<kF64, double, float>;
  const int vec = plan::ChunkElements(sizeof(BitsOf<T>));
  const int64_t T_ = c.T, D = c.chunks * vec - c.short_by, S = D + c.pad;
  const int L = c.L;
  const Tolerance tol = ToleranceOf<T>();
  const double scale = 0.625, eps = 1e-6;
  const bool fused = c.fused && !kF64;
  g_family = fused ? "block_fused" : "block_generic";
  Family& fam = g_families[g_family];
  ++fam.cases;
  char desc[256];
  snprintf(desc, sizeof desc, "%s T=%ld D=%ld L=%d rmsnorm=%d caches=%d mis=%d pad=%d null_grads=0x%x dw=%d",
           DtypeName<T>(), (long)T_, (long)D, L, c.rmsnorm, c.caches, c.mis, c.pad, c.null_grads, c.want_dw);
  g_case = desc;
  g_case_failed = false;

  Rng rng(seed);
  std::vector<Mat<T>> src;
  for (int i = 0; i < L; ++i) { src.emplace_back(T_, D, S, c.mis); src.back().Fill(rng); }
  Mat<T> w(1, D, D, 0), gamma(1, D, D, 0);
  w.Fill(rng, 0.1);
  gamma.Fill(rng, 0.2, 1.0);
  Mat<T> out(T_, D, S + 1, c.mis), g(T_, D, S + 3, c.mis);
  g.Fill(rng);
  Buf rms_cache(T_ * L * sizeof(CacheT)), alpha_cache(T_ * L * sizeof(CacheT));
  std::vector<const void*> sp(L);
  for (int i = 0; i < L; ++i) sp[i] = src[i].ptr();

  ref::Problem prob;
  prob.tokens = T_; prob.dim = D; prob.num_blocks = L; prob.has_partial = false;
  prob.rmsnorm = c.rmsnorm; prob.scale = scale; prob.eps = eps;
  for (int i = 0; i < L; ++i) prob.sources.push_back(src[i].Dense());
  prob.w = w.Dense();
  if (c.rmsnorm) prob.gamma = gamma.Dense();
  const ref::ForwardResult rf = ref::Forward(prob);
  const ref::BackwardResult rb = ref::Backward(prob, g.Dense());

  // Forward.
  std::string fwd_kernel;
  if constexpr (!kF64) if (fused) {
    plan::Layout layout;
    if (!plan::ChooseLayout(D, vec, plan::kForwardShapes, &layout)) { Fail("no forward layout"); return; }
    FusedForwardArgs a;
    FillTables<T>(L, sp, nullptr, a);
    a.w = w.ptr(); a.gamma = c.rmsnorm ? gamma.ptr() : nullptr; a.out = out.ptr();
    a.rms_cache = c.caches ? rms_cache.template at<float>() : nullptr;
    a.alpha_cache = c.caches ? alpha_cache.template at<float>() : nullptr;
    a.num_tokens = T_;
    a.strides = {S, S + 1, 0, 0};
    a.dim = static_cast<int>(D); a.padded_dim = static_cast<int>(layout.row_chunks * vec); a.num_sources = L;
    a.group_threads = layout.group_threads; a.scale = static_cast<float>(scale); a.eps = static_cast<float>(eps);
    a.rmsnorm = c.rmsnorm;
    const int threads = layout.group_threads * layout.groups_per_cta;
    const int64_t steps = (T_ + layout.groups_per_cta - 1) / layout.groups_per_cta;
    const int grid = static_cast<int>(plan::PersistentGridSize(steps, 1, 1 << 20, c.caps[0]));
    auto run = [&](auto kernel, size_t ring_bytes) {
      emu::Launch(dim3(grid), dim3(threads), a.padded_dim * sizeof(float) + ring_bytes, [&] { kernel(a); });
    };
    if (layout.chunks == 8) run(FusedForwardKernel<T, 8, 0>, 0);
    else if (layout.chunks == 4) run(FusedForwardKernel<T, 4, 0>, 0);
    else if (layout.chunks == 2) run(FusedForwardKernel<T, 2, 0>, 0);
    else run(FusedForwardKernel<T, 1, 0>, 0);
    // The pipelined forward (rows 16-byte aligned, as the host requires), at the
    // second grid size: every bit as the register kernel's.
    const bool aligned = (c.mis * sizeof(BitsOf<T>)) % 16 == 0 && (S * sizeof(BitsOf<T>)) % 16 == 0;
    if (aligned && plan::ForwardCanPipeline(layout.chunks)) {
      Mat<T> out2(T_, D, S + 1, c.mis);
      Buf rms2(T_ * L * sizeof(CacheT)), alpha2(T_ * L * sizeof(CacheT));
      FusedForwardArgs b = a;
      b.out = out2.ptr();
      b.rms_cache = c.caches ? rms2.template at<float>() : nullptr;
      b.alpha_cache = c.caches ? alpha2.template at<float>() : nullptr;
      const int grid2 = static_cast<int>(plan::PersistentGridSize(steps, 1, 1 << 20, c.caps[1]));
      const size_t ring = plan::ForwardRingBytes(layout.chunks, threads);
      auto run2 = [&](auto kernel) {
        emu::Launch(dim3(grid2), dim3(threads), b.padded_dim * sizeof(float) + ring, [&] { kernel(b); });
      };
      using plan::ForwardStages;
      if (layout.chunks == 4) run2(FusedForwardKernel<T, 4, ForwardStages(4)>);
      else if (layout.chunks == 2) run2(FusedForwardKernel<T, 2, ForwardStages(2)>);
      else run2(FusedForwardKernel<T, 1, ForwardStages(1)>);
      const std::string what = "pipelined forward (grid " + std::to_string(grid2) + ")";
      CheckBits(what + " h", out.ptr(), out2.ptr(), (T_ * (S + 1)) * sizeof(BitsOf<T>), false);
      CheckPadding(what + " h", out2);
      if (c.caches) {
        CheckBits(what + " alpha_cache", alpha_cache.p, alpha2.p, alpha2.bytes, false);
        CheckBits(what + " rms_cache", rms_cache.p, rms2.p, rms2.bytes, false);
      }
      fam.covered.insert(std::string("fwd pipelined ") + DtypeName<T>() + " chunks=" +
                         std::to_string(layout.chunks) + (layout.group_threads > 32 ? " W>1" : " W=1"));
    }
    char k[128];
    snprintf(k, sizeof k, "FusedForwardKernel<%s,%d> G=%d W=%d groups/CTA=%d grid=%d", DtypeName<T>(),
             layout.chunks, layout.group_threads, layout.group_threads / 32, layout.groups_per_cta, grid);
    fwd_kernel = k;
    fam.covered.insert(std::string("fwd ") + DtypeName<T>() + " chunks=" + std::to_string(layout.chunks) +
                       (layout.group_threads > 32 ? " W>1" : " W=1"));
  }
  if (!fused) {
    GenericArgs a{};
    FillTables<T>(L, sp, nullptr, a);
    a.w = w.ptr(); a.gamma = c.rmsnorm ? gamma.ptr() : nullptr; a.grad_out = nullptr; a.out = out.ptr();
    a.rms_cache = c.caches ? rms_cache.p : nullptr; a.alpha_cache = c.caches ? alpha_cache.p : nullptr;
    const int grid = static_cast<int>(plan::PersistentGridSize(T_, 1, 1 << 20, c.caps[0]));
    Buf stats(grid * 4 * L * sizeof(Acc), 0x77);
    a.stats_scratch = stats.p; a.u_partials = nullptr; a.num_tokens = T_;
    a.num_chunks = plan::NumPartialRows(T_);
    a.dim = D; a.strides = {S, S + 1, 0, 0}; a.num_sources = L; a.scale = scale; a.eps = eps; a.rmsnorm = c.rmsnorm;
    emu::Launch(dim3(grid), dim3(kGenericThreads), 0, [&] { GenericForwardKernel<T>(a); });
    fwd_kernel = std::string("GenericForwardKernel<") + DtypeName<T>() + "> grid=" + std::to_string(grid);
    fam.covered.insert(std::string("fwd ") + DtypeName<T>() + (c.chunks > 2048 ? " wide" : ""));
  }
  g_case = std::string(desc) + " | " + fwd_kernel;
  Check("h", out.Dense(), rf.out, tol.out);
  CheckPadding("h", out);
  if (c.caches) {
    Check("alpha_cache", AccVector<CacheT>(alpha_cache, T_ * L), rf.alpha, tol.cache);
    if (c.rmsnorm) Check("rms_cache", AccVector<CacheT>(rms_cache, T_ * L), rf.rms, tol.cache);
  }

  // Backward, at two grid sizes.
  struct BwdOut {
    std::vector<Mat<T>> grads;
    Mat<T> dw{1, 1, 1, 0}, dgamma{1, 1, 1, 0};
    Buf u;
  };
  const int64_t rows = plan::NumPartialRows(T_);
  std::string bwd_kernel;
  // grad_out with 16-byte-aligned rows for the pipelined backward, which needs
  // them (g's stride S + 3 misaligns them); a stride other than the sources' S,
  // so that reading grad_out with the sources' stride shows.
  const int64_t Sg = S + plan::ChunkElements(sizeof(BitsOf<T>));
  Mat<T> g_aligned(T_, D, Sg, c.mis);
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t d = 0; d < D; ++d) g_aligned.ptr()[t * Sg + d] = g.ptr()[t * (S + 3) + d];
  const bool rows_aligned = (c.mis * sizeof(BitsOf<T>)) % 16 == 0 && (S * sizeof(BitsOf<T>)) % 16 == 0;
  bool ran_pipelined = false;
  auto backward = [&](int cap, BwdOut& o, bool pipelined) {
    o.grads.clear();
    for (int i = 0; i < L; ++i) o.grads.emplace_back(T_, D, S + 2, c.mis);
    o.dw = Mat<T>(1, D, D, 0);
    o.dgamma = Mat<T>(1, D, D, 0);
    o.u = Buf(rows * D * sizeof(Acc), 0x33);
    std::vector<void*> gp(L);
    for (int i = 0; i < L; ++i) gp[i] = i < 30 && ((c.null_grads >> i) & 1) ? nullptr : o.grads[i].ptr();
    char k[160] = "";
    if constexpr (!kF64) if (fused) {
      plan::Layout layout;
      if (!plan::ChooseLayout(D, vec, plan::kBackwardShapes, &layout)) { Fail("no backward layout"); return; }
      const plan::StatsPlacement placement = plan::PlaceBackwardStats(L, vec, &layout);
      const bool pipe = pipelined && plan::BackwardCanPipeline(layout.chunks);
      ran_pipelined = pipe;
      FusedBackwardArgs a;
      FillTables<T>(L, sp, &gp, a);
      a.w = w.ptr(); a.gamma = c.rmsnorm ? gamma.ptr() : nullptr; a.grad_out = pipe ? g_aligned.ptr() : g.ptr();
      a.rms_cache = c.caches ? rms_cache.template at<float>() : nullptr;
      a.alpha_cache = c.caches ? alpha_cache.template at<float>() : nullptr;
      const int threads = layout.group_threads * layout.groups_per_cta;
      const int64_t items = plan::NumWorkItems(T_, layout.groups_per_cta);
      const int grid = static_cast<int>(plan::PersistentGridSize(items, 1, 1 << 20, cap));
      g_last_grid = grid;
      Buf stats(placement.shared ? 0 : grid * layout.groups_per_cta * placement.bytes_per_group, 0x11);
      a.stats_scratch = placement.shared ? nullptr : stats.template at<float>();
      a.u_partials = c.want_dw ? o.u.template at<float>() : nullptr;
      a.num_tokens = T_; a.num_items = items;
      a.strides = {S, 0, pipe ? Sg : S + 3, S + 2};
      a.dim = static_cast<int>(D); a.num_sources = L; a.group_threads = layout.group_threads;
      a.stats_floats = static_cast<int>(placement.bytes_per_group / sizeof(float));
      a.weight_floats = static_cast<int>(placement.weight_bytes / sizeof(float));
      // As block_attn_res.cu lays it out: the ring after the statistics, 16-byte aligned.
      const size_t ring_offset = (placement.dynamic_shared_bytes + 15) / 16;
      a.ring_offset = static_cast<int>(ring_offset);
      const size_t smem = pipe ? 16 * ring_offset + plan::BackwardRingBytes(layout.chunks, threads)
                               : placement.dynamic_shared_bytes;
      a.scale = static_cast<float>(scale); a.eps = static_cast<float>(eps); a.rmsnorm = c.rmsnorm;
      auto run = [&](auto kernel) {
        emu::Launch(dim3(grid), dim3(threads), smem, [&] { kernel(a); });
      };
      using plan::BackwardStages;
      if (layout.chunks == 4) run(FusedBackwardKernel<T, 4, 0>);
      else if (layout.chunks == 2 && pipe) run(FusedBackwardKernel<T, 2, BackwardStages(2)>);
      else if (layout.chunks == 2) run(FusedBackwardKernel<T, 2, 0>);
      else if (pipe) run(FusedBackwardKernel<T, 1, BackwardStages(1)>);
      else run(FusedBackwardKernel<T, 1, 0>);
      snprintf(k, sizeof k, "FusedBackwardKernel<%s,%d>%s G=%d W=%d groups/CTA=%d stats=%s", DtypeName<T>(),
               layout.chunks, pipe ? " (pipelined)" : "", layout.group_threads, layout.group_threads / 32,
               layout.groups_per_cta, placement.shared ? "shared" : "global");
      fam.covered.insert(std::string("bwd ") + (pipe ? "pipelined " : "") + DtypeName<T>() + " chunks=" +
                         std::to_string(layout.chunks) + (layout.group_threads > 32 ? " W>1" : " W=1") +
                         (placement.shared ? " shared" : " global"));
    }
    if (!fused) {
      GenericArgs a{};
      FillTables<T>(L, sp, &gp, a);
      a.w = w.ptr(); a.gamma = c.rmsnorm ? gamma.ptr() : nullptr; a.grad_out = g.ptr(); a.out = nullptr;
      a.rms_cache = c.caches ? rms_cache.p : nullptr; a.alpha_cache = c.caches ? alpha_cache.p : nullptr;
      const int grid = static_cast<int>(plan::PersistentGridSize(rows, 1, 1 << 20, cap));
      g_last_grid = grid;
      Buf stats(grid * 4 * L * sizeof(Acc), 0x77);
      a.stats_scratch = stats.p; a.u_partials = c.want_dw ? o.u.p : nullptr;
      a.num_tokens = T_; a.num_chunks = rows;
      a.dim = D; a.strides = {S, 0, S + 3, S + 2}; a.num_sources = L; a.scale = scale; a.eps = eps;
      a.rmsnorm = c.rmsnorm;
      emu::Launch(dim3(grid), dim3(kGenericThreads), 0, [&] { GenericBackwardKernel<T>(a); });
      snprintf(k, sizeof k, "GenericBackwardKernel<%s>", DtypeName<T>());
      fam.covered.insert(std::string("bwd ") + DtypeName<T>() + (c.chunks > 2048 ? " wide" : ""));
    }
    bwd_kernel = k;
    if (c.want_dw) {
      ReduceRows<T>(o.u.p, rows, D, c.rmsnorm ? gamma.ptr() : nullptr, w.ptr(), o.dw.ptr(), o.dgamma.ptr());
    }
  };
  BwdOut a, b;
  backward(c.caps[0], a, false);
  const int grid_a = g_last_grid;
  g_case = std::string(desc) + " | " + bwd_kernel + " grid cap " + std::to_string(c.caps[0]);
  for (int i = 0; i < L; ++i) {
    if (i < 30 && ((c.null_grads >> i) & 1)) {
      ++fam.checks;
      if (!a.grads[i].PaddingIntact()) { ++fam.failures; Fail("grad_source[" + std::to_string(i) + "] is null but was written"); }
      continue;
    }
    Check("grad_source[" + std::to_string(i) + "]", a.grads[i].Dense(), rb.grad_sources[i], tol.grad);
    CheckPadding("grad_source[" + std::to_string(i) + "]", a.grads[i]);
  }
  if (c.want_dw) {
    Check("dw (ReduceRowsKernel)", a.dw.Dense(), rb.grad_w, tol.grad);
    if (c.rmsnorm) Check("dgamma (ReduceRowsKernel)", a.dgamma.Dense(), rb.grad_gamma, tol.grad);
  }
  backward(c.caps[1], b, false);
  CountDeterminism(grid_a, g_last_grid);
  const auto same_bits = [&](const BwdOut& x, const std::string& why, bool determinism) {
    for (int i = 0; i < L; ++i)
      CheckBits("grad_source[" + std::to_string(i) + "]" + why, a.grads[i].buf.p, x.grads[i].buf.p,
                a.grads[i].buf.bytes, determinism);
    if (c.want_dw) {
      CheckBits("dw partial rows" + why, a.u.p, x.u.p, a.u.bytes, determinism);
      CheckBits("dw" + why, a.dw.buf.p, x.dw.buf.p, a.dw.buf.bytes, determinism);
      CheckBits("dgamma" + why, a.dgamma.buf.p, x.dgamma.buf.p, a.dgamma.buf.bytes, determinism);
    }
  };
  same_bits(b, " (grid caps " + std::to_string(c.caps[0]) + " vs " + std::to_string(c.caps[1]) + ")", true);
  // The pipelined backward (aligned rows), at the second grid size: the register kernel's bits.
  if (rows_aligned && fused) {
    BwdOut p;
    backward(c.caps[1], p, true);
    if (ran_pipelined) same_bits(p, " (pipelined backward, grid cap " + std::to_string(c.caps[1]) + ")", false);
  }
  if (g_verbose) printf("  ok? %d  %s\n", !g_case_failed, g_case.c_str());
}

// ---------------------------------------------------------------------------
// Phase 1 (S queries over N blocks) and phase 2 (merge with the partial block).

struct Phase1Case {
  int64_t T, chunks, short_by, N, S;
  bool rmsnorm, accumulate, weight_grads, force_global;
  int mis, pad;
  int null_blocks;  // bit i: grad_blocks[i] null
  int null_gouts;   // bit s: grad_outs[s] null; bit 16 + s: grad_lses[s] null
  int caps[2];
};

template <typename T>
void RunPhase1(const Phase1Case& c, uint64_t seed) {
  using Acc = AccOf<T>;
  constexpr int kVec = Io<T>::kVec;
  const int64_t T_ = c.T, D = c.chunks * kVec - c.short_by, N = c.N, S = c.S, St = D + c.pad;
  const Tolerance tol = ToleranceOf<T>();
  const double scale = 0.625, eps = 1e-6;
  g_family = "phase1";
  Family& fam = g_families[g_family];
  ++fam.cases;
  char desc[256];
  snprintf(desc, sizeof desc, "%s T=%ld D=%ld N=%ld S=%ld rmsnorm=%d accumulate=%d dw=%d mis=%d pad=%d null_blocks=0x%x null_gouts=0x%x",
           DtypeName<T>(), (long)T_, (long)D, (long)N, (long)S, c.rmsnorm, c.accumulate, c.weight_grads, c.mis, c.pad,
           c.null_blocks, c.null_gouts);
  g_case = desc;
  g_case_failed = false;
  Rng rng(seed);
  std::vector<Mat<T>> blocks, gouts, init;
  for (int i = 0; i < N; ++i) { blocks.emplace_back(T_, D, St, c.mis); blocks.back().Fill(rng); }
  for (int i = 0; i < N; ++i) { init.emplace_back(T_, D, St + 2, c.mis); init.back().Fill(rng); }
  for (int s = 0; s < S; ++s) { gouts.emplace_back(T_, D, St + 3, c.mis); gouts.back().Fill(rng); }
  std::vector<Buf> glses;
  for (int s = 0; s < S; ++s) {
    glses.emplace_back(T_ * sizeof(Acc));
    for (int64_t t = 0; t < T_; ++t) glses.back().template at<Acc>()[t] = static_cast<Acc>(0.3 * rng.Normal());
  }
  Mat<T> w(S, D, D, 0), gamma(S, D, D, 0);
  w.Fill(rng, 0.1);
  gamma.Fill(rng, 0.2, 1.0);
  auto gout_null = [&](int64_t s) { return s < 16 && ((c.null_gouts >> s) & 1); };
  auto glse_null = [&](int64_t s) { return s < 16 && ((c.null_gouts >> (16 + s)) & 1); };
  auto gblock_null = [&](int64_t i) { return i < 30 && ((c.null_blocks >> i) & 1); };

  ref::Phase1Problem prob;
  prob.tokens = T_; prob.dim = D; prob.num_queries = S; prob.rmsnorm = c.rmsnorm; prob.scale = scale; prob.eps = eps;
  for (auto& b : blocks) prob.blocks.push_back(b.Dense());
  prob.w = w.Dense();
  if (c.rmsnorm) prob.gamma = gamma.Dense();
  std::vector<std::vector<double>> rg(S), rl(S);
  for (int s = 0; s < S; ++s) {
    if (!gout_null(s)) rg[s] = gouts[s].Dense();
    if (!glse_null(s)) rl[s] = AccVector<Acc>(glses[s], T_);
  }
  const ref::Phase1ForwardResult rf = ref::Phase1Forward(prob);
  const ref::Phase1BackwardResult rb = ref::Phase1Backward(prob, rg, rl);

  const int64_t row_chunks = (D + kVec - 1) / kVec, padded = row_chunks * kVec;
  Buf weights((S + 1) * padded * sizeof(Acc));
  {
    const int64_t total = S * padded;
    const int grid = static_cast<int>(std::clamp<int64_t>((total + 255) / 256, 1, 4096));
    emu::Launch(dim3(grid), dim3(256), 0, [&] {
      PrepareWeightsKernel<T>(w.ptr(), c.rmsnorm ? gamma.ptr() : nullptr, nullptr, false, S, D, padded, weights.template at<Acc>());
    });
  }
  const int threads = static_cast<int>(std::clamp<int64_t>((row_chunks + 31) / 32 * 32, 32, kPhase1MaxThreads));
  std::vector<const void*> bp(N);
  for (int i = 0; i < N; ++i) bp[i] = blocks[i].ptr();

  struct Out {
    std::vector<Mat<T>> mats;  // forward: o_s; backward: grad_blocks
    std::vector<Buf> lses;
    Buf partials, dw, dgamma;
  };
  std::string kname;
  auto launch = [&](bool backward, int cap, Out& o) {
    const bool wg = backward && c.weight_grads;
    const int64_t tpi = wg ? TokensPerItem(T_, S, D, sizeof(Acc)) : 1;
    const int64_t items = (T_ + tpi - 1) / tpi;
    Phase1Args a;
    a.shape = {T_, tpi, items, D, row_chunks, {St, St + 1, St + 3, St + 2}};
    a.u = weights.p;
    a.blocks = {}; a.grad_blocks = {}; a.outs = {}; a.lses = {}; a.grad_outs = {}; a.grad_lses = {};
    if (N > kMaxInlineSources) a.blocks.device_ptrs = bp.data();
    else for (int i = 0; i < N; ++i) a.blocks.inline_ptrs[i] = bp[i];
    std::vector<void*> gbp(N), op(S), lp(S);
    std::vector<const void*> gop(S), glp(S);
    o.mats.clear(); o.lses.clear();
    if (backward) {
      for (int i = 0; i < N; ++i) {
        o.mats.emplace_back(init[i].rows, D, init[i].stride, c.mis);
        memcpy(o.mats.back().buf.p, init[i].buf.p, init[i].buf.bytes);
        gbp[i] = gblock_null(i) ? nullptr : o.mats.back().ptr();
      }
      for (int s = 0; s < S; ++s) {
        gop[s] = gout_null(s) ? nullptr : gouts[s].ptr();
        glp[s] = glse_null(s) ? nullptr : glses[s].p;
      }
      if (N > kMaxInlineSources) a.grad_blocks.device_ptrs = gbp.data();
      else for (int i = 0; i < N; ++i) a.grad_blocks.inline_ptrs[i] = gbp[i];
      if (S > kMaxInlineQueries) { a.grad_outs.device_ptrs = gop.data(); a.grad_lses.device_ptrs = glp.data(); }
      else for (int s = 0; s < S; ++s) { a.grad_outs.inline_ptrs[s] = gop[s]; a.grad_lses.inline_ptrs[s] = glp[s]; }
    } else {
      for (int s = 0; s < S; ++s) {
        o.mats.emplace_back(T_, D, St + 1, c.mis);
        o.lses.emplace_back(T_ * sizeof(Acc), 0x5C);
        op[s] = o.mats.back().ptr();
        lp[s] = o.lses.back().p;
      }
      if (S > kMaxInlineQueries) { a.outs.device_ptrs = op.data(); a.lses.device_ptrs = lp.data(); }
      else for (int s = 0; s < S; ++s) { a.outs.inline_ptrs[s] = op[s]; a.lses.inline_ptrs[s] = lp[s]; }
    }
    a.any_grad_block = std::any_of(gbp.begin(), gbp.end(), [](void* p) { return p != nullptr; });
    a.stats_elems = Phase1StatsElems(N, S, threads / 32, backward);
    const size_t stats_bytes = a.stats_elems * sizeof(Acc);
    const bool shared = stats_bytes <= kSharedStatsBudget && !c.force_global;
    int grid = static_cast<int>(plan::PersistentGridSize(items, 1, 1 << 20, cap));
    g_last_grid = grid;
    if (!shared) grid = static_cast<int>(std::clamp<int64_t>(kGlobalStatsBudgetBytes / static_cast<int64_t>(stats_bytes), 1, grid));
    g_last_grid = grid;
    Buf stats(shared ? 0 : grid * stats_bytes, 0x19);
    a.stats_global = shared ? nullptr : stats.p;
    o.partials = Buf(items * S * D * sizeof(Acc) + 8, 0x42);
    a.u_partials = wg ? o.partials.p : nullptr;
    a.num_blocks = N; a.num_queries = S; a.scale = scale; a.eps = eps; a.rmsnorm = c.rmsnorm;
    a.accumulate = backward && c.accumulate;
    if (backward) emu::Launch(dim3(grid), dim3(threads), shared ? stats_bytes : 0, [&] { Phase1Kernel<T, true>(a); });
    else emu::Launch(dim3(grid), dim3(threads), shared ? stats_bytes : 0, [&] { Phase1Kernel<T, false>(a); });
    char k[160];
    snprintf(k, sizeof k, "Phase1Kernel<%s,%s> threads=%d grid=%d items=%ld stats=%s", DtypeName<T>(),
             backward ? "backward" : "forward", threads, grid, (long)items, shared ? "shared" : "global");
    kname = k;
    fam.covered.insert(std::string(DtypeName<T>()) + (backward ? " bwd" : " fwd") + (shared ? " shared" : " global") +
                       (threads > 32 ? " W>1" : " W=1"));
    o.dw = Buf(S * D * sizeof(BitsOf<T>), 0x5C);
    o.dgamma = Buf(S * D * sizeof(BitsOf<T>), 0x5C);
    if (wg) ReduceRows<T>(o.partials.p, items, S * D, c.rmsnorm ? gamma.ptr() : nullptr, w.ptr(), o.dw.p, o.dgamma.p);
  };

  Out f;
  launch(false, c.caps[0], f);
  g_case = std::string(desc) + " | " + kname;
  for (int s = 0; s < S; ++s) {
    Check("o[" + std::to_string(s) + "]", f.mats[s].Dense(), rf.outs[s], tol.out);
    CheckPadding("o[" + std::to_string(s) + "]", f.mats[s]);
    Check("lse[" + std::to_string(s) + "]", AccVector<Acc>(f.lses[s], T_), rf.lses[s], tol.cache);
  }
  Out a, b;
  launch(true, c.caps[0], a);
  const int grid_a = g_last_grid;
  g_case = std::string(desc) + " | " + kname;
  for (int i = 0; i < N; ++i) {
    if (gblock_null(i)) {
      ++fam.checks;
      if (memcmp(a.mats[i].buf.p, init[i].buf.p, init[i].buf.bytes) != 0) { ++fam.failures; Fail("grad_blocks[" + std::to_string(i) + "] is null but was written"); }
      continue;
    }
    std::vector<double> want = rb.grad_blocks[i];
    if (c.accumulate) {
      const std::vector<double> before = init[i].Dense();
      for (size_t k = 0; k < want.size(); ++k) want[k] += before[k];
    }
    Check("grad_blocks[" + std::to_string(i) + "]", a.mats[i].Dense(), want, tol.grad);
    CheckPadding("grad_blocks[" + std::to_string(i) + "]", a.mats[i]);
  }
  if (c.weight_grads) {
    std::vector<double> dw(S * D), dg(S * D);
    for (int64_t k = 0; k < S * D; ++k) {
      dw[k] = ToDouble<T>(a.dw.template at<BitsOf<T>>()[k]);
      dg[k] = ToDouble<T>(a.dgamma.template at<BitsOf<T>>()[k]);
    }
    Check("dw (ReduceRowsKernel)", dw, rb.grad_w, tol.grad);
    if (c.rmsnorm) Check("dgamma (ReduceRowsKernel)", dg, rb.grad_gamma, tol.grad);
  }
  launch(true, c.caps[1], b);
  CountDeterminism(grid_a, g_last_grid);
  const std::string caps = " (grid caps " + std::to_string(c.caps[0]) + " vs " + std::to_string(c.caps[1]) + ")";
  for (int i = 0; i < N; ++i)
    CheckBits("grad_blocks[" + std::to_string(i) + "]" + caps, a.mats[i].buf.p, b.mats[i].buf.p, a.mats[i].buf.bytes);
  if (c.weight_grads) {
    CheckBits("dw" + caps, a.dw.p, b.dw.p, a.dw.bytes);
    CheckBits("dgamma" + caps, a.dgamma.p, b.dgamma.p, a.dgamma.bytes);
  }
  if (g_verbose) printf("  ok? %d  %s\n", !g_case_failed, g_case.c_str());
}

struct Phase2Case {
  int64_t T, chunks, short_by;
  bool rmsnorm, partial, input_norm, weight_grads;
  int mis, pad;
  int null_grads;  // bit 0: grad_o, bit 1: grad_partial, bit 2: grad_lse null
  int caps[2];
  // The fused partial-block update: bit 0, the forward adds y (partial_update) and
  // writes p' (new_partial); bit 1, the backward adds grad_partial_in. Both need a
  // partial block; with bit 0 the backward reads p' as its partial block.
  int fused = 0;
  // Sharp depth attention (SPEC §3): when merge_gap != 0, lse = z_p + merge_gap per
  // token, so that the merge weights are sigmoid(+-merge_gap): one of them down to
  // 1e-13 at a gap of 30, the partial block partial_size times the others in size.
  double merge_gap = 0, partial_size = 1;
};

// The bits of a + b computed as a separate addition would (in the accumulation
// type, then rounded to T to nearest even), worked out here rather than through
// Traits<T>::FromAcc, which the kernel's own stores use.
template <typename T>
BitsOf<T> AddRounded(BitsOf<T> a, BitsOf<T> b) {
  const AccOf<T> sum = Traits<T>::ToAcc(a) + Traits<T>::ToAcc(b);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    uint32_t bits;
    memcpy(&bits, &sum, sizeof bits);
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  } else if constexpr (std::is_same_v<T, __half>) {
    const _Float16 h = static_cast<_Float16>(sum);
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
  } else {
    BitsOf<T> bits;
    memcpy(&bits, &sum, sizeof bits);
    return bits;
  }
}

template <typename T>
void RunPhase2(const Phase2Case& c, uint64_t seed) {
  using Acc = AccOf<T>;
  constexpr int kVec = Io<T>::kVec;
  const int64_t T_ = c.T, D = c.chunks * kVec - c.short_by, St = D + c.pad;
  const Tolerance tol = ToleranceOf<T>();
  const double scale = 0.625, eps = 1e-6, norm_eps = 1e-5;
  g_family = "phase2";
  Family& fam = g_families[g_family];
  ++fam.cases;
  const bool update = c.partial && (c.fused & 1);
  const bool grad_in = c.partial && (c.fused & 2) && !(c.null_grads & 2);
  char desc[256];
  snprintf(desc, sizeof desc, "%s T=%ld D=%ld rmsnorm=%d partial=%d input_norm=%d dw=%d mis=%d pad=%d null_grads=0x%x fused=%d"
           " merge_gap=%g partial_size=%g",
           DtypeName<T>(), (long)T_, (long)D, c.rmsnorm, c.partial, c.input_norm, c.weight_grads, c.mis, c.pad, c.null_grads,
           (update ? 1 : 0) | (grad_in ? 2 : 0), c.merge_gap, c.partial_size);
  g_case = desc;
  g_case_failed = false;
  Rng rng(seed);
  Mat<T> o(T_, D, St, c.mis), p(T_, D, St, c.mis), g(T_, D, St + 3, c.mis);
  o.Fill(rng); p.Fill(rng, c.partial_size); g.Fill(rng);
  // The fused update's y (a sub-layer's output, smaller than p), the p' = p + y it
  // must give (the backward's partial block), and the gradient p' gets elsewhere.
  Mat<T> y(T_, D, St, c.mis), p_new(T_, D, St, c.mis), g_in(T_, D, St + 3, c.mis);
  if (update) {
    y.Fill(rng, 0.3 * c.partial_size);
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t d = 0; d < D; ++d)
        p_new.ptr()[t * St + d] = AddRounded<T>(p.ptr()[t * St + d], y.ptr()[t * St + d]);
  }
  if (grad_in) g_in.Fill(rng);
  const Mat<T>& merged = update ? p_new : p;  // the partial block that is merged
  Buf lse(T_ * sizeof(Acc));
  for (int64_t t = 0; t < T_; ++t) lse.template at<Acc>()[t] = static_cast<Acc>(1.0 + rng.Normal());
  Mat<T> w(1, D, D, 0), gamma(1, D, D, 0), nw(1, D, D, 0);
  // Without RMSNorm, w / partial_size keeps z_p of order one (a logit of 1000 has
  // an fp32 ulp of 6e-5: that would measure large logits, not sharp ones).
  w.Fill(rng, c.rmsnorm ? 0.1 : 0.1 / c.partial_size);
  gamma.Fill(rng, 0.2, 1.0);
  nw.Fill(rng, 0.2, 1.0);
  if (c.merge_gap != 0 && c.partial) {
    const std::vector<double> pv = merged.Dense(), wv = w.Dense(), gv = gamma.Dense();
    for (int64_t t = 0; t < T_; ++t) {
      double dot = 0, sum_sq = 0;
      for (int64_t d = 0; d < D; ++d) {
        dot += wv[d] * (c.rmsnorm ? gv[d] : 1.0) * pv[t * D + d];
        sum_sq += pv[t * D + d] * pv[t * D + d];
      }
      const double r = c.rmsnorm ? std::sqrt(sum_sq / D + eps) : 1.0;
      lse.template at<Acc>()[t] = static_cast<Acc>(scale * dot / r + c.merge_gap);
    }
  }

  ref::Phase2Problem prob;
  prob.tokens = T_; prob.dim = D; prob.has_partial = c.partial; prob.rmsnorm = c.rmsnorm; prob.input_norm = c.input_norm;
  prob.scale = scale; prob.eps = eps; prob.norm_eps = norm_eps;
  prob.out = o.Dense(); prob.lse = AccVector<Acc>(lse, T_);
  if (c.partial) prob.partial = merged.Dense();
  prob.w = w.Dense();
  if (c.rmsnorm) prob.gamma = gamma.Dense();
  if (c.input_norm) prob.norm_weight = nw.Dense();
  const std::vector<double> rf = ref::Phase2Forward(prob);
  const ref::Phase2BackwardResult rb = ref::Phase2Backward(prob, g.Dense());

  const int64_t row_chunks = (D + kVec - 1) / kVec, padded = row_chunks * kVec;
  Buf weights(2 * padded * sizeof(Acc));
  {
    const int64_t total = (1 + (c.input_norm ? 1 : 0)) * padded;
    const int grid = static_cast<int>(std::clamp<int64_t>((total + 255) / 256, 1, 4096));
    emu::Launch(dim3(grid), dim3(256), 0, [&] {
      PrepareWeightsKernel<T>(w.ptr(), c.rmsnorm ? gamma.ptr() : nullptr, c.input_norm ? nw.ptr() : nullptr,
                              c.input_norm, 1, D, padded, weights.template at<Acc>());
    });
  }
  struct Out {
    Mat<T> out{1, 1, 1, 0}, go{1, 1, 1, 0}, gp{1, 1, 1, 0}, np{1, 1, 1, 0};
    Buf glse, rows, dw, dgamma, dnw;
  };
  std::string kname;
  // fuse: the forward with the fused update (else it merges `merged` as is).
  auto launch = [&](bool backward, int cap, Out& r, bool fuse = false) {
    const bool wg = backward && c.weight_grads;
    const int64_t tpi = wg ? TokensPerItem(T_, 2, D, sizeof(Acc)) : 1;
    const int64_t items = (T_ + tpi - 1) / tpi;
    r.out = Mat<T>(T_, D, St + 1, c.mis);
    r.go = Mat<T>(T_, D, St + 2, c.mis);
    r.gp = Mat<T>(T_, D, St + 2, c.mis);
    r.np = Mat<T>(T_, D, St + 1, c.mis);  // new_partial: out's stride
    r.glse = Buf(T_ * sizeof(Acc), 0x5C);
    r.rows = Buf(2 * items * D * sizeof(Acc), 0x42);
    Phase2Args a;
    a.shape = {T_, tpi, items, D, row_chunks, {St, St + 1, St + 3, St + 2}};
    a.o = o.ptr(); a.lse = lse.p; a.weights = weights.p;
    a.partial = !c.partial ? nullptr : fuse ? p.ptr() : merged.ptr();
    a.partial_update = fuse ? y.ptr() : nullptr;
    a.new_partial = fuse ? r.np.ptr() : nullptr;
    a.out = backward ? nullptr : r.out.ptr();
    a.grad_out = backward ? g.ptr() : nullptr;
    a.grad_o = backward && !(c.null_grads & 1) ? r.go.ptr() : nullptr;
    a.grad_partial = backward && !(c.null_grads & 2) ? r.gp.ptr() : nullptr;
    a.grad_lse = backward && !(c.null_grads & 4) ? r.glse.p : nullptr;
    a.grad_partial_in = backward && grad_in ? g_in.ptr() : nullptr;
    a.u_partials = wg ? r.rows.p : nullptr;
    a.norm_partials = wg && c.input_norm ? r.rows.p + items * D * sizeof(Acc) : nullptr;
    a.scale = scale; a.eps = eps; a.norm_eps = norm_eps; a.rmsnorm = c.rmsnorm; a.input_norm = c.input_norm;
    const int64_t ctas = (items + kPhase2Warps - 1) / kPhase2Warps;
    const int grid = static_cast<int>(plan::PersistentGridSize(ctas, 1, 1 << 20, cap));
    g_last_grid = grid;
    // The fused update has kernels of its own, picked as RunPhase2 picks them.
    const bool fused = backward ? a.grad_partial_in != nullptr : a.partial_update != nullptr;
    emu::Launch(dim3(grid), dim3(kPhase2Threads), 0, [&] {
      if (backward) fused ? Phase2Kernel<T, true, true>(a) : Phase2Kernel<T, true, false>(a);
      else fused ? Phase2Kernel<T, false, true>(a) : Phase2Kernel<T, false, false>(a);
    });
    char k[160];
    snprintf(k, sizeof k, "Phase2Kernel<%s,%s> grid=%d items=%ld tokens/item=%ld", DtypeName<T>(),
             backward ? "backward" : "forward", grid, (long)items, (long)tpi);
    kname = k;
    fam.covered.insert(std::string(DtypeName<T>()) + (backward ? " bwd" : " fwd") +
                       (fuse || (backward && grad_in) ? " fused" : ""));
    r.dw = Buf(D * sizeof(BitsOf<T>), 0x5C);
    r.dgamma = Buf(D * sizeof(BitsOf<T>), 0x5C);
    r.dnw = Buf(D * sizeof(BitsOf<T>), 0x5C);
    if (wg) {
      ReduceRows<T>(r.rows.p, items, D, c.rmsnorm ? gamma.ptr() : nullptr, w.ptr(), r.dw.p, r.dgamma.p);
      if (c.input_norm) ReduceRows<T>(r.rows.p + items * D * sizeof(Acc), items, D, nullptr, nullptr, r.dnw.p, nullptr);
    }
  };
  auto row = [&](const Buf& b) {
    std::vector<double> v(D);
    for (int64_t k = 0; k < D; ++k) v[k] = ToDouble<T>(b.template at<BitsOf<T>>()[k]);
    return v;
  };
  Out f;
  launch(false, c.caps[0], f, update);
  g_case = std::string(desc) + " | " + kname;
  Check("out", f.out.Dense(), rf, tol.out);
  CheckPadding("out", f.out);
  if (update) {
    // new_partial must be the rounded sum bit for bit, and the merge must use those
    // rounded values: the same bits of out as merging p' given as the partial block
    // (merging the unrounded sum is within out's tolerance in bf16/fp16, not bitwise).
    ++fam.checks;
    size_t wrong = 0, first = 0;
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t d = 0; d < D; ++d)
        if (f.np.ptr()[t * (St + 1) + d] != p_new.ptr()[t * St + d] && wrong++ == 0) first = t * D + d;
    if (wrong != 0) {
      ++fam.failures;
      const std::vector<double> got = f.np.Dense(), want = p_new.Dense();
      Fail("new_partial: " + std::to_string(wrong) + " elements differ from round(partial + y) (first at " +
           std::to_string(first) + ": expected " + std::to_string(want[first]) + ", got " + std::to_string(got[first]) + ")");
    }
    CheckPadding("new_partial", f.np);
    Out unfused, capped;
    launch(false, c.caps[0], unfused);
    launch(false, c.caps[1], capped, true);
    CheckBits("out, fused update vs p' given as the partial block", f.out.buf.p, unfused.out.buf.p,
              f.out.buf.bytes, false);
    const std::string caps = " (grid caps " + std::to_string(c.caps[0]) + " vs " + std::to_string(c.caps[1]) + ")";
    CheckBits("out, fused update" + caps, f.out.buf.p, capped.out.buf.p, f.out.buf.bytes);
    CheckBits("new_partial" + caps, f.np.buf.p, capped.np.buf.p, f.np.buf.bytes);
  }
  Out a, b;
  launch(true, c.caps[0], a);
  const int grid_a = g_last_grid;
  g_case = std::string(desc) + " | " + kname;
  if (!(c.null_grads & 1)) { Check("grad_o", a.go.Dense(), rb.grad_out, tol.grad); CheckPadding("grad_o", a.go); }
  if (!(c.null_grads & 2) && c.partial) {
    std::vector<double> want = rb.grad_partial;
    if (grad_in) {
      const std::vector<double> in = g_in.Dense();
      for (size_t k = 0; k < want.size(); ++k) want[k] += in[k];
    }
    Check(grad_in ? "grad_partial (+ grad_partial_in)" : "grad_partial", a.gp.Dense(), want, tol.grad);
    CheckPadding("grad_partial", a.gp);
  }
  if (!(c.null_grads & 4) && c.partial) Check("grad_lse", AccVector<Acc>(a.glse, T_), rb.grad_lse, tol.grad);
  if (c.weight_grads) {
    Check("dw (ReduceRowsKernel)", row(a.dw), rb.grad_w, tol.grad);
    if (c.rmsnorm) Check("dgamma (ReduceRowsKernel)", row(a.dgamma), rb.grad_gamma, tol.grad);
    if (c.input_norm) Check("dnorm_weight (ReduceRowsKernel)", row(a.dnw), rb.grad_norm_weight, tol.grad);
  }
  launch(true, c.caps[1], b);
  CountDeterminism(grid_a, g_last_grid);
  const std::string caps = " (grid caps " + std::to_string(c.caps[0]) + " vs " + std::to_string(c.caps[1]) + ")";
  CheckBits("grad_o" + caps, a.go.buf.p, b.go.buf.p, a.go.buf.bytes);
  CheckBits("grad_partial" + caps, a.gp.buf.p, b.gp.buf.p, a.gp.buf.bytes);
  CheckBits("grad_lse" + caps, a.glse.p, b.glse.p, a.glse.bytes);
  if (c.weight_grads) {
    CheckBits("dw" + caps, a.dw.p, b.dw.p, a.dw.bytes);
    CheckBits("dgamma" + caps, a.dgamma.p, b.dgamma.p, a.dgamma.bytes);
    CheckBits("dnorm_weight" + caps, a.dnw.p, b.dnw.p, a.dnw.bytes);
  }
  if (g_verbose) printf("  ok? %d  %s\n", !g_case_failed, g_case.c_str());
}

// ---------------------------------------------------------------------------

template <typename F>
void ForTypes(F f, bool with_double) {
  f(static_cast<float*>(nullptr));
  f(static_cast<__half*>(nullptr));
  f(static_cast<__nv_bfloat16*>(nullptr));
  if (with_double) f(static_cast<double*>(nullptr));
}
#define EACH_TYPE(with_double, call) \
  ForTypes([&](auto* tag) { using T = std::remove_pointer_t<decltype(tag)>; call; }, with_double)

int main(int argc, char** argv) {
  std::set<std::string> only;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "-v") g_verbose = true;
    else only.insert(argv[i]);
  }
  auto want = [&](const char* f) { return only.empty() || only.count(f) > 0; };
  uint64_t seed = 1;

  if (want("block_fused")) {
    // Chunk counts (16-byte chunks per row) chosen so that plan::ChooseLayout
    // picks every kernel shape, with W = 1 and W > 1 (see the coverage line):
    //   25: fwd 1/32, bwd 1/32       40: fwd 2/32, bwd 2/32
    //   70: fwd 1/96, bwd 1/96      100: fwd 4/32, bwd 2/64
    //  170: fwd 2/96, bwd 2/96      230: fwd 4/64, bwd 2/128
    //  300: fwd 1/288 (W = 9), bwd 2/160
    // 1300: fwd 8/192 (W = 6), bwd 4/352 (W = 11)   (rows past 1024 chunks:
    // 2048: fwd 8/256 (W = 8), bwd 4/512 (W = 16)    wg in shared memory)
    const BlockCase cases[] = {
        // T, chunks, short_by, L, rms, caches, mis, pad, null_grads, dw, fused, caps
        {13, 25, 1, 3, true, true, 0, 8, 0, true, true, {1, 3}},
        {13, 40, 0, 3, false, false, 1, 3, 0b010, true, true, {2, 5}},
        {9, 70, 3, 5, true, false, 3, 5, 0b00001, true, true, {1, 2}},
        {17, 100, 2, 2, true, true, 2, 0, 0, true, true, {1, 3}},
        {17, 100, 0, 4, false, true, 0, 7, 0b1000, true, true, {2, 4}},
        {9, 170, 1, 3, true, true, 1, 1, 0, true, true, {1, 2}},
        {12, 230, 0, 2, true, false, 0, 4, 0b01, true, true, {1, 3}},
        {10, 300, 5, 2, true, true, 0, 0, 0, true, true, {1, 2}},
        {20, 16, 0, 9, true, false, 0, 0, 0b100000001, false, true, {1, 3}},
        {6, 40, 0, 200, true, true, 1, 0, 0, true, true, {1, 2}},  // L > 128: pointer tables in memory
        // > 64 tokens: more partial rows than ReduceRowsKernel has row lanes (8).
        {150, 6, 1, 2, true, true, 0, 0, 0, true, true, {1, 2}},
        // Enough work items (groups/CTA chunks of 8 tokens each) for two grid sizes: W = 2, W = 3.
        {80, 100, 0, 2, true, true, 0, 0, 0, true, true, {1, 2}},
        {40, 70, 1, 3, true, false, 1, 0, 0, true, true, {1, 2}},
        // The widest fused rows: 16384 16-bit / 8192 fp32 elements, and an odd
        // width with a partial last chunk, misaligned rows and a null gradient.
        {17, 2048, 0, 3, true, true, 0, 0, 0, true, true, {1, 2}},
        {9, 1300, 3, 2, false, false, 1, 3, 0b01, true, true, {1, 2}},
        // 16-byte-aligned rows (pad = short_by), so the pipelined forward runs too:
        // partial last chunks, L = 1 and 2 (fewer rows than ring stages), every
        // pipelined shape with W = 1 and W > 1, L > 128, one CTA for every token.
        {13, 25, 3, 3, true, true, 0, 3, 0, true, true, {1, 3}},
        {9, 40, 1, 1, true, true, 0, 1, 0, true, true, {1, 2}},
        {11, 170, 2, 2, false, true, 0, 2, 0, true, true, {2, 1}},
        {7, 100, 0, 5, true, true, 0, 0, 0, true, true, {1, 3}},
        {7, 230, 0, 5, true, false, 0, 8, 0, true, true, {3, 1}},
        {5, 70, 2, 150, true, true, 0, 2, 0, true, true, {1, 2}},
        // Aligned, every gradient null and no dw: pass 2 reads nothing at all.
        {10, 40, 0, 3, true, false, 0, 0, 0b111, false, true, {1, 2}},
    };
    for (const BlockCase& c : cases) { EACH_TYPE(false, RunBlock<T>(c, seed)); ++seed; }
    // Global statistics: W = 4 (256 chunks: bwd 2/128) needs 64 L bytes per
    // group, > 46 KiB at L = 800; W = 1 needs 16 L bytes, > 46 KiB at L = 3000.
    // (fp16 shares the bf16 code path but for the conversions; skipped for time.)
    RunBlock<float>({3, 256, 0, 800, true, true, 0, 0, 0b110, true, true, {1, 2}}, seed++);
    RunBlock<__nv_bfloat16>({2, 256, 0, 800, false, true, 1, 0, 0, true, true, {1, 2}}, seed++);
    RunBlock<float>({1, 25, 0, 3000, true, true, 1, 0, 0, true, true, {1, 2}}, seed++);
    // The 1-chunk backward with W = 3 (70 chunks: G = 96) in fp16: 13 L floats per
    // group, > 46 KiB at L = 906.
    RunBlock<__half>({3, 70, 2, 910, true, false, 1, 0, 0b101, true, true, {1, 2}}, seed++);
    // The 4-chunk backward (wg in shared memory, W = 16) with its statistics in
    // global memory: 52 L floats per group, more than the 32 KiB that 64 KiB of
    // wg leave of plan::kOptInSharedBytes when L > 157.
    RunBlock<__nv_bfloat16>({1, 2048, 0, 160, true, true, 0, 0, 0, true, true, {1, 2}}, seed++);
  }
  if (want("block_generic")) {
    const BlockCase cases[] = {
        // fp64 (always generic) and wide rows (> 2048 chunks: no fused layout).
        {13, 150, 0, 3, true, true, 0, 8, 0, true, false, {1, 3}},
        {10, 39, 1, 4, false, false, 1, 3, 0b0100, true, false, {2, 5}},
        {17, 25, 0, 3, true, true, 1, 1, 0, false, false, {1, 2}},
        {3, 2054, 3, 2, true, true, 0, 2, 0, true, false, {1, 2}},
        {9, 2049, 0, 3, true, false, 1, 0, 0b10, true, false, {1, 2}},
        {150, 6, 1, 2, true, true, 1, 0, 0, true, false, {3, 7}},  // > 8 partial rows per lane set
    };
    for (const BlockCase& c : cases) { EACH_TYPE(true, RunBlock<T>(c, seed)); ++seed; }
    RunBlock<double>({4, 20, 1, 150, true, true, 0, 0, 0, true, false, {1, 2}}, seed++);  // L > 128
  }
  if (want("phase1")) {
    const Phase1Case cases[] = {
        // T, chunks, short_by, N, S, rms, acc, wg, force_global, mis, pad, null_blocks, null_gouts, caps
        {11, 25, 0, 3, 2, true, false, true, false, 0, 8, 0, 0, {1, 3}},
        {11, 50, 3, 3, 5, false, true, true, false, 1, 3, 0b010, (1 << 16) | 0b10, {1, 2}},
        {20, 130, 1, 4, 1, true, true, false, true, 3, 5, 0b0001, 0, {1, 3}},
        {9, 300, 0, 2, 6, true, false, true, false, 0, 0, 0, 0b1, {1, 2}},
        {30, 10, 0, 5, 3, true, true, true, true, 1, 1, 0, 1 << 18, {1, 4}},
        {4, 8, 0, 2, 34, true, false, true, false, 0, 0, 0, 0, {1, 2}},  // S > 32: query tables in memory
        {150, 4, 1, 2, 2, true, false, true, false, 0, 0, 0, 0, {3, 7}},  // > 8 items: ReduceRows lanes wrap
    };
    for (const Phase1Case& c : cases) { EACH_TYPE(true, RunPhase1<T>(c, seed)); ++seed; }
    // Statistics too big for shared memory (fp32: N = 80, S = 8, 8 warps).
    RunPhase1<float>({4, 256, 0, 80, 8, true, false, true, false, 0, 0, 0, 0, {1, 2}}, seed++);
  }
  if (want("phase2")) {
    const Phase2Case cases[] = {
        // T, chunks, short_by, rms, partial, input_norm, wg, mis, pad, null_grads, caps
        {21, 25, 0, true, true, true, true, 0, 8, 0, {1, 3}},
        {21, 25, 1, false, true, false, true, 1, 3, 0b001, {1, 2}},
        {13, 130, 2, true, false, true, true, 3, 5, 0b010, {1, 2}},
        {13, 130, 0, true, true, true, false, 0, 0, 0b100, {1, 2}},
        {40, 12, 1, true, true, false, true, 1, 1, 0, {1, 4}},
        {40, 12, 0, true, true, true, true, 2, 1, 0b011, {1, 4}},
        {150, 4, 1, true, true, true, true, 0, 0, 0, {1, 2}},  // > 8 items: ReduceRows lanes wrap
        {300, 4, 0, true, true, false, true, 1, 0, 0, {1, 3}},  // 38 items, 5 CTAs: two grid sizes
        // The fused update (last field: 1 forward, 2 backward's grad_partial_in, 3 both),
        // odd widths, misaligned and padded rows, rmsnorm and the input norm on and off.
        {21, 25, 1, true, true, true, true, 1, 3, 0, {1, 3}, 3},
        {21, 25, 0, false, true, false, true, 0, 8, 0, {1, 2}, 3},
        {13, 130, 3, true, true, false, false, 3, 5, 0b001, {1, 2}, 1},
        {40, 12, 2, false, true, true, true, 2, 1, 0b100, {1, 4}, 2},
        {40, 12, 1, true, true, true, false, 0, 0, 0b010, {1, 4}, 3},  // no grad_partial: no grad_partial_in
        {150, 4, 1, true, true, true, true, 0, 0, 0, {1, 2}, 3},
    };
    for (const Phase2Case& c : cases) { EACH_TYPE(true, RunPhase2<T>(c, seed)); ++seed; }
    // Sharp merges: lse - z_p = +-5 .. +-30 (beta or 1 - beta down to 1e-13), the
    // partial block 1e-3, 1 and 1e3 times o (fp16: 1e-2, 1 and 10 where it holds the
    // gradients), RMSNorm on and off for each, the input norm, the fused update and
    // the layouts varying from case to case: as tests/cpp/test_two_phase.cc's
    // Phase2SharpMergesMatchReference and test_util.h's Fp16HoldsSharp.
    int k = 0;
    for (double gap : {5.0, 10.0, 20.0, 30.0}) {
      for (double sign : {1.0, -1.0}) {
        for (int s = 0; s < 3; ++s) {
          for (bool rmsnorm : {true, false}) {
            const double size = s == 0 ? 1e-3 : s == 1 ? 1.0 : 1e3;
            const double fp16_size = s == 0 ? 1e-2 : s == 1 ? 1.0 : 10.0;
            const bool fp16_holds = std::exp(-gap) * std::min(fp16_size, 1.0) >= 1e-5;
            // The input norm only with a partial block of o's size (see the C++ test).
            Phase2Case c{17, 9, (k / 2) % 3, rmsnorm, true, (k / 3) % 3 == 1 && s == 1, true,
                         (k / 5) % 3, k % 2, 0, {1, 2}, (k / 7) % 4 == 2 ? 3 : 0};
            c.merge_gap = sign * gap;
            ++k;
            ForTypes([&](auto* tag) {
              using T = std::remove_pointer_t<decltype(tag)>;
              constexpr bool kHalf = std::is_same_v<T, __half>;
              c.partial_size = kHalf ? fp16_size : size;
              if (fp16_holds || !kHalf) RunPhase2<T>(c, seed);
            }, true);
            ++seed;
          }
        }
      }
    }
  }

  int failures = 0;
  for (const auto& [name, f] : g_families) {
    std::string cov;
    for (const std::string& s : f.covered) cov += (cov.empty() ? "" : ", ") + s;
    printf("%-14s %s: %d cases, %d checks, %d failed (%d determinism); %d grid-size reruns, %d with distinct grids\n",
           name.c_str(), f.failures ? "FAIL" : "ok", f.cases, f.checks, f.failures, f.det_failures, f.det_pairs,
           f.det_distinct);
    if (g_verbose) printf("    covered: %s\n", cov.c_str());
    failures += f.failures;
  }
  return failures ? 1 : 0;
}
