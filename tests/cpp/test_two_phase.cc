// The two-phase schedule through the C ABI (attnres_phase1_* / attnres_phase2_*),
// held to SPEC §5 and §3 against the float64 reference in src/ref/two_phase_reference.h
// on every backend (phase_problems.h): every dtype, odd dims, padded row strides
// (padding of inputs is NaN, padding of outputs must stay untouched), determinism
// across thread counts and CPU variants, accumulate_grads, and every validation rule
// of the header (status, a message that names the argument, nothing written).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "phase_problems.h"
#include "ref/harness.h"
#include "ref/reference.h"
#include "ref/two_phase_reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

using attnres::ref::Phase1Problem;
using attnres::ref::Phase2Problem;

class ThreadsAndIsaGuard {
 public:
  ~ThreadsAndIsaGuard() {
    attnres_set_num_threads(0);
    attnres_set_cpu_isa(nullptr);
  }
};


// ---------------------------------------------------------------------------
// The reference itself: phase 1 then phase 2 is the single op (SPEC §5, "in exact
// arithmetic h equals the single op"), forward and backward, and the input norm's
// backward matches finite differences.

// Phase 1 then phase 2 for each of three queries against the single op over the
// same sources, forward and backward.
void CheckComposition(bool rmsnorm, bool has_gamma, bool has_partial) {
  SCOPED_TRACE("rmsnorm=" + std::to_string(rmsnorm) + " gamma=" + std::to_string(has_gamma) +
               " partial=" + std::to_string(has_partial));
  Rng rng(7);
  const int64_t T = 3, D = 6, N = 4, S = 3;
  const attnres_dtype f64 = ATTNRES_DTYPE_FLOAT64;
  Phase1Problem p1;
  p1.tokens = T;
  p1.dim = D;
  p1.num_queries = S;
  p1.rmsnorm = rmsnorm;
  p1.scale = 0.8;
  p1.eps = 0.05;
  for (int64_t i = 0; i < N; ++i) p1.blocks.push_back(rng.Normal(T * D, 0, 1 + i * 0.3, f64));
  p1.w = rng.Normal(S * D, 0, 0.5, f64);
  if (has_gamma) p1.gamma = rng.Normal(S * D, 1, 0.2, f64);
  const auto f1 = attnres::ref::Phase1Forward(p1);
  Vecs partials, grads;
  for (int64_t s = 0; s < S; ++s) {
    partials.push_back(rng.Normal(T * D, 0, 1, f64));
    grads.push_back(rng.Normal(T * D, 0, 1, f64));
  }
  // Gradients of sum_s <g_s, h_s> through both phases.
  Vecs go(S), gl(S), grads_single(N, Vec(T * D, 0.0));
  Vec dw_total(S * D, 0.0), dgamma_total(S * D, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    Phase2Problem p2;
    p2.tokens = T;
    p2.dim = D;
    p2.has_partial = has_partial;
    p2.rmsnorm = rmsnorm;
    p2.scale = p1.scale;
    p2.eps = p1.eps;
    p2.out = f1.outs[s];
    p2.lse = f1.lses[s];
    p2.partial = partials[s];
    p2.w = Vec(p1.w.begin() + s * D, p1.w.begin() + (s + 1) * D);
    if (has_gamma) p2.gamma = Vec(p1.gamma.begin() + s * D, p1.gamma.begin() + (s + 1) * D);
    const Vec h = attnres::ref::Phase2Forward(p2);

    attnres::ref::Problem single;
    single.tokens = T;
    single.dim = D;
    single.num_blocks = N;
    single.has_partial = has_partial;
    single.rmsnorm = rmsnorm;
    single.scale = p1.scale;
    single.eps = p1.eps;
    single.sources = p1.blocks;
    if (has_partial) single.sources.push_back(partials[s]);
    single.w = p2.w;
    single.gamma = p2.gamma;
    const auto fs = attnres::ref::Forward(single);
    EXPECT_TRUE(Close("h (s=" + std::to_string(s) + ")", h, fs.out, 1e-13));

    const auto b2 = attnres::ref::Phase2Backward(p2, grads[s]);
    const auto bs = attnres::ref::Backward(single, grads[s]);
    if (has_partial) EXPECT_TRUE(Close("dp", b2.grad_partial, bs.grad_sources[N], 1e-12));
    go[s] = b2.grad_out;
    gl[s] = b2.grad_lse;
    // Expected totals: the single op's dw/dgamma per query.
    for (int64_t d = 0; d < D; ++d) {
      dw_total[s * D + d] = bs.grad_w[d] - b2.grad_w[d];  // phase 1's share
      dgamma_total[s * D + d] = bs.grad_gamma[d] - b2.grad_gamma[d];
    }
    // Phase 1's block gradients must add up to the single op's over all s.
    for (int64_t i = 0; i < N; ++i) grads_single[i] = Add(grads_single[i], bs.grad_sources[i]);
  }
  const auto b1 = attnres::ref::Phase1Backward(p1, go, gl);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_TRUE(Close("dv_" + std::to_string(i), b1.grad_blocks[i], grads_single[i], 1e-12));
  }
  EXPECT_TRUE(Close("dw (phase 1 share)", b1.grad_w, dw_total, 1e-12));
  if (rmsnorm) EXPECT_TRUE(Close("dgamma (phase 1 share)", b1.grad_gamma, dgamma_total, 1e-12));
}

TEST(TwoPhaseReference, ComposesToTheSingleOpReference) {
  for (bool rmsnorm : {true, false}) {
    for (bool has_gamma : {true, false}) {
      for (bool has_partial : {true, false}) CheckComposition(rmsnorm, has_gamma, has_partial);
    }
  }
}

