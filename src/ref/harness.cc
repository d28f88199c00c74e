#include "ref/harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "backends.h"
#include "ref/two_phase_reference.h"

namespace attnres::harness {
namespace {

// dtype <-> double for the test side (independent of the kernels' conversions).
// binary16 is the compiler's: _Float16, or __fp16 on aarch64 (g++ 12 has no
// _Float16 in C++ there); both convert from double with one rounding.
#if defined(__aarch64__)
using Float16 = __fp16;
#else
using Float16 = _Float16;
#endif

double ReadElement(const char* p, attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: { double v; std::memcpy(&v, p, 8); return v; }
    case ATTNRES_DTYPE_FLOAT32: { float v; std::memcpy(&v, p, 4); return v; }
    case ATTNRES_DTYPE_BFLOAT16: {
      uint16_t h; std::memcpy(&h, p, 2);
      const uint32_t u = uint32_t{h} << 16;
      float v; std::memcpy(&v, &u, 4);
      return v;
    }
    case ATTNRES_DTYPE_FLOAT16: { Float16 v; std::memcpy(&v, p, 2); return double(v); }
  }
  return 0;
}

void WriteElement(char* p, attnres_dtype dtype, double value) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: std::memcpy(p, &value, 8); return;
    case ATTNRES_DTYPE_FLOAT32: { const float v = float(value); std::memcpy(p, &v, 4); return; }
    case ATTNRES_DTYPE_BFLOAT16: {
      const float f = float(value);
      uint32_t u; std::memcpy(&u, &f, 4);
      const uint16_t h = std::isnan(f) ? uint16_t((u >> 16) | 0x40)
                                       : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      std::memcpy(p, &h, 2);
      return;
    }
    case ATTNRES_DTYPE_FLOAT16: { const Float16 v = Float16(value); std::memcpy(p, &v, 2); return; }
  }
}

double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double max_ref = 0, max_err = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    max_ref = std::max(max_ref, std::fabs(want[k]));
    const double err = std::fabs(got[k] - want[k]);
    max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

}  // namespace

std::string CaseSpec::Describe() const {
  std::ostringstream os;
  os << DtypeName(dtype) << " tokens=" << tokens << " dim=" << dim << " blocks=" << num_blocks
     << (partial ? "+partial" : "") << (rmsnorm ? " rmsnorm" : " no-rmsnorm") << " scale=" << scale
     << " eps=" << eps << " pad=" << row_padding << (backward_caches ? " caches" : " no-caches")
     << " logits~" << logit_magnitude << " seed=" << seed;
  return os.str();
}

double Errors::WorstForward() const { return std::max({out, rms, alpha, lse}); }
double Errors::WorstBackward() const { return std::max({grad_sources, grad_w, grad_gamma}); }

double ForwardTolerance(attnres_dtype dtype) { return ref::SpecTolerance(dtype).out; }
double BackwardTolerance(attnres_dtype dtype) { return ref::SpecTolerance(dtype).grad; }

const char* DtypeName(attnres_dtype dtype) { return attnres::DtypeName(dtype); }

bool ParseDtype(const std::string& name, attnres_dtype* dtype) {
  for (attnres_dtype d : {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64, ATTNRES_DTYPE_BFLOAT16,
                          ATTNRES_DTYPE_FLOAT16}) {
    if (name == DtypeName(d)) { *dtype = d; return true; }
  }
  return false;
}

int64_t ElementBytes(attnres_dtype dtype) { return attnres::ElementBytes(dtype); }

namespace {

// splitmix64: fast enough to fill gigabytes for the benchmarks, and reproducible.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  // Uniform with mean `mean` and standard deviation `sd`.
  double Next(double mean, double sd) {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double unit = double(z >> 11) * 0x1.0p-53;  // [0, 1)
    return mean + sd * std::sqrt(3.0) * (2 * unit - 1);
  }

 private:
  uint64_t state_;
};

// A [rows, stride] buffer of `dtype` whose first `cols` of each row are random
// (the rest zero): stream `stream` of the spec's seed, so every buffer of a case
// draws its own reproducible values.
Bytes RandomRows(const CaseSpec& spec, uint64_t stream, attnres_dtype dtype, int64_t rows,
                 int64_t cols, int64_t stride, double mean, double sd) {
  Random rng(spec.seed * 1000003 + stream);
  const int64_t elem = ElementBytes(dtype);
  Bytes bytes(std::max<int64_t>(1, rows * stride * elem), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      WriteElement(bytes.data() + (r * stride + c) * elem, dtype, rng.Next(mean, sd));
    }
  }
  return bytes;
}

