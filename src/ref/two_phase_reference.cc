// Float64 reference of the two-phase schedule: SPEC §5 line by line, one token at
// a time (see two_phase_reference.h for the formulas).
#include "ref/two_phase_reference.h"

#include <algorithm>
#include <cmath>

namespace attnres::ref {
namespace {

double Dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// rms of one row (1 when rmsnorm is off).
double Rms(const double* v, int64_t dim, bool rmsnorm, double eps) {
  return rmsnorm ? std::sqrt(Dot(v, v, dim) / dim + eps) : 1.0;
}

// u = w * gamma, [dim] (gamma taken as 1 when empty or when rmsnorm is off).
std::vector<double> Query(const double* w, const std::vector<double>& gamma, int64_t offset,
                          int64_t dim, bool rmsnorm) {
  std::vector<double> u(w, w + dim);
  if (rmsnorm && !gamma.empty()) {
    for (int64_t d = 0; d < dim; ++d) u[d] *= gamma[offset + d];
  }
  return u;
}

// Phase 1 per token: the logits z [S][N], lse [S], weights a [S][N], o [S][dim].
struct Phase1Token {
  std::vector<const double*> v;        // N rows of dim
  std::vector<double> r;               // [N]
  std::vector<std::vector<double>> z;  // [S][N]
  std::vector<double> lse;             // [S]
  std::vector<std::vector<double>> a;  // [S][N]
  std::vector<std::vector<double>> o;  // [S][dim]
};

Phase1Token ComputePhase1Token(const Phase1Problem& p, const std::vector<std::vector<double>>& u,
                               int64_t t) {
  const int64_t N = p.num_blocks(), S = p.num_queries, D = p.dim;
  Phase1Token k;
  for (int64_t i = 0; i < N; ++i) {
    k.v.push_back(p.blocks[i].data() + t * D);
    k.r.push_back(Rms(k.v[i], D, p.rmsnorm, p.eps));
  }
  k.z.assign(S, std::vector<double>(N));
  k.a.assign(S, std::vector<double>(N));
  k.o.assign(S, std::vector<double>(D, 0.0));
  k.lse.assign(S, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < N; ++i) k.z[s][i] = p.scale * Dot(u[s].data(), k.v[i], D) / k.r[i];
    const double m = *std::max_element(k.z[s].begin(), k.z[s].end());
    double sum = 0;
    for (int64_t i = 0; i < N; ++i) sum += std::exp(k.z[s][i] - m);
    k.lse[s] = m + std::log(sum);
    for (int64_t i = 0; i < N; ++i) {
      k.a[s][i] = std::exp(k.z[s][i] - k.lse[s]);
      for (int64_t d = 0; d < D; ++d) k.o[s][d] += k.a[s][i] * k.v[i][d];
    }
  }
  return k;
}

std::vector<std::vector<double>> Queries(const Phase1Problem& p) {
  std::vector<std::vector<double>> u;  // [S][dim]
  for (int64_t s = 0; s < p.num_queries; ++s) {
    u.push_back(Query(p.w.data() + s * p.dim, p.gamma, s * p.dim, p.dim, p.rmsnorm));
  }
  return u;
}

// Phase 2 per token: r_p, z_p, beta and h [dim] (before the input norm).
struct Phase2Token {
  const double* o;
  const double* p;  // nullptr without a partial block
  double r_p = 1, z_p = 0, beta = 1, keep = 0;  // keep = 1 - beta
  std::vector<double> h;
};

Phase2Token ComputePhase2Token(const Phase2Problem& q, const std::vector<double>& u, int64_t t) {
  const int64_t D = q.dim;
  Phase2Token k;
  k.o = q.out.data() + t * D;
  k.p = q.has_partial ? q.partial.data() + t * D : nullptr;
  k.h.assign(k.o, k.o + D);
  if (k.p != nullptr) {
    k.r_p = Rms(k.p, D, q.rmsnorm, q.eps);
    k.z_p = q.scale * Dot(u.data(), k.p, D) / k.r_p;
    // Each weight from its own exponent: 1 - beta would lose a weight of 1e-13 even
    // in double (SPEC §3, sharp depth attention).
    k.beta = 1.0 / (1.0 + std::exp(k.z_p - q.lse[t]));
    k.keep = 1.0 / (1.0 + std::exp(q.lse[t] - k.z_p));
    for (int64_t d = 0; d < D; ++d) k.h[d] = k.beta * k.o[d] + k.keep * k.p[d];
  }
  return k;
}

double NormWeight(const Phase2Problem& q, int64_t d) {
  return q.norm_weight.empty() ? 1.0 : q.norm_weight[d];
}

}  // namespace

