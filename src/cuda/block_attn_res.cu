// The block op on CUDA: turns a validated attnres_params into kernel launches on
// the caller's stream (attnres::CudaForward / CudaBackward).
//
// Dispatch (all of it lives here):
//   bf16 / f16 / f32 rows of up to 2048 16-byte chunks (plan.h's shapes)
//     -> block_attn_res_fused.cuh, the shape plan::ChooseLayout picks from D
//        alone (any alignment: accesses narrow per row where a row is not
//        16-byte aligned, without changing which thread computes what);
//   f64, and rows too wide for the fused kernels -> block_attn_res_generic.cuh.
// dw / dgamma: each chunk of plan::kTokensPerRow tokens writes its partial of
// U = sum_{t,i} a_i v_i to its own scratch row; ReduceRowsKernel sums the rows
// in a fixed order and writes dw = (rmsnorm ? gamma : 1) * U and dgamma = w * U
// in the input dtype. No float atomics; the bits depend on the problem only.
//
// Before anything is launched, every pointer is checked to be memory of the
// current device (runtime.h: CheckDevicePointer). Scratch (pointer tables for
// L > kMaxInlineSources, statistics for large L, the U rows) comes from the
// library's pool, stream-ordered: a call never synchronises the host, and it
// can be captured into a CUDA graph.
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "backends.h"
#include "cuda/block_attn_res_fused.cuh"
#include "cuda/block_attn_res_generic.cuh"
#include "cuda/common.cuh"
#include "cuda/plan.h"
#include "cuda/runtime.h"

