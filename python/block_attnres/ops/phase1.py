"""Phase 1 of the two-phase schedule (docs/DESIGN.md, "The two phases"): its native
calls, its declaration (``OP``), the public function ``block_attn_res_phase1``, and the
stream's variant, whose block gradients are summed inside the kernels.

Within one block of S sub-layers every sub-layer mixes the same N completed blocks,
so phase 1 mixes them for all S queries in one read of the blocks. Per token
(``u_s = w_s * gamma_s``, ``r_i`` the RMS of ``v_i``, 1 without RMSNorm)::

    z_si  = scale * dot(u_s, v_i) / r_i
    lse_s = log sum_i exp(z_si)                       (fp32; fp64 for fp64 inputs)
    o_s   = sum_i exp(z_si - lse_s) v_i               (the blocks' dtype)

Op: ``attnres::phase1(Tensor[] blocks, Tensor w, Tensor? gamma, float eps, float scale,
bool rmsnorm) -> Tensor[]``, the S outputs then the S LSEs in one list (a fixed length,
2S), so that each sub-layer's gradient lands on its own tensor. Its backward takes all
S gradients at once (a missing one is zero), reads each block once and writes each
block's gradient once. What autograd saves: the blocks, ``w`` and ``gamma`` by
reference.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _native, _validate
from .._op import OpDef, fast_apply

__all__ = ["block_attn_res_phase1", "forward", "gradients", "BlockGradSums",
           "phase1_in_stream", "OP"]

_FUNCTION = "attnres.block_attn_res_phase1"

_COMMON = ("num_tokens", "dim", "dtype", "device", "stream", "scale", "eps", "rmsnorm",
           "num_blocks", "source_row_stride", "proj_weight", "gamma", "num_queries")
_forward_call = _native.entry_call(
    "attnres_phase1_forward", _COMMON + ("out_row_stride",),
    ("blocks", "query_outs", "query_lses"))
_backward_call = _native.entry_call(
    "attnres_phase1_backward",
    _COMMON + ("grad_out_row_stride", "grad_source_row_stride", "grad_proj_weight",
               "grad_gamma", "accumulate_grads"),
    ("blocks", "grad_query_outs", "grad_query_lses", "grad_blocks"))


def _blocks(blocks: Sequence[Tensor], layout: Optional[_validate.Layout]):
    """(blocks in one row stride, their pointers, the stride)."""
    dim = blocks[0].shape[-1]
    if layout is not None and layout.contiguous:
        return blocks, layout.pointers, dim
    blocks, stride = _native.rows(list(blocks), dim)
    return blocks, [b.data_ptr() for b in blocks], stride


def forward(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor], eps: float,
            scale: float, rmsnorm: bool, *,
            layout: Optional[_validate.Layout] = None) -> List[Tensor]:
    """The S outputs [..., D] in the blocks' dtype, then the S LSEs [...] (fp32/fp64),
    for checked inputs. `layout`: what _validate.plain_phase1() returned, or None."""
    blocks, pointers, stride = _blocks(blocks, layout)
    first = blocks[0]
    dim, num_queries = first.shape[-1], w.shape[0]
    tokens, nbytes = _native.row_bytes(first, dim)
    outs = [_native.new_output(first, nbytes) for _ in range(num_queries)]
    acc = _native.accumulation_dtype(first.dtype)
    lses = [first.new_empty(first.shape[:-1], dtype=acc) for _ in range(num_queries)]
    if tokens == 0:
        return outs + lses
    # Held in locals until the call returns: a temporary's storage would be freed
    # before the library reads it.
    w, gamma = w.contiguous(), (gamma.contiguous() if rmsnorm and gamma is not None else None)
    device, stream = _native.device_and_stream(_FUNCTION, first)
    _forward_call(first, tokens, dim, _native.DTYPE_CODES[first.dtype], device, stream, scale,
                  eps, 1 if rmsnorm else 0, len(blocks), stride, w.data_ptr(),
                  _native.ptr(gamma), num_queries, dim, pointers, [o.data_ptr() for o in outs],
                  [x.data_ptr() for x in lses])
    return outs + lses


class Gradients(NamedTuple):
    """Phase 1's gradients; None where not asked for or not applicable."""

    blocks: List[Optional[Tensor]]
    w: Optional[Tensor]      # [S, D]
    gamma: Optional[Tensor]  # [S, D]


def _upstream(function: str, grad_outs, grad_lses, first: Tensor, num_queries: int):
    """The S output and S LSE gradients checked, in the kernels' dtypes, contiguous."""
    for name, grads in (("grad_outs", grad_outs), ("grad_lses", grad_lses)):
        if len(grads) != num_queries:
            raise _validate.error(function, name, f"a list of S = {num_queries} (one per query)",
                                  f"{len(grads)} entries")
    acc = _native.accumulation_dtype(first.dtype)
    grad_outs = [None if g is None else g.to(first.dtype).contiguous() for g in grad_outs]
    grad_lses = [None if g is None else g.to(acc).contiguous() for g in grad_lses]
    for s, g in enumerate(grad_outs):
        if g is not None:
            _validate.grad_out(function, f"grad_outs[{s}]", g, first)
    for s, g in enumerate(grad_lses):
        if g is not None and g.shape != first.shape[:-1]:
            raise _validate.error(function, f"grad_lses[{s}]",
                                  f"of shape {tuple(first.shape[:-1])}", f"shape {tuple(g.shape)}")
    return grad_outs, grad_lses


