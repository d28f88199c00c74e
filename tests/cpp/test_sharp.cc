// Sharp depth attention (SPEC §3): the shared SharpFamily (test_util.h) through
// every path of the C ABI, each against the float64 single op on the same sources
// with every output measured against its own max-abs, so that a gradient scaled by
// a weight of 1e-13 is held to the same relative accuracy as the others:
//   - the single op, on every backend (each CPU variant; CUDA with a device);
//   - phase 1 then phase 2 as the stream composes them (two queries over the same
//     blocks and partial block), on every CPU variant: h, every block's gradient
//     summed over the queries, the partial block's, and dw/dgamma as the sum of
//     both phases' shares;
//   - the float64 two-phase reference itself, which must compose to the single op
//     to 1e-12 in every regime (it is the oracle of the CUDA emulation).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "ref/two_phase_reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

using Vec = std::vector<double>;
using Vecs = std::vector<Vec>;

constexpr int kQueries = 2;  // query 1 is query 0 at half the size (a gap half as large)

// The configurations every sharp case runs in: RMSNorm with and without gamma, and
// none (keys are the raw sources, so the partial block's size moves its logit).
struct Keys {
  bool rmsnorm, gamma;
};
constexpr Keys kKeys[] = {{true, true}, {true, false}, {false, false}};

Case SharpCase(attnres_dtype dtype, Keys keys, bool has_partial, uint64_t seed) {
  Case c;
  c.dtype = dtype;
  c.tokens = 12;
  c.dim = 33;
  c.num_blocks = 3;
  c.has_partial = has_partial;
  c.rmsnorm = keys.rmsnorm;
  c.has_gamma = keys.gamma;
  c.scale = 0.9;
  c.seed = seed;
  return c;
}

// Every dtype x key configuration x member of the family, with a distinct seed.
template <typename Body>
void ForEachSharpCase(bool has_partial, Body body) {
  uint64_t seed = 1;
  for (attnres_dtype dt : kAllDTypes) {
    for (Keys keys : kKeys) {
      for (const SharpLogits& sharp : SharpFamily(dt, has_partial)) {
        const Case c = SharpCase(dt, keys, has_partial, seed++);
        SCOPED_TRACE(c.Describe() + " " + sharp.Describe());
        body(c, sharp);
      }
    }
  }
}

TEST(Sharp, SingleOpMatchesTheReference) {
  for (bool has_partial : {true, false}) {
    ForEachSharpCase(has_partial, [](const Case& c, const SharpLogits& sharp) {
      const attnres::ref::Problem problem = MakeSharpProblem(c, sharp);
      const Vec grad_out = MakeGradOut(c);
      const auto ref_f = attnres::ref::Forward(problem);
      const auto ref_b = attnres::ref::Backward(problem, grad_out);
      ForEachBackend([&](const Backend& backend) {
        AbiProblem abi(c, problem, backend.device);
        ExpectForwardClose(c, abi.Forward(c.rmsnorm, true), ref_f, /*caches=*/true);
        ExpectBackwardClose(c, abi.Backward(grad_out, BackwardOptions{}), ref_b, BackwardOptions{});
      });
    });
  }
}

// ---------------------------------------------------------------------------
// The two phases composed.

// A dense [count] tensor of `dtype` holding v (rounded to it), or sentinel bytes.
Buffer DenseBuffer(attnres_dtype dtype, size_t count, const Vec& v = {}) {
  EXPECT_TRUE(v.empty() || v.size() == count);
  return v.empty() ? Buffer(dtype, count, kOutputSentinel) : InputBuffer(dtype, v);
}

Vec Slice(const Vec& v, size_t begin, size_t count) {
  return Vec(v.begin() + begin, v.begin() + begin + count);
}

