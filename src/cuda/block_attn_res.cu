// The CUDA backend of attnres: turns a validated attnres_params into kernel
// launches on the caller's stream.
//
// Dispatch (all of it lives here):
//   bf16 / f16 / f32, rows that fit a token group's registers -> fused_kernels.cuh
//     128-bit chunks when every row pointer, w and gamma are 16-byte aligned and
//     dim and every row stride are multiples of the chunk; scalar chunks otherwise.
//   f64, or rows too wide for the fused kernels -> generic_kernels.cuh
// dw / dgamma: each token group (fused) or CTA (generic) writes its partial of
// U = sum_{t,i} a_i v_i to a scratch row; ReduceWeightGradsKernel sums the rows
// in a fixed order and writes dw = (rmsnorm ? gamma : 1) * U and dgamma = w * U
// in the input dtype. The grids are sized from the device and the kernel alone,
// so the same call on the same device always sums the same partials in the same
// order: dw/dgamma are bitwise reproducible, with no float atomics anywhere.
//
// Scratch memory (pointer tables for L > kMaxInlineSources, stats for large L,
// the U partials) comes from cudaMallocAsync on the caller's stream and is
// released with cudaFreeAsync on the same stream after the last launch that
// uses it, so a call never synchronises the host.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "backend.h"
#include "cuda/common.cuh"
#include "cuda/block_attn_res_fused.cuh"
#include "cuda/block_attn_res_generic.cuh"

namespace attnres {
namespace cuda {
namespace {

constexpr int kReduceColumns = 32;
constexpr int kReduceRowLanes = 8;
// Dynamic shared memory the backward uses without an opt-in: the 48 KiB every
// device grants a CTA, less room for the kernels' static reduction slots.
constexpr size_t kSharedStatsBudget = 46 * 1024;
// The fused kernels aim for this many threads per CTA when a token needs fewer.
constexpr int kTargetCtaThreads = 256;
// Keeps every per-token index (4 L + 3 W L floats) comfortably inside int.
constexpr int64_t kMaxSources = int64_t{1} << 22;

// Sums the U partials [rows, dim] over rows in a fixed order: row lane y adds
// rows y, y + 8, ... in turn, then lane 0 adds the 8 lane sums in order.
template <typename T>
__global__ void __launch_bounds__(kReduceColumns* kReduceRowLanes)
    ReduceWeightGradsKernel(const typename Traits<T>::Acc* partials, int64_t rows, int64_t dim,
                            const void* w, const void* gamma, void* grad_w, void* grad_gamma) {
  using Acc = typename Traits<T>::Acc;
  __shared__ Acc lane_sums[kReduceRowLanes][kReduceColumns];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceColumns + threadIdx.x;
  Acc sum = 0;
  if (col < dim) {
    for (int64_t r = threadIdx.y; r < rows; r += kReduceRowLanes) sum += partials[r * dim + col];
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= dim) return;
  Acc u = lane_sums[0][threadIdx.x];
  for (int y = 1; y < kReduceRowLanes; ++y) u += lane_sums[y][threadIdx.x];
  // gamma is null when rmsnorm is off or gamma is all ones: dw = U.
  if (grad_w != nullptr) {
    const Acc dw = gamma != nullptr ? LoadAcc<T>(gamma, col) * u : u;
    StoreAcc<T>(grad_w, col, dw);
  }
  if (grad_gamma != nullptr) StoreAcc<T>(grad_gamma, col, LoadAcc<T>(w, col) * u);
}

attnres_status CudaFailure(const std::string& what, cudaError_t err) {
  const attnres_status status = err == cudaErrorMemoryAllocation ? ATTNRES_ERROR_OUT_OF_MEMORY
                                                                   : ATTNRES_ERROR_DEVICE_FAILURE;
  return Fail(status, "attnres CUDA backend: " + what + " failed: " + cudaGetErrorName(err) +
                          " (" + cudaGetErrorString(err) + ")");
}

// Checks the launch just enqueued (configuration errors, and sticky errors of
// earlier work on the device).
attnres_status CheckLaunch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ATTNRES_OK;
  return CudaFailure(std::string("launch of ") + kernel, err);
}

// Stream-ordered scratch: cudaFreeAsync on the same stream in the destructor,
// which runs after every launch that uses the buffer has been enqueued.
class StreamBuffer {
 public:
  explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }

  attnres_status Allocate(size_t bytes, const char* what) {
    const cudaError_t err = cudaMallocAsync(&ptr_, std::max<size_t>(bytes, 1), stream_);
    if (err == cudaSuccess) return ATTNRES_OK;
    ptr_ = nullptr;
    cudaGetLastError();  // allocation errors are not sticky: clear them
    return CudaFailure(std::string("cudaMallocAsync of ") + std::to_string(bytes) +
                           " bytes for " + what,
                       err);
  }

  template <typename U>
  U* get() const {
    return static_cast<U*>(ptr_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

// Fills `table` with L device pointers: by value when they fit, else through
// a device copy of the host array (cudaMemcpyAsync from pageable memory returns
// once the array is staged, so the host vector may die right after).
template <typename Ptr>
attnres_status FillTable(const std::vector<Ptr>& ptrs, cudaStream_t stream,
                         StreamBuffer* storage, PointerTable<Ptr>* table) {
  table->device_ptrs = nullptr;
  if (ptrs.size() <= static_cast<size_t>(kMaxInlineSources)) {
    std::fill(std::begin(table->inline_ptrs), std::end(table->inline_ptrs), Ptr{});
    std::copy(ptrs.begin(), ptrs.end(), table->inline_ptrs);
    return ATTNRES_OK;
  }
  const size_t bytes = ptrs.size() * sizeof(Ptr);
  if (attnres_status s = storage->Allocate(bytes, "the source pointer table"); s != ATTNRES_OK) {
    return s;
  }
  const cudaError_t err =
      cudaMemcpyAsync(storage->get<void>(), ptrs.data(), bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return CudaFailure("cudaMemcpyAsync of the pointer table", err);
  table->device_ptrs = storage->get<const Ptr>();
  return ATTNRES_OK;
}

std::vector<const void*> SourcePointers(const attnres_params& p) {
  std::vector<const void*> ptrs(p.blocks, p.blocks + p.num_blocks);
  if (p.partial != nullptr) ptrs.push_back(p.partial);
  return ptrs;
}

std::vector<void*> GradPointers(const attnres_params& p) {
  std::vector<void*> ptrs(p.num_blocks, nullptr);
  if (p.grad_blocks != nullptr) std::copy(p.grad_blocks, p.grad_blocks + p.num_blocks, ptrs.begin());
  if (p.partial != nullptr) ptrs.push_back(p.grad_partial);
  return ptrs;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int NumSms() {
  int device = 0, num_sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return num_sms;
}

// Persistent grid: as many CTAs as fit on the device at once, at most `work`.
// Depends only on the device and the kernel's resources, never on timing.
template <typename Kernel>
attnres_status PersistentGrid(Kernel kernel, int threads, size_t dynamic_smem, int64_t work,
                              const char* name, int* grid) {
  const int num_sms = NumSms();
  if (num_sms <= 0) {
    return Fail(ATTNRES_ERROR_UNSUPPORTED_DEVICE, "attnres CUDA backend: no current CUDA device");
  }
  int per_sm = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem);
  if (err != cudaSuccess) return CudaFailure(std::string("occupancy query for ") + name, err);
  if (per_sm <= 0) {
    return Fail(ATTNRES_ERROR_DEVICE_FAILURE,
                std::string("attnres CUDA backend: ") + name + " with " + std::to_string(threads) +
                    " threads and " + std::to_string(dynamic_smem) +
                    " bytes of shared memory does not fit on an SM");
  }
  *grid = static_cast<int>(std::min<int64_t>(work, int64_t{per_sm} * num_sms));
  return ATTNRES_OK;
}

// ---------------------------------------------------------------------------
// Fused-kernel dispatch.

using FusedForwardFn = void (*)(FusedForwardArgs);
using FusedBackwardFn = void (*)(FusedBackwardArgs);

template <typename T>
constexpr int VectorWidth() {
  return 16 / sizeof(typename Traits<T>::Bits);
}

template <typename T>
FusedForwardFn FusedForwardFor(bool vector, int chunks) {
  constexpr int kV = VectorWidth<T>();
  switch (chunks * (vector ? 1 : -1)) {
    case 1: return FusedForwardKernel<T, kV, 1>;
    case 2: return FusedForwardKernel<T, kV, 2>;
    case 4: return FusedForwardKernel<T, kV, 4>;
    case -1: return FusedForwardKernel<T, 1, 1>;
    case -2: return FusedForwardKernel<T, 1, 2>;
    case -4: return FusedForwardKernel<T, 1, 4>;
  }
  return nullptr;
}

// The backward keeps g and wg in registers next to two rows in flight, so it
// stops at 2 chunks per thread to stay clear of spills.
template <typename T>
FusedBackwardFn FusedBackwardFor(bool vector, int chunks) {
  constexpr int kV = VectorWidth<T>();
  switch (chunks * (vector ? 1 : -1)) {
    case 1: return FusedBackwardKernel<T, kV, 1>;
    case 2: return FusedBackwardKernel<T, kV, 2>;
    case -1: return FusedBackwardKernel<T, 1, 1>;
    case -2: return FusedBackwardKernel<T, 1, 2>;
  }
  return nullptr;
}

struct FusedLayout {
  bool vector = false;
  int chunks = 0;         // chunks per thread
  int group_threads = 0;  // G, a multiple of 32
  int groups_per_cta = 0;
};

// Picks chunks per thread (largest first among `options`) so that a token's
// row spreads over as few idle lanes as possible: the first option wasting at
// most 1/8 of the group's chunk slots wins, else the least wasteful. Returns
// false when no option fits the kernel's thread limit (the row is too wide).
template <typename Fn>
bool ChooseFusedLayout(int64_t dim, bool vector, int vec_width, const std::vector<int>& options,
                       Fn kernel_for, FusedLayout* layout) {
  const int64_t width = vector ? vec_width : 1;
  const int64_t num_chunks = dim / width;
  int64_t best_waste = INT64_MAX;
  for (int chunks : options) {
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, kernel_for(vector, chunks)) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    const int64_t threads = (num_chunks + chunks - 1) / chunks;
    const int64_t group = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
    if (group > attr.maxThreadsPerBlock) continue;
    const int64_t waste = group * chunks - num_chunks;
    if (waste < best_waste) {
      best_waste = waste;
      layout->vector = vector;
      layout->chunks = chunks;
      layout->group_threads = static_cast<int>(group);
      layout->groups_per_cta = std::max(1, kTargetCtaThreads / layout->group_threads);
      if (waste * 8 <= num_chunks) break;
    }
  }
  return best_waste != INT64_MAX;
}

template <typename T>
attnres_status FusedForward(const attnres_params& p, const FusedLayout& layout,
                            cudaStream_t stream) {
  FusedForwardArgs args;
  StreamBuffer table_storage(stream);
  if (attnres_status s = FillTable(SourcePointers(p), stream, &table_storage, &args.sources);
      s != ATTNRES_OK) {
    return s;
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.out = p.out;
  args.rms_cache = static_cast<float*>(p.rms_cache);
  args.alpha_cache = static_cast<float*>(p.alpha_cache);
  args.num_tokens = p.num_tokens;
  args.source_row_stride = p.source_row_stride;
  args.out_row_stride = p.out_row_stride;
  args.dim = static_cast<int>(p.dim);
  args.num_sources = static_cast<int>(NumSources(p));
  args.group_threads = layout.group_threads;
  args.scale = static_cast<float>(p.scale);
  args.eps = static_cast<float>(p.eps);
  args.rmsnorm = p.rmsnorm != 0;

  const FusedForwardFn kernel = FusedForwardFor<T>(layout.vector, layout.chunks);
  const int threads = layout.group_threads * layout.groups_per_cta;
  const int64_t steps = (p.num_tokens + layout.groups_per_cta - 1) / layout.groups_per_cta;
  const size_t shared_wg_bytes = static_cast<size_t>(p.dim) * sizeof(float);
  int grid = 0;
  if (attnres_status s =
          PersistentGrid(kernel, threads, shared_wg_bytes, steps, "FusedForwardKernel", &grid);
      s != ATTNRES_OK) {
    return s;
  }
  kernel<<<grid, threads, shared_wg_bytes, stream>>>(args);
  return CheckLaunch("FusedForwardKernel");
}

template <typename T>
attnres_status FusedBackward(const attnres_params& p, FusedLayout layout, cudaStream_t stream) {
  FusedBackwardArgs args;
  StreamBuffer source_table(stream), grad_table(stream), stats(stream), partials(stream);
  if (attnres_status s = FillTable(SourcePointers(p), stream, &source_table, &args.sources);
      s != ATTNRES_OK) {
    return s;
  }
  if (attnres_status s = FillTable(GradPointers(p), stream, &grad_table, &args.grads);
      s != ATTNRES_OK) {
    return s;
  }
  const int64_t L = NumSources(p);
  const int group_warps = layout.group_threads / kWarpSize;
  const int64_t stats_floats = FusedBackwardStatsFloats(L, group_warps);
  const size_t stats_bytes = static_cast<size_t>(stats_floats) * sizeof(float);
  // Stats in shared memory when one group's fit the default budget (fewer
  // groups per CTA if need be); otherwise in a global scratch, which costs
  // 16 B per source and token against the 2 L D bytes the token moves anyway.
  const bool global_stats = stats_bytes > kSharedStatsBudget;
  if (!global_stats) {
    layout.groups_per_cta = std::min<int>(layout.groups_per_cta,
                                          static_cast<int>(kSharedStatsBudget / stats_bytes));
  }
  const size_t dynamic_smem = global_stats ? 0 : layout.groups_per_cta * stats_bytes;
  const int threads = layout.group_threads * layout.groups_per_cta;
  const int64_t steps = (p.num_tokens + layout.groups_per_cta - 1) / layout.groups_per_cta;
  const FusedBackwardFn kernel = FusedBackwardFor<T>(layout.vector, layout.chunks);
  int grid = 0;
  if (attnres_status s =
          PersistentGrid(kernel, threads, dynamic_smem, steps, "FusedBackwardKernel", &grid);
      s != ATTNRES_OK) {
    return s;
  }
  const int64_t groups = int64_t{grid} * layout.groups_per_cta;
  args.stats_scratch = nullptr;
  if (global_stats) {
    if (attnres_status s = stats.Allocate(groups * stats_bytes, "backward statistics");
        s != ATTNRES_OK) {
      return s;
    }
    args.stats_scratch = stats.get<float>();
  }
  const bool want_u = p.grad_proj_weight != nullptr || p.grad_gamma != nullptr;
  args.u_partials = nullptr;
  if (want_u) {
    if (attnres_status s = partials.Allocate(groups * p.dim * sizeof(float), "dw partials");
        s != ATTNRES_OK) {
      return s;
    }
    args.u_partials = partials.get<float>();
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.grad_out = p.grad_out;
  args.rms_cache = static_cast<const float*>(p.rms_cache);
  args.alpha_cache = static_cast<const float*>(p.alpha_cache);
  args.num_tokens = p.num_tokens;
  args.source_row_stride = p.source_row_stride;
  args.grad_out_row_stride = p.grad_out_row_stride;
  args.grad_row_stride = p.grad_source_row_stride;
  args.dim = static_cast<int>(p.dim);
  args.num_sources = static_cast<int>(L);
  args.group_threads = layout.group_threads;
  args.stats_floats = static_cast<int>(stats_floats);
  args.scale = static_cast<float>(p.scale);
  args.eps = static_cast<float>(p.eps);
  args.rmsnorm = p.rmsnorm != 0;

  kernel<<<grid, threads, dynamic_smem, stream>>>(args);
  if (attnres_status s = CheckLaunch("FusedBackwardKernel"); s != ATTNRES_OK) return s;
  if (!want_u) return ATTNRES_OK;
  const dim3 reduce_block(kReduceColumns, kReduceRowLanes);
  const unsigned reduce_grid = static_cast<unsigned>((p.dim + kReduceColumns - 1) / kReduceColumns);
  ReduceWeightGradsKernel<T><<<reduce_grid, reduce_block, 0, stream>>>(
      partials.get<float>(), groups, p.dim, p.proj_weight, args.gamma, p.grad_proj_weight,
      p.grad_gamma);
  return CheckLaunch("ReduceWeightGradsKernel");
}

// ---------------------------------------------------------------------------
// Generic-kernel dispatch.

template <typename T>
attnres_status GenericLaunch(const attnres_params& p, bool backward, cudaStream_t stream) {
  using Acc = typename Traits<T>::Acc;
  GenericArgs args;
  StreamBuffer source_table(stream), grad_table(stream), stats(stream), partials(stream);
  if (attnres_status s = FillTable(SourcePointers(p), stream, &source_table, &args.sources);
      s != ATTNRES_OK) {
    return s;
  }
  std::vector<void*> grads;
  if (backward) grads = GradPointers(p);
  if (attnres_status s = FillTable(grads, stream, &grad_table, &args.grads); s != ATTNRES_OK) {
    return s;
  }
  const int64_t L = NumSources(p);
  const auto kernel = backward ? GenericBackwardKernel<T> : GenericForwardKernel<T>;
  const char* name = backward ? "GenericBackwardKernel" : "GenericForwardKernel";
  int grid = 0;
  if (attnres_status s = PersistentGrid(kernel, kGenericThreads, 0, p.num_tokens, name, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  if (attnres_status s = stats.Allocate(int64_t{grid} * 4 * L * sizeof(Acc), "statistics");
      s != ATTNRES_OK) {
    return s;
  }
  const bool want_u = backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr);
  if (want_u) {
    const size_t bytes = int64_t{grid} * p.dim * sizeof(Acc);
    if (attnres_status s = partials.Allocate(bytes, "dw partials"); s != ATTNRES_OK) return s;
    // Generic CTAs accumulate into their row token after token.
    const cudaError_t err = cudaMemsetAsync(partials.get<void>(), 0, bytes, stream);
    if (err != cudaSuccess) return CudaFailure("cudaMemsetAsync of the dw partials", err);
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.grad_out = backward ? p.grad_out : nullptr;
  args.out = backward ? nullptr : p.out;
  args.rms_cache = p.rms_cache;
  args.alpha_cache = p.alpha_cache;
  args.stats_scratch = stats.get<void>();
  args.u_partials = want_u ? partials.get<void>() : nullptr;
  args.num_tokens = p.num_tokens;
  args.dim = p.dim;
  args.source_row_stride = p.source_row_stride;
  args.out_row_stride = p.out_row_stride;
  args.grad_out_row_stride = p.grad_out_row_stride;
  args.grad_row_stride = p.grad_source_row_stride;
  args.num_sources = static_cast<int>(L);
  args.scale = p.scale;
  args.eps = p.eps;
  args.rmsnorm = p.rmsnorm != 0;

  kernel<<<grid, kGenericThreads, 0, stream>>>(args);
  if (attnres_status s = CheckLaunch(name); s != ATTNRES_OK) return s;
  if (!want_u) return ATTNRES_OK;
  const dim3 reduce_block(kReduceColumns, kReduceRowLanes);
  const unsigned reduce_grid = static_cast<unsigned>((p.dim + kReduceColumns - 1) / kReduceColumns);
  ReduceWeightGradsKernel<T><<<reduce_grid, reduce_block, 0, stream>>>(
      partials.get<Acc>(), grid, p.dim, p.proj_weight, args.gamma, p.grad_proj_weight,
      p.grad_gamma);
  return CheckLaunch("ReduceWeightGradsKernel");
}

// ---------------------------------------------------------------------------
// Entry points per dtype.

// True when every row can move in 128-bit chunks of `width` elements.
bool VectorOk(const attnres_params& p, int width, bool backward) {
  if (p.dim % width != 0 || p.source_row_stride % width != 0) return false;
  for (const void* src : SourcePointers(p)) {
    if (!Aligned16(src)) return false;
  }
  if (!Aligned16(p.proj_weight) || (p.rmsnorm && p.gamma != nullptr && !Aligned16(p.gamma))) {
    return false;
  }
  if (!backward) return Aligned16(p.out) && p.out_row_stride % width == 0;
  if (!Aligned16(p.grad_out) || p.grad_out_row_stride % width != 0) return false;
  for (const void* grad : GradPointers(p)) {
    if (grad == nullptr) continue;
    if (!Aligned16(grad) || p.grad_source_row_stride % width != 0) return false;
  }
  return true;
}

template <typename T>
attnres_status Run(const attnres_params& p, bool backward) {
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if constexpr (std::is_same_v<T, double>) {
    return GenericLaunch<T>(p, backward, stream);
  } else {
    constexpr int kV = VectorWidth<T>();
    const bool vector = VectorOk(p, kV, backward);
    FusedLayout layout;
    const bool fused =
        backward ? ChooseFusedLayout(p.dim, vector, kV, {2, 1}, FusedBackwardFor<T>, &layout)
                 : ChooseFusedLayout(p.dim, vector, kV, {4, 2, 1}, FusedForwardFor<T>, &layout);
    if (!fused) return GenericLaunch<T>(p, backward, stream);
    return backward ? FusedBackward<T>(p, layout, stream) : FusedForward<T>(p, layout, stream);
  }
}

attnres_status Dispatch(const attnres_params& p, bool backward) {
  if (p.num_tokens == 0) return ATTNRES_OK;
  const int64_t L = NumSources(p);
  if (L > kMaxSources || p.dim > INT_MAX) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                "attnres CUDA backend: num_sources must be <= " + std::to_string(kMaxSources) +
                    " and dim <= " + std::to_string(INT_MAX) + ", got " + std::to_string(L) +
                    " and " + std::to_string(p.dim));
  }
  switch (p.dtype) {
    case ATTNRES_DTYPE_FLOAT32: return Run<float>(p, backward);
    case ATTNRES_DTYPE_FLOAT64: return Run<double>(p, backward);
    case ATTNRES_DTYPE_BFLOAT16: return Run<__nv_bfloat16>(p, backward);
    case ATTNRES_DTYPE_FLOAT16: return Run<__half>(p, backward);
  }
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DTYPE, "attnres CUDA backend: unknown dtype " +
                                                   std::to_string(static_cast<int>(p.dtype)));
}

}  // namespace
}  // namespace cuda

bool CudaAvailable() {
  // The device count cannot change within a process; ask the driver once.
  static const bool available = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // no driver / no device: not an error to keep around
      return false;
    }
    return count > 0;
  }();
  return available;
}

attnres_status CudaForward(const attnres_params& p) { return cuda::Dispatch(p, false); }
attnres_status CudaBackward(const attnres_params& p) { return cuda::Dispatch(p, true); }

}  // namespace attnres
