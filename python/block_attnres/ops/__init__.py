"""The ops of attnres, one module each, each declared once (``attnres._op.OpDef``):

* ``block_attn_res``: the single op, ``attnres::block_attn_res``;
* ``phase1``: the two-phase schedule's phase 1, ``attnres::phase1``;
* ``phase2``: its phase 2, ``attnres::phase2`` and ``attnres::phase2_update``.

Importing this package registers every op (and its backward op) in
``torch.ops.attnres``. ``custom_op_calls`` counts the runs of each custom op's
implementation: in eager mode the front ends take the fast path and it stays put.
"""

from .._op import custom_op_calls
from . import block_attn_res, phase1, phase2

__all__ = ["block_attn_res", "custom_op_calls", "phase1", "phase2"]
