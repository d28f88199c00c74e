"""Phase 2 of the two-phase schedule (docs/DESIGN.md, "The two phases"): its native
calls, its declarations (``OP``, and ``UPDATE_OP`` with the partial block's update
fused), the public function ``block_attn_res_phase2``, and the stream's variant.

Per sub-layer s, per token, phase 2 merges phase 1's ``o_s``, ``lse_s`` with the
partial block ``p`` (``u_s = w_s * gamma_s``, ``r_p`` the RMS of ``p``, 1 without
RMSNorm)::

    z_p   = scale * dot(u_s, p) / r_p
    beta  = sigmoid(lse_s - z_p),  keep = sigmoid(z_p - lse_s)   (each from its own
                                                                  exponent, not 1 - beta)
    h     = beta o_s + keep p                       (h = o_s without p)
    out   = h, or RMSNorm(h) * norm_weight          (the sub-layer's input norm, fused)

In exact arithmetic ``h`` is the single op over ``[v_0, ..., v_{N-1}, p]``.

Ops: ``attnres::phase2(Tensor out, Tensor lse, Tensor? partial, Tensor w, Tensor? gamma,
Tensor? norm_weight, float eps, float scale, bool rmsnorm, bool input_norm, float
norm_eps) -> Tensor`` and ``attnres::phase2_update`` (the same with ``update`` after
``partial``): phase 2 over ``p' = p + update``, which the kernel forms (the bits of
torch's add) and writes in the same pass, returning ``(h, p')``. Its backward reads
``p'`` only, and adds the gradient ``p'`` receives from its other uses into the partial
block's. What autograd saves: ``o_s``, ``lse_s``, ``p`` (``p'`` with the update) and the
weights.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .. import _native, _validate
from .._op import OpDef, fast_apply

__all__ = ["block_attn_res_phase2", "forward", "forward_update", "gradients",
           "phase2_in_stream", "OP", "UPDATE_OP"]

_FUNCTION = "attnres.block_attn_res_phase2"

_COMMON = ("num_tokens", "dim", "dtype", "device", "stream", "scale", "eps", "rmsnorm",
           "query_out", "query_lse", "partial", "source_row_stride", "proj_weight", "gamma",
           "input_norm", "norm_eps", "norm_weight")
_forward_call = _native.entry_call(
    "attnres_phase2_forward", _COMMON + ("out", "out_row_stride", "partial_update",
                                         "new_partial"))
_backward_call = _native.entry_call(
    "attnres_phase2_backward",
    _COMMON + ("grad_out", "grad_out_row_stride", "grad_query_out", "grad_query_lse",
               "grad_partial", "grad_source_row_stride", "grad_proj_weight", "grad_gamma",
               "grad_norm_weight", "grad_partial_in"))


def _rows(out: Tensor, partial: Optional[Tensor], update: Optional[Tensor]):
    """out, partial and update (each may be None but out) with one shared row stride
    (the ABI's source_row_stride), and that stride."""
    rows, stride = _native.rows([t for t in (out, partial, update) if t is not None],
                                out.shape[-1])
    rows = iter(rows)
    return (next(rows), next(rows) if partial is not None else None,
            next(rows) if update is not None else None, stride)


def _forward(out, lse, partial, update, w, gamma, norm_weight, eps, scale, rmsnorm,
             input_norm, norm_eps, layout):
    """(h, new_partial or None) for checked inputs. Written out, not through helpers: on
    a few tokens the Python here is the cost of the call."""
    dim = out.shape[-1]
    tokens = out.numel() // dim if dim else 0
    nbytes = tokens * dim * _ELEMENT_BYTES[out.dtype]
    gamma = gamma if rmsnorm else None
    norm_weight = norm_weight if input_norm else None
    if layout is not None and layout.contiguous:
        stride = dim
    else:
        out, partial, update, stride = _rows(out, partial, update)
        # Held in locals until the call returns: a temporary's storage would be freed
        # before the library reads it.
        lse, w = lse.contiguous(), w.contiguous()
        gamma = gamma.contiguous() if gamma is not None else None
        norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    result = _native.new_output(out, nbytes)
    # new_partial is written with result's row stride (the ABI's out_row_stride).
    new_partial = _native.new_output(out, nbytes) if update is not None else None
    if tokens == 0:
        return result, new_partial
    device, stream = (0, 0) if out.is_cpu else _native.device_and_stream(_FUNCTION, out)
    _forward_call(out, tokens, dim, _DTYPE_CODES[out.dtype], device, stream, scale, eps,
                  1 if rmsnorm else 0, out.data_ptr(), lse.data_ptr(),
                  partial.data_ptr() if partial is not None else 0, stride, w.data_ptr(),
                  gamma.data_ptr() if gamma is not None else 0, 1 if input_norm else 0,
                  norm_eps, norm_weight.data_ptr() if norm_weight is not None else 0,
                  result.data_ptr(), dim, update.data_ptr() if update is not None else 0,
                  new_partial.data_ptr() if new_partial is not None else 0)
    return result, new_partial


_ELEMENT_BYTES, _DTYPE_CODES = _native.ELEMENT_BYTES, _native.DTYPE_CODES


def forward(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
            gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float, scale: float,
            rmsnorm: bool, input_norm: bool, norm_eps: float, *,
            layout: Optional[_validate.Layout] = None) -> Tensor:
    """h (or RMSNorm(h) * norm_weight with input_norm), [..., D] in out's dtype, for
    checked inputs. `layout`: what _validate.plain_phase2() returned, or None."""
    return _forward(out, lse, partial, None, w, gamma, norm_weight, eps, scale, rmsnorm,
                    input_norm, norm_eps, layout)[0]


def forward_update(out: Tensor, lse: Tensor, partial: Tensor, update: Tensor, w: Tensor,
                   gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                   scale: float, rmsnorm: bool, input_norm: bool, norm_eps: float, *,
                   layout: Optional[_validate.Layout] = None):
    """(h, new_partial): forward() over new_partial = partial + update (the bits of
    torch's add), which the kernel forms and writes in the same pass."""
    return _forward(out, lse, partial, update, w, gamma, norm_weight, eps, scale, rmsnorm,
                    input_norm, norm_eps, layout)


class Gradients(NamedTuple):
    """Phase 2's gradients; None where not asked for or not applicable."""

    out: Optional[Tensor]
    lse: Optional[Tensor]
    partial: Optional[Tensor]
    w: Optional[Tensor]
    gamma: Optional[Tensor]
    norm_weight: Optional[Tensor]


def _upstream(function: str, grad: Optional[Tensor], grad_partial_in: Optional[Tensor],
              out: Tensor, partial: Optional[Tensor], need_partial: bool):
    """grad and grad_partial_in checked and in out's dtype, with one row stride."""
    grad = torch.zeros_like(out) if grad is None else grad.to(out.dtype)
    _validate.grad_out(function, "grad", grad, out)
    if grad_partial_in is not None:
        if partial is None:
            raise _validate.error(function, "grad_partial_in", "None when partial is None "
                                  "(it is added into the partial block's gradient)",
                                  _validate._kind(grad_partial_in))
        grad_partial_in = grad_partial_in.to(out.dtype)
        _validate.grad_out(function, "grad_partial_in", grad_partial_in, out)
        if not need_partial:  # it only ever reaches the partial block's gradient
            grad_partial_in = None
    # grad_partial_in shares grad's row stride (the ABI's grad_out_row_stride).
    grads, stride = _native.rows([grad] if grad_partial_in is None else
                                 [grad, grad_partial_in], out.shape[-1])
    return grads[0], grads[1] if grad_partial_in is not None else None, stride


def gradients(function: str, grad: Optional[Tensor], out: Tensor, lse: Tensor,
              partial: Optional[Tensor], w: Tensor, gamma: Optional[Tensor],
              norm_weight: Optional[Tensor], eps: float, scale: float, rmsnorm: bool,
              input_norm: bool, norm_eps: float, needs: Sequence[bool] = (True,) * 6,
              grad_partial_in: Optional[Tensor] = None) -> Gradients:
    """Phase 2's gradients for checked inputs given grad = dLoss/dh (None: zero; checked
    here, errors naming `function`). `needs`: one flag each for out, lse, partial, w,
    gamma, norm_weight. After a fused update, `partial` is the forward's new_partial
    and `grad_partial_in` (None: zero) the gradient new_partial received from its other
    uses; the partial gradient is then that of both the old partial and the update."""
    dim = out.shape[-1]
    tokens, nbytes = _native.row_bytes(out, dim)
    gamma = gamma if rmsnorm else None
    norm_weight = norm_weight if input_norm else None
    exists = (True, True, partial is not None, True, gamma is not None, input_norm)
    needs = [bool(n) and e for n, e in zip(needs, exists)]
    grad, grad_partial_in, grad_stride = _upstream(function, grad, grad_partial_in, out,
                                                   partial, needs[2])
    out, partial, _, stride = _rows(out, partial, None)
    # Held in locals until the call returns (see _forward).
    lse, w = lse.contiguous(), w.contiguous()
    gamma = gamma.contiguous() if gamma is not None else None
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    likes = (out, lse, out, w, w, w)
    grads = Gradients(*(None if not need else _native.new_output(like, nbytes) if i in (0, 2)
                        else torch.empty_like(like, memory_format=torch.contiguous_format)
                        for i, (like, need) in enumerate(zip(likes, needs))))
    if tokens == 0:
        _native.zero_sums(grads[3:])
        return grads
    device, stream = _native.device_and_stream(function, out)
    _backward_call(out, tokens, dim, _native.DTYPE_CODES[out.dtype], device, stream, scale, eps,
                   1 if rmsnorm else 0, out.data_ptr(), lse.data_ptr(), _native.ptr(partial),
                   stride, w.data_ptr(), _native.ptr(gamma), 1 if input_norm else 0, norm_eps,
                   _native.ptr(norm_weight), grad.data_ptr(), grad_stride,
                   *(_native.ptr(g) for g in grads[:3]), dim,
                   *(_native.ptr(g) for g in grads[3:]), _native.ptr(grad_partial_in))
    return grads


# ---------------------------------------------------------------------------------
# The declarations
# ---------------------------------------------------------------------------------

_INPUTS = (("out", "Tensor"), ("lse", "Tensor"), ("partial", "Tensor?"), ("w", "Tensor"),
           ("gamma", "Tensor?"), ("norm_weight", "Tensor?"))
_ATTRS = (("eps", "float"), ("scale", "float"), ("rmsnorm", "bool"), ("input_norm", "bool"),
          ("norm_eps", "float"))


def _check(function, out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm,
           input_norm, norm_eps):
    _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)


