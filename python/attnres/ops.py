"""Block AttnRes as differentiable ``torch.library`` custom ops (the public function
over them is ``attnres.functional.block_attn_res_fn``).

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

from collections import Counter
from typing import Optional

import torch
from torch import Tensor

from . import _native, _validate

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"attnres.ops needs torch >= 2.4 (torch.library.custom_op), found torch "
                      f"{torch.__version__}")

_FORWARD = "attnres::block_attn_res"
_BACKWARD = "attnres::block_attn_res_backward"

# How many times each custom op's implementation has run (the op name -> count), a
# diagnostic: in eager mode the front ends take the fast path (below) and these stay
# put; under torch.compile, make_fx or a torch.func transform they count.
custom_op_calls: Counter = Counter()
_grad_enabled = torch.is_grad_enabled


# ---------------------------------------------------------------------------------
# Forward op
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::block_attn_res", mutates_args=())
def _block_attn_res(blocks: list[Tensor], partial: Optional[Tensor], w: Tensor,
                    gamma: Optional[Tensor], eps: float, scale: float, rmsnorm: bool) -> Tensor:
    custom_op_calls[_FORWARD] += 1
    h, _, _ = _native.forward(blocks, partial, w, gamma if rmsnorm else None,
                              scale=scale, eps=eps, rmsnorm=rmsnorm, function=_FORWARD)
    return h


@_block_attn_res.register_fake
def _block_attn_res_fake(blocks, partial, w, gamma, eps, scale, rmsnorm):
    sources, _, _ = _validate.inputs(_FORWARD, blocks, partial, w, gamma if rmsnorm else None,
                                     scale, eps)
    return sources[0].new_empty(sources[0].shape)


# ---------------------------------------------------------------------------------
# Backward op
# ---------------------------------------------------------------------------------

@torch.library.custom_op("attnres::block_attn_res_backward", mutates_args=())
def _block_attn_res_backward(grad_out: Tensor, blocks: list[Tensor], partial: Optional[Tensor],
                             w: Tensor, gamma: Optional[Tensor], eps: float, scale: float,
                             rmsnorm: bool, need_blocks: list[bool], need_partial: bool,
                             need_w: bool, need_gamma: bool) -> list[Tensor]:
    custom_op_calls[_BACKWARD] += 1
    grad_blocks, grad_partial, grad_w, grad_gamma = _native.backward(
        grad_out, blocks, partial, w, gamma if rmsnorm else None,
        scale=scale, eps=eps, rmsnorm=rmsnorm,
        need_block_grads=list(need_blocks),
        need_partial_grad=need_partial and partial is not None,
        need_proj_weight_grad=need_w,
        need_gamma_grad=need_gamma and rmsnorm, function=_BACKWARD)
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
# The eager fast path
# ---------------------------------------------------------------------------------
#
# Outside tracing (_native.eager()) the front ends skip the dispatcher: without
# autograd they call _native.forward themselves, with it they apply
# BlockAttnResFunction, an autograd.Function over the same native calls that saves
# what the op's setup_context saves and computes what _backward computes, so both
# paths give the same bits. Under torch.compile, make_fx, FakeTensorMode or a
# torch.func transform the front ends call the custom ops above instead.

class BlockAttnResFunction(torch.autograd.Function):
    """apply(meta, *blocks, partial, w, gamma) with meta = (N, eps, scale, rmsnorm,
    plain, function): h, as attnres::block_attn_res, for inputs that
    _validate.plain_inputs() returned `plain` for. partial and gamma may be None
    (gamma is None without RMSNorm)."""

    @staticmethod
    def forward(ctx, meta, *tensors):
        n, eps, scale, rmsnorm, plain, function = meta
        ctx.meta = (n, eps, scale, rmsnorm, function)
        ctx.save_for_backward(*tensors)  # by reference, as _setup_context
        partial, w, gamma = tensors[n:]
        h, _, _ = _native.forward(tensors[:n], partial, w, gamma, scale=scale, eps=eps,
                                  rmsnorm=rmsnorm, function=function, _plain=plain)
        return h

    @staticmethod
    def backward(ctx, grad_h):
        n, eps, scale, rmsnorm, function = ctx.meta
        saved = ctx.saved_tensors
        blocks = saved[:n]
        partial, w, gamma = saved[n:]
        needs = ctx.needs_input_grad
        need_blocks = list(needs[1:n + 1])
        need_partial = needs[n + 1] and partial is not None
        need_w = needs[n + 2]
        need_gamma = needs[n + 3] and rmsnorm and gamma is not None
        if _native.eager() and not _grad_enabled():  # create_graph=False
            _validate.grad_out(function, "grad_out", grad_h, blocks[0] if n else partial)
            grad_blocks, grad_partial, grad_w, grad_gamma = _native.backward(
                grad_h, blocks, partial, w, gamma, scale=scale, eps=eps, rmsnorm=rmsnorm,
                need_block_grads=need_blocks, need_partial_grad=need_partial,
                need_proj_weight_grad=need_w, need_gamma_grad=need_gamma,
                function=function + " (backward)", _validated=True)
            return (None, *grad_blocks, grad_partial, grad_w, grad_gamma)
        # Traced (compiled autograd), or create_graph=True: the backward op, as _backward
        # does (which refuses a double backward as the op does).
        grads = iter(torch.ops.attnres.block_attn_res_backward(
            grad_h, list(blocks), partial, w, gamma, eps, scale, rmsnorm, need_blocks,
            need_partial, need_w, need_gamma))
        return (None, *[next(grads) if need else None for need in need_blocks],
                next(grads) if need_partial else None, next(grads) if need_w else None,
                next(grads) if need_gamma else None)


def _fast_apply(cls):
    """cls.apply without autograd.Function.apply's Python preamble (binding default
    arguments for a setup_context, which these classes do not define, and unwrapping
    functorch's dead wrappers, which plain tensors outside any transform are not):
    the C entry point it ends in. Falls back to cls.apply."""
    apply = getattr(torch._C, "_FunctionBase", None)
    apply = apply.__dict__.get("apply") if apply is not None else None
    return apply.__get__(None, cls) if apply is not None else cls.apply


apply_block_attn_res = _fast_apply(BlockAttnResFunction)
