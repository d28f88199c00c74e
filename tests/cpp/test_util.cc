#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "ref/harness.h"

#ifdef ATTNRES_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace attnres_test {

// ---------------------------------------------------------------------------
// Conversions.

float DoubleToFloatRoundToOdd(double x) {
  float f = static_cast<float>(x);
  if (std::isnan(x) || std::isinf(f) || static_cast<double>(f) == x) return f;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  // Inexact: take the neighbour towards zero, then force the last bit to one.
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) u -= 1;
  u |= 1;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t DoubleToBf16(double x) {
  const float f = DoubleToFloatRoundToOdd(x);
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet
  u += 0x7FFFu + ((u >> 16) & 1u);  // ties to even; overflow carries to inf
  return static_cast<uint16_t>(u >> 16);
}

double Bf16ToDouble(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t DoubleToF16(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7E00;
  const double a = std::fabs(x);
  // 65520 = max half (65504) + half an ulp (16): ties round to even = inf.
  if (a >= 65520.0) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) {
    // Subnormal (or rounds up to the smallest normal: m = 1024 encodes it).
    const double m = std::nearbyint(a * std::ldexp(1.0, 24));
    return sign | static_cast<uint16_t>(m);
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  e -= 1;             // a = 1.xxx * 2^e
  double mant = std::nearbyint(std::ldexp(a, -e) * 1024.0);  // in [1024, 2048]
  if (mant == 2048.0) {
    mant = 1024.0;
    e += 1;
  }
  if (e > 15) return sign | 0x7C00;
  return sign | static_cast<uint16_t>(((e + 15) << 10) |
                                      (static_cast<int>(mant) - 1024));
}

double F16ToDouble(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int e = (bits >> 10) & 0x1F;
  const int m = bits & 0x3FF;
  if (e == 0x1F) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  return sign * std::ldexp(static_cast<double>(m + 1024), e - 25);
}

size_t DTypeSize(attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT32: return 4;
    case ATTNRES_DTYPE_FLOAT64: return 8;
    case ATTNRES_DTYPE_BFLOAT16: return 2;
    case ATTNRES_DTYPE_FLOAT16: return 2;
  }
  return 0;
}

const char* DTypeName(attnres_dtype dtype) { return attnres::harness::DtypeName(dtype); }

double RoundToDType(double x, attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT32: return static_cast<float>(x);
    case ATTNRES_DTYPE_FLOAT64: return x;
    case ATTNRES_DTYPE_BFLOAT16: return Bf16ToDouble(DoubleToBf16(x));
    case ATTNRES_DTYPE_FLOAT16: return F16ToDouble(DoubleToF16(x));
  }
  return x;
}

attnres_dtype CacheDType(attnres_dtype dtype) {
  return dtype == ATTNRES_DTYPE_FLOAT64 ? ATTNRES_DTYPE_FLOAT64
                                        : ATTNRES_DTYPE_FLOAT32;
}

// ---------------------------------------------------------------------------
// DeviceMemory and Buffer.

#ifdef ATTNRES_WITH_CUDA

DeviceMemory::DeviceMemory(size_t bytes, size_t offset) : bytes_(bytes), offset_(offset) {
  const cudaError_t err = cudaMalloc(&base_, bytes + offset);
  if (err != cudaSuccess) {
    base_ = nullptr;
    ADD_FAILURE() << "cudaMalloc of " << bytes + offset << " bytes: " << cudaGetErrorString(err);
  }
}

DeviceMemory::~DeviceMemory() {
  if (base_ != nullptr) cudaFree(base_);
}

void DeviceMemory::Fill(uint8_t pattern) {
  EXPECT_EQ(cudaMemset(get(), pattern, bytes_), cudaSuccess);
}

void Buffer::Upload() {
  if (device_.get() == nullptr) return;
  EXPECT_EQ(cudaMemcpy(device_.get(), data(), total_bytes(), cudaMemcpyHostToDevice),
            cudaSuccess);
}

