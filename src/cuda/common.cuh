// Device-side building blocks shared by every attnres CUDA kernel: storage-type
// conversions, row I/O in 16-byte chunks with cache hints, source pointer
// tables, deterministic reductions, and the final reduction of weight-gradient
// partial rows.
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

#include "cuda/plan.h"

namespace attnres::cuda {

constexpr int kWarpSize = plan::kWarpSize;
constexpr int kMaxThreadsPerCta = 1024;
constexpr int kMaxWarpsPerCta = kMaxThreadsPerCta / kWarpSize;

// Up to this many sources, the L device pointers travel by value in the kernel
// argument struct (2 tables x 128 x 8 B = 2 KiB, well under the 4 KiB classic
// parameter limit); above it they are written to a scratch buffer by a kernel
// (runtime.h: FillPointerTable), which CUDA graph capture records like any
// other launch.
constexpr int kMaxInlineSources = 128;

// L device pointers, indexed by source. Kernels receive their argument struct as
// __grid_constant__, so indexing `inline_ptrs` with a runtime index reads the
// constant bank directly instead of copying the whole table to local memory.
// The same layout serves other per-call pointer arrays (two_phase.cu: the S queries'
// outputs), with their own inline capacity.
template <typename Ptr, int kInline>
struct InlinePointerTable {
  Ptr inline_ptrs[kInline];
  const Ptr* device_ptrs;  // non-null exactly when there are more than kInline entries

  __device__ __forceinline__ Ptr Get(int64_t i) const {
    return device_ptrs != nullptr ? device_ptrs[i] : inline_ptrs[i];
  }
};

template <typename Ptr>
using PointerTable = InlinePointerTable<Ptr, kMaxInlineSources>;

// The row strides of a call, in elements (attnres_params: source_row_stride,
// out_row_stride, grad_out_row_stride, grad_source_row_stride). Every kernel
// argument struct carries one, filled from the params in one place
// (runtime.h: RowStridesOf), so no op copies the four fields by hand.
struct RowStrides {
  int64_t source;       // every source row: blocks[i], partial (phase 2: o and p)
  int64_t out;          // out (phase 1: every o_s)
  int64_t grad_out;     // grad_out (phase 1: every g_s)
  int64_t grad_source;  // every source gradient: grad_blocks[i], grad_partial (phase 2: grad_o)
};

// Declares `name` as the launch's dynamic shared memory, an array of T aligned
// to 16 bytes (the widest access any kernel makes into it). Under the CPU
// emulator (tests/cuda_emulation/emu.h), which has no `extern __shared__`, it
// is a pointer to the emulator's per-CTA buffer instead.
#if defined(ATTNRES_CUDA_EMULATOR)
#define ATTNRES_DYNAMIC_SHARED(T, name) T* const name = reinterpret_cast<T*>(emu::DynSmem())
#else
#define ATTNRES_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

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

template <typename T>
__device__ __forceinline__ typename Traits<T>::Acc LoadAcc(const void* base, int64_t index) {
  return Traits<T>::ToAcc(static_cast<const typename Traits<T>::Bits*>(base)[index]);
}

template <typename T>
__device__ __forceinline__ void StoreAcc(void* base, int64_t index, typename Traits<T>::Acc x) {
  static_cast<typename Traits<T>::Bits*>(base)[index] = Traits<T>::FromAcc(x);
}

// ---------------------------------------------------------------------------
// Row I/O in chunks of 16 bytes (8 bf16/fp16 or 4 fp32 elements).
//
// Which thread owns which chunk never depends on addresses, so the arithmetic,
// and every bit of the results, is the same for any alignment; only the width
// of the accesses follows the row: one 128-bit access where the row is 16-byte
// aligned, else the widest that its address allows (8, 4 or 2 bytes). A row's
// chunks all share its alignment (they are 16 bytes apart), so the choice is
// made once per row and is uniform across the warps of a token group.
//
// Cache hints: kKeepInL2 (ld.global.cg) for the backward's first pass, whose
// data the second pass rereads; kStreaming (ld/st.global.cs, evict-first) for
// data touched once, so it does not push the rereads out of L2.

enum class Hint { kDefault, kKeepInL2, kStreaming };

// The widest access, in bytes (16, 8, 4, 2 or 1), that address p allows.
__device__ __forceinline__ int AccessBytes(const void* p) {
  const unsigned low = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p)) & 15u;
  return low == 0 ? 16 : static_cast<int>(low & (0u - low));
}

