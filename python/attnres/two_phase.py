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
        h     = beta o_s + (1 - beta) p                   (h = o_s without p)
        out   = h, or RMSNorm(h) * norm_weight            (the sub-layer's input norm, fused)

In exact arithmetic ``h`` is the single op over ``[v_0, ..., v_{N-1}, p]``.

Ops in the ``attnres`` namespace: ``phase1`` / ``phase1_backward`` and ``phase2`` /
``phase2_backward``. Phase 1 returns *lists* of S outputs and S LSEs, so that each
sub-layer's gradient lands on its own tensor; its backward takes all S gradients at
once (a missing one is zero), reads each block once and writes each block's gradient
once. What autograd saves: the blocks, ``w`` and ``gamma`` by reference (phase 1);
``o_s``, ``lse_s``, ``p`` and the weights (phase 2). Nothing is recomputed twice in
memory: the backward kernels recompute logits in the pass that reads the rows anyway.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _native, _validate

_PHASE1 = "attnres.block_attn_res_phase1"
_PHASE2 = "attnres.block_attn_res_phase2"

for _name in ("attnres_phase1_forward", "attnres_phase1_backward", "attnres_phase2_forward",
              "attnres_phase2_backward"):
    getattr(_native._lib, _name).argtypes = [ctypes.c_char_p]
    getattr(_native._lib, _name).restype = ctypes.c_int


# ---------------------------------------------------------------------------------
# Native calls
# ---------------------------------------------------------------------------------

def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


def _params(**fields) -> bytes:
    p = _native._Params()
    _native._lib.attnres_params_init(ctypes.byref(p))
    for name, value in fields.items():
        setattr(p, name, value)
    return bytes(p)


def _pointer_array(addresses: List[int]):
    array = _native._pointers(addresses)
    return array, ctypes.cast(array.buffer_info()[0], ctypes.POINTER(ctypes.c_void_p))


def _common(first: Tensor, tokens: int, dim: int, eps: float, scale: float, rmsnorm: bool,
            function: str) -> dict:
    device, stream = _native._stream_and_device(function, first)
    return dict(num_tokens=tokens, dim=dim, dtype=_native._DTYPES[first.dtype], device=device,
                stream=stream, scale=scale, eps=eps, rmsnorm=1 if rmsnorm else 0)


def phase1_forward(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor], *, eps: float,
                   scale: float, rmsnorm: bool, function: str = _PHASE1
                   ) -> Tuple[List[Tensor], List[Tensor]]:
    """(outs, lses): S outputs [..., D] in the blocks' dtype, S LSEs [...] fp32/fp64."""
    blocks, dim, num_queries = _validate.phase1(function, blocks, w, gamma, eps, scale)
    blocks, stride = _native._rows(blocks, dim)
    first = blocks[0]
    tokens = first.numel() // dim
    nbytes = tokens * dim * _native._ELEMENT_BYTES[first.dtype]
    outs = [_native._new_output(first, nbytes) for _ in range(num_queries)]
    acc = _native.accumulation_dtype(first.dtype)
    lses = [first.new_empty(first.shape[:-1], dtype=acc) for _ in range(num_queries)]
    if tokens == 0:
        return outs, lses
    w, gamma = w.contiguous(), (gamma.contiguous() if rmsnorm and gamma is not None else None)
    block_array, block_ptrs = _pointer_array([b.data_ptr() for b in blocks])
    out_array, out_ptrs = _pointer_array([o.data_ptr() for o in outs])
    lse_array, lse_ptrs = _pointer_array([x.data_ptr() for x in lses])
    p = _params(**_common(first, tokens, dim, eps, scale, rmsnorm, function),
                num_blocks=len(blocks), blocks=block_ptrs, source_row_stride=stride,
                proj_weight=w.data_ptr(), gamma=_ptr(gamma), num_queries=num_queries,
                query_outs=out_ptrs, out_row_stride=dim, query_lses=lse_ptrs)
    _native._call(_native._lib.attnres_phase1_forward, p, first)
    return outs, lses


def phase1_backward(grad_outs: Sequence[Optional[Tensor]], grad_lses: Sequence[Optional[Tensor]],
                    blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor], *, eps: float,
                    scale: float, rmsnorm: bool, need_blocks: Optional[Sequence[bool]] = None,
                    need_w: bool = True, need_gamma: bool = True,
                    function: str = _PHASE1 + " (backward)"):
    """(grad_blocks: list of N (tensor or None), grad_w [S, D] or None, grad_gamma or None)."""
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
    grad_blocks = [_native._new_output(first, nbytes) if need else None for need in need_blocks]
    gamma = gamma if rmsnorm else None
    grad_w = w.new_empty(w.shape) if need_w else None
    grad_gamma = w.new_empty(w.shape) if need_gamma and gamma is not None else None
    if tokens == 0:
        for g in (grad_w, grad_gamma):
            if g is not None:
                g.zero_()
        return grad_blocks, grad_w, grad_gamma
    w, gamma = w.contiguous(), (gamma.contiguous() if gamma is not None else None)
    block_array, block_ptrs = _pointer_array([b.data_ptr() for b in blocks])
    grad_array, grad_ptrs = _pointer_array([_ptr(g) for g in grad_blocks])
    go_array, go_ptrs = _pointer_array([_ptr(g) for g in grad_outs])
    gl_array, gl_ptrs = _pointer_array([_ptr(g) for g in grad_lses])
    p = _params(**_common(first, tokens, dim, eps, scale, rmsnorm, function),
                num_blocks=len(blocks), blocks=block_ptrs, source_row_stride=stride,
                proj_weight=w.data_ptr(), gamma=_ptr(gamma), num_queries=num_queries,
                grad_query_outs=go_ptrs, grad_out_row_stride=dim, grad_query_lses=gl_ptrs,
                grad_blocks=grad_ptrs, grad_source_row_stride=dim,
                grad_proj_weight=_ptr(grad_w), grad_gamma=_ptr(grad_gamma))
    _native._call(_native._lib.attnres_phase1_backward, p, first)
    return grad_blocks, grad_w, grad_gamma


