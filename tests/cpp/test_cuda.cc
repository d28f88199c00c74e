// The CUDA backend against the float64 reference: the same random problems as
// the CPU tests (test_util), copied to the device, one allocation per source
// and per gradient, rows `dim + pad` apart, run with device = CUDA.
//
// Without a device (or in a build without ATTNRES_WITH_CUDA) every GPU case
// skips; only the "device unavailable" contract is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

#ifdef ATTNRES_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace attnres_test {
namespace {

#ifdef ATTNRES_WITH_CUDA
#define ATTNRES_SKIP_WITHOUT_CUDA()                                   \
  do {                                                                \
    if (!attnres_cuda_available()) GTEST_SKIP() << "skipped: no CUDA device"; \
  } while (0)
#else
#define ATTNRES_SKIP_WITHOUT_CUDA() \
  GTEST_SKIP() << "skipped: no CUDA device (test built without ATTNRES_WITH_CUDA)"
#endif

TEST(CudaBackend, UnavailableDeviceIsReported) {
  if (attnres_cuda_available()) GTEST_SKIP() << "a CUDA device is present";
  const float w[4] = {0, 0, 0, 0}, src[4] = {1, 2, 3, 4};
  float out[4];
  const void* blocks[1] = {src};
  attnres_params p;
  attnres_params_init(&p);
  p.device = ATTNRES_DEVICE_CUDA;
  p.num_tokens = 1;
  p.dim = 4;
  p.num_blocks = 1;
  p.blocks = blocks;
  p.source_row_stride = 4;
  p.proj_weight = w;
  p.out = out;
  p.out_row_stride = 4;
  EXPECT_EQ(attnres_forward(&p), ATTNRES_ERROR_UNSUPPORTED_DEVICE);
  EXPECT_STRNE(attnres_last_error(), "");
}

#ifdef ATTNRES_WITH_CUDA

#define ASSERT_CUDA_OK(expr)                                              \
  do {                                                                    \
    const cudaError_t err_ = (expr);                                      \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

// One device allocation holding the bytes of a host Buffer (guards included).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(const Buffer& host) : bytes_(host.total_bytes()) {
    if (cudaMalloc(&ptr_, bytes_) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << bytes_ << " bytes failed";
      return;
    }
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  void* get() const { return ptr_; }
  // Copies the device bytes back over `host` (same size).
  void CopyTo(Buffer* host) const {
    EXPECT_EQ(cudaMemcpy(host->data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void FillRows(Buffer* b, const std::vector<double>& values, int64_t rows, int64_t dim,
              int64_t stride) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) b->Set(t * stride + d, values[t * dim + d]);
  }
}

std::vector<double> ReadRows(const Buffer& b, int64_t rows, int64_t dim, int64_t stride,
                             const std::string& name, std::string* layout_error) {
  std::vector<double> v(rows * dim);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) v[t * dim + d] = b.Get(t * stride + d);
    if (t + 1 < rows && stride > dim && !b.BytesAre(t * stride + dim, stride - dim, kOutputSentinel)) {
      *layout_error += name + ": padding after row " + std::to_string(t) + " written; ";
    }
  }
  if (!b.GuardIntact(kOutputSentinel)) *layout_error += name + ": written past its end; ";
  return v;
}

std::vector<double> ReadDense(const Buffer& b, size_t count, const std::string& name,
                              std::string* layout_error) {
  std::vector<double> v(count);
  for (size_t k = 0; k < count; ++k) v[k] = b.Get(k);
  if (!b.GuardIntact(kOutputSentinel)) *layout_error += name + ": written past its end; ";
  return v;
}

struct DeviceForward {
  std::vector<double> out, rms, alpha;
  std::string layout_error;
};

struct DeviceBackward {
  std::vector<std::vector<double>> grad_sources;  // empty where skipped
  std::vector<double> grad_w, grad_gamma;         // empty where skipped
  Buffer grad_w_bits, grad_gamma_bits;            // raw, for bitwise comparisons
  std::string layout_error;
};