// What the two phases give for kQueries queries over one problem's blocks and its
// partial block: every query's h, and the gradients of sum_s <g_s, h_s>.
struct Composed {
  Vecs h;                  // kQueries x [T * D]
  Vecs grad_blocks;        // N, summed over the queries
  Vec grad_partial;        // summed over the queries
  Vec grad_w, grad_gamma;  // [kQueries * D], totals
  // The two-phase runs only: each phase's share of the totals, and what passes
  // between the phases (o_s and lse_s forward, do_s and dlse_s backward).
  Vec grad_w_share[2], grad_gamma_share[2];
  Vecs o, lse, grad_o, grad_lse;

  void AddShares() {
    for (size_t k = 0; k < grad_w_share[0].size(); ++k) {
      grad_w.push_back(grad_w_share[0][k] + grad_w_share[1][k]);
      grad_gamma.push_back(grad_gamma_share[0][k] + grad_gamma_share[1][k]);
    }
  }
};

// Query s's rows of an [S, D] tensor, or zeros when it is empty.
void Append(Vec* to, const Vec& v, size_t count) {
  if (v.empty()) {
    to->insert(to->end(), count, 0.0);
  } else {
    to->insert(to->end(), v.begin(), v.end());
  }
}

Composed RunTwoPhases(const Case& c, const attnres::ref::Problem& problem, const Vecs& w,
                      const Vecs& grad) {
  const attnres_dtype dt = c.dtype, acc = CacheDType(dt);
  const int64_t T = c.tokens, D = c.dim, N = c.num_blocks;
  const size_t rows = static_cast<size_t>(T * D);
  std::vector<Buffer> blocks, outs, lses, grad_outs, grad_lses, grad_blocks;
  std::vector<const void*> block_ptrs, grad_out_ptrs, grad_lse_ptrs;
  std::vector<void*> out_ptrs, lse_ptrs, grad_block_ptrs;
  for (int64_t i = 0; i < N; ++i) blocks.push_back(DenseBuffer(dt, rows, problem.sources[i]));
  for (int64_t i = 0; i < N; ++i) grad_blocks.push_back(DenseBuffer(dt, rows));
  for (int s = 0; s < kQueries; ++s) {
    outs.push_back(DenseBuffer(dt, rows));
    lses.push_back(DenseBuffer(acc, T));
  }
  for (auto& b : blocks) block_ptrs.push_back(b.data());
  for (auto& b : grad_blocks) grad_block_ptrs.push_back(b.data());
  for (auto& b : outs) out_ptrs.push_back(b.data());
  for (auto& b : lses) lse_ptrs.push_back(b.data());
  Vec all_w, all_gamma;
  for (int s = 0; s < kQueries; ++s) {
    Append(&all_w, w[s], D);
    Append(&all_gamma, problem.gamma, D);
  }
  Buffer w_all = DenseBuffer(dt, kQueries * D, all_w);
  Buffer gamma_all = DenseBuffer(dt, kQueries * D, all_gamma);
  Buffer partial = DenseBuffer(dt, rows, problem.sources[N]);

  attnres_params common;
  attnres_params_init(&common);
  common.num_tokens = T;
  common.dim = D;
  common.dtype = dt;
  common.source_row_stride = common.out_row_stride = D;
  common.grad_out_row_stride = common.grad_source_row_stride = D;
  common.scale = c.scale;
  common.eps = c.eps;
  common.rmsnorm = c.rmsnorm ? 1 : 0;

  attnres_params p1 = common;
  p1.num_blocks = N;
  p1.blocks = block_ptrs.data();
  p1.num_queries = kQueries;
  p1.proj_weight = w_all.data();
  p1.gamma = c.has_gamma ? gamma_all.data() : nullptr;
  p1.query_outs = out_ptrs.data();
  p1.query_lses = lse_ptrs.data();
  EXPECT_EQ(attnres_phase1_forward(&p1), ATTNRES_OK) << attnres_last_error();

  Composed r;
  r.grad_partial.assign(rows, 0);
  for (int s = 0; s < kQueries; ++s) {
    Buffer w_s = DenseBuffer(dt, D, w[s]), gamma_s = DenseBuffer(dt, D, problem.gamma);
    Buffer h = DenseBuffer(dt, rows), g = DenseBuffer(dt, rows, grad[s]);
    Buffer grad_o = DenseBuffer(dt, rows), grad_lse = DenseBuffer(acc, T);
    Buffer grad_p = DenseBuffer(dt, rows), grad_w = DenseBuffer(dt, D), grad_gamma = DenseBuffer(dt, D);
    attnres_params p2 = common;
    p2.query_out = outs[s].data();
    p2.query_lse = lses[s].data();
    p2.partial = partial.data();
    p2.proj_weight = w_s.data();
    p2.gamma = c.has_gamma ? gamma_s.data() : nullptr;
    p2.out = h.data();
    EXPECT_EQ(attnres_phase2_forward(&p2), ATTNRES_OK) << attnres_last_error();
    r.h.push_back(Values(h));
    p2.out = nullptr;
    p2.grad_out = g.data();
    p2.grad_query_out = grad_o.data();
    p2.grad_query_lse = grad_lse.data();
    p2.grad_partial = grad_p.data();
    p2.grad_proj_weight = grad_w.data();
    p2.grad_gamma = c.rmsnorm ? grad_gamma.data() : nullptr;
    EXPECT_EQ(attnres_phase2_backward(&p2), ATTNRES_OK) << attnres_last_error();
    const Vec dp = Values(grad_p);
    for (size_t k = 0; k < rows; ++k) r.grad_partial[k] += dp[k];
    Append(&r.grad_w_share[1], Values(grad_w), D);
    Append(&r.grad_gamma_share[1], c.rmsnorm ? Values(grad_gamma) : Vec(), D);
    grad_outs.push_back(std::move(grad_o));
    grad_lses.push_back(std::move(grad_lse));
  }
  for (int s = 0; s < kQueries; ++s) {
    r.o.push_back(Values(outs[s]));
    r.lse.push_back(Values(lses[s]));
    r.grad_o.push_back(Values(grad_outs[s]));
    r.grad_lse.push_back(Values(grad_lses[s]));
  }
  for (auto& b : grad_outs) grad_out_ptrs.push_back(b.data());
  for (auto& b : grad_lses) grad_lse_ptrs.push_back(b.data());
  Buffer grad_w = DenseBuffer(dt, kQueries * D), grad_gamma = DenseBuffer(dt, kQueries * D);
  p1.query_outs = nullptr;
  p1.query_lses = nullptr;
  p1.grad_query_outs = grad_out_ptrs.data();
  p1.grad_query_lses = grad_lse_ptrs.data();
  p1.grad_blocks = grad_block_ptrs.data();
  p1.grad_proj_weight = grad_w.data();
  p1.grad_gamma = c.rmsnorm ? grad_gamma.data() : nullptr;
  EXPECT_EQ(attnres_phase1_backward(&p1), ATTNRES_OK) << attnres_last_error();
  for (auto& b : grad_blocks) r.grad_blocks.push_back(Values(b));
  r.grad_w_share[0] = Values(grad_w);
  r.grad_gamma_share[0] = c.rmsnorm ? Values(grad_gamma) : Vec(kQueries * D, 0.0);
  r.AddShares();
  return r;
}