template <Hint kHint, typename U>
__device__ __forceinline__ U LoadHinted(const U* p) {
  if constexpr (kHint == Hint::kKeepInL2) {
    return __ldcg(p);
  } else if constexpr (kHint == Hint::kStreaming) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

template <Hint kHint, typename U>
__device__ __forceinline__ void StoreHinted(U* p, U x) {
  if constexpr (kHint == Hint::kStreaming) {
    __stcs(p, x);
  } else {
    *p = x;
  }
}

template <typename T>
struct Chunk {
  using Bits = typename Traits<T>::Bits;
  static_assert(sizeof(Bits) == 2 || sizeof(Bits) == 4, "chunks hold 16-bit or 32-bit elements");
  static constexpr int kVec = 16 / sizeof(Bits);
  using Raw = uint4;  // the chunk's 16 bytes, element j in bits [16 j, 16 j + 16) or word j

  // The kVec elements at p, in accesses of `bytes` (AccessBytes of the row).
  template <Hint kHint>
  static __device__ __forceinline__ Raw Load(const Bits* p, int bytes) {
    if (bytes >= 16) return LoadHinted<kHint>(reinterpret_cast<const uint4*>(p));
    if (bytes == 8) {
      const uint2* q = reinterpret_cast<const uint2*>(p);
      const uint2 a = LoadHinted<kHint>(q), b = LoadHinted<kHint>(q + 1);
      return make_uint4(a.x, a.y, b.x, b.y);
    }
    if (sizeof(Bits) == 4 || bytes == 4) {
      const unsigned* q = reinterpret_cast<const unsigned*>(p);
      return make_uint4(LoadHinted<kHint>(q), LoadHinted<kHint>(q + 1), LoadHinted<kHint>(q + 2),
                        LoadHinted<kHint>(q + 3));
    }
    return LoadPartial<kHint>(p, kVec);
  }

  // Element j of a chunk held as its four 32-bit words (Raw's layout).
  static __device__ __forceinline__ Bits Element(const uint32_t (&words)[4], int j) {
    if constexpr (sizeof(Bits) == 4) {
      return static_cast<Bits>(words[j]);
    } else {
      return static_cast<Bits>(words[j / 2] >> (16 * (j % 2)));
    }
  }

  // Sets element j of a chunk's words, which start as zeros.
  static __device__ __forceinline__ void SetElement(uint32_t (&words)[4], int j, Bits x) {
    if constexpr (sizeof(Bits) == 4) {
      words[j] = x;
    } else {
      words[j / 2] |= static_cast<uint32_t>(x) << (16 * (j % 2));
    }
  }

  // The first n elements at p (element-wise accesses), the rest zero.
  template <Hint kHint>
  static __device__ __forceinline__ Raw LoadPartial(const Bits* p, int n) {
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j >= n) break;
      SetElement(words, j, LoadHinted<kHint>(p + j));
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }

  template <Hint kHint>
  static __device__ __forceinline__ void Store(Bits* p, const Raw& raw, int bytes) {
    if (bytes >= 16) {
      StoreHinted<kHint>(reinterpret_cast<uint4*>(p), raw);
    } else if (bytes == 8) {
      uint2* q = reinterpret_cast<uint2*>(p);
      StoreHinted<kHint>(q, make_uint2(raw.x, raw.y));
      StoreHinted<kHint>(q + 1, make_uint2(raw.z, raw.w));
    } else if (sizeof(Bits) == 4 || bytes == 4) {
      unsigned* q = reinterpret_cast<unsigned*>(p);
      StoreHinted<kHint>(q, raw.x);
      StoreHinted<kHint>(q + 1, raw.y);
      StoreHinted<kHint>(q + 2, raw.z);
      StoreHinted<kHint>(q + 3, raw.w);
    } else {
      StorePartial<kHint>(p, raw, kVec);
    }
  }

  // The first n elements of raw to p.
  template <Hint kHint>
  static __device__ __forceinline__ void StorePartial(Bits* p, const Raw& raw, int n) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (j >= n) break;
      StoreHinted<kHint>(p + j, Element(words, j));
    }
  }

  static __device__ __forceinline__ Raw Zero() { return make_uint4(0, 0, 0, 0); }

  static __device__ __forceinline__ void Unpack(const Raw& raw, float (&out)[kVec]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = Traits<T>::ToAcc(Element(words, j));
  }

  static __device__ __forceinline__ Raw Pack(const float (&in)[kVec]) {
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < kVec; ++j) SetElement(words, j, Traits<T>::FromAcc(in[j]));
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};