// A problem on the device, laid out as a caller with separate tensors holds it.
class DeviceProblem {
 public:
  DeviceProblem(const Case& c, const attnres::ref::Problem& p) : case_(c), L_(c.num_sources()) {
    const int64_t stride = c.dim + c.source_pad;
    for (int64_t i = 0; i < L_; ++i) {
      Buffer host(c.dtype, StridedCount(c.tokens, c.dim, stride), kInputPadding);
      FillRows(&host, p.sources[i], c.tokens, c.dim, stride);
      sources_.emplace_back(host);
    }
    for (int64_t i = 0; i < c.num_blocks; ++i) block_ptrs_.push_back(sources_[i].get());
    Buffer w(c.dtype, c.dim, kInputPadding);
    for (int64_t d = 0; d < c.dim; ++d) w.Set(d, p.w[d]);
    w_ = DeviceBuffer(w);
    if (c.has_gamma) {
      Buffer gamma(c.dtype, c.dim, kInputPadding);
      for (int64_t d = 0; d < c.dim; ++d) gamma.Set(d, p.gamma[d]);
      gamma_ = DeviceBuffer(gamma);
    }
  }

  attnres_params Params(cudaStream_t stream) const {
    static const void* const kNoBlocks[1] = {nullptr};
    attnres_params p;
    attnres_params_init(&p);
    p.device = ATTNRES_DEVICE_CUDA;
    p.stream = stream;
    p.num_tokens = case_.tokens;
    p.dim = case_.dim;
    p.num_blocks = case_.num_blocks;
    p.dtype = case_.dtype;
    p.blocks = block_ptrs_.empty() ? kNoBlocks : block_ptrs_.data();
    p.partial = case_.has_partial ? sources_[L_ - 1].get() : nullptr;
    p.source_row_stride = case_.dim + case_.source_pad;
    p.proj_weight = w_.get();
    p.gamma = case_.has_gamma ? gamma_.get() : nullptr;
    p.scale = case_.scale;
    p.eps = case_.eps;
    p.rmsnorm = case_.rmsnorm ? 1 : 0;
    return p;
  }

  // Runs the forward; keeps the caches on the device for a later backward.
  DeviceForward Forward(bool want_caches, cudaStream_t stream = nullptr) {
    DeviceForward res;
    const int64_t T = case_.tokens, D = case_.dim, stride = D + case_.out_pad;
    Buffer out(case_.dtype, StridedCount(T, D, stride), kOutputSentinel);
    Buffer rms(CacheDType(case_.dtype), T * L_, kOutputSentinel);
    Buffer alpha(CacheDType(case_.dtype), T * L_, kOutputSentinel);
    DeviceBuffer d_out(out);
    rms_cache_ = DeviceBuffer(rms);
    alpha_cache_ = DeviceBuffer(alpha);
    attnres_params p = Params(stream);
    p.out = d_out.get();
    p.out_row_stride = stride;
    if (want_caches && case_.rmsnorm) p.rms_cache = rms_cache_.get();
    if (want_caches) p.alpha_cache = alpha_cache_.get();
    const attnres_status status = attnres_forward(&p);
    EXPECT_EQ(status, ATTNRES_OK) << attnres_last_error();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    d_out.CopyTo(&out);
    res.out = ReadRows(out, T, D, stride, "out", &res.layout_error);
    if (want_caches) {
      alpha_cache_.CopyTo(&alpha);
      res.alpha = ReadDense(alpha, T * L_, "alpha_cache", &res.layout_error);
      if (case_.rmsnorm) {
        rms_cache_.CopyTo(&rms);
        res.rms = ReadDense(rms, T * L_, "rms_cache", &res.layout_error);
      }
    }
    return res;
  }

