// The two-phase ops on CUDA (src/cuda/two_phase.cu) against the CPU backend on the
// same inputs: every dtype, S in {1, 6} (and 40: query pointer tables in device
// memory), N in {1, 9} (and 130: block pointer tables in device memory, phase 1's
// statistics in global memory), odd dims, padded rows, misaligned buffers, the
// partial block and the input norm on and off, NULL gradient pointers and
// accumulate_grads, phase 2's fused partial-block update (new_partial bit for bit
// the rounded sum, out bit for bit the plain merge of it; grad_partial_in).
// Every output's padding and guard must be untouched, and
// every result, the weight gradients included, bitwise identical across runs and
// with the grid capped at 1 or 3 CTAs (ATTNRES_CUDA_MAX_CTAS).
//
// Without a device (or in a build without ATTNRES_WITH_CUDA) the GPU cases skip,
// with the reason. scripts/gpu_check.sh runs them with --gtest_filter='CudaTwoPhase*'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "test_util.h"

#ifdef ATTNRES_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace attnres_test {
namespace {

using Vec = std::vector<double>;
using Vecs = std::vector<Vec>;

// Runs everywhere: without a device, device = CUDA is refused with a status and a
// message, and nothing is written.
TEST(CudaTwoPhase, UnavailableDeviceIsReported) {
  if (attnres_cuda_available()) GTEST_SKIP() << "a CUDA device is present";
  const float block[4] = {1, 2, 3, 4}, w[4] = {0, 0, 0, 0};
  float out[4] = {7, 7, 7, 7}, lse[1] = {7};
  const void* blocks[1] = {block};
  void* outs[1] = {out};
  void* lses[1] = {lse};
  attnres_params p;
  attnres_params_init(&p);
  p.device = ATTNRES_DEVICE_CUDA;
  p.num_tokens = 1;
  p.dim = 4;
  p.num_blocks = 1;
  p.blocks = blocks;
  p.source_row_stride = 4;
  p.proj_weight = w;
  p.query_outs = outs;
  p.query_lses = lses;
  p.out_row_stride = 4;
  EXPECT_EQ(attnres_phase1_forward(&p), ATTNRES_ERROR_UNSUPPORTED_DEVICE);
  EXPECT_STRNE(attnres_last_error(), "");
  EXPECT_EQ(out[0], 7.0f);
  EXPECT_EQ(lse[0], 7.0f);
}

#ifndef ATTNRES_WITH_CUDA

TEST(CudaTwoPhase, NeedsTheCudaBuild) {
  GTEST_SKIP() << "skipped: test built without ATTNRES_WITH_CUDA";
}

#else

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  Vec Normal(size_t n, double mean, double sd, attnres_dtype dtype) {
    std::normal_distribution<double> dist(mean, sd);
    Vec v(n);
    for (double& x : v) x = RoundToDType(dist(gen_), dtype);
    return v;
  }
  double Uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(gen_);
  }

 private:
  std::mt19937_64 gen_;
};

// A [rows, dim] tensor with row stride `stride` (dense: rows = 1, or stride = dim)
// held twice: in a host Buffer (the CPU backend's operand, and where results are
// read) and in its device twin starting `offset` elements past a cudaMalloc'd
// address (misaligned on purpose: one element is less than 16 bytes).
class Twin {
 public:
  Twin(attnres_dtype dtype, int64_t rows, int64_t dim, int64_t stride, uint8_t fill,
       size_t offset)
      : rows_(rows), dim_(dim), stride_(stride),
        host_(dtype, StridedCount(rows, dim, stride), fill) {
    host_.AddDeviceTwin(offset * DTypeSize(dtype));
  }
  Twin(const Twin&) = delete;
  Twin& operator=(const Twin&) = delete;

  void* ptr(bool cuda) { return cuda ? host_.abi_data() : host_.data(); }
  void Write(const Vec& v) {
    for (int64_t t = 0; t < rows_; ++t)
      for (int64_t d = 0; d < dim_; ++d) host_.Set(t * stride_ + d, v[t * dim_ + d]);
  }
  Vec Read() const {
    Vec v(rows_ * dim_);
    for (int64_t t = 0; t < rows_; ++t)
      for (int64_t d = 0; d < dim_; ++d) v[t * dim_ + d] = host_.Get(t * stride_ + d);
    return v;
  }
  void Fill(uint8_t pattern) { host_.Fill(pattern); }
  // The bytes between rows and the guard still hold `pattern`.
  bool OutsideIs(uint8_t pattern) const {
    for (int64_t t = 0; t + 1 < rows_; ++t) {
      if (!host_.BytesAre(t * stride_ + dim_, stride_ - dim_, pattern)) return false;
    }
    return host_.GuardIntact(pattern);
  }
  std::vector<unsigned char> Bytes() const {
    return std::vector<unsigned char>(host_.bytes(), host_.bytes() + host_.total_bytes());
  }
  // Host -> device and back, whole buffers (padding and guard included).
  void Upload() { host_.Upload(); }
  void Download() { host_.Download(); }