def gradients(function: str, grad_outs: Sequence[Optional[Tensor]],
              grad_lses: Sequence[Optional[Tensor]], blocks: Sequence[Tensor], w: Tensor,
              gamma: Optional[Tensor], eps: float, scale: float, rmsnorm: bool,
              needs: Optional[Sequence[bool]] = None,
              accumulate_into: Optional[Sequence[Optional[Tensor]]] = None) -> Gradients:
    """Phase 1's gradients for checked blocks, w and gamma, given the S output and S LSE
    gradients (None: zero; checked here, errors naming `function`). `needs`: one flag
    per block, then w and gamma (None: all). `accumulate_into`: N contiguous tensors
    like the blocks (None where a block's gradient is not needed), to which the kernel
    adds the block gradients (rounding once) and which come back as the block
    gradients."""
    blocks, pointers, stride = _blocks(blocks, None)
    first = blocks[0]
    dim, num_queries = first.shape[-1], w.shape[0]
    grad_outs, grad_lses = _upstream(function, grad_outs, grad_lses, first, num_queries)
    needs = [True] * (len(blocks) + 2) if needs is None else needs
    tokens, nbytes = _native.row_bytes(first, dim)
    if accumulate_into is None:
        grad_blocks = [_native.new_output(first, nbytes) if need else None
                       for need in needs[:len(blocks)]]
    else:
        grad_blocks = [g if need else None for g, need in zip(accumulate_into, needs)]
    gamma = gamma if rmsnorm else None
    grads = Gradients(grad_blocks, w.new_empty(w.shape) if needs[-2] else None,
                      w.new_empty(w.shape) if needs[-1] and gamma is not None else None)
    if tokens == 0:
        _native.zero_sums((grads.w, grads.gamma))
        return grads
    w, gamma = w.contiguous(), (gamma.contiguous() if gamma is not None else None)
    device, stream = _native.device_and_stream(function, first)
    _backward_call(first, tokens, dim, _native.DTYPE_CODES[first.dtype], device, stream, scale,
                   eps, 1 if rmsnorm else 0, len(blocks), stride, w.data_ptr(),
                   _native.ptr(gamma), num_queries, dim, dim, _native.ptr(grads.w),
                   _native.ptr(grads.gamma), 0 if accumulate_into is None else 1, pointers,
                   [_native.ptr(g) for g in grad_outs], [_native.ptr(g) for g in grad_lses],
                   [_native.ptr(g) for g in grad_blocks])
    return grads


# ---------------------------------------------------------------------------------
# The declaration
# ---------------------------------------------------------------------------------

def _check(function, blocks, w, gamma, eps, scale, rmsnorm):
    _validate.phase1(function, blocks, w, gamma, eps, scale)


def _fake(blocks, w, gamma, eps, scale, rmsnorm):
    first, num_queries = blocks[0], w.shape[0]
    acc = _native.accumulation_dtype(first.dtype)
    return ([first.new_empty(first.shape) for _ in range(num_queries)]
            + [first.new_empty(first.shape[:-1], dtype=acc) for _ in range(num_queries)])


def _save(flat, attrs, outputs):
    """The inputs by reference; gamma only with rmsnorm (the fast path has it None then)."""
    return flat if attrs[2] or flat[-1] is None else [*flat[:-1], None]


def _split_grads(function: str, grads, num_queries: int):
    """(grad_outs, grad_lses) from the op's one list of 2S result gradients."""
    if len(grads) != 2 * num_queries:
        raise _validate.error(function, "grads", f"2S = {2 * num_queries} gradients (the S "
                              "outputs', then the S LSEs')", f"{len(grads)}")
    return list(grads[:num_queries]), list(grads[num_queries:])


def _backward(grads, saved, attrs, needs):
    *blocks, w, gamma = saved
    function = OP.name + " (backward)"
    g = gradients(function, *_split_grads(function, grads, w.shape[0]), blocks, w, gamma,
                  *attrs, needs)
    return [*g.blocks, g.w, g.gamma]


OP = OpDef(
    "phase1",
    inputs=(("blocks", "Tensor[]"), ("w", "Tensor"), ("gamma", "Tensor?")),
    attrs=(("eps", "float"), ("scale", "float"), ("rmsnorm", "bool")),
    returns="Tensor[]", forward=forward, check=_check, fake=_fake, save=_save,
    backward=_backward)

_eager = _native.eager
_grad_enabled = torch.is_grad_enabled