void Buffer::Download() {
  if (device_.get() == nullptr) return;
  EXPECT_EQ(cudaMemcpy(data(), device_.get(), total_bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
}

#else  // Tests that need a device skip before they allocate.

DeviceMemory::DeviceMemory(size_t bytes, size_t offset) : bytes_(bytes), offset_(offset) {
  ADD_FAILURE() << "device memory in a test built without ATTNRES_WITH_CUDA";
}

DeviceMemory::~DeviceMemory() = default;

void DeviceMemory::Fill(uint8_t) {}
void Buffer::Upload() {}
void Buffer::Download() {}

#endif  // ATTNRES_WITH_CUDA

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  std::swap(base_, other.base_);
  std::swap(bytes_, other.bytes_);
  std::swap(offset_, other.offset_);
  return *this;
}

Buffer::Buffer(attnres_dtype dtype, size_t count, uint8_t fill)
    : dtype_(dtype),
      count_(count),
      storage_((count + kGuardElements) * DTypeSize(dtype), fill) {}

void Buffer::AddDeviceTwin(size_t offset) {
  device_ = DeviceMemory(total_bytes(), offset);
  Upload();
}

void Buffer::Set(size_t i, double v) {
  unsigned char* p = storage_.data() + i * elem_size();
  switch (dtype_) {
    case ATTNRES_DTYPE_FLOAT32: {
      const float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case ATTNRES_DTYPE_FLOAT64:
      std::memcpy(p, &v, 8);
      break;
    case ATTNRES_DTYPE_BFLOAT16: {
      const uint16_t b = DoubleToBf16(v);
      std::memcpy(p, &b, 2);
      break;
    }
    case ATTNRES_DTYPE_FLOAT16: {
      const uint16_t h = DoubleToF16(v);
      std::memcpy(p, &h, 2);
      break;
    }
  }
}

double Buffer::Get(size_t i) const {
  const unsigned char* p = storage_.data() + i * elem_size();
  switch (dtype_) {
    case ATTNRES_DTYPE_FLOAT32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case ATTNRES_DTYPE_FLOAT64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case ATTNRES_DTYPE_BFLOAT16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return Bf16ToDouble(b);
    }
    case ATTNRES_DTYPE_FLOAT16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return F16ToDouble(h);
    }
  }
  return 0;
}

void Buffer::Fill(uint8_t pattern) {
  std::fill(storage_.begin(), storage_.end(), pattern);
}

