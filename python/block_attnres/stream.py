"""``BlockAttnResStream``: the residual stream of a Block AttnRes model, with the
bookkeeping (completed blocks, the partial block, which query mixes what) in one
place and the report's two-phase schedule behind it.

A model with L sub-layers (attention and MLP each count) groups them into blocks of
``block_size``. The embedding is block ``b_0``. Sub-layer ``j`` reads ``h_j``, a softmax
mix over depth of the completed blocks and of the partial block ``p`` (the sum of the
outputs of this block's earlier sub-layers) with its own pseudo-query ``w[j]``; the
first sub-layer of a block mixes the completed blocks only. After ``block_size``
sub-layers the partial block becomes a completed block. The model's output mixes
everything with the last query ``w[L]``.

Use::

    res = attnres.nn.BlockAttnResStream(dim, num_sublayers=2 * n_layers, block_size=8)
    stream = res.begin(embedding)
    for layer in layers:                     # attention, then MLP, per layer
        stream.add(layer.attn(stream.next_input()))
        stream.add(layer.mlp(stream.next_input()))
    y = stream.finish()

Schedules, equal within the tolerances of docs/DESIGN.md:

* ``"two_phase"`` (default): at the start of each block, phase 1 mixes the completed
  blocks for all of that block's queries in one read of the blocks (the final query
  joins the last block's when no block is completed in between); each sub-layer then
  runs phase 2, which merges that result with the partial block. Each completed block
  is read once per block of sub-layers, and its gradient is formed once per block
  (the later blocks' shares summed in phase 1's kernels, not by autograd).
  Inside a block, ``add(out)`` only holds ``out``: the next phase 2 adds it into the
  partial block in its own pass (``update=``), so the sum makes no separate trip
  through memory; the block's last ``add`` adds as usual (the sum becomes a block).
* ``"per_layer"``: the single op ``block_attn_res_fn`` once per sub-layer (every
  sub-layer reads every completed block).

With ``input_norm=True`` the stream also owns each sub-layer's input RMSNorm
(``norm_weight[j]``, fused into phase 2): ``next_input()`` and ``finish()`` return
``RMSNorm(h) * norm_weight[j]`` instead of ``h``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _validate
from .ops.block_attn_res import block_attn_res_fn
from .ops.phase1 import BlockGradSums, phase1_in_stream
from .ops.phase2 import phase2_in_stream

__all__ = ["BlockAttnResStream"]

_SCHEDULES = ("two_phase", "per_layer")


class BlockAttnResStream(nn.Module):
    """Parameters of the stream; ``begin(embedding)`` starts one forward pass.

    ``w``: ``[num_sublayers + 1, dim]`` pseudo-queries (zeros: uniform attention at the
    start, as in the report), the last row for the final mix. ``gamma``: the same shape
    (ones), the keys' RMSNorm weight; ``None`` with ``rmsnorm=False`` or ``gamma=False``.
    ``norm_weight``: the same shape (ones), each sub-layer's input RMSNorm weight and
    the final norm's, only with ``input_norm=True`` (eps ``norm_eps``, default ``eps``).
    """

    def __init__(self, dim: int, num_sublayers: int, block_size: int, *, eps: float = 1e-6,
                 scale: float = 1.0, rmsnorm: bool = True, gamma: bool = True,
                 input_norm: bool = False, norm_eps: Optional[float] = None,
                 schedule: str = "two_phase", dtype: Optional[torch.dtype] = None,
                 device=None) -> None:
        super().__init__()
        name = "BlockAttnResStream"
        for arg, value in (("dim", dim), ("num_sublayers", num_sublayers),
                           ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise _validate.error(name, arg, "an int >= 1", repr(value))
        if schedule not in _SCHEDULES:
            raise _validate.error(name, "schedule", f"one of {_SCHEDULES}", repr(schedule))
        _validate.scalars(name, scale, eps)
        self.dim, self.num_sublayers, self.block_size = dim, num_sublayers, block_size
        self.eps, self.scale, self.rmsnorm, self.schedule = eps, scale, rmsnorm, schedule
        self.input_norm = input_norm
        self.norm_eps = eps if norm_eps is None else norm_eps
        _validate.scalars(name, scale, self.norm_eps)
        shape = (num_sublayers + 1, dim)
        factory = {"dtype": dtype, "device": device}
        self.w = nn.Parameter(torch.zeros(shape, **factory))
        self.gamma = nn.Parameter(torch.ones(shape, **factory)) if rmsnorm and gamma else None
        self.norm_weight = nn.Parameter(torch.ones(shape, **factory)) if input_norm else None

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.w)
        for p in (self.gamma, self.norm_weight):
            if p is not None:
                nn.init.ones_(p)

    def begin(self, embedding: Tensor) -> "Stream":
        """A stream whose block b_0 is ``embedding`` ``[..., dim]``."""
        if not isinstance(embedding, Tensor) or embedding.dim() == 0 or \
                embedding.shape[-1] != self.dim:
            raise _validate.error("BlockAttnResStream.begin", "embedding",
                                  f"a tensor [..., {self.dim}]", _validate._kind(embedding))
        return Stream(self, embedding)

    def forward(self, embedding: Tensor, sublayers) -> Tensor:
        """The whole stream over ``sublayers``, a sequence of ``num_sublayers`` callables
        (each maps its input to its output)."""
        stream = self.begin(embedding)
        for sublayer in sublayers:
            stream.add(sublayer(stream.next_input()))
        return stream.finish()

    def extra_repr(self) -> str:
        return (f"{self.dim}, num_sublayers={self.num_sublayers}, block_size={self.block_size}, "
                f"eps={self.eps}, scale={self.scale}, rmsnorm={self.rmsnorm}, "
                f"gamma={self.gamma is not None}, input_norm={self.input_norm}, "
                f"schedule={self.schedule!r}")


class Stream:
    """One forward pass through a ``BlockAttnResStream``: ``next_input()`` and ``add(out)``
    alternate once per sub-layer, then ``finish()``."""

    def __init__(self, module: BlockAttnResStream, embedding: Tensor) -> None:
        self._m = module
        self._dtype, self._shape = embedding.dtype, embedding.shape
        self._blocks: List[Tensor] = [embedding]
        self._partial: Optional[Tensor] = None
        # The last output add() received, not yet in _partial: the next mix (a phase 2
        # inside the same block) adds it (two_phase schedule only).
        self._update: Optional[Tensor] = None
        self._next = 0              # the next sub-layer
        self._awaiting_add = False  # next_input() was called, add() was not
        self._finished = False
        self._phase1: Optional[tuple] = None  # (first query, outs, lses) of this block
        # The blocks' gradients, summed across phase 1 calls in their kernels, and the
        # token that orders those calls' backward (ops.phase1.BlockGradSums).
        self._grad_sums = BlockGradSums()
        self._phase1_token: Optional[Tensor] = None
        # The parameters in the stream's dtype (differentiably) and split into rows, made
        # at the first mix: one cast and one unbind per pass instead of an index and a
        # cast per query (whose backward would also write a zero-padded copy of the whole
        # parameter for every row).
        self._weights: Optional[tuple] = None  # (w, gamma, norm_weight)
        self._rows: Optional[tuple] = None     # their rows

    # -- the public calls ---------------------------------------------------------

    def next_input(self) -> Tensor:
        """The input of the next sub-layer: h (or its RMSNorm with ``input_norm``)."""
        self._check_open("next_input")
        if self._awaiting_add:
            raise RuntimeError("BlockAttnResStream: next_input() called twice without add(); "
                               "call add(out) with the sub-layer's output first")
        if self._next >= self._m.num_sublayers:
            raise RuntimeError(f"BlockAttnResStream: all {self._m.num_sublayers} declared "
                               "sub-layers have run; call finish()")
        self._awaiting_add = True
        return self._mix(self._next)

    def add(self, out: Tensor) -> None:
        """Adds the output of the sub-layer whose input next_input() returned."""
        self._check_open("add")
        if not self._awaiting_add:
            raise RuntimeError("BlockAttnResStream: add() called before next_input(); each "
                               "sub-layer takes its input from next_input() first")
        if not isinstance(out, Tensor) or out.shape != self._shape or out.dtype != self._dtype:
            raise _validate.error("BlockAttnResStream.add", "out",
                                  f"a {self._dtype} tensor of shape {tuple(self._shape)} "
                                  "(the embedding's)", _validate._kind(out) +
                                  (f" of {out.dtype}" if isinstance(out, Tensor) else ""))
        self._awaiting_add = False
        self._next += 1
        if self._partial is None:
            self._partial = out
        elif self._next % self._m.block_size != 0 and self._m.schedule == "two_phase":
            # The block goes on, so the next mix (next_input() or finish()) is a phase 2
            # over this partial block: it forms partial + out in its own pass, with the
            # bits of the addition below.
            self._update = out
        else:
            self._partial = self._partial + out
        if self._next % self._m.block_size == 0:  # the block is complete
            self._blocks.append(self._partial)
            self._partial = None
            self._phase1 = None

    def finish(self) -> Tensor:
        """The final mix of every block and the partial block with the last query."""
        self._check_open("finish")
        if self._awaiting_add or self._next != self._m.num_sublayers:
            done = self._next - (1 if self._awaiting_add else 0)
            raise RuntimeError(f"BlockAttnResStream: finish() after {done} of "
                               f"{self._m.num_sublayers} sub-layers")
        self._finished = True
        return self._mix(self._m.num_sublayers)

    # -- the schedules ------------------------------------------------------------

    def _check_open(self, call: str) -> None:
        if self._finished:
            raise RuntimeError(f"BlockAttnResStream: {call}() after finish(); start a new "
                               "stream with begin()")

    def _cast(self) -> tuple:
        """(w, gamma, norm_weight) in the stream's dtype, differentiably (.to() returns
        the parameter itself when it already has that dtype)."""
        if self._weights is None:
            m, dtype = self._m, self._dtype
            self._weights = tuple(p.to(dtype) if p is not None else None
                                  for p in (m.w, m.gamma, m.norm_weight))
        return self._weights

    def _params(self, j: int):
        """Query j's rows, in the stream's dtype (differentiably)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = tuple(p.unbind(0) if p is not None else None
                                      for p in self._cast())
        w, gamma, norm_weight = rows
        return w[j], gamma[j] if gamma is not None else None, \
            norm_weight[j] if norm_weight is not None else None

    def _mix(self, j: int) -> Tensor:
        m = self._m
        w, gamma, norm_weight = self._params(j)
        if m.schedule == "per_layer":
            h = block_attn_res_fn(self._blocks, self._partial, w, gamma, eps=m.eps,
                                  scale=m.scale, rmsnorm=m.rmsnorm)
            if m.input_norm:
                h = F.rms_norm(h, (m.dim,), weight=norm_weight, eps=m.norm_eps)
            return h
        first, outs, lses = self._phase1_for(j)
        q = j - first
        # The partial block for the next mix: with the update added, or passed through.
        h, self._partial = phase2_in_stream(
            outs[q], lses[q], self._partial, w, gamma, eps=m.eps, scale=m.scale,
            rmsnorm=m.rmsnorm, norm_weight=norm_weight, input_norm=m.input_norm,
            norm_eps=m.norm_eps, update=self._update)
        self._update = None
        return h

    def _phase1_for(self, j: int):
        """Phase 1 of the block holding query j, run at the block's first query: its
        sub-layers' queries, plus the final query when the model ends inside this block
        (then no block is completed before finish(), so it mixes the same blocks)."""
        if self._phase1 is not None:
            return self._phase1
        m = self._m
        last = min(j + m.block_size, m.num_sublayers)  # one past the block's last query
        if j == m.num_sublayers or last == m.num_sublayers and last % m.block_size != 0:
            last = m.num_sublayers + 1
        w, gamma, _ = self._cast()
        w = w[j:last]
        gamma = gamma[j:last] if gamma is not None else None
        outs, lses, self._phase1_token = phase1_in_stream(
            self._blocks, w, gamma, self._grad_sums, self._phase1_token, eps=m.eps,
            scale=m.scale, rmsnorm=m.rmsnorm)
        self._phase1 = (j, outs, lses)
        return self._phase1
