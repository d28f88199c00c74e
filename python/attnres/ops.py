"""Block AttnRes as a differentiable ``torch.library`` custom op.

Math (SPEC section 1), per token, over the sources ``V = [b_0, ..., b_{N-1}, p]``
(``L = N + 1`` with a partial block ``p``, ``N`` without)::

    r_i   = sqrt(mean_d(v_i^2) + eps)                       (rmsnorm only)
    k_i   = gamma * v_i / r_i   if rmsnorm   else   v_i
    alpha = softmax_i(scale * dot(w, k_i))
    h     = sum_i alpha_i * v_i

Shapes: every block and the partial block are ``[..., D]`` (usually ``[B, T, D]``),
``w`` and ``gamma`` are ``[D]``; ``h`` is ``[..., D]`` in the input dtype.

Two ops live in the ``attnres`` namespace:

* ``attnres::block_attn_res(Tensor[] blocks, Tensor? partial, Tensor w, Tensor? gamma,
  float eps, float scale, bool rmsnorm) -> Tensor``
* ``attnres::block_attn_res_backward(Tensor grad_out, Tensor[] blocks, Tensor? partial,
  Tensor w, Tensor? gamma, float eps, float scale, bool rmsnorm, bool[] need_blocks,
  bool need_partial, bool need_w, bool need_gamma) -> Tensor[]``; it returns only the
  gradients asked for, in the order (needed blocks..., partial, w, gamma), so that a
  block without ``requires_grad`` costs no gradient write and the output list has a
  length fixed by the arguments (which the fake implementation needs).

What autograd saves: the caller's source tensors, ``w`` and (with rmsnorm) ``gamma``,
all by reference -- never a stacked copy, never the rms/alpha caches. The backward
reads every source once anyway, so it recomputes ``r`` and ``alpha`` in that same pass
instead of keeping ``2 * L`` floats per token alive between forward and backward.

Autocast: nothing is registered for the Autocast keys, so under ``torch.autocast`` the
op sees its inputs unchanged and computes in their dtype (accumulating in fp32, or
fp64 for fp64 inputs). All inputs must share one dtype; a mismatch -- typical under
autocast, where matmul outputs are bf16 while the embedding stays fp32 -- raises a
``ValueError`` that names the argument.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _native

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"attnres.ops needs torch >= 2.4 (torch.library.custom_op), found torch "
                      f"{torch.__version__}")

__all__ = ["block_attn_res_fn"]

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_inputs(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                  gamma: Optional[Tensor]) -> None:
    """Raises ValueError naming the first argument whose shape, dtype or device is off."""
    if len(blocks) == 0 and partial is None:
        raise ValueError("block_attn_res: at least one source is needed: blocks is empty and "
                         "partial is None")
    first, first_name = (blocks[0], "blocks[0]") if len(blocks) else (partial, "partial")
    if not isinstance(first, Tensor):
        raise ValueError(f"block_attn_res: {first_name} must be a torch.Tensor, got "
                         f"{type(first).__name__}")
    if first.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"block_attn_res: {first_name} has dtype {first.dtype}; expected one of "
            f"{', '.join(str(d) for d in _SUPPORTED_DTYPES)}")
    if first.dim() < 1:
        raise ValueError(f"block_attn_res: {first_name} must have at least one dimension "
                         f"([..., D]), got a 0-d tensor")
    dtype, device, shape = first.dtype, first.device, first.shape
    dim = shape[-1]

    def check(name: str, t: object, expected_shape, whose: str) -> None:
        if not isinstance(t, Tensor):
            raise ValueError(f"block_attn_res: {name} must be a torch.Tensor, got "
                             f"{type(t).__name__}")
        if t.dtype != dtype:
            raise ValueError(
                f"block_attn_res: {name} has dtype {t.dtype}, expected {dtype} (the dtype of "
                f"{first_name}); all inputs must share one dtype (the op does not cast, also not "
                f"under torch.autocast: cast the residual stream to one dtype)")
        if t.device != device:
            raise ValueError(f"block_attn_res: {name} is on device {t.device}, expected {device} "
                             f"(the device of {first_name})")
        if tuple(t.shape) != tuple(expected_shape):
            raise ValueError(f"block_attn_res: {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(expected_shape)} ({whose})")

    for i in range(1, len(blocks)):
        check(f"blocks[{i}]", blocks[i], shape, f"the shape of {first_name}")
    if partial is not None:
        check("partial", partial, shape, f"the shape of {first_name}")
    vector_note = f"D, the last dimension of {first_name}"
    check("w", w, (dim,), vector_note)
    if gamma is not None:
        check("gamma", gamma, (dim,), vector_note)


# ---------------------------------------------------------------------------------
# Forward op
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::block_attn_res", mutates_args=())
def _block_attn_res(blocks: list[Tensor], partial: Optional[Tensor], w: Tensor,
                    gamma: Optional[Tensor], eps: float, scale: float, rmsnorm: bool) -> Tensor:
    h, _, _ = _native.forward(blocks, partial, w, gamma if rmsnorm else None,
                              scale=scale, eps=eps, rmsnorm=rmsnorm)
    return h


@_block_attn_res.register_fake
def _block_attn_res_fake(blocks, partial, w, gamma, eps, scale, rmsnorm):
    _check_inputs(blocks, partial, w, gamma)
    first = blocks[0] if len(blocks) else partial
    return first.new_empty(first.shape)


# ---------------------------------------------------------------------------------
# Backward op
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::block_attn_res_backward", mutates_args=())
def _block_attn_res_backward(grad_out: Tensor, blocks: list[Tensor], partial: Optional[Tensor],
                             w: Tensor, gamma: Optional[Tensor], eps: float, scale: float,
                             rmsnorm: bool, need_blocks: list[bool], need_partial: bool,
                             need_w: bool, need_gamma: bool) -> list[Tensor]:
    grad_blocks, grad_partial, grad_w, grad_gamma = _native.backward(
        grad_out, blocks, partial, w, gamma if rmsnorm else None,
        scale=scale, eps=eps, rmsnorm=rmsnorm,
        need_block_grads=list(need_blocks),
        need_partial_grad=need_partial and partial is not None,
        need_proj_weight_grad=need_w,
        need_gamma_grad=need_gamma and rmsnorm)
    grads = [g for g, need in zip(grad_blocks, need_blocks) if need]
    if need_partial and partial is not None:
        grads.append(grad_partial)
    if need_w:
        grads.append(grad_w)
    if need_gamma and rmsnorm:
        grads.append(grad_gamma)
    return grads


@_block_attn_res_backward.register_fake
def _block_attn_res_backward_fake(grad_out, blocks, partial, w, gamma, eps, scale, rmsnorm,
                                  need_blocks, need_partial, need_w, need_gamma):
    grads = [b.new_empty(b.shape) for b, need in zip(blocks, need_blocks) if need]
    if need_partial and partial is not None:
        grads.append(partial.new_empty(partial.shape))
    if need_w:
        grads.append(w.new_empty(w.shape))
    if need_gamma and rmsnorm:
        grads.append(w.new_empty(w.shape))
    return grads


# ---------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    blocks, partial, w, gamma, eps, scale, rmsnorm = inputs
    ctx.num_blocks = len(blocks)
    ctx.eps, ctx.scale, ctx.rmsnorm = eps, scale, rmsnorm
    # By reference; gamma only matters to the backward when rmsnorm is on.
    ctx.save_for_backward(*blocks, partial, w, gamma if rmsnorm else None)


def _backward(ctx, grad_h):
    saved = ctx.saved_tensors
    n = ctx.num_blocks
    blocks = list(saved[:n])
    partial, w, gamma = saved[n:]
    need_blocks, need_partial, need_w, need_gamma = ctx.needs_input_grad[:4]
    need_blocks = [bool(x) for x in need_blocks]
    need_partial = bool(need_partial) and partial is not None
    need_gamma = bool(need_gamma) and ctx.rmsnorm and gamma is not None

    grads = iter(torch.ops.attnres.block_attn_res_backward(
        grad_h, blocks, partial, w, gamma, ctx.eps, ctx.scale, ctx.rmsnorm,
        need_blocks, need_partial, bool(need_w), need_gamma))
    grad_blocks = [next(grads) if need else None for need in need_blocks]
    grad_partial = next(grads) if need_partial else None
    grad_w = next(grads) if need_w else None
    grad_gamma = next(grads) if need_gamma else None
    return grad_blocks, grad_partial, grad_w, grad_gamma, None, None, None


_block_attn_res.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------

def block_attn_res_fn(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                      gamma: Optional[Tensor] = None, *, eps: float = 1e-6, scale: float = 1.0,
                      rmsnorm: bool = True) -> Tensor:
    """Block AttnRes over ``blocks + [partial]``; differentiable in every tensor argument.

    Args:
        blocks: the N completed block representations, each ``[..., D]`` (same shape,
            dtype and device). Read in place: neither stacked nor copied, and saved for
            the backward by reference. May be empty only when ``partial`` is given.
        partial: the running partial block ``[..., D]``, or None (then ``L = N``).
        w: the pseudo-query ``[D]``.
        gamma: the RMSNorm weight ``[D]``; None means ones. Ignored (and given no
            gradient) when ``rmsnorm`` is False.
        eps: added to the mean square inside the RMSNorm.
        scale: multiplies the logits ``dot(w, k_i)``.
        rmsnorm: normalise the keys (not the values) with RMSNorm.

    Returns:
        ``h`` ``[..., D]``, a new contiguous tensor in the input dtype.

    Gradients go to exactly the arguments with ``requires_grad``; a block without it is
    never written a gradient. All tensors must share one dtype (bf16, fp16, fp32, fp64)
    and device; otherwise ``ValueError`` names the offending argument. Under
    ``torch.autocast`` nothing is cast: the op computes in its inputs' dtype.
    """
    blocks = list(blocks)
    if not rmsnorm:
        gamma = None
    _check_inputs(blocks, partial, w, gamma)
    return torch.ops.attnres.block_attn_res(blocks, partial, w, gamma, float(eps), float(scale),
                                            bool(rmsnorm))
