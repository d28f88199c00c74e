"""The two-phase schedule of Block AttnRes (docs/DESIGN.md, "The two phases"):
the native calls, the ``torch.library`` custom ops with fake implementations and
autograd, and the public functions.

Within one block of S sub-layers every sub-layer mixes the same N completed blocks;
only the partial block ``p`` differs. So, per token (``u_s = w_s * gamma_s``,
``r_i`` the RMS of ``v_i``, 1 without RMSNorm)::

    phase 1 (once per block of sub-layers, all S queries in one read of the blocks)
        z_si  = scale * dot(u_s, v_i) / r_i
        lse_s = log sum_i exp(z_si)                       (fp32; fp64 for fp64 inputs)
        o_s   = sum_i exp(z_si - lse_s) v_i               (the blocks' dtype)
    phase 2 (per sub-layer s)
        z_p   = scale * dot(u_s, p) / r_p,  beta = sigmoid(lse_s - z_p)
        h     = beta o_s + keep p,  keep = sigmoid(z_p - lse_s)  (1 - beta, formed on its own;
                                                          h = o_s without p)
        out   = h, or RMSNorm(h) * norm_weight            (the sub-layer's input norm, fused)

In exact arithmetic ``h`` is the single op over ``[v_0, ..., v_{N-1}, p]``.

Ops in the ``attnres`` namespace: ``phase1`` / ``phase1_backward``, ``phase2`` /
``phase2_backward``, and ``phase2_update`` (phase 2 with the partial-block update
``p' = p + y`` fused in; it returns ``(h, p')`` and its backward is ``phase2_backward``
over ``p'`` with the gradient ``p'`` receives elsewhere added in). Phase 1 returns
*lists* of S outputs and S LSEs, so that each sub-layer's gradient lands on its own
tensor; its backward takes all S gradients at once (a missing one is zero), reads each
block once and writes each block's gradient once (in a stream, adding into the block's
running sum over the stream's phase 1 calls: BlockGradSums). What autograd saves: the blocks,
``w`` and ``gamma`` by reference (phase 1); ``o_s``, ``lse_s``, ``p`` (``p'`` with the
update) and the weights (phase 2). Nothing is recomputed twice in
memory: the backward kernels recompute logits in the pass that reads the rows anyway.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _native, _validate
from .ops import _fast_apply, custom_op_calls

_PHASE1 = "attnres.block_attn_res_phase1"
_PHASE2 = "attnres.block_attn_res_phase2"


# ---------------------------------------------------------------------------------
# Native calls
# ---------------------------------------------------------------------------------
#
# Each packs attnres_params in one pack_into (_native.entry_call): the fields below,
# the arrays of pointers behind them, every other field at its default. The
# `_validated` flag of each function below skips the validator for a caller that has
# run it (the fast path's _validate.plain_phase1/2, or the public function).

_COMMON = ("num_tokens", "dim", "dtype", "device", "stream", "scale", "eps", "rmsnorm")
_phase1_forward_call = _native.entry_call(
    "attnres_phase1_forward",
    _COMMON + ("num_blocks", "source_row_stride", "proj_weight", "gamma", "num_queries",
               "out_row_stride"),
    ("blocks", "query_outs", "query_lses"))
_phase1_backward_call = _native.entry_call(
    "attnres_phase1_backward",
    _COMMON + ("num_blocks", "source_row_stride", "proj_weight", "gamma", "num_queries",
               "grad_out_row_stride", "grad_source_row_stride", "grad_proj_weight",
               "grad_gamma", "accumulate_grads"),
    ("blocks", "grad_query_outs", "grad_query_lses", "grad_blocks"))
_phase2_forward_call = _native.entry_call(
    "attnres_phase2_forward",
    _COMMON + ("query_out", "query_lse", "partial", "source_row_stride", "proj_weight", "gamma",
               "out", "out_row_stride", "input_norm", "norm_eps", "norm_weight",
               "partial_update", "new_partial"))
_phase2_backward_call = _native.entry_call(
    "attnres_phase2_backward",
    _COMMON + ("query_out", "query_lse", "partial", "source_row_stride", "proj_weight", "gamma",
               "input_norm", "norm_eps", "norm_weight", "grad_out", "grad_out_row_stride",
               "grad_query_out", "grad_query_lse", "grad_partial", "grad_source_row_stride",
               "grad_proj_weight", "grad_gamma", "grad_norm_weight", "grad_partial_in"))


def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


def _device(first: Tensor, function: str) -> Tuple[int, int]:
    return (_native._DEVICE_CPU, 0) if first.is_cpu else _native._stream_and_device(function,
                                                                                      first)


def phase1_forward(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor], *, eps: float,
                   scale: float, rmsnorm: bool, function: str = _PHASE1,
                   _validated: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """(outs, lses): S outputs [..., D] in the blocks' dtype, S LSEs [...] fp32/fp64."""
    if _validated:
        blocks, dim, num_queries = list(blocks), blocks[0].shape[-1], w.shape[0]
    else:
        blocks, dim, num_queries = _validate.phase1(function, blocks, w, gamma, eps, scale)
    blocks, stride = _native._rows(blocks, dim)
    first = blocks[0]
    tokens = first.numel() // dim
    nbytes = tokens * dim * _native._ELEMENT_BYTES[first.dtype]
    outs = [_native._new_output(first, nbytes) for _ in range(num_queries)]
    acc = _native.accumulation_dtype(first.dtype)
    lse_shape = first.shape[:-1]
    lses = [first.new_empty(lse_shape, dtype=acc) for _ in range(num_queries)]
    if tokens == 0:
        return outs, lses
    # Held in locals until the call returns: a temporary's storage would be freed
    # before the library reads it.
    w, gamma = w.contiguous(), (gamma.contiguous() if rmsnorm and gamma is not None else None)
    device, stream = _device(first, function)
    _phase1_forward_call(
        first, tokens, dim, _native._DTYPES[first.dtype], device, stream, scale, eps,
        1 if rmsnorm else 0, len(blocks), stride, w.data_ptr(), _ptr(gamma), num_queries, dim,
        [b.data_ptr() for b in blocks], [o.data_ptr() for o in outs],
        [x.data_ptr() for x in lses])
    return outs, lses


