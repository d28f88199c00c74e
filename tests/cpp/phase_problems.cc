#include "phase_problems.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>

namespace attnres_test {

Vec Rng::Normal(size_t n, double mean, double sd, attnres_dtype dtype) {
  std::normal_distribution<double> dist(mean, sd);
  Vec v(n);
  for (double& x : v) x = RoundToDType(dist(gen_), dtype);
  return v;
}

double Rng::Uniform(double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(gen_);
}

Vec Add(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

Rows::Rows(attnres_dtype dtype, int64_t rows, int64_t dim, int64_t stride, uint8_t fill,
           attnres_device device, size_t offset)
    : rows_(rows), dim_(dim), stride_(stride), buf_(dtype, StridedCount(rows, dim, stride), fill) {
  if (device == ATTNRES_DEVICE_CUDA) buf_.AddDeviceTwin(offset * DTypeSize(dtype));
}

void Rows::Write(const Vec& v) {
  for (int64_t t = 0; t < rows_; ++t) {
    for (int64_t d = 0; d < dim_; ++d) buf_.Set(t * stride_ + d, v[t * dim_ + d]);
  }
}

Vec Rows::Read() const {
  Vec v(rows_ * dim_);
  for (int64_t t = 0; t < rows_; ++t) {
    for (int64_t d = 0; d < dim_; ++d) v[t * dim_ + d] = buf_.Get(t * stride_ + d);
  }
  return v;
}

bool Rows::OutsideIs(uint8_t pattern) const {
  if (buf_.total_bytes() == 0) return true;
  for (int64_t t = 0; t + 1 < rows_; ++t) {
    if (!buf_.BytesAre(t * stride_ + dim_, stride_ - dim_, pattern)) return false;
  }
  return buf_.GuardIntact(pattern);
}

bool Rows::AllAre(uint8_t pattern) const {
  return buf_.total_bytes() == 0 ||
         (buf_.BytesAre(0, buf_.count(), pattern) && buf_.GuardIntact(pattern));
}

namespace {

bool Contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::vector<unsigned char> Bytes(const Buffer& b) {
  return std::vector<unsigned char>(b.bytes(), b.bytes() + b.total_bytes());
}

// A dense [n] tensor (one row).
Rows Dense(attnres_dtype dtype, int64_t n, uint8_t fill, attnres_device device, size_t offset) {
  return Rows(dtype, 1, n, n, fill, device, offset);
}
Rows DenseInput(attnres_dtype dtype, const Vec& v, attnres_device device, size_t offset) {
  Rows r = Dense(dtype, static_cast<int64_t>(v.size()), kInputPadding, device, offset);
  r.Write(v);
  return r;
}

using AbiCall = attnres_status (*)(const attnres_params*);

// Uploads every buffer (the host copies hold the inputs and the outputs' sentinels
// or initial values), makes the call, and downloads every buffer; an input whose
// bytes changed is reported in *layout.
template <typename InputBytes>
attnres_status RunCall(AbiCall call, const attnres_params& p, attnres_device device,
                       const std::vector<Buffer*>& all, const InputBytes& input_bytes,
                       std::string* error, std::string* layout) {
  const auto before = input_bytes();
  for (Buffer* b : all) b->Upload();
  Synchronize(device);
  const attnres_status status = call(&p);
  *error = status == ATTNRES_OK ? "" : attnres_last_error();
  Synchronize(device);
  for (Buffer* b : all) b->Download();
  if (input_bytes() != before) *layout += "an input was modified; ";
  return status;
}

}  // namespace

// ---------------------------------------------------------------------------
// Phase 1.

std::string Phase1Case::Describe() const {
  std::ostringstream s;
  s << DTypeName(dtype) << " tokens=" << tokens << " dim=" << dim << " N=" << blocks
    << " S=" << queries << " rmsnorm=" << rmsnorm << " gamma=" << gamma << " scale=" << scale
    << " eps=" << eps << " pads=" << source_pad << "/" << out_pad << "/" << grad_out_pad << "/"
    << grad_source_pad << " offset=" << offset << " seed=" << seed;
  return s.str();
}

Phase1Abi::Phase1Abi(const Phase1Case& c, attnres_device device) : c_(c), device_(device) {
  MakeValues(c);
  MakeBuffers(c);
}

void Phase1Abi::MakeValues(const Phase1Case& c) {
  Rng rng(c.seed);
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim, N = c.blocks, S = c.queries;
  ref.tokens = T;
  ref.dim = D;
  ref.num_queries = S;
  ref.rmsnorm = c.rmsnorm;
  ref.scale = c.scale;
  ref.eps = c.eps;
  for (int64_t i = 0; i < N; ++i) ref.blocks.push_back(rng.Normal(T * D, 0, rng.Uniform(0.5, 2), dt));
  ref.w = rng.Normal(S * D, 0, 1 / std::sqrt(double(D)), dt);
  // The reference ignores gamma without rmsnorm (SPEC §1: keys are the raw sources).
  ref.gamma = c.gamma ? rng.Normal(S * D, 1, 0.2, dt) : Vec();
  for (int64_t s = 0; s < S; ++s) {
    grad_outs.push_back(Contains(c.null_grad_outs, s) ? Vec() : rng.Normal(T * D, 0, 1, dt));
    grad_lses.push_back(c.grad_lses_array_null || Contains(c.null_grad_lses, s)
                            ? Vec() : rng.Normal(T, 0, 1, acc));
  }
}

void Phase1Abi::MakeBuffers(const Phase1Case& c) {
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim, N = c.blocks, S = c.queries;
  const attnres_device dev = device_;
  const size_t off = c.offset;
  for (int64_t i = 0; i < N; ++i) {
    blocks_.emplace_back(dt, T, D, D + c.source_pad, kInputPadding, dev, off);
    blocks_.back().Write(ref.blocks[i]);
    gblocks_.emplace_back(dt, T, D, D + c.grad_source_pad, kOutputSentinel, dev, off);
  }
  w_ = DenseInput(dt, ref.w, dev, off);
  if (c.gamma) gamma_ = DenseInput(dt, ref.gamma, dev, off);
  for (int64_t s = 0; s < S; ++s) {
    outs_.emplace_back(dt, T, D, D + c.out_pad, kOutputSentinel, dev, off);
    lses_.push_back(Dense(acc, T, kOutputSentinel, dev, off));
    gouts_.emplace_back();
    if (!grad_outs[s].empty()) {
      gouts_.back() = Rows(dt, T, D, D + c.grad_out_pad, kInputPadding, dev, off);
      gouts_.back().Write(grad_outs[s]);
    }
    glses_.push_back(grad_lses[s].empty() ? Rows() : DenseInput(acc, grad_lses[s], dev, off));
  }
  gw_ = Dense(dt, S * D, kOutputSentinel, dev, off);
  ggamma_ = Dense(dt, S * D, kOutputSentinel, dev, off);
  for (auto& b : blocks_) block_ptrs_.push_back(b.data());
  for (auto& g : gblocks_) gblock_ptrs_.push_back(g.data());
  for (int64_t s = 0; s < S; ++s) {
    out_ptrs_.push_back(outs_[s].data());
    lse_ptrs_.push_back(lses_[s].data());
    gout_ptrs_.push_back(grad_outs[s].empty() ? nullptr : gouts_[s].data());
    glse_ptrs_.push_back(grad_lses[s].empty() ? nullptr : glses_[s].data());
  }
}

attnres_params Phase1Abi::Inputs() const {
  attnres_params p = CommonParams(device_, c_.dtype, c_.tokens, c_.dim, c_.dim + c_.source_pad,
                                  c_.scale, c_.eps, c_.rmsnorm);
  p.num_blocks = c_.blocks;
  p.blocks = block_ptrs_.data();
  p.proj_weight = w_.data();
  p.gamma = c_.gamma ? gamma_.data() : nullptr;
  p.num_queries = c_.queries;
  return p;
}

std::vector<Buffer*> Phase1Abi::All() {
  std::vector<Buffer*> all;
  for (auto* list : {&blocks_, &gblocks_, &outs_, &lses_, &gouts_, &glses_}) {
    for (Rows& r : *list) all.push_back(&r.buffer());
  }
  for (Rows* r : {&w_, &gamma_, &gw_, &ggamma_}) all.push_back(&r->buffer());
  return all;
}

std::vector<std::vector<unsigned char>> Phase1Abi::InputBytes() const {
  std::vector<std::vector<unsigned char>> all;
  for (auto* list : {&blocks_, &gouts_, &glses_}) {
    for (const Rows& r : *list) all.push_back(Bytes(r.buffer()));
  }
  all.push_back(Bytes(w_.buffer()));
  all.push_back(Bytes(gamma_.buffer()));
  return all;
}

attnres_status Phase1Abi::Call(AbiCall call, const attnres_params& p, std::string* error,
                               std::string* layout) {
  return RunCall(call, p, device_, All(), [&] { return InputBytes(); }, error, layout);
}

Phase1Abi::Forward Phase1Abi::RunForward() {
  for (auto& o : outs_) o.Fill(kOutputSentinel);
  for (auto& l : lses_) l.Fill(kOutputSentinel);
  attnres_params p = Inputs();
  p.query_outs = out_ptrs_.data();
  p.out_row_stride = c_.dim + c_.out_pad;
  p.query_lses = lse_ptrs_.data();
  Forward f;
  f.status = Call(attnres_phase1_forward, p, &f.error, &f.layout);
  for (int64_t s = 0; s < c_.queries; ++s) {
    f.outs.push_back(outs_[s].Read());
    f.lses.push_back(lses_[s].Read());
    if (!outs_[s].OutsideIs(kOutputSentinel)) f.layout += "query_outs[" + std::to_string(s) + "] padding/guard written; ";
    if (!lses_[s].OutsideIs(kOutputSentinel)) f.layout += "query_lses[" + std::to_string(s) + "] guard written; ";
  }
  return f;
}

Phase1Abi::Backward Phase1Abi::RunBackward(const Phase1Grads& g) {
  std::vector<int> skipped_blocks = g.null_blocks;
  if (g.grad_blocks_null) {
    for (int i = 0; i < static_cast<int>(gblocks_.size()); ++i) skipped_blocks.push_back(i);
  }
  std::vector<void*> gptrs = gblock_ptrs_;
  for (size_t i = 0; i < gblocks_.size(); ++i) {
    gblocks_[i].Fill(kOutputSentinel);
    if (!g.initial.empty() && !Contains(g.null_blocks, static_cast<int>(i))) gblocks_[i].Write(g.initial[i]);
  }
  for (int i : skipped_blocks) gptrs[i] = nullptr;
  gw_.Fill(kOutputSentinel);
  ggamma_.Fill(kOutputSentinel);
  attnres_params p = Inputs();
  p.grad_query_outs = gout_ptrs_.data();
  p.grad_out_row_stride = c_.dim + c_.grad_out_pad;
  p.grad_query_lses = c_.grad_lses_array_null ? nullptr : glse_ptrs_.data();
  p.grad_blocks = g.grad_blocks_null ? nullptr : gptrs.data();
  p.grad_source_row_stride = c_.dim + c_.grad_source_pad;
  p.grad_proj_weight = g.skip_w ? nullptr : gw_.data();
  p.grad_gamma = g.skip_gamma || !c_.rmsnorm ? nullptr : ggamma_.data();
  p.accumulate_grads = g.accumulate ? 1 : 0;
  Backward b;
  b.status = Call(attnres_phase1_backward, p, &b.error, &b.layout);
  for (size_t i = 0; i < gblocks_.size(); ++i) {
    const bool skipped = Contains(skipped_blocks, static_cast<int>(i));
    b.grad_blocks.push_back(skipped ? Vec() : gblocks_[i].Read());
    if (skipped && !gblocks_[i].AllAre(kOutputSentinel)) {
      b.layout += "grad_blocks[" + std::to_string(i) + "] was NULL but its buffer was written; ";
    }
    if (!gblocks_[i].OutsideIs(kOutputSentinel)) b.layout += "grad_blocks[" + std::to_string(i) + "] padding/guard written; ";
  }
  if (!g.skip_w) b.grad_w = gw_.Read();
  if (!g.skip_gamma && c_.rmsnorm) b.grad_gamma = ggamma_.Read();
  if (!gw_.OutsideIs(kOutputSentinel) || !ggamma_.OutsideIs(kOutputSentinel)) b.layout += "dw/dgamma guard written; ";
  if (g.skip_w && !gw_.AllAre(kOutputSentinel)) b.layout += "grad_proj_weight written; ";
  if ((g.skip_gamma || !c_.rmsnorm) && !ggamma_.AllAre(kOutputSentinel)) b.layout += "grad_gamma written; ";
  return b;
}

// ---------------------------------------------------------------------------
// Phase 2.

std::string Phase2Case::Describe() const {
  std::ostringstream s;
  s << DTypeName(dtype) << " tokens=" << tokens << " dim=" << dim << " merge_gap=" << merge_gap
    << " partial_size=" << partial_size << " partial=" << partial << " rmsnorm=" << rmsnorm
    << " gamma=" << gamma << " input_norm=" << input_norm << " norm_weight=" << norm_weight
    << " update=" << update << " grad_partial_in=" << grad_partial_in << " lse=" << lse
    << " sparse=" << sparse << " scale=" << scale << " eps=" << eps << " norm_eps=" << norm_eps
    << " pads=" << source_pad << "/" << out_pad << "/" << grad_out_pad << "/" << grad_source_pad
    << " offset=" << offset << " seed=" << seed;
  return s.str();
}

Phase2Abi::Phase2Abi(const Phase2Case& c, attnres_device device) : c_(c), device_(device) {
  Vec update;
  const Vec previous = MakeValues(c, &update);
  if (c.merge_gap != 0 && c.partial) MakeSharp(c);
  MakeBuffers(c, previous, update);
}

// Returns the partial block before the update (ref.partial is p' with it).
Vec Phase2Abi::MakeValues(const Phase2Case& c, Vec* update) {
  Rng rng(c.seed);
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim;
  ref.tokens = T;
  ref.dim = D;
  ref.has_partial = c.partial;
  ref.rmsnorm = c.rmsnorm;
  ref.input_norm = c.input_norm;
  ref.scale = c.scale;
  ref.eps = c.eps;
  ref.norm_eps = c.norm_eps;
  ref.out = rng.Normal(T * D, 0, 1, dt);
  ref.lse = rng.Normal(T, 0.5, 1, acc);
  ref.partial = c.partial ? rng.Normal(T * D, 0, 1.2 * c.partial_size, dt) : Vec();
  ref.w = rng.Normal(D, 0, 1 / std::sqrt(double(D)), dt);
  ref.gamma = c.gamma ? rng.Normal(D, 1, 0.2, dt) : Vec();
  ref.norm_weight = c.norm_weight ? rng.Normal(D, 1, 0.2, dt) : Vec();
  grad = rng.Normal(T * D, 0, 1, dt);
  const Vec previous = ref.partial;
  if (c.update) {
    // p' = partial + y as the kernels form it: one addition in the accumulation type
    // (exact here in double, then rounded to float), rounded to the dtype; the
    // reference then merges p'.
    *update = rng.Normal(T * D, 0, 0.8 * c.partial_size, dt);
    for (int64_t k = 0; k < T * D; ++k) {
      const double sum = previous[k] + (*update)[k];
      ref.partial[k] = RoundToDType(dt == ATTNRES_DTYPE_FLOAT64 ? sum : double(float(sum)), dt);
    }
    new_partial = ref.partial;
  }
  if (c.grad_partial_in) grad_partial_in = rng.Normal(T * D, 0, 1, dt);
  return previous;
}

// lse = z_p + merge_gap for the partial block that is merged.
void Phase2Abi::MakeSharp(const Phase2Case& c) {
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim;
  // Without RMSNorm, w / partial_size keeps z_p of order one (a logit of 1000 has
  // an fp32 ulp of 6e-5: that would measure large logits, not sharp ones).
  if (!c.rmsnorm) for (double& x : ref.w) x = RoundToDType(x / c.partial_size, dt);
  for (int64_t t = 0; t < T; ++t) {
    double dot = 0, sum_sq = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double x = ref.partial[t * D + d];
      dot += ref.w[d] * (c.rmsnorm && c.gamma ? ref.gamma[d] : 1.0) * x;
      sum_sq += x * x;
    }
    const double z_p = c.scale * dot / (c.rmsnorm ? std::sqrt(sum_sq / D + c.eps) : 1.0);
    ref.lse[t] = RoundToDType(z_p + c.merge_gap, acc);
  }
}

void Phase2Abi::MakeBuffers(const Phase2Case& c, const Vec& previous, const Vec& update) {
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim, ss = D + c.source_pad;
  const attnres_device dev = device_;
  const size_t off = c.offset;
  const auto input = [&](const Vec& v, int64_t stride) {
    Rows r(dt, T, D, stride, kInputPadding, dev, off);
    r.Write(v);
    return r;
  };
  const auto output = [&](int64_t stride) { return Rows(dt, T, D, stride, kOutputSentinel, dev, off); };
  qo_ = input(ref.out, ss);
  if (c.partial) part_ = input(previous, ss);
  if (c.update) {
    upd_ = input(update, ss);
    updated_ = input(new_partial, ss);  // p', the backward's partial
    np_ = output(D + c.out_pad);
  }
  if (c.grad_partial_in) gin_ = input(grad_partial_in, D + c.grad_out_pad);
  lse_ = DenseInput(acc, ref.lse, dev, off);
  w_ = DenseInput(dt, ref.w, dev, off);
  if (c.gamma) gamma_ = DenseInput(dt, ref.gamma, dev, off);
  if (c.norm_weight) nw_ = DenseInput(dt, ref.norm_weight, dev, off);
  out_ = output(D + c.out_pad);
  gout_ = input(grad, D + c.grad_out_pad);
  gq_ = output(D + c.grad_source_pad);
  gp_ = output(D + c.grad_source_pad);
  glse_ = Dense(acc, T, kOutputSentinel, dev, off);
  gw_ = Dense(dt, D, kOutputSentinel, dev, off);
  gg_ = Dense(dt, D, kOutputSentinel, dev, off);
  gnw_ = Dense(dt, D, kOutputSentinel, dev, off);
}

attnres_params Phase2Abi::Inputs() const {
  attnres_params p = CommonParams(device_, c_.dtype, c_.tokens, c_.dim, c_.dim + c_.source_pad,
                                  c_.scale, c_.eps, c_.rmsnorm);
  p.num_blocks = 0;
  p.query_out = qo_.data();
  p.query_lse = c_.lse ? lse_.data() : nullptr;
  p.partial = c_.partial ? part_.data() : nullptr;
  p.proj_weight = w_.data();
  p.gamma = c_.gamma ? gamma_.data() : nullptr;
  p.input_norm = c_.input_norm ? 1 : 0;
  p.norm_eps = c_.norm_eps;
  p.norm_weight = c_.norm_weight ? nw_.data() : nullptr;
  return p;
}

std::vector<Buffer*> Phase2Abi::All() {
  std::vector<Buffer*> all;
  for (Rows* r : {&qo_, &part_, &out_, &gout_, &gq_, &gp_, &upd_, &updated_, &gin_, &np_, &lse_,
                  &w_, &gamma_, &nw_, &glse_, &gw_, &gg_, &gnw_}) {
    all.push_back(&r->buffer());
  }
  return all;
}

std::vector<std::vector<unsigned char>> Phase2Abi::InputBytes() const {
  std::vector<std::vector<unsigned char>> all;
  for (const Rows* r : {&qo_, &part_, &lse_, &w_, &gamma_, &nw_, &gout_, &upd_, &updated_, &gin_}) {
    all.push_back(Bytes(r->buffer()));
  }
  return all;
}

attnres_status Phase2Abi::Call(AbiCall call, const attnres_params& p, std::string* error,
                               std::string* layout) {
  return RunCall(call, p, device_, All(), [&] { return InputBytes(); }, error, layout);
}

Phase2Abi::Forward Phase2Abi::RunForward(bool fused) {
  out_.Fill(kOutputSentinel);
  np_.Fill(kOutputSentinel);
  attnres_params p = Inputs();
  p.out = out_.data();
  p.out_row_stride = c_.dim + c_.out_pad;
  if (c_.update && fused) {
    p.partial_update = upd_.data();
    p.new_partial = np_.data();
  } else if (c_.update) {
    p.partial = updated_.data();
  }
  Forward f;
  f.status = Call(attnres_phase2_forward, p, &f.error, &f.layout);
  f.out = out_.Read();
  if (!out_.OutsideIs(kOutputSentinel)) f.layout += "out padding/guard written; ";
  if (c_.update && fused) {
    f.new_partial = np_.Read();
    if (!np_.OutsideIs(kOutputSentinel)) f.layout += "new_partial padding/guard written; ";
  } else if (!np_.AllAre(kOutputSentinel)) {
    f.layout += "new_partial written without partial_update; ";
  }
  return f;
}

Phase2Abi::Backward Phase2Abi::RunBackward() {
  for (Rows* r : {&gq_, &gp_, &glse_, &gw_, &gg_, &gnw_}) r->Fill(kOutputSentinel);
  const bool sparse = c_.sparse;
  attnres_params p = Inputs();
  p.grad_out = gout_.data();
  p.grad_out_row_stride = c_.dim + c_.grad_out_pad;
  p.grad_query_out = sparse ? nullptr : gq_.data();
  p.grad_query_lse = sparse ? nullptr : glse_.data();
  p.grad_partial = c_.partial && !sparse ? gp_.data() : nullptr;
  p.grad_source_row_stride = c_.dim + c_.grad_source_pad;
  p.grad_proj_weight = sparse ? nullptr : gw_.data();
  p.grad_gamma = c_.rmsnorm ? gg_.data() : nullptr;
  p.grad_norm_weight = c_.input_norm ? gnw_.data() : nullptr;
  if (c_.update) p.partial = updated_.data();
  if (c_.grad_partial_in) p.grad_partial_in = gin_.data();
  Backward b;
  b.status = Call(attnres_phase2_backward, p, &b.error, &b.layout);
  ReadBackward(p, &b);
  return b;
}

void Phase2Abi::ReadBackward(const attnres_params& p, Backward* b) {
  const std::pair<Rows*, const void*> outputs[] = {
      {&gq_, p.grad_query_out}, {&glse_, p.grad_query_lse}, {&gp_, p.grad_partial},
      {&gw_, p.grad_proj_weight}, {&gg_, p.grad_gamma}, {&gnw_, p.grad_norm_weight}};
  Vec* const results[] = {&b->grad_out, &b->grad_lse, &b->grad_partial,
                          &b->grad_w, &b->grad_gamma, &b->grad_norm_weight};
  for (size_t k = 0; k < 6; ++k) {
    Rows& r = *outputs[k].first;
    if (outputs[k].second == nullptr) {
      if (!r.AllAre(kOutputSentinel)) b->layout += "a NULL gradient's buffer was written; ";
      continue;
    }
    *results[k] = r.Read();
    if (!r.OutsideIs(kOutputSentinel)) b->layout += "a gradient's padding or guard was written; ";
  }
}

// ---------------------------------------------------------------------------
// Checks on every backend.

namespace {

// Runs `body` on every backend: the CPU ISAs with `cpu`, CUDA with the same case
// built with device twins.
template <typename Abi, typename CaseT, typename Body>
void OnEveryBackend(Abi& cpu, const CaseT& c, const Body& body) {
  std::unique_ptr<Abi> cuda;
  ForEachBackend([&](const Backend& backend) {
    if (backend.device != ATTNRES_DEVICE_CUDA) return body(cpu, false);
    if (!cuda) cuda = std::make_unique<Abi>(c, backend.device);
    body(*cuda, true);
  });
}

bool BitwiseEqual(const Vecs& a, const Vecs& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (!attnres_test::BitwiseEqual(a[k], b[k])) return false;
  }
  return true;
}

// On CUDA: a second run, and grids of 1 and 3 CTAs (every CTA takes many items),
// give the bits of the first.
template <typename Run>
void ExpectSameBitsOnCuda(const Run& run) {
  const Vecs first = run();
  EXPECT_TRUE(BitwiseEqual(run(), first)) << "a second run changed some output's bits";
  for (const char* cap : {"1", "3"}) {
    ScopedEnv env("ATTNRES_CUDA_MAX_CTAS", cap);
    EXPECT_TRUE(BitwiseEqual(run(), first))
        << "ATTNRES_CUDA_MAX_CTAS=" << cap << " changed some output's bits";
  }
}

Vecs Concat(Vecs a, const Vecs& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void ExpectPhase1Backward(const Phase1Case& c, const Phase1Abi::Backward& b,
                          const attnres::ref::Phase1BackwardResult& ref, const Phase1Grads& g,
                          const char* what) {
  const Tolerance tol = ToleranceFor(c.dtype);
  ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
  EXPECT_EQ(b.layout, "");
  for (int64_t i = 0; i < c.blocks; ++i) {
    if (b.grad_blocks[i].empty()) continue;
    const Vec expected = g.accumulate && !g.initial.empty() ? Add(g.initial[i], ref.grad_blocks[i])
                                                             : ref.grad_blocks[i];
    EXPECT_TRUE(Close(std::string(what) + " dv_" + std::to_string(i), b.grad_blocks[i], expected, tol.grad));
  }
  if (!g.skip_w) EXPECT_TRUE(Close(std::string(what) + " dw", b.grad_w, ref.grad_w, tol.grad));
  if (c.rmsnorm && !g.skip_gamma) {
    EXPECT_TRUE(Close(std::string(what) + " dgamma", b.grad_gamma, ref.grad_gamma, tol.grad));
  }
}

}  // namespace

void CheckPhase1(const Phase1Case& c, const Phase1Grads& g) {
  SCOPED_TRACE(c.Describe());
  Phase1Abi cpu(c);
  const auto ref_f = attnres::ref::Phase1Forward(cpu.ref);
  const auto ref_b = attnres::ref::Phase1Backward(cpu.ref, cpu.grad_outs, cpu.grad_lses);
  const Tolerance tol = ToleranceFor(c.dtype);
  OnEveryBackend(cpu, c, [&](Phase1Abi& abi, bool cuda) {
    const auto f = abi.RunForward();
    ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
    EXPECT_EQ(f.layout, "");
    for (int64_t s = 0; s < c.queries; ++s) {
      EXPECT_TRUE(Close("o_" + std::to_string(s), f.outs[s], ref_f.outs[s], tol.out));
      EXPECT_TRUE(Close("lse_" + std::to_string(s), f.lses[s], ref_f.lses[s], tol.cache));
    }
    ExpectPhase1Backward(c, abi.RunBackward(g), ref_b, g, "");
    // NULL gradient pointers skip exactly those gradients; the others are unchanged.
    if (c.blocks >= 2) {
      Phase1Grads some;
      some.null_blocks = {0};
      some.skip_w = true;
      ExpectPhase1Backward(c, abi.RunBackward(some), ref_b, some, "(dv_0, dw skipped)");
    }
    Phase1Grads weights;  // grad_blocks NULL: only the weight gradients
    weights.grad_blocks_null = true;
    ExpectPhase1Backward(c, abi.RunBackward(weights), ref_b, weights, "(grad_blocks NULL)");
    if (!cuda) return;
    ExpectSameBitsOnCuda([&] {
      const auto b = abi.RunBackward(g);
      return Concat(Concat(abi.RunForward().outs, b.grad_blocks), {b.grad_w, b.grad_gamma});
    });
  });
}

void CheckPhase2(const Phase2Case& c) {
  SCOPED_TRACE(c.Describe());
  Phase2Abi cpu(c);
  const Vec ref_out = attnres::ref::Phase2Forward(cpu.ref);
  const auto ref_b = attnres::ref::Phase2Backward(cpu.ref, cpu.grad);
  const Vec dp = c.grad_partial_in ? Add(ref_b.grad_partial, cpu.grad_partial_in) : ref_b.grad_partial;
  const Tolerance tol = ToleranceFor(c.dtype);
  OnEveryBackend(cpu, c, [&](Phase2Abi& abi, bool cuda) {
    const auto f = abi.RunForward();
    ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
    EXPECT_EQ(f.layout, "");
    EXPECT_TRUE(Close("out", f.out, ref_out, tol.out));
    if (c.update) {
      EXPECT_TRUE(Close("new_partial (bitwise)", f.new_partial, abi.new_partial, 0));
      // The merge takes the rounded p': the plain forward's out given p'.
      const auto plain = abi.RunForward(/*fused=*/false);
      ASSERT_EQ(plain.status, ATTNRES_OK) << plain.error;
      EXPECT_TRUE(BitwiseEqual(f.out, plain.out)) << "the fused forward's out differs from the plain forward's of p'";
    }
    const auto b = abi.RunBackward();
    ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
    EXPECT_EQ(b.layout, "");
    if (!c.sparse) {
      EXPECT_TRUE(Close("do", b.grad_out, ref_b.grad_out, tol.grad));
      EXPECT_TRUE(Close("dlse", b.grad_lse, ref_b.grad_lse, tol.grad));
      if (c.partial) EXPECT_TRUE(Close("dp", b.grad_partial, dp, tol.grad));
      EXPECT_TRUE(Close("dw", b.grad_w, ref_b.grad_w, tol.grad));
    }
    if (c.rmsnorm) EXPECT_TRUE(Close("dgamma", b.grad_gamma, ref_b.grad_gamma, tol.grad));
    if (c.input_norm) EXPECT_TRUE(Close("dnorm_weight", b.grad_norm_weight, ref_b.grad_norm_weight, tol.grad));
    if (!cuda) return;
    ExpectSameBitsOnCuda([&] {
      const auto fwd = abi.RunForward();
      const auto bwd = abi.RunBackward();
      return Vecs{fwd.out, fwd.new_partial, bwd.grad_out, bwd.grad_lse, bwd.grad_partial,
                  bwd.grad_w, bwd.grad_gamma, bwd.grad_norm_weight};
    });
  });
}

}  // namespace attnres_test