def _check_update(function, out, lse, partial, update, w, gamma, norm_weight, eps, scale,
                  rmsnorm, input_norm, norm_eps):
    _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps,
                     update)


def _saved(out, lse, partial, w, gamma, norm_weight, attrs) -> list:
    """What both ops save; gamma only with rmsnorm, norm_weight only with input_norm."""
    _, _, rmsnorm, input_norm, _ = attrs
    return [out, lse, partial, w, gamma if rmsnorm else None,
            norm_weight if input_norm else None]


def _save(flat, attrs, outputs):
    return _saved(*flat, attrs)


def _save_update(flat, attrs, outputs):
    out, lse, _, _, w, gamma, norm_weight = flat
    return _saved(out, lse, outputs[1], w, gamma, norm_weight, attrs)


def _backward(grads, saved, attrs, needs):
    """grads: h's, then (after an update, or passed through in a stream) the partial
    block's from its other uses."""
    g = gradients(OP.name + " (backward)", grads[0], *saved, *attrs, needs,
                  grads[1] if len(grads) > 1 else None)
    return list(g)


OP = OpDef(
    "phase2", inputs=_INPUTS, attrs=_ATTRS, returns="Tensor", forward=forward,
    check=_check, fake=lambda out, *rest: out.new_empty(out.shape),
    save=_save, backward=_backward)

