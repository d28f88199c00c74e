// The contract between the CPU dispatcher (backend.cc, compiled for the baseline
// ISA) and the kernel variants (kernels.cc, compiled once per ISA).
//
// Only plain structs and declarations live here: a function defined in a header
// shared by translation units built with different -march flags could be merged
// by the linker into the baseline path and run AVX-512 code on a CPU without it.
#ifndef ATTNRES_SRC_CPU_KERNEL_TABLE_H_
#define ATTNRES_SRC_CPU_KERNEL_TABLE_H_

#include <cstdint>

#include "attnres/attnres.h"

namespace attnres::cpu {

// Per-call constants, prepared once by the dispatcher. "A" below is the
// accumulation type: float, or double for float64 inputs. Vectors of length
// padded_dim are zero beyond dim so that kernels can run whole SIMD vectors.
struct CallInfo {
  const attnres_params* params;
  int64_t num_sources;         // L
  int64_t padded_dim;          // dim rounded up to two of the widest vectors (a pair)
  int64_t tile_tokens;         // tokens per tile: pass 2 rereads the tile's rows from cache
  const void* const* sources;  // [L] blocks then partial
  void* const* grad_sources;   // [L] (backward; entries may be null)
  const void* wg;              // A[padded_dim]: w * gamma (w when rmsnorm is off)
  bool stream_stores;          // write out / dv rows with non-temporal stores
};

// Scratch of one thread, in units of A, 64-byte aligned (Call::AllocateScratch
// in backend.cc lays it out).
struct Scratch {
  void* acc;    // [2, tile, padded_dim] (backward): two tiles' grad_out rows in A
  void* stats;  // [4, tile, L] (forward), [2, 4, tile, L] (backward): z, r, alpha, dot(g, v)
  void* u;      // [padded_dim] (backward): this chunk's share of U, or null for no dw/dgamma
};

// Tokens [begin, end) of one call. Forward: one tile (end - begin <= tile_tokens),
// writes out and the requested caches. Backward: one chunk (kChunkTokens, the unit
// of the deterministic dw/dgamma sum), tiled inside as a pipeline of two tiles;
// writes the requested source gradients and adds the chunk's U to scratch.u
// (which the caller zeroed).
using RangeFn = void (*)(const CallInfo& info, const Scratch& scratch, int64_t begin,
                         int64_t end);

struct KernelTable {
  const char* name;
  int vector_bytes;
  RangeFn forward[4];   // indexed by attnres_dtype
  RangeFn backward[4];
};

// One per compiled variant; null when the variant is not compiled in.
const KernelTable* BaselineKernels();
const KernelTable* Avx2Kernels();
const KernelTable* Avx512Kernels();
const KernelTable* Avx512Bf16Kernels();

}  // namespace attnres::cpu

#endif  // ATTNRES_SRC_CPU_KERNEL_TABLE_H_