// The same through the float64 references of the two phases; given `fed`, each
// phase reads what passed between the phases there instead of its own.
Composed ReferenceTwoPhases(const Case& c, const attnres::ref::Problem& problem, const Vecs& w,
                            const Vecs& grad, const Composed* fed = nullptr) {
  const int64_t T = c.tokens, D = c.dim, N = c.num_blocks;
  attnres::ref::Phase1Problem p1;
  p1.tokens = T;
  p1.dim = D;
  p1.num_queries = kQueries;
  p1.rmsnorm = c.rmsnorm;
  p1.scale = c.scale;
  p1.eps = c.eps;
  p1.blocks.assign(problem.sources.begin(), problem.sources.begin() + N);
  for (int s = 0; s < kQueries; ++s) {
    Append(&p1.w, w[s], D);
    if (!problem.gamma.empty()) Append(&p1.gamma, problem.gamma, D);
  }
  const auto f1 = attnres::ref::Phase1Forward(p1);
  Composed r;
  r.grad_partial.assign(T * D, 0.0);
  Vecs grad_outs, grad_lses;
  for (int s = 0; s < kQueries; ++s) {
    attnres::ref::Phase2Problem p2;
    p2.tokens = T;
    p2.dim = D;
    p2.rmsnorm = c.rmsnorm;
    p2.scale = c.scale;
    p2.eps = c.eps;
    p2.out = fed != nullptr ? fed->o[s] : f1.outs[s];
    p2.lse = fed != nullptr ? fed->lse[s] : f1.lses[s];
    p2.partial = problem.sources[N];
    p2.w = w[s];
    p2.gamma = problem.gamma;
    r.h.push_back(attnres::ref::Phase2Forward(p2));
    const auto b2 = attnres::ref::Phase2Backward(p2, grad[s]);
    for (int64_t k = 0; k < T * D; ++k) r.grad_partial[k] += b2.grad_partial[k];
    grad_outs.push_back(b2.grad_out);
    grad_lses.push_back(b2.grad_lse);
    Append(&r.grad_w_share[1], b2.grad_w, D);
    Append(&r.grad_gamma_share[1], c.rmsnorm ? b2.grad_gamma : Vec(), D);
  }
  const auto b1 = fed != nullptr ? attnres::ref::Phase1Backward(p1, fed->grad_o, fed->grad_lse)
                                 : attnres::ref::Phase1Backward(p1, grad_outs, grad_lses);
  r.grad_blocks = b1.grad_blocks;
  r.grad_w_share[0] = b1.grad_w;
  r.grad_gamma_share[0] = c.rmsnorm ? b1.grad_gamma : Vec(kQueries * D, 0.0);
  r.AddShares();
  return r;
}