 private:
  int64_t rows_, dim_, stride_;
  Buffer host_;
};
using TwinPtr = std::unique_ptr<Twin>;

// Runs `call` on the CPU (cuda = false) or on the device: uploads every twin
// first (the host copies hold inputs and the outputs' sentinels or initial
// values), synchronises, and downloads every twin afterwards.
attnres_status RunOn(bool cuda, const std::vector<Twin*>& twins,
                     const std::function<attnres_status()>& call, std::string* error) {
  if (cuda) {
    for (Twin* t : twins) t->Upload();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const attnres_status status = call();
  *error = status == ATTNRES_OK ? "" : attnres_last_error();
  if (cuda) {
    const cudaError_t err = cudaDeviceSynchronize();
    EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    for (Twin* t : twins) t->Download();
  }
  return status;
}

// Same results on every output, to the tolerance of SPEC §3 for the dtype.
void ExpectClose(const std::string& what, const Vec& cuda, const Vec& cpu, double tol) {
  EXPECT_TRUE(Close(what, cuda, cpu, tol));
}

// ---------------------------------------------------------------------------
// Phase 1.

struct Phase1Case {
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  int64_t tokens = 21, dim = 37, blocks = 3, queries = 2;
  bool rmsnorm = true, gamma = true;
  double scale = 1.0;
  int64_t pad = 0;      // rows dim + pad apart (grad_blocks: dim + pad + 1)
  size_t offset = 0;    // device buffers start this many elements past an allocation
  bool accumulate = false;
  bool sparse = false;  // some grad_query_outs, grad_query_lses and grad_blocks NULL
  uint64_t seed = 1;

  std::string Describe() const {
    std::ostringstream s;
    s << DTypeName(dtype) << " T=" << tokens << " D=" << dim << " N=" << blocks
      << " S=" << queries << " rmsnorm=" << rmsnorm << " gamma=" << gamma << " pad=" << pad
      << " offset=" << offset << " accumulate=" << accumulate << " sparse=" << sparse;
    return s.str();
  }
};

struct Phase1Result {
  attnres_status forward = ATTNRES_OK, backward = ATTNRES_OK;
  std::string error, layout;
  Vecs outs, lses, grad_blocks;
  Vec grad_w, grad_gamma;
  std::vector<std::vector<unsigned char>> bytes;  // every output, for bitwise checks
};

class Phase1Problem {
 public:
  explicit Phase1Problem(const Phase1Case& c) : c_(c) {
    Rng rng(c.seed);
    const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
    const int64_t T = c.tokens, D = c.dim, N = c.blocks, S = c.queries;
    const int64_t stride = D + c.pad, grad_stride = D + c.pad + 1;
    const size_t off = c.offset;
    for (int64_t i = 0; i < N; ++i) {
      blocks_.push_back(std::make_unique<Twin>(dt, T, D, stride, kInputPadding, off));
      blocks_.back()->Write(rng.Normal(T * D, 0, rng.Uniform(0.5, 2), dt));
      grad_blocks_.push_back(std::make_unique<Twin>(dt, T, D, grad_stride, kOutputSentinel, off));
      initial_.push_back(rng.Normal(T * D, 0, 1, dt));
      null_block_.push_back(c.sparse && i % 3 == 1);
    }
    w_ = std::make_unique<Twin>(dt, 1, S * D, S * D, kInputPadding, off);
    w_->Write(rng.Normal(S * D, 0, 1 / std::sqrt(double(D)), dt));
    gamma_ = std::make_unique<Twin>(dt, 1, S * D, S * D, kInputPadding, off);
    gamma_->Write(rng.Normal(S * D, 1, 0.2, dt));
    for (int64_t s = 0; s < S; ++s) {
      outs_.push_back(std::make_unique<Twin>(dt, T, D, stride, kOutputSentinel, off));
      lses_.push_back(std::make_unique<Twin>(acc, 1, T, T, kOutputSentinel, off));
      grad_outs_.push_back(std::make_unique<Twin>(dt, T, D, stride, kInputPadding, off));
      grad_outs_.back()->Write(rng.Normal(T * D, 0, 1, dt));
      grad_lses_.push_back(std::make_unique<Twin>(acc, 1, T, T, kInputPadding, off));
      grad_lses_.back()->Write(rng.Normal(T, 0, 1, acc));
      null_grad_out_.push_back(c.sparse && s % 2 == 1);
      null_grad_lse_.push_back(c.sparse && s % 3 == 0);
    }
    grad_w_ = std::make_unique<Twin>(dt, 1, S * D, S * D, kOutputSentinel, off);
    grad_gamma_ = std::make_unique<Twin>(dt, 1, S * D, S * D, kOutputSentinel, off);
  }

  Phase1Result Run(bool cuda) {
    const int64_t S = c_.queries, N = c_.blocks;
    Phase1Result r;
    std::vector<const void*> blocks, grad_outs, grad_lses;
    std::vector<void*> outs, lses, grad_blocks;
    for (int64_t i = 0; i < N; ++i) {
      blocks.push_back(blocks_[i]->ptr(cuda));
      grad_blocks.push_back(null_block_[i] ? nullptr : grad_blocks_[i]->ptr(cuda));
    }
    for (int64_t s = 0; s < S; ++s) {
      outs.push_back(outs_[s]->ptr(cuda));
      lses.push_back(lses_[s]->ptr(cuda));
      grad_outs.push_back(null_grad_out_[s] ? nullptr : grad_outs_[s]->ptr(cuda));
      grad_lses.push_back(null_grad_lse_[s] ? nullptr : grad_lses_[s]->ptr(cuda));
    }
    attnres_params p;
    attnres_params_init(&p);
    p.device = cuda ? ATTNRES_DEVICE_CUDA : ATTNRES_DEVICE_CPU;
    p.dtype = c_.dtype;
    p.num_tokens = c_.tokens;
    p.dim = c_.dim;
    p.num_blocks = N;
    p.num_queries = S;
    p.blocks = blocks.data();
    p.source_row_stride = c_.dim + c_.pad;
    p.proj_weight = w_->ptr(cuda);
    p.gamma = c_.gamma ? gamma_->ptr(cuda) : nullptr;
    p.scale = c_.scale;
    p.rmsnorm = c_.rmsnorm ? 1 : 0;

    // Forward.
    for (auto& o : outs_) o->Fill(kOutputSentinel);
    for (auto& l : lses_) l->Fill(kOutputSentinel);
    attnres_params fwd = p;
    fwd.query_outs = outs.data();
    fwd.query_lses = lses.data();
    fwd.out_row_stride = c_.dim + c_.pad;
    r.forward = RunOn(cuda, All(), [&] { return attnres_phase1_forward(&fwd); }, &r.error);
    for (int64_t s = 0; s < S; ++s) {
      r.outs.push_back(outs_[s]->Read());
      r.lses.push_back(lses_[s]->Read());
      if (!outs_[s]->OutsideIs(kOutputSentinel)) r.layout += "query_outs padding written; ";
      if (!lses_[s]->OutsideIs(kOutputSentinel)) r.layout += "query_lses guard written; ";
      r.bytes.push_back(outs_[s]->Bytes());
      r.bytes.push_back(lses_[s]->Bytes());
    }
    if (r.forward != ATTNRES_OK) return r;

    // Backward.
    for (int64_t i = 0; i < N; ++i) {
      grad_blocks_[i]->Fill(kOutputSentinel);
      if (c_.accumulate) grad_blocks_[i]->Write(initial_[i]);
    }
    grad_w_->Fill(kOutputSentinel);
    grad_gamma_->Fill(kOutputSentinel);
    attnres_params bwd = p;
    bwd.grad_query_outs = grad_outs.data();
    bwd.grad_out_row_stride = c_.dim + c_.pad;
    bwd.grad_query_lses = grad_lses.data();
    bwd.grad_blocks = grad_blocks.data();
    bwd.grad_source_row_stride = c_.dim + c_.pad + 1;
    bwd.grad_proj_weight = grad_w_->ptr(cuda);
    bwd.grad_gamma = c_.rmsnorm ? grad_gamma_->ptr(cuda) : nullptr;
    bwd.accumulate_grads = c_.accumulate ? 1 : 0;
    r.backward = RunOn(cuda, All(), [&] { return attnres_phase1_backward(&bwd); }, &r.error);
    for (int64_t i = 0; i < N; ++i) {
      r.grad_blocks.push_back(null_block_[i] ? Vec() : grad_blocks_[i]->Read());
      if (!grad_blocks_[i]->OutsideIs(kOutputSentinel)) r.layout += "grad_blocks padding written; ";
      if (null_block_[i] && grad_blocks_[i]->Bytes() != Sentinel(*grad_blocks_[i])) {
        r.layout += "a NULL grad_blocks entry's buffer was written; ";
      }
      r.bytes.push_back(grad_blocks_[i]->Bytes());
    }
    r.grad_w = grad_w_->Read();
    if (c_.rmsnorm) r.grad_gamma = grad_gamma_->Read();
    if (!grad_w_->OutsideIs(kOutputSentinel) || !grad_gamma_->OutsideIs(kOutputSentinel)) {
      r.layout += "dw/dgamma guard written; ";
    }
    r.bytes.push_back(grad_w_->Bytes());
    r.bytes.push_back(grad_gamma_->Bytes());
    return r;
  }

 private:
  std::vector<Twin*> All() {
    std::vector<Twin*> all;
    for (auto* list : {&blocks_, &grad_blocks_, &outs_, &lses_, &grad_outs_, &grad_lses_}) {
      for (auto& t : *list) all.push_back(t.get());
    }
    for (Twin* t : {w_.get(), gamma_.get(), grad_w_.get(), grad_gamma_.get()}) all.push_back(t);
    return all;
  }
  static std::vector<unsigned char> Sentinel(const Twin& t) {
    std::vector<unsigned char> bytes = t.Bytes();
    std::fill(bytes.begin(), bytes.end(), kOutputSentinel);
    return bytes;
  }

  Phase1Case c_;
  std::vector<TwinPtr> blocks_, grad_blocks_, outs_, lses_, grad_outs_, grad_lses_;
  TwinPtr w_, gamma_, grad_w_, grad_gamma_;
  Vecs initial_;
  std::vector<bool> null_block_, null_grad_out_, null_grad_lse_;
};

void CheckPhase1(const Phase1Case& c) {
  SCOPED_TRACE(c.Describe());
  Phase1Problem problem(c);
  const Phase1Result cpu = problem.Run(false);
  ASSERT_EQ(cpu.forward, ATTNRES_OK) << cpu.error;
  ASSERT_EQ(cpu.backward, ATTNRES_OK) << cpu.error;
  const Phase1Result cuda = problem.Run(true);
  ASSERT_EQ(cuda.forward, ATTNRES_OK) << cuda.error;
  ASSERT_EQ(cuda.backward, ATTNRES_OK) << cuda.error;
  EXPECT_EQ(cuda.layout, "");
  const Tolerance tol = ToleranceFor(c.dtype);
  for (int64_t s = 0; s < c.queries; ++s) {
    ExpectClose("query_outs[" + std::to_string(s) + "]", cuda.outs[s], cpu.outs[s], tol.out);
    ExpectClose("query_lses[" + std::to_string(s) + "]", cuda.lses[s], cpu.lses[s], tol.cache);
  }
  for (int64_t i = 0; i < c.blocks; ++i) {
    ExpectClose("grad_blocks[" + std::to_string(i) + "]", cuda.grad_blocks[i], cpu.grad_blocks[i],
                tol.grad);
  }
  ExpectClose("grad_proj_weight", cuda.grad_w, cpu.grad_w, tol.grad);
  ExpectClose("grad_gamma", cuda.grad_gamma, cpu.grad_gamma, tol.grad);

  // Bitwise: a second run, and grids of 1 and 3 CTAs (every CTA takes many items).
  const Phase1Result again = problem.Run(true);
  EXPECT_TRUE(again.bytes == cuda.bytes) << "a second run changed some output's bits";
  for (const char* cap : {"1", "3"}) {
    ScopedEnv env("ATTNRES_CUDA_MAX_CTAS", cap);
    const Phase1Result capped = problem.Run(true);
    EXPECT_TRUE(capped.bytes == cuda.bytes)
        << "ATTNRES_CUDA_MAX_CTAS=" << cap << " changed some output's bits";
  }
}

TEST(CudaTwoPhase, Phase1MatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (int64_t S : {1, 6}) {
      for (int64_t N : {1, 9}) {
        for (int64_t D : {37, 1029}) {
          Phase1Case c;
          c.dtype = dtype;
          c.queries = S;
          c.blocks = N;
          c.dim = D;
          c.tokens = 45;
          c.rmsnorm = k % 4 != 3;
          c.gamma = k % 3 != 2;
          c.scale = k % 2 ? 0.7 : 1.0;
          c.pad = k % 2 ? 3 : 0;
          c.offset = k % 3 == 1 ? 1 : 0;
          c.accumulate = k % 5 == 2;
          c.sparse = k % 4 == 1;
          c.seed = 100 + k++;
          CheckPhase1(c);
        }
      }
    }
  }
}

