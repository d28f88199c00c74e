#include "test_util.h"

#include "ref/harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

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
// Buffer.

Buffer::Buffer(attnres_dtype dtype, size_t count, uint8_t fill)
    : dtype_(dtype),
      count_(count),
      storage_((count + kGuardElements) * DTypeSize(dtype), fill) {}

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

attnres::ref::Problem MakeProblem(const Case& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> spread(0.5, 2.0);
  attnres::ref::Problem p;
  p.tokens = c.tokens;
  p.dim = c.dim;
  p.num_blocks = c.num_blocks;
  p.has_partial = c.has_partial;
  p.rmsnorm = c.rmsnorm;
  p.scale = c.scale;
  p.eps = c.eps;
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

std::vector<double> MakeGradOut(const Case& c) {
  std::mt19937_64 rng(c.seed ^ 0x9E3779B97F4A7C15ull);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g(c.tokens * c.dim);
  for (double& v : g) v = RoundToDType(normal(rng), c.dtype);
  return g;
}

// ---------------------------------------------------------------------------
// AbiProblem.

namespace {

const void* const kNoBlocks[1] = {nullptr};  // non-NULL array for N = 0

// FNV-1a over 8-byte words: detects any write to an input buffer.
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

void FillRows(Buffer* b, const std::vector<double>& values, int64_t rows,
              int64_t dim, int64_t stride) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) b->Set(t * stride + d, values[t * dim + d]);
  }
}

}  // namespace

AbiProblem::AbiProblem(const Case& c, const attnres::ref::Problem& p)
    : case_(c), L_(c.num_sources()) {
  const int64_t stride = c.dim + c.source_pad;
  for (int64_t i = 0; i < L_; ++i) {
    sources_.emplace_back(c.dtype, StridedCount(c.tokens, c.dim, stride),
                          kInputPadding);
    FillRows(&sources_.back(), p.sources[i], c.tokens, c.dim, stride);
  }
  for (int64_t i = 0; i < c.num_blocks; ++i) block_ptrs_.push_back(sources_[i].data());
  w_ = Buffer(c.dtype, c.dim, kInputPadding);
  for (int64_t d = 0; d < c.dim; ++d) w_.Set(d, p.w[d]);
  if (c.has_gamma) {
    gamma_ = Buffer(c.dtype, c.dim, kInputPadding);
    for (int64_t d = 0; d < c.dim; ++d) gamma_.Set(d, p.gamma[d]);
  }
}

attnres_params AbiProblem::InputParams() const {
  attnres_params p;
  attnres_params_init(&p);
  p.num_tokens = case_.tokens;
  p.dim = case_.dim;
  p.num_blocks = case_.num_blocks;
  p.dtype = case_.dtype;
  p.device = ATTNRES_DEVICE_CPU;
  p.blocks = block_ptrs_.empty() ? kNoBlocks : block_ptrs_.data();
  p.partial = case_.has_partial ? sources_[L_ - 1].data() : nullptr;
  p.source_row_stride = case_.dim + case_.source_pad;
  p.proj_weight = w_.data();
  p.gamma = case_.has_gamma ? gamma_.data() : nullptr;
  p.scale = case_.scale;
  p.eps = case_.eps;
  p.rmsnorm = case_.rmsnorm ? 1 : 0;
  return p;
}

std::vector<double> AbiProblem::ReadRows(const Buffer& b, int64_t stride,
                                         const char* name,
                                         std::string* layout_error) const {
  const int64_t T = case_.tokens, D = case_.dim;
  std::vector<double> v(T * D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < D; ++d) v[t * D + d] = b.Get(t * stride + d);
    if (t + 1 < T && stride > D &&
        !b.BytesAre(t * stride + D, stride - D, kOutputSentinel)) {
      *layout_error += std::string(name) + ": row padding after row " +
                       std::to_string(t) + " was written; ";
    }
  }
  if (!b.GuardIntact(kOutputSentinel)) {
    *layout_error += std::string(name) + ": written past its end; ";
  }
  return v;
}

