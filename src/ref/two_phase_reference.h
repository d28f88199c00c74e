// The float64 reference of the two-phase schedule (SPEC §5): the test oracle of
// attnres_phase1_* and attnres_phase2_*. Written to be read, not to be fast, one
// token at a time; never linked into libattnres.
//
// Per token (u_s = w_s * gamma_s, gamma_s = 1 when absent or when rmsnorm is off;
// r_i = 1 when rmsnorm is off):
//   phase 1   z_{s,i} = scale * dot(u_s, v_i) / r_i          over the N blocks
//             lse_s   = log sum_i exp(z_{s,i})
//             o_s     = sum_i exp(z_{s,i} - lse_s) v_i
//   phase 2   z_p  = scale * dot(u, p) / r_p,  beta = sigmoid(lse - z_p)
//             h    = beta * o + keep * p,  keep = sigmoid(z_p - lse) = 1 - beta
//                                                       (h = o without p)
//             out  = h, or h / sqrt(mean(h^2) + norm_eps) * norm_weight (input_norm)
#ifndef ATTNRES_SRC_REF_TWO_PHASE_REFERENCE_H_
#define ATTNRES_SRC_REF_TWO_PHASE_REFERENCE_H_

#include <cstdint>
#include <vector>

namespace attnres::ref {

// Phase 1: S queries over N completed blocks. Every tensor dense, token-major.
struct Phase1Problem {
  int64_t tokens = 0;
  int64_t dim = 0;
  int64_t num_queries = 1;  // S
  bool rmsnorm = true;
  double scale = 1.0;
  double eps = 1e-6;
  std::vector<std::vector<double>> blocks;  // N x [tokens * dim]
  std::vector<double> w;                    // [S * dim], row s is w_s
  std::vector<double> gamma;                // [S * dim]; empty means ones

  int64_t num_blocks() const { return static_cast<int64_t>(blocks.size()); }
};

struct Phase1ForwardResult {
  std::vector<std::vector<double>> outs;  // S x [tokens * dim]   o_s
  std::vector<std::vector<double>> lses;  // S x [tokens]         lse_s
};

struct Phase1BackwardResult {
  std::vector<std::vector<double>> grad_blocks;  // N x [tokens * dim]
  std::vector<double> grad_w;                    // [S * dim]
  std::vector<double> grad_gamma;                // [S * dim]; zeros when rmsnorm is off
};

Phase1ForwardResult Phase1Forward(const Phase1Problem& problem);
// grad_outs: S entries, each [tokens * dim] or empty (zero); grad_lses: S entries,
// each [tokens] or empty (zero); an empty outer vector means all zero.
Phase1BackwardResult Phase1Backward(const Phase1Problem& problem,
                                    const std::vector<std::vector<double>>& grad_outs,
                                    const std::vector<std::vector<double>>& grad_lses);

// Phase 2: one query (w, gamma [dim]) merging phase 1's o, lse with the partial block.
struct Phase2Problem {
  int64_t tokens = 0;
  int64_t dim = 0;
  bool has_partial = true;
  bool rmsnorm = true;
  bool input_norm = false;
  double scale = 1.0;
  double eps = 1e-6;
  double norm_eps = 1e-6;
  std::vector<double> out;          // [tokens * dim]  o (phase 1's output)
  std::vector<double> lse;          // [tokens]        lse (phase 1's)
  std::vector<double> partial;      // [tokens * dim]  p (unused without has_partial)
  std::vector<double> w;            // [dim]
  std::vector<double> gamma;        // [dim]; empty means ones
  std::vector<double> norm_weight;  // [dim]; empty means ones
};

struct Phase2BackwardResult {
  std::vector<double> grad_out;          // [tokens * dim]  dL/do
  std::vector<double> grad_lse;          // [tokens]        dL/dlse (zeros without p)
  std::vector<double> grad_partial;      // [tokens * dim]  (zeros without p)
  std::vector<double> grad_w;            // [dim]
  std::vector<double> grad_gamma;        // [dim]; zeros when rmsnorm is off
  std::vector<double> grad_norm_weight;  // [dim]; zeros without input_norm
};

// [tokens * dim]: h, or RMSNorm(h) * norm_weight with input_norm.
std::vector<double> Phase2Forward(const Phase2Problem& problem);
// grad: dL/d(the forward's result), [tokens * dim].
Phase2BackwardResult Phase2Backward(const Phase2Problem& problem, const std::vector<double>& grad);

}  // namespace attnres::ref

#endif  // ATTNRES_SRC_REF_TWO_PHASE_REFERENCE_H_
