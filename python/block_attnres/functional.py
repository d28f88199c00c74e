"""The functional API: ``block_attn_res_fn``, autograd-aware and torch.compile-ready
(the op, its math and what autograd saves: ``attnres.ops.block_attn_res``). The
seed-compatible functions, with explicit caches and the seed's limits, are in
``attnres.compat``; the two phases in ``attnres.two_phase``."""

from .ops.block_attn_res import block_attn_res_fn

__all__ = ["block_attn_res_fn"]
