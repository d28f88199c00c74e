"""The single op: Block AttnRes over ``blocks + [partial]``, its native calls, its
declaration (``OP``, from which ``attnres._op`` derives the custom ops, autograd and the
eager fast path) and the public function ``block_attn_res_fn``.

Math (SPEC section 1), per token, over the sources ``V = [b_0, ..., b_{N-1}, p]``
(``L = N + 1`` with a partial block ``p``, ``N`` without)::

    r_i   = sqrt(mean_d(v_i^2) + eps)                       (rmsnorm only)
    k_i   = gamma * v_i / r_i   if rmsnorm   else   v_i
    alpha = softmax_i(scale * dot(w, k_i))
    h     = sum_i alpha_i * v_i

Shapes: every block and the partial block are ``[..., D]`` (usually ``[B, T, D]``),
``w`` and ``gamma`` are ``[D]``; ``h`` is ``[..., D]`` in the input dtype.

Ops: ``attnres::block_attn_res(Tensor[] blocks, Tensor? partial, Tensor w, Tensor? gamma,
float eps, float scale, bool rmsnorm) -> Tensor`` and its backward op
``attnres::block_attn_res_backward`` (the form of every backward op: ``attnres._op``).

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

from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .. import _native, _validate
from .._op import OpDef

__all__ = ["block_attn_res_fn", "forward", "forward_with_caches", "gradients", "OP"]

_FUNCTION = "block_attn_res_fn"

# ---------------------------------------------------------------------------------
# Native calls (inputs already checked)
# ---------------------------------------------------------------------------------

_forward_call = _native.entry_call(
    "attnres_forward",
    ("num_tokens", "dim", "num_blocks", "dtype", "device", "stream", "partial",
     "source_row_stride", "proj_weight", "gamma", "scale", "eps", "rmsnorm", "out",
     "out_row_stride", "rms_cache", "alpha_cache"),
    ("blocks",))
_backward_call = _native.entry_call(
    "attnres_backward",
    ("num_tokens", "dim", "num_blocks", "dtype", "device", "stream", "partial",
     "source_row_stride", "proj_weight", "gamma", "scale", "eps", "rmsnorm", "rms_cache",
     "alpha_cache", "grad_out", "grad_out_row_stride", "grad_partial",
     "grad_source_row_stride", "grad_proj_weight", "grad_gamma"),
    ("blocks", "grad_blocks"))


def _sources(blocks: Sequence[Tensor], partial: Optional[Tensor]):
    """(first source, the pointers of the blocks then of the partial block, their one
    row stride, the tensors behind the pointers). Copies made here (a layout the ABI
    cannot take) must outlive the call: the caller holds the last item until then."""
    first = blocks[0] if len(blocks) else partial
    sources, stride = _native.rows([*blocks, partial] if partial is not None else list(blocks),
                                   first.shape[-1])
    return sources[0], [s.data_ptr() for s in sources], stride, sources


def _split(pointers: list, has_partial: bool):
    """(block pointers (one NULL when there are none: the array is never empty),
    partial pointer)."""
    blocks = pointers[:-1] if has_partial else pointers
    return blocks or [0], pointers[-1] if has_partial else 0


def _forward(blocks, partial, w, gamma, eps, scale, rmsnorm, layout, rms, alpha) -> Tensor:
    """h into a new tensor, the caches into rms and alpha when given. Written out, not
    through helpers: on a few tokens the Python here is the cost of the call."""
    gamma = gamma if rmsnorm else None
    if layout is not None and layout.contiguous:
        first = blocks[0] if blocks else partial
        pointers, _keep = layout.pointers, None
        dim = stride = first.shape[-1]
    else:
        first, pointers, stride, _keep = _sources(blocks, partial)
        dim = first.shape[-1]
    tokens = first.numel() // dim if dim else 0
    out = _native.new_output(first, tokens * dim * _ELEMENT_BYTES[first.dtype])
    if tokens == 0:  # empty tensors may have null data pointers, which the ABI refuses
        return out
    if _keep is not None:
        # Held in locals until the call returns: a temporary's storage would be freed
        # before the library reads it.
        w = w.contiguous()
        gamma = gamma.contiguous() if gamma is not None else None
    device, stream = (0, 0) if first.is_cpu else _native.device_and_stream(_FUNCTION, first)
    if partial is not None:  # the partial block's pointer is the last
        partial_pointer, pointers = pointers[-1], pointers[:-1]
    else:
        partial_pointer = 0
    _forward_call(first, tokens, dim, len(blocks), _DTYPE_CODES[first.dtype], device, stream,
                  partial_pointer, stride, w.data_ptr(),
                  gamma.data_ptr() if gamma is not None else 0, scale, eps, 1 if rmsnorm else 0,
                  out.data_ptr(), dim, rms.data_ptr() if rms is not None else 0,
                  alpha.data_ptr() if alpha is not None else 0, pointers or [0])
    return out


_ELEMENT_BYTES, _DTYPE_CODES = _native.ELEMENT_BYTES, _native.DTYPE_CODES


def forward(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
            gamma: Optional[Tensor], eps: float, scale: float, rmsnorm: bool, *,
            layout: Optional[_validate.Layout] = None) -> Tensor:
    """h = sum_i softmax_i(z) v_i over the sources [*blocks, partial], checked inputs.
    `layout`: what _validate.plain_inputs() returned for them, or None."""
    return _forward(blocks, partial, w, gamma, eps, scale, rmsnorm, layout, None, None)


def forward_with_caches(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                        gamma: Optional[Tensor], eps: float, scale: float, rmsnorm: bool,
                        want_rms: bool, want_alpha: bool):
    """(h, rms, alpha) for checked inputs: rms and alpha ``[..., L]`` in the accumulation
    dtype, or None where not wanted (rms needs rmsnorm)."""
    first = blocks[0] if len(blocks) else partial
    cache_shape = tuple(first.shape[:-1]) + (len(blocks) + (partial is not None),)
    acc = _native.accumulation_dtype(first.dtype)
    rms, alpha = (torch.empty(cache_shape, dtype=acc, device=first.device) if want else None
                  for want in (want_rms and rmsnorm, want_alpha))
    return _forward(blocks, partial, w, gamma, eps, scale, rmsnorm, None, rms, alpha), rms, alpha


class Gradients(NamedTuple):
    """The single op's gradients; None where not asked for or not applicable."""

    blocks: List[Optional[Tensor]]
    partial: Optional[Tensor]
    w: Optional[Tensor]
    gamma: Optional[Tensor]


