// Shared helpers of the C++ test suite: random problems, storage-dtype
// conversion, running a problem through the C ABI with every source in its own
// (optionally strided) allocation, and comparison against the float64 oracle.
#ifndef ATTNRES_TESTS_CPP_TEST_UTIL_H_
#define ATTNRES_TESTS_CPP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"

namespace attnres_test {

// ---------------------------------------------------------------------------
// Storage dtypes. All conversions from double round to nearest, ties to even.

uint16_t DoubleToBf16(double x);
double Bf16ToDouble(uint16_t bits);
uint16_t DoubleToF16(double x);
double F16ToDouble(uint16_t bits);
// double -> float rounded to odd: a following rounding to a narrower format
// (bf16) then gives the correctly rounded result of the original double.
float DoubleToFloatRoundToOdd(double x);

size_t DTypeSize(attnres_dtype dtype);
const char* DTypeName(attnres_dtype dtype);
// The value `x` becomes once stored in `dtype` (what the library will read).
double RoundToDType(double x, attnres_dtype dtype);
// Caches and accumulation: double for f64, float otherwise.
attnres_dtype CacheDType(attnres_dtype dtype);

// Bytes written into every output buffer (and its padding) before a call, so
// that stray writes are detectable. Input padding is filled with 0xFF (NaN in
// every float format), so that stray reads poison the result.
constexpr uint8_t kOutputSentinel = 0xA5;
constexpr uint8_t kInputPadding = 0xFF;

// `bytes` of CUDA device memory whose first byte lies `offset` bytes past an
// allocation from cudaMalloc (256-byte aligned), so that an offset misaligns it
// on purpose. Empty by default; move-only. Only a build with
// ATTNRES_WITH_CUDA can allocate (elsewhere the constructor fails the test).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(size_t bytes, size_t offset);
  DeviceMemory(DeviceMemory&& other) noexcept { *this = std::move(other); }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();

  void* get() const { return base_ == nullptr ? nullptr : static_cast<char*>(base_) + offset_; }
  size_t bytes() const { return bytes_; }
  void Fill(uint8_t pattern);  // cudaMemset of every byte

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t offset_ = 0;
};

// One heap allocation of `count` elements of `dtype` followed by kGuardElements
// guard elements (never part of the tensor: writes there are out-of-bounds),
// optionally with a device twin: a copy of the whole allocation, guards
// included, in CUDA memory. Values are always set and read on the host; Upload
// and Download move every byte between the two (no-ops without a twin).
class Buffer {
 public:
  static constexpr size_t kGuardElements = 8;

  Buffer() = default;
  Buffer(attnres_dtype dtype, size_t count, uint8_t fill);

  attnres_dtype dtype() const { return dtype_; }
  size_t count() const { return count_; }
  size_t elem_size() const { return DTypeSize(dtype_); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  unsigned char* bytes() { return storage_.data(); }
  const unsigned char* bytes() const { return storage_.data(); }
  size_t total_bytes() const { return storage_.size(); }

  // Allocates the device twin, `offset` bytes into its allocation, and uploads.
  void AddDeviceTwin(size_t offset);
  // What a call is given: the device twin when there is one, else the host bytes.
  void* abi_data() { return device_.get() != nullptr ? device_.get() : data(); }
  const void* abi_data() const { return device_.get() != nullptr ? device_.get() : data(); }
  // cudaMemcpy from pageable memory may return before the copy has landed, and
  // a kernel on a non-blocking stream is not ordered after it: synchronise the
  // device after uploading and before such a launch.
  void Upload();
  void Download();

  void Set(size_t i, double v);
  double Get(size_t i) const;
  void Fill(uint8_t pattern);
  // True when elements [first, first + n) all hold `pattern` bytes.
  bool BytesAre(size_t first, size_t n, uint8_t pattern) const;
  bool GuardIntact(uint8_t pattern) const {
    return BytesAre(count_, kGuardElements, pattern);
  }

 private:
  attnres_dtype dtype_ = ATTNRES_DTYPE_FLOAT32;
  size_t count_ = 0;
  std::vector<unsigned char> storage_;
  DeviceMemory device_;
};

// Elements of a [rows, dim] tensor with the given row stride: the last row
// ends at dim, so the allocation is exactly what the ABI may touch.
inline size_t StridedCount(int64_t rows, int64_t dim, int64_t stride) {
  return rows == 0 ? 0 : static_cast<size_t>((rows - 1) * stride + dim);
}

// ---------------------------------------------------------------------------
// Problems.

struct Case {
  int64_t tokens = 4;
  int64_t dim = 8;
  int64_t num_blocks = 3;
  bool has_partial = true;
  bool rmsnorm = true;
  bool has_gamma = true;  // false: gamma = NULL (all ones)
  double scale = 1.0;
  double eps = 1e-6;
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  // Row stride = dim + pad, per stride field of attnres_params.
  int64_t source_pad = 0;
  int64_t out_pad = 0;
  int64_t grad_out_pad = 0;
  int64_t grad_source_pad = 0;
  uint64_t seed = 1;