// More than 8 tokens per weight-gradient item, many items per CTA when capped.
TEST(CudaTwoPhase, Phase1ManyTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    Phase1Case c;
    c.dtype = dtype;
    c.tokens = 20000;
    c.dim = 64;
    c.blocks = 5;
    c.queries = 6;
    c.seed = 7;
    CheckPhase1(c);
  }
}

// S > 32 and N > 128: the pointer tables in device memory; the statistics of
// a token no longer fit in shared memory.
TEST(CudaTwoPhase, Phase1LargeTables) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64}) {
    Phase1Case c;
    c.dtype = dtype;
    c.tokens = 10;
    c.dim = 17;
    c.blocks = 130;
    c.queries = 40;
    c.sparse = true;
    c.seed = 9;
    CheckPhase1(c);
  }
}

// ---------------------------------------------------------------------------
// Phase 2.

struct Phase2Case {
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  int64_t tokens = 21, dim = 37;
  bool partial = true, rmsnorm = true, gamma = true, input_norm = false, norm_weight = true;
  double scale = 1.0;
  int64_t pad = 0;
  size_t offset = 0;
  bool sparse = false;  // grad_query_out, grad_query_lse, grad_partial and dw NULL
  // The fused update (needs partial): the forward adds y and writes p' to new_partial,
  // the backward then reads p' as its partial block; and grad_partial_in (needs
  // grad_partial, so not with sparse).
  bool update = false, grad_partial_in = false;
  uint64_t seed = 1;

