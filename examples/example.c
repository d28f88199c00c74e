/* Block AttnRes from C: 3 blocks + a partial block, 4 tokens of dim 8, float32. */
#include <stdio.h>

#include "attnres/attnres.h"

enum { kTokens = 4, kDim = 8, kBlocks = 3 };

int main(void) {
  static float blocks[kBlocks][kTokens * kDim], partial[kTokens * kDim], out[kTokens * kDim];
  static float w[kDim], gamma[kDim], alpha[kTokens * (kBlocks + 1)];
  for (int i = 0; i < kBlocks; ++i)
    for (int k = 0; k < kTokens * kDim; ++k) blocks[i][k] = (float)((i + 1) * (k % 5) - 2);
  for (int k = 0; k < kTokens * kDim; ++k) partial[k] = (float)(k % 3);
  for (int d = 0; d < kDim; ++d) { w[d] = 0.1f * (float)d; gamma[d] = 1.0f; }

  const void* block_ptrs[kBlocks] = {blocks[0], blocks[1], blocks[2]};
  attnres_params p;
  attnres_params_init(&p); /* scale 1, eps 1e-6, rmsnorm on */
  p.num_tokens = kTokens;
  p.dim = kDim;
  p.num_blocks = kBlocks;
  p.dtype = ATTNRES_DTYPE_FLOAT32;
  p.blocks = block_ptrs;
  p.partial = partial;
  p.source_row_stride = kDim;
  p.proj_weight = w;
  p.gamma = gamma;
  p.out = out;
  p.out_row_stride = kDim;
  p.alpha_cache = alpha;
  if (attnres_forward(&p) != ATTNRES_OK) {
    fprintf(stderr, "attnres_forward: %s\n", attnres_last_error());
    return 1;
  }
  printf("attnres %s (%s): token 0 alpha =", attnres_version(), attnres_cpu_isa());
  for (int i = 0; i <= kBlocks; ++i) printf(" %.4f", alpha[i]);
  printf("\n");

  p.source_row_stride = kDim - 1; /* an error: rows would overlap */
  if (attnres_forward(&p) != ATTNRES_OK) printf("expected error: %s\n", attnres_last_error());
  return 0;
}
