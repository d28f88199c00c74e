// Device-side building blocks shared by every attnres CUDA kernel: storage-type
// conversions, 128-bit row I/O with cache hints, the source pointer tables and
// deterministic reductions.
//
// Every reduction here sums in a fixed order that does not depend on timing:
// warp butterflies (xor shuffles) give every lane the same bits, because IEEE
// addition is commutative and each butterfly step adds the same two values on
// both partners; cross-warp partials go through shared memory and are summed in
// warp order by every thread. So all threads of a token see identical softmax
// statistics, and dw/dgamma are bitwise reproducible.
#ifndef ATTNRES_SRC_CUDA_COMMON_CUH_
#define ATTNRES_SRC_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace attnres::cuda {

constexpr int kWarpSize = 32;
constexpr int kMaxThreadsPerCta = 1024;
constexpr int kMaxWarpsPerCta = kMaxThreadsPerCta / kWarpSize;

// Up to this many sources, the L device pointers travel by value in the kernel
// argument struct (2 tables x 128 x 8 B = 2 KiB, well under the 4 KiB classic
// parameter limit); above it they are copied to a device buffer first.
constexpr int kMaxInlineSources = 128;

// L device pointers, indexed by source. Kernels receive their argument struct as
// __grid_constant__, so indexing `inline_ptrs` with a runtime index reads the
// constant bank directly instead of copying the whole table to local memory.
template <typename Ptr>
struct PointerTable {
  Ptr inline_ptrs[kMaxInlineSources];
  const Ptr* device_ptrs;  // non-null exactly when L > kMaxInlineSources

  __device__ __forceinline__ Ptr Get(int i) const {
    return device_ptrs != nullptr ? device_ptrs[i] : inline_ptrs[i];
  }
};

// ---------------------------------------------------------------------------
// Storage types. Kernels address memory as raw bit patterns (`Bits`) and convert
// to the accumulation type (`Acc`) in registers; bf16 -> fp32 is a shift.

template <typename T>
struct Traits;

template <>
struct Traits<float> {
  using Bits = uint32_t;
  using Acc = float;
  static __device__ __forceinline__ float ToAcc(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits FromAcc(float x) { return __float_as_uint(x); }
};

template <>
struct Traits<__nv_bfloat16> {
  using Bits = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ float ToAcc(Bits b) {
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
  static __device__ __forceinline__ Bits FromAcc(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

template <>
struct Traits<__half> {
  using Bits = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ float ToAcc(Bits b) {
    return __half2float(__ushort_as_half(b));
  }
  static __device__ __forceinline__ Bits FromAcc(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

template <>
struct Traits<double> {
  using Bits = unsigned long long;  // NOLINT(runtime/int): matches __longlong_as_double
  using Acc = double;
  static __device__ __forceinline__ double ToAcc(Bits b) {
    return __longlong_as_double(static_cast<long long>(b));  // NOLINT(runtime/int)
  }
  static __device__ __forceinline__ Bits FromAcc(double x) {
    return static_cast<Bits>(__double_as_longlong(x));
  }
};

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }
__device__ __forceinline__ float Sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double Sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float Max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double Max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------
// Row I/O in chunks of kVec elements: one 128-bit access when kVec * sizeof(T)
// is 16, one scalar access when kVec is 1.
//
// Cache hints: kKeepInL2 (ld.global.cg) for the backward's first pass, whose
// data the second pass rereads; kStreaming (ld/st.global.cs, evict-first) for
// data touched once, so it does not push the rereads out of L2.

enum class Hint { kDefault, kKeepInL2, kStreaming };

template <typename T, int kVec>
struct Chunk {
  using Bits = typename Traits<T>::Bits;
  static constexpr bool kVector = kVec > 1;
  static_assert(!kVector || kVec * sizeof(Bits) == 16, "vector chunks are 128-bit");
  using Raw = typename std::conditional<kVector, uint4, Bits>::type;

  template <Hint kHint>
  static __device__ __forceinline__ Raw Load(const Bits* p) {
    const Raw* q = reinterpret_cast<const Raw*>(p);
    if constexpr (kHint == Hint::kKeepInL2) return __ldcg(q);
    if constexpr (kHint == Hint::kStreaming) return __ldcs(q);
    return *q;
  }

  template <Hint kHint>
  static __device__ __forceinline__ void Store(Bits* p, const Raw& raw) {
    Raw* q = reinterpret_cast<Raw*>(p);
    if constexpr (kHint == Hint::kStreaming) {
      __stcs(q, raw);
    } else {
      *q = raw;
    }
  }

  static __device__ __forceinline__ Raw Zero() {
    if constexpr (kVector) {
      return make_uint4(0, 0, 0, 0);
    } else {
      return Bits{0};
    }
  }

  static __device__ __forceinline__ void Unpack(const Raw& raw, float (&out)[kVec]) {
    if constexpr (!kVector) {
      out[0] = Traits<T>::ToAcc(raw);
    } else {
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      if constexpr (sizeof(Bits) == 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) out[k] = Traits<T>::ToAcc(words[k]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          out[2 * k] = Traits<T>::ToAcc(static_cast<Bits>(words[k] & 0xFFFFu));
          out[2 * k + 1] = Traits<T>::ToAcc(static_cast<Bits>(words[k] >> 16));
        }
      }
    }
  }

  static __device__ __forceinline__ Raw Pack(const float (&in)[kVec]) {
    if constexpr (!kVector) {
      return Traits<T>::FromAcc(in[0]);
    } else {
      uint32_t words[4];
      if constexpr (sizeof(Bits) == 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) words[k] = Traits<T>::FromAcc(in[k]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          words[k] = static_cast<uint32_t>(Traits<T>::FromAcc(in[2 * k])) |
                     (static_cast<uint32_t>(Traits<T>::FromAcc(in[2 * k + 1])) << 16);
        }
      }
      return make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
};

// ---------------------------------------------------------------------------
// Reductions.

template <typename Acc>
__device__ __forceinline__ Acc WarpSum(Acc v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  }
  return v;
}

template <typename Acc>
__device__ __forceinline__ Acc WarpMax(Acc v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = Max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_COMMON_CUH_
