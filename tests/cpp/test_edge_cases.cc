// Numerical edge cases not covered by test_isolation.cc (which holds NaN/Inf
// isolation, logits of +-1e4 and all-zero sources with eps > 0), on every backend:
//   - eps = 0: finite and exact for ordinary sources; a source row that is all
//     zero makes r = 0 and its key 0/0, so that token (and only that token) is
//     NaN, as in the seed and the float64 oracle. docs/RELIABILITY.md states it.
//   - subnormal inputs in every dtype: computed as IEEE values (never flushed
//     to zero), matching the oracle to the dtype's tolerance plus a few units
//     of its smallest subnormal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

// ---------------------------------------------------------------------------
// eps = 0.

Case EpsZeroCase(attnres_dtype dtype, bool rmsnorm) {
  Case c(dtype, 6, 21, 3, 404);
  c.rmsnorm = rmsnorm;
  c.eps = 0.0;
  c.source_pad = 2;
  return c;
}

TEST(EpsZero, OrdinarySourcesMatchTheOracle) {
  for (attnres_dtype dtype : kAllDTypes) {
    const Case c = EpsZeroCase(dtype, true);
    SCOPED_TRACE(c.Describe());
    attnres::ref::Problem p = MakeProblem(c);
    p.eps = 0.0;
    const auto grad_out = MakeGradOut(c);
    const auto ref_f = attnres::ref::Forward(p);
    const auto ref_b = attnres::ref::Backward(p, grad_out);
    ForEachBackend([&](const Backend& backend) {
      AbiProblem abi(c, p, backend.device);
      ExpectForwardClose(c, abi.Forward(true, true), ref_f, /*caches=*/true);
      ExpectBackwardClose(c, abi.Backward(grad_out, BackwardOptions()), ref_b, {});
    });
  }
}

// One zero row (token 2, source 1) with RMSNorm and eps = 0: r = 0 there, the
// key is 0/0 = NaN, and the softmax of that token is NaN. Every other token is
// bitwise what it is when that row is not zero; dw and dgamma, sums over all
// tokens, are NaN. The float64 oracle agrees (NaN in the same token).
TEST(EpsZero, ZeroSourceRowMakesOnlyItsTokenNaN) {
  constexpr int64_t kToken = 2, kSource = 1;
  for (attnres_dtype dtype : kAllDTypes) {
    const Case c = EpsZeroCase(dtype, true);
    SCOPED_TRACE(c.Describe());
    const int64_t D = c.dim, L = c.num_sources();
    attnres::ref::Problem clean_p = MakeProblem(c);
    clean_p.eps = 0.0;
    attnres::ref::Problem zero_p = clean_p;
    std::fill_n(zero_p.sources[kSource].begin() + kToken * D, D, 0.0);
    const auto grad_out = MakeGradOut(c);
    const auto ref_f = attnres::ref::Forward(zero_p);
    EXPECT_TRUE(AllNan(Row(ref_f.out, kToken, D))) << "the oracle is NaN there too";

    ForEachBackend([&](const Backend& backend) {
      AbiProblem clean(c, clean_p, backend.device), zero(c, zero_p, backend.device);
      const ForwardOutput fc = clean.Forward(true, true);
      const ForwardOutput fz = zero.Forward(true, true);
      ASSERT_EQ(fz.status, ATTNRES_OK) << fz.error;
      ASSERT_EQ(fc.status, ATTNRES_OK) << fc.error;
      EXPECT_EQ(fz.rms[kToken * L + kSource], 0.0) << "r = sqrt(0 + 0)";
      for (int64_t t = 0; t < c.tokens; ++t) {
        SCOPED_TRACE("token " + std::to_string(t));
        if (t == kToken) {
          EXPECT_TRUE(AllNan(Row(fz.out, t, D)));
          EXPECT_TRUE(AllNan(Row(fz.alpha, t, L)));
        } else {
          EXPECT_TRUE(AllFinite(Row(fz.out, t, D)));
          EXPECT_TRUE(BitwiseEqual(Row(fz.out, t, D), Row(fc.out, t, D)));
          EXPECT_TRUE(BitwiseEqual(Row(fz.alpha, t, L), Row(fc.alpha, t, L)));
        }
      }
      for (bool caches : {false, true}) {
        SCOPED_TRACE(caches ? "backward with caches" : "backward without caches");
        BackwardOptions o;
        o.use_rms_cache = o.use_alpha_cache = caches;
        const BackwardOutput bc = clean.Backward(grad_out, o);
        const BackwardOutput bz = zero.Backward(grad_out, o);
        ASSERT_EQ(bz.status, ATTNRES_OK) << bz.error;
        ASSERT_EQ(bc.status, ATTNRES_OK) << bc.error;
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t t = 0; t < c.tokens; ++t) {
            const auto row = Row(bz.grad_sources[i], t, D);
            if (t == kToken) {
              EXPECT_TRUE(AllNan(row)) << "source " << i;
            } else {
              EXPECT_TRUE(BitwiseEqual(row, Row(bc.grad_sources[i], t, D)))
                  << "source " << i << " token " << t;
            }
          }
        }
        EXPECT_TRUE(AllNan(bz.grad_w)) << "dw sums the NaN token";
        EXPECT_TRUE(AllNan(bz.grad_gamma)) << "dgamma sums the NaN token";
      }
    });
  }
}