bool Buffer::BytesAre(size_t first, size_t n, uint8_t pattern) const {
  const size_t es = elem_size();
  for (size_t b = first * es; b < (first + n) * es; ++b) {
    if (storage_[b] != pattern) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Problems.

std::string Case::Describe() const {
  std::ostringstream s;
  s << DTypeName(dtype) << " T=" << tokens << " D=" << dim << " N=" << num_blocks
    << (has_partial ? "+partial" : "") << (rmsnorm ? " rmsnorm" : " no-rmsnorm")
    << (has_gamma ? " gamma" : " gamma=NULL") << " scale=" << scale
    << " eps=" << eps << " pads(src/out/gout/gsrc)=" << source_pad << "/" << out_pad
    << "/" << grad_out_pad << "/" << grad_source_pad << " seed=" << seed;
  return s.str();
}

namespace {

// A problem with c's sizes and flags, and no values yet.
attnres::ref::Problem ProblemWithoutValues(const Case& c) {
  attnres::ref::Problem p;
  p.tokens = c.tokens;
  p.dim = c.dim;
  p.num_blocks = c.num_blocks;
  p.has_partial = c.has_partial;
  p.rmsnorm = c.rmsnorm;
  p.scale = c.scale;
  p.eps = c.eps;
  return p;
}

}  // namespace

attnres::ref::Problem MakeProblem(const Case& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> spread(0.5, 2.0);
  attnres::ref::Problem p = ProblemWithoutValues(c);
  const int64_t L = c.num_sources();
  p.sources.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    const double s = spread(rng);
    p.sources[i].resize(c.tokens * c.dim);
    for (double& v : p.sources[i]) v = RoundToDType(s * normal(rng), c.dtype);
  }
  p.w.resize(c.dim);
  const double w_scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  for (double& v : p.w) v = RoundToDType(w_scale * normal(rng), c.dtype);
  if (c.has_gamma) {
    p.gamma.resize(c.dim);
    for (double& v : p.gamma) v = RoundToDType(1.0 + 0.2 * normal(rng), c.dtype);
  }
  return p;
}

std::string SharpLogits::Describe() const {
  static const char* const kNames[] = {"blocks", "partial", "first block", "all but the first block"};
  std::ostringstream s;
  s << "gap=" << gap << " favoured: " << kNames[static_cast<int>(favoured)]
    << " partial x" << partial_magnitude;
  return s.str();
}

attnres::ref::Problem MakeSharpProblem(const Case& c, const SharpLogits& sharp) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> spread(0.5, 2.0);
  attnres::ref::Problem p = ProblemWithoutValues(c);
  const int64_t L = c.num_sources(), N = c.num_blocks, T = c.tokens, D = c.dim;
  std::vector<bool> favoured(L);
  for (int64_t i = 0; i < L; ++i) {
    const bool partial = c.has_partial && i == N;
    switch (sharp.favoured) {
      case Favoured::kBlocks: favoured[i] = !partial; break;
      case Favoured::kPartial: favoured[i] = partial; break;
      case Favoured::kFirstBlock: favoured[i] = i == 0; break;
      case Favoured::kAllButFirstBlock: favoured[i] = i != 0; break;
    }
  }
  p.sources.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    // Without RMSNorm a source's size scales its logit: the blocks are all of one size.
    const double size = c.has_partial && i == N ? sharp.partial_magnitude
                        : c.rmsnorm             ? spread(rng)
                                                : 1.0;
    const double sign = favoured[i] ? 1.0 : -1.0;
    p.sources[i].resize(T * D);
    for (double& v : p.sources[i]) v = RoundToDType(size * sign * (1 + 0.2 * normal(rng)), c.dtype);
  }
  if (c.has_gamma) {
    p.gamma.resize(D);
    for (double& v : p.gamma) v = RoundToDType(1.0 + 0.2 * normal(rng), c.dtype);
  }
  // Each source's mean logit for w = ones; w is then scaled so that they span `gap`
  // (the favoured ones on top).
  double lowest = 0, highest = 0;
  for (int64_t i = 0; i < L; ++i) {
    double mean = 0;
    for (int64_t t = 0; t < T; ++t) {
      const double* v = p.sources[i].data() + t * D;
      double sum_sq = 0, dot = 0;
      for (int64_t d = 0; d < D; ++d) {
        sum_sq += v[d] * v[d];
        dot += (p.gamma.empty() || !c.rmsnorm ? 1.0 : p.gamma[d]) * v[d];
      }
      mean += c.scale * dot / (c.rmsnorm ? std::sqrt(sum_sq / D + c.eps) : 1.0) / T;
    }
    lowest = i == 0 ? mean : std::min(lowest, mean);
    highest = i == 0 ? mean : std::max(highest, mean);
  }
  p.w.assign(D, RoundToDType(sharp.gap / (highest - lowest), c.dtype));
  return p;
}

bool Fp16HoldsSharp(double gap, double partial_size) {
  return partial_size >= 1e-2 && partial_size <= 10 &&
         std::exp(-gap) * std::min(partial_size, 1.0) >= 1e-5;
}

std::vector<double> SharpPartialSizes(attnres_dtype dtype) {
  if (dtype == ATTNRES_DTYPE_FLOAT16) return {1e-2, 1.0, 10.0};
  return {1e-3, 1.0, 1e3};
}

std::vector<SharpLogits> SharpFamily(attnres_dtype dtype, bool has_partial) {
  std::vector<Favoured> patterns = {Favoured::kFirstBlock, Favoured::kAllButFirstBlock};
  if (has_partial) patterns.insert(patterns.begin(), {Favoured::kBlocks, Favoured::kPartial});
  std::vector<SharpLogits> family;
  for (double gap : {0.0, 5.0, 10.0, 20.0, 30.0}) {
    for (Favoured favoured : patterns) {
      for (double size : SharpPartialSizes(dtype)) {
        if (!has_partial && size != 1.0) continue;
        if (dtype == ATTNRES_DTYPE_FLOAT16 && !Fp16HoldsSharp(gap, size)) continue;
        family.push_back({gap, favoured, size});
      }
    }
  }
  return family;
}

std::vector<double> MakeGradOut(const Case& c) {
  std::mt19937_64 rng(c.seed ^ 0x9E3779B97F4A7C15ull);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g(c.tokens * c.dim);
  for (double& v : g) v = RoundToDType(normal(rng), c.dtype);
  return g;
}

// ---------------------------------------------------------------------------
// Reading back.