std::vector<double> Unpack(const Bytes& bytes, attnres_dtype dtype, int64_t rows, int64_t cols,
                           int64_t stride) {
  const int64_t elem = ElementBytes(dtype);
  std::vector<double> values(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      values[r * cols + c] = ReadElement(bytes.data() + (r * stride + c) * elem, dtype);
    }
  }
  return values;
}

// The accumulation type of a dtype's caches and lse: float64 for float64, else float32.
attnres_dtype AccumulationType(attnres_dtype dtype) {
  return dtype == ATTNRES_DTYPE_FLOAT64 ? ATTNRES_DTYPE_FLOAT64 : ATTNRES_DTYPE_FLOAT32;
}

// Every vector of `parts` end to end: the error of a list of tensors measured as one
// stacked tensor, as the seed measures its stacked grad_v (a source with tiny alpha
// has a tiny gradient that a 16-bit format cannot resolve on its own scale).
std::vector<double> Concatenate(const std::vector<std::vector<double>>& parts) {
  std::vector<double> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

}  // namespace

Case::Case(const CaseSpec& spec) : spec_(spec), stride_(spec.dim + spec.row_padding) {
  const int64_t T = spec.tokens, D = spec.dim, L = spec.num_sources();
  const attnres_dtype dt = spec.dtype;
  uint64_t stream = 0;
  for (int64_t i = 0; i < L; ++i) sources_.push_back(RandomRows(spec, stream++, dt, T, D, stride_, 0.0, 1.0));
  // |z| ~ logit_magnitude: dot(w, k) with k ~ unit-rms has sd sqrt(D) * sd(w).
  w_ = RandomRows(spec, stream++, dt, 1, D, D, 0.0, spec.logit_magnitude / std::sqrt(double(D)));
  gamma_ = RandomRows(spec, stream++, dt, 1, D, D, 1.0, 0.2);
  grad_out_ = RandomRows(spec, stream++, dt, T, D, stride_, 0.0, 1.0);

  const int64_t elem = ElementBytes(dt), acc = ElementBytes(AccumulationType(dt));
  const int64_t row_bytes = std::max<int64_t>(1, T * stride_ * elem);
  out_.assign(row_bytes, 0);
  for (int64_t i = 0; i < L; ++i) grad_sources_.emplace_back(row_bytes, 0);
  grad_w_.assign(D * elem, 0);
  grad_gamma_.assign(D * elem, 0);
  rms_.assign(std::max<int64_t>(1, T * L * acc), 0);
  alpha_.assign(std::max<int64_t>(1, T * L * acc), 0);
  for (int64_t i = 0; i < spec.num_blocks; ++i) {
    block_ptrs_.push_back(sources_[i].data());
    grad_block_ptrs_.push_back(grad_sources_[i].data());
  }
}

ref::Problem Case::Problem() const {
  const int64_t T = spec_.tokens, D = spec_.dim;
  ref::Problem problem;
  problem.tokens = T;
  problem.dim = D;
  problem.num_blocks = spec_.num_blocks;
  problem.has_partial = spec_.partial;
  problem.rmsnorm = spec_.rmsnorm;
  problem.scale = spec_.scale;
  problem.eps = spec_.eps;
  for (const auto& s : sources_) problem.sources.push_back(Unpack(s, spec_.dtype, T, D, stride_));
  problem.w = Unpack(w_, spec_.dtype, 1, D, D);
  problem.gamma = Unpack(gamma_, spec_.dtype, 1, D, D);
  return problem;
}

attnres_params Case::ForwardParams() {
  attnres_params p;
  attnres_params_init(&p);
  p.num_tokens = spec_.tokens;
  p.dim = spec_.dim;
  p.num_blocks = spec_.num_blocks;
  p.dtype = spec_.dtype;
  p.blocks = block_ptrs_.data();
  p.partial = spec_.partial ? sources_.back().data() : nullptr;
  p.source_row_stride = stride_;
  p.proj_weight = w_.data();
  p.gamma = gamma_.data();
  p.scale = spec_.scale;
  p.eps = spec_.eps;
  p.rmsnorm = spec_.rmsnorm ? 1 : 0;
  p.out = out_.data();
  p.out_row_stride = stride_;
  p.rms_cache = spec_.rmsnorm ? rms_.data() : nullptr;
  p.alpha_cache = alpha_.data();
  return p;
}