  std::string Describe() const {
    std::ostringstream s;
    s << DTypeName(dtype) << " T=" << tokens << " D=" << dim << " partial=" << partial
      << " rmsnorm=" << rmsnorm << " gamma=" << gamma << " input_norm=" << input_norm
      << " norm_weight=" << norm_weight << " pad=" << pad << " offset=" << offset
      << " sparse=" << sparse << " update=" << update << " grad_partial_in=" << grad_partial_in;
    return s.str();
  }
};

struct Phase2Result {
  attnres_status forward = ATTNRES_OK, backward = ATTNRES_OK;
  std::string error, layout;
  Vec out, new_p, grad_o, grad_lse, grad_p, grad_w, grad_gamma, grad_nw;
  // With the update: the plain forward (no update) given the new_partial just
  // written as its partial block; the bytes of its out.
  attnres_status plain_forward = ATTNRES_OK;
  std::vector<unsigned char> plain_out_bytes;
  std::vector<std::vector<unsigned char>> bytes;
};

class Phase2Problem {
 public:
  explicit Phase2Problem(const Phase2Case& c) : c_(c) {
    Rng rng(c.seed);
    const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
    const int64_t T = c.tokens, D = c.dim, stride = D + c.pad, grad_stride = D + c.pad + 1;
    const size_t off = c.offset;
    const auto make = [&](int64_t rows, int64_t dim, int64_t row_stride, attnres_dtype type,
                          uint8_t fill) {
      return std::make_unique<Twin>(type, rows, dim, row_stride, fill, off);
    };
    o_ = make(T, D, stride, dt, kInputPadding);
    o_->Write(rng.Normal(T * D, 0, 1, dt));
    p_ = make(T, D, stride, dt, kInputPadding);
    p_->Write(rng.Normal(T * D, 0, 1.5, dt));
    lse_ = make(1, T, T, acc, kInputPadding);
    lse_->Write(rng.Normal(T, 0.5, 1.5, acc));
    w_ = make(1, D, D, dt, kInputPadding);
    w_->Write(rng.Normal(D, 0, 1 / std::sqrt(double(D)), dt));
    gamma_ = make(1, D, D, dt, kInputPadding);
    gamma_->Write(rng.Normal(D, 1, 0.2, dt));
    nw_ = make(1, D, D, dt, kInputPadding);
    nw_->Write(rng.Normal(D, 1, 0.2, dt));
    g_ = make(T, D, stride, dt, kInputPadding);
    g_->Write(rng.Normal(T * D, 0, 1, dt));
    y_ = make(T, D, stride, dt, kInputPadding);
    y_->Write(rng.Normal(T * D, 0, 0.3, dt));
    g_in_ = make(T, D, stride, dt, kInputPadding);
    g_in_->Write(rng.Normal(T * D, 0, 1, dt));
    out_ = make(T, D, stride, dt, kOutputSentinel);
    plain_out_ = make(T, D, stride, dt, kOutputSentinel);
    new_p_ = make(T, D, stride, dt, kOutputSentinel);
    grad_o_ = make(T, D, grad_stride, dt, kOutputSentinel);
    grad_lse_ = make(1, T, T, acc, kOutputSentinel);
    grad_p_ = make(T, D, grad_stride, dt, kOutputSentinel);
    grad_w_ = make(1, D, D, dt, kOutputSentinel);
    grad_gamma_ = make(1, D, D, dt, kOutputSentinel);
    grad_nw_ = make(1, D, D, dt, kOutputSentinel);
  }