Buffer InputBuffer(attnres_dtype dtype, const std::vector<double>& v) {
  Buffer b(dtype, v.size(), kInputPadding);
  for (size_t i = 0; i < v.size(); ++i) b.Set(i, v[i]);
  return b;
}

std::vector<double> Values(const Buffer& b) {
  std::vector<double> v(b.count());
  for (size_t i = 0; i < v.size(); ++i) v[i] = b.Get(i);
  return v;
}

std::vector<double> ReadRows(const Buffer& b, int64_t rows, int64_t dim, int64_t stride,
                             const std::string& name, std::string* layout_error) {
  std::vector<double> v(rows * dim);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) v[t * dim + d] = b.Get(t * stride + d);
    if (t + 1 < rows && stride > dim &&
        !b.BytesAre(t * stride + dim, stride - dim, kOutputSentinel)) {
      *layout_error += name + ": row padding after row " + std::to_string(t) + " was written; ";
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

// ---------------------------------------------------------------------------
// AbiProblem.

namespace {

const void* const kNoBlocks[1] = {nullptr};  // non-NULL array for N = 0

// FNV-1a over 8-byte words of the host bytes: detects any write to a buffer.
uint64_t Hash(const Buffer& b) {
  uint64_t h = 1469598103934665603ull;
  const size_t n = b.total_bytes();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, b.bytes() + i, 8);
    h = (h ^ word) * 1099511628211ull;
  }
  for (; i < n; ++i) h = (h ^ b.bytes()[i]) * 1099511628211ull;
  return h;
}

std::vector<uint64_t> Hashes(const std::vector<Buffer*>& buffers) {
  std::vector<uint64_t> h;
  for (const Buffer* b : buffers) h.push_back(Hash(*b));
  return h;
}

void FillRows(Buffer* b, const std::vector<double>& values, int64_t rows,
              int64_t dim, int64_t stride) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) b->Set(t * stride + d, values[t * dim + d]);
  }
}

void ResetOutput(Buffer* b) {
  b->Fill(kOutputSentinel);
  b->Upload();
}

int64_t ElementAt(const std::vector<int64_t>& v, int64_t i) {
  return i < static_cast<int64_t>(v.size()) ? v[i] : 0;
}

}  // namespace

// Waits for every call on the device, whatever its stream, and reports an error
// that surfaced asynchronously.
void Synchronize(attnres_device device) {
#ifdef ATTNRES_WITH_CUDA
  if (device == ATTNRES_DEVICE_CUDA) {
    const cudaError_t err = cudaDeviceSynchronize();
    EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  }
#else
  (void)device;
#endif
}

AbiProblem::AbiProblem(const Case& c, const attnres::ref::Problem& p, attnres_device device,
                       const Placement& at)
    : case_(c), L_(c.num_sources()), device_(device) {
  const int64_t T = c.tokens, D = c.dim;
  for (int64_t i = 0; i < L_; ++i) {
    sources_.emplace_back(c.dtype, StridedCount(T, D, D + c.source_pad), kInputPadding);
    FillRows(&sources_.back(), p.sources[i], T, D, D + c.source_pad);
  }
  w_ = Buffer(c.dtype, D, kInputPadding);
  for (int64_t d = 0; d < D; ++d) w_.Set(d, p.w[d]);
  if (c.has_gamma) {
    gamma_ = Buffer(c.dtype, D, kInputPadding);
    for (int64_t d = 0; d < D; ++d) gamma_.Set(d, p.gamma[d]);
  }
  const attnres_dtype cache_dtype = CacheDType(c.dtype);
  out_ = Buffer(c.dtype, StridedCount(T, D, D + c.out_pad), kOutputSentinel);
  rms_cache_ = Buffer(cache_dtype, T * L_, kOutputSentinel);
  alpha_cache_ = Buffer(cache_dtype, T * L_, kOutputSentinel);
  grad_out_ = Buffer(c.dtype, StridedCount(T, D, D + c.grad_out_pad), kInputPadding);
  for (int64_t i = 0; i < L_; ++i) {
    grad_sources_.emplace_back(c.dtype, StridedCount(T, D, D + c.grad_source_pad),
                               kOutputSentinel);
  }
  grad_w_ = Buffer(c.dtype, D, kOutputSentinel);
  grad_gamma_ = Buffer(c.dtype, D, kOutputSentinel);
  // Every buffer up front, so that the addresses stay put for a captured graph.
  if (device == ATTNRES_DEVICE_CUDA) {
    const size_t elem = DTypeSize(c.dtype);
    for (int64_t i = 0; i < L_; ++i) sources_[i].AddDeviceTwin(ElementAt(at.sources, i) * elem);
    w_.AddDeviceTwin(at.w * elem);
    if (c.has_gamma) gamma_.AddDeviceTwin(at.gamma * elem);
    out_.AddDeviceTwin(at.out * elem);
    rms_cache_.AddDeviceTwin(0);
    alpha_cache_.AddDeviceTwin(0);
    grad_out_.AddDeviceTwin(at.grad_out * elem);
    for (int64_t i = 0; i < L_; ++i) {
      grad_sources_[i].AddDeviceTwin(ElementAt(at.grads, i) * elem);
    }
    grad_w_.AddDeviceTwin(0);
    grad_gamma_.AddDeviceTwin(0);
    Synchronize(device);
  }
  for (int64_t i = 0; i < c.num_blocks; ++i) block_ptrs_.push_back(sources_[i].abi_data());
  cache_hashes_ = Hashes({&rms_cache_, &alpha_cache_});
}

