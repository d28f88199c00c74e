"""Pure-torch Block AttnRes and a tiny transformer in the report's layout, for tests.

``reference_block_attn_res`` is SPEC section 1 written with stock torch ops (stack +
RMSNorm + einsum + softmax + einsum, accumulating in fp32 or fp64), so autograd derives
its backward. ``TinyAttnResLM`` is the report's layer structure; whether each AttnRes
is the native op or the reference is a constructor flag, and both variants have the
same parameter names, so one state_dict loads into the other.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def reference_block_attn_res(blocks: Sequence[Tensor], partial: Optional[Tensor], w: Tensor,
                             gamma: Optional[Tensor] = None, *, eps: float = 1e-6,
                             scale: float = 1.0, rmsnorm: bool = True) -> Tensor:
    """h [..., D] from blocks N x [..., D], partial [..., D] or None, w [D], gamma [D] or None."""
    out_dtype = blocks[0].dtype
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    sources = list(blocks) + ([partial] if partial is not None else [])
    v = torch.stack([s.to(acc) for s in sources], dim=-2)               # [..., L, D]
    if rmsnorm:
        inv_rms = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., L, 1]
        k = v * inv_rms
        if gamma is not None:
            k = k * gamma.to(acc)
    else:
        k = v
    logits = scale * torch.einsum("d,...ld->...l", w.to(acc), k)         # [..., L]
    alpha = logits.softmax(dim=-1)
    # h = v_pivot + sum_l alpha_l (v_l - v_pivot), pivot the source of the largest
    # weight: the same h, but autograd's softmax backward then sees dL/dalpha_l =
    # dot(g, v_l - v_pivot), so alpha_pivot (0 - sum_l alpha_l (...)) is formed from
    # small terms instead of ga_pivot - sum_l alpha_l ga_l, a difference of two
    # numbers near ga_pivot (up to 1.5e-4 of max-abs off in float64: SPEC §3's sharp
    # depth attention).
    pivot = alpha.detach().argmax(dim=-1, keepdim=True)                  # [..., 1]
    v_pivot = v.gather(-2, pivot.unsqueeze(-1).expand(*pivot.shape, v.shape[-1]))  # [..., 1, D]
    h = v_pivot.squeeze(-2) + torch.einsum("...l,...ld->...d", alpha, v - v_pivot)
    return h.to(out_dtype)


class ReferenceBlockAttnRes(nn.Module):
    """Same parameters and forward signature as ``attnres.nn.BlockAttnRes``."""

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, rmsnorm: bool = True,
                 dtype=None, device=None) -> None:
        super().__init__()
        self.eps, self.scale, self.rmsnorm = eps, scale, rmsnorm
        self.w = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))
        if rmsnorm:
            self.gamma = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        else:
            self.register_parameter("gamma", None)

    def forward(self, blocks: Sequence[Tensor], partial: Optional[Tensor] = None) -> Tensor:
        dtype = blocks[0].dtype
        gamma = self.gamma.to(dtype) if self.gamma is not None else None
        return reference_block_attn_res(blocks, partial, self.w.to(dtype), gamma,
                                        eps=self.eps, scale=self.scale, rmsnorm=self.rmsnorm)


def make_attn_res(impl: str, dim: int, **kwargs) -> nn.Module:
    if impl == "native":
        from block_attnres.nn import BlockAttnRes
        return BlockAttnRes(dim, **kwargs)
    if impl == "reference":
        return ReferenceBlockAttnRes(dim, **kwargs)
    raise ValueError(f"impl must be 'native' or 'reference', got {impl!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:                              # x [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))                 # [B, H, T, Dh]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.num_heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class AttnResLayer(nn.Module):
    """One transformer layer in the report's layout: AttnRes before each sub-layer.

    ``starts_block``: this layer closes the running partial block into ``blocks`` before
    its attention sub-layer, so a new block begins every S layers.
    """

    def __init__(self, dim: int, num_heads: int, hidden: int, starts_block: bool, impl: str,
                 **attn_res_kwargs) -> None:
        super().__init__()
        self.starts_block = starts_block
        self.attn_res = make_attn_res(impl, dim, **attn_res_kwargs)
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads)
        self.mlp_res = make_attn_res(impl, dim, **attn_res_kwargs)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = Mlp(dim, hidden)

    def forward(self, blocks: list[Tensor], partial: Optional[Tensor]):
        if self.starts_block and partial is not None:
            blocks = blocks + [partial]
            partial = None
        h = self.attn_res(blocks, partial)
        attn_out = self.attn(self.attn_norm(h))
        partial = attn_out if partial is None else partial + attn_out
        h = self.mlp_res(blocks, partial)
        partial = partial + self.mlp(self.mlp_norm(h))
        return blocks, partial


class TinyAttnResLM(nn.Module):
    """Embedding -> num_layers AttnRes layers (a new block every layers_per_block) ->
    a final AttnRes over all blocks -> RMSNorm -> logits. The embedding is block b_0."""

    def __init__(self, vocab: int = 32, dim: int = 16, num_heads: int = 2, hidden: int = 32,
                 num_layers: int = 8, layers_per_block: int = 2, impl: str = "native",
                 **attn_res_kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            AttnResLayer(dim, num_heads, hidden, starts_block=(i % layers_per_block == 0),
                         impl=impl, **attn_res_kwargs)
            for i in range(num_layers))
        self.final_res = make_attn_res(impl, dim, **attn_res_kwargs)
        self.final_norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:                         # tokens [B, T]
        blocks: list[Tensor] = [self.embed(tokens)]
        partial: Optional[Tensor] = None
        for layer in self.layers:
            blocks, partial = layer(blocks, partial)
        h = self.final_res(blocks, partial)
        return self.head(self.final_norm(h))                            # [B, T, vocab]


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over the batch's predicted positions."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def randomize_attn_res(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial w and gamma, so the test does not run at uniform attention only."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith(".gamma"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def embedding_favouring_stream(schedule: str, dim: int = 16, num: int = 3):
    """SPEC section 3's sharp regime in a model: a BlockAttnResStream (float32, input
    norm) of `num` Linear+tanh sub-layers in one block of num + 1, whose final query
    favours the embedding (keys near +1) by a logit gap of 20-26, so the partial block
    keeps a weight of 1e-12 to 1e-9 in the final mix. Returns (res, layers, embedding,
    grad_y)."""
    from block_attnres.nn import BlockAttnResStream

    g = torch.Generator().manual_seed(4)
    res = BlockAttnResStream(dim, num, num + 1, schedule=schedule, input_norm=True)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(num))
    with torch.no_grad():
        res.w.copy_(0.3 * torch.randn(res.w.shape, generator=g))
        res.w[num].fill_(1.0)
        for layer in layers:
            layer[0].weight.copy_(torch.randn(dim, dim, generator=g) / dim ** 0.5)
            layer[0].bias.copy_(0.1 * torch.randn(dim, generator=g))
    emb = 1 + 0.2 * torch.randn(2, 6, dim, generator=g)
    gy = torch.randn(2, 6, dim, generator=g)
    return res, layers, emb, gy