TEST(TwoPhaseReference, InputNormBackwardMatchesFiniteDifferences) {
  Rng rng(3);
  const attnres_dtype f64 = ATTNRES_DTYPE_FLOAT64;
  Phase2Problem p;
  p.tokens = 2;
  p.dim = 5;
  p.input_norm = true;
  p.scale = 0.7;
  p.eps = 0.01;
  p.norm_eps = 0.02;
  p.out = rng.Normal(10, 0, 1, f64);
  p.lse = rng.Normal(2, 0, 1, f64);
  p.partial = rng.Normal(10, 0, 1, f64);
  p.w = rng.Normal(5, 0, 0.5, f64);
  p.gamma = rng.Normal(5, 1, 0.2, f64);
  p.norm_weight = rng.Normal(5, 1, 0.2, f64);
  const Vec g = rng.Normal(10, 0, 1, f64);
  const auto b = attnres::ref::Phase2Backward(p, g);
  auto loss = [&](const Phase2Problem& q) {
    const Vec y = attnres::ref::Phase2Forward(q);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * g[i];
    return s;
  };
  const double h = 1e-6;
  auto check = [&](const char* name, Vec Phase2Problem::*field, const Vec& analytic) {
    for (size_t i = 0; i < (p.*field).size(); ++i) {
      Phase2Problem plus = p, minus = p;
      (plus.*field)[i] += h;
      (minus.*field)[i] -= h;
      const double fd = (loss(plus) - loss(minus)) / (2 * h);
      EXPECT_NEAR(analytic[i], fd, 1e-7) << name << "[" << i << "]";
    }
  };
  check("out", &Phase2Problem::out, b.grad_out);
  check("lse", &Phase2Problem::lse, b.grad_lse);
  check("partial", &Phase2Problem::partial, b.grad_partial);
  check("w", &Phase2Problem::w, b.grad_w);
  check("gamma", &Phase2Problem::gamma, b.grad_gamma);
  check("norm_weight", &Phase2Problem::norm_weight, b.grad_norm_weight);
}

// ---------------------------------------------------------------------------
// The ABI vs the reference.

std::vector<Phase1Case> Phase1Cases(attnres_dtype dt) {
  Phase1Case a(dt, 7, 33, 3, 2, 1);  // everything on, padded strides everywhere
  a.scale = 0.7;
  a.source_pad = 3;
  a.out_pad = 5;
  a.grad_out_pad = 2;
  a.grad_source_pad = 4;
  Phase1Case b(dt, 5, 1, 1, 1, 2);  // D = 1, one block, one query, gamma NULL
  b.gamma = false;
  b.source_pad = 1;
  // No RMSNorm (gamma given: ignored), missing upstream gradients.
  Phase1Case c(dt, 9, 130, 9, 6, 3);
  c.rmsnorm = false;
  c.scale = 1.3;
  c.eps = 0.3;
  c.source_pad = 1;
  c.grad_out_pad = 7;
  c.null_grad_outs = {2};
  c.null_grad_lses = {1, 4};
  Phase1Case d(dt, 3, 7, 33, 24, 4);  // many blocks and queries, no LSE gradients
  d.eps = 0.1;
  d.scale = 0.5;
  d.source_pad = 9;
  d.out_pad = 1;
  d.grad_source_pad = 2;
  d.grad_lses_array_null = true;
  Phase1Case e(dt, 17, 64, 2, 5, 5);  // full vectors, 5 queries (a partial group of 4)
  e.scale = 2.0;
  e.source_pad = 64;
  e.null_grad_outs = {0};
  // Rows of several of pass 1's tiles and a short last pair; 13 queries (query
  // groups of 8 + 5 on AVX-512, 4 + 4 + 4 + 1 on AVX2).
  Phase1Case f(dt, 4, 1031, 5, 13, 6);
  f.scale = 0.8;
  f.source_pad = 3;
  f.grad_out_pad = 1;
  f.null_grad_lses = {7};
  return {a, b, c, d, e, f};
}

TEST(TwoPhaseAbi, Phase1MatchesReference) {
  for (attnres_dtype dt : kAllDTypes) {
    for (const Phase1Case& c : Phase1Cases(dt)) CheckPhase1(c);
  }
}

// Phase 1 backward's block gradients above 16 MB are written with non-temporal
// stores when every row is aligned for them (src/cpu/backend.cc; the forward's
// query rows never are): aligned rows, and bf16 rows one element apart too many for
// that, on every CPU variant. (The suite name is the single op's streaming test's,
// which the aarch64 run under qemu leaves out for its time.)
TEST(StreamingStores, Phase1LargeOutputsMatchTheReference) {
  for (auto [dt, pad] : {std::pair{ATTNRES_DTYPE_BFLOAT16, 0}, std::pair{ATTNRES_DTYPE_BFLOAT16, 1},
                         std::pair{ATTNRES_DTYPE_FLOAT32, 0}}) {
    // bf16: 5 x 4.6 MB of outputs, 4 x 4.6 MB of gradients (fp32 twice that).
    Phase1Case c(dt, 1000, 2304, 4, 5, 7);
    c.out_pad = pad;
    c.grad_source_pad = pad;
    CheckPhase1(c);
  }
}

TEST(TwoPhaseAbi, Phase2MatchesReference) {
  const int64_t dims[] = {1, 7, 33, 130};
  int k = 0;
  for (attnres_dtype dt : kAllDTypes) {
    for (bool partial : {true, false}) {
      for (int norm : {0, 1, 2}) {        // no input norm, input norm, with norm_weight
        for (int keys : {0, 1, 2}) {      // RMSNorm + gamma, RMSNorm without gamma, none
          Phase2Case c(dt, 6, dims[k % 4], 100 + k);
          c.partial = partial;
          c.input_norm = norm >= 1;
          c.norm_weight = norm == 2;
          c.rmsnorm = keys != 2;
          c.gamma = keys == 0 || keys == 2;  // keys == 2: gamma given but unused
          c.scale = (k % 3 == 0) ? 1.0 : 0.6 + 0.1 * (k % 7);
          c.eps = (k % 2) ? 1e-6 : 0.25;
          c.norm_eps = (k % 3) ? 1e-6 : 0.1;
          // D = 1: RMSNorm(h) = sign(h) * norm_weight up to norm_eps, so every gradient
          // through it is O(norm_eps) and pure cancellation in fp32 (no relative measure
          // holds); a large norm_eps keeps the case well conditioned.
          if (c.dim == 1 && c.input_norm) c.norm_eps = 0.5;
          c.source_pad = k % 3;
          c.out_pad = (k + 1) % 4;
          c.grad_out_pad = k % 2;
          c.grad_source_pad = (k + 2) % 3;
          ++k;
          CheckPhase2(c);
        }
      }
    }
  }
}

// The fused partial-block update (ABI 3): new_partial is partial + y with the bits of
// one rounded addition, out merges it (the plain forward's out of it, bit for bit),
// and grad_partial_in is added into grad_partial.
TEST(TwoPhaseAbi, Phase2FusedUpdateMatchesReference) {
  const int64_t dims[] = {1, 7, 33, 130, 1031};
  int k = 0;
  for (attnres_dtype dt : kAllDTypes) {
    for (int norm : {0, 2}) {    // no input norm, input norm with norm_weight
      for (int keys : {0, 2}) {  // RMSNorm + gamma, none
        Phase2Case c(dt, 1 + 4 * (k % 3), dims[k % 5], 300 + k);
        c.update = c.grad_partial_in = true;
        c.input_norm = norm >= 1;
        c.norm_weight = norm == 2;
        c.rmsnorm = keys != 2;
        c.gamma = keys == 0;
        c.scale = (k % 2) ? 1.0 : 0.7;
        if (c.dim == 1 && c.input_norm) c.norm_eps = 0.5;  // as in Phase2MatchesReference
        c.source_pad = k % 3;
        c.out_pad = (k + 1) % 4;
        c.grad_out_pad = (k + 1) % 2;
        c.grad_source_pad = k % 3;
        ++k;
        CheckPhase2(c);
      }
    }
  }
}

