// Float64 reference: SPEC §1 line by line, one token at a time.
#include "ref/reference.h"

#include <algorithm>
#include <cmath>

namespace attnres::ref {
namespace {

// Per-token quantities shared by forward and backward.
struct TokenState {
  std::vector<const double*> v;   // L source rows
  std::vector<double> r;          // [L] rms (1 when rmsnorm is off)
  std::vector<double> z;          // [L] logits
  std::vector<double> alpha;      // [L] softmax(z)
};

double Gamma(const Problem& p, int64_t d) {
  return p.gamma.empty() || !p.rmsnorm ? 1.0 : p.gamma[d];
}

TokenState ComputeToken(const Problem& p, int64_t t) {
  const int64_t L = p.num_sources(), D = p.dim;
  TokenState s;
  for (int64_t i = 0; i < L; ++i) s.v.push_back(p.sources[i].data() + t * D);
  s.r.assign(L, 1.0);
  s.z.assign(L, 0.0);
  for (int64_t i = 0; i < L; ++i) {
    if (p.rmsnorm) {
      double sum_sq = 0;
      for (int64_t d = 0; d < D; ++d) sum_sq += s.v[i][d] * s.v[i][d];
      s.r[i] = std::sqrt(sum_sq / D + p.eps);
    }
    double dot = 0;  // dot(w, k_i) with k_i = gamma * v_i / r_i
    for (int64_t d = 0; d < D; ++d) dot += p.w[d] * Gamma(p, d) * s.v[i][d] / s.r[i];
    s.z[i] = p.scale * dot;
  }
  const double z_max = *std::max_element(s.z.begin(), s.z.end());
  double denom = 0;
  s.alpha.resize(L);
  for (int64_t i = 0; i < L; ++i) denom += s.alpha[i] = std::exp(s.z[i] - z_max);
  for (int64_t i = 0; i < L; ++i) s.alpha[i] /= denom;
  return s;
}

}  // namespace

ForwardResult Forward(const Problem& p) {
  const int64_t L = p.num_sources(), D = p.dim;
  ForwardResult res;
  res.out.assign(p.tokens * D, 0.0);
  res.rms.assign(p.tokens * L, 1.0);
  res.alpha.assign(p.tokens * L, 0.0);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const TokenState s = ComputeToken(p, t);
    for (int64_t i = 0; i < L; ++i) {
      res.rms[t * L + i] = s.r[i];
      res.alpha[t * L + i] = s.alpha[i];
      for (int64_t d = 0; d < D; ++d) res.out[t * D + d] += s.alpha[i] * s.v[i][d];
    }
  }
  return res;
}

BackwardResult Backward(const Problem& p, const std::vector<double>& grad_out) {
  const int64_t L = p.num_sources(), D = p.dim;
  BackwardResult res;
  res.grad_sources.assign(L, std::vector<double>(p.tokens * D, 0.0));
  res.grad_w.assign(D, 0.0);
  res.grad_gamma.assign(D, 0.0);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const TokenState s = ComputeToken(p, t);
    const double* g = grad_out.data() + t * D;

    std::vector<double> ga(L, 0.0);  // dLoss/dalpha_i = dot(g, v_i)
    int64_t pivot = 0;               // the source with the largest alpha
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t d = 0; d < D; ++d) ga[i] += g[d] * s.v[i][d];
      if (s.alpha[i] > s.alpha[pivot]) pivot = i;
    }
    // The softmax backward gz_i = alpha_i (ga_i - sum_j alpha_j ga_j), with every ga
    // taken relative to the pivot's: when alpha_pivot is near 1, ga_pivot - sum is a
    // tiny difference of two large numbers (up to 1.5e-4 of max-abs off in double in
    // tests/cpp/test_util.h's sharp family), while the sum of alpha_j (ga_j - ga_pivot)
    // is formed from exact differences.
    double mean_delta = 0;  // sum_j alpha_j * (ga_j - ga_pivot)
    for (int64_t j = 0; j < L; ++j) mean_delta += s.alpha[j] * (ga[j] - ga[pivot]);
    for (int64_t i = 0; i < L; ++i) {
      const double gz = s.alpha[i] * ((ga[i] - ga[pivot]) - mean_delta);
      std::vector<double> gk(D);                         // dLoss/dk_i = scale * gz * w
      double c = 0;                                      // dot(gamma * gk, v_i)
      for (int64_t d = 0; d < D; ++d) {
        gk[d] = p.scale * gz * p.w[d];
        c += Gamma(p, d) * gk[d] * s.v[i][d];
      }
      double* dv = res.grad_sources[i].data() + t * D;
      const double r = s.r[i];
      for (int64_t d = 0; d < D; ++d) {
        const double k = Gamma(p, d) * s.v[i][d] / r;
        dv[d] = s.alpha[i] * g[d];
        if (p.rmsnorm) {
          dv[d] += Gamma(p, d) * gk[d] / r - s.v[i][d] * c / (D * r * r * r);
          res.grad_gamma[d] += gk[d] * s.v[i][d] / r;
        } else {
          dv[d] += gk[d];
        }
        res.grad_w[d] += p.scale * gz * k;
      }
    }
  }
  return res;
}

}  // namespace attnres::ref
