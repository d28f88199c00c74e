// attnres — a thin C++17 layer over the C ABI (attnres.h): typed inputs and
// exceptions. Everything goes through the C calls (attnres_forward/backward and the
// two phases, attnres_phase1_* / attnres_phase2_*).
#ifndef ATTNRES_ATTNRES_HPP_
#define ATTNRES_ATTNRES_HPP_

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attnres/attnres.h"

namespace attnres {

// 16-bit storage types (bit patterns); use them to select bfloat16 / float16.
struct bfloat16_t { uint16_t bits; };
struct float16_t { uint16_t bits; };

template <typename T> struct DtypeOf;
template <> struct DtypeOf<float> { static constexpr attnres_dtype value = ATTNRES_DTYPE_FLOAT32; };
template <> struct DtypeOf<double> { static constexpr attnres_dtype value = ATTNRES_DTYPE_FLOAT64; };
template <> struct DtypeOf<bfloat16_t> { static constexpr attnres_dtype value = ATTNRES_DTYPE_BFLOAT16; };
template <> struct DtypeOf<float16_t> { static constexpr attnres_dtype value = ATTNRES_DTYPE_FLOAT16; };

// The caches' type: double for double inputs, float otherwise.
template <typename T>
using Accum = std::conditional_t<std::is_same_v<T, double>, double, float>;

class Error : public std::runtime_error {
 public:
  Error(attnres_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  attnres_status status() const { return status_; }

 private:
  attnres_status status_;
};

inline void Check(attnres_status status) {
  if (status != ATTNRES_OK) throw Error(status, attnres_last_error());
}

// The sources and weights of one call. Rows of every per-token buffer are
// `row_stride` elements apart (0 means dim, i.e. dense).
template <typename T>
struct Inputs {
  int64_t num_tokens = 0;
  int64_t dim = 0;
  std::vector<const T*> blocks;  // N pointers, read in place
  const T* partial = nullptr;    // optional
  int64_t row_stride = 0;
  const T* proj_weight = nullptr;  // [dim]; phase 1: [num_queries, dim]
  const T* gamma = nullptr;        // like proj_weight; nullptr means ones
  double scale = 1.0;
  double eps = 1e-6;
  bool rmsnorm = true;
  int64_t num_queries = 1;  // S, phase 1 only
};

// Gradient buffers of the backward; nullptr skips that gradient.
template <typename T>
struct Gradients {
  std::vector<T*> blocks;  // empty, or N pointers (each may be nullptr)
  T* partial = nullptr;
  T* proj_weight = nullptr;
  T* gamma = nullptr;
  int64_t row_stride = 0;  // of blocks and partial; 0 means dim
};

template <typename T>
attnres_params MakeParams(const Inputs<T>& in) {
  attnres_params p;
  attnres_params_init(&p);
  p.num_tokens = in.num_tokens;
  p.dim = in.dim;
  p.num_blocks = static_cast<int64_t>(in.blocks.size());
  p.dtype = DtypeOf<T>::value;
  p.blocks = reinterpret_cast<const void* const*>(in.blocks.data());
  p.partial = in.partial;
  p.source_row_stride = in.row_stride ? in.row_stride : in.dim;
  p.proj_weight = in.proj_weight;
  p.gamma = in.gamma;
  p.scale = in.scale;
  p.eps = in.eps;
  p.rmsnorm = in.rmsnorm ? 1 : 0;
  p.num_queries = in.num_queries;
  return p;
}

// The gradient buffers of the single op and of phase 1 (grads.blocks already
// checked to hold N pointers or none).
template <typename T>
void SetGradients(attnres_params& p, const Gradients<T>& grads, int64_t dim) {
  p.grad_blocks = grads.blocks.empty() ? nullptr
                                       : reinterpret_cast<void* const*>(grads.blocks.data());
  p.grad_partial = grads.partial;
  p.grad_source_row_stride = grads.row_stride ? grads.row_stride : dim;
  p.grad_proj_weight = grads.proj_weight;
  p.grad_gamma = grads.gamma;
}

// Throws unless `v` holds `want` entries (or is empty when `may_be_empty`).
template <typename V>
void CheckCount(const char* function, const char* name, const V& v, size_t want,
                bool may_be_empty = false) {
  if (v.size() == want || (may_be_empty && v.empty())) return;
  throw Error(ATTNRES_ERROR_INVALID_ARGUMENT,
              std::string(function) + ": " + name + " must hold " + std::to_string(want) +
                  " pointers" + (may_be_empty ? " (or none)" : "") + ", got " +
                  std::to_string(v.size()));
}

// h = sum_i softmax(z)_i v_i into `out` (dense rows); caches are [num_tokens, L].
template <typename T>
void Forward(const Inputs<T>& in, T* out, Accum<T>* rms_cache = nullptr,
             Accum<T>* alpha_cache = nullptr) {
  attnres_params p = MakeParams(in);
  p.out = out;
  p.out_row_stride = in.dim;
  p.rms_cache = rms_cache;
  p.alpha_cache = alpha_cache;
  Check(attnres_forward(&p));
}

// Gradients given grad_out = dLoss/dh (dense rows). The caches are optional.
template <typename T>
void Backward(const Inputs<T>& in, const T* grad_out, const Gradients<T>& grads,
              const Accum<T>* rms_cache = nullptr, const Accum<T>* alpha_cache = nullptr) {
  CheckCount("attnres::Backward", "grads.blocks", grads.blocks, in.blocks.size(), true);
  attnres_params p = MakeParams(in);
  p.grad_out = grad_out;
  p.grad_out_row_stride = in.dim;
  p.rms_cache = const_cast<Accum<T>*>(rms_cache);
  p.alpha_cache = const_cast<Accum<T>*>(alpha_cache);
  SetGradients(p, grads, in.dim);
  Check(attnres_backward(&p));
}

// ---- The two-phase schedule (docs/DESIGN.md, "The two phases") ----

// Phase 1: the in.num_queries = S queries over the blocks (in.partial must be null):
// o_s into outs[s] (dense rows), lse_s into lses[s] ([num_tokens]).
template <typename T>
void Phase1Forward(const Inputs<T>& in, const std::vector<T*>& outs,
                   const std::vector<Accum<T>*>& lses) {
  CheckCount("attnres::Phase1Forward", "outs", outs, size_t(in.num_queries));
  CheckCount("attnres::Phase1Forward", "lses", lses, size_t(in.num_queries));
  attnres_params p = MakeParams(in);
  p.query_outs = reinterpret_cast<void* const*>(outs.data());
  p.query_lses = reinterpret_cast<void* const*>(lses.data());
  p.out_row_stride = in.dim;
  Check(attnres_phase1_forward(&p));
}

// Phase 1's gradients given dL/do_s (dense rows; nullptr entries are zero) and
// optionally dL/dlse_s (empty: none). grads.partial must be null; grads.proj_weight
// and grads.gamma are [S, dim]. `accumulate` adds into grads.blocks.
template <typename T>
void Phase1Backward(const Inputs<T>& in, const std::vector<const T*>& grad_outs,
                    const std::vector<const Accum<T>*>& grad_lses, const Gradients<T>& grads,
                    bool accumulate = false) {
  CheckCount("attnres::Phase1Backward", "grad_outs", grad_outs, size_t(in.num_queries));
  CheckCount("attnres::Phase1Backward", "grad_lses", grad_lses, size_t(in.num_queries), true);
  CheckCount("attnres::Phase1Backward", "grads.blocks", grads.blocks, in.blocks.size(), true);
  attnres_params p = MakeParams(in);
  p.grad_query_outs = reinterpret_cast<const void* const*>(grad_outs.data());
  p.grad_out_row_stride = in.dim;
  p.grad_query_lses =
      grad_lses.empty() ? nullptr : reinterpret_cast<const void* const*>(grad_lses.data());
  p.accumulate_grads = accumulate ? 1 : 0;
  SetGradients(p, grads, in.dim);
  Check(attnres_phase1_backward(&p));
}

// Phase 2 of one sub-layer: in.blocks must be empty; in.partial may be null.
template <typename T>
struct Phase2Inputs {
  Inputs<T> in;                          // partial, proj_weight, gamma ([dim]), scalars
  const T* query_out = nullptr;          // o_s, rows of in.row_stride
  const Accum<T>* query_lse = nullptr;   // lse_s [num_tokens]
  bool input_norm = false;               // out = RMSNorm(h) * norm_weight
  const T* norm_weight = nullptr;        // [dim]; nullptr means ones
  double norm_eps = 1e-6;
  // The fused partial-block update (forward only): y, added into in.partial first;
  // the sum p' is merged and written to Phase2Forward's new_partial. The backward
  // takes p' as in.partial and this left null.
  const T* partial_update = nullptr;
};

template <typename T>
attnres_params MakeParams(const Phase2Inputs<T>& in) {
  attnres_params p = MakeParams(in.in);
  p.query_out = in.query_out;
  p.query_lse = in.query_lse;
  p.input_norm = in.input_norm ? 1 : 0;
  p.norm_weight = in.norm_weight;
  p.norm_eps = in.norm_eps;
  p.partial_update = in.partial_update;
  return p;
}

// new_partial: p' [rows of dim], required with in.partial_update.
template <typename T>
void Phase2Forward(const Phase2Inputs<T>& in, T* out, T* new_partial = nullptr) {
  attnres_params p = MakeParams(in);
  p.out = out;
  p.out_row_stride = in.in.dim;
  p.new_partial = new_partial;
  Check(attnres_phase2_forward(&p));
}

// Gradient buffers of phase 2; nullptr skips that gradient.
template <typename T>
struct Phase2Gradients {
  T* query_out = nullptr;
  Accum<T>* query_lse = nullptr;
  T* partial = nullptr;
  T* proj_weight = nullptr;
  T* gamma = nullptr;
  T* norm_weight = nullptr;
  int64_t row_stride = 0;  // of query_out and partial; 0 means dim
  // Added into partial (needs it): the gradient the partial block receives from its
  // other uses (after a fused update, from the later sub-layers), rows of dim.
  const T* partial_in = nullptr;
};

template <typename T>
void Phase2Backward(const Phase2Inputs<T>& in, const T* grad_out, const Phase2Gradients<T>& grads) {
  attnres_params p = MakeParams(in);
  p.grad_out = grad_out;
  p.grad_out_row_stride = in.in.dim;
  p.grad_query_out = grads.query_out;
  p.grad_query_lse = grads.query_lse;
  p.grad_partial = grads.partial;
  p.grad_source_row_stride = grads.row_stride ? grads.row_stride : in.in.dim;
  p.grad_proj_weight = grads.proj_weight;
  p.grad_gamma = grads.gamma;
  p.grad_norm_weight = grads.norm_weight;
  p.grad_partial_in = grads.partial_in;
  Check(attnres_phase2_backward(&p));
}

}  // namespace attnres

#endif  // ATTNRES_ATTNRES_HPP_