ForwardOutput AbiProblem::Forward(bool want_rms_cache, bool want_alpha_cache) {
  ForwardOutput res;
  const int64_t T = case_.tokens, D = case_.dim;
  const int64_t out_stride = D + case_.out_pad;
  attnres_params p = InputParams();
  out_ = Buffer(case_.dtype, StridedCount(T, D, out_stride), kOutputSentinel);
  p.out = out_.data();
  p.out_row_stride = out_stride;
  const attnres_dtype cache_dtype = CacheDType(case_.dtype);
  if (want_rms_cache) {
    rms_cache_ = Buffer(cache_dtype, T * L_, kOutputSentinel);
    p.rms_cache = rms_cache_.data();
  }
  if (want_alpha_cache) {
    alpha_cache_ = Buffer(cache_dtype, T * L_, kOutputSentinel);
    p.alpha_cache = alpha_cache_.data();
  }
  caches_valid_ = false;

  std::vector<uint64_t> input_hashes;
  for (const Buffer& s : sources_) input_hashes.push_back(Hash(s));
  res.status = attnres_forward(&p);
  if (res.status != ATTNRES_OK) {
    res.error = attnres_last_error();
    return res;
  }
  for (size_t i = 0; i < sources_.size(); ++i) {
    if (Hash(sources_[i]) != input_hashes[i]) {
      res.layout_error += "source " + std::to_string(i) + " was modified; ";
    }
  }
  res.out = ReadRows(out_, out_stride, "out", &res.layout_error);
  auto read_cache = [&](const Buffer& b, const char* name) {
    std::vector<double> v(T * L_);
    for (int64_t k = 0; k < T * L_; ++k) v[k] = b.Get(k);
    if (!b.GuardIntact(kOutputSentinel)) {
      res.layout_error += std::string(name) + ": written past its end; ";
    }
    return v;
  };
  if (want_rms_cache) res.rms = read_cache(rms_cache_, "rms_cache");
  if (want_alpha_cache) res.alpha = read_cache(alpha_cache_, "alpha_cache");
  caches_valid_ = want_alpha_cache && (want_rms_cache || !case_.rmsnorm);
  return res;
}