Phase1ForwardResult Phase1Forward(const Phase1Problem& p) {
  const int64_t S = p.num_queries, D = p.dim;
  const auto u = Queries(p);
  Phase1ForwardResult r;
  r.outs.assign(S, std::vector<double>(p.tokens * D));
  r.lses.assign(S, std::vector<double>(p.tokens));
  for (int64_t t = 0; t < p.tokens; ++t) {
    const Phase1Token k = ComputePhase1Token(p, u, t);
    for (int64_t s = 0; s < S; ++s) {
      std::copy(k.o[s].begin(), k.o[s].end(), r.outs[s].begin() + t * D);
      r.lses[s][t] = k.lse[s];
    }
  }
  return r;
}

Phase1BackwardResult Phase1Backward(const Phase1Problem& p,
                                    const std::vector<std::vector<double>>& grad_outs,
                                    const std::vector<std::vector<double>>& grad_lses) {
  const int64_t N = p.num_blocks(), S = p.num_queries, D = p.dim;
  const auto u = Queries(p);
  Phase1BackwardResult r;
  r.grad_blocks.assign(N, std::vector<double>(p.tokens * D, 0.0));
  r.grad_w.assign(S * D, 0.0);
  r.grad_gamma.assign(S * D, 0.0);
  const std::vector<double> zero_row(D, 0.0);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const Phase1Token k = ComputePhase1Token(p, u, t);
    for (int64_t s = 0; s < S; ++s) {
      const bool has_go = s < static_cast<int64_t>(grad_outs.size()) && !grad_outs[s].empty();
      const double* go = has_go ? grad_outs[s].data() + t * D : zero_row.data();  // do_s [dim]
      const bool has_gl = s < static_cast<int64_t>(grad_lses.size()) && !grad_lses[s].empty();
      const double gl = has_gl ? grad_lses[s][t] : 0.0;                          // dlse_s
      // dz_{s,i} = a_{s,i} (dot(do_s, v_i) - dot(do_s, o_s) + dlse_s), with
      // dot(do_s, o_s) = sum_j a_{s,j} dot(do_s, v_j) taken relative to the block of
      // the largest weight (the pivot form of reference.cc's softmax backward).
      std::vector<double> ga(N);
      int64_t pivot = 0;
      for (int64_t i = 0; i < N; ++i) {
        ga[i] = Dot(go, k.v[i], D);
        if (k.a[s][i] > k.a[s][pivot]) pivot = i;
      }
      double mean_delta = 0;
      for (int64_t j = 0; j < N; ++j) mean_delta += k.a[s][j] * (ga[j] - ga[pivot]);
      for (int64_t i = 0; i < N; ++i) {
        const double a = k.a[s][i];
        const double dz = a * ((ga[i] - ga[pivot]) - mean_delta + gl);  // dz_{s,i}
        const double u_dot_v = Dot(u[s].data(), k.v[i], D);
        const double ri = k.r[i];
        double* dv = r.grad_blocks[i].data() + t * D;
        for (int64_t d = 0; d < D; ++d) {
          // dz_{s,i}/dv_i[d] = scale (u_s[d] / r_i - v_i[d] dot(u_s, v_i) / (D r_i^3))
          const double dz_dv = p.rmsnorm ? p.scale * (u[s][d] / ri - k.v[i][d] * u_dot_v /
                                                                         (D * ri * ri * ri))
                                         : p.scale * u[s][d];
          dv[d] += a * go[d] + dz * dz_dv;
          const double gamma = p.rmsnorm && !p.gamma.empty() ? p.gamma[s * D + d] : 1.0;
          r.grad_w[s * D + d] += dz * p.scale * gamma * k.v[i][d] / ri;
          if (p.rmsnorm) r.grad_gamma[s * D + d] += dz * p.scale * p.w[s * D + d] * k.v[i][d] / ri;
        }
      }
    }
  }
  return r;
}