// Sharp merges (SPEC §3): lse - z_p = +-5 .. +-30, so beta or 1 - beta is down to
// 1e-13, with the partial block SharpPartialSizes times o (in fp16 the cases
// Fp16HoldsSharp), RMSNorm on and off for each; the input norm, the fused update
// and the shapes vary from case to case.
TEST(TwoPhaseAbi, Phase2SharpMergesMatchReference) {
  int k = 0;
  for (attnres_dtype dt : kAllDTypes) {
    for (double gap : {5.0, 10.0, 20.0, 30.0}) {
      for (double sign : {1.0, -1.0}) {
        for (double size : SharpPartialSizes(dt)) {
          if (dt == ATTNRES_DTYPE_FLOAT16 && !Fp16HoldsSharp(gap, size)) continue;
          for (bool rmsnorm : {true, false}) {
            Phase2Case c(dt, 9, k % 2 ? 33 : 64, 500 + k);
            c.merge_gap = sign * gap;
            c.partial_size = size;
            c.rmsnorm = rmsnorm;
            c.gamma = k % 3 != 1;
            // The input norm only with a partial block of o's size: otherwise h is
            // close to the larger of the two, dh (orthogonal to h) nearly so to it,
            // and dot(dh, o - p) comes from terms 1000x its size, a cancellation any
            // fp32 evaluation of dh shares (the single op's dot(dh, v_i) too): 1-2e-4
            // of max-abs in dlse there.
            c.input_norm = c.norm_weight = (k / 2) % 3 == 1 && size == 1;
            c.update = c.grad_partial_in = (k / 3) % 4 == 2;
            c.scale = 0.8;
            c.source_pad = (k / 5) % 3;
            ++k;
            CheckPhase2(c);
          }
        }
      }
    }
  }
}

TEST(TwoPhaseAbi, ZeroTokensWriteZeroWeightGradients) {
  for (attnres_dtype dt : kAllDTypes) {
    SCOPED_TRACE(DTypeName(dt));
    const Phase1Case c(dt, 0, 8, 3, 2, 1);
    Phase1Abi abi(c);
    const auto f = abi.RunForward();
    ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
    EXPECT_EQ(f.layout, "");
    const auto b = abi.RunBackward();
    ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
    EXPECT_EQ(b.layout, "");
    EXPECT_TRUE(Close("dw", b.grad_w, Vec(c.queries * c.dim, 0.0), 0));
    EXPECT_TRUE(Close("dgamma", b.grad_gamma, Vec(c.queries * c.dim, 0.0), 0));

    Phase2Case c2(dt, 0, 8, 1);
    c2.input_norm = true;
    Phase2Abi abi2(c2);
    const auto f2 = abi2.RunForward();
    ASSERT_EQ(f2.status, ATTNRES_OK) << f2.error;
    const auto b2 = abi2.RunBackward();
    ASSERT_EQ(b2.status, ATTNRES_OK) << b2.error;
    EXPECT_TRUE(Close("dw", b2.grad_w, Vec(c2.dim, 0.0), 0));
    EXPECT_TRUE(Close("dgamma", b2.grad_gamma, Vec(c2.dim, 0.0), 0));
    EXPECT_TRUE(Close("dnorm_weight", b2.grad_norm_weight, Vec(c2.dim, 0.0), 0));
  }
}

// Header: "accumulate_grads: 1 adds into grad_blocks[i] instead of overwriting";
// grad_proj_weight and grad_gamma stay "overwritten" (the sentinel they held before
// the call must not leak into them); accumulate = 0 ignores what the buffers held.
TEST(TwoPhaseAbi, AccumulateGradsAddsIntoBlockGradients) {
  for (attnres_dtype dt : kAllDTypes) {
    Phase1Case c(dt, 11, 19, 4, 3, 1);
    c.grad_source_pad = 3;
    c.null_grad_lses = {1};
    Rng rng(99);
    Phase1Grads g;
    for (int64_t i = 0; i < c.blocks; ++i) g.initial.push_back(rng.Normal(c.tokens * c.dim, 0, 1, dt));
    g.null_blocks = {2};
    g.accumulate = true;
    CheckPhase1(c, g);
    g.null_blocks = {};
    g.accumulate = false;
    CheckPhase1(c, g);
  }
}