// The float64 single op per query (its own w, the same sources): the totals
// Composed must hold.
Composed SingleOpPerQuery(const Case& c, const attnres::ref::Problem& problem, const Vecs& w,
                          const Vecs& grad) {
  const int64_t D = c.dim, N = c.num_blocks;
  Composed e;
  e.grad_blocks.assign(N, Vec(c.tokens * D, 0.0));
  e.grad_partial.assign(c.tokens * D, 0.0);
  for (int s = 0; s < kQueries; ++s) {
    attnres::ref::Problem q = problem;
    q.w = w[s];
    const auto b = attnres::ref::Backward(q, grad[s]);
    e.h.push_back(attnres::ref::Forward(q).out);
    for (int64_t i = 0; i <= N; ++i) {
      Vec& sum = i < N ? e.grad_blocks[i] : e.grad_partial;
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += b.grad_sources[i][k];
    }
    Append(&e.grad_w, b.grad_w, D);
    Append(&e.grad_gamma, c.rmsnorm ? b.grad_gamma : Vec(), D);
  }
  return e;
}

Vecs QueriesOf(const Case& c, const attnres::ref::Problem& problem) {
  Vec half(problem.w.size());
  for (size_t d = 0; d < half.size(); ++d) half[d] = RoundToDType(0.5 * problem.w[d], c.dtype);
  return {problem.w, half};
}

Vecs GradsOf(Case c) {
  Vecs g;
  for (int s = 0; s < kQueries; ++s, c.seed += 1000) g.push_back(MakeGradOut(c));
  return g;
}

// Each query's rows of dw (or dgamma) within tol of the expected ones.
void ExpectWeightGradsClose(const std::string& name, const Vec& got, const Vec& want,
                            int64_t dim, double tol) {
  for (int s = 0; s < kQueries; ++s) {
    EXPECT_TRUE(Close(name + "_" + std::to_string(s), Slice(got, s * dim, dim),
                      Slice(want, s * dim, dim), tol));
  }
}