def phase1_backward(grad_outs: Sequence[Optional[Tensor]], grad_lses: Sequence[Optional[Tensor]],
                    blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor], *, eps: float,
                    scale: float, rmsnorm: bool, need_blocks: Optional[Sequence[bool]] = None,
                    need_w: bool = True, need_gamma: bool = True,
                    function: str = _PHASE1 + " (backward)", _validated: bool = False,
                    _accumulate_into: Optional[Sequence[Optional[Tensor]]] = None):
    """(grad_blocks: list of N (tensor or None), grad_w [S, D] or None, grad_gamma or None).
    `_accumulate_into`: N contiguous tensors like the blocks (None where a block's
    gradient is not needed), to which the kernel adds the block gradients (rounding once)
    and which it returns as grad_blocks."""
    if _validated:
        blocks, dim, num_queries = list(blocks), blocks[0].shape[-1], w.shape[0]
    else:
        blocks, dim, num_queries = _validate.phase1(function, blocks, w, gamma, eps, scale)
    for name, grads in (("grad_outs", grad_outs), ("grad_lses", grad_lses)):
        if len(grads) != num_queries:
            raise _validate.error(function, name, f"a list of S = {num_queries} (one per query)",
                                  f"{len(grads)} entries")
    blocks, stride = _native._rows(blocks, dim)
    first = blocks[0]
    tokens = first.numel() // dim
    acc = _native.accumulation_dtype(first.dtype)
    grad_outs = [None if g is None else g.to(first.dtype).contiguous() for g in grad_outs]
    grad_lses = [None if g is None else g.to(acc).contiguous() for g in grad_lses]
    for s, g in enumerate(grad_outs):
        if g is not None:
            _validate.grad_out(function, f"grad_outs[{s}]", g, first)
    for s, g in enumerate(grad_lses):
        if g is not None and g.shape != first.shape[:-1]:
            raise _validate.error(function, f"grad_lses[{s}]", f"of shape {tuple(first.shape[:-1])}",
                                  f"shape {tuple(g.shape)}")
    need_blocks = [True] * len(blocks) if need_blocks is None else list(need_blocks)
    nbytes = tokens * dim * _native._ELEMENT_BYTES[first.dtype]
    if _accumulate_into is None:
        grad_blocks = [_native._new_output(first, nbytes) if need else None
                       for need in need_blocks]
    else:
        grad_blocks = [g if need else None for g, need in zip(_accumulate_into, need_blocks)]
    gamma = gamma if rmsnorm else None
    grad_w = w.new_empty(w.shape) if need_w else None
    grad_gamma = w.new_empty(w.shape) if need_gamma and gamma is not None else None
    if tokens == 0:
        for g in (grad_w, grad_gamma):
            if g is not None:
                g.zero_()
        return grad_blocks, grad_w, grad_gamma
    w, gamma = w.contiguous(), (gamma.contiguous() if gamma is not None else None)
    device, stream = _device(first, function)
    _phase1_backward_call(
        first, tokens, dim, _native._DTYPES[first.dtype], device, stream, scale, eps,
        1 if rmsnorm else 0, len(blocks), stride, w.data_ptr(), _ptr(gamma), num_queries, dim,
        dim, _ptr(grad_w), _ptr(grad_gamma), 0 if _accumulate_into is None else 1,
        [b.data_ptr() for b in blocks], [_ptr(g) for g in grad_outs],
        [_ptr(g) for g in grad_lses], [_ptr(g) for g in grad_blocks])
    return grad_blocks, grad_w, grad_gamma


def _phase2_rows(out: Tensor, partial: Optional[Tensor], update: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], int]:
    """out, partial and update (each may be None but out) with one shared row stride
    (the ABI's source_row_stride)."""
    rows, stride = _native._rows([t for t in (out, partial, update) if t is not None],
                                 out.shape[-1])
    rows = iter(rows)
    return (next(rows), next(rows) if partial is not None else None,
            next(rows) if update is not None else None, stride)