// SPEC §3: dw and dgamma (and phase 2's dnorm_weight) bitwise identical run to run
// and for any number of threads, for every CPU variant; every variant near the reference.
TEST(TwoPhaseDeterminism, AcrossThreadsAndIsas) {
  ThreadsAndIsaGuard guard;
  for (attnres_dtype dt : {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_BFLOAT16}) {
    Phase1Case c(dt, 300, 37, 5, 3, 1);
    c.scale = 0.9;
    c.source_pad = 3;
    SCOPED_TRACE(c.Describe());
    Phase1Abi abi(c);
    const auto ref_b = attnres::ref::Phase1Backward(abi.ref, abi.grad_outs, abi.grad_lses);

    Phase2Case c2(dt, 300, 37, 1);
    c2.input_norm = c2.norm_weight = true;
    c2.grad_source_pad = 2;
    Phase2Abi abi2(c2);
    const auto ref_b2 = attnres::ref::Phase2Backward(abi2.ref, abi2.grad);
    const Tolerance tol = ToleranceFor(dt);

    ForEachIsa([&](const std::string&) {
      attnres_set_num_threads(1);
      const auto f1 = abi.RunForward();
      const auto b1 = abi.RunBackward();
      const auto q1 = abi2.RunBackward();
      ASSERT_EQ(b1.status, ATTNRES_OK) << b1.error;
      ASSERT_EQ(q1.status, ATTNRES_OK) << q1.error;
      EXPECT_TRUE(Close("dw", b1.grad_w, ref_b.grad_w, tol.grad));
      EXPECT_TRUE(Close("dgamma", b1.grad_gamma, ref_b.grad_gamma, tol.grad));
      EXPECT_TRUE(Close("phase 2 dw", q1.grad_w, ref_b2.grad_w, tol.grad));
      EXPECT_TRUE(Close("phase 2 dnorm_weight", q1.grad_norm_weight, ref_b2.grad_norm_weight, tol.grad));
      for (int threads : {2, 1, 2}) {
        SCOPED_TRACE("threads=" + std::to_string(threads));
        attnres_set_num_threads(threads);
        ASSERT_EQ(attnres_get_num_threads(), threads);
        const auto f = abi.RunForward();
        const auto b = abi.RunBackward();
        const auto q = abi2.RunBackward();
        ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
        ASSERT_EQ(q.status, ATTNRES_OK) << q.error;
        EXPECT_TRUE(BitwiseEqual(b.grad_w, b1.grad_w)) << "phase 1 dw differs";
        EXPECT_TRUE(BitwiseEqual(b.grad_gamma, b1.grad_gamma)) << "phase 1 dgamma differs";
        for (int64_t i = 0; i < c.blocks; ++i) {
          EXPECT_TRUE(BitwiseEqual(b.grad_blocks[i], b1.grad_blocks[i])) << "dv_" << i << " differs";
        }
        for (int64_t s = 0; s < c.queries; ++s) {
          EXPECT_TRUE(BitwiseEqual(f.outs[s], f1.outs[s])) << "o_" << s << " differs";
          EXPECT_TRUE(BitwiseEqual(f.lses[s], f1.lses[s])) << "lse_" << s << " differs";
        }
        EXPECT_TRUE(BitwiseEqual(q.grad_w, q1.grad_w)) << "phase 2 dw differs";
        EXPECT_TRUE(BitwiseEqual(q.grad_gamma, q1.grad_gamma)) << "phase 2 dgamma differs";
        EXPECT_TRUE(BitwiseEqual(q.grad_norm_weight, q1.grad_norm_weight)) << "phase 2 dnorm_weight differs";
        EXPECT_TRUE(BitwiseEqual(q.grad_partial, q1.grad_partial)) << "phase 2 dp differs";
      }
    });
  }
}

// ---------------------------------------------------------------------------
// Validation: every rule of the header for the four calls.

constexpr int64_t kT = 5, kD = 13, kN = 3, kS = 2;
using Floats = std::vector<float>;
constexpr uint8_t kSentinel = 0xA5;

class TwoPhaseValidation : public ::testing::Test {
 protected:
  TwoPhaseValidation() {
    std::mt19937_64 rng(5);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto random = [&](size_t n, float s, float offset) {
      Floats v(n);
      for (float& x : v) x = offset + s * normal(rng);
      return v;
    };
    for (int64_t i = 0; i < kN; ++i) blocks_.push_back(random(kT * kD, 1, 0));
    w_ = random(kS * kD, 0.3f, 0);
    gamma_ = random(kS * kD, 0.1f, 1);
    for (int64_t s = 0; s < kS; ++s) {
      gouts_.push_back(random(kT * kD, 1, 0));
      glses_.push_back(random(kT, 1, 0));
    }
    o_ = random(kT * kD, 1, 0);
    lse_ = random(kT, 1, 0);
    partial_ = random(kT * kD, 1, 0);
    w2_ = random(kD, 0.3f, 0);
    gamma2_ = random(kD, 0.1f, 1);
    nw_ = random(kD, 0.1f, 1);
    g2_ = random(kT * kD, 1, 0);
    update_ = random(kT * kD, 1, 0);
    gin_ = random(kT * kD, 1, 0);
    arena_ = random(kT * kD * 4, 1, 0);

    outs_.assign(kS, Floats(kT * kD));
    lses_.assign(kS, Floats(kT));
    gblocks_.assign(kN, Floats(kT * kD));
    gw_.resize(kS * kD);
    ggamma_.resize(kS * kD);
    out2_.resize(kT * kD);
    gq_.resize(kT * kD);
    glse_.resize(kT);
    gp_.resize(kT * kD);
    gw2_.resize(kD);
    gg2_.resize(kD);
    gnw_.resize(kD);
    new_partial_.resize(kT * kD);
    ResetOutputs();
    inputs_snapshot_ = Inputs();

    for (auto& b : blocks_) block_ptrs_.push_back(b.data());
    for (auto& o : outs_) out_ptrs_.push_back(o.data());
    for (auto& l : lses_) lse_ptrs_.push_back(l.data());
    for (auto& g : gouts_) gout_ptrs_.push_back(g.data());
    for (auto& g : glses_) glse_ptrs_.push_back(g.data());
    for (auto& g : gblocks_) gblock_ptrs_.push_back(g.data());
  }