  Phase2Result Run(bool cuda) {
    Phase2Result r;
    attnres_params p;
    attnres_params_init(&p);
    p.device = cuda ? ATTNRES_DEVICE_CUDA : ATTNRES_DEVICE_CPU;
    p.dtype = c_.dtype;
    p.num_tokens = c_.tokens;
    p.dim = c_.dim;
    p.num_blocks = 0;
    p.query_out = o_->ptr(cuda);
    p.partial = c_.partial ? p_->ptr(cuda) : nullptr;
    p.query_lse = c_.partial ? lse_->ptr(cuda) : nullptr;
    p.source_row_stride = c_.dim + c_.pad;
    p.proj_weight = w_->ptr(cuda);
    p.gamma = c_.gamma ? gamma_->ptr(cuda) : nullptr;
    p.scale = c_.scale;
    p.rmsnorm = c_.rmsnorm ? 1 : 0;
    p.input_norm = c_.input_norm ? 1 : 0;
    p.norm_weight = c_.input_norm && c_.norm_weight ? nw_->ptr(cuda) : nullptr;

    out_->Fill(kOutputSentinel);
    new_p_->Fill(kOutputSentinel);
    attnres_params fwd = p;
    fwd.out = out_->ptr(cuda);
    fwd.out_row_stride = c_.dim + c_.pad;
    if (c_.update) {
      fwd.partial_update = y_->ptr(cuda);
      fwd.new_partial = new_p_->ptr(cuda);
    }
    r.forward = RunOn(cuda, All(), [&] { return attnres_phase2_forward(&fwd); }, &r.error);
    r.out = out_->Read();
    if (!out_->OutsideIs(kOutputSentinel)) r.layout += "out padding written; ";
    r.bytes.push_back(out_->Bytes());
    if (c_.update) {
      r.new_p = new_p_->Read();
      if (!new_p_->OutsideIs(kOutputSentinel)) r.layout += "new_partial padding written; ";
      r.bytes.push_back(new_p_->Bytes());
    } else {
      const std::vector<unsigned char> bytes = new_p_->Bytes();
      if (std::any_of(bytes.begin(), bytes.end(),
                      [](unsigned char b) { return b != kOutputSentinel; })) {
        r.layout += "new_partial written without partial_update; ";
      }
    }
    if (r.forward != ATTNRES_OK) return r;
    if (c_.update) {
      // From here on p' is the partial block, as the backward must be given it.
      p.partial = new_p_->ptr(cuda);
      plain_out_->Fill(kOutputSentinel);
      attnres_params plain = p;
      plain.out = plain_out_->ptr(cuda);
      plain.out_row_stride = c_.dim + c_.pad;
      r.plain_forward =
          RunOn(cuda, All(), [&] { return attnres_phase2_forward(&plain); }, &r.error);
      r.plain_out_bytes = plain_out_->Bytes();
    }

    for (Twin* t : Outputs()) t->Fill(kOutputSentinel);
    attnres_params bwd = p;
    bwd.grad_out = g_->ptr(cuda);
    bwd.grad_out_row_stride = c_.dim + c_.pad;
    bwd.grad_source_row_stride = c_.dim + c_.pad + 1;
    bwd.grad_query_out = c_.sparse ? nullptr : grad_o_->ptr(cuda);
    bwd.grad_query_lse = c_.sparse ? nullptr : grad_lse_->ptr(cuda);
    bwd.grad_partial = c_.partial && !c_.sparse ? grad_p_->ptr(cuda) : nullptr;
    bwd.grad_proj_weight = c_.sparse ? nullptr : grad_w_->ptr(cuda);
    bwd.grad_gamma = c_.rmsnorm ? grad_gamma_->ptr(cuda) : nullptr;
    bwd.grad_norm_weight = c_.input_norm ? grad_nw_->ptr(cuda) : nullptr;
    bwd.grad_partial_in =
        c_.grad_partial_in && bwd.grad_partial != nullptr ? g_in_->ptr(cuda) : nullptr;
    r.backward = RunOn(cuda, All(), [&] { return attnres_phase2_backward(&bwd); }, &r.error);
    if (bwd.grad_query_out != nullptr) r.grad_o = grad_o_->Read();
    if (bwd.grad_query_lse != nullptr) r.grad_lse = grad_lse_->Read();
    if (bwd.grad_partial != nullptr) r.grad_p = grad_p_->Read();
    if (bwd.grad_proj_weight != nullptr) r.grad_w = grad_w_->Read();
    if (bwd.grad_gamma != nullptr) r.grad_gamma = grad_gamma_->Read();
    if (bwd.grad_norm_weight != nullptr) r.grad_nw = grad_nw_->Read();
    for (Twin* t : Outputs()) {
      if (!t->OutsideIs(kOutputSentinel)) r.layout += "a gradient's padding or guard was written; ";
      r.bytes.push_back(t->Bytes());
    }
    const std::vector<std::pair<Twin*, const void*>> skipped = {
        {grad_o_.get(), bwd.grad_query_out}, {grad_lse_.get(), bwd.grad_query_lse},
        {grad_p_.get(), bwd.grad_partial},   {grad_w_.get(), bwd.grad_proj_weight},
        {grad_gamma_.get(), bwd.grad_gamma}, {grad_nw_.get(), bwd.grad_norm_weight}};
    for (const auto& [twin, ptr] : skipped) {
      if (ptr != nullptr) continue;
      const std::vector<unsigned char> bytes = twin->Bytes();
      for (unsigned char b : bytes) {
        if (b != kOutputSentinel) {
          r.layout += "a NULL gradient's buffer was written; ";
          break;
        }
      }
    }
    return r;
  }