// Without RMSNorm eps is unused: zero sources with eps = 0 are ordinary.
TEST(EpsZero, ZeroSourcesWithoutRmsnormAreFinite) {
  for (attnres_dtype dtype : kAllDTypes) {
    const Case c = EpsZeroCase(dtype, false);
    SCOPED_TRACE(c.Describe());
    attnres::ref::Problem p = MakeProblem(c);
    p.eps = 0.0;
    for (auto& s : p.sources) std::fill(s.begin(), s.end(), 0.0);
    const auto grad_out = MakeGradOut(c);
    const auto ref_b = attnres::ref::Backward(p, grad_out);
    const Tolerance tol = ToleranceFor(dtype);
    ForEachBackend([&](const Backend& backend) {
      AbiProblem abi(c, p, backend.device);
      const ForwardOutput f = abi.Forward(false, true);
      ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
      EXPECT_TRUE(Close("out", f.out, std::vector<double>(f.out.size(), 0.0), 0));
      EXPECT_TRUE(Close("alpha", f.alpha,
                        std::vector<double>(f.alpha.size(), 1.0 / c.num_sources()), tol.cache));
      const BackwardOutput b = abi.Backward(grad_out, BackwardOptions());
      ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
      for (int64_t i = 0; i < c.num_sources(); ++i) {
        EXPECT_TRUE(Close("grad_source", b.grad_sources[i], ref_b.grad_sources[i], tol.grad));
      }
      EXPECT_TRUE(AllFinite(b.grad_w));
    });
  }
}

// ---------------------------------------------------------------------------
// Subnormal inputs.

// Smallest positive subnormal of each storage dtype.
double DenormMin(attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: return std::numeric_limits<double>::denorm_min();
    case ATTNRES_DTYPE_FLOAT32: return std::numeric_limits<float>::denorm_min();
    case ATTNRES_DTYPE_BFLOAT16: return std::ldexp(1.0, -133);
    case ATTNRES_DTYPE_FLOAT16: return std::ldexp(1.0, -24);
  }
  return 0;
}

// Smallest positive normal of each storage dtype.
double NormMin(attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: return std::numeric_limits<double>::min();
    case ATTNRES_DTYPE_FLOAT32:
    case ATTNRES_DTYPE_BFLOAT16: return std::numeric_limits<float>::min();
    case ATTNRES_DTYPE_FLOAT16: return std::ldexp(1.0, -14);
  }
  return 0;
}