  std::vector<Floats*> OutputVectors() {
    std::vector<Floats*> v;
    for (auto& o : outs_) v.push_back(&o);
    for (auto& l : lses_) v.push_back(&l);
    for (auto& g : gblocks_) v.push_back(&g);
    for (Floats* f : {&gw_, &ggamma_, &out2_, &gq_, &glse_, &gp_, &gw2_, &gg2_, &gnw_, &new_partial_}) {
      v.push_back(f);
    }
    return v;
  }
  void ResetOutputs() {
    for (Floats* f : OutputVectors()) std::memset(f->data(), kSentinel, f->size() * sizeof(float));
  }
  // "" when every output still holds the sentinel, else the first one written.
  std::string WrittenOutput() {
    const char* names[] = {"query_outs", "query_lses", "grad_blocks", "grad_proj_weight",
                           "grad_gamma", "out", "grad_query_out", "grad_query_lse",
                           "grad_partial", "phase 2 grad_proj_weight", "phase 2 grad_gamma",
                           "grad_norm_weight", "new_partial"};
    (void)names;
    int k = 0;
    for (Floats* f : OutputVectors()) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(f->data());
      for (size_t b = 0; b < f->size() * sizeof(float); ++b) {
        if (bytes[b] != kSentinel) return "output vector #" + std::to_string(k);
      }
      ++k;
    }
    return "";
  }
  std::vector<Floats> Inputs() const {
    std::vector<Floats> all = blocks_;
    for (const Floats* f : {&w_, &gamma_, &o_, &lse_, &partial_, &w2_, &gamma2_, &nw_, &g2_, &arena_,
                            &update_, &gin_}) {
      all.push_back(*f);
    }
    for (const auto& g : gouts_) all.push_back(g);
    for (const auto& g : glses_) all.push_back(g);
    return all;
  }

  attnres_params Phase1Inputs() const {
    attnres_params p;
    attnres_params_init(&p);
    p.num_tokens = kT;
    p.dim = kD;
    p.num_blocks = kN;
    p.dtype = ATTNRES_DTYPE_FLOAT32;
    p.blocks = block_ptrs_.data();
    p.source_row_stride = kD;
    p.proj_weight = w_.data();
    p.gamma = gamma_.data();
    p.scale = 0.5;
    p.num_queries = kS;
    return p;
  }
  attnres_params P1Forward() {
    attnres_params p = Phase1Inputs();
    p.query_outs = out_ptrs_.data();
    p.query_lses = lse_ptrs_.data();
    p.out_row_stride = kD;
    return p;
  }
  attnres_params P1Backward() {
    attnres_params p = Phase1Inputs();
    p.grad_query_outs = gout_ptrs_.data();
    p.grad_query_lses = glse_ptrs_.data();
    p.grad_out_row_stride = kD;
    p.grad_blocks = gblock_ptrs_.data();
    p.grad_source_row_stride = kD;
    p.grad_proj_weight = gw_.data();
    p.grad_gamma = ggamma_.data();
    return p;
  }
  attnres_params Phase2Inputs() const {
    attnres_params p;
    attnres_params_init(&p);
    p.num_tokens = kT;
    p.dim = kD;
    p.num_blocks = 0;
    p.dtype = ATTNRES_DTYPE_FLOAT32;
    p.query_out = o_.data();
    p.query_lse = lse_.data();
    p.partial = partial_.data();
    p.source_row_stride = kD;
    p.proj_weight = w2_.data();
    p.gamma = gamma2_.data();
    p.scale = 0.5;
    p.input_norm = 1;
    p.norm_weight = nw_.data();
    return p;
  }
  attnres_params P2Forward() {
    attnres_params p = Phase2Inputs();
    p.out = out2_.data();
    p.out_row_stride = kD;
    return p;
  }
  attnres_params P2FusedForward() {
    attnres_params p = P2Forward();
    p.partial_update = update_.data();
    p.new_partial = new_partial_.data();
    return p;
  }
  attnres_params P2Backward() {
    attnres_params p = Phase2Inputs();
    p.grad_out = g2_.data();
    p.grad_out_row_stride = kD;
    p.grad_query_out = gq_.data();
    p.grad_query_lse = glse_.data();
    p.grad_partial = gp_.data();
    p.grad_source_row_stride = kD;
    p.grad_proj_weight = gw2_.data();
    p.grad_gamma = gg2_.data();
    p.grad_norm_weight = gnw_.data();
    return p;
  }

  using Call = attnres_status (*)(const attnres_params*);
  // A broken argument: `edit` applied to a valid call's params must give `status`
  // and a message naming every word.
  struct Rule {
    const char* what;
    std::function<void(attnres_params&)> edit;
    attnres_status status;
    std::vector<std::string> words;
  };

  // The call fails with `status`, its message names every word, nothing is written.
  void ExpectRejected(const char* what, Call call, const attnres_params* p, attnres_status status,
                      const std::vector<std::string>& words) {
    SCOPED_TRACE(what);
    CountCheck(3 + words.size());
    ResetOutputs();
    const attnres_status got = call(p);
    EXPECT_EQ(got, status) << "status " << attnres_status_string(got) << ": " << attnres_last_error();
    const std::string message = attnres_last_error();
    for (const std::string& w : words) {
      EXPECT_NE(message.find(w), std::string::npos) << "message does not name '" << w << "': " << message;
    }
    EXPECT_EQ(WrittenOutput(), "") << "an output was written by a rejected call";
    EXPECT_TRUE(Inputs() == inputs_snapshot_) << "an input was modified by a rejected call";
  }

  void ExpectRules(Call call, const attnres_params& valid, const std::vector<Rule>& rules) {
    for (const Rule& r : rules) {
      attnres_params p = valid;
      r.edit(p);
      ExpectRejected(r.what, call, &p, r.status, r.words);
    }
  }

  std::vector<Floats> blocks_;
  Floats w_, gamma_;
  std::vector<Floats> gouts_, glses_;
  Floats o_, lse_, partial_, w2_, gamma2_, nw_, g2_, update_, gin_;
  Floats arena_;  // inputs that overlapping outputs point into (writes stay in bounds)
  std::vector<Floats> outs_, lses_, gblocks_;
  Floats gw_, ggamma_, out2_, gq_, glse_, gp_, gw2_, gg2_, gnw_, new_partial_;
  std::vector<Floats> inputs_snapshot_;
  std::vector<const void*> block_ptrs_, gout_ptrs_, glse_ptrs_;
  std::vector<void*> out_ptrs_, lse_ptrs_, gblock_ptrs_;
};

TEST_F(TwoPhaseValidation, ValidCallsSucceed) {
  for (auto [call, p] : std::vector<std::pair<Call, attnres_params>>{
           {attnres_phase1_forward, P1Forward()}, {attnres_phase1_backward, P1Backward()},
           {attnres_phase2_forward, P2Forward()}, {attnres_phase2_backward, P2Backward()}}) {
    EXPECT_EQ(call(&p), ATTNRES_OK) << attnres_last_error();
  }
  // Inputs may share memory: the same block twice, o and p the same tensor.
  attnres_params p = P1Forward();
  std::vector<const void*> same = {blocks_[0].data(), blocks_[0].data(), blocks_[1].data()};
  p.blocks = same.data();
  EXPECT_EQ(attnres_phase1_forward(&p), ATTNRES_OK) << attnres_last_error();
  attnres_params q = P2Forward();
  q.partial = q.query_out;
  EXPECT_EQ(attnres_phase2_forward(&q), ATTNRES_OK) << attnres_last_error();
  // Phase 2 without a partial block needs no lse.
  q = P2Forward();
  q.partial = nullptr;
  q.query_lse = nullptr;
  EXPECT_EQ(attnres_phase2_forward(&q), ATTNRES_OK) << attnres_last_error();
}