BackwardOutput AbiProblem::Backward(const std::vector<double>& grad_out,
                                    const BackwardOptions& o) {
  BackwardOutput res;
  const int64_t T = case_.tokens, D = case_.dim, N = case_.num_blocks;
  const bool want_caches = o.use_alpha_cache || (o.use_rms_cache && case_.rmsnorm);
  if (want_caches && !caches_valid_) {
    const ForwardOutput f = Forward(case_.rmsnorm, true);
    if (f.status != ATTNRES_OK) {
      res.status = f.status;
      res.error = "forward (for the caches) failed: " + f.error;
      return res;
    }
  }
  attnres_params p = InputParams();
  const int64_t gout_stride = D + case_.grad_out_pad;
  grad_out_ = Buffer(case_.dtype, StridedCount(T, D, gout_stride), kInputPadding);
  FillRows(&grad_out_, grad_out, T, D, gout_stride);
  p.grad_out = grad_out_.data();
  p.grad_out_row_stride = gout_stride;
  if (o.use_rms_cache && case_.rmsnorm) p.rms_cache = rms_cache_.data();
  if (o.use_alpha_cache) p.alpha_cache = alpha_cache_.data();

  const int64_t gsrc_stride = D + case_.grad_source_pad;
  auto skipped = [&](int64_t i) {
    if (i < N && o.grad_blocks_null) return true;
    return i < static_cast<int64_t>(o.skip_source.size()) && o.skip_source[i];
  };
  grad_sources_.assign(L_, Buffer());
  grad_block_ptrs_.assign(N, nullptr);
  for (int64_t i = 0; i < L_; ++i) {
    if (skipped(i)) continue;
    grad_sources_[i] = Buffer(case_.dtype, StridedCount(T, D, gsrc_stride), kOutputSentinel);
    if (i < N) grad_block_ptrs_[i] = grad_sources_[i].data();
  }
  p.grad_blocks = o.grad_blocks_null ? nullptr : grad_block_ptrs_.data();
  if (case_.has_partial && !skipped(L_ - 1)) p.grad_partial = grad_sources_[L_ - 1].data();
  p.grad_source_row_stride = gsrc_stride;
  if (!o.skip_w) {
    grad_w_ = Buffer(case_.dtype, D, kOutputSentinel);
    p.grad_proj_weight = grad_w_.data();
  }
  const bool want_gamma = case_.rmsnorm && !o.skip_gamma;
  if (want_gamma) {
    grad_gamma_ = Buffer(case_.dtype, D, kOutputSentinel);
    p.grad_gamma = grad_gamma_.data();
  }

  std::vector<uint64_t> input_hashes;
  for (const Buffer& s : sources_) input_hashes.push_back(Hash(s));
  const uint64_t rms_hash = Hash(rms_cache_), alpha_hash = Hash(alpha_cache_);
  res.status = attnres_backward(&p);
  if (res.status != ATTNRES_OK) {
    res.error = attnres_last_error();
    return res;
  }
  for (size_t i = 0; i < sources_.size(); ++i) {
    if (Hash(sources_[i]) != input_hashes[i]) {
      res.layout_error += "source " + std::to_string(i) + " was modified; ";
    }
  }
  if (Hash(rms_cache_) != rms_hash) res.layout_error += "rms_cache was modified; ";
  if (Hash(alpha_cache_) != alpha_hash) res.layout_error += "alpha_cache was modified; ";

  res.grad_sources.resize(L_);
  for (int64_t i = 0; i < L_; ++i) {
    if (skipped(i)) continue;
    const std::string name = "grad_source[" + std::to_string(i) + "]";
    res.grad_sources[i] = ReadRows(grad_sources_[i], gsrc_stride, name.c_str(),
                                   &res.layout_error);
  }
  auto read_vec = [&](const Buffer& b, const char* name) {
    std::vector<double> v(D);
    for (int64_t d = 0; d < D; ++d) v[d] = b.Get(d);
    if (!b.GuardIntact(kOutputSentinel)) {
      res.layout_error += std::string(name) + ": written past its end; ";
    }
    return v;
  };
  if (!o.skip_w) res.grad_w = read_vec(grad_w_, "grad_proj_weight");
  if (want_gamma) res.grad_gamma = read_vec(grad_gamma_, "grad_gamma");
  return res;
}

// ---------------------------------------------------------------------------
// Comparison.

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

Tolerance ToleranceFor(attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT32: return {1e-5, 1e-4, 1e-5};
    case ATTNRES_DTYPE_FLOAT64: return {1e-10, 1e-10, 1e-10};
    case ATTNRES_DTYPE_BFLOAT16: return {8e-3, 1e-2, 1e-5};
    case ATTNRES_DTYPE_FLOAT16: return {1e-3, 1e-2, 1e-5};
  }
  return {0, 0, 0};
}

// ---------------------------------------------------------------------------
// ISAs.

std::vector<std::string> AvailableIsas() {
  std::vector<std::string> isas;
  std::istringstream names(attnres_cpu_isas());
  for (std::string name; names >> name;) isas.push_back(name);
  return isas;
}

void ForEachIsa(const std::function<void(const std::string& isa)>& body) {
  static const std::vector<std::string> isas = AvailableIsas();
  if (isas.empty()) {
    ADD_FAILURE() << "attnres_set_cpu_isa accepted none of the ISA names";
    return;
  }
  for (const std::string& isa : isas) {
    ASSERT_EQ(attnres_set_cpu_isa(isa.c_str()), ATTNRES_OK) << isa;
    SCOPED_TRACE("isa=" + isa);
    body(isa);
  }
  attnres_set_cpu_isa(nullptr);
}

bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

}  // namespace attnres_test