  // round(partial + y) as a separate addition gives it: the sum in the accumulation
  // type (float, or double for float64), rounded once to the dtype.
  Vec RoundedSum() const {
    const Vec p = p_->Read(), y = y_->Read();
    Vec sum(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      sum[i] = c_.dtype == ATTNRES_DTYPE_FLOAT64
                   ? p[i] + y[i]
                   : RoundToDType(static_cast<double>(static_cast<float>(p[i]) +
                                                      static_cast<float>(y[i])),
                                  c_.dtype);
    }
    return sum;
  }

 private:
  std::vector<Twin*> Outputs() {
    return {grad_o_.get(), grad_lse_.get(), grad_p_.get(), grad_w_.get(), grad_gamma_.get(),
            grad_nw_.get()};
  }
  std::vector<Twin*> All() {
    std::vector<Twin*> all = Outputs();
    for (Twin* t : {o_.get(), p_.get(), lse_.get(), w_.get(), gamma_.get(), nw_.get(), g_.get(),
                    out_.get(), y_.get(), g_in_.get(), new_p_.get(), plain_out_.get()}) {
      all.push_back(t);
    }
    return all;
  }

  Phase2Case c_;
  TwinPtr o_, p_, lse_, w_, gamma_, nw_, g_, out_, y_, g_in_, new_p_, plain_out_;
  TwinPtr grad_o_, grad_lse_, grad_p_, grad_w_, grad_gamma_, grad_nw_;
};