def _phase2_rows(out: Tensor, partial: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor], int]:
    dim = out.shape[-1]
    rows, stride = _native._rows([out] if partial is None else [out, partial], dim)
    return rows[0], (rows[1] if partial is not None else None), stride


def phase2_forward(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                   gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                   norm_weight: Optional[Tensor] = None, input_norm: bool = False,
                   norm_eps: float = 1e-6, function: str = _PHASE2) -> Tensor:
    """h (or RMSNorm(h) * norm_weight with input_norm), [..., D] in out's dtype."""
    _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    out, partial, stride = _phase2_rows(out, partial)
    result = _native._new_output(out, tokens * dim * _native._ELEMENT_BYTES[out.dtype])
    if tokens == 0:
        return result
    # Held in locals until the call returns: a temporary's storage would be freed
    # before the library reads it.
    lse, w = lse.contiguous(), w.contiguous()
    gamma = gamma.contiguous() if rmsnorm and gamma is not None else None
    norm_weight = norm_weight.contiguous() if input_norm and norm_weight is not None else None
    p = _params(**_common(out, tokens, dim, eps, scale, rmsnorm, function),
                query_out=out.data_ptr(), query_lse=lse.data_ptr(), partial=_ptr(partial),
                source_row_stride=stride, proj_weight=w.data_ptr(),
                gamma=_ptr(gamma), out=result.data_ptr(), out_row_stride=dim,
                input_norm=1 if input_norm else 0, norm_eps=norm_eps,
                norm_weight=_ptr(norm_weight))
    _native._call(_native._lib.attnres_phase2_forward, p, out)
    return result


def phase2_backward(grad: Tensor, out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                    gamma: Optional[Tensor], *, eps: float, scale: float, rmsnorm: bool,
                    norm_weight: Optional[Tensor] = None, input_norm: bool = False,
                    norm_eps: float = 1e-6, need: Sequence[bool] = (True,) * 6,
                    function: str = _PHASE2 + " (backward)"):
    """Gradients (out, lse, partial, w, gamma, norm_weight), None where not needed or
    not applicable."""
    _validate.phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    grad = grad.to(out.dtype)
    _validate.grad_out(function, "grad", grad, out)
    out, partial, stride = _phase2_rows(out, partial)
    (grad,), grad_stride = _native._rows([grad], dim)
    # Held in locals until the call returns (see phase2_forward).
    lse, w = lse.contiguous(), w.contiguous()
    gamma = gamma.contiguous() if rmsnorm and gamma is not None else None
    norm_weight = norm_weight.contiguous() if input_norm and norm_weight is not None else None
    need_out, need_lse, need_partial, need_w, need_gamma, need_nw = need
    nbytes = tokens * dim * _native._ELEMENT_BYTES[out.dtype]
    grad_out = _native._new_output(out, nbytes) if need_out else None
    grad_lse = torch.empty_like(lse, memory_format=torch.contiguous_format) if need_lse else None
    grad_partial = (_native._new_output(out, nbytes)
                    if need_partial and partial is not None else None)
    grad_w = w.new_empty(w.shape) if need_w else None
    grad_gamma = w.new_empty(w.shape) if need_gamma and gamma is not None else None
    grad_nw = w.new_empty(w.shape) if need_nw and input_norm else None
    result = [grad_out, grad_lse, grad_partial, grad_w, grad_gamma, grad_nw]
    if tokens == 0:
        for g in result[3:]:
            if g is not None:
                g.zero_()
        return result
    p = _params(**_common(out, tokens, dim, eps, scale, rmsnorm, function),
                query_out=out.data_ptr(), query_lse=lse.data_ptr(),
                partial=_ptr(partial), source_row_stride=stride,
                proj_weight=w.data_ptr(), gamma=_ptr(gamma),
                input_norm=1 if input_norm else 0, norm_eps=norm_eps,
                norm_weight=_ptr(norm_weight),
                grad_out=grad.data_ptr(), grad_out_row_stride=grad_stride,
                grad_query_out=_ptr(grad_out), grad_query_lse=_ptr(grad_lse),
                grad_partial=_ptr(grad_partial), grad_source_row_stride=dim,
                grad_proj_weight=_ptr(grad_w), grad_gamma=_ptr(grad_gamma),
                grad_norm_weight=_ptr(grad_nw))
    _native._call(_native._lib.attnres_phase2_backward, p, out)
    return result