namespace attnres {
namespace cuda {
namespace {

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

// Every pointer the call will touch must be memory of the current device.
attnres_status CheckPointers(const attnres_params& p, bool backward, const Device& device) {
  auto check = [&](const void* ptr, const std::string& name) {
    return CheckDevicePointer(ptr, name, device);
  };
  for (int64_t i = 0; i < p.num_blocks; ++i) {
    if (attnres_status s = check(p.blocks[i], "blocks[" + std::to_string(i) + "]"); s != ATTNRES_OK) return s;
  }
  if (attnres_status s = check(p.partial, "partial"); s != ATTNRES_OK) return s;
  if (attnres_status s = check(p.proj_weight, "proj_weight"); s != ATTNRES_OK) return s;
  if (attnres_status s = check(p.rmsnorm ? p.gamma : nullptr, "gamma"); s != ATTNRES_OK) return s;
  if (attnres_status s = check(p.rms_cache, "rms_cache"); s != ATTNRES_OK) return s;
  if (attnres_status s = check(p.alpha_cache, "alpha_cache"); s != ATTNRES_OK) return s;
  if (!backward) return check(p.out, "out");
  if (attnres_status s = check(p.grad_out, "grad_out"); s != ATTNRES_OK) return s;
  if (p.grad_blocks != nullptr) {
    for (int64_t i = 0; i < p.num_blocks; ++i) {
      const std::string name = "grad_blocks[" + std::to_string(i) + "]";
      if (attnres_status s = check(p.grad_blocks[i], name); s != ATTNRES_OK) return s;
    }
  }
  if (attnres_status s = check(p.grad_partial, "grad_partial"); s != ATTNRES_OK) return s;
  if (attnres_status s = check(p.grad_proj_weight, "grad_proj_weight"); s != ATTNRES_OK) return s;
  return check(p.grad_gamma, "grad_gamma");
}

// ---------------------------------------------------------------------------
// The kernels that exist, by shape (plan.h lists the same shapes).

using FusedForwardFn = void (*)(FusedForwardArgs);
using FusedBackwardFn = void (*)(FusedBackwardArgs);

template <typename T>
FusedForwardFn FusedForwardFor(int chunks, bool pipelined) {
  static_assert(ForwardMaxThreads(8) == 256 && ForwardMaxThreads(4) == 256 &&
                    ForwardMaxThreads(2) == 512 && ForwardMaxThreads(1) == 1024,
                "plan::kForwardShapes and the instantiations below disagree");
  static_assert(!plan::ForwardCanPipeline(8) && plan::ForwardCanPipeline(4),
                "plan::ForwardCanPipeline and the instantiations below disagree");
  using plan::ForwardStages;
  switch (chunks) {
    case 8: return FusedForwardKernel<T, 8, 0>;
    case 4: return pipelined ? FusedForwardKernel<T, 4, ForwardStages(4)> : FusedForwardKernel<T, 4, 0>;
    case 2: return pipelined ? FusedForwardKernel<T, 2, ForwardStages(2)> : FusedForwardKernel<T, 2, 0>;
    case 1: return pipelined ? FusedForwardKernel<T, 1, ForwardStages(1)> : FusedForwardKernel<T, 1, 0>;
  }
  return nullptr;
}

// Whether every row the pipelined kernels copy asynchronously starts on a
// 16-byte boundary: the sources', and in the backward grad_out's.
bool PipelinedRowsAligned(const attnres_params& p, bool backward) {
  const auto aligned = [&](const void* base, int64_t stride) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (stride * ElementBytes(p.dtype)) % 16 == 0;
  };
  for (const void* source : SourcePointers(p)) {
    if (!aligned(source, p.source_row_stride)) return false;
  }
  return !backward || aligned(p.grad_out, p.grad_out_row_stride);
}

template <typename T>
FusedBackwardFn FusedBackwardFor(int chunks, bool pipelined) {
  static_assert(BackwardMaxThreads(4) == 512 && BackwardMaxThreads(2) == 512 &&
                    BackwardMaxThreads(1) == 512,
                "plan::kBackwardShapes and the instantiations below disagree");
  static_assert(!plan::BackwardCanPipeline(4) && plan::BackwardCanPipeline(2),
                "plan::BackwardCanPipeline and the instantiations below disagree");
  using plan::BackwardStages;
  switch (chunks) {
    case 4: return FusedBackwardKernel<T, 4, 0>;
    case 2: return pipelined ? FusedBackwardKernel<T, 2, BackwardStages(2)> : FusedBackwardKernel<T, 2, 0>;
    case 1: return pipelined ? FusedBackwardKernel<T, 1, BackwardStages(1)> : FusedBackwardKernel<T, 1, 0>;
  }
  return nullptr;
}

std::string KernelName(const char* kernel, int32_t dtype, int chunks) {
  return std::string(kernel) + "<" + DtypeName(dtype) + ", " + std::to_string(chunks) +
         " chunks>";
}

// The U rows reduced to dw and dgamma.
template <typename T>
attnres_status ReduceWeightGrads(const attnres_params& p, const void* partials, int64_t rows,
                                 cudaStream_t stream) {
  using Acc = typename Traits<T>::Acc;
  const dim3 block(plan::kReduceColumns, plan::kReduceRowLanes);
  const unsigned grid = static_cast<unsigned>((p.dim + plan::kReduceColumns - 1) / plan::kReduceColumns);
  ReduceRowsKernel<T><<<grid, block, 0, stream>>>(
      static_cast<const Acc*>(partials), rows, p.dim, p.rmsnorm ? p.gamma : nullptr,
      p.proj_weight, p.grad_proj_weight, p.grad_gamma);
  return CheckLaunch("ReduceRowsKernel");
}

// The scratch of a backward or generic launch, held until the launcher returns
// (each buffer is freed on the stream, after the launches that use it): the
// pointer tables for more than kMaxInlineSources sources, the statistics, the
// U partial rows. Each is allocated only when needed.
struct LaunchScratch {
  LaunchScratch(const Device& device, cudaStream_t stream)
      : stream(stream),
        source_table(device, stream),
        grad_table(device, stream),
        stats(device, stream),
        partials(device, stream) {}

  // The kernel's pointer tables: the L sources, and the L source gradients
  // (backward) or none (forward).
  template <typename Args>
  attnres_status FillTables(const attnres_params& p, bool backward, Args* args) {
    if (attnres_status s =
            FillPointerTable(SourcePointers(p), stream, &source_table, &args->sources);
        s != ATTNRES_OK) {
      return s;
    }
    return FillPointerTable(backward ? GradPointers(p) : std::vector<void*>(), stream, &grad_table,
                            &args->grads);
  }

