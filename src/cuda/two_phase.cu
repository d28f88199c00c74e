// The two-phase schedule on CUDA, host side: attnres::CudaTwoPhase turns a
// validated attnres_params into launches on the caller's stream. The kernels
// and their math are in phase1_kernel.cuh and phase2_kernel.cuh (shared pieces:
// two_phase_common.cuh); here each kernel's call is planned (work items,
// threads, where the statistics go, the grid) and launched by its own launch
// template (LaunchPhase1, LaunchPhase2), and the weight-gradient partial rows
// are reduced (ReduceRowsKernel, common.cuh).
//
// Scratch (u_s rows, pointer tables beyond the inline ones, the statistics when
// they do not fit in shared memory, the partial rows) comes from the library's
// pool, stream-ordered: a call never synchronises the host and can be captured
// into a CUDA graph.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "cuda/common.cuh"
#include "cuda/phase1_kernel.cuh"
#include "cuda/phase2_kernel.cuh"
#include "cuda/plan.h"
#include "cuda/runtime.h"
#include "cuda/two_phase_common.cuh"

namespace attnres {
namespace cuda {
namespace {

std::string Indexed(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// The S entries of a query pointer array, or S nulls for a null array.
template <typename Ptr>
std::vector<Ptr> QueryPointers(Ptr const* array, int64_t S) {
  return array != nullptr ? std::vector<Ptr>(array, array + S) : std::vector<Ptr>(S, nullptr);
}

// Every pointer the call will touch must be memory of the current device.
attnres_status CheckPointers(const attnres_params& p, int phase, bool backward,
                             const Device& device) {
  std::vector<std::pair<const void*, std::string>> ptrs;
  ptrs.emplace_back(p.proj_weight, "proj_weight");
  if (p.rmsnorm) ptrs.emplace_back(p.gamma, "gamma");
  if (phase == 1) {
    const int64_t S = p.num_queries;
    for (int64_t i = 0; i < p.num_blocks; ++i) ptrs.emplace_back(p.blocks[i], Indexed("blocks", i));
    if (!backward) {
      for (int64_t s = 0; s < S; ++s) {
        ptrs.emplace_back(p.query_outs[s], Indexed("query_outs", s));
        ptrs.emplace_back(p.query_lses[s], Indexed("query_lses", s));
      }
    } else {
      for (int64_t s = 0; s < S; ++s) {
        ptrs.emplace_back(p.grad_query_outs[s], Indexed("grad_query_outs", s));
        if (p.grad_query_lses != nullptr) {
          ptrs.emplace_back(p.grad_query_lses[s], Indexed("grad_query_lses", s));
        }
      }
      for (int64_t i = 0; p.grad_blocks != nullptr && i < p.num_blocks; ++i) {
        ptrs.emplace_back(p.grad_blocks[i], Indexed("grad_blocks", i));
      }
    }
  } else {
    ptrs.emplace_back(p.query_out, "query_out");
    ptrs.emplace_back(p.partial, "partial");
    if (p.partial != nullptr) ptrs.emplace_back(p.query_lse, "query_lse");
    if (p.input_norm) ptrs.emplace_back(p.norm_weight, "norm_weight");
    if (!backward) {
      ptrs.emplace_back(p.out, "out");
      ptrs.emplace_back(p.partial_update, "partial_update");
      ptrs.emplace_back(p.new_partial, "new_partial");
    } else {
      ptrs.emplace_back(p.grad_out, "grad_out");
      ptrs.emplace_back(p.grad_query_out, "grad_query_out");
      ptrs.emplace_back(p.grad_query_lse, "grad_query_lse");
      ptrs.emplace_back(p.grad_partial, "grad_partial");
      ptrs.emplace_back(p.grad_partial_in, "grad_partial_in");
      ptrs.emplace_back(p.grad_norm_weight, "grad_norm_weight");
    }
  }
  if (backward) {
    ptrs.emplace_back(p.grad_proj_weight, "grad_proj_weight");
    ptrs.emplace_back(p.grad_gamma, "grad_gamma");
  }
  for (const auto& [ptr, name] : ptrs) {
    if (attnres_status s = CheckDevicePointer(ptr, name, device); s != ATTNRES_OK) return s;
  }
  return ATTNRES_OK;
}

// The call as the kernels see it.
struct Call {
  const attnres_params& p;
  int phase;
  bool backward;
  Device device;
  cudaStream_t stream;
  int64_t S;  // rows of proj_weight: num_queries in phase 1, 1 in phase 2
  bool weight_grads;
};

// The call's PhaseShape, for either phase: an item writes rows_per_item
// partial rows of dim Acc (phase 1: the S rows of U; phase 2: U and the norm
// weight's), so the budget of TokensPerItem knows their size.
template <typename T>
PhaseShape ShapeOf(const Call& call, int64_t rows_per_item) {
  constexpr int kVec = Io<T>::kVec;
  const attnres_params& p = call.p;
  const int64_t tokens_per_item =
      call.weight_grads ? TokensPerItem(p.num_tokens, rows_per_item, p.dim,
                                        sizeof(typename Traits<T>::Acc))
                        : 1;
  return {p.num_tokens, tokens_per_item, (p.num_tokens + tokens_per_item - 1) / tokens_per_item,
          p.dim, (p.dim + kVec - 1) / kVec, RowStridesOf(p)};
}

std::string KernelName(const char* kernel, const Call& call) {
  return std::string(kernel) + "<" + DtypeName(call.p.dtype) +
         (call.backward ? ", backward>" : ", forward>");
}

// dw = (rmsnorm ? gamma : 1) * U and dgamma = w * U from the partial rows
// [rows, width] (width = S * dim: the S rows of U of an item are contiguous, as
// w and gamma are); and dnorm_weight from its own rows.
template <typename T>
attnres_status ReducePartials(const Call& call, const void* u_rows, const void* norm_rows,
                              int64_t rows) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  const dim3 block(plan::kReduceColumns, plan::kReduceRowLanes);
  const auto launch = [&](const void* partials, int64_t width, const void* scale_by,
                          const void* times, void* grad_scaled, void* grad_times) {
    const int64_t grid = (width + plan::kReduceColumns - 1) / plan::kReduceColumns;
    if (grid > INT_MAX) {
      return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                  "attnres CUDA backend: the weight gradients need num_queries * dim <= " +
                      std::to_string(int64_t{INT_MAX} * plan::kReduceColumns) + ", got " +
                      std::to_string(width));
    }
    ReduceRowsKernel<T><<<static_cast<unsigned>(grid), block, 0, call.stream>>>(
        static_cast<const Acc*>(partials), rows, width, scale_by, times, grad_scaled, grad_times);
    return CheckLaunch("ReduceRowsKernel");
  };
  if (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr) {
    if (attnres_status s = launch(u_rows, call.S * p.dim, p.rmsnorm ? p.gamma : nullptr,
                                  p.proj_weight, p.grad_proj_weight, p.grad_gamma);
        s != ATTNRES_OK) {
      return s;
    }
  }
  if (call.phase == 2 && p.grad_norm_weight != nullptr) {
    return launch(norm_rows, p.dim, nullptr, nullptr, p.grad_norm_weight, nullptr);
  }
  return ATTNRES_OK;
}

// The u_s rows (and phase 2's norm weight) padded to whole chunks of the
// call's shape, for Io::LoadWeights.
template <typename T>
attnres_status PrepareWeights(const Call& call, const PhaseShape& shape, Scratch* storage,
                              const void** weights) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  const int64_t padded = shape.row_chunks * Io<T>::kVec;
  const bool norm = call.phase == 2 && p.input_norm;
  const int64_t total = (call.S + (norm ? 1 : 0)) * padded;
  if (attnres_status s = storage->Allocate(total * sizeof(Acc), "the query rows w * gamma");
      s != ATTNRES_OK) {
    return s;
  }
  // The kernels read these rows with 16-byte loads (Io::LoadWeights).
  if (reinterpret_cast<uintptr_t>(storage->get<void>()) % 16 != 0) {
    return Fail(ATTNRES_ERROR_INTERNAL,
                "attnres CUDA backend: scratch memory from the pool is not 16-byte aligned");
  }
  const int64_t grid = std::clamp<int64_t>((total + 255) / 256, 1, 4096);
  PrepareWeightsKernel<T><<<static_cast<unsigned>(grid), 256, 0, call.stream>>>(
      p.proj_weight, p.rmsnorm ? p.gamma : nullptr, norm ? p.norm_weight : nullptr, norm, call.S,
      p.dim, padded, storage->get<Acc>());
  *weights = storage->get<const void>();
  return CheckLaunch("PrepareWeightsKernel");
}

// Phase 1's pointer tables in device memory where they do not travel inline:
// the blocks, their gradients (backward), and the queries' outputs and lses
// (forward) or their gradients (backward).
struct Phase1Tables {
  Phase1Tables(const Device& device, cudaStream_t stream)
      : blocks(device, stream),
        grad_blocks(device, stream),
        query_a(device, stream),
        query_b(device, stream) {}
  Scratch blocks, grad_blocks, query_a, query_b;
};

attnres_status FillPhase1Tables(const Call& call, Phase1Tables* tables, Phase1Args* args) {
  const attnres_params& p = call.p;
  const int64_t N = p.num_blocks, S = p.num_queries;
  if (attnres_status s = FillPointerTable(std::vector<const void*>(p.blocks, p.blocks + N),
                                          call.stream, &tables->blocks, &args->blocks);
      s != ATTNRES_OK) {
    return s;
  }
  std::vector<void*> grad_ptrs;
  if (call.backward) grad_ptrs = QueryPointers<void*>(p.grad_blocks, N);
  if (attnres_status s =
          FillPointerTable(grad_ptrs, call.stream, &tables->grad_blocks, &args->grad_blocks);
      s != ATTNRES_OK) {
    return s;
  }
  args->any_grad_block =
      std::any_of(grad_ptrs.begin(), grad_ptrs.end(), [](void* ptr) { return ptr != nullptr; });
  attnres_status s = ATTNRES_OK;
  if (!call.backward) {
    s = FillPointerTable(QueryPointers<void*>(p.query_outs, S), call.stream, &tables->query_a,
                         &args->outs);
    if (s == ATTNRES_OK) {
      s = FillPointerTable(QueryPointers<void*>(p.query_lses, S), call.stream, &tables->query_b,
                           &args->lses);
    }
    args->grad_outs = {};  // all null
    args->grad_lses = {};  // all null
  } else {
    args->outs = {};  // all null
    args->lses = {};  // all null
    s = FillPointerTable(QueryPointers<const void*>(p.grad_query_outs, S), call.stream,
                         &tables->query_a, &args->grad_outs);
    if (s == ATTNRES_OK) {
      s = FillPointerTable(QueryPointers<const void*>(p.grad_query_lses, S), call.stream,
                           &tables->query_b, &args->grad_lses);
    }
  }
  return s;
}

// Phase 1's launch template: one thread per 16-byte chunk of a row, in whole
// warps, up to kPhase1MaxThreads; the statistics in shared memory when they
// fit, else in a global scratch (`stats`) of at most kGlobalStatsBudgetBytes,
// which caps the grid.
template <typename T, bool kBackward>
attnres_status LaunchPhase1(const Call& call, Scratch* stats, Phase1Args* args) {
  using Acc = typename Traits<T>::Acc;
  const auto kernel = Phase1Kernel<T, kBackward>;
  const std::string name = KernelName("Phase1Kernel", call);
  const int threads = static_cast<int>(std::clamp<int64_t>(
      (args->shape.row_chunks + kWarpSize - 1) / kWarpSize * kWarpSize, kWarpSize,
      kPhase1MaxThreads));
  args->stats_elems =
      Phase1StatsElems(args->num_blocks, args->num_queries, threads / kWarpSize, kBackward);
  const size_t stats_bytes = static_cast<size_t>(args->stats_elems) * sizeof(Acc);
  const bool shared = stats_bytes <= kSharedStatsBudget;
  int grid = 0;
  if (attnres_status s = PersistentGrid(kernel, threads, shared ? stats_bytes : 0,
                                        args->shape.num_items, name, call.device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  args->stats_global = nullptr;
  if (!shared) {
    grid = static_cast<int>(std::clamp<int64_t>(
        kGlobalStatsBudgetBytes / static_cast<int64_t>(stats_bytes), 1, grid));
    if (attnres_status s = stats->Allocate(grid * stats_bytes, "phase 1 statistics");
        s != ATTNRES_OK) {
      return s;
    }
    args->stats_global = stats->get<void>();
  }
  kernel<<<grid, threads, shared ? stats_bytes : 0, call.stream>>>(*args);
  return CheckLaunch(name);
}

template <typename T>
attnres_status RunPhase1(const Call& call) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  const int64_t S = p.num_queries;
  Scratch weights(call.device, call.stream), stats(call.device, call.stream),
      partials(call.device, call.stream);
  Phase1Tables tables(call.device, call.stream);

  Phase1Args args;
  args.shape = ShapeOf<T>(call, S);
  if (call.weight_grads) {
    // Every item writes all of its rows (its first token stores, the rest add).
    if (attnres_status s = partials.Allocate(args.shape.num_items * S * p.dim * sizeof(Acc),
                                             "the dw/dgamma partial rows");
        s != ATTNRES_OK) {
      return s;
    }
  }
  if (p.num_tokens == 0) {  // dw = dgamma = 0, as on the CPU
    return call.weight_grads ? ReducePartials<T>(call, partials.get<void>(), nullptr, 0)
                             : ATTNRES_OK;
  }
  if (attnres_status s = PrepareWeights<T>(call, args.shape, &weights, &args.u);
      s != ATTNRES_OK) {
    return s;
  }
  if (attnres_status s = FillPhase1Tables(call, &tables, &args); s != ATTNRES_OK) return s;
  args.u_partials = call.weight_grads ? partials.get<void>() : nullptr;
  args.num_blocks = p.num_blocks;
  args.num_queries = S;
  args.scale = p.scale;
  args.eps = p.eps;
  args.rmsnorm = p.rmsnorm != 0;
  args.accumulate = call.backward && p.accumulate_grads != 0;

  if (attnres_status s = call.backward ? LaunchPhase1<T, true>(call, &stats, &args)
                                       : LaunchPhase1<T, false>(call, &stats, &args);
      s != ATTNRES_OK) {
    return s;
  }
  if (!call.weight_grads) return ATTNRES_OK;
  return ReducePartials<T>(call, partials.get<void>(), nullptr, args.shape.num_items);
}

// Phase 2's launch template: persistent CTAs of kPhase2Warps warps, a warp per
// weight-gradient item. kFused: the fused partial-block update's kernels.
template <typename T, bool kBackward, bool kFused>
attnres_status LaunchPhase2(const Call& call, const Phase2Args& args) {
  const auto kernel = Phase2Kernel<T, kBackward, kFused>;
  const std::string name =
      KernelName("Phase2Kernel", call) + (kFused ? " (fused partial-block update)" : "");
  int grid = 0;
  const int64_t ctas = (args.shape.num_items + kPhase2Warps - 1) / kPhase2Warps;
  if (attnres_status s = PersistentGrid(kernel, kPhase2Threads, 0, ctas, name, call.device, &grid);
      s != ATTNRES_OK) {
    return s;
  }
  kernel<<<grid, kPhase2Threads, 0, call.stream>>>(args);
  return CheckLaunch(name);
}

template <typename T>
attnres_status RunPhase2(const Call& call) {
  using Acc = typename Traits<T>::Acc;
  const attnres_params& p = call.p;
  Scratch weights(call.device, call.stream), partials(call.device, call.stream);

  Phase2Args args;
  args.shape = ShapeOf<T>(call, 2);
  const bool want_u = call.backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr);
  const bool want_norm = call.backward && p.grad_norm_weight != nullptr;
  // [items, dim] of U, then [items, dim] of the norm weight's gradient.
  const int64_t rows_bytes = args.shape.num_items * p.dim * static_cast<int64_t>(sizeof(Acc));
  if (call.weight_grads) {
    if (attnres_status s = partials.Allocate(2 * rows_bytes, "the dw/dgamma/dnorm_weight partial rows");
        s != ATTNRES_OK) {
      return s;
    }
  }
  char* u_rows = partials.get<char>();
  char* norm_rows = u_rows != nullptr ? u_rows + rows_bytes : nullptr;
  if (p.num_tokens == 0) {  // the weight gradients are zero, as on the CPU
    return call.weight_grads ? ReducePartials<T>(call, u_rows, norm_rows, 0) : ATTNRES_OK;
  }
  if (attnres_status s = PrepareWeights<T>(call, args.shape, &weights, &args.weights);
      s != ATTNRES_OK) {
    return s;
  }
  args.o = p.query_out;
  args.partial = p.partial;
  args.partial_update = call.backward ? nullptr : p.partial_update;
  args.new_partial = call.backward ? nullptr : p.new_partial;
  args.lse = p.query_lse;
  args.out = call.backward ? nullptr : p.out;
  args.grad_out = call.backward ? p.grad_out : nullptr;
  args.grad_o = call.backward ? p.grad_query_out : nullptr;
  args.grad_lse = call.backward ? p.grad_query_lse : nullptr;
  args.grad_partial = call.backward ? p.grad_partial : nullptr;
  args.grad_partial_in = call.backward ? p.grad_partial_in : nullptr;
  args.u_partials = want_u ? u_rows : nullptr;
  args.norm_partials = want_norm ? norm_rows : nullptr;
  args.scale = p.scale;
  args.eps = p.eps;
  args.norm_eps = p.norm_eps;
  args.rmsnorm = p.rmsnorm != 0;
  args.input_norm = p.input_norm != 0;

  const bool fused = call.backward ? p.grad_partial_in != nullptr : p.partial_update != nullptr;
  const attnres_status s =
      call.backward ? (fused ? LaunchPhase2<T, true, true>(call, args)
                             : LaunchPhase2<T, true, false>(call, args))
                    : (fused ? LaunchPhase2<T, false, true>(call, args)
                             : LaunchPhase2<T, false, false>(call, args));
  if (s != ATTNRES_OK) return s;
  if (!call.weight_grads) return ATTNRES_OK;
  return ReducePartials<T>(call, u_rows, norm_rows, args.shape.num_items);
}

template <typename T>
attnres_status Run(const Call& call) {
  return call.phase == 1 ? RunPhase1<T>(call) : RunPhase2<T>(call);
}

}  // namespace
}  // namespace cuda