def phase2_forward(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                   gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                   norm_weight: Optional[Tensor] = None, input_norm: bool = False,
                   norm_eps: float = 1e-6, update: Optional[Tensor] = None,
                   function: str = _PHASE2, _validated: bool = False,
                   _contiguous: bool = False):
    """h (or RMSNorm(h) * norm_weight with input_norm), [..., D] in out's dtype; with
    `update`, (h, new_partial): the kernel forms new_partial = partial + update (the
    bits of torch's add) and merges it in place of partial.
    `_contiguous`: the caller has also seen every tensor contiguous."""
    if not _validated:
        _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale,
                         norm_eps, update)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    nbytes = tokens * dim * _native._ELEMENT_BYTES[out.dtype]
    if _contiguous:
        stride = dim
    else:
        out, partial, update, stride = _phase2_rows(out, partial, update)
    # new_partial is written with result's row stride (the ABI's out_row_stride).
    if _contiguous and nbytes < _native._LARGE:
        result = _native._empty_like(out)
        new_partial = _native._empty_like(out) if update is not None else None
    else:
        result = _native._new_output(out, nbytes)
        new_partial = _native._new_output(out, nbytes) if update is not None else None
    if tokens == 0:
        return result if update is None else (result, new_partial)
    gamma = gamma if rmsnorm else None
    norm_weight = norm_weight if input_norm else None
    if not _contiguous:
        # Held in locals until the call returns: a temporary's storage would be freed
        # before the library reads it.
        lse, w = lse.contiguous(), w.contiguous()
        gamma = gamma.contiguous() if gamma is not None else None
        norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    device, stream = (_native._DEVICE_CPU, 0) if out.is_cpu else _device(out, function)
    _phase2_forward_call(
        out, tokens, dim, _native._DTYPES[out.dtype], device, stream, scale, eps,
        1 if rmsnorm else 0, out.data_ptr(), lse.data_ptr(),
        partial.data_ptr() if partial is not None else 0, stride, w.data_ptr(),
        gamma.data_ptr() if gamma is not None else 0, result.data_ptr(), dim,
        1 if input_norm else 0, norm_eps,
        norm_weight.data_ptr() if norm_weight is not None else 0,
        update.data_ptr() if update is not None else 0,
        new_partial.data_ptr() if update is not None else 0)
    return result if update is None else (result, new_partial)


def phase2_backward(grad: Tensor, out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                    gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                    norm_weight: Optional[Tensor] = None, input_norm: bool = False,
                    norm_eps: float = 1e-6, need: Sequence[bool] = (True,) * 6,
                    grad_partial_in: Optional[Tensor] = None,
                    function: str = _PHASE2 + " (backward)", _validated: bool = False):
    """Gradients (out, lse, partial, w, gamma, norm_weight), None where not needed or
    not applicable. After a fused update, `partial` is the forward's new_partial and
    `grad_partial_in` (or None: zero) the gradient new_partial received from its other
    uses; the partial gradient is then that of both the old partial and the update."""
    if not _validated:
        _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale,
                         norm_eps)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    grad = grad.to(out.dtype)
    _validate.grad_out(function, "grad", grad, out)
    need_out, need_lse, need_partial, need_w, need_gamma, need_nw = need
    need_partial = need_partial and partial is not None
    if grad_partial_in is not None:
        if partial is None:
            raise _validate.error(function, "grad_partial_in", "None when partial is None "
                                  "(it is added into the partial block's gradient)",
                                  _validate._kind(grad_partial_in))
        grad_partial_in = grad_partial_in.to(out.dtype)
        _validate.grad_out(function, "grad_partial_in", grad_partial_in, out)
        if not need_partial:  # it only ever reaches the partial block's gradient
            grad_partial_in = None
    out, partial, _, stride = _phase2_rows(out, partial)
    # grad_partial_in shares grad's row stride (the ABI's grad_out_row_stride).
    grads, grad_stride = _native._rows(
        [grad] if grad_partial_in is None else [grad, grad_partial_in], dim)
    grad = grads[0]
    grad_partial_in = grads[1] if grad_partial_in is not None else None
    # Held in locals until the call returns (see phase2_forward).
    lse, w = lse.contiguous(), w.contiguous()
    gamma = gamma.contiguous() if rmsnorm and gamma is not None else None
    norm_weight = norm_weight.contiguous() if input_norm and norm_weight is not None else None
    nbytes = tokens * dim * _native._ELEMENT_BYTES[out.dtype]
    grad_out = _native._new_output(out, nbytes) if need_out else None
    grad_lse = torch.empty_like(lse, memory_format=torch.contiguous_format) if need_lse else None
    grad_partial = _native._new_output(out, nbytes) if need_partial else None
    grad_w = w.new_empty(w.shape) if need_w else None
    grad_gamma = w.new_empty(w.shape) if need_gamma and gamma is not None else None
    grad_nw = w.new_empty(w.shape) if need_nw and input_norm else None
    result = [grad_out, grad_lse, grad_partial, grad_w, grad_gamma, grad_nw]
    if tokens == 0:
        for g in result[3:]:
            if g is not None:
                g.zero_()
        return result
    device, stream = _device(out, function)
    _phase2_backward_call(
        out, tokens, dim, _native._DTYPES[out.dtype], device, stream, scale, eps,
        1 if rmsnorm else 0, out.data_ptr(), lse.data_ptr(), _ptr(partial), stride,
        w.data_ptr(), _ptr(gamma), 1 if input_norm else 0, norm_eps, _ptr(norm_weight),
        grad.data_ptr(), grad_stride, _ptr(grad_out), _ptr(grad_lse), _ptr(grad_partial), dim,
        _ptr(grad_w), _ptr(grad_gamma), _ptr(grad_nw), _ptr(grad_partial_in))
    return result