// |actual - expected| <= tol * max|expected| + units * denorm_min, elementwise.
::testing::AssertionResult CloseWithFloor(const std::string& what,
                                          const std::vector<double>& actual,
                                          const std::vector<double>& expected, double tol,
                                          double floor) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << what << ": size " << actual.size() << " vs "
                                         << expected.size();
  }
  double max_abs = 0;
  for (double e : expected) max_abs = std::max(max_abs, std::fabs(e));
  for (size_t k = 0; k < actual.size(); ++k) {
    const double err = std::fabs(actual[k] - expected[k]);
    if (!(err <= tol * max_abs + floor)) {
      return ::testing::AssertionFailure()
             << what << "[" << k << "] = " << actual[k] << ", expected " << expected[k]
             << " (max |expected| " << max_abs << ", floor " << floor << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Every source value is a subnormal of the dtype (or zero): magnitudes spread
// over the subnormal range, signs random. With RMSNorm and eps = 1e-6 the keys
// are tiny, the softmax is near uniform and h is a subnormal mean of the
// sources; the upstream gradient is ordinary, so source gradients are normal
// numbers and the rest of the pipeline sees subnormals only in v.
// dim 19 takes the single-vector path of every variant; 147 also whole chunks of
// four vectors, whose pairs narrow together (vcvtne2ps2bf16 on avx512bf16, which
// flushes subnormals unless the kernel routes them around it).
void CheckSubnormalSources(attnres_dtype dtype, bool rmsnorm, int64_t dim) {
  Case c(dtype, 7, dim, 3, 808);
  c.rmsnorm = rmsnorm;
  SCOPED_TRACE(c.Describe());
  attnres::ref::Problem p = MakeProblem(c);
  const double denorm = DenormMin(dtype), norm_min = NormMin(dtype);
  for (auto& s : p.sources) {
    for (double& x : s) {
      // x ~ N(0, s^2) with s in [0.5, 2]: map |x| in [0, ~4] onto [0, norm_min).
      const double m = std::min(std::fabs(x) / 4.0, 0.99) * norm_min;
      x = std::copysign(std::floor(m / denorm) * denorm, x);
      ASSERT_LT(std::fabs(x), norm_min);
    }
  }
  const auto grad_out = MakeGradOut(c);
  const auto ref_f = attnres::ref::Forward(p);
  const auto ref_b = attnres::ref::Backward(p, grad_out);
  const Tolerance tol = ToleranceFor(dtype);
  // A few roundings in the subnormal range, where the spacing is denorm_min.
  const double floor = 8 * denorm;
  double max_out = 0;
  for (double v : ref_f.out) max_out = std::max(max_out, std::fabs(v));
  ASSERT_GT(max_out, 0.05 * norm_min) << "the case should give subnormal, non-zero outputs";
  ASSERT_LT(max_out, norm_min) << "the case should give subnormal outputs";
  ForEachBackend([&](const Backend& backend) {
    AbiProblem abi(c, p, backend.device);
    const ForwardOutput f = abi.Forward(rmsnorm, true);
    ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
    EXPECT_TRUE(AllFinite(f.out));
    EXPECT_TRUE(CloseWithFloor("out", f.out, ref_f.out, tol.out, floor));
    // Not flushed to zero: outputs well inside the subnormal range survive.
    for (size_t k = 0; k < f.out.size(); ++k) {
      if (std::fabs(ref_f.out[k]) > 16 * denorm) {
        EXPECT_NE(f.out[k], 0.0) << "out[" << k << "] flushed to zero";
      }
    }
    EXPECT_TRUE(Close("alpha", f.alpha, ref_f.alpha, tol.cache));
    for (bool caches : {false, true}) {
      BackwardOptions o;
      o.use_rms_cache = rmsnorm && caches;
      o.use_alpha_cache = caches;
      const BackwardOutput b = abi.Backward(grad_out, o);
      ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
      for (int64_t i = 0; i < c.num_sources(); ++i) {
        EXPECT_TRUE(AllFinite(b.grad_sources[i]));
        EXPECT_TRUE(Close("grad_source[" + std::to_string(i) + "]", b.grad_sources[i],
                          ref_b.grad_sources[i], tol.grad));
      }
      EXPECT_TRUE(AllFinite(b.grad_w));
      EXPECT_TRUE(CloseWithFloor("grad_w", b.grad_w, ref_b.grad_w, tol.grad, floor));
      if (rmsnorm) {
        EXPECT_TRUE(AllFinite(b.grad_gamma));
        EXPECT_TRUE(CloseWithFloor("grad_gamma", b.grad_gamma, ref_b.grad_gamma, tol.grad, floor));
      }
    }
  });
}

TEST(Subnormal, SourcesRmsnorm) {
  for (attnres_dtype dtype : kAllDTypes) {
    for (int64_t dim : {19, 147}) CheckSubnormalSources(dtype, true, dim);
  }
}

TEST(Subnormal, SourcesNoRmsnorm) {
  for (attnres_dtype dtype : kAllDTypes) {
    for (int64_t dim : {19, 147}) CheckSubnormalSources(dtype, false, dim);
  }
}

}  // namespace
}  // namespace attnres_test