# ---------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::phase1", mutates_args=())
def _phase1(blocks: list[Tensor], w: Tensor, gamma: Optional[Tensor], eps: float, scale: float,
            rmsnorm: bool) -> list[Tensor]:
    """The S outputs then the S LSEs, in one list (a fixed length: 2S)."""
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
    return phase2_forward(out, lse, partial, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm,
                          norm_weight=norm_weight, input_norm=input_norm, norm_eps=norm_eps)


@_phase2.register_fake
def _phase2_fake(out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm,
                 norm_eps):
    _validate.phase2(_PHASE2, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    return out.new_empty(out.shape)


@torch.library.custom_op("attnres::phase2_backward", mutates_args=())
def _phase2_backward(grad: Tensor, out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                     gamma: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                     scale: float, rmsnorm: bool, input_norm: bool, norm_eps: float,
                     need: list[bool]) -> list[Tensor]:
    """The needed gradients of (out, lse, partial, w, gamma, norm_weight), in that order."""
    grads = phase2_backward(grad, out, lse, partial, w, gamma, eps=eps, scale=scale,
                            rmsnorm=rmsnorm, norm_weight=norm_weight, input_norm=input_norm,
                            norm_eps=norm_eps, need=need)
    return [g for g in grads if g is not None]


def _phase2_applicable(need, partial, gamma, rmsnorm, input_norm) -> List[bool]:
    """`need` restricted to the gradients that exist for these arguments."""
    exists = [True, True, partial is not None, True, gamma is not None and rmsnorm, input_norm]
    return [bool(n) and e for n, e in zip(need, exists)]


@_phase2_backward.register_fake
def _phase2_backward_fake(grad, out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm,
                          input_norm, norm_eps, need):
    likes = [out, lse, out, w, w, w]
    need = _phase2_applicable(need, partial, gamma, rmsnorm, input_norm)
    return [like.new_empty(like.shape) for like, n in zip(likes, need) if n]


def _phase2_setup_context(ctx, inputs, output):
    out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm, norm_eps = inputs
    ctx.args = (eps, scale, rmsnorm, input_norm, norm_eps)
    ctx.save_for_backward(out, lse, partial, w, gamma, norm_weight)


def _phase2_grad(ctx, grad):
    out, lse, partial, w, gamma, norm_weight = ctx.saved_tensors
    eps, scale, rmsnorm, input_norm, norm_eps = ctx.args
    need = _phase2_applicable(ctx.needs_input_grad[:6], partial, gamma, rmsnorm, input_norm)
    result = iter(torch.ops.attnres.phase2_backward(
        grad, out, lse, partial, w, gamma, norm_weight, eps, scale, rmsnorm, input_norm,
        norm_eps, need))
    return tuple(next(result) if n else None for n in need) + (None,) * 5


_phase2.register_autograd(_phase2_grad, setup_context=_phase2_setup_context)


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
    if not isinstance(blocks, (list, tuple)):
        raise _validate.error(_PHASE1, "blocks", "a list or tuple of tensors",
                              _validate._kind(blocks))
    _validate.phase1(_PHASE1, blocks, w, gamma, eps, scale)
    result = torch.ops.attnres.phase1(list(blocks), w, gamma if rmsnorm else None, float(eps),
                                      float(scale), bool(rmsnorm))
    num_queries = w.shape[0]
    return list(result[:num_queries]), list(result[num_queries:])


def block_attn_res_phase2(out: Tensor, lse: Tensor, partial: Optional[Tensor], w: Tensor,
                          gamma: Optional[Tensor] = None, *, eps: float = 1e-6,
                          scale: float = 1.0, rmsnorm: bool = True,
                          norm_weight: Optional[Tensor] = None,
                          input_norm: Optional[bool] = None, norm_eps: float = 1e-6) -> Tensor:
    """Phase 2 for one sub-layer, differentiable: merges phase 1's ``out``, ``lse`` of
    this sub-layer's query (``w``, ``gamma``: ``[D]``) with the partial block.

    ``partial`` None returns ``out`` (the first sub-layer of a block), after the input
    norm if there is one. ``input_norm`` (default: ``norm_weight is not None``)
    returns ``RMSNorm(h) * norm_weight`` (``norm_weight`` None: ones), fused so that
    ``h`` makes no round trip through memory.
    """
    if input_norm is None:
        input_norm = norm_weight is not None
    if norm_weight is not None and not input_norm:
        raise _validate.error(_PHASE2, "norm_weight", "None when input_norm=False",
                              "a tensor")
    _validate.phase2(_PHASE2, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    if partial is None and not input_norm:  # h = out
        return out
    return torch.ops.attnres.phase2(out, lse, partial, w, gamma if rmsnorm else None,
                                    norm_weight, float(eps), float(scale), bool(rmsnorm),
                                    bool(input_norm), float(norm_eps))