  Case() = default;
  // These sizes, the rest as above (a partial block, RMSNorm, gamma, scale 1,
  // eps 1e-6, dense rows).
  Case(attnres_dtype dtype, int64_t tokens, int64_t dim, int64_t num_blocks, uint64_t seed)
      : tokens(tokens), dim(dim), num_blocks(num_blocks), dtype(dtype), seed(seed) {}

  int64_t num_sources() const { return num_blocks + (has_partial ? 1 : 0); }
  std::string Describe() const;
};

// Random problem (seeded std::mt19937_64) whose values are all representable
// in case.dtype: sources ~ N(0, s_i^2) with a per-source s_i in [0.5, 2],
// w ~ N(0, 1/D) (logits of order one), gamma ~ 1 + N(0, 0.2^2).
attnres::ref::Problem MakeProblem(const Case& c);
// The sharp family (SPEC §3, "sharp depth attention"): the favoured sources point
// along +1 and the others along -1 (each element 1 +- 20% noise; with RMSNorm the
// blocks are 0.5-2 in size), and w is a multiple of ones chosen so that the
// sources' mean logits span `gap`, the favoured ones on top: the least favoured
// keep about exp(-gap) of the weight.
enum class Favoured { kBlocks, kPartial, kFirstBlock, kAllButFirstBlock };
struct SharpLogits {
  double gap = 0;
  Favoured favoured = Favoured::kBlocks;
  double partial_magnitude = 1;  // the partial block's size next to the blocks'
  std::string Describe() const;
};
// Whether fp16 holds a sharp case's outputs: the partial block 1e-2 to 10 times the
// others (without RMSNorm dw grows with the square of its size, and fp16 ends at
// 65504), and the smallest gradients, about exp(-gap) * min(size, 1), at 1e-5 or
// more (fp16 keeps 8 of its 10 bits there as subnormals, and nothing below 6e-8).
bool Fp16HoldsSharp(double gap, double partial_size);
// The partial block's sizes a sharp case list tries in `dtype`: 1e-3, 1, 1e3 times
// the others, fp16 1e-2, 1, 10.
std::vector<double> SharpPartialSizes(attnres_dtype dtype);
// case.num_blocks >= 2; kBlocks and kPartial need case.has_partial.
attnres::ref::Problem MakeSharpProblem(const Case& c, const SharpLogits& sharp);
// The shared list: gaps 0, 5, 10, 20 and 30, every Favoured pattern that applies,
// and SharpPartialSizes; in fp16 the members Fp16HoldsSharp.
std::vector<SharpLogits> SharpFamily(attnres_dtype dtype, bool has_partial);
// Random upstream gradient [tokens * dim], representable in case.dtype.
std::vector<double> MakeGradOut(const Case& c);

// ---------------------------------------------------------------------------
// Running through the C ABI.

// A dense input tensor of `dtype` holding v (its guard kInputPadding), and every
// element of a buffer, upcast.
Buffer InputBuffer(attnres_dtype dtype, const std::vector<double>& v);
std::vector<double> Values(const Buffer& b);

// Upcasts a [rows, dim] tensor with the given row stride from b's host bytes;
// appends to *layout_error when the padding between rows or the guard no
// longer holds kOutputSentinel.
std::vector<double> ReadRows(const Buffer& b, int64_t rows, int64_t dim, int64_t stride,
                             const std::string& name, std::string* layout_error);
// The first `count` elements of b, and the same check of its guard.
std::vector<double> ReadDense(const Buffer& b, size_t count, const std::string& name,
                              std::string* layout_error);

struct ForwardOutput {
  attnres_status status = ATTNRES_OK;
  std::string error;         // attnres_last_error() when status != OK
  std::vector<double> out;   // [tokens * dim]
  std::vector<double> rms;   // [tokens * L] when requested
  std::vector<double> alpha; // [tokens * L] when requested
  std::string layout_error;  // non-empty when padding, guards or inputs were written
};

struct BackwardOptions {
  bool use_rms_cache = false;    // pass rms_cache (written by a forward first)
  bool use_alpha_cache = false;  // pass alpha_cache (written by a forward first)
  bool grad_blocks_null = false; // grad_blocks = NULL (no block gradients)
  std::vector<bool> skip_source; // per source: NULL gradient pointer
  bool skip_w = false;
  bool skip_gamma = false;       // always skipped when rmsnorm is off
};

// Both caches (rms only applies with RMSNorm), or none.
inline BackwardOptions WithCaches(bool caches) {
  BackwardOptions o;
  o.use_rms_cache = o.use_alpha_cache = caches;
  return o;
}

struct BackwardOutput {
  attnres_status status = ATTNRES_OK;
  std::string error;
  std::vector<std::vector<double>> grad_sources;  // L entries; empty if skipped
  std::vector<double> grad_w;                     // empty if skipped
  std::vector<double> grad_gamma;                 // empty if skipped
  std::string layout_error;
};

// Waits for every call on the device, whatever its stream, and reports an error
// that surfaced asynchronously (nothing to wait for on the CPU).
void Synchronize(attnres_device device);

// Where the device twins of a CUDA problem start, in elements past their
// 256-byte aligned allocations: misaligned pointers on purpose. The CPU
// backend ignores it.
struct Placement {
  std::vector<int64_t> sources, grads;  // per source; missing entries are 0
  int64_t w = 0, gamma = 0, out = 0, grad_out = 0;
};

// attnres_params_init's defaults with the fields every entry point reads set.
attnres_params CommonParams(attnres_device device, attnres_dtype dtype, int64_t tokens,
                            int64_t dim, int64_t source_row_stride, double scale, double eps,
                            bool rmsnorm);

// Owns a problem laid out the way a caller with separate tensors would hold it:
// every block, the partial block, w, gamma and every output in its own
// allocation, rows `dim + pad` apart, on one backend: the CPU (whichever ISA is
// in force when a call is made) or the CUDA device, where every buffer has a
// device twin. Before each call the inputs are uploaded and the outputs reset
// to kOutputSentinel; after it every output is copied back whole, so that the
// checks of padding, guards and untouched inputs are the same on both.
class AbiProblem {
 public:
  AbiProblem(const Case& c, const attnres::ref::Problem& p,
             attnres_device device = ATTNRES_DEVICE_CPU, const Placement& at = {});

