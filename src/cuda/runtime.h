// Host-side services that every CUDA op of attnres shares: errors with the CUDA
// text, the current device, checks that the caller's pointers live on it,
// stream-ordered scratch from the library's own memory pool, source pointer
// tables that CUDA graph capture can record, and persistent grids. An op's file
// (block_attn_res.cu, ...) turns its params into launches with these.
//
// Nothing here synchronises the host or touches process-wide CUDA state that
// the caller owns (the current device, the device's default memory pool).
#ifndef ATTNRES_SRC_CUDA_RUNTIME_H_
#define ATTNRES_SRC_CUDA_RUNTIME_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "cuda/common.cuh"
#include "cuda/plan.h"

namespace attnres::cuda {

// ATTNRES_ERROR_DEVICE_FAILURE (ATTNRES_ERROR_OUT_OF_MEMORY for allocation
// failures, ATTNRES_ERROR_UNSUPPORTED_DEVICE when the library has no code for
// this GPU) with "<what> failed: <CUDA error name> (<CUDA error text>)".
attnres_status CudaFailure(const std::string& what, cudaError_t err);

// Checks the launch just enqueued (configuration errors, and sticky errors of
// earlier work on the device).
attnres_status CheckLaunch(const std::string& kernel);

// The current device, which attnres runs on and never changes (the caller sets
// it; PyTorch does), and its SM count. Fails when the stream belongs to another
// device.
struct Device {
  int id = -1;
  int num_sms = 0;
  size_t max_shared_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};
attnres_status CurrentDevice(cudaStream_t stream, Device* device);

// The call's row strides, as every kernel argument struct carries them.
inline RowStrides RowStridesOf(const attnres_params& p) {
  return {p.source_row_stride, p.out_row_stride, p.grad_out_row_stride, p.grad_source_row_stride};
}

// ATTNRES_ERROR_INVALID_ARGUMENT naming `name` unless `ptr` is memory that
// kernels on `device` may read and write: device memory of that device, or
// managed memory. Host memory (pageable or pinned) and another device's memory
// are refused before anything is launched: a kernel touching them would fault
// (a sticky error that ends the caller's CUDA context) or crawl over the bus.
// A null ptr passes (the op decides which pointers are optional).
attnres_status CheckDevicePointer(const void* ptr, const std::string& name, const Device& device);

// Scratch memory from the library's pool on the current device (one per device,
// created on first use, kept for the process): cudaMallocFromPoolAsync on the
// caller's stream, cudaFreeAsync on the same stream in the destructor, which
// runs after every launch that uses the buffer has been enqueued. The pool keeps
// up to kPoolKeepBytes between calls (the device's default pool keeps nothing,
// so every call would go back to the driver) and leaves the default pool, which
// the caller may have configured, alone. Under stream capture the allocation
// becomes a graph allocation node.
constexpr uint64_t kPoolKeepBytes = uint64_t{256} << 20;
class Scratch {
 public:
  Scratch(const Device& device, cudaStream_t stream) : device_(device), stream_(stream) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();

  attnres_status Allocate(size_t bytes, const std::string& what);

  template <typename U>
  U* get() const {
    return static_cast<U*>(ptr_);
  }