def _caches(function: str, first: Tensor, num_sources: int, rms_cache, alpha_cache):
    """The caches checked and in the kernels' form (accumulation dtype, contiguous, on
    the sources' device)."""
    cache_shape = tuple(first.shape[:-1]) + (num_sources,)
    acc = _native.accumulation_dtype(first.dtype)
    caches = []
    for name, cache in (("rms_cache", rms_cache), ("alpha_cache", alpha_cache)):
        if cache is not None:
            _validate.cache(function, name, cache, cache_shape)
            if not (cache.dtype is acc and cache.is_contiguous() and cache.device == first.device):
                cache = cache.to(device=first.device, dtype=acc).contiguous()
        caches.append(cache)
    return caches


def gradients(function: str, grad_out: Tensor, blocks: Sequence[Tensor],
              partial: Optional[Tensor], w: Tensor, gamma: Optional[Tensor], eps: float,
              scale: float, rmsnorm: bool, needs: Optional[Sequence[bool]] = None,
              rms_cache: Optional[Tensor] = None,
              alpha_cache: Optional[Tensor] = None) -> Gradients:
    """The gradients of h = forward(...) given grad_out = dLoss/dh, for checked sources,
    w and gamma; grad_out and the caches are checked here (errors name `function`).

    `needs`: one flag per block, then the partial block, w and gamma (None: all). The caches are
    optional: without them the softmax is recomputed in the pass that reads the sources
    anyway, so no extra memory traffic."""
    num_blocks = len(blocks)
    gamma = gamma if rmsnorm else None
    first, pointers, stride, _keep = _sources(blocks, partial)
    dim = first.shape[-1]
    _validate.grad_out(function, "grad_out", grad_out, first)
    rms_cache, alpha_cache = _caches(function, first, len(pointers),
                                     rms_cache if rmsnorm else None, alpha_cache)
    if needs is None:
        needs = [True] * (num_blocks + 3)
    (grad_out,), grad_stride = _native.rows([grad_out], dim)
    tokens, nbytes = _native.row_bytes(first, dim)
    grad_blocks = [_native.new_output(first, nbytes) if need else None
                   for need in needs[:num_blocks]]
    grad_partial = (_native.new_output(first, nbytes)
                    if partial is not None and needs[num_blocks] else None)
    grad_w = w.new_empty(dim) if needs[-2] else None
    grad_gamma = w.new_empty(dim) if rmsnorm and needs[-1] else None
    grads = Gradients(grad_blocks, grad_partial, grad_w, grad_gamma)
    if tokens == 0:
        _native.zero_sums((grad_w, grad_gamma))
        return grads
    w = w.contiguous()
    gamma = gamma.contiguous() if gamma is not None else None
    device, stream = _native.device_and_stream(function, first)
    block_pointers, partial_pointer = _split(pointers, partial is not None)
    _backward_call(first, tokens, dim, num_blocks, _native.DTYPE_CODES[first.dtype], device,
                   stream, partial_pointer, stride, w.data_ptr(), _native.ptr(gamma), scale,
                   eps, 1 if rmsnorm else 0, _native.ptr(rms_cache), _native.ptr(alpha_cache),
                   grad_out.data_ptr(), grad_stride, _native.ptr(grad_partial), dim,
                   _native.ptr(grad_w), _native.ptr(grad_gamma), block_pointers,
                   [_native.ptr(g) for g in grad_blocks] or [0])
    return grads