  const Case& config() const { return case_; }
  // CUDA: the cudaStream_t of every call (nullptr, the default, is the legacy
  // stream).
  void set_stream(void* stream) { stream_ = stream; }
  // params with sizes, flags and inputs set (CommonParams and the single op's
  // inputs); outputs NULL. For CUDA the inputs
  // are those uploaded by the constructor or the last Prepare*.
  attnres_params InputParams() const;

  ForwardOutput Forward(bool want_rms_cache, bool want_alpha_cache);
  // Runs a forward first when the options ask for caches no forward has left.
  BackwardOutput Backward(const std::vector<double>& grad_out,
                          const BackwardOptions& options);

  // Forward and Backward in halves, for a test that makes the call itself (a
  // CUDA graph capture, a broken argument): Prepare* uploads the inputs,
  // resets the call's outputs and returns its params; Read* (after the call
  // has completed) reads the outputs back and checks the layout.
  attnres_params PrepareForward(bool want_rms_cache, bool want_alpha_cache);
  ForwardOutput ReadForward();
  attnres_params PrepareBackward(const std::vector<double>& grad_out,
                                 const BackwardOptions& options);
  BackwardOutput ReadBackward();

  // True when no output byte (out, the caches, every gradient; padding and
  // guards included) has changed since the last Prepare*.
  bool OutputsUntouched();

  // Host storage, for tests that poke at it (the next Prepare* uploads it).
  Buffer& source(int64_t i) { return sources_[i]; }
  Buffer& proj_weight() { return w_; }
  Buffer& gamma() { return gamma_; }

 private:
  bool Skipped(const BackwardOptions& o, int64_t i) const;
  std::vector<std::pair<std::string, Buffer*>> Inputs(bool backward);
  std::vector<Buffer*> Outputs();
  // Uploads the inputs and remembers their hashes; snapshots the outputs.
  void Ready(bool backward);
  // Downloads the inputs and reports any that changed since Ready.
  void CheckInputs(bool backward, std::string* layout_error);

  Case case_;
  int64_t L_;
  attnres_device device_;
  void* stream_ = nullptr;
  std::vector<Buffer> sources_;  // L buffers, the partial block last
  std::vector<const void*> block_ptrs_;
  Buffer w_, gamma_;
  Buffer out_, rms_cache_, alpha_cache_;
  Buffer grad_out_;
  std::vector<Buffer> grad_sources_;
  std::vector<void*> grad_block_ptrs_;
  Buffer grad_w_, grad_gamma_;

