// Phase 2 of the two-phase schedule on CUDA: one warp per token (the math is in
// two_phase_common.cuh's header; two_phase.cu plans and launches).
//
// A few passes over the token's o, p (and g) rows, warp-shuffle reductions
// only; h is recomputed, never stored. With the fused update the first pass
// forms p' = partial + y and stores it to new_partial; the later passes read p'
// back from there (each lane rereads the chunks it wrote itself, so no
// barrier), as the CPU's pre-pass does.
//
// Layout: Phase2Args is all the kernel receives; Phase2Traits<T, kBackward,
// kFused> holds its compile-time shape; Phase2Kernel is the one launch
// template, whose token loop forms the merge weight (Phase2Warp::MergeOf, both
// directions) and then runs Phase2Warp::Forward or Phase2Warp::Backward.
#ifndef ATTNRES_SRC_CUDA_PHASE2_KERNEL_CUH_
#define ATTNRES_SRC_CUDA_PHASE2_KERNEL_CUH_

#include <cstdint>

#include "core/token_math.h"
#include "cuda/common.cuh"
#include "cuda/two_phase_common.cuh"

namespace attnres::cuda {

struct Phase2Args {
  const void* o;            // phase 1's o, [num_tokens, strides.source]
  const void* partial;      // or null: h = o
  const void* partial_update;  // forward, optional: y, [num_tokens, strides.source]
  void* new_partial;  // forward, with partial_update: p' = partial + y, [num_tokens, strides.out]
  const void* lse;          // Acc [num_tokens]; read only with a partial block
  const void* weights;      // Acc [1 + input_norm, row_chunks * kVec]: u, then the norm weight
  void* out;                // forward
  const void* grad_out;     // backward
  void* grad_o;             // backward, optional
  void* grad_lse;           // backward, optional, Acc [num_tokens]
  void* grad_partial;       // backward, optional
  const void* grad_partial_in;  // backward, optional: [num_tokens, strides.grad_out]
  void* u_partials;         // backward: Acc [num_items, dim], or null
  void* norm_partials;      // backward: Acc [num_items, dim], or null
  PhaseShape shape;
  double scale;
  double eps;
  double norm_eps;
  bool rmsnorm;
  bool input_norm;
};

// kFused: the fused partial-block update (forward: partial_update and
// new_partial; backward: grad_partial_in), in kernels of their own so that the
// plain merge keeps its registers (the update inline costs the 16-bit forward
// registers, and with them resident CTAs per SM).
template <typename T, bool kBackwardT, bool kFusedT>
struct Phase2Traits : TwoPhaseTraits<T> {
  static constexpr bool kBackward = kBackwardT;
  static constexpr bool kFused = kFusedT;
  // The forward's fused update: p' = partial + y is what the token merges.
  static constexpr bool kUpdate = kFused && !kBackward;
  static constexpr int kThreads = kPhase2Threads;
  static constexpr int kWarps = kPhase2Warps;
};

// A phase-2 warp: what its lanes hold for the whole launch, and the steps of a
// token. Passes over a row stride by kWarpSize chunks; the sums are warp
// shuffles, so no step needs a barrier.
template <typename KT>
class Phase2Warp {
 public:
  using IO = typename KT::IO;
  using Acc = typename KT::Acc;
  using Bits = typename KT::Bits;
  static constexpr int kVec = KT::kVec;

  // A token's merge h = beta o + keep p: its rows (p is p' with the fused
  // update), their access widths and the merge weights (keep = 1 - beta,
  // formed on its own: token_math.h), and z_p and r_p for the backward.
  struct Merge {
    const Bits* o;
    const Bits* p;  // null: no partial block, h = o
    int o_bytes, p_bytes;
    int64_t dim;
    Acc beta = 1, keep = 0, z = 0, r = 1;

    // h over chunk c.
    __device__ __forceinline__ void H(int64_t c, Acc (&h)[kVec]) const {
      IO::Load(o, o_bytes, c, dim, h);
      if (p == nullptr) return;
      Acc x[kVec];
      IO::Load(p, p_bytes, c, dim, x);
#pragma unroll
      for (int e = 0; e < kVec; ++e) h[e] = beta * h[e] + keep * x[e];
    }
  };