  // Runs the backward; `use_caches` needs a Forward(true) first. Sources whose
  // `skip` entry is true get a NULL gradient pointer.
  DeviceBackward Backward(const std::vector<double>& grad_out, bool use_caches,
                          const std::vector<bool>& skip, bool skip_w, bool skip_gamma,
                          cudaStream_t stream = nullptr) {
    DeviceBackward res;
    const int64_t T = case_.tokens, D = case_.dim, N = case_.num_blocks;
    const int64_t gout_stride = D + case_.grad_out_pad, gsrc_stride = D + case_.grad_source_pad;
    Buffer gout(case_.dtype, StridedCount(T, D, gout_stride), kInputPadding);
    FillRows(&gout, grad_out, T, D, gout_stride);
    DeviceBuffer d_gout(gout);
    std::vector<Buffer> grads(L_);
    std::vector<DeviceBuffer> d_grads(L_);
    std::vector<void*> grad_block_ptrs(N, nullptr);
    void* grad_partial = nullptr;
    for (int64_t i = 0; i < L_; ++i) {
      if (skip[i]) continue;
      grads[i] = Buffer(case_.dtype, StridedCount(T, D, gsrc_stride), kOutputSentinel);
      d_grads[i] = DeviceBuffer(grads[i]);
      (i < N ? grad_block_ptrs[i] : grad_partial) = d_grads[i].get();
    }
    res.grad_w_bits = Buffer(case_.dtype, D, kOutputSentinel);
    res.grad_gamma_bits = Buffer(case_.dtype, D, kOutputSentinel);
    DeviceBuffer d_grad_w(res.grad_w_bits), d_grad_gamma(res.grad_gamma_bits);
    const bool want_gamma = case_.rmsnorm && !skip_gamma;

    attnres_params p = Params(stream);
    p.grad_out = d_gout.get();
    p.grad_out_row_stride = gout_stride;
    p.grad_blocks = grad_block_ptrs.data();
    p.grad_partial = grad_partial;
    p.grad_source_row_stride = gsrc_stride;
    p.grad_proj_weight = skip_w ? nullptr : d_grad_w.get();
    p.grad_gamma = want_gamma ? d_grad_gamma.get() : nullptr;
    if (use_caches) {
      p.alpha_cache = alpha_cache_.get();
      if (case_.rmsnorm) p.rms_cache = rms_cache_.get();
    }
    const attnres_status status = attnres_backward(&p);
    EXPECT_EQ(status, ATTNRES_OK) << attnres_last_error();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    res.grad_sources.resize(L_);
    for (int64_t i = 0; i < L_; ++i) {
      if (skip[i]) continue;
      d_grads[i].CopyTo(&grads[i]);
      res.grad_sources[i] = ReadRows(grads[i], T, D, gsrc_stride,
                                     "grad_source[" + std::to_string(i) + "]", &res.layout_error);
    }
    d_grad_w.CopyTo(&res.grad_w_bits);
    d_grad_gamma.CopyTo(&res.grad_gamma_bits);
    if (!skip_w) res.grad_w = ReadDense(res.grad_w_bits, D, "grad_w", &res.layout_error);
    if (want_gamma) {
      res.grad_gamma = ReadDense(res.grad_gamma_bits, D, "grad_gamma", &res.layout_error);
    }
    return res;
  }

 private:
  Case case_;
  int64_t L_;
  std::vector<DeviceBuffer> sources_;
  std::vector<const void*> block_ptrs_;
  DeviceBuffer w_, gamma_, rms_cache_, alpha_cache_;
};

// dtypes x L in {1, 2, 17, 33, 128, 1024} x D in {1, 7, 123, 1536, 4096}, every
// combination once, the options (partial, rmsnorm, gamma, caches, scale, row
// padding) cycling with the case index so that each shows up across L and D.
// Tokens shrink with L * D to keep the float64 reference quick.
struct SampledCase {
  Case c;
  bool use_caches;
};

std::vector<SampledCase> SampledCases() {
  std::vector<SampledCase> cases;
  const attnres_dtype dtypes[] = {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT16,
                                  ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64};
  const int64_t sources[] = {1, 2, 17, 33, 128, 1024};
  const int64_t dims[] = {1, 7, 123, 1536, 4096};
  int index = 0;
  for (attnres_dtype dtype : dtypes) {
    for (int64_t L : sources) {
      for (int64_t D : dims) {
        Case c;
        c.dtype = dtype;
        c.dim = D;
        c.has_partial = L == 1 ? index % 2 == 0 : index % 3 != 0;
        c.num_blocks = L - (c.has_partial ? 1 : 0);
        c.rmsnorm = index % 4 != 3;
        c.has_gamma = index % 5 != 4;
        c.scale = index % 3 == 1 ? 0.5 : 1.0;
        c.eps = index % 2 == 0 ? 1e-6 : 1e-5;
        c.tokens = std::clamp<int64_t>(1500000 / (L * D), 2, 97);
        // Every 4th case pads rows by one element: odd strides force the
        // scalar path for 16-bit types; 8-element pads keep 128-bit rows.
        const int64_t pad = index % 4 == 1 ? 1 : index % 4 == 2 ? 8 : 0;
        c.source_pad = pad;
        c.out_pad = pad;
        c.grad_out_pad = index % 4 == 3 ? 8 : 0;
        c.grad_source_pad = pad;
        c.seed = 1000 + index;
        cases.push_back({c, index % 2 == 1});
        ++index;
      }
    }
  }
  return cases;
}