  bool want_rms_ = false, want_alpha_ = false;  // of the last PrepareForward
  BackwardOptions backward_;                     // of the last PrepareBackward
  bool caches_valid_ = false;
  std::vector<uint64_t> input_hashes_;  // at the last Prepare*
  std::vector<uint64_t> cache_hashes_;  // as the last forward left the caches
  std::vector<uint64_t> output_hashes_; // at the last Prepare*
};

// ---------------------------------------------------------------------------
// Comparison.

// max|actual - expected| / max|expected|; the absolute error when expected is
// all zeros; +inf when sizes differ or actual has a non-finite value where
// expected is finite.
double RelMaxError(const std::vector<double>& actual,
                   const std::vector<double>& expected);

// Every comparison the shared helpers make is counted: with ATTNRES_COUNT_CHECKS
// set, the test program prints how many (and how many elements they compared)
// when it ends, so that a refactor of the tests can show it checks no less.
void CountCheck(size_t elements);

// EXPECT_TRUE(Close("out", a, e, 1e-5)) prints the worst element on failure.
::testing::AssertionResult Close(const std::string& what,
                                 const std::vector<double>& actual,
                                 const std::vector<double>& expected, double tol);

using attnres::ref::Tolerance;
inline Tolerance ToleranceFor(attnres_dtype dtype) { return attnres::ref::SpecTolerance(dtype); }

// A successful call, untouched padding, guards and inputs, and every output
// within ToleranceFor(c.dtype) of the oracle: the caches when `caches` (rms with
// RMSNorm), each gradient not skipped by `o`.
void ExpectForwardClose(const Case& c, const ForwardOutput& got,
                        const attnres::ref::ForwardResult& ref, bool caches);
void ExpectBackwardClose(const Case& c, const BackwardOutput& got,
                         const attnres::ref::BackwardResult& ref, const BackwardOptions& o);

// Backward without and with both caches, each ExpectBackwardClose to `ref`.
void ExpectBackwardCloseWithAndWithoutCaches(AbiProblem& abi, const std::vector<double>& grad_out,
                                             const attnres::ref::BackwardResult& ref);

// ---------------------------------------------------------------------------
// Backends.

// The names attnres_set_cpu_isa accepts on this machine, best first
// (attnres_cpu_isas() split at its spaces).
std::vector<std::string> AvailableIsas();
// Runs `body` once per available ISA, with that ISA forced and a SCOPED_TRACE
// naming it; restores the automatic choice afterwards.
void ForEachIsa(const std::function<void(const std::string& isa)>& body);

struct Backend {
  std::string name;       // a CPU ISA ("avx2", ..., "baseline") or "cuda"
  attnres_device device;  // what AbiProblem is given
};

// Every CPU ISA (AvailableIsas()), then "cuda" when the tests were built with
// ATTNRES_WITH_CUDA and a device is present.
std::vector<Backend> AvailableBackends();
// Runs `body` once per available backend with a SCOPED_TRACE naming it; a CPU
// ISA is forced for its run, the automatic choice restored before the device's.
void ForEachBackend(const std::function<void(const Backend& backend)>& body);

// What this process's CUDA runtime says about devices (the tests link their
// own runtime): the reason behind a skip, printed with it.
std::string CudaRuntimeStatus();

#define ATTNRES_SKIP_WITHOUT_CUDA()                               \
  do {                                                            \
    if (!attnres_cuda_available()) {                              \
      GTEST_SKIP() << "skipped: no CUDA device ("                 \
                   << ::attnres_test::CudaRuntimeStatus() << ")"; \
    }                                                             \
  } while (0)

// Sets an environment variable (a knob such as ATTNRES_CUDA_MAX_CTAS) for the
// life of the object.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// Bitwise equality of two double vectors (NaNs with equal payloads compare equal).
bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b);

// Every dtype of the ABI.
inline constexpr attnres_dtype kAllDTypes[] = {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64,
                                               ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT16};

inline bool AllFinite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

inline bool AllNan(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isnan(x); });
}

// Row t of a [rows, width] tensor.
inline std::vector<double> Row(const std::vector<double>& v, int64_t t, int64_t width) {
  return std::vector<double>(v.begin() + t * width, v.begin() + (t + 1) * width);
}

}  // namespace attnres_test

#endif  // ATTNRES_TESTS_CPP_TEST_UTIL_H_
