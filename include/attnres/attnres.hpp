// attnres — a thin C++17 layer over the C ABI (attnres.h): typed inputs and
// exceptions. Everything still goes through attnres_forward/attnres_backward.
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
  const T* proj_weight = nullptr;  // [dim]
  const T* gamma = nullptr;        // [dim]; nullptr means ones
  double scale = 1.0;
  double eps = 1e-6;
  bool rmsnorm = true;
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
  return p;
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
  if (!grads.blocks.empty() && grads.blocks.size() != in.blocks.size()) {
    throw Error(ATTNRES_ERROR_INVALID_ARGUMENT,
                "attnres::Backward: grads.blocks must be empty or hold one pointer per block (" +
                    std::to_string(in.blocks.size()) + "), got " +
                    std::to_string(grads.blocks.size()));
  }
  attnres_params p = MakeParams(in);
  p.grad_out = grad_out;
  p.grad_out_row_stride = in.dim;
  p.rms_cache = const_cast<Accum<T>*>(rms_cache);
  p.alpha_cache = const_cast<Accum<T>*>(alpha_cache);
  p.grad_blocks = grads.blocks.empty() ? nullptr
                                       : reinterpret_cast<void* const*>(grads.blocks.data());
  p.grad_partial = grads.partial;
  p.grad_source_row_stride = grads.row_stride ? grads.row_stride : in.dim;
  p.grad_proj_weight = grads.proj_weight;
  p.grad_gamma = grads.gamma;
  Check(attnres_backward(&p));
}

}  // namespace attnres

#endif  // ATTNRES_ATTNRES_HPP_