void CheckPhase2(const Phase2Case& c) {
  SCOPED_TRACE(c.Describe());
  Phase2Problem problem(c);
  const Phase2Result cpu = problem.Run(false);
  ASSERT_EQ(cpu.forward, ATTNRES_OK) << cpu.error;
  ASSERT_EQ(cpu.backward, ATTNRES_OK) << cpu.error;
  const Phase2Result cuda = problem.Run(true);
  ASSERT_EQ(cuda.forward, ATTNRES_OK) << cuda.error;
  ASSERT_EQ(cuda.backward, ATTNRES_OK) << cuda.error;
  EXPECT_EQ(cuda.layout, "");
  const Tolerance tol = ToleranceFor(c.dtype);
  ExpectClose("out", cuda.out, cpu.out, tol.out);
  if (c.update) {
    const Vec sum = problem.RoundedSum();
    EXPECT_TRUE(cuda.new_p == sum) << "new_partial is not round(partial + partial_update)";
    EXPECT_TRUE(cpu.new_p == sum) << "the CPU's new_partial is not round(partial + partial_update)";
    // The merge takes the rounded p': the same bits as the plain merge of new_partial
    // (merging the unrounded sum stays within out's tolerance in bf16/fp16).
    ASSERT_EQ(cuda.plain_forward, ATTNRES_OK) << cuda.error;
    EXPECT_TRUE(cuda.plain_out_bytes == cuda.bytes[0])
        << "the fused forward's out differs from the plain forward given its new_partial";
  }
  ExpectClose("grad_query_out", cuda.grad_o, cpu.grad_o, tol.grad);
  ExpectClose("grad_query_lse", cuda.grad_lse, cpu.grad_lse, tol.grad);
  ExpectClose("grad_partial", cuda.grad_p, cpu.grad_p, tol.grad);
  ExpectClose("grad_proj_weight", cuda.grad_w, cpu.grad_w, tol.grad);
  ExpectClose("grad_gamma", cuda.grad_gamma, cpu.grad_gamma, tol.grad);
  ExpectClose("grad_norm_weight", cuda.grad_nw, cpu.grad_nw, tol.grad);

  const Phase2Result again = problem.Run(true);
  EXPECT_TRUE(again.bytes == cuda.bytes) << "a second run changed some output's bits";
  for (const char* cap : {"1", "3"}) {
    ScopedEnv env("ATTNRES_CUDA_MAX_CTAS", cap);
    const Phase2Result capped = problem.Run(true);
    EXPECT_TRUE(capped.bytes == cuda.bytes)
        << "ATTNRES_CUDA_MAX_CTAS=" << cap << " changed some output's bits";
  }
}