# ---------------------------------------------------------------------------------
# The declaration
# ---------------------------------------------------------------------------------

def _check(function, blocks, partial, w, gamma, eps, scale, rmsnorm):
    _validate.inputs(function, blocks, partial, w, gamma if rmsnorm else None, scale, eps)


def _fake(blocks, partial, w, gamma, eps, scale, rmsnorm):
    first = blocks[0] if len(blocks) else partial
    return first.new_empty(first.shape)


def _save(flat, attrs, outputs):
    """The inputs by reference; gamma only with rmsnorm (the fast path has it None then)."""
    return flat if attrs[2] or flat[-1] is None else [*flat[:-1], None]


def _backward(grads, saved, attrs, needs):
    *blocks, partial, w, gamma = saved
    eps, scale, rmsnorm = attrs
    g = gradients(OP.name + " (backward)", grads[0], blocks, partial, w, gamma, eps, scale,
                  rmsnorm, needs)
    return [*g.blocks, g.partial, g.w, g.gamma]


OP = OpDef(
    "block_attn_res",
    inputs=(("blocks", "Tensor[]"), ("partial", "Tensor?"), ("w", "Tensor"),
            ("gamma", "Tensor?")),
    attrs=(("eps", "float"), ("scale", "float"), ("rmsnorm", "bool")),
    returns="Tensor", forward=forward, check=_check, fake=_fake, save=_save,
    backward=_backward)

_eager = _native.eager
_grad_enabled = torch.is_grad_enabled
_plain_inputs = _validate.plain_inputs


def block_attn_res_fn(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                      gamma: Optional[Tensor] = None, *, eps: float = 1e-6, scale: float = 1.0,
                      rmsnorm: bool = True, function: str = _FUNCTION) -> Tensor:
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
        function: the name errors give (a front end over this function passes its own).

    Returns:
        ``h`` ``[..., D]``, a new contiguous tensor in the input dtype.

    Gradients go to exactly the arguments with ``requires_grad``; a block without it is
    never written a gradient. All tensors must share one dtype (bf16, fp16, fp32, fp64)
    and device; otherwise ``ValueError`` names the offending argument. Under
    ``torch.autocast`` nothing is cast: the op computes in its inputs' dtype.
    """
    if not rmsnorm:
        gamma = None
    layout = _plain_inputs(blocks, partial, w, gamma, scale, eps, _grad_enabled()) \
        if _eager() else None
    return OP(function, (blocks, partial, w, gamma), (eps, scale, rmsnorm), layout)