// h and the source gradients against the single op; dw and dgamma as totals.
void ExpectComposedClose(const Case& c, const Composed& got, const Composed& want,
                         const Tolerance& tol, bool weight_totals) {
  for (int s = 0; s < kQueries; ++s) {
    EXPECT_TRUE(Close("h_" + std::to_string(s), got.h[s], want.h[s], tol.out));
  }
  for (int64_t i = 0; i < c.num_blocks; ++i) {
    EXPECT_TRUE(Close("dv_" + std::to_string(i), got.grad_blocks[i], want.grad_blocks[i], tol.grad));
  }
  EXPECT_TRUE(Close("dp", got.grad_partial, want.grad_partial, tol.grad));
  if (!weight_totals) return;
  ExpectWeightGradsClose("dw", got.grad_w, want.grad_w, c.dim, tol.grad);
  if (c.rmsnorm) ExpectWeightGradsClose("dgamma", got.grad_gamma, want.grad_gamma, c.dim, tol.grad);
}

bool Is16Bit(attnres_dtype dtype) {
  return dtype == ATTNRES_DTYPE_BFLOAT16 || dtype == ATTNRES_DTYPE_FLOAT16;
}

// The ABI's two phases against the float64 single op. In 16-bit dtypes, dw and
// dgamma are not: o_s and do_s pass between the phases rounded to the dtype (SPEC
// §5), each phase's share is rounded once more, and the shares cancel where o is
// close to p or the partial block is much larger than the blocks (phase 2's share
// and the lse term of phase 1's both scale with dot(g, o - p)): 1-2% of max-abs
// here, a property of the schedule's storage, not of the kernels. There each
// share is held to its phase's float64 reference fed the values that phase read.
TEST(Sharp, TwoPhasesComposeToTheSingleOp) {
  ForEachSharpCase(/*has_partial=*/true, [](const Case& c, const SharpLogits& sharp) {
    const attnres::ref::Problem problem = MakeSharpProblem(c, sharp);
    const Vecs w = QueriesOf(c, problem), grad = GradsOf(c);
    const Composed single = SingleOpPerQuery(c, problem, w, grad);
    const Tolerance tol = ToleranceFor(c.dtype);
    ForEachIsa([&](const std::string&) {
      const Composed got = RunTwoPhases(c, problem, w, grad);
      ExpectComposedClose(c, got, single, tol, /*weight_totals=*/!Is16Bit(c.dtype));
      if (!Is16Bit(c.dtype)) return;
      const Composed shares = ReferenceTwoPhases(c, problem, w, grad, &got);
      for (int k = 0; k < 2; ++k) {
        const std::string phase = k == 0 ? " (phase 1)" : " (phase 2)";
        ExpectWeightGradsClose("dw" + phase, got.grad_w_share[k], shares.grad_w_share[k], c.dim, tol.grad);
        if (c.rmsnorm) {
          ExpectWeightGradsClose("dgamma" + phase, got.grad_gamma_share[k], shares.grad_gamma_share[k],
                                 c.dim, tol.grad);
        }
      }
    });
  });
}

// The float64 references of the two phases (the oracle of the CUDA emulation and of
// the shares above) compose to the single op's in every regime.
TEST(Sharp, TwoPhaseReferenceComposesToTheSingleOp) {
  for (Keys keys : kKeys) {
    for (const SharpLogits& sharp : SharpFamily(ATTNRES_DTYPE_FLOAT64, true)) {
      const Case c = SharpCase(ATTNRES_DTYPE_FLOAT64, keys, true, /*seed=*/1);
      SCOPED_TRACE(c.Describe() + " " + sharp.Describe());
      const attnres::ref::Problem problem = MakeSharpProblem(c, sharp);
      const Vecs w = QueriesOf(c, problem), grad = GradsOf(c);
      ExpectComposedClose(c, ReferenceTwoPhases(c, problem, w, grad),
                          SingleOpPerQuery(c, problem, w, grad), Tolerance{1e-12, 1e-12, 1e-12},
                          /*weight_totals=*/true);
    }
  }
}

}  // namespace
}  // namespace attnres_test