TEST(CudaTwoPhase, Phase2MatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (bool partial : {true, false}) {
      for (bool input_norm : {false, true}) {
        for (int64_t D : {37, 1029}) {
          Phase2Case c;
          c.dtype = dtype;
          c.partial = partial;
          c.input_norm = input_norm;
          c.dim = D;
          c.tokens = 45;
          c.rmsnorm = k % 4 != 3;
          c.gamma = k % 3 != 2;
          c.norm_weight = k % 5 != 4;
          c.scale = k % 2 ? 0.7 : 1.0;
          c.pad = k % 2 ? 3 : 0;
          c.offset = k % 3 == 1 ? 1 : 0;
          c.sparse = k % 6 == 5;
          c.seed = 200 + k++;
          CheckPhase2(c);
        }
      }
    }
  }
}

// The fused partial-block update, forward and backward apart and together.
TEST(CudaTwoPhase, Phase2FusedUpdateMatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (int fused : {1, 2, 3}) {  // bit 0: partial_update, bit 1: grad_partial_in
      for (bool input_norm : {false, true}) {
        for (int64_t D : {37, 1029}) {
          Phase2Case c;
          c.dtype = dtype;
          c.update = fused & 1;
          c.grad_partial_in = fused & 2;
          c.input_norm = input_norm;
          c.dim = D;
          c.tokens = 45;
          c.rmsnorm = k % 4 != 3;
          c.gamma = k % 3 != 2;
          c.norm_weight = k % 5 != 4;
          c.scale = k % 2 ? 0.7 : 1.0;
          c.pad = k % 2 ? 3 : 0;
          c.offset = k % 3 == 1 ? 1 : 0;
          c.sparse = fused == 1 && k % 4 == 0;  // no grad_partial: no grad_partial_in
          c.seed = 300 + k++;
          CheckPhase2(c);
        }
      }
    }
  }
}

TEST(CudaTwoPhase, Phase2ManyTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    Phase2Case c;
    c.dtype = dtype;
    c.tokens = 20000;
    c.dim = 64;
    c.input_norm = true;
    c.seed = 11;
    CheckPhase2(c);
    c.update = c.grad_partial_in = true;
    c.seed = 12;
    CheckPhase2(c);
  }
}

// No tokens: nothing to mix, and the weight gradients are zero, as on the CPU.
TEST(CudaTwoPhase, NoTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  Phase1Case c1;
  c1.tokens = 0;
  CheckPhase1(c1);
  Phase2Case c2;
  c2.tokens = 0;
  c2.input_norm = true;
  CheckPhase2(c2);
}

#endif  // ATTNRES_WITH_CUDA

}  // namespace
}  // namespace attnres_test