std::vector<double> Phase2Forward(const Phase2Problem& q) {
  const int64_t D = q.dim;
  const auto u = Query(q.w.data(), q.gamma, 0, D, q.rmsnorm);
  std::vector<double> result(q.tokens * D);
  for (int64_t t = 0; t < q.tokens; ++t) {
    const Phase2Token k = ComputePhase2Token(q, u, t);
    const double inv = q.input_norm ? 1.0 / std::sqrt(Dot(k.h.data(), k.h.data(), D) / D +
                                                      q.norm_eps)
                                    : 1.0;
    for (int64_t d = 0; d < D; ++d) {
      result[t * D + d] = q.input_norm ? k.h[d] * inv * NormWeight(q, d) : k.h[d];
    }
  }
  return result;
}

Phase2BackwardResult Phase2Backward(const Phase2Problem& q, const std::vector<double>& grad) {
  const int64_t D = q.dim;
  const auto u = Query(q.w.data(), q.gamma, 0, D, q.rmsnorm);
  Phase2BackwardResult r;
  r.grad_out.assign(q.tokens * D, 0.0);
  r.grad_lse.assign(q.tokens, 0.0);
  r.grad_partial.assign(q.tokens * D, 0.0);
  r.grad_w.assign(D, 0.0);
  r.grad_gamma.assign(D, 0.0);
  r.grad_norm_weight.assign(D, 0.0);
  for (int64_t t = 0; t < q.tokens; ++t) {
    const Phase2Token k = ComputePhase2Token(q, u, t);
    const double* gx = grad.data() + t * D;
    std::vector<double> g(gx, gx + D);  // dL/dh [dim]
    if (q.input_norm) {
      // x = h * inv * nw, inv = 1 / sqrt(mean(h^2) + norm_eps):
      // dh = inv * gxn - h * inv^3 * dot(gxn, h) / D with gxn = gx * nw.
      const double inv = 1.0 / std::sqrt(Dot(k.h.data(), k.h.data(), D) / D + q.norm_eps);
      std::vector<double> gxn(D);
      for (int64_t d = 0; d < D; ++d) {
        gxn[d] = gx[d] * NormWeight(q, d);
        r.grad_norm_weight[d] += gx[d] * k.h[d] * inv;
      }
      const double c = Dot(gxn.data(), k.h.data(), D);
      for (int64_t d = 0; d < D; ++d) g[d] = inv * gxn[d] - k.h[d] * inv * inv * inv * c / D;
    }
    double* go = r.grad_out.data() + t * D;
    if (k.p == nullptr) {  // h = o
      std::copy(g.begin(), g.end(), go);
      continue;
    }
    const double beta = k.beta;
    double dbeta = 0;  // dot(g, o - p)
    for (int64_t d = 0; d < D; ++d) dbeta += g[d] * (k.o[d] - k.p[d]);
    const double dlse = dbeta * beta * k.keep;
    const double dz_p = -dlse;
    r.grad_lse[t] = dlse;
    const double u_dot_p = Dot(u.data(), k.p, D);
    const double rp = k.r_p;
    double* dp = r.grad_partial.data() + t * D;
    for (int64_t d = 0; d < D; ++d) {
      go[d] = beta * g[d];
      const double dz_dp = q.rmsnorm ? q.scale * (u[d] / rp - k.p[d] * u_dot_p / (D * rp * rp * rp))
                                     : q.scale * u[d];
      dp[d] = k.keep * g[d] + dz_p * dz_dp;
      const double gamma = q.rmsnorm && !q.gamma.empty() ? q.gamma[d] : 1.0;
      r.grad_w[d] += dz_p * q.scale * gamma * k.p[d] / rp;
      if (q.rmsnorm) r.grad_gamma[d] += dz_p * q.scale * q.w[d] * k.p[d] / rp;
    }
  }
  return r;
}

}  // namespace attnres::ref