attnres_params CommonParams(attnres_device device, attnres_dtype dtype, int64_t tokens,
                            int64_t dim, int64_t source_row_stride, double scale, double eps,
                            bool rmsnorm) {
  attnres_params p;
  attnres_params_init(&p);
  p.device = device;
  p.dtype = dtype;
  p.num_tokens = tokens;
  p.dim = dim;
  p.source_row_stride = source_row_stride;
  p.scale = scale;
  p.eps = eps;
  p.rmsnorm = rmsnorm ? 1 : 0;
  return p;
}

attnres_params AbiProblem::InputParams() const {
  const Case& c = case_;
  attnres_params p = CommonParams(device_, c.dtype, c.tokens, c.dim, c.dim + c.source_pad,
                                  c.scale, c.eps, c.rmsnorm);
  p.stream = stream_;
  p.num_blocks = c.num_blocks;
  p.blocks = block_ptrs_.empty() ? kNoBlocks : block_ptrs_.data();
  p.partial = c.has_partial ? sources_[L_ - 1].abi_data() : nullptr;
  p.proj_weight = w_.abi_data();
  p.gamma = c.has_gamma ? gamma_.abi_data() : nullptr;
  return p;
}

bool AbiProblem::Skipped(const BackwardOptions& o, int64_t i) const {
  if (i < case_.num_blocks && o.grad_blocks_null) return true;
  return i < static_cast<int64_t>(o.skip_source.size()) && o.skip_source[i];
}

std::vector<std::pair<std::string, Buffer*>> AbiProblem::Inputs(bool backward) {
  std::vector<std::pair<std::string, Buffer*>> inputs;
  for (int64_t i = 0; i < L_; ++i) inputs.emplace_back("source " + std::to_string(i), &sources_[i]);
  inputs.emplace_back("proj_weight", &w_);
  if (case_.has_gamma) inputs.emplace_back("gamma", &gamma_);
  if (backward) inputs.emplace_back("grad_out", &grad_out_);
  return inputs;
}

std::vector<Buffer*> AbiProblem::Outputs() {
  std::vector<Buffer*> outputs = {&out_, &rms_cache_, &alpha_cache_, &grad_w_, &grad_gamma_};
  for (Buffer& g : grad_sources_) outputs.push_back(&g);
  return outputs;
}

void AbiProblem::Ready(bool backward) {
  input_hashes_.clear();
  for (const auto& [name, buffer] : Inputs(backward)) {
    buffer->Upload();
    input_hashes_.push_back(Hash(*buffer));
  }
  output_hashes_ = Hashes(Outputs());
  Synchronize(device_);  // Buffer::Upload: before a launch on a non-blocking stream
}

void AbiProblem::CheckInputs(bool backward, std::string* layout_error) {
  const auto inputs = Inputs(backward);
  for (size_t k = 0; k < inputs.size(); ++k) {
    inputs[k].second->Download();
    if (Hash(*inputs[k].second) != input_hashes_[k]) {
      *layout_error += inputs[k].first + " was modified; ";
    }
  }
}