attnres_params Case::BackwardParams() {
  attnres_params p = ForwardParams();
  p.out = nullptr;
  if (!spec_.backward_caches) p.rms_cache = p.alpha_cache = nullptr;
  p.grad_out = grad_out_.data();
  p.grad_out_row_stride = stride_;
  p.grad_blocks = grad_block_ptrs_.data();
  p.grad_partial = spec_.partial ? grad_sources_.back().data() : nullptr;
  p.grad_source_row_stride = stride_;
  p.grad_proj_weight = grad_w_.data();
  p.grad_gamma = spec_.rmsnorm ? grad_gamma_.data() : nullptr;
  return p;
}

attnres_status Case::Forward() {
  const attnres_params p = ForwardParams();
  return attnres_forward(&p);
}

attnres_status Case::Backward() {
  const attnres_params p = BackwardParams();
  return attnres_backward(&p);
}

Errors Case::Compare() const {
  const int64_t T = spec_.tokens, D = spec_.dim, L = spec_.num_sources();
  const attnres_dtype dt = spec_.dtype, acc = AccumulationType(dt);
  const ref::Problem problem = Problem();
  const ref::ForwardResult fwd = ref::Forward(problem);
  const ref::BackwardResult bwd = ref::Backward(problem, Unpack(grad_out_, dt, T, D, stride_));
  Errors e;
  e.out = RelativeError(Unpack(out_, dt, T, D, stride_), fwd.out);
  if (spec_.rmsnorm) e.rms = RelativeError(Unpack(rms_, acc, 1, T * L, T * L), fwd.rms);
  e.alpha = RelativeError(Unpack(alpha_, acc, 1, T * L, T * L), fwd.alpha);
  std::vector<std::vector<double>> got_sources;
  for (const auto& g : grad_sources_) got_sources.push_back(Unpack(g, dt, T, D, stride_));
  e.grad_sources = RelativeError(Concatenate(got_sources), Concatenate(bwd.grad_sources));
  e.grad_w = RelativeError(Unpack(grad_w_, dt, 1, D, D), bwd.grad_w);
  if (spec_.rmsnorm) e.grad_gamma = RelativeError(Unpack(grad_gamma_, dt, 1, D, D), bwd.grad_gamma);
  return e;
}

Phase1Case::Phase1Case(const CaseSpec& spec, int64_t queries)
    : spec_(spec), queries_(queries), stride_(spec.dim + spec.row_padding) {
  const int64_t T = spec.tokens, D = spec.dim, N = spec.num_blocks, S = queries;
  const attnres_dtype dt = spec.dtype, acc = AccumulationType(dt);
  uint64_t stream = 0;
  for (int64_t i = 0; i < N; ++i) blocks_.push_back(RandomRows(spec, stream++, dt, T, D, stride_, 0.0, 1.0));
  w_ = RandomRows(spec, stream++, dt, S, D, D, 0.0, spec.logit_magnitude / std::sqrt(double(D)));
  gamma_ = RandomRows(spec, stream++, dt, S, D, D, 1.0, 0.2);
  const int64_t row_bytes = std::max<int64_t>(1, T * stride_ * ElementBytes(dt));
  const int64_t lse_bytes = std::max<int64_t>(1, T * ElementBytes(acc));
  for (int64_t s = 0; s < S; ++s) {
    grad_outs_.push_back(RandomRows(spec, stream++, dt, T, D, stride_, 0.0, 1.0));
    grad_lses_.push_back(RandomRows(spec, stream++, acc, 1, T, T, 0.0, 1.0));
    outs_.emplace_back(row_bytes, 0);
    lses_.emplace_back(lse_bytes, 0);
  }
  for (int64_t i = 0; i < N; ++i) grad_blocks_.emplace_back(row_bytes, 0);
  grad_w_.assign(S * D * ElementBytes(dt), 0);
  grad_gamma_.assign(S * D * ElementBytes(dt), 0);
  for (int64_t i = 0; i < N; ++i) {
    block_ptrs_.push_back(blocks_[i].data());
    grad_block_ptrs_.push_back(grad_blocks_[i].data());
  }
  for (int64_t s = 0; s < S; ++s) {
    out_ptrs_.push_back(outs_[s].data());
    lse_ptrs_.push_back(lses_[s].data());
    grad_out_ptrs_.push_back(grad_outs_[s].data());
    grad_lse_ptrs_.push_back(grad_lses_[s].data());
  }
}