// Rules every call shares: params, abi_version, dtype, device, sizes, scalars.
TEST_F(TwoPhaseValidation, CommonRules) {
  const std::pair<const char*, Call> calls[] = {
      {"phase1_forward", attnres_phase1_forward}, {"phase1_backward", attnres_phase1_backward},
      {"phase2_forward", attnres_phase2_forward}, {"phase2_backward", attnres_phase2_backward}};
  const attnres_params valid[] = {P1Forward(), P1Backward(), P2Forward(), P2Backward()};
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(calls[k].first);
    const Call call = calls[k].second;
    ExpectRejected("params NULL", call, nullptr, ATTNRES_ERROR_NULL_POINTER, {"params"});
    ExpectRules(call, valid[k], {
        {"abi_version", [](attnres_params& p) { p.abi_version = 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"abi_version"}},
        {"dtype", [](attnres_params& p) { p.dtype = 7; }, ATTNRES_ERROR_UNSUPPORTED_DTYPE, {"dtype", "7"}},
        {"dtype -1", [](attnres_params& p) { p.dtype = -1; }, ATTNRES_ERROR_UNSUPPORTED_DTYPE, {"dtype"}},
        {"device", [](attnres_params& p) { p.device = 9; }, ATTNRES_ERROR_UNSUPPORTED_DEVICE, {"device"}},
        {"num_tokens", [](attnres_params& p) { p.num_tokens = -1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"num_tokens", "-1"}},
        {"dim", [](attnres_params& p) { p.dim = 0; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"dim"}},
        {"rmsnorm", [](attnres_params& p) { p.rmsnorm = 2; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"rmsnorm"}},
        {"scale inf", [](attnres_params& p) { p.scale = INFINITY; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"scale"}},
        {"scale nan", [](attnres_params& p) { p.scale = NAN; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"scale"}},
        {"eps < 0", [](attnres_params& p) { p.eps = -1e-3; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"eps"}},
        {"eps nan", [](attnres_params& p) { p.eps = NAN; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"eps"}},
        {"source_row_stride", [](attnres_params& p) { p.source_row_stride = kD - 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"source_row_stride", "12"}},
        {"proj_weight NULL", [](attnres_params& p) { p.proj_weight = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"proj_weight"}},
    });
    if (!attnres_cuda_available()) {
      attnres_params p = valid[k];
      p.device = ATTNRES_DEVICE_CUDA;
      ExpectRejected("device CUDA without CUDA", call, &p, ATTNRES_ERROR_UNSUPPORTED_DEVICE, {"CUDA"});
    }
  }
}

TEST_F(TwoPhaseValidation, Phase1Rules) {
  const std::pair<const char*, Call> calls[] = {{"phase1_forward", attnres_phase1_forward},
                                                {"phase1_backward", attnres_phase1_backward}};
  const attnres_params valid[] = {P1Forward(), P1Backward()};
  std::vector<const void*> with_null = {blocks_[0].data(), blocks_[1].data(), nullptr};
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE(calls[k].first);
    const Call call = calls[k].second;
    ExpectRules(call, valid[k], {
        {"num_blocks 0", [&](attnres_params& p) { p.num_blocks = 0; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"num_blocks"}},
        {"partial in phase 1", [&](attnres_params& p) { p.partial = partial_.data(); }, ATTNRES_ERROR_INVALID_ARGUMENT, {"partial"}},
        {"num_queries 0", [&](attnres_params& p) { p.num_queries = 0; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"num_queries", "0"}},
        {"num_queries < 0", [&](attnres_params& p) { p.num_queries = -3; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"num_queries", "-3"}},
        {"blocks NULL", [&](attnres_params& p) { p.blocks = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"blocks"}},
        {"blocks[2] NULL", [&](attnres_params& p) { p.blocks = with_null.data(); }, ATTNRES_ERROR_NULL_POINTER, {"blocks[2]"}},
    });
  }

  std::vector<void*> outs_null = {outs_[0].data(), nullptr};
  std::vector<void*> lses_null = {nullptr, lses_[1].data()};
  std::vector<void*> same_out = {outs_[0].data(), outs_[0].data()};
  std::vector<const void*> blocks_in_arena = {arena_.data(), blocks_[1].data(), blocks_[2].data()};
  std::vector<void*> out_on_block = {arena_.data() + 7, outs_[1].data()};
  std::vector<void*> lse_in_out = {outs_[1].data() + 3, lses_[1].data()};
  std::vector<void*> lse_in_w = {lses_[0].data(), arena_.data() + 1};
  // Forward only.
  ExpectRules(attnres_phase1_forward, P1Forward(), {
      {"query_outs NULL", [&](attnres_params& p) { p.query_outs = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"query_outs"}},
      {"query_lses NULL", [&](attnres_params& p) { p.query_lses = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"query_lses"}},
      {"query_outs[1] NULL", [&](attnres_params& p) { p.query_outs = outs_null.data(); }, ATTNRES_ERROR_NULL_POINTER, {"query_outs[1]"}},
      {"query_lses[0] NULL", [&](attnres_params& p) { p.query_lses = lses_null.data(); }, ATTNRES_ERROR_NULL_POINTER, {"query_lses[0]"}},
      {"out_row_stride", [&](attnres_params& p) { p.out_row_stride = kD - 2; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"out_row_stride", "11"}},
  });

  // Overlaps: outputs with each other and with inputs.
  ExpectRules(attnres_phase1_forward, P1Forward(), {
      {"query_outs[1] == query_outs[0]", [&](attnres_params& p) { p.query_outs = same_out.data(); }, ATTNRES_ERROR_OVERLAP, {"query_outs[0]", "query_outs[1]"}},
      {"query_outs[0] overlaps blocks[0]", [&](attnres_params& p) { p.blocks = blocks_in_arena.data(); p.query_outs = out_on_block.data(); }, ATTNRES_ERROR_OVERLAP, {"query_outs[0]", "blocks[0]"}},
      {"query_lses[0] inside query_outs[1]", [&](attnres_params& p) { p.query_lses = lse_in_out.data(); }, ATTNRES_ERROR_OVERLAP, {"query_lses[0]", "query_outs[1]"}},
      {"query_lses[1] inside proj_weight", [&](attnres_params& p) { p.proj_weight = arena_.data(); p.query_lses = lse_in_w.data(); }, ATTNRES_ERROR_OVERLAP, {"query_lses[1]", "proj_weight"}},
  });
}