attnres_params AbiProblem::PrepareForward(bool want_rms_cache, bool want_alpha_cache) {
  want_rms_ = want_rms_cache;
  want_alpha_ = want_alpha_cache;
  caches_valid_ = false;
  for (Buffer* b : {&out_, &rms_cache_, &alpha_cache_}) ResetOutput(b);
  cache_hashes_ = Hashes({&rms_cache_, &alpha_cache_});
  Ready(false);
  attnres_params p = InputParams();
  p.out = out_.abi_data();
  p.out_row_stride = case_.dim + case_.out_pad;
  if (want_rms_cache) p.rms_cache = rms_cache_.abi_data();
  if (want_alpha_cache) p.alpha_cache = alpha_cache_.abi_data();
  return p;
}

ForwardOutput AbiProblem::ReadForward() {
  ForwardOutput res;
  const int64_t T = case_.tokens, D = case_.dim;
  Synchronize(device_);
  CheckInputs(false, &res.layout_error);
  out_.Download();
  res.out = ReadRows(out_, T, D, D + case_.out_pad, "out", &res.layout_error);
  if (want_rms_) {
    rms_cache_.Download();
    res.rms = ReadDense(rms_cache_, T * L_, "rms_cache", &res.layout_error);
  }
  if (want_alpha_) {
    alpha_cache_.Download();
    res.alpha = ReadDense(alpha_cache_, T * L_, "alpha_cache", &res.layout_error);
  }
  caches_valid_ = want_alpha_ && (want_rms_ || !case_.rmsnorm);
  cache_hashes_ = Hashes({&rms_cache_, &alpha_cache_});
  return res;
}

ForwardOutput AbiProblem::Forward(bool want_rms_cache, bool want_alpha_cache) {
  const attnres_params p = PrepareForward(want_rms_cache, want_alpha_cache);
  const attnres_status status = attnres_forward(&p);
  if (status != ATTNRES_OK) {
    ForwardOutput res;
    res.status = status;
    res.error = attnres_last_error();
    return res;
  }
  return ReadForward();
}

attnres_params AbiProblem::PrepareBackward(const std::vector<double>& grad_out,
                                           const BackwardOptions& o) {
  backward_ = o;
  const int64_t D = case_.dim, N = case_.num_blocks;
  FillRows(&grad_out_, grad_out, case_.tokens, D, D + case_.grad_out_pad);
  for (Buffer& g : grad_sources_) ResetOutput(&g);
  ResetOutput(&grad_w_);
  ResetOutput(&grad_gamma_);
  Ready(true);
  attnres_params p = InputParams();
  p.grad_out = grad_out_.abi_data();
  p.grad_out_row_stride = D + case_.grad_out_pad;
  if (o.use_rms_cache && case_.rmsnorm) p.rms_cache = rms_cache_.abi_data();
  if (o.use_alpha_cache) p.alpha_cache = alpha_cache_.abi_data();
  grad_block_ptrs_.assign(N, nullptr);
  for (int64_t i = 0; i < N; ++i) {
    if (!Skipped(o, i)) grad_block_ptrs_[i] = grad_sources_[i].abi_data();
  }
  p.grad_blocks = o.grad_blocks_null ? nullptr : grad_block_ptrs_.data();
  if (case_.has_partial && !Skipped(o, L_ - 1)) p.grad_partial = grad_sources_[L_ - 1].abi_data();
  p.grad_source_row_stride = D + case_.grad_source_pad;
  if (!o.skip_w) p.grad_proj_weight = grad_w_.abi_data();
  if (case_.rmsnorm && !o.skip_gamma) p.grad_gamma = grad_gamma_.abi_data();
  return p;
}

BackwardOutput AbiProblem::ReadBackward() {
  BackwardOutput res;
  const BackwardOptions& o = backward_;
  const int64_t T = case_.tokens, D = case_.dim;
  Synchronize(device_);
  CheckInputs(true, &res.layout_error);
  rms_cache_.Download();
  alpha_cache_.Download();
  const std::vector<uint64_t> caches = Hashes({&rms_cache_, &alpha_cache_});
  if (caches[0] != cache_hashes_[0]) res.layout_error += "rms_cache was modified; ";
  if (caches[1] != cache_hashes_[1]) res.layout_error += "alpha_cache was modified; ";

  res.grad_sources.resize(L_);
  for (int64_t i = 0; i < L_; ++i) {
    if (Skipped(o, i)) continue;
    grad_sources_[i].Download();
    res.grad_sources[i] = ReadRows(grad_sources_[i], T, D, D + case_.grad_source_pad,
                                   "grad_source[" + std::to_string(i) + "]", &res.layout_error);
  }
  if (!o.skip_w) {
    grad_w_.Download();
    res.grad_w = ReadDense(grad_w_, D, "grad_proj_weight", &res.layout_error);
  }
  if (case_.rmsnorm && !o.skip_gamma) {
    grad_gamma_.Download();
    res.grad_gamma = ReadDense(grad_gamma_, D, "grad_gamma", &res.layout_error);
  }
  return res;
}

