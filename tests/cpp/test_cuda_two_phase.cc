// The two-phase ops on CUDA (src/cuda/two_phase.cu), through the shared phase
// problems (phase_problems.h: every backend against the float64 reference, and on
// CUDA the same bits from a rerun and from grids capped at 1 or 3 CTAs,
// ATTNRES_CUDA_MAX_CTAS): every dtype, S in {1, 6} (and 40: query pointer tables in
// device memory), N in {1, 9} (and 130: block pointer tables in device memory,
// phase 1's statistics in global memory), odd dims, padded rows, misaligned
// buffers, the partial block and the input norm on and off, NULL gradient pointers
// and accumulate_grads, phase 2's fused partial-block update (new_partial bit for
// bit the rounded sum, out bit for bit the plain merge of it; grad_partial_in).
// Every output's padding and guard must be untouched.
//
// Without a device (or in a build without ATTNRES_WITH_CUDA) the GPU cases skip,
// with the reason. scripts/gpu_check.sh runs them with --gtest_filter='CudaTwoPhase*'.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "phase_problems.h"
#include "test_util.h"

namespace attnres_test {
namespace {
#ifndef ATTNRES_WITH_CUDA

TEST(CudaTwoPhase, NeedsTheCudaBuild) {
  GTEST_SKIP() << "skipped: test built without ATTNRES_WITH_CUDA";
}

#else

// Phase 1 as this file runs it: rows dim + pad apart (grad_blocks dim + pad + 1),
// device buffers `offset` elements past an allocation; `sparse` makes some
// grad_query_outs, grad_query_lses and grad_blocks entries NULL.
void CheckOnCuda(Phase1Case c, int64_t pad, size_t offset, bool accumulate, bool sparse) {
  c.source_pad = c.out_pad = c.grad_out_pad = pad;
  c.grad_source_pad = pad + 1;
  c.offset = offset;
  Phase1Grads g;
  g.accumulate = accumulate;
  Rng rng(c.seed + 1000);
  for (int64_t i = 0; accumulate && i < c.blocks; ++i) {
    g.initial.push_back(rng.Normal(c.tokens * c.dim, 0, 1, c.dtype));
  }
  for (int s = 0; sparse && s < c.queries; ++s) {
    if (s % 2 == 1) c.null_grad_outs.push_back(s);
    if (s % 3 == 0) c.null_grad_lses.push_back(s);
  }
  for (int i = 0; sparse && i < c.blocks; ++i) {
    if (i % 3 == 1) g.null_blocks.push_back(i);
  }
  CheckPhase1(c, g);
}

TEST(CudaTwoPhase, Phase1MatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (int64_t S : {1, 6}) {
      for (int64_t N : {1, 9}) {
        for (int64_t D : {37, 1029}) {
          Phase1Case c(dtype, 45, D, N, S, 100 + k);
          c.rmsnorm = k % 4 != 3;
          c.gamma = k % 3 != 2;
          c.scale = k % 2 ? 0.7 : 1.0;
          CheckOnCuda(c, k % 2 ? 3 : 0, k % 3 == 1 ? 1 : 0, k % 5 == 2, k % 4 == 1);
          ++k;
        }
      }
    }
  }
}

// More than 8 tokens per weight-gradient item, many items per CTA when capped.
TEST(CudaTwoPhase, Phase1ManyTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    CheckOnCuda(Phase1Case(dtype, 20000, 64, 5, 6, 7), 0, 0, false, false);
  }
}

// S > 32 and N > 128: the pointer tables in device memory; the statistics of
// a token no longer fit in shared memory.
TEST(CudaTwoPhase, Phase1LargeTables) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64}) {
    CheckOnCuda(Phase1Case(dtype, 10, 17, 130, 40, 9), 0, 0, false, /*sparse=*/true);
  }
}

// A phase 2 case of this file: rows dim + pad apart (the gradients dim + pad + 1),
// query_lse only with the partial block, norm_weight only with the input norm.
Phase2Case CudaPhase2(attnres_dtype dtype, int64_t dim, int k, uint64_t seed) {
  Phase2Case c(dtype, 45, dim, seed);
  c.rmsnorm = k % 4 != 3;
  c.gamma = k % 3 != 2;
  c.norm_weight = k % 5 != 4;
  c.scale = k % 2 ? 0.7 : 1.0;
  c.source_pad = c.out_pad = c.grad_out_pad = k % 2 ? 3 : 0;
  c.grad_source_pad = c.source_pad + 1;
  c.offset = k % 3 == 1 ? 1 : 0;
  return c;
}

void CheckOnCuda(Phase2Case c) {
  c.lse = c.partial;
  c.norm_weight = c.norm_weight && c.input_norm;
  CheckPhase2(c);
}

TEST(CudaTwoPhase, Phase2MatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (bool partial : {true, false}) {
      for (bool input_norm : {false, true}) {
        for (int64_t D : {37, 1029}) {
          Phase2Case c = CudaPhase2(dtype, D, k, 200 + k);
          c.partial = partial;
          c.input_norm = input_norm;
          c.sparse = k % 6 == 5;
          ++k;
          CheckOnCuda(c);
        }
      }
    }
  }
}

// The fused partial-block update, forward and backward apart and together.
TEST(CudaTwoPhase, Phase2FusedUpdateMatchesCpu) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  int k = 0;
  for (attnres_dtype dtype : kAllDTypes) {
    for (int fused : {1, 2, 3}) {  // bit 0: partial_update, bit 1: grad_partial_in
      for (bool input_norm : {false, true}) {
        for (int64_t D : {37, 1029}) {
          Phase2Case c = CudaPhase2(dtype, D, k, 300 + k);
          c.update = fused & 1;
          c.grad_partial_in = fused & 2;
          c.input_norm = input_norm;
          c.sparse = fused == 1 && k % 4 == 0;  // no grad_partial: no grad_partial_in
          ++k;
          CheckOnCuda(c);
        }
      }
    }
  }
}

TEST(CudaTwoPhase, Phase2ManyTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    Phase2Case c(dtype, 20000, 64, 11);
    c.input_norm = c.norm_weight = true;
    CheckOnCuda(c);
    c.update = c.grad_partial_in = true;
    c.seed = 12;
    CheckOnCuda(c);
  }
}

// No tokens: nothing to mix, and the weight gradients are zero, as on the CPU.
TEST(CudaTwoPhase, NoTokens) {
  ATTNRES_SKIP_WITHOUT_CUDA();
  CheckOnCuda(Phase1Case(ATTNRES_DTYPE_FLOAT32, 0, 37, 3, 2, 1), 0, 0, false, false);
  Phase2Case c2(ATTNRES_DTYPE_FLOAT32, 0, 37, 1);
  c2.input_norm = c2.norm_weight = true;
  CheckOnCuda(c2);
}

#endif  // ATTNRES_WITH_CUDA

}  // namespace
}  // namespace attnres_test
