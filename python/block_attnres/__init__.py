"""attnres: fused Block Attention Residuals (Kimi team, arXiv:2603.15031).

Seed-compatible functions (drop-in for the original PyPTO/Ascend operator; attnres.compat):
    block_attn_res, block_attn_res_backward
    ai_infra_block_attn_res, ai_infra_block_attn_res_backward (the same functions)
Training: block_attn_res_fn (attnres.functional; autograd over the torch.library op
attnres::block_attn_res, torch.compile-ready) and the module attnres.nn.BlockAttnRes.
The report's two-phase schedule: block_attn_res_phase1, block_attn_res_phase2
(attnres.two_phase) and the residual stream attnres.nn.BlockAttnResStream.
The ops, one module each: attnres.ops.
Runtime controls: set_num_threads, get_num_threads, cpu_isa, cpu_isas, set_cpu_isa,
cuda_available.
"""

from ._native import (__version__, cpu_isa, cpu_isas, cuda_available, get_num_threads, set_cpu_isa,
                      set_num_threads)
from .compat import (ai_infra_block_attn_res, ai_infra_block_attn_res_backward,
                     block_attn_res, block_attn_res_backward)
from .functional import block_attn_res_fn
from .two_phase import block_attn_res_phase1, block_attn_res_phase2
from . import compat, nn, ops

__all__ = [
    "__version__",
    "ai_infra_block_attn_res",
    "ai_infra_block_attn_res_backward",
    "block_attn_res",
    "block_attn_res_backward",
    "block_attn_res_fn",
    "block_attn_res_phase1",
    "block_attn_res_phase2",
    "compat",
    "cpu_isa",
    "cpu_isas",
    "cuda_available",
    "get_num_threads",
    "nn",
    "ops",
    "set_cpu_isa",
    "set_num_threads",
]