BackwardOutput AbiProblem::Backward(const std::vector<double>& grad_out,
                                    const BackwardOptions& o) {
  BackwardOutput res;
  const bool want_caches = o.use_alpha_cache || (o.use_rms_cache && case_.rmsnorm);
  if (want_caches && !caches_valid_) {
    const ForwardOutput f = Forward(case_.rmsnorm, true);
    if (f.status != ATTNRES_OK) {
      res.status = f.status;
      res.error = "forward (for the caches) failed: " + f.error;
      return res;
    }
  }
  const attnres_params p = PrepareBackward(grad_out, o);
  res.status = attnres_backward(&p);
  if (res.status != ATTNRES_OK) {
    res.error = attnres_last_error();
    return res;
  }
  return ReadBackward();
}

bool AbiProblem::OutputsUntouched() {
  Synchronize(device_);
  const std::vector<Buffer*> outputs = Outputs();
  for (Buffer* b : outputs) b->Download();
  return Hashes(outputs) == output_hashes_;
}

// ---------------------------------------------------------------------------
// Comparison.

namespace {

struct CheckCount {
  size_t checks = 0, elements = 0;
};
CheckCount& Counted() {
  static CheckCount count;
  return count;
}

class CheckCountReport : public ::testing::Environment {
 public:
  void TearDown() override {
    if (std::getenv("ATTNRES_COUNT_CHECKS") == nullptr) return;
    std::printf("attnres checks: %zu comparisons of %zu elements\n", Counted().checks,
                Counted().elements);
  }
};
::testing::Environment* const kCheckCountReport =
    ::testing::AddGlobalTestEnvironment(new CheckCountReport);

}  // namespace

void CountCheck(size_t elements) {
  ++Counted().checks;
  Counted().elements += elements;
}

double RelMaxError(const std::vector<double>& actual,
                   const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double max_ref = 0, max_err = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (!std::isfinite(e)) {
      const bool same = (std::isnan(e) && std::isnan(a)) || a == e;
      if (!same) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
    max_ref = std::max(max_ref, std::fabs(e));
    max_err = std::max(max_err, std::fabs(a - e));
  }
  return max_ref == 0 ? max_err : max_err / max_ref;
}

::testing::AssertionResult Close(const std::string& what,
                                 const std::vector<double>& actual,
                                 const std::vector<double>& expected, double tol) {
  CountCheck(expected.size());
  const double err = RelMaxError(actual, expected);
  if (err <= tol) return ::testing::AssertionSuccess();
  auto fail = ::testing::AssertionFailure();
  fail << what << ": relative max error " << err << " > " << tol;
  if (actual.size() != expected.size()) {
    return fail << " (size " << actual.size() << " vs expected " << expected.size()
                << ")";
  }
  size_t worst = 0;
  double worst_err = -1, max_ref = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    double e = std::fabs(actual[i] - expected[i]);
    if (std::isnan(e)) e = std::numeric_limits<double>::infinity();
    if (e > worst_err) {
      worst_err = e;
      worst = i;
    }
    if (std::isfinite(expected[i])) max_ref = std::max(max_ref, std::fabs(expected[i]));
  }
  std::ostringstream detail;
  detail.precision(17);
  detail << " (worst at index " << worst << ": actual " << actual[worst] << ", expected "
         << expected[worst] << "; max|expected| " << max_ref << ", " << actual.size()
         << " elements)";
  return fail << detail.str();
}