  cudaStream_t stream;
  Scratch source_table, grad_table, stats, partials;
};

// The U partial rows (plan.h: one per chunk of kTokensPerRow tokens, dim Acc
// each) when the call wants dw or dgamma (a backward only), else null.
template <typename Acc>
attnres_status AllocateURows(const attnres_params& p, bool backward, Scratch* storage, Acc** rows) {
  *rows = nullptr;
  if (!backward || (p.grad_proj_weight == nullptr && p.grad_gamma == nullptr)) return ATTNRES_OK;
  const size_t bytes = plan::NumPartialRows(p.num_tokens) * p.dim * sizeof(Acc);
  if (attnres_status s = storage->Allocate(bytes, "dw partial rows"); s != ATTNRES_OK) return s;
  *rows = storage->get<Acc>();
  return ATTNRES_OK;
}

// Launches a block-op kernel and, when it wrote U rows (u_rows not null: dw or
// dgamma wanted), reduces them into dw and dgamma.
template <typename T, typename Args>
attnres_status LaunchAndReduce(void (*kernel)(Args), int grid, int threads, size_t shared_bytes,
                               const Args& args, const std::string& name, const attnres_params& p,
                               const void* u_rows, int64_t rows, cudaStream_t stream) {
  kernel<<<grid, threads, shared_bytes, stream>>>(args);
  if (attnres_status s = CheckLaunch(name); s != ATTNRES_OK) return s;
  if (u_rows == nullptr) return ATTNRES_OK;
  return ReduceWeightGrads<T>(p, u_rows, rows, stream);
}

// The fused launchers launch nothing and set *fits = false when the device
// cannot give the launch the shared memory it needs (RunFused falls back).
template <typename T>
attnres_status FusedForward(const attnres_params& p, const plan::Layout& layout, bool pipeline,
                            const Device& device, cudaStream_t stream, bool* fits) {
  constexpr int kVec = Chunk<T>::kVec;
  const int threads = layout.group_threads * layout.groups_per_cta;
  const FusedForwardFn kernel = FusedForwardFor<T>(layout.chunks, pipeline);
  const std::string name =
      KernelName(pipeline ? "FusedForwardKernel (pipelined)" : "FusedForwardKernel", p.dtype,
                 layout.chunks);
  const size_t shared_wg_bytes = static_cast<size_t>(layout.row_chunks * kVec) * sizeof(float);
  const size_t shared_bytes =
      shared_wg_bytes + (pipeline ? plan::ForwardRingBytes(layout.chunks, threads) : 0);
  if (attnres_status s = AllowSharedMemory(reinterpret_cast<const void*>(kernel), shared_bytes,
                                           name, device, fits);
      s != ATTNRES_OK || !*fits) {
    return s;
  }

  FusedForwardArgs args;
  Scratch table_storage(device, stream);
  if (attnres_status s = FillPointerTable(SourcePointers(p), stream, &table_storage, &args.sources);
      s != ATTNRES_OK) {
    return s;
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.out = p.out;
  args.rms_cache = static_cast<float*>(p.rms_cache);
  args.alpha_cache = static_cast<float*>(p.alpha_cache);
  args.num_tokens = p.num_tokens;
  args.strides = RowStridesOf(p);
  args.dim = static_cast<int>(p.dim);
  args.padded_dim = static_cast<int>(shared_wg_bytes / sizeof(float));
  args.num_sources = static_cast<int>(NumSources(p));
  args.group_threads = layout.group_threads;
  args.scale = static_cast<float>(p.scale);
  args.eps = static_cast<float>(p.eps);
  args.rmsnorm = p.rmsnorm != 0;

  const int64_t steps = (p.num_tokens + layout.groups_per_cta - 1) / layout.groups_per_cta;
  int grid = 0;
  if (attnres_status s = PersistentGrid(kernel, threads, shared_bytes, steps, name, device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  return LaunchAndReduce<T>(kernel, grid, threads, shared_bytes, args, name, p, nullptr, 0,
                           stream);
}

template <typename T>
attnres_status FusedBackward(const attnres_params& p, plan::Layout layout, bool pipeline,
                             const Device& device, cudaStream_t stream, bool* fits) {
  const int64_t L = NumSources(p);
  const plan::StatsPlacement placement = plan::PlaceBackwardStats(L, Chunk<T>::kVec, &layout);
  const FusedBackwardFn kernel = FusedBackwardFor<T>(layout.chunks, pipeline);
  const std::string name =
      KernelName(pipeline ? "FusedBackwardKernel (pipelined)" : "FusedBackwardKernel", p.dtype,
                 layout.chunks);
  const int threads = layout.group_threads * layout.groups_per_cta;
  // The ring, when there is one, after the weights and statistics, 16-byte aligned.
  const size_t ring_offset = (placement.dynamic_shared_bytes + 15) / 16;
  const size_t shared_bytes =
      pipeline ? 16 * ring_offset + plan::BackwardRingBytes(layout.chunks, threads)
               : placement.dynamic_shared_bytes;
  if (attnres_status s = AllowSharedMemory(reinterpret_cast<const void*>(kernel), shared_bytes,
                                           name, device, fits);
      s != ATTNRES_OK || !*fits) {
    return s;
  }

  FusedBackwardArgs args;
  LaunchScratch scratch(device, stream);
  if (attnres_status s = scratch.FillTables(p, true, &args); s != ATTNRES_OK) return s;
  const int64_t items = plan::NumWorkItems(p.num_tokens, layout.groups_per_cta);
  int grid = 0;
  if (attnres_status s = PersistentGrid(kernel, threads, shared_bytes, items, name, device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  args.stats_scratch = nullptr;
  if (!placement.shared) {
    const size_t bytes = int64_t{grid} * layout.groups_per_cta * placement.bytes_per_group;
    if (attnres_status s = scratch.stats.Allocate(bytes, "backward statistics"); s != ATTNRES_OK) {
      return s;
    }
    args.stats_scratch = scratch.stats.get<float>();
  }
  if (attnres_status s = AllocateURows(p, true, &scratch.partials, &args.u_partials);
      s != ATTNRES_OK) {
    return s;
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.grad_out = p.grad_out;
  args.rms_cache = static_cast<const float*>(p.rms_cache);
  args.alpha_cache = static_cast<const float*>(p.alpha_cache);
  args.num_tokens = p.num_tokens;
  args.num_items = items;
  args.strides = RowStridesOf(p);
  args.dim = static_cast<int>(p.dim);
  args.num_sources = static_cast<int>(L);
  args.group_threads = layout.group_threads;
  args.stats_floats = static_cast<int>(placement.bytes_per_group / sizeof(float));
  args.weight_floats = static_cast<int>(placement.weight_bytes / sizeof(float));
  args.ring_offset = static_cast<int>(ring_offset);
  args.scale = static_cast<float>(p.scale);
  args.eps = static_cast<float>(p.eps);
  args.rmsnorm = p.rmsnorm != 0;

  return LaunchAndReduce<T>(kernel, grid, threads, shared_bytes, args, name, p,
                           args.u_partials, plan::NumPartialRows(p.num_tokens), stream);
}

template <typename T>
attnres_status GenericLaunch(const attnres_params& p, bool backward, const Device& device,
                             cudaStream_t stream) {
  using Acc = typename Traits<T>::Acc;
  GenericArgs args;
  LaunchScratch scratch(device, stream);
  if (attnres_status s = scratch.FillTables(p, backward, &args); s != ATTNRES_OK) return s;
  const int64_t L = NumSources(p);
  const int64_t rows = plan::NumPartialRows(p.num_tokens);
  const auto kernel = backward ? GenericBackwardKernel<T> : GenericForwardKernel<T>;
  const std::string name = std::string(backward ? "GenericBackwardKernel<" : "GenericForwardKernel<") +
                           DtypeName(p.dtype) + ">";
  int grid = 0;
  if (attnres_status s = PersistentGrid(kernel, kGenericThreads, 0, backward ? rows : p.num_tokens,
                                        name, device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  if (attnres_status s = scratch.stats.Allocate(int64_t{grid} * 4 * L * sizeof(Acc), "statistics");
      s != ATTNRES_OK) {
    return s;
  }
  Acc* u_rows = nullptr;
  if (attnres_status s = AllocateURows(p, backward, &scratch.partials, &u_rows);
      s != ATTNRES_OK) {
    return s;
  }
  args.w = p.proj_weight;
  args.gamma = p.rmsnorm ? p.gamma : nullptr;
  args.grad_out = backward ? p.grad_out : nullptr;
  args.out = backward ? nullptr : p.out;
  args.rms_cache = p.rms_cache;
  args.alpha_cache = p.alpha_cache;
  args.stats_scratch = scratch.stats.get<void>();
  args.u_partials = u_rows;
  args.num_tokens = p.num_tokens;
  args.num_chunks = rows;
  args.dim = p.dim;
  args.strides = RowStridesOf(p);
  args.num_sources = static_cast<int>(L);
  args.scale = p.scale;
  args.eps = p.eps;
  args.rmsnorm = p.rmsnorm != 0;

  return LaunchAndReduce<T>(kernel, grid, kGenericThreads, 0, args, name, p, args.u_partials, rows,
                           stream);
}

// A fused launch on `layout`, or, when the device cannot give it the shared
// memory it needs (the opt-in beyond 48 KiB, on GPUs older than sm_80), the
// register kernels instead of the pipelined ones and the generic kernels
// instead of the register ones.
template <typename T>
attnres_status RunFused(const attnres_params& p, const plan::Layout& layout, bool backward,
                        bool pipeline, const Device& device, cudaStream_t stream) {
  bool fits = true;
  const attnres_status s = backward ? FusedBackward<T>(p, layout, pipeline, device, stream, &fits)
                                    : FusedForward<T>(p, layout, pipeline, device, stream, &fits);
  if (s != ATTNRES_OK || fits) return s;
  if (pipeline) return RunFused<T>(p, layout, backward, false, device, stream);
  return GenericLaunch<T>(p, backward, device, stream);
}

template <typename T>
attnres_status Run(const attnres_params& p, bool backward, const Device& device,
                   cudaStream_t stream) {
  if constexpr (std::is_same_v<T, double>) {
    return GenericLaunch<T>(p, backward, device, stream);
  } else {
    plan::Layout layout;
    const int vec = Chunk<T>::kVec;
    const bool fused = backward ? plan::ChooseLayout(p.dim, vec, plan::kBackwardShapes, &layout)
                                : plan::ChooseLayout(p.dim, vec, plan::kForwardShapes, &layout);
    if (!fused) return GenericLaunch<T>(p, backward, device, stream);
    // The pipelined kernels when the knob asks for them, the shape has them and
    // every row they copy asynchronously is 16-byte aligned.
    bool pipeline = false;
    if (attnres_status s = PipelineKnob(backward, &pipeline); s != ATTNRES_OK) return s;
    pipeline = pipeline && PipelinedRowsAligned(p, backward) &&
               (backward ? plan::BackwardCanPipeline(layout.chunks)
                         : plan::ForwardCanPipeline(layout.chunks));
    return RunFused<T>(p, layout, backward, pipeline, device, stream);
  }
}

// dw and dgamma are sums over the tokens: over none they are zero, as on the CPU (all
// bits zero is +0 in every dtype), and must be written as such.
attnres_status ZeroWeightGrads(const attnres_params& p, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(p.dim) * ElementBytes(p.dtype);
  for (void* grad : {p.grad_proj_weight, p.grad_gamma}) {
    if (grad == nullptr) continue;
    if (const cudaError_t err = cudaMemsetAsync(grad, 0, bytes, stream); err != cudaSuccess) {
      cudaGetLastError();
      return CudaFailure("cudaMemsetAsync of the weight gradients (no tokens)", err);
    }
  }
  return ATTNRES_OK;
}

attnres_status Dispatch(const attnres_params& p, bool backward) {
  const bool weight_grads =
      backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr);
  if (p.num_tokens == 0 && !weight_grads) return ATTNRES_OK;
  const int64_t L = NumSources(p);
  if (L > plan::kMaxSources || p.dim > INT_MAX) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                "attnres CUDA backend: num_sources must be <= " + std::to_string(plan::kMaxSources) +
                    " and dim <= " + std::to_string(INT_MAX) + ", got " + std::to_string(L) +
                    " and " + std::to_string(p.dim));
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  Device device;
  if (attnres_status s = CurrentDevice(stream, &device); s != ATTNRES_OK) return s;
  if (attnres_status s = CheckPointers(p, backward, device); s != ATTNRES_OK) return s;
  if (p.num_tokens == 0) return ZeroWeightGrads(p, stream);
  switch (p.dtype) {
    case ATTNRES_DTYPE_FLOAT32: return Run<float>(p, backward, device, stream);
    case ATTNRES_DTYPE_FLOAT64: return Run<double>(p, backward, device, stream);
    case ATTNRES_DTYPE_BFLOAT16: return Run<__nv_bfloat16>(p, backward, device, stream);
    case ATTNRES_DTYPE_FLOAT16: return Run<__half>(p, backward, device, stream);
  }
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DTYPE, "attnres CUDA backend: unknown dtype " +
                                                   std::to_string(static_cast<int>(p.dtype)));
}

}  // namespace
}  // namespace cuda

attnres_status CudaForward(const attnres_params& p) { return cuda::Dispatch(p, false); }
attnres_status CudaBackward(const attnres_params& p) { return cuda::Dispatch(p, true); }

}  // namespace attnres