attnres_params Phase1Case::ForwardParams() {
  attnres_params p;
  attnres_params_init(&p);
  p.num_tokens = spec_.tokens;
  p.dim = spec_.dim;
  p.num_blocks = spec_.num_blocks;
  p.dtype = spec_.dtype;
  p.blocks = block_ptrs_.data();
  p.source_row_stride = stride_;
  p.proj_weight = w_.data();
  p.gamma = gamma_.data();
  p.scale = spec_.scale;
  p.eps = spec_.eps;
  p.rmsnorm = spec_.rmsnorm ? 1 : 0;
  p.num_queries = queries_;
  p.query_outs = out_ptrs_.data();
  p.query_lses = lse_ptrs_.data();
  p.out_row_stride = stride_;
  return p;
}

attnres_params Phase1Case::BackwardParams() {
  attnres_params p = ForwardParams();
  p.query_outs = p.query_lses = nullptr;
  p.grad_query_outs = grad_out_ptrs_.data();
  p.grad_query_lses = grad_lse_ptrs_.data();
  p.grad_out_row_stride = stride_;
  p.grad_blocks = grad_block_ptrs_.data();
  p.grad_source_row_stride = stride_;
  p.grad_proj_weight = grad_w_.data();
  p.grad_gamma = spec_.rmsnorm ? grad_gamma_.data() : nullptr;
  return p;
}

attnres_status Phase1Case::Forward() {
  const attnres_params p = ForwardParams();
  return attnres_phase1_forward(&p);
}

attnres_status Phase1Case::Backward() {
  const attnres_params p = BackwardParams();
  return attnres_phase1_backward(&p);
}

Errors Phase1Case::Compare() const {
  const int64_t T = spec_.tokens, D = spec_.dim, S = queries_;
  const attnres_dtype dt = spec_.dtype, acc = AccumulationType(dt);
  ref::Phase1Problem problem;
  problem.tokens = T;
  problem.dim = D;
  problem.num_queries = S;
  problem.rmsnorm = spec_.rmsnorm;
  problem.scale = spec_.scale;
  problem.eps = spec_.eps;
  for (const auto& b : blocks_) problem.blocks.push_back(Unpack(b, dt, T, D, stride_));
  problem.w = Unpack(w_, dt, S, D, D);
  problem.gamma = Unpack(gamma_, dt, S, D, D);
  std::vector<std::vector<double>> grad_outs, grad_lses, outs, lses, grad_blocks;
  for (int64_t s = 0; s < S; ++s) {
    grad_outs.push_back(Unpack(grad_outs_[s], dt, T, D, stride_));
    grad_lses.push_back(Unpack(grad_lses_[s], acc, 1, T, T));
    outs.push_back(Unpack(outs_[s], dt, T, D, stride_));
    lses.push_back(Unpack(lses_[s], acc, 1, T, T));
  }
  for (const auto& g : grad_blocks_) grad_blocks.push_back(Unpack(g, dt, T, D, stride_));
  const ref::Phase1ForwardResult fwd = ref::Phase1Forward(problem);
  const ref::Phase1BackwardResult bwd = ref::Phase1Backward(problem, grad_outs, grad_lses);
  Errors e;
  e.out = RelativeError(Concatenate(outs), Concatenate(fwd.outs));
  e.lse = RelativeError(Concatenate(lses), Concatenate(fwd.lses));
  e.grad_sources = RelativeError(Concatenate(grad_blocks), Concatenate(bwd.grad_blocks));
  e.grad_w = RelativeError(Unpack(grad_w_, dt, S, D, D), bwd.grad_w);
  if (spec_.rmsnorm) e.grad_gamma = RelativeError(Unpack(grad_gamma_, dt, S, D, D), bwd.grad_gamma);
  return e;
}

}  // namespace attnres::harness