void ExpectForwardClose(const Case& c, const ForwardOutput& got,
                        const attnres::ref::ForwardResult& ref, bool caches) {
  ASSERT_EQ(got.status, ATTNRES_OK) << got.error;
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_EQ(got.layout_error, "");
  EXPECT_TRUE(Close("out", got.out, ref.out, tol.out));
  if (caches) {
    EXPECT_TRUE(Close("alpha_cache", got.alpha, ref.alpha, tol.cache));
    if (c.rmsnorm) {
      EXPECT_TRUE(Close("rms_cache", got.rms, ref.rms, tol.cache));
    }
  }
}

void ExpectBackwardClose(const Case& c, const BackwardOutput& got,
                         const attnres::ref::BackwardResult& ref, const BackwardOptions& o) {
  ASSERT_EQ(got.status, ATTNRES_OK) << got.error;
  const Tolerance tol = ToleranceFor(c.dtype);
  EXPECT_EQ(got.layout_error, "");
  for (int64_t i = 0; i < c.num_sources(); ++i) {
    if (got.grad_sources[i].empty()) continue;
    EXPECT_TRUE(Close("grad_source[" + std::to_string(i) + "]", got.grad_sources[i],
                      ref.grad_sources[i], tol.grad));
  }
  if (!o.skip_w) {
    EXPECT_TRUE(Close("grad_w", got.grad_w, ref.grad_w, tol.grad));
  }
  if (c.rmsnorm && !o.skip_gamma) {
    EXPECT_TRUE(Close("grad_gamma", got.grad_gamma, ref.grad_gamma, tol.grad));
  }
}

void ExpectBackwardCloseWithAndWithoutCaches(AbiProblem& abi, const std::vector<double>& grad_out,
                                             const attnres::ref::BackwardResult& ref) {
  for (bool caches : {false, true}) {
    SCOPED_TRACE(caches ? "backward with caches" : "backward without caches");
    ExpectBackwardClose(abi.config(), abi.Backward(grad_out, WithCaches(caches)), ref, {});
  }
}

// ---------------------------------------------------------------------------
// Backends.

std::vector<std::string> AvailableIsas() {
  std::vector<std::string> isas;
  std::istringstream names(attnres_cpu_isas());
  for (std::string name; names >> name;) isas.push_back(name);
  return isas;
}

std::vector<Backend> AvailableBackends() {
  std::vector<Backend> backends;
  for (const std::string& isa : AvailableIsas()) backends.push_back({isa, ATTNRES_DEVICE_CPU});
#ifdef ATTNRES_WITH_CUDA
  if (attnres_cuda_available()) backends.push_back({"cuda", ATTNRES_DEVICE_CUDA});
#endif
  return backends;
}

void ForEachBackend(const std::function<void(const Backend& backend)>& body) {
  static const std::vector<Backend> backends = AvailableBackends();
  if (backends.empty() || backends.front().device != ATTNRES_DEVICE_CPU) {
    ADD_FAILURE() << "attnres_set_cpu_isa accepted none of the ISA names";
  }
  for (const Backend& backend : backends) {
    if (backend.device == ATTNRES_DEVICE_CPU) {
      ASSERT_EQ(attnres_set_cpu_isa(backend.name.c_str()), ATTNRES_OK) << backend.name;
    } else {
      attnres_set_cpu_isa(nullptr);
    }
    SCOPED_TRACE("backend=" + backend.name);
    body(backend);
  }
  attnres_set_cpu_isa(nullptr);
}

void ForEachIsa(const std::function<void(const std::string& isa)>& body) {
  ForEachBackend([&](const Backend& backend) {
    if (backend.device == ATTNRES_DEVICE_CPU) body(backend.name);
  });
}

std::string CudaRuntimeStatus() {
#ifdef ATTNRES_WITH_CUDA
  int count = 0, driver = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  cudaDriverGetVersion(&driver);
  cudaGetLastError();
  return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + "), " + std::to_string(count) + " device(s), driver API " +
         std::to_string(driver);
#else
  return "test built without ATTNRES_WITH_CUDA";
#endif
}

ScopedEnv::ScopedEnv(const char* name, const char* value) : name_(name) {
  if (const char* old = std::getenv(name); old != nullptr) {
    old_ = old;
    had_ = true;
  }
  setenv(name, value, 1);
}

ScopedEnv::~ScopedEnv() {
  if (had_) {
    setenv(name_, old_.c_str(), 1);
  } else {
    unsetenv(name_);
  }
}

bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b) {
  CountCheck(b.size());
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

}  // namespace attnres_test