// ---------------------------------------------------------------------------
// Asynchronous copies, global -> shared memory (cp.async, sm_80 and newer).
//
// A copy in flight holds no register, so a kernel can keep several rows per
// thread in flight where registers would allow one (block_attn_res_fused.cuh:
// the pipelined forward). Each thread waits only for its own copies and reads
// only what it copied, so no barrier is needed between a copy and its use.
// Copies are committed in groups; AsyncWait<N> returns once at most N of this
// thread's committed groups are still pending. On GPUs older than sm_80 the
// copy is an ordinary load and store (the wait then has nothing to wait for).
// The CPU emulator (tests/cuda_emulation/emu.h) defers each copy to the wait
// and poisons its destination until then, so a read before the wait shows.

// Copies the first src_bytes (0..16) of the 16-byte-aligned chunk at src into
// the 16 bytes at dst, zero-filling the rest; src_bytes = 0 reads nothing.
__device__ __forceinline__ void AsyncCopyChunk(uint4* dst, const void* src, int src_bytes) {
#if defined(ATTNRES_CUDA_EMULATOR)
  emu::AsyncCopy(dst, src, src_bytes);
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  uint32_t words[4] = {0, 0, 0, 0};
  const unsigned char* bytes = static_cast<const unsigned char*>(src);
  for (int b = 0; b < src_bytes; ++b) words[b / 4] |= static_cast<uint32_t>(bytes[b]) << (8 * (b % 4));
  *dst = make_uint4(words[0], words[1], words[2], words[3]);
#endif
}

__device__ __forceinline__ void AsyncCommit() {
#if defined(ATTNRES_CUDA_EMULATOR)
  emu::AsyncCommit();
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void AsyncWait() {
#if defined(ATTNRES_CUDA_EMULATOR)
  emu::AsyncWait(kPending);
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

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

// Sums the weight-gradient partial rows [rows, dim] (plan.h: one per chunk of
// tokens) in plan.h's fixed order and writes, in the storage type T,
//   grad_scaled = (scale_by ? scale_by : 1) * U    (dw = gamma * U; U without rmsnorm)
//   grad_times  = times * U                        (dgamma = w * U)
// each output only when non-null. Launch: blocks of (kReduceColumns,
// kReduceRowLanes) threads, ceil(dim / kReduceColumns) of them.
template <typename T>
__global__ void __launch_bounds__(plan::kReduceColumns* plan::kReduceRowLanes)
    ReduceRowsKernel(const typename Traits<T>::Acc* partials, int64_t rows, int64_t dim,
                     const void* scale_by, const void* times, void* grad_scaled,
                     void* grad_times) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc lane_sums[plan::kReduceRowLanes][plan::kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * plan::kReduceColumns + threadIdx.x;
  Acc sum = 0;
  if (col < dim) {
    for (int64_t r = threadIdx.y; r < rows; r += plan::kReduceRowLanes) {
      sum += partials[r * dim + col];
    }
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= dim) return;
  Acc u = lane_sums[0][threadIdx.x];
  for (int y = 1; y < plan::kReduceRowLanes; ++y) u += lane_sums[y][threadIdx.x];
  if (grad_scaled != nullptr) {
    StoreAcc<T>(grad_scaled, col, scale_by != nullptr ? LoadAcc<T>(scale_by, col) * u : u);
  }
  if (grad_times != nullptr) StoreAcc<T>(grad_times, col, LoadAcc<T>(times, col) * u);
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_COMMON_CUH_