 private:
  Device device_;
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

// Writes n device pointers to `table` (already allocated in `storage`, n * 8
// bytes) with small kernels that carry them by value: stream-ordered, no host
// memory involved, so graph capture records it like any other launch.
attnres_status WritePointerTable(const void* const* ptrs, int64_t n, cudaStream_t stream,
                                 const void** table);

// Fills `table` with the pointers: by value up to its inline capacity, else in a
// device array in `storage` (an empty `ptrs` leaves every entry null).
template <typename Ptr, int kInline>
attnres_status FillPointerTable(const std::vector<Ptr>& ptrs, cudaStream_t stream,
                                Scratch* storage, InlinePointerTable<Ptr, kInline>* table) {
  table->device_ptrs = nullptr;
  std::fill(std::begin(table->inline_ptrs), std::end(table->inline_ptrs), Ptr{});
  if (ptrs.size() <= static_cast<size_t>(kInline)) {
    std::copy(ptrs.begin(), ptrs.end(), table->inline_ptrs);
    return ATTNRES_OK;
  }
  if (attnres_status s = storage->Allocate(ptrs.size() * sizeof(Ptr), "a device pointer table");
      s != ATTNRES_OK) {
    return s;
  }
  std::vector<const void*> untyped(ptrs.begin(), ptrs.end());
  const void** device_table = storage->get<const void*>();
  if (attnres_status s = WritePointerTable(untyped.data(), static_cast<int64_t>(untyped.size()),
                                           stream, device_table);
      s != ATTNRES_OK) {
    return s;
  }
  table->device_ptrs = static_cast<const Ptr*>(static_cast<void*>(device_table));
  return ATTNRES_OK;
}

// ATTNRES_CUDA_MAX_CTAS (environment): caps every persistent grid, so that tests
// can run each CTA over many work items and check that no result bit changes.
// 0 when unset; a value that is not a positive integer fails the call.
attnres_status GridCap(int64_t* cap);

// ATTNRES_CUDA_FORWARD_PIPELINE and ATTNRES_CUDA_BACKWARD_PIPELINE
// (environment): "1" sends the calls of that direction whose rows are all
// 16-byte aligned to the pipelined kernels (block_attn_res_fused.cuh, kStages >
// 0), "0" or unset to the register ones, until a GPU run has measured which is
// faster (docs/CUDA.md). Both give the same bits. Any other value fails the call.
attnres_status PipelineKnob(bool backward, bool* on);

// Reads the kernel's attributes: fails with the CUDA error (no kernel image for
// this GPU's architecture, for one) or, as an internal error, when its thread
// limit is below what the launch plans (plan.h's shapes and the kernels'
// launch bounds disagree).
attnres_status CheckKernel(const void* kernel, int threads, const std::string& name);

// Whether `kernel` can run with `dynamic_smem` bytes of dynamic shared memory on
// `device`: always while it and the kernel's static shared memory stay within the
// 48 KiB every kernel gets (plan::kDefaultSharedBytes); above that, when the device's opt-in limit covers them next to the kernel's
// static shared memory (sm_80 and newer grant 99 KiB or more; a T4 64 KiB). Then
// the kernel is allowed all the device grants (one value per kernel and device,
// so concurrent calls never undo each other's setting). `fits` false: nothing
// was changed, and the caller takes another kernel.
attnres_status AllowSharedMemory(const void* kernel, size_t dynamic_smem, const std::string& name,
                                 const Device& device, bool* fits);

// Persistent grid (plan::PersistentGridSize) for `kernel` launched with
// `threads` and `dynamic_smem`: as many CTAs as the occupancy calculator says
// fit on the device at once, at most `work`. How many CTAs run changes speed
// only: no result depends on it. Above 48 KiB of dynamic shared memory, call
// AllowSharedMemory first.
template <typename Kernel>
attnres_status PersistentGrid(Kernel kernel, int threads, size_t dynamic_smem, int64_t work,
                              const std::string& name, const Device& device, int* grid) {
  if (attnres_status s = CheckKernel(reinterpret_cast<const void*>(kernel), threads, name);
      s != ATTNRES_OK) {
    return s;
  }
  int per_sm = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not left for the next launch check to report
    return CudaFailure("occupancy query for " + name, err);
  }
  if (per_sm <= 0) {
    return CudaFailure(name + " with " + std::to_string(threads) + " threads and " +
                           std::to_string(dynamic_smem) + " bytes of shared memory per CTA",
                       cudaErrorInvalidConfiguration);
  }
  int64_t cap = 0;
  if (attnres_status s = GridCap(&cap); s != ATTNRES_OK) return s;
  *grid = static_cast<int>(plan::PersistentGridSize(work, per_sm, device.num_sms, cap));
  return ATTNRES_OK;
}

}  // namespace attnres::cuda

#endif  // ATTNRES_SRC_CUDA_RUNTIME_H_
