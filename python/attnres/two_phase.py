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
import math
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
# Validation (the one style of _validate: "<function>: <argument> must be ..., got ...")
# ---------------------------------------------------------------------------------

def _check_scalars(function: str, eps: float, scale: float) -> None:
    _validate.scalars(function, scale, eps)


def _check_phase1(function: str, blocks: object, w: object, gamma: object, eps: float,
                  scale: float) -> Tuple[List[Tensor], int, int]:
    """Blocks (a non-empty list of [..., D] tensors of one dtype, device and shape),
    w and gamma [S, D]. Returns (blocks, D, S)."""
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise _validate.error(function, "blocks", "a non-empty list or tuple of tensors",
                              _validate._kind(blocks) if not isinstance(blocks, (list, tuple))
                              else f"an empty {type(blocks).__name__}")
    first, _ = _validate.first_source(function, blocks, None)
    dim = first.shape[-1]
    if not isinstance(w, Tensor) or w.dim() != 2 or w.shape[-1] != dim or w.shape[0] < 1:
        raise _validate.error(function, "w", f"a tensor [S, D] with D = {dim} (one row per "
                              "query)", _validate._kind(w))
    for i, b in enumerate(blocks):
        _validate.tensor(function, f"blocks[{i}]", b, first.shape, first.dtype, first.device,
                         "blocks[0]", "the shape of blocks[0]")
    _validate.tensor(function, "w", w, None, first.dtype, first.device, "blocks[0]", "")
    if gamma is not None:
        _validate.tensor(function, "gamma", gamma, w.shape, first.dtype, first.device,
                         "blocks[0]", "the shape of w")
    _check_scalars(function, eps, scale)
    return list(blocks), dim, w.shape[0]


def _check_phase2(function: str, out: object, lse: object, partial: object, w: object,
                  gamma: object, norm_weight: object, eps: float, scale: float,
                  norm_eps: float) -> None:
    if not isinstance(out, Tensor) or out.dim() == 0:
        raise _validate.error(function, "out", "a tensor [..., D] (phase 1's output)",
                              _validate._kind(out))
    if out.dtype not in _validate.SUPPORTED_DTYPES:
        raise _validate.error(function, "out", "a bfloat16, float16, float32 or float64 tensor",
                              str(out.dtype))
    dim = out.shape[-1]
    acc = _native.accumulation_dtype(out.dtype)
    _validate.tensor(function, "lse", lse, out.shape[:-1], acc, out.device, "out",
                     "the leading dimensions of out; fp32, fp64 for fp64 inputs")
    if partial is not None:
        _validate.tensor(function, "partial", partial, out.shape, out.dtype, out.device, "out",
                         "the shape of out")
    _validate.tensor(function, "w", w, (dim,), out.dtype, out.device, "out", "D")
    for name, t in (("gamma", gamma), ("norm_weight", norm_weight)):
        if t is not None:
            _validate.tensor(function, name, t, (dim,), out.dtype, out.device, "out", "D")
    _check_scalars(function, eps, scale)
    if not (math.isfinite(norm_eps) and norm_eps >= 0):
        raise _validate.error(function, "norm_eps", "finite and >= 0", str(norm_eps))


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
    blocks, dim, num_queries = _check_phase1(function, blocks, w, gamma, eps, scale)
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
    blocks, dim, num_queries = _check_phase1(function, blocks, w, gamma, eps, scale)
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
    _check_phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    out, partial, stride = _phase2_rows(out, partial)
    result = _native._new_output(out, tokens * dim * _native._ELEMENT_BYTES[out.dtype])
    if tokens == 0:
        return result
    lse = lse.contiguous()
    gamma = gamma.contiguous() if rmsnorm and gamma is not None else None
    norm_weight = norm_weight.contiguous() if input_norm and norm_weight is not None else None
    p = _params(**_common(out, tokens, dim, eps, scale, rmsnorm, function),
                query_out=out.data_ptr(), query_lse=lse.data_ptr(), partial=_ptr(partial),
                source_row_stride=stride, proj_weight=w.contiguous().data_ptr(),
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
    _check_phase2(function, out, lse, partial, w, gamma, norm_weight, eps, scale, norm_eps)
    dim = out.shape[-1]
    tokens = out.numel() // dim
    grad = grad.to(out.dtype)
    _validate.grad_out(function, "grad", grad, out)
    out, partial, stride = _phase2_rows(out, partial)
    (grad,), grad_stride = _native._rows([grad], dim)
    gamma = gamma if rmsnorm else None
    norm_weight = norm_weight if input_norm else None
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
                query_out=out.data_ptr(), query_lse=lse.contiguous().data_ptr(),
                partial=_ptr(partial), source_row_stride=stride,
                proj_weight=w.contiguous().data_ptr(),
                gamma=_ptr(gamma.contiguous() if gamma is not None else None),
                input_norm=1 if input_norm else 0, norm_eps=norm_eps,
                norm_weight=_ptr(norm_weight.contiguous() if norm_weight is not None else None),
                grad_out=grad.data_ptr(), grad_out_row_stride=grad_stride,
                grad_query_out=_ptr(grad_out), grad_query_lse=_ptr(grad_lse),
                grad_partial=_ptr(grad_partial), grad_source_row_stride=dim,
                grad_proj_weight=_ptr(grad_w), grad_gamma=_ptr(grad_gamma),
                grad_norm_weight=_ptr(grad_nw))
    _native._call(_native._lib.attnres_phase2_backward, p, out)
    return result