attnres_status CudaTwoPhase(const attnres_params& p, int phase, bool backward) {
  using namespace cuda;
  const char* function = phase == 1 ? (backward ? "attnres_phase1_backward" : "attnres_phase1_forward")
                                    : (backward ? "attnres_phase2_backward" : "attnres_phase2_forward");
  const bool weight_grads =
      backward && (p.grad_proj_weight != nullptr || p.grad_gamma != nullptr ||
                   (phase == 2 && p.grad_norm_weight != nullptr));
  if (p.num_tokens == 0 && !weight_grads) return ATTNRES_OK;
  if (phase == 1 &&
      (p.num_blocks > plan::kMaxSources || p.num_queries > plan::kMaxSources ||
       p.num_blocks * (2 * p.num_queries + 1) > kMaxQueryBlockProduct)) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                std::string(function) + ": the CUDA backend needs num_blocks and num_queries <= " +
                    std::to_string(plan::kMaxSources) + " and num_blocks * (2 num_queries + 1) <= " +
                    std::to_string(kMaxQueryBlockProduct) + ", got num_blocks = " +
                    std::to_string(p.num_blocks) + " and num_queries = " +
                    std::to_string(p.num_queries));
  }
  Call call{p, phase, backward, Device{}, static_cast<cudaStream_t>(p.stream),
            phase == 1 ? p.num_queries : 1, weight_grads};
  if (attnres_status s = CurrentDevice(call.stream, &call.device); s != ATTNRES_OK) return s;
  if (attnres_status s = CheckPointers(p, phase, backward, call.device); s != ATTNRES_OK) return s;
  switch (p.dtype) {
    case ATTNRES_DTYPE_FLOAT32: return Run<float>(call);
    case ATTNRES_DTYPE_FLOAT64: return Run<double>(call);
    case ATTNRES_DTYPE_BFLOAT16: return Run<__nv_bfloat16>(call);
    case ATTNRES_DTYPE_FLOAT16: return Run<__half>(call);
  }
  return Fail(ATTNRES_ERROR_UNSUPPORTED_DTYPE,
              std::string(function) + ": unknown dtype " + std::to_string(p.dtype));
}

}  // namespace attnres