void ExpectForwardMatches(const Case& c, bool use_caches) {
  SCOPED_TRACE(c.Describe());
  const attnres::ref::Problem problem = MakeProblem(c);
  const attnres::ref::ForwardResult ref = attnres::ref::Forward(problem);
  DeviceProblem dev(c, problem);
  const DeviceForward got = dev.Forward(use_caches);
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_EQ(got.layout_error, "");
  EXPECT_TRUE(Close("out", got.out, ref.out, tol.out));
  if (use_caches) {
    EXPECT_TRUE(Close("alpha_cache", got.alpha, ref.alpha, tol.cache));
    if (c.rmsnorm) {
      EXPECT_TRUE(Close("rms_cache", got.rms, ref.rms, tol.cache));
    }
  }
}

void ExpectBackwardMatches(const Case& c, bool use_caches, const std::vector<bool>& skip) {
  SCOPED_TRACE(c.Describe() + (use_caches ? " caches" : " no-caches"));
  const attnres::ref::Problem problem = MakeProblem(c);
  const std::vector<double> grad_out = MakeGradOut(c);
  const attnres::ref::BackwardResult ref = attnres::ref::Backward(problem, grad_out);
  DeviceProblem dev(c, problem);
  if (use_caches) dev.Forward(true);
  const DeviceBackward got = dev.Backward(grad_out, use_caches, skip, false, false);
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_EQ(got.layout_error, "");
  for (int64_t i = 0; i < c.num_sources(); ++i) {
    if (skip[i]) continue;
    EXPECT_TRUE(Close("grad_source[" + std::to_string(i) + "]", got.grad_sources[i],
                      ref.grad_sources[i], tol.grad));
  }
  EXPECT_TRUE(Close("grad_w", got.grad_w, ref.grad_w, tol.grad));
  if (c.rmsnorm) {
    EXPECT_TRUE(Close("grad_gamma", got.grad_gamma, ref.grad_gamma, tol.grad));
  }
}

#endif  // ATTNRES_WITH_CUDA

TEST(CudaBackend, ForwardMatchesReference) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  for (const SampledCase& s : SampledCases()) ExpectForwardMatches(s.c, s.use_caches);
#endif
}

TEST(CudaBackend, BackwardMatchesReference) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  int index = 0;
  for (const SampledCase& s : SampledCases()) {
    // Every third case skips every other gradient (NULL pointers).
    std::vector<bool> skip(s.c.num_sources(), false);
    if (index++ % 3 == 2) {
      for (size_t i = 0; i < skip.size(); i += 2) skip[i] = true;
    }
    ExpectBackwardMatches(s.c, s.use_caches, skip);
  }
#endif
}

// Rows wider than the fused kernels' registers take the generic kernels.
TEST(CudaBackend, WideRowsMatchReference) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    for (int64_t D : {20000, 20001}) {
      Case c;
      c.dtype = dtype;
      c.dim = D;
      c.num_blocks = 3;
      c.tokens = 5;
      ExpectForwardMatches(c, true);
      ExpectBackwardMatches(c, false, std::vector<bool>(c.num_sources(), false));
    }
  }
#endif
}

TEST(CudaBackend, WeightGradientsAreBitwiseReproducible) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32,
                              ATTNRES_DTYPE_FLOAT64}) {
    Case c;
    c.dtype = dtype;
    c.dim = 1536;
    c.num_blocks = 8;
    c.tokens = 3001;
    SCOPED_TRACE(c.Describe());
    const attnres::ref::Problem problem = MakeProblem(c);
    const std::vector<double> grad_out = MakeGradOut(c);
    DeviceProblem dev(c, problem);
    const std::vector<bool> skip(c.num_sources(), false);
    const DeviceBackward first = dev.Backward(grad_out, false, skip, false, false);
    for (int run = 0; run < 3; ++run) {
      const DeviceBackward again = dev.Backward(grad_out, false, skip, false, false);
      EXPECT_EQ(std::memcmp(first.grad_w_bits.data(), again.grad_w_bits.data(),
                            first.grad_w_bits.total_bytes()),
                0);
      EXPECT_EQ(std::memcmp(first.grad_gamma_bits.data(), again.grad_gamma_bits.data(),
                            first.grad_gamma_bits.total_bytes()),
                0);
    }
  }
