// The per-token math of every op, written once for the CPU kernels and the CUDA
// kernels: the softmax over depth, its backward in the pivot form, the RMSNorm
// chain of the keys, and the two-phase merge. A numerical fix here reaches every
// backend, and the tests that run on the CPU exercise the math the GPU runs.
//
// Scalars only (a few per source and token); A is float, or double for float64
// inputs. Everything is in an unnamed namespace: this header is included by CPU
// sources compiled for different ISAs, and no copy may be merged into another.
#ifndef ATTNRES_SRC_CORE_TOKEN_MATH_H_
#define ATTNRES_SRC_CORE_TOKEN_MATH_H_

#include <cstdint>

#if defined(__CUDACC__)
#define ATTNRES_HD __host__ __device__ __forceinline__
#else
#define ATTNRES_HD inline
#endif

namespace attnres::math {
namespace {  // NOLINT(build/namespaces): see above

// Through builtins, not <cmath>'s inline std:: overloads, which the linker could
// share between CPU variants; the CUDA math functions in device code.
#define ATTNRES_MATH_FN(name, float_fn, double_fn) \
  ATTNRES_HD float name(float x) { return float_fn(x); } \
  ATTNRES_HD double name(double x) { return double_fn(x); }
#if defined(__CUDA_ARCH__)
ATTNRES_MATH_FN(Exp, expf, exp)
ATTNRES_MATH_FN(Log, logf, log)
ATTNRES_MATH_FN(Sqrt, sqrtf, sqrt)
#else
ATTNRES_MATH_FN(Exp, __builtin_expf, __builtin_exp)
ATTNRES_MATH_FN(Log, __builtin_logf, __builtin_log)
ATTNRES_MATH_FN(Sqrt, __builtin_sqrtf, __builtin_sqrt)
#endif
#undef ATTNRES_MATH_FN

// r = sqrt(mean(v^2) + eps) from sum(v^2) over dim elements.
template <typename A>
ATTNRES_HD A Rms(A sum_sq, int64_t dim, A eps) {
  return Sqrt(sum_sq / static_cast<A>(dim) + eps);
}

// The largest of n logits, strided (z[i * stride]).
template <typename A>
ATTNRES_HD A MaxLogit(const A* z, int64_t n, int64_t stride = 1) {
  A m = z[0];
  for (int64_t i = 1; i < n; ++i) m = z[i * stride] > m ? z[i * stride] : m;
  return m;
}

// alpha = softmax(z) over one token's n logits, exp(z - max z): logits of +-1e4
// stay finite, a -inf logit gets weight 0, and a NaN or +inf logit makes the
// token's weights NaN (that token only), as in the reference.
template <typename A>
ATTNRES_HD void Softmax(const A* z, A* alpha, int64_t n) {
  const A max_z = MaxLogit(z, n);
  A denom = 0;
  for (int64_t i = 0; i < n; ++i) denom += alpha[i] = Exp(z[i] - max_z);
  const A inv_denom = A(1) / denom;
  for (int64_t i = 0; i < n; ++i) alpha[i] *= inv_denom;
}

// The softmax in one pass, for kernels that read each source once (the CUDA
// forward): a running max m and denominator s = sum_j exp(z_j - m) over the
// logits added so far, with every accumulator of exp(z_j - m)-weighted terms kept
// relative to the same m. Add(z) folds in the next logit, m' = max(m, z), and
// returns the factor for what was accumulated, exp(m - m'), and z's weight
// exp(z - m'). The cases come out as Softmax's: a -inf logit gets weight 0 even
// before any finite one (exp(-inf - -inf) would be NaN), so a leading -inf gives
// alpha = 0 and a finite h; a NaN or +inf logit makes s, so every alpha and h, NaN.
template <typename A>
struct OnlineSoftmax {
  struct Step {
    A rescale, weight;
  };
  A max = -static_cast<A>(__builtin_huge_val());
  A denom = 0;

