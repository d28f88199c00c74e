"""The seed-compatible entry points: drop-in replacements for the original
``ai_infra_block_attn_res`` / ``ai_infra_block_attn_res_backward`` (PyPTO, Ascend).

Same parameters, defaults, return tuples, cache shapes and validation rules
(every one raises ``ValueError`` naming the argument with the expected and the
actual value), including the seed's hardware limits N <= 127 and L <= 128; the
native API (``attnres.block_attn_res_fn``, the C ABI) has no such limits. Unlike
the seed, nothing is stacked: blocks are read in place and gradients are written
straight into separate tensors.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import _validate
from .ops import block_attn_res as _op

_FORWARD = "block_attn_res"
_SEED_MAX_BLOCKS = _validate.SEED_MAX_BLOCKS
_plain_inputs = _validate.plain_inputs


def block_attn_res(
    blocks: List[torch.Tensor],
    proj_weight: torch.Tensor,
    partial_block: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    rmsnorm_eps: float = 1e-6,
    rmsnorm_gamma: Optional[torch.Tensor] = None,
    enable_rmsnorm: bool = True,
    rms_out_flag: bool = False,
    alpha_out_flag: bool = False,
):
    """Block AttnRes forward.

    Args:
        blocks: N completed block representations, each [B, T, D].
        proj_weight: the pseudo-query w, [D].
        partial_block: the current block's partial sum [B, T, D], or None.
        scale: softmax scale on the logits.
        rmsnorm_eps: RMSNorm epsilon.
        rmsnorm_gamma: RMSNorm weight [D] (required when enable_rmsnorm).
        enable_rmsnorm: normalise the keys with RMSNorm.
        rms_out_flag: also return rms_cache [B, T, L, 1] (float32).
        alpha_out_flag: also return alpha_cache [B, T, L] (float32).

    Returns:
        out [B, T, D] alone when both flags are False, else a tuple
        (out[, rms_cache][, alpha_cache]). Caches are float64 for float64 inputs.
    """
    if not (rms_out_flag or alpha_out_flag) and (rmsnorm_gamma is not None or not enable_rmsnorm):
        # The common call, without caches: the native checks in one pass
        # (plain_inputs); the seed's own rules add only N and the rank here. Anything
        # else takes the full validator below, which names what is wrong.
        layout = _plain_inputs(blocks, partial_block, proj_weight, rmsnorm_gamma, scale,
                               rmsnorm_eps, False)
        if layout is not None and 0 < len(blocks) <= _SEED_MAX_BLOCKS and len(layout.shape) == 3:
            return _op.forward(blocks, partial_block, proj_weight, rmsnorm_gamma, rmsnorm_eps,
                               scale, enable_rmsnorm, layout=layout)
    _validate.seed_forward(blocks, proj_weight, partial_block, scale, rmsnorm_eps,
                           rmsnorm_gamma, enable_rmsnorm, rms_out_flag)
    out, rms, alpha = _op.forward_with_caches(blocks, partial_block, proj_weight, rmsnorm_gamma,
                                              rmsnorm_eps, scale, enable_rmsnorm, rms_out_flag,
                                              alpha_out_flag)
    if not (rms_out_flag or alpha_out_flag):
        return out
    results = [out]
    if rms_out_flag:
        results.append(rms.unsqueeze(-1))
    if alpha_out_flag:
        results.append(alpha)
    return tuple(results)


def block_attn_res_backward(
    grad_h: torch.Tensor,
    blocks: List[torch.Tensor],
    proj_weight: torch.Tensor,
    alpha_cache: torch.Tensor,
    partial_block: Optional[torch.Tensor] = None,
    rmsnorm_gamma: Optional[torch.Tensor] = None,
    rms_cache: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    enable_rmsnorm: bool = True,
):
    """Block AttnRes backward.

    Args:
        grad_h: dLoss/dout, [B, T, D].
        blocks, proj_weight, partial_block, rmsnorm_gamma: as given to the forward.
        alpha_cache: the forward's alpha_cache [B, T, L].
        rms_cache: the forward's rms_cache [B, T, L, 1] (required with RMSNorm).
        scale, enable_rmsnorm: as given to the forward.

    Returns:
        (grad_blocks: list of N [B, T, D], grad_partial_block or None,
        grad_proj_weight [D]) plus grad_rmsnorm_gamma [D] when enable_rmsnorm;
        gradients in the input dtype.
    """
    _validate.seed_backward(grad_h, blocks, proj_weight, alpha_cache, partial_block,
                            rmsnorm_gamma, rms_cache, scale, enable_rmsnorm)
    # The seed's backward takes no eps: the caches hold what it would change.
    grad_blocks, grad_partial, grad_w, grad_gamma = _op.gradients(
        "block_attn_res_backward", grad_h, blocks, partial_block, proj_weight,
        rmsnorm_gamma if enable_rmsnorm else None, 0.0, scale, enable_rmsnorm,
        rms_cache=rms_cache if enable_rmsnorm else None, alpha_cache=alpha_cache)
    if enable_rmsnorm:
        return grad_blocks, grad_partial, grad_w, grad_gamma
    return grad_blocks, grad_partial, grad_w


# The seed's names.
ai_infra_block_attn_res = block_attn_res
ai_infra_block_attn_res_backward = block_attn_res_backward
