"""The autograd-aware function of Block AttnRes, for training.

``block_attn_res_fn`` is the ``torch.library`` op ``attnres::block_attn_res``
(``attnres.ops``: the math, what autograd saves, autocast), so it works with
``loss.backward()`` and under ``torch.compile(fullgraph=True)``. In eager mode it
skips the dispatcher, whose overhead dwarfs the kernel on a few tokens: it calls the
library directly (no autograd needed) or through ``attnres.ops.BlockAttnResFunction``
(the same native calls, the same saved tensors, the same bits). The seed-compatible
functions, with explicit caches and the seed's limits, are in ``attnres.compat``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _native, _validate, ops  # ops also registers torch.ops.attnres.*

_FUNCTION = "block_attn_res_fn"
_eager = _native.eager
_grad_enabled = torch.is_grad_enabled
_plain_inputs = _validate.plain_inputs
_apply = ops.apply_block_attn_res

__all__ = ["block_attn_res_fn"]


def block_attn_res_fn(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                      gamma: Optional[Tensor] = None, *, eps: float = 1e-6, scale: float = 1.0,
                      rmsnorm: bool = True) -> Tensor:
    """Block AttnRes over ``blocks + [partial]``; differentiable in every tensor argument.

    Args:
        blocks: a list or tuple of the N completed block representations, each ``[..., D]``
            (same shape, dtype and device). Read in place: neither stacked nor copied, and
            saved for the backward by reference. May be empty only when ``partial`` is
            given. A single tensor is refused (it is not a list of blocks).
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
    if not rmsnorm:
        gamma = None
    if _eager():  # the fast path (attnres.ops); anything unusual falls through
        grad = _grad_enabled()
        plain = _plain_inputs(blocks, partial, w, gamma, scale, eps, grad)
        if plain is not None:
            if plain[3]:  # requires_grad
                return _apply((len(blocks), eps, scale, rmsnorm, plain, _FUNCTION),
                              *blocks, partial, w, gamma)
            # _native.forward looked up per call: tests spy on it.
            return _native.forward(blocks, partial, w, gamma, scale=scale, eps=eps,
                                   rmsnorm=rmsnorm, function=_FUNCTION, _plain=plain)[0]
    # Checked here, not only inside the op, so that torch.compile reports the error
    # while tracing, as it is, naming this function.
    _validate.inputs(_FUNCTION, blocks, partial, w, gamma, scale, eps)
    return torch.ops.attnres.block_attn_res(list(blocks), partial, w, gamma, float(eps),
                                            float(scale), bool(rmsnorm))
