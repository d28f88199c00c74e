"""``nn.Module`` front end for Block AttnRes (see ``attnres.ops`` for the math)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from . import _validate
from .functional import block_attn_res_fn
from .stream import BlockAttnResStream

__all__ = ["BlockAttnRes", "BlockAttnResStream"]

_NAME = "BlockAttnRes"  # what errors call the module


class BlockAttnRes(nn.Module):
    """Softmax mix over depth of the completed blocks and the partial block.

    Owns the pseudo-query ``w`` ``[dim]``, initialised to zeros so that attention starts
    uniform over the sources (as in the report), and, when ``rmsnorm`` is on, the key
    RMSNorm weight ``gamma`` ``[dim]`` (ones). With ``rmsnorm=False`` there is no
    ``gamma`` parameter (``self.gamma is None``), so no parameter goes unused under DDP;
    ``gamma=False`` keeps the RMSNorm but without a learned weight (as
    ``nn.RMSNorm(elementwise_affine=False)``: ``self.gamma is None``, the keys are
    ``v_i / r_i``).

    ``forward(blocks, partial=None)`` takes a list or tuple of ``[..., dim]`` tensors and an
    optional partial block of the same shape and returns ``h`` ``[..., dim]`` in their
    dtype (``blocks`` may be empty when ``partial`` is given). Blocks and partial must
    share one dtype; the parameters are cast to it
    (differentiably: their gradients arrive in the parameters' own dtype), which is what
    mixed precision needs -- fp32 master parameters, bf16 activations.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, rmsnorm: bool = True,
                 gamma: bool = True, dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__()
        if dim < 1:
            raise _validate.error(_NAME, "dim", ">= 1", str(dim))
        factory = {"dtype": dtype, "device": device}
        self.dim = dim
        self.eps = eps
        self.scale = scale
        self.rmsnorm = rmsnorm
        self.w = nn.Parameter(torch.empty(dim, **factory))
        if rmsnorm and gamma:
            self.gamma = nn.Parameter(torch.empty(dim, **factory))
        else:
            self.register_parameter("gamma", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.w)
        if self.gamma is not None:
            nn.init.ones_(self.gamma)

    def forward(self, blocks: Sequence[Tensor], partial: Optional[Tensor] = None) -> Tensor:
        first = blocks[0] if blocks.__class__ is list and blocks else None
        if first.__class__ is Tensor and first.dtype in _validate.SUPPORTED_DTYPES:
            dtype = first.dtype  # the common case, without the validator's calls
        else:
            dtype = _validate.first_source(_NAME, blocks, partial)[0].dtype
        w, gamma = self.w, self.gamma
        if w.dtype is not dtype:  # .to() would return the parameter itself otherwise
            w = w.to(dtype)
        if gamma is not None and gamma.dtype is not dtype:
            gamma = gamma.to(dtype)
        return block_attn_res_fn(blocks, partial, w, gamma, eps=self.eps, scale=self.scale,
                                 rmsnorm=self.rmsnorm, function=_NAME)

    def extra_repr(self) -> str:
        gamma = ", gamma=False" if self.rmsnorm and self.gamma is None else ""
        return f"{self.dim}, eps={self.eps}, scale={self.scale}, rmsnorm={self.rmsnorm}{gamma}"
