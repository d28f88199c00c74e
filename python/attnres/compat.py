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

from . import _native

_SEED_MAX_BLOCKS = 127
_SEED_MAX_SOURCES = 128


def _too_many_sources(n: int, has_partial: bool) -> str:
    num_sources = n + (1 if has_partial else 0)
    return (f"blocks + partial_block: L = {num_sources} sources (N = {n} blocks"
            f"{' + partial_block' if has_partial else ''}), expected L <= {_SEED_MAX_SOURCES} "
            "(the seed's limit; attnres.block_attn_res_fn has none)")


def _check_block_list(blocks, who: str):
    if not isinstance(blocks, (list, tuple)):
        raise ValueError(f"blocks must be a list of tensors, got {type(blocks).__name__}")
    if len(blocks) == 0:
        raise ValueError("blocks must not be empty")
    if not isinstance(blocks[0], torch.Tensor):
        raise ValueError(f"blocks[0] must be a torch.Tensor, got {type(blocks[0]).__name__}")
    if blocks[0].dim() != 3:
        raise ValueError(f"blocks[0] must be 3-D [B, T, D], got shape {tuple(blocks[0].shape)}")
    if blocks[0].dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"blocks[0] dtype must be bfloat16, float16, float32 or float64, "
                         f"got {blocks[0].dtype}")
    return tuple(blocks[0].shape), blocks[0].dtype, blocks[0].device


def _check_blocks(blocks, shape, dtype, device):
    """Every block against blocks[0]; the per-call cost that grows with N, so the
    message (and its f-string) is only built for a block that fails."""
    for i, block in enumerate(blocks):
        if not (isinstance(block, torch.Tensor) and block.shape == shape
                and block.dtype is dtype and block.device == device
                and block.layout is torch.strided):
            _check_tensor(block, f"blocks[{i}]", shape, dtype, device)


def _check_tensor(t, name: str, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name} shape must be {tuple(shape)}, but got {tuple(t.shape)}")
    if dtype is not None and t.dtype is not dtype:
        raise ValueError(f"{name} dtype must be {dtype}, but got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} device must be {device}, but got {t.device}")
    if t.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, but got layout {t.layout}")


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
    (b, t, d), dtype, device = _check_block_list(blocks, "forward")
    n = len(blocks)
    if n < 1 or n > _SEED_MAX_BLOCKS:
        raise ValueError(f"N (number of blocks) must be in [1, {_SEED_MAX_BLOCKS}], got {n}")
    _check_blocks(blocks, (b, t, d), dtype, device)
    if partial_block is not None:
        _check_tensor(partial_block, "partial_block", (b, t, d), dtype, device)
    _check_tensor(proj_weight, "proj_weight", (d,), dtype, device)
    if enable_rmsnorm and rmsnorm_gamma is None:
        raise ValueError("rmsnorm_gamma is required when enable_rmsnorm=True")
    if rmsnorm_gamma is not None:
        _check_tensor(rmsnorm_gamma, "rmsnorm_gamma", (d,), dtype, device)
    if rms_out_flag and not enable_rmsnorm:
        raise ValueError("rms_out_flag=True is invalid when enable_rmsnorm=False "
                         "(no RMSNorm output to cache)")
    num_sources = n + (partial_block is not None)
    if num_sources > _SEED_MAX_SOURCES:
        raise ValueError(_too_many_sources(n, partial_block is not None))

    out, rms, alpha = _native.forward(
        blocks, partial_block, proj_weight, rmsnorm_gamma, scale=scale, eps=rmsnorm_eps,
        rmsnorm=enable_rmsnorm, want_rms=rms_out_flag, want_alpha=alpha_out_flag,
        _validated=True)
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
    if not isinstance(blocks, (list, tuple)) or len(blocks) == 0:
        raise ValueError("blocks must not be empty")
    (b, t, d), dtype, device = _check_block_list(blocks, "backward")
    n = len(blocks)
    has_partial = partial_block is not None
    num_sources = n + 1 if has_partial else n
    _check_tensor(grad_h, "grad_h", (b, t, d), dtype, device)
    _check_blocks(blocks, (b, t, d), dtype, device)
    if has_partial:
        _check_tensor(partial_block, "partial_block", (b, t, d), dtype, device)
    _check_tensor(proj_weight, "proj_weight", (d,), dtype, device)
    if alpha_cache is None:
        raise ValueError("alpha_cache must be provided and cannot be None")
    _check_tensor(alpha_cache, "alpha_cache", (b, t, num_sources), None, device)
    if enable_rmsnorm:
        if rmsnorm_gamma is None:
            raise ValueError("when enable_rmsnorm is True, rmsnorm_gamma must be provided")
        _check_tensor(rmsnorm_gamma, "rmsnorm_gamma", (d,), dtype, device)
        if rms_cache is None:
            raise ValueError("when enable_rmsnorm is True, rms_cache must be provided")
        _check_tensor(rms_cache, "rms_cache", (b, t, num_sources, 1), None, device)
    if num_sources > _SEED_MAX_SOURCES:
        raise ValueError(_too_many_sources(n, partial_block is not None))

    grad_blocks, grad_partial, grad_w, grad_gamma = _native.backward(
        grad_h, blocks, partial_block, proj_weight, rmsnorm_gamma if enable_rmsnorm else None,
        scale=scale, eps=0.0, rmsnorm=enable_rmsnorm,
        rms_cache=rms_cache if enable_rmsnorm else None, alpha_cache=alpha_cache,
        _validated=True)
    if enable_rmsnorm:
        return grad_blocks, grad_partial, grad_w, grad_gamma
    return grad_blocks, grad_partial, grad_w


# The seed's names.
ai_infra_block_attn_res = block_attn_res
ai_infra_block_attn_res_backward = block_attn_res_backward