# ---------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::phase1", mutates_args=())
def _phase1(blocks: list[Tensor], w: Tensor, gamma: Optional[Tensor], eps: float, scale: float,
            rmsnorm: bool) -> list[Tensor]:
    """The S outputs then the S LSEs, in one list (a fixed length: 2S)."""
    custom_op_calls["attnres::phase1"] += 1
    outs, lses = phase1_forward(blocks, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm)
    return outs + lses


@_phase1.register_fake
def _phase1_fake(blocks, w, gamma, eps, scale, rmsnorm):
    blocks, _, num_queries = _validate.phase1(_PHASE1, blocks, w, gamma, eps, scale)
    first = blocks[0]
    acc = _native.accumulation_dtype(first.dtype)
    return ([first.new_empty(first.shape) for _ in range(num_queries)]
            + [first.new_empty(first.shape[:-1], dtype=acc) for _ in range(num_queries)])


@torch.library.custom_op("attnres::phase1_backward", mutates_args=())
def _phase1_backward(grad_outs: list[Optional[Tensor]], grad_lses: list[Optional[Tensor]],
                     blocks: list[Tensor], w: Tensor, gamma: Optional[Tensor], eps: float,
                     scale: float, rmsnorm: bool, need_blocks: list[bool], need_w: bool,
                     need_gamma: bool) -> list[Tensor]:
    """The needed gradients, in the order (needed blocks..., w, gamma)."""
    custom_op_calls["attnres::phase1_backward"] += 1
    grad_blocks, grad_w, grad_gamma = phase1_backward(
        grad_outs, grad_lses, blocks, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm,
        need_blocks=need_blocks, need_w=need_w, need_gamma=need_gamma)
    return [g for g in grad_blocks if g is not None] + [
        g for g in (grad_w, grad_gamma) if g is not None]


@_phase1_backward.register_fake
def _phase1_backward_fake(grad_outs, grad_lses, blocks, w, gamma, eps, scale, rmsnorm,
                          need_blocks, need_w, need_gamma):
    grads = [b.new_empty(b.shape) for b, need in zip(blocks, need_blocks) if need]
    if need_w:
        grads.append(w.new_empty(w.shape))
    if need_gamma and rmsnorm and gamma is not None:
        grads.append(w.new_empty(w.shape))
    return grads


def _phase1_setup_context(ctx, inputs, output):
    blocks, w, gamma, eps, scale, rmsnorm = inputs
    ctx.num_blocks = len(blocks)
    ctx.eps, ctx.scale, ctx.rmsnorm = eps, scale, rmsnorm
    ctx.save_for_backward(*blocks, w, gamma if rmsnorm else None)


def _phase1_grad(ctx, grads):
    saved = ctx.saved_tensors
    n = ctx.num_blocks
    blocks, (w, gamma) = list(saved[:n]), saved[n:]
    num_queries = w.shape[0]
    grad_outs, grad_lses = list(grads[:num_queries]), list(grads[num_queries:])
    need_blocks = [bool(x) for x in ctx.needs_input_grad[0]]
    need_w = bool(ctx.needs_input_grad[1])
    need_gamma = bool(ctx.needs_input_grad[2]) and gamma is not None
    result = iter(torch.ops.attnres.phase1_backward(
        grad_outs, grad_lses, blocks, w, gamma, ctx.eps, ctx.scale, ctx.rmsnorm, need_blocks,
        need_w, need_gamma))
    grad_blocks = [next(result) if need else None for need in need_blocks]
    grad_w = next(result) if need_w else None
    grad_gamma = next(result) if need_gamma else None
    return grad_blocks, grad_w, grad_gamma, None, None, None


_phase1.register_autograd(_phase1_grad, setup_context=_phase1_setup_context)


@torch.library.custom_op("attnres::phase2", mutates_args=())
def _phase2(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
            gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float, scale: float,
            rmsnorm: bool, input_norm: bool, norm_eps: float) -> Tensor:
    custom_op_calls["attnres::phase2"] += 1
    return phase2_forward(out, lse, partial, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm,
                          norm_weight=norm_weight, input_norm=input_norm, norm_eps=norm_eps)


