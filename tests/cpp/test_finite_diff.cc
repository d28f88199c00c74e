// The float64 backward through the C ABI against central differences of the
// float64 forward through the C ABI: loss = sum_{t,d} c[t,d] * h[t,d] for a
// random c, so dLoss/dh = c is the grad_out given to the backward. Checks the
// gradient of every source element, of w and of gamma, on every backend.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "test_util.h"

namespace attnres_test {
namespace {

constexpr double kStep = 1e-5;  // truncation ~ kStep^2, cancellation ~ 1e-16 / kStep
constexpr double kTol = 1e-6;   // relative to the max-abs of the analytic gradient

double Loss(AbiProblem* abi, const std::vector<double>& c) {
  const ForwardOutput f = abi->Forward(false, false);
  EXPECT_EQ(f.status, ATTNRES_OK) << f.error;
  double loss = 0;
  for (size_t k = 0; k < c.size(); ++k) loss += c[k] * f.out[k];
  return loss;
}

// Central difference of Loss with respect to element `index` of `buffer`.
double Derivative(AbiProblem* abi, Buffer* buffer, size_t index,
                  const std::vector<double>& c) {
  const double x = buffer->Get(index);
  buffer->Set(index, x + kStep);
  const double up = Loss(abi, c);
  buffer->Set(index, x - kStep);
  const double down = Loss(abi, c);
  buffer->Set(index, x);
  return (up - down) / (2 * kStep);
}

void CheckGradients(const Case& c) {
  SCOPED_TRACE(c.Describe());
  ASSERT_EQ(c.dtype, ATTNRES_DTYPE_FLOAT64);
  const attnres::ref::Problem problem = MakeProblem(c);
  const std::vector<double> dloss_dh = MakeGradOut(c);
  const int64_t L = c.num_sources(), T = c.tokens, D = c.dim;
  const int64_t stride = D + c.source_pad;

  ForEachBackend([&](const Backend& backend) {
    AbiProblem abi(c, problem, backend.device);
    for (bool caches : {false, true}) {
      SCOPED_TRACE(caches ? "backward with caches" : "backward without caches");
      BackwardOptions o;
      o.use_rms_cache = o.use_alpha_cache = caches;
      const BackwardOutput b = abi.Backward(dloss_dh, o);
      ASSERT_EQ(b.status, ATTNRES_OK) << b.error;

      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> numeric(T * D);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t d = 0; d < D; ++d) {
            numeric[t * D + d] = Derivative(&abi, &abi.source(i), t * stride + d, dloss_dh);
          }
        }
        EXPECT_TRUE(Close("d/dsource[" + std::to_string(i) + "]", b.grad_sources[i],
                          numeric, kTol));
      }
      std::vector<double> numeric_w(D), numeric_gamma(D);
      for (int64_t d = 0; d < D; ++d) {
        numeric_w[d] = Derivative(&abi, &abi.proj_weight(), d, dloss_dh);
      }
      EXPECT_TRUE(Close("d/dw", b.grad_w, numeric_w, kTol));
      if (c.rmsnorm && c.has_gamma) {
        for (int64_t d = 0; d < D; ++d) {
          numeric_gamma[d] = Derivative(&abi, &abi.gamma(), d, dloss_dh);
        }
        EXPECT_TRUE(Close("d/dgamma", b.grad_gamma, numeric_gamma, kTol));
      }
    }
  });
}

Case F64Case(int64_t tokens, int64_t dim, int64_t num_blocks, bool partial, bool rmsnorm,
             double scale, double eps, uint64_t seed) {
  Case c;
  c.tokens = tokens;
  c.dim = dim;
  c.num_blocks = num_blocks;
  c.has_partial = partial;
  c.rmsnorm = rmsnorm;
  c.scale = scale;
  c.eps = eps;
  c.dtype = ATTNRES_DTYPE_FLOAT64;
  c.seed = seed;
  return c;
}

TEST(FiniteDiff, RmsnormWithPartial) {
  CheckGradients(F64Case(3, 6, 3, true, true, 0.7, 1e-3, 101));
}

TEST(FiniteDiff, RmsnormNoPartialWideLogits) {
  CheckGradients(F64Case(2, 9, 6, false, true, 3.0, 1e-6, 102));
}

TEST(FiniteDiff, RmsnormOff) {
  CheckGradients(F64Case(2, 5, 4, false, false, 1.3, 1e-6, 103));
}

TEST(FiniteDiff, RmsnormOffWithPartialNegativeScale) {
  CheckGradients(F64Case(3, 4, 2, true, false, -0.8, 1e-6, 104));
}

TEST(FiniteDiff, PartialOnlySingleSource) {
  CheckGradients(F64Case(2, 4, 0, true, true, 1.0, 1e-6, 105));
}

TEST(FiniteDiff, GammaNullMeansOnes) {
  Case c = F64Case(3, 7, 2, true, true, 1.0, 1e-2, 106);
  c.has_gamma = false;
  CheckGradients(c);  // dgamma itself is checked against the oracle below
  const auto problem = MakeProblem(c);
  const auto g = MakeGradOut(c);
  const auto ref_b = attnres::ref::Backward(problem, g);
  ForEachBackend([&](const Backend& backend) {
    AbiProblem abi(c, problem, backend.device);
    const BackwardOutput b = abi.Backward(g, BackwardOptions());
    ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
    EXPECT_TRUE(Close("grad_gamma (gamma NULL)", b.grad_gamma, ref_b.grad_gamma, 1e-10));
  });
}

TEST(FiniteDiff, StridedRows) {
  Case c = F64Case(4, 5, 3, true, true, 0.9, 1e-5, 107);
  c.source_pad = 3;
  c.out_pad = 2;
  c.grad_out_pad = 5;
  c.grad_source_pad = 1;
  CheckGradients(c);
}

}  // namespace
}  // namespace attnres_test