def block_attn_res_phase1(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor] = None, *,
                          eps: float = 1e-6, scale: float = 1.0, rmsnorm: bool = True
                          ) -> Tuple[List[Tensor], List[Tensor]]:
    """Phase 1 for S queries over the N completed blocks, differentiable.

    ``blocks``: a list of N tensors ``[..., D]``; ``w`` and ``gamma``: ``[S, D]`` (gamma
    None: no learned RMSNorm weight; ignored without RMSNorm). Returns ``(outs, lses)``:
    S tensors ``[..., D]`` in the blocks' dtype and S tensors ``[...]`` in fp32 (fp64
    for fp64 blocks).
    """
    gamma = gamma if rmsnorm else None
    layout = (_validate.plain_phase1(blocks, w, gamma, eps, scale, _grad_enabled())
              if _eager() else None)
    result = OP(_FUNCTION, (blocks, w, gamma), (eps, scale, rmsnorm), layout)
    num_queries = w.shape[0]
    return list(result[:num_queries]), list(result[num_queries:])


# ---------------------------------------------------------------------------------
# In a stream: the block gradients summed in the kernels
# ---------------------------------------------------------------------------------

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
    autograd to add, as the op does."""

    __slots__ = ("sums", "claimed")

    def __init__(self) -> None:
        self.sums: dict = {}  # block index -> its gradient summed so far, in this backward
        self.claimed = 0      # blocks [0, claimed) have had their first reader


class Phase1InStream(torch.autograd.Function):
    """Phase 1 for the calls of one stream: apply(attrs, sums, layout, token, *blocks, w,
    gamma) -> (*outs, *lses, token), the blocks those of every earlier call and more
    (BlockGradSums). `token` is the previous call's (None for the first)."""

    @staticmethod
    def forward(ctx, attrs, sums, layout, token, *flat):
        inputs = OP.unflatten(flat)
        num_blocks = len(inputs[0])
        ctx.first_read, ctx.sums = sums.claimed, sums  # blocks [first_read, N) first read here
        ctx.token = (flat[0].dtype, flat[0].device)  # the token's gradient is like it
        sums.claimed = num_blocks
        outputs = forward(*inputs, *attrs, layout=layout)
        ctx.attrs = attrs
        ctx.save_for_backward(*_save(flat, attrs, outputs))
        ctx.set_materialize_grads(False)  # a missing gradient is zero to the kernel
        return (*outputs, flat[0].new_empty(0))

    @staticmethod
    def backward(ctx, *grads):
        sums, needs = ctx.sums.sums, ctx.needs_input_grad
        head = (None, None, None, torch.zeros(0, dtype=ctx.token[0], device=ctx.token[1]) if needs[3] else None)
        if not (_eager() and not _grad_enabled()):
            sums.clear()
            return (*head, *OP._grads(ctx, grads[:-1], needs[4:], direct=False))
        if grads[-1] is None:  # the stream's next phase 1 did not run in this backward
            sums.clear()
            torch.autograd.Variable._execution_engine.queue_callback(sums.clear)
        saved = ctx.saved_tensors
        *blocks, w, gamma = saved
        n = len(blocks)
        flags = [bool(x) and s is not None for x, s in zip(needs[4:], saved)]
        into = None
        if any(i in sums for i in range(n)):
            into = [None if not flags[i] else sums[i] if i in sums else
                    torch.zeros_like(blocks[i], memory_format=torch.contiguous_format)
                    for i in range(n)]
        function = OP.name + " (backward)"
        g = gradients(function, *_split_grads(function, grads[:-1], w.shape[0]), blocks, w,
                      gamma, *ctx.attrs, flags, accumulate_into=into)
        for i, grad in enumerate(g.blocks):
            if grad is not None:
                sums[i] = grad
        mine = [sums.pop(i, None) if i >= ctx.first_read else None for i in range(n)]
        return (*head, *mine, g.w, g.gamma)


_apply_in_stream = fast_apply(Phase1InStream)


def phase1_in_stream(blocks: Sequence[Tensor], w: Tensor, gamma: Optional[Tensor],
                     sums: BlockGradSums, token: Optional[Tensor], *, eps: float, scale: float,
                     rmsnorm: bool) -> Tuple[List[Tensor], List[Tensor], Optional[Tensor]]:
    """block_attn_res_phase1 for one of a stream's phase 1 calls, its block gradients
    summed in `sums` (BlockGradSums) when it takes the eager fast path with a gradient.
    `token`: what the stream's previous call returned (None at the first). Returns
    (outs, lses, token for the next call)."""
    if _eager() and _grad_enabled():
        gamma = gamma if rmsnorm else None
        layout = _validate.plain_phase1(blocks, w, gamma, eps, scale, True)
        if layout is not None and layout.requires_grad:
            result = _apply_in_stream((eps, scale, rmsnorm), sums, layout, token, *blocks, w,
                                      gamma)
            num_queries = w.shape[0]
            return list(result[:num_queries]), list(result[num_queries:-1]), result[-1]
    outs, lses = block_attn_res_phase1(blocks, w, gamma, eps=eps, scale=scale, rmsnorm=rmsnorm)
    return outs, lses, token