@_phase2.register_fake
def _phase2_fake(out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm,
                 norm_eps):
    _validate.phase2(_PHASE2, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    return out.new_empty(out.shape)


@torch.library.custom_op("attnres::phase2_update", mutates_args=())
def _phase2_update(out: Tensor, lse: Tensor, partial: Tensor, update: Tensor, w: Tensor,
                   gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                   scale: float, rmsnorm: bool, input_norm: bool,
                   norm_eps: float) -> Tuple[Tensor, Tensor]:
    """(h, new_partial): attnres::phase2 over new_partial = partial + update, which the
    kernel forms (the bits of torch's add) and writes in the same pass."""
    custom_op_calls["attnres::phase2_update"] += 1
    return phase2_forward(out, lse, partial, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm,
                          norm_weight=norm_weight, input_norm=input_norm, norm_eps=norm_eps,
                          update=update)


@_phase2_update.register_fake
def _phase2_update_fake(out, lse, partial, update, w, gamma, norm_weight, eps, scale, rmsnorm,
                        input_norm, norm_eps):
    _validate.phase2(_PHASE2, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps,
                     update)
    return out.new_empty(out.shape), out.new_empty(out.shape)


@torch.library.custom_op("attnres::phase2_backward", mutates_args=())
def _phase2_backward(grad: Tensor, out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                     gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                     scale: float, rmsnorm: bool, input_norm: bool, norm_eps: float,
                     need: list[bool], grad_partial_in: Optional[Tensor] = None) -> list[Tensor]:
    """The needed gradients of (out, lse, partial, w, gamma, norm_weight), in that order.
    After attnres::phase2_update, partial is its new_partial and grad_partial_in what
    new_partial received from its other uses (added into the partial gradient)."""
    custom_op_calls["attnres::phase2_backward"] += 1
    grads = phase2_backward(grad, out, lse, partial, w, gamma, eps=eps, scale=scale,
                            rmsnorm=rmsnorm, norm_weight=norm_weight, input_norm=input_norm,
                            norm_eps=norm_eps, need=need, grad_partial_in=grad_partial_in)
    return [g for g in grads if g is not None]


def _phase2_applicable(need, partial, gamma, rmsnorm, input_norm) -> List[bool]:
    """`need` restricted to the gradients that exist for these arguments."""
    exists = [True, True, partial is not None, True, gamma is not None and rmsnorm, input_norm]
    return [bool(n) and e for n, e in zip(need, exists)]


@_phase2_backward.register_fake
def _phase2_backward_fake(grad, out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm,
                          input_norm, norm_eps, need, grad_partial_in=None):
    likes = [out, lse, out, w, w, w]
    need = _phase2_applicable(need, partial, gamma, rmsnorm, input_norm)
    return [like.new_empty(like.shape) for like, n in zip(likes, need) if n]


def _phase2_op_backward(saved, args, needs, grad, grad_partial_in=None) -> list:
    """The gradients (out, lse, partial, w, gamma, norm_weight) through the backward op,
    None where `needs` (of those six) does not ask or none exists. `saved`: the six
    tensors the forward saved (partial: new_partial after a fused update); `args`:
    (eps, scale, rmsnorm, input_norm, norm_eps)."""
    out, lse, partial, w, gamma, norm_weight = saved
    eps, scale, rmsnorm, input_norm, norm_eps = args
    need = _phase2_applicable(needs, partial, gamma, rmsnorm, input_norm)
    result = iter(torch.ops.attnres.phase2_backward(
        grad, out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm,
        norm_eps, need, grad_partial_in))
    return [next(result) if n else None for n in need]


def _phase2_setup_context(ctx, inputs, output):
    out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm, norm_eps = inputs
    ctx.args = (eps, scale, rmsnorm, input_norm, norm_eps)
    ctx.save_for_backward(out, lse, partial, w, gamma, norm_weight)


def _phase2_grad(ctx, grad):
    grads = _phase2_op_backward(ctx.saved_tensors, ctx.args, ctx.needs_input_grad[:6], grad)
    return tuple(grads) + (None,) * 5


_phase2.register_autograd(_phase2_grad, setup_context=_phase2_setup_context)


def _phase2_update_setup_context(ctx, inputs, output):
    out, lse, _, _, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm, norm_eps = inputs
    ctx.args = (eps, scale, rmsnorm, input_norm, norm_eps)
    # The backward reads only new_partial (the kernel's contract), not partial or update.
    ctx.save_for_backward(out, lse, output[1], w, gamma, norm_weight)


def _phase2_update_grad(ctx, grad, grad_new_partial):
    needs = ctx.needs_input_grad
    # new_partial = partial + update: one gradient for both, formed by the kernel with
    # the gradient new_partial receives from its other uses added in.
    g_out, g_lse, g_partial, g_w, g_gamma, g_nw = _phase2_op_backward(
        ctx.saved_tensors, ctx.args, (needs[0], needs[1], needs[2] or needs[3], *needs[4:7]),
        grad, grad_new_partial)
    return (g_out, g_lse, g_partial if needs[2] else None, g_partial if needs[3] else None,
            g_w, g_gamma, g_nw) + (None,) * 5


_phase2_update.register_autograd(_phase2_update_grad, setup_context=_phase2_update_setup_context)


# ---------------------------------------------------------------------------------
# The eager fast path (as attnres.ops.BlockAttnResFunction for the single op)
# ---------------------------------------------------------------------------------
#
# Outside tracing (_native.eager()) the public functions skip the dispatcher: they
# call phase1_forward / phase2_forward themselves when nothing needs a gradient, and
# apply these autograd.Functions otherwise. Each saves what the op's setup_context
# saves and computes what its autograd formula computes, through the same native
# calls, so both paths give the same bits.

class Phase1Function(torch.autograd.Function):
    """apply((N, S, eps, scale, rmsnorm), *blocks, w, gamma) -> (*outs, *lses), as
    attnres::phase1, for inputs _validate.plain_phase1() accepted (gamma None without
    RMSNorm)."""

    @staticmethod
    def forward(ctx, meta, *tensors):
        n, _, eps, scale, rmsnorm = meta[:5]
        ctx.meta = meta
        ctx.save_for_backward(*tensors[:n + 2])  # by reference, as _phase1_setup_context
        outs, lses = phase1_forward(tensors[:n], tensors[n], tensors[n + 1], eps=eps,
                                    scale=scale, rmsnorm=rmsnorm, _validated=True)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        grad_blocks, grad_w, grad_gamma = _phase1_function_grads(ctx, ctx.saved_tensors, grads)
        return (None, *grad_blocks, grad_w, grad_gamma)


def _phase1_function_grads(ctx, saved, grads, into=None):
    """(grad_blocks, grad_w, grad_gamma) of a Phase1Function whose saved tensors are
    `saved` (ctx.saved_tensors, read once: a saved-tensor hook such as non-reentrant
    checkpointing unpacks once), the block gradients added to `into` (as
    phase1_backward's _accumulate_into; eager only) when given."""
    n, num_queries, eps, scale, rmsnorm = ctx.meta[:5]
    blocks, (w, gamma) = list(saved[:n]), saved[n:]
    needs = ctx.needs_input_grad
    need_blocks = list(needs[1:n + 1])
    need_w = needs[n + 1]
    need_gamma = needs[n + 2] and gamma is not None
    grad_outs, grad_lses = list(grads[:num_queries]), list(grads[num_queries:2 * num_queries])
    if _native.eager() and not _grad_enabled():  # create_graph=False
        return phase1_backward(grad_outs, grad_lses, blocks, w, gamma, eps=eps, scale=scale,
                               rmsnorm=rmsnorm, need_blocks=need_blocks, need_w=need_w,
                               need_gamma=need_gamma, _validated=True, _accumulate_into=into)
    # Traced (compiled autograd), or create_graph=True: the backward op, as
    # _phase1_grad does (which refuses a double backward as the op does).
    assert into is None
    result = iter(torch.ops.attnres.phase1_backward(
        grad_outs, grad_lses, blocks, w, gamma, eps, scale, rmsnorm, need_blocks, need_w,
        need_gamma))
    grad_blocks = [next(result) if need else None for need in need_blocks]
    return grad_blocks, next(result) if need_w else None, next(result) if need_gamma else None


class BlockGradSums:
    """The gradients of a stream's completed blocks, summed inside phase 1's backward.

    A stream's phase 1 at each block start reads every block completed so far, so a
    block's gradient is the sum of one share per later block start. Left to autograd,
    each share is a new tensor and each sum a separate pass of torch's add (two reads
    and a write of the block). Instead, the phase 1 calls of one stream (Phase1InStream)
    keep a running sum per block here, and each call's kernel adds its shares into them
    (accumulate_grads: one more read per block, in the pass that reads the block
    anyway); the block's first reader in the forward, the last to run backward, hands
    the sum to autograd. A token output of each call, input of the next, makes that
    order certain and tells a call whether the next one ran in the same backward pass
    (if not, it is the first of this pass: what is held here is stale and dropped, and
    the end of the pass drops what a partial backward leaves). Off the eager path
    (compiled autograd, create_graph=True) every call returns its own shares for
    autograd to add, as Phase1Function does."""

    __slots__ = ("sums", "claimed")

    def __init__(self) -> None:
        self.sums: dict = {}  # block index -> its gradient summed so far, in this backward
        self.claimed = 0      # blocks [0, claimed) have had their first reader


class Phase1InStream(torch.autograd.Function):
    """Phase1Function for the calls of one stream: apply((N, S, eps, scale, rmsnorm,
    sums), *blocks, w, gamma, token) -> (*outs, *lses, token), the blocks those of
    every earlier call and more (BlockGradSums). `token` is the previous call's (None
    for the first)."""

    @staticmethod
    def forward(ctx, meta, *tensors):
        n, sums = meta[0], meta[5]
        ctx.first_read = sums.claimed  # blocks [first_read, n) are first read here
        sums.claimed = n
        ctx.set_materialize_grads(False)  # a missing gradient is zero to the kernel
        return (*Phase1Function.forward(ctx, meta, *tensors[:n + 2]), tensors[0].new_empty(0))

    @staticmethod
    def backward(ctx, *grads):
        n, sums = ctx.meta[0], ctx.meta[5].sums
        saved, needs = ctx.saved_tensors, ctx.needs_input_grad
        token = saved[0].new_zeros(0) if needs[n + 3] else None
        if not (_native.eager() and not _grad_enabled()):
            sums.clear()
            grad_blocks, grad_w, grad_gamma = _phase1_function_grads(ctx, saved, grads)
            return (None, *grad_blocks, grad_w, grad_gamma, token)
        if grads[-1] is None:  # the stream's next phase 1 did not run in this backward
            sums.clear()
            torch.autograd.Variable._execution_engine.queue_callback(sums.clear)
        into = None
        if any(i in sums for i in range(n)):
            into = [None if not needs[1 + i] else sums[i] if i in sums else
                    torch.zeros_like(saved[i], memory_format=torch.contiguous_format)
                    for i in range(n)]
        grad_blocks, grad_w, grad_gamma = _phase1_function_grads(ctx, saved, grads, into)
        for i, g in enumerate(grad_blocks):
            if g is not None:
                sums[i] = g
        mine = [sums.pop(i, None) if i >= ctx.first_read else None for i in range(n)]
        return (None, *mine, grad_w, grad_gamma, token)


class Phase2Function(torch.autograd.Function):
    """apply((eps, scale, rmsnorm, input_norm, norm_eps, contiguous[, pass_partial]), out,
    lse, partial, w, gamma, norm_weight, update) -> h, as attnres::phase2, or with update
    (h, new_partial), as attnres::phase2_update, for inputs _validate.plain_phase2()
    accepted (gamma None without RMSNorm, norm_weight None without input_norm). With
    pass_partial (and partial, no update): (h, partial), the partial block passed
    through, so that the gradient of its later uses reaches this node and the kernel
    adds it into the partial block's gradient (phase2_in_stream)."""

    @staticmethod
    def forward(ctx, meta, out, lse, partial, w, gamma, norm_weight, update):
        eps, scale, rmsnorm, input_norm, norm_eps, contiguous = meta[:6]
        ctx.meta = meta
        result = phase2_forward(out, lse, partial, w, gamma, eps=eps, scale=scale,
                                rmsnorm=rmsnorm, norm_weight=norm_weight, input_norm=input_norm,
                                norm_eps=norm_eps, update=update, _validated=True,
                                _contiguous=contiguous)
        if update is None:
            ctx.save_for_backward(out, lse, partial, w, gamma, norm_weight)  # as the op's
            if meta[6:] != (True,):
                return result
            # autograd returns an input as a view of it with this node as its history.
            ctx.set_materialize_grads(False)
            return result, partial
        # As _phase2_update_setup_context. Unlike the op, an unused new_partial (the
        # stream's final mix) passes no gradient rather than zeros, and the kernel
        # then adds none.
        ctx.save_for_backward(out, lse, result[1], w, gamma, norm_weight)
        ctx.set_materialize_grads(False)
        return result

    @staticmethod
    def backward(ctx, grad, grad_new_partial=None):
        eps, scale, rmsnorm, input_norm, norm_eps = ctx.meta[:5]
        saved = ctx.saved_tensors
        out, lse, partial, w, gamma, norm_weight = saved
        needs = ctx.needs_input_grad
        # With an update, partial and update share one gradient (see _phase2_update_grad).
        need = (needs[1], needs[2], needs[3] or needs[7], needs[4], needs[5], needs[6])
        if grad is None:  # only new_partial's gradient arrived
            grad = torch.zeros_like(out)
        if _native.eager() and not _grad_enabled():  # create_graph=False
            need = _phase2_applicable(need, partial, gamma, rmsnorm, input_norm)
            grads = phase2_backward(grad, out, lse, partial, w, gamma, eps=eps, scale=scale,
                                    rmsnorm=rmsnorm, norm_weight=norm_weight,
                                    input_norm=input_norm, norm_eps=norm_eps, need=need,
                                    grad_partial_in=grad_new_partial, _validated=True)
            grads = [g if n else None for g, n in zip(grads, need)]
        else:
            # Traced (compiled autograd), or create_graph=True: the backward op, as
            # _phase2_grad does (which refuses a double backward as the op does).
            grads = _phase2_op_backward(saved, ctx.meta[:5], need, grad, grad_new_partial)
        g_out, g_lse, g_partial, g_w, g_gamma, g_nw = grads
        return (None, g_out, g_lse, g_partial if needs[3] else None, g_w, g_gamma, g_nw,
                g_partial if needs[7] else None)


_apply_phase1 = _fast_apply(Phase1Function)
_apply_phase1_in_stream = _fast_apply(Phase1InStream)
_apply_phase2 = _fast_apply(Phase2Function)
_eager = _native.eager
_grad_enabled = torch.is_grad_enabled


# ---------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------

def block_attn_res_phase1(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor] = None, *,
                          eps: float = 1e-6, scale: float = 1.0, rmsnorm: bool = True
                          ) -> Tuple[List[Tensor], List[Tensor]]:
    """Phase 1 for S queries over the N completed blocks, differentiable.

    ``blocks``: a list of N tensors ``[..., D]``; ``w`` and ``gamma``: ``[S, D]`` (gamma
    None: no learned RMSNorm weight; ignored without RMSNorm). Returns ``(outs, lses)``:
    S tensors ``[..., D]`` in the blocks' dtype and S tensors ``[...]`` in fp32 (fp64
    for fp64 blocks).
    """
    if _eager():  # the fast path; anything unusual falls through to the op
        plain = _validate.plain_phase1(blocks, w, gamma, eps, scale, _grad_enabled())
        if plain is not None:
            blocks, num_queries = plain[0], plain[6]
            gamma = gamma if rmsnorm else None
            if not plain[3]:  # nothing requires grad
                return phase1_forward(blocks, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm,
                                      _validated=True)
            result = _apply_phase1((len(blocks), num_queries, eps, scale, rmsnorm), *blocks, w,
                                   gamma)
            return list(result[:num_queries]), list(result[num_queries:])
    if not isinstance(blocks, (list, tuple)):
        raise _validate.error(_PHASE1, "blocks", "a list or tuple of tensors",
                              _validate._kind(blocks))
    _validate.phase1(_PHASE1, blocks, w, gamma, eps, scale)
    result = torch.ops.attnres.phase1(list(blocks), w, gamma if rmsnorm else None, float(eps),
                                      float(scale), bool(rmsnorm))
    num_queries = w.shape[0]
    return list(result[:num_queries]), list(result[num_queries:])


