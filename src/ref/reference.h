// The float64 reference of Block AttnRes (SPEC §1): the test oracle for every
// backend. Written to be read, not to be fast; never linked into libattnres.
#ifndef ATTNRES_SRC_REF_REFERENCE_H_
#define ATTNRES_SRC_REF_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "attnres/attnres.h"

namespace attnres::ref {

// SPEC §3, the one copy of the table: how close every backend must come to this
// reference, as each output's max error relative to the reference tensor's
// max-abs: h; every gradient (dw and dgamma included); the rms/alpha caches and
// phase 1's lse (accumulation type). 16-bit inputs are compared with the reference
// fed the same 16-bit values.
struct Tolerance {
  double out, grad, cache;
};
constexpr Tolerance SpecTolerance(attnres_dtype dtype) {
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT32: return {1e-5, 1e-4, 1e-5};
    case ATTNRES_DTYPE_FLOAT64: return {1e-10, 1e-10, 1e-10};
    case ATTNRES_DTYPE_BFLOAT16: return {8e-3, 1e-2, 1e-5};
    case ATTNRES_DTYPE_FLOAT16: return {1e-3, 1e-2, 1e-5};
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
