// The float64 reference of Block AttnRes (SPEC §1): the test oracle for every
// backend. Written to be read, not to be fast; never linked into libattnres.
#ifndef ATTNRES_SRC_REF_REFERENCE_H_
#define ATTNRES_SRC_REF_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "attnres/attnres.h"

namespace attnres::ref {

// SPEC §3's tolerances (the table is in tolerance_table.h, which the Python tests
// read too): max error relative to the reference tensor's max-abs, for h, every
// gradient, and the accumulation-type outputs (caches, lse).
struct Tolerance {
  double out, grad, cache;
};
constexpr Tolerance SpecTolerance(attnres_dtype dtype) {
  switch (dtype) {
#define ATTNRES_TOLERANCE(name, out, grad, cache) \
  case ATTNRES_DTYPE_##name:                      \
    return {out, grad, cache};
#include "tolerance_table.h"
#undef ATTNRES_TOLERANCE
    default: return {0, 0, 0};
  }
}

// One problem, dense, in float64. Sources are the N blocks followed by the
// partial block when there is one; each holds tokens*dim values, token-major.
struct Problem {
  int64_t tokens = 0;
  int64_t dim = 0;
  int64_t num_blocks = 0;
  bool has_partial = false;
  bool rmsnorm = true;
  double scale = 1.0;
  double eps = 1e-6;
  std::vector<std::vector<double>> sources;  // L x [tokens * dim]
  std::vector<double> w;                     // [dim]
  std::vector<double> gamma;                 // [dim]; empty means ones

  int64_t num_sources() const { return num_blocks + (has_partial ? 1 : 0); }
};

struct ForwardResult {
  std::vector<double> out;    // [tokens * dim]
  std::vector<double> rms;    // [tokens * L]; ones when rmsnorm is off
  std::vector<double> alpha;  // [tokens * L]
};

struct BackwardResult {
  std::vector<std::vector<double>> grad_sources;  // L x [tokens * dim]
  std::vector<double> grad_w;                     // [dim]
  std::vector<double> grad_gamma;                 // [dim]; zeros when rmsnorm is off
};

ForwardResult Forward(const Problem& problem);
BackwardResult Backward(const Problem& problem, const std::vector<double>& grad_out);

}  // namespace attnres::ref

#endif  // ATTNRES_SRC_REF_REFERENCE_H_