  ATTNRES_HD Step Add(A z) {
    const A new_max = z > max ? z : max;  // a NaN z keeps the max; its weight is NaN
    const Step step{new_max == max ? A(1) : Exp(max - new_max),
                    z == -static_cast<A>(__builtin_huge_val()) ? A(0) : Exp(z - new_max)};
    denom = denom * step.rescale + step.weight;
    max = new_max;
    return step;
  }

  // The weight of logit z once every logit has been added.
  ATTNRES_HD A Alpha(A z) const { return Exp(z - max) / denom; }
};

// log sum_i exp(z[i * stride]) over n logits, the max subtracted first.
template <typename A>
ATTNRES_HD A LogSumExp(const A* z, int64_t n, int64_t stride = 1) {
  const A max_z = MaxLogit(z, n, stride);
  A sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += Exp(z[i * stride] - max_z);
  return max_z + Log(sum);
}

// The softmax backward: gz_i = alpha_i (ga_i - sum_k alpha_k ga_k), given
// ga_i = dL/dalpha_i, computed relative to the source with the largest alpha (the
// pivot). When the softmax is peaked, ga_i - mean is a small difference of two
// large numbers, while the ga_k - ga_pivot are exact inputs: with correlated,
// residual-like sources this is what keeps dw within 1e-4 (docs/DESIGN.md).
// Writes gz (which may alias ga). `extra` is added to every (ga_i - mean): the
// gradient of a log-sum-exp output (phase 1's dlse), zero for the single op.
template <typename A>
ATTNRES_HD void SoftmaxBackward(const A* alpha, const A* ga, int64_t n, A extra, A* gz) {
  int64_t pivot = 0;
  for (int64_t i = 1; i < n; ++i) pivot = alpha[i] > alpha[pivot] ? i : pivot;
  const A ga_pivot = ga[pivot];
  A mean_delta = 0;
  for (int64_t i = 0; i < n; ++i) mean_delta += alpha[i] * (ga[i] - ga_pivot);
  for (int64_t i = 0; i < n; ++i) gz[i] = alpha[i] * ((ga[i] - ga_pivot) - mean_delta + extra);
}

// The key chain of one logit z = scale * dot(u, v) / r, r = sqrt(mean(v^2) + eps)
// (r = 1 without RMSNorm): dz/dv = a * u + b * v with
//   a = scale / r,   b = -z / (dim * r^2)   (b = 0 without RMSNorm),
// so a logit gradient gz contributes gz * a * u + gz * b * v to dv, and gz * a * v
// to dL/du (dw = gamma * that, dgamma = w * that).
template <typename A>
struct KeyChain {
  A a, b;
};
template <typename A>
ATTNRES_HD KeyChain<A> KeyGradient(A z, A r, A scale, int64_t dim, bool rmsnorm) {
  return {scale / r, rmsnorm ? -z / (static_cast<A>(dim) * r * r) : A(0)};
}

// Phase 2's two merge weights, beta = sigmoid(lse - z_p) on phase 1's result and
// keep = 1 - beta = sigmoid(z_p - lse) on the partial block, each from its own
// exponent, never as 1 - (a number near 1): when one weight is 1e-13 the
// subtraction would keep none of its digits, and it scales the partial block in h,
// its gradient and (through beta * keep) dlse and so dw (SPEC §3, sharp depth
// attention). exp of a non-positive number only, so nothing overflows; a NaN x
// gives NaN weights.
template <typename A>
struct MergeWeights {
  A beta, keep;
};
template <typename A>
ATTNRES_HD MergeWeights<A> MergeWeightsOf(A lse, A z_p) {
  const A x = lse - z_p;
  const A e = Exp(x >= 0 ? -x : x);  // exp(-|x|), in [0, 1]
  const A big = A(1) / (A(1) + e), small = e / (A(1) + e);
  return x >= 0 ? MergeWeights<A>{big, small} : MergeWeights<A>{small, big};
}

}  // namespace
}  // namespace attnres::math

#endif  // ATTNRES_SRC_CORE_TOKEN_MATH_H_