#endif
}

TEST(CudaBackend, HugeLogitsStayFinite) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  for (bool rmsnorm : {true, false}) {
    Case c;
    c.dtype = ATTNRES_DTYPE_FLOAT32;
    c.dim = 64;
    c.num_blocks = 5;
    c.tokens = 16;
    c.rmsnorm = rmsnorm;
    c.scale = 1e4;  // logits of order +-1e4
    SCOPED_TRACE(c.Describe());
    const attnres::ref::Problem problem = MakeProblem(c);
    DeviceProblem dev(c, problem);
    const DeviceForward got = dev.Forward(true);
    for (double x : got.out) ASSERT_TRUE(std::isfinite(x));
    for (double x : got.alpha) ASSERT_TRUE(std::isfinite(x));
    const attnres::ref::ForwardResult ref = attnres::ref::Forward(problem);
    EXPECT_TRUE(Close("out", got.out, ref.out, 1e-3));
    const DeviceBackward grads = dev.Backward(MakeGradOut(c), true,
                                              std::vector<bool>(c.num_sources(), false), false,
                                              false);
    for (const auto& g : grads.grad_sources) {
      for (double x : g) ASSERT_TRUE(std::isfinite(x));
    }
  }
#endif
}

TEST(CudaBackend, NanStaysInItsToken) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  Case c;
  c.dtype = ATTNRES_DTYPE_BFLOAT16;
  c.dim = 256;
  c.num_blocks = 4;
  c.tokens = 8;
  attnres::ref::Problem problem = MakeProblem(c);
  const int64_t bad_token = 5;
  problem.sources[1][bad_token * c.dim + 17] = std::numeric_limits<double>::quiet_NaN();
  DeviceProblem dev(c, problem);
  const DeviceForward got = dev.Forward(false);
  for (int64_t t = 0; t < c.tokens; ++t) {
    bool any_nan = false;
    for (int64_t d = 0; d < c.dim; ++d) any_nan |= std::isnan(got.out[t * c.dim + d]);
    EXPECT_EQ(any_nan, t == bad_token) << "token " << t;
  }
  std::vector<bool> skip(c.num_sources(), false);
  const DeviceBackward grads = dev.Backward(MakeGradOut(c), false, skip, false, false);
  for (int64_t t = 0; t < c.tokens; ++t) {
    if (t == bad_token) continue;
    for (const auto& g : grads.grad_sources) {
      for (int64_t d = 0; d < c.dim; ++d) ASSERT_FALSE(std::isnan(g[t * c.dim + d])) << t;
    }
  }
#endif
}

TEST(CudaBackend, RunsOnTheCallersStream) {
  ATTNRES_SKIP_WITHOUT_CUDA();
#ifdef ATTNRES_WITH_CUDA
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Case c;
  c.dtype = ATTNRES_DTYPE_BFLOAT16;
  c.dim = 1536;
  c.num_blocks = 200;  // > 128: pointer tables go through device memory
  c.tokens = 6;
  const attnres::ref::Problem problem = MakeProblem(c);
  DeviceProblem dev(c, problem);
  const DeviceForward got = dev.Forward(true, stream);
  EXPECT_TRUE(Close("out", got.out, attnres::ref::Forward(problem).out, 8e-3));
  const std::vector<double> grad_out = MakeGradOut(c);
  const DeviceBackward grads = dev.Backward(grad_out, true,
                                            std::vector<bool>(c.num_sources(), false), false,
                                            false, stream);
  const attnres::ref::BackwardResult ref = attnres::ref::Backward(problem, grad_out);
  EXPECT_TRUE(Close("grad_w", grads.grad_w, ref.grad_w, 1e-2));
  EXPECT_TRUE(Close("grad_source[199]", grads.grad_sources[199], ref.grad_sources[199], 1e-2));
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
#endif
}

}  // namespace
}  // namespace attnres_test
