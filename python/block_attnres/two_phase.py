"""The two-phase schedule of Block AttnRes as public functions (docs/DESIGN.md, "The two
phases"; the ops: ``attnres.ops.phase1`` and ``attnres.ops.phase2``)."""

from .ops.phase1 import block_attn_res_phase1
from .ops.phase2 import block_attn_res_phase2

__all__ = ["block_attn_res_phase1", "block_attn_res_phase2"]