# phase2_update saves new_partial in place of partial and update: new_partial =
# partial + update, so both get its one gradient, which the kernel forms with the
# gradient new_partial receives from its other uses added in.
UPDATE_OP = OpDef(
    "phase2_update", inputs=_INPUTS[:3] + (("update", "Tensor"),) + _INPUTS[3:],
    attrs=_ATTRS, returns="(Tensor, Tensor)", forward=forward_update, check=_check_update,
    fake=lambda out, *rest: (out.new_empty(out.shape), out.new_empty(out.shape)),
    save=_save_update,
    backward=_backward,
    saved_needs=lambda n: (n[0], n[1], n[2] or n[3], *n[4:]),
    input_grads=lambda g: (g[0], g[1], g[2], g[2], *g[3:]))


class _PassPartial(OP.function):
    """OP.function returning (h, partial): the partial block passed through, so that the
    gradient of its later uses reaches this node and the kernel adds it into the
    partial block's gradient (phase2_in_stream)."""

    @staticmethod
    def forward(ctx, attrs, layout, *flat):
        return OP.function.forward(ctx, attrs, layout, *flat), flat[2]


_apply_pass_partial = fast_apply(_PassPartial)
_eager = _native.eager
_grad_enabled = torch.is_grad_enabled


def block_attn_res_phase2(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                          gamma: Optional[Tensor] = None, *, eps: float = 1e-6,
                          scale: float = 1.0, rmsnorm: bool = True,
                          norm_weight: Optional[Tensor] = None,
                          input_norm: Optional[bool] = None, norm_eps: float = 1e-6,
                          update: Optional[Tensor] = None):
    """Phase 2 for one sub-layer, differentiable: merges phase 1's ``out``, ``lse`` of
    this sub-layer's query (``w``, ``gamma``: ``[D]``) with the partial block.

    ``partial`` None returns ``out`` (the first sub-layer of a block), after the input
    norm if there is one. ``input_norm`` (default: ``norm_weight is not None``)
    returns ``RMSNorm(h) * norm_weight`` (``norm_weight`` None: ones), fused so that
    ``h`` makes no round trip through memory.

    ``update`` (a tensor like ``partial``, which must then be given) fuses the
    partial-block update ``partial + update`` (the previous sub-layer's output) into
    the same pass: the result is ``(h, new_partial)``, ``h`` merging ``new_partial``,
    which has the bits of ``partial + update`` in torch. Gradients reach ``partial`` and
    ``update`` as through that addition.
    """
    if input_norm is None:
        input_norm = norm_weight is not None
    if norm_weight is not None and not input_norm:
        raise _validate.error(_FUNCTION, "norm_weight", "None when input_norm=False",
                              "a tensor")
    gamma = gamma if rmsnorm else None
    attrs = (eps, scale, rmsnorm, input_norm, norm_eps)
    layout = (_validate.plain_phase2(out, lse, partial, w, gamma, norm_weight, eps, scale,
                                     norm_eps, _grad_enabled(), update) if _eager() else None)
    if update is not None:
        return UPDATE_OP(_FUNCTION, (out, lse, partial, update, w, gamma, norm_weight), attrs,
                         layout)
    if partial is None and not input_norm:  # h = out
        if layout is None:
            _validate.phase2(_FUNCTION, out, lse, partial, w, gamma, norm_weight, eps, scale,
                             norm_eps)
        return out
    return OP(_FUNCTION, (out, lse, partial, w, gamma, norm_weight), attrs, layout)


def phase2_in_stream(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                     gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                     norm_weight: Optional[Tensor], input_norm: bool, norm_eps: float,
                     update: Optional[Tensor]):
    """block_attn_res_phase2 for a stream's sub-layer: (h, the partial block for the next
    mix). Without an update the partial block (the block's first output) is read here
    and again by the next mix; on the eager fast path with a gradient it comes back
    through this call (_PassPartial), so that its two gradients are added in the kernel
    rather than by autograd."""
    if update is None and partial is not None and _eager() and _grad_enabled():
        gamma = gamma if rmsnorm else None
        layout = _validate.plain_phase2(out, lse, partial, w, gamma, norm_weight, eps, scale,
                                        norm_eps, True)
        if layout is not None and layout.requires_grad:
            return _apply_pass_partial((eps, scale, rmsnorm, input_norm, norm_eps), layout,
                                       out, lse, partial, w, gamma, norm_weight)
    result = block_attn_res_phase2(out, lse, partial, w, gamma, eps=eps, scale=scale,
                                   rmsnorm=rmsnorm, norm_weight=norm_weight,
                                   input_norm=input_norm, norm_eps=norm_eps, update=update)
    return result if update is not None else (result, partial)  # (h, p + update) or (h, p)