  __device__ __forceinline__ explicit Phase2Warp(const Phase2Args& args) {
    lane = threadIdx.x % kWarpSize;
    dim = args.shape.dim;
    padded = args.shape.row_chunks * kVec;
    u = static_cast<const Acc*>(args.weights);
    norm_weight = args.input_norm ? u + padded : nullptr;
    scale = static_cast<Acc>(args.scale);
  }

  // Token t's rows and merge weight: z_p = scale * dot(u, p) / r_p, beta and
  // keep from lse - z_p (beta = 1, keep = 0 without a partial block).
  __device__ __forceinline__ Merge MergeOf(const Phase2Args& args, int64_t t) const {
    const PhaseShape& shape = args.shape;
    Merge m;
    m.dim = dim;
    m.o = IO::Row(args.o, t, shape.strides.source);
    m.p = args.partial != nullptr ? IO::Row(args.partial, t, shape.strides.source) : nullptr;
    m.o_bytes = AccessBytes(m.o);
    m.p_bytes = m.p != nullptr ? AccessBytes(m.p) : 16;
    if (m.p != nullptr) Weigh(args, t, &m);
    return m;
  }

  // Forward: out = h, or h / rms(h) * norm_weight with the input norm.
  __device__ __forceinline__ void Forward(const Phase2Args& args, const Merge& m,
                                          int64_t t) const {
    const PhaseShape& shape = args.shape;
    Acc inv_rms = 1;
    if (args.input_norm) {
      Acc sum_sq = 0;
      for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
        Acc h[kVec];
        m.H(c, h);
        sum_sq += Dot(h, h);
      }
      inv_rms = Acc(1) / math::Rms(WarpSum(sum_sq), dim, static_cast<Acc>(args.norm_eps));
    }
    Bits* out = IO::Row(args.out, t, shape.strides.out);
    const int out_bytes = AccessBytes(out);
    for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
      Acc h[kVec];
      m.H(c, h);
      if (args.input_norm) {
        Acc nw[kVec];
        IO::LoadWeights(norm_weight, c, nw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) h[e] = h[e] * inv_rms * nw[e];
      }
      IO::Store(out, out_bytes, c, dim, h);
    }
  }

  // Backward: through the input norm to dh, then do, dlse and dnorm_weight
  // (MergeInputGrads), then dp and U (PartialGrads).
  __device__ __forceinline__ void Backward(const Phase2Args& args, const Merge& m, int64_t item,
                                           bool first_token, int64_t t) const {
    const OutGrad d = OutGradOf(args, m, t);
    const Acc dlse = MergeInputGrads(args, m, d, item, first_token, t);
    if (args.grad_lse != nullptr && lane == 0) static_cast<Acc*>(args.grad_lse)[t] = dlse;
    PartialGrads(args, m, d, dlse, item, first_token, t);
  }

 private:
  // The merge weight of a token with a partial block. The fused forward first
  // forms p' = partial + y, each element rounded to T as a separate addition
  // would round it, and stores it; m->p then points at p'.
  __device__ __forceinline__ void Weigh(const Phase2Args& args, int64_t t, Merge* m) const {
    const PhaseShape& shape = args.shape;
    const Bits* update = nullptr;
    Bits* p_new = nullptr;
    int update_bytes = 16, p_new_bytes = 16;
    if constexpr (KT::kUpdate) {
      update = IO::Row(args.partial_update, t, shape.strides.source);
      p_new = IO::Row(args.new_partial, t, shape.strides.out);
      update_bytes = AccessBytes(update);
      p_new_bytes = AccessBytes(p_new);
    }
    Acc dot = 0, sum_sq = 0;
    for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
      Acc x[kVec], y[kVec];
      IO::Load(m->p, m->p_bytes, c, dim, x);
      if constexpr (KT::kUpdate) {
        IO::Load(update, update_bytes, c, dim, y);
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[e] += y[e];
        IO::StoreRounded(p_new, p_new_bytes, c, dim, x);  // x is now p'
      }
      IO::LoadWeights(u, c, y);
      dot += Dot(y, x);
      sum_sq += Dot(x, x);
    }
    if constexpr (KT::kUpdate) {  // every later pass merges p' (this lane's own stores)
      m->p = p_new;
      m->p_bytes = p_new_bytes;
    }
    dot = WarpSum(dot);
    sum_sq = WarpSum(sum_sq);
    m->r = args.rmsnorm ? math::Rms(sum_sq, dim, static_cast<Acc>(args.eps)) : Acc(1);
    m->z = scale * (dot / m->r);
    const math::MergeWeights<Acc> weights =
        math::MergeWeightsOf(static_cast<const Acc*>(args.lse)[t], m->z);
    m->beta = weights.beta;
    m->keep = weights.keep;
  }

  // Token t's g = dL/dout and what dh needs of the input norm: with it, h' =
  // h / r_h and dh = (g nw - h' dot(g nw, h') / dim) / r_h (inv_rms = 1 / r_h,
  // proj = dot(g nw, h') / dim).
  struct OutGrad {
    const Bits* g;
    int g_bytes;
    Acc inv_rms = 1, proj = 0;
  };

  __device__ __forceinline__ OutGrad OutGradOf(const Phase2Args& args, const Merge& m,
                                               int64_t t) const {
    const PhaseShape& shape = args.shape;
    OutGrad d;
    d.g = IO::Row(args.grad_out, t, shape.strides.grad_out);
    d.g_bytes = AccessBytes(d.g);
    if (args.input_norm) {
      Acc sum_sq = 0, gh = 0;
      for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
        Acc h[kVec], gx[kVec], nw[kVec];
        m.H(c, h);
        IO::Load(d.g, d.g_bytes, c, dim, gx);
        IO::LoadWeights(norm_weight, c, nw);
        sum_sq += Dot(h, h);
#pragma unroll
        for (int e = 0; e < kVec; ++e) gh += gx[e] * nw[e] * h[e];
      }
      d.inv_rms = Acc(1) / math::Rms(WarpSum(sum_sq), dim, static_cast<Acc>(args.norm_eps));
      d.proj = WarpSum(gh) * d.inv_rms / static_cast<Acc>(dim);
    }
    return d;
  }

  // dh over chunk c, given h there (ignored without the norm) and g.
  __device__ __forceinline__ void Dh(const Phase2Args& args, const OutGrad& d, int64_t c,
                                     const Acc (&h)[kVec], Acc (&dh)[kVec]) const {
    IO::Load(d.g, d.g_bytes, c, dim, dh);
    if (!args.input_norm) return;
    Acc nw[kVec];
    IO::LoadWeights(norm_weight, c, nw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) dh[e] = (dh[e] * nw[e] - h[e] * d.inv_rms * d.proj) * d.inv_rms;
  }

  // do = beta dh, dnorm_weight += g h / r_h into the item's partial row, and
  // dlse = dot(dh, o - p) beta keep (0 without a partial block), returned.
  __device__ __forceinline__ Acc MergeInputGrads(const Phase2Args& args, const Merge& m,
                                                 const OutGrad& d, int64_t item, bool first_token,
                                                 int64_t t) const {
    const PhaseShape& shape = args.shape;
    Bits* grad_o = args.grad_o != nullptr ? IO::Row(args.grad_o, t, shape.strides.grad_source)
                                          : nullptr;
    const int grad_o_bytes = grad_o != nullptr ? AccessBytes(grad_o) : 16;
    Acc* norm_row = args.norm_partials != nullptr
                        ? static_cast<Acc*>(args.norm_partials) + item * dim
                        : nullptr;
    Acc dbeta = 0;
    for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
      Acc h[kVec] = {}, dh[kVec];
      if (args.input_norm || norm_row != nullptr) m.H(c, h);
      Dh(args, d, c, h, dh);
      if (m.p != nullptr) {
        Acc ox[kVec], px[kVec];
        IO::Load(m.o, m.o_bytes, c, dim, ox);
        IO::Load(m.p, m.p_bytes, c, dim, px);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dbeta += dh[e] * (ox[e] - px[e]);
      }
      if (grad_o != nullptr) {
        Acc x[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[e] = m.beta * dh[e];
        IO::Store(grad_o, grad_o_bytes, c, dim, x);
      }
      if (norm_row != nullptr) {
        Acc gx[kVec];
        IO::Load(d.g, d.g_bytes, c, dim, gx);
        AddToItemRow<kVec>(norm_row, c, dim, first_token,
                           [&](int e) { return gx[e] * h[e] * d.inv_rms; });
      }
    }
    return m.p != nullptr ? WarpSum(dbeta) * (m.beta * m.keep) : Acc(0);
  }

  // dp = keep dh + c u + b p (+ grad_partial_in with kFused: what p receives
  // from its other uses, the fused update's p', added before the one rounding
  // to T) and U += c p into the item's partial row, (c, b) = -dlse * the key
  // chain of z_p. Without a partial block, U = 0.
  __device__ __forceinline__ void PartialGrads(const Phase2Args& args, const Merge& m,
                                               const OutGrad& d, Acc dlse, int64_t item,
                                               bool first_token, int64_t t) const {
    constexpr bool kFused = KT::kFused;
    const PhaseShape& shape = args.shape;
    Acc* u_row =
        args.u_partials != nullptr ? static_cast<Acc*>(args.u_partials) + item * dim : nullptr;
    if (m.p == nullptr) {
      if (u_row != nullptr && first_token) {
        for (int64_t i = lane; i < dim; i += kWarpSize) u_row[i] = 0;
      }
      return;
    }
    if (args.grad_partial == nullptr && u_row == nullptr) return;
    const math::KeyChain<Acc> chain = math::KeyGradient(m.z, m.r, scale, dim, args.rmsnorm);
    const Acc coef_u = -dlse * chain.a, coef_p = -dlse * chain.b;
    Bits* grad_p = args.grad_partial != nullptr
                       ? IO::Row(args.grad_partial, t, shape.strides.grad_source)
                       : nullptr;
    const int grad_p_bytes = grad_p != nullptr ? AccessBytes(grad_p) : 16;
    const Bits* grad_p_in =
        kFused ? IO::Row(args.grad_partial_in, t, shape.strides.grad_out) : nullptr;
    const int grad_p_in_bytes = kFused ? AccessBytes(grad_p_in) : 16;
    for (int64_t c = lane; c < shape.row_chunks; c += kWarpSize) {
      Acc px[kVec];
      IO::Load(m.p, m.p_bytes, c, dim, px);
      if (u_row != nullptr) {
        AddToItemRow<kVec>(u_row, c, dim, first_token, [&](int e) { return coef_u * px[e]; });
      }
      if (grad_p == nullptr) continue;
      Acc h[kVec] = {}, dh[kVec], uc[kVec];
      if (args.input_norm) m.H(c, h);
      Dh(args, d, c, h, dh);
      IO::LoadWeights(u, c, uc);
#pragma unroll
      for (int e = 0; e < kVec; ++e) dh[e] = m.keep * dh[e] + coef_u * uc[e] + coef_p * px[e];
      if constexpr (kFused) {
        Acc g_in[kVec];
        IO::Load(grad_p_in, grad_p_in_bytes, c, dim, g_in);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dh[e] += g_in[e];
      }
      IO::Store(grad_p, grad_p_bytes, c, dim, dh);
    }
  }

  int lane;
  int64_t dim, padded;
  const Acc* u;
  const Acc* norm_weight;  // null without the input norm
  Acc scale;
};

// ---------------------------------------------------------------------------
// The launch template: persistent CTAs of kPhase2Warps warps, each warp over
// the weight-gradient items, one token at a time.

template <typename T, bool kBackward, bool kFused>
__global__ void __launch_bounds__(Phase2Traits<T, kBackward, kFused>::kThreads)
    Phase2Kernel(const __grid_constant__ Phase2Args args) {
  using KT = Phase2Traits<T, kBackward, kFused>;
  const Phase2Warp<KT> warp(args);
  const PhaseShape& shape = args.shape;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * KT::kWarps + threadIdx.x / kWarpSize;
       item < shape.num_items; item += static_cast<int64_t>(gridDim.x) * KT::kWarps) {
    const int64_t first = item * shape.tokens_per_item;
    const int64_t end = shape.ItemEnd(first);
    for (int64_t t = first; t < end; ++t) {
      const typename Phase2Warp<KT>::Merge m = warp.MergeOf(args, t);
      if constexpr (kBackward) {
        warp.Backward(args, m, item, t == first, t);
      } else {
        warp.Forward(args, m, t);
      }
    }
  }
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_PHASE2_KERNEL_CUH_