def phase1_in_stream(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor],
                     sums: BlockGradSums, token: Optional[Tensor], *, eps: float, scale: float,
                     rmsnorm: bool) -> Tuple[List[Tensor], List[Tensor], Optional[Tensor]]:
    """block_attn_res_phase1 for one of a stream's phase 1 calls, its block gradients
    summed in `sums` (BlockGradSums) when it takes the eager fast path with a gradient.
    `token`: what the stream's previous call returned (None at the first). Returns
    (outs, lses, token for the next call)."""
    if _eager() and _grad_enabled():
        plain = _validate.plain_phase1(blocks, w, gamma, eps, scale, True)
        if plain is not None and plain[3]:
            blocks, num_queries = plain[0], plain[6]
            result = _apply_phase1_in_stream(
                (len(blocks), num_queries, eps, scale, rmsnorm, sums), *blocks, w,
                gamma if rmsnorm else None, token)
            return list(result[:num_queries]), list(result[num_queries:-1]), result[-1]
    outs, lses = block_attn_res_phase1(blocks, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm)
    return outs, lses, token


def phase2_in_stream(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                     gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                     norm_weight: Optional[Tensor], input_norm: bool, norm_eps: float,
                     update: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """block_attn_res_phase2 for a stream's sub-layer: (h, the partial block for the next
    mix). Without an update the partial block (the block's first output) is read here
    and again by the next mix; on the eager fast path with a gradient it comes back
    through this call (Phase2Function's pass_partial), so that its two gradients are
    added in the kernel rather than by autograd."""
    if update is None and partial is not None and _eager() and _grad_enabled():
        plain = _validate.plain_phase2(out, lse, partial, w, gamma, norm_weight, eps, scale,
                                       norm_eps, True)
        if plain is not None and plain[1]:
            return _apply_phase2((eps, scale, rmsnorm, input_norm, norm_eps, plain[0], True),
                                 out, lse, partial, w, gamma if rmsnorm else None, norm_weight,
                                 None)
    result = block_attn_res_phase2(out, lse, partial, w, gamma, eps=eps, scale=scale,
                                   rmsnorm=rmsnorm, norm_weight=norm_weight,
                                   input_norm=input_norm, norm_eps=norm_eps, update=update)
    return result if update is not None else (result, partial)  # (h, p + update) or (h, p)


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
        raise _validate.error(_PHASE2, "norm_weight", "None when input_norm=False",
                              "a tensor")
    if _eager():  # the fast path; anything unusual falls through to the op
        plain = _validate.plain_phase2(out, lse, partial, w, gamma, norm_weight, eps, scale,
                                       norm_eps, _grad_enabled(), update)
        if plain is not None:
            if partial is None and not input_norm:  # h = out (plain: no update then)
                return out
            gamma = gamma if rmsnorm else None
            contiguous, requires_grad = plain
            if requires_grad:
                return _apply_phase2((eps, scale, rmsnorm, input_norm, norm_eps, contiguous),
                                     out, lse, partial, w, gamma, norm_weight, update)
            return phase2_forward(out, lse, partial, w, gamma, eps=eps, scale=scale,
                                  rmsnorm=rmsnorm, norm_weight=norm_weight,
                                  input_norm=input_norm, norm_eps=norm_eps, update=update,
                                  _validated=True, _contiguous=contiguous)
    _validate.phase2(_PHASE2, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps,
                     update)
    if update is not None:
        return torch.ops.attnres.phase2_update(out, lse, partial, update, w,
                                               gamma if rmsnorm else None, norm_weight,
                                               float(eps), float(scale), bool(rmsnorm),
                                               bool(input_norm), float(norm_eps))
    if partial is None and not input_norm:  # h = out
        return out
    return torch.ops.attnres.phase2(out, lse, partial, w, gamma if rmsnorm else None,
                                    norm_weight, float(eps), float(scale), bool(rmsnorm),
                                    bool(input_norm), float(norm_eps))