TEST_F(TwoPhaseValidation, Phase1BackwardRules) {
  const Call call = attnres_phase1_backward;
  std::vector<void*> on_block = {gblocks_[0].data(), const_cast<float*>(blocks_[1].data()) , gblocks_[2].data()};
  std::vector<void*> twice = {gblocks_[0].data(), gblocks_[0].data() + 2, gblocks_[2].data()};
  std::vector<const void*> gout_in_arena = {arena_.data(), gouts_[1].data()};
  std::vector<void*> gb_on_gout = {gblocks_[0].data(), gblocks_[1].data(), arena_.data() + 5};
  std::vector<const void*> glse_in_arena = {arena_.data(), glses_[1].data()};
  ExpectRules(call, P1Backward(), {
      {"grad_query_outs NULL", [&](attnres_params& p) { p.grad_query_outs = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"grad_query_outs"}},
      {"accumulate_grads", [&](attnres_params& p) { p.accumulate_grads = 2; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"accumulate_grads", "2"}},
      {"grad_gamma without rmsnorm", [&](attnres_params& p) { p.rmsnorm = 0; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_gamma"}},
      {"grad_out_row_stride", [&](attnres_params& p) { p.grad_out_row_stride = kD - 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_out_row_stride", "12"}},
      {"grad_source_row_stride", [&](attnres_params& p) { p.grad_source_row_stride = 3; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_source_row_stride", "3"}},
  });

  // Overlaps.
  ExpectRules(call, P1Backward(), {
      {"grad_blocks[1] == blocks[1]", [&](attnres_params& p) { p.grad_blocks = on_block.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_blocks[1]", "blocks[1]"}},
      {"grad_blocks[1] overlaps grad_blocks[0]", [&](attnres_params& p) { p.grad_blocks = twice.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_blocks[0]", "grad_blocks[1]"}},
      {"grad_gamma overlaps grad_proj_weight", [&](attnres_params& p) { p.grad_gamma = gw_.data() + 1; }, ATTNRES_ERROR_OVERLAP, {"grad_gamma", "grad_proj_weight"}},
      {"grad_blocks[2] overlaps grad_query_outs[0]", [&](attnres_params& p) { p.grad_query_outs = gout_in_arena.data(); p.grad_blocks = gb_on_gout.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_blocks[2]", "grad_query_outs[0]"}},
      {"grad_proj_weight overlaps grad_query_lses[0]", [&](attnres_params& p) { p.grad_query_lses = glse_in_arena.data(); p.grad_proj_weight = arena_.data() + 1; }, ATTNRES_ERROR_OVERLAP, {"grad_proj_weight", "grad_query_lses[0]"}},
      {"grad_gamma overlaps gamma", [&](attnres_params& p) { p.gamma = arena_.data(); p.grad_gamma = arena_.data() + kD; }, ATTNRES_ERROR_OVERLAP, {"grad_gamma", "gamma"}},
  });
}

TEST_F(TwoPhaseValidation, Phase2Rules) {
  const std::pair<const char*, Call> calls[] = {{"phase2_forward", attnres_phase2_forward},
                                                {"phase2_backward", attnres_phase2_backward}};
  const attnres_params valid[] = {P2Forward(), P2Backward()};
  std::vector<const void*> some_blocks = {blocks_[0].data()};
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE(calls[k].first);
    const Call call = calls[k].second;
    ExpectRules(call, valid[k], {
        {"num_blocks != 0", [&](attnres_params& p) { p.num_blocks = 1; p.blocks = some_blocks.data(); }, ATTNRES_ERROR_INVALID_ARGUMENT, {"num_blocks"}},
        {"query_out NULL", [&](attnres_params& p) { p.query_out = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"query_out"}},
        {"query_lse NULL with partial", [&](attnres_params& p) { p.query_lse = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"query_lse"}},
        {"input_norm 2", [&](attnres_params& p) { p.input_norm = 2; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"input_norm", "2"}},
        {"norm_eps < 0", [&](attnres_params& p) { p.norm_eps = -1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"norm_eps"}},
        {"norm_eps inf", [&](attnres_params& p) { p.norm_eps = INFINITY; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"norm_eps"}},
        {"norm_eps nan", [&](attnres_params& p) { p.norm_eps = NAN; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"norm_eps"}},
        {"norm_weight without input_norm", [&](attnres_params& p) { p.input_norm = 0; p.grad_norm_weight = nullptr; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"norm_weight"}},
        {"source_row_stride", [&](attnres_params& p) { p.source_row_stride = kD - 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"source_row_stride"}},
    });
  }

  // Forward only.
  ExpectRules(attnres_phase2_forward, P2Forward(), {
      {"out NULL", [&](attnres_params& p) { p.out = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"out"}},
      {"out_row_stride", [&](attnres_params& p) { p.out_row_stride = 4; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"out_row_stride", "4"}},
      {"out overlaps partial", [&](attnres_params& p) { p.partial = arena_.data(); p.out = arena_.data() + kD; }, ATTNRES_ERROR_OVERLAP, {"out", "partial"}},
      {"out == query_out", [&](attnres_params& p) { p.query_out = arena_.data(); p.out = arena_.data(); }, ATTNRES_ERROR_OVERLAP, {"out", "query_out"}},
      {"out overlaps norm_weight", [&](attnres_params& p) { p.norm_weight = arena_.data() + 3; p.out = arena_.data(); }, ATTNRES_ERROR_OVERLAP, {"out", "norm_weight"}},
      {"out overlaps query_lse", [&](attnres_params& p) { p.query_lse = arena_.data() + 2; p.out = arena_.data(); }, ATTNRES_ERROR_OVERLAP, {"out", "query_lse"}},
  });
}

TEST_F(TwoPhaseValidation, Phase2BackwardRules) {
  const Call call = attnres_phase2_backward;
  ExpectRules(call, P2Backward(), {
      {"grad_out NULL", [&](attnres_params& p) { p.grad_out = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"grad_out"}},
      {"grad_out_row_stride", [&](attnres_params& p) { p.grad_out_row_stride = kD - 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_out_row_stride"}},
      {"grad_source_row_stride", [&](attnres_params& p) { p.grad_source_row_stride = kD - 1; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_source_row_stride"}},
      {"grad_partial without partial", [&](attnres_params& p) { p.partial = nullptr; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_partial"}},
      {"grad_gamma without rmsnorm", [&](attnres_params& p) { p.rmsnorm = 0; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_gamma"}},
      {"grad_norm_weight without input_norm", [&](attnres_params& p) { p.input_norm = 0; p.norm_weight = nullptr; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_norm_weight"}},
  });

  // Overlaps.
  ExpectRules(call, P2Backward(), {
      {"grad_partial overlaps grad_query_out", [&](attnres_params& p) { p.grad_partial = gq_.data() + 1; }, ATTNRES_ERROR_OVERLAP, {"grad_partial", "grad_query_out"}},
      {"grad_partial == partial", [&](attnres_params& p) { p.partial = arena_.data(); p.grad_partial = arena_.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_partial", "partial"}},
      {"grad_query_out overlaps grad_out", [&](attnres_params& p) { p.grad_out = arena_.data(); p.grad_query_out = arena_.data() + 4; }, ATTNRES_ERROR_OVERLAP, {"grad_query_out", "grad_out"}},
      {"grad_query_lse overlaps query_lse", [&](attnres_params& p) { p.query_lse = arena_.data(); p.grad_query_lse = arena_.data() + 1; }, ATTNRES_ERROR_OVERLAP, {"grad_query_lse", "query_lse"}},
      {"grad_norm_weight == grad_proj_weight", [&](attnres_params& p) { p.grad_norm_weight = gw2_.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_norm_weight", "grad_proj_weight"}},
      {"grad_gamma overlaps norm_weight", [&](attnres_params& p) { p.norm_weight = arena_.data(); p.grad_gamma = arena_.data() + 2; }, ATTNRES_ERROR_OVERLAP, {"grad_gamma", "norm_weight"}},
      {"grad_query_lse inside grad_partial", [&](attnres_params& p) { p.grad_query_lse = gp_.data() + 3; }, ATTNRES_ERROR_OVERLAP, {"grad_query_lse", "grad_partial"}},
  });
}

// The fused partial-block update (ABI 3): what it needs, where it may not point.
TEST_F(TwoPhaseValidation, FusedUpdateRules) {
  attnres_params p = P2FusedForward();
  ResetOutputs();
  ASSERT_EQ(attnres_phase2_forward(&p), ATTNRES_OK) << attnres_last_error();
  p = P2Backward();
  p.grad_partial_in = gin_.data();
  ASSERT_EQ(attnres_phase2_backward(&p), ATTNRES_OK) << attnres_last_error();

  const Call forward = attnres_phase2_forward;
  const Floats wide_grad_out(kT * 2 * kD, 0.5f);
  ExpectRules(forward, P2FusedForward(), {
      {"partial_update without partial", [&](attnres_params& p) { p.partial = nullptr; }, ATTNRES_ERROR_INVALID_ARGUMENT, {"partial_update"}},
      {"new_partial NULL", [&](attnres_params& p) { p.new_partial = nullptr; }, ATTNRES_ERROR_NULL_POINTER, {"new_partial"}},
  });
  ExpectRules(forward, P2Forward(), {
      {"new_partial without partial_update", [&](attnres_params& p) { p.new_partial = new_partial_.data(); }, ATTNRES_ERROR_INVALID_ARGUMENT, {"new_partial", "partial_update"}},
  });
  ExpectRules(forward, P2FusedForward(), {
      {"new_partial overlaps partial", [&](attnres_params& p) { p.partial = arena_.data(); p.new_partial = arena_.data() + kD; }, ATTNRES_ERROR_OVERLAP, {"new_partial", "partial"}},
      {"new_partial == partial_update", [&](attnres_params& p) { p.partial_update = arena_.data(); p.new_partial = arena_.data(); }, ATTNRES_ERROR_OVERLAP, {"new_partial", "partial_update"}},
      {"new_partial overlaps out", [&](attnres_params& p) { p.new_partial = out2_.data() + 1; }, ATTNRES_ERROR_OVERLAP, {"new_partial", "out"}},
  });

  const Call backward = attnres_phase2_backward;
  ExpectRules(backward, P2Backward(), {
      {"partial_update in the backward", [&](attnres_params& p) { p.partial_update = update_.data(); }, ATTNRES_ERROR_INVALID_ARGUMENT, {"partial_update", "new_partial"}},
      {"grad_partial_in without grad_partial", [&](attnres_params& p) { p.grad_partial = nullptr; p.grad_partial_in = gin_.data(); }, ATTNRES_ERROR_INVALID_ARGUMENT, {"grad_partial_in"}},
      {"grad_partial_in == grad_partial", [&](attnres_params& p) { p.grad_partial_in = gp_.data(); }, ATTNRES_ERROR_OVERLAP, {"grad_partial", "grad_partial_in"}},
  });
  // grad_partial_in's rows are grad_out_row_stride apart: with 2 kD its last row reaches
  // past element 4 * 2 kD, where grad_query_out now starts.
  ExpectRules(backward, P2Backward(), {
      // grad_out's rows now span 2 kD each: its own buffer of that size, or the checks
      // would find it reaching into whatever the heap put after g2_ (on aarch64, grad_gamma).
      {"grad_partial_in's rows follow grad_out_row_stride", [&](attnres_params& p) { p.grad_out_row_stride = 2 * kD; p.grad_out = wide_grad_out.data(); p.grad_partial_in = arena_.data(); p.grad_query_out = arena_.data() + 4 * 2 * kD; }, ATTNRES_ERROR_OVERLAP, {"grad_query_out", "grad_partial_in"}},
  });
}

// The harness behind `attnres run --queries S` (src/ref/harness.h): its phase 1 case
// passes on every dtype, and its comparison notices one wrong element of an output,
// of an lse and of a block gradient (so the tool's PASS can fail).
TEST(HarnessPhase1Case, MatchesTheReferenceAndNoticesAWrongElement) {
  for (attnres_dtype dtype : {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64,
                              ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT16}) {
    attnres::harness::CaseSpec spec;
    spec.dtype = dtype;
    spec.tokens = 13;
    spec.dim = 67;
    spec.num_blocks = 5;
    spec.partial = false;
    spec.row_padding = 3;
    attnres::harness::Phase1Case one(spec, 3);
    ASSERT_EQ(one.Forward(), ATTNRES_OK) << attnres_last_error();
    ASSERT_EQ(one.Backward(), ATTNRES_OK) << attnres_last_error();
    const attnres::harness::Errors e = one.Compare();
    EXPECT_LE(e.WorstForward(), attnres::harness::ForwardTolerance(dtype)) << DTypeName(dtype);
    EXPECT_LE(e.WorstBackward(), attnres::harness::BackwardTolerance(dtype)) << DTypeName(dtype);

    const int64_t elem = attnres::harness::ElementBytes(dtype);
    const attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
    // Flip the top byte of one element: its sign bit, and part of its exponent.
    auto corrupt = [](void* base, int64_t offset_bytes, int64_t elem_bytes) {
      static_cast<unsigned char*>(base)[offset_bytes + elem_bytes - 1] ^= 0xC0;
    };
    corrupt(fwd.query_outs[2], (7 * (spec.dim + spec.row_padding) + 11) * elem, elem);
    EXPECT_GT(one.Compare().out, attnres::harness::ForwardTolerance(dtype)) << DTypeName(dtype);
    const int64_t acc = dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : 4;
    corrupt(fwd.query_lses[1], 4 * acc, acc);
    EXPECT_GT(one.Compare().lse, attnres::harness::ForwardTolerance(dtype)) << DTypeName(dtype);
    corrupt(bwd.grad_blocks[4], (12 * (spec.dim + spec.row_padding) + 66) * elem, elem);
    EXPECT_GT(one.Compare().grad_sources, attnres::harness::BackwardTolerance(dtype))
        << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace attnres_test
