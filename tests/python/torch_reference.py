"""Plain float64 reference for Block Attention Residuals (SPEC section 1).

This is the oracle every fast path is tested against. It is written to be read,
not to be fast: every input is upcast to float64 first and every formula is the
one in the spec, with the shapes spelled out.

Notation (per token; the B*T tokens are independent):

    V = [b_0, ..., b_{N-1}, p]             sources, L = N + (p is not None)
    r_i   = sqrt(mean_d(v_i[d]^2) + eps)   (rmsnorm on)
    k_i   = gamma * v_i / r_i  (rmsnorm on);   k_i = v_i  (off, gamma ignored)
    z_i   = scale * dot(w, k_i)
    alpha = softmax_i(z)
    h     = sum_i alpha_i * v_i            (values are the raw sources)

Backward, with g = dLoss/dh:

    ga_i   = dot(g, v_i)
    gz_i   = alpha_i * (ga_i - sum_j alpha_j * ga_j)
    gk_i   = scale * gz_i * w
    dv_i   = alpha_i * g + (gamma*gk_i/r_i - v_i * dot(gamma*gk_i, v_i) / (D r_i^3)   on
                            gk_i                                                     off)
    dw     = scale * sum_{t,i} gz_i * k_i
    dgamma = sum_{t,i} gk_i * v_i / r_i                                               (on)
"""
import re
from pathlib import Path
from typing import List, Optional, Sequence

import torch

F64 = torch.float64


def _spec_tolerance() -> dict:
    """SPEC section 3's table, read from its one copy, src/ref/tolerance_table.h: per
    dtype, (h, every gradient, the accumulation-type caches) as max|x - ref| / max|ref|,
    16-bit inputs against the reference fed the same 16-bit values."""
    table = Path(__file__).resolve().parents[2] / "src" / "ref" / "tolerance_table.h"
    rows = re.findall(r"^ATTNRES_TOLERANCE\((\w+),([^,]+),([^,]+),([^)]+)\)",
                      table.read_text(), re.MULTILINE)
    tolerance = {getattr(torch, name.lower()): tuple(float(x) for x in values)
                 for name, *values in rows}
    if set(tolerance) != {torch.float32, torch.float64, torch.bfloat16, torch.float16}:
        raise RuntimeError(f"{table}: expected one ATTNRES_TOLERANCE line per dtype")
    return tolerance


TOLERANCE = _spec_tolerance()


def _f64(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().to(F64)


def stack_sources(blocks: Sequence[torch.Tensor], partial: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T, L, D] float64: the N blocks followed by the optional partial block."""
    sources = [_f64(b) for b in blocks]
    if partial is not None:
        sources.append(_f64(partial))
    return torch.stack(sources, dim=2)


def _keys(v: torch.Tensor, gamma64: Optional[torch.Tensor], eps: float, rmsnorm: bool):
    """Returns (k [B,T,L,D], r [B,T,L] or None). gamma64 is float64 [D] (None: ones)."""
    if not rmsnorm:
        return v, None
    d = v.shape[-1]
    r = torch.sqrt((v * v).sum(dim=-1) / d + eps)  # [B,T,L]
    g = torch.ones(d, dtype=F64) if gamma64 is None else gamma64
    k = g * v / r.unsqueeze(-1)  # [B,T,L,D]
    return k, r


def reference_logits(blocks, partial, w, gamma, scale, eps, rmsnorm):
    """z [B,T,L] float64: the softmax logits scale * dot(w, k_i)."""
    v = stack_sources(blocks, partial)  # [B,T,L,D]
    k, _ = _keys(v, _f64(gamma), eps, rmsnorm)
    return scale * torch.einsum("btld,d->btl", k, _f64(w))


def reference_forward(blocks, partial, w, gamma, scale, eps, rmsnorm):
    """Returns (h [B,T,D], rms [B,T,L] or None when rmsnorm is off, alpha [B,T,L]), float64."""
    v = stack_sources(blocks, partial)  # [B,T,L,D]
    k, r = _keys(v, _f64(gamma), eps, rmsnorm)
    z = scale * torch.einsum("btld,d->btl", k, _f64(w))  # [B,T,L]
    # Overflow-safe softmax: subtract the per-token max first.
    z = z - z.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    alpha = e / e.sum(dim=-1, keepdim=True)  # [B,T,L]
    h = torch.einsum("btl,btld->btd", alpha, v)  # [B,T,D]
    return h, r, alpha


def reference_backward(grad_h, blocks, partial, w, gamma, scale, eps, rmsnorm):
    """Explicit-formula backward, float64.

    Returns (grad_blocks: list of N [B,T,D], grad_partial [B,T,D] or None,
    dw [D], dgamma [D] or None).
    """
    n = len(blocks)
    v = stack_sources(blocks, partial)  # [B,T,L,D]
    d = v.shape[-1]
    g = _f64(grad_h)  # [B,T,D]
    w64 = _f64(w)
    _, r, alpha = reference_forward(blocks, partial, w, gamma, scale, eps, rmsnorm)
    k, _ = _keys(v, _f64(gamma), eps, rmsnorm)

    ga = torch.einsum("btd,btld->btl", g, v)  # [B,T,L]
    # gz = alpha (ga - sum alpha ga) with ga taken relative to the source of the
    # largest weight: exact differences instead of ga_pivot - sum, which keeps
    # nothing of a 1e-13 weight's share in float64 (SPEC §3, sharp depth attention).
    ga = ga - ga.gather(-1, alpha.argmax(dim=-1, keepdim=True))
    gz = alpha * (ga - (alpha * ga).sum(dim=-1, keepdim=True))  # [B,T,L]
    gk = scale * gz.unsqueeze(-1) * w64  # [B,T,L,D]
    dv = alpha.unsqueeze(-1) * g.unsqueeze(2)  # [B,T,L,D]
    if rmsnorm:
        gam = torch.ones(d, dtype=F64) if gamma is None else _f64(gamma)
        r4 = r.unsqueeze(-1)  # [B,T,L,1]
        c = (gam * gk * v).sum(dim=-1, keepdim=True)  # [B,T,L,1]
        dv = dv + gam * gk / r4 - v * c / (d * r4 ** 3)
        dgamma = (gk * v / r4).sum(dim=(0, 1, 2))  # [D]
    else:
        dv = dv + gk
        dgamma = None
    dw = scale * (gz.unsqueeze(-1) * k).sum(dim=(0, 1, 2))  # [D]
    grad_blocks = [dv[:, :, i, :] for i in range(n)]
    grad_partial = dv[:, :, n, :] if partial is not None else None
    return grad_blocks, grad_partial, dw, dgamma


def reference_backward_autograd(grad_h, blocks, partial, w, gamma, scale, eps, rmsnorm):
    """Same as reference_backward, but by torch.autograd through reference_forward.

    Autograd's softmax backward is not in the pivot form: a cross-check for ordinary
    weights only (at weights of 1e-13 it keeps little of their share)."""
    leaves = [_f64(b).clone().requires_grad_(True) for b in blocks]
    p = _f64(partial).clone().requires_grad_(True) if partial is not None else None
    w64 = _f64(w).clone().requires_grad_(True)
    gam = None
    if rmsnorm:
        gam = (torch.ones_like(w64) if gamma is None else _f64(gamma)).clone().requires_grad_(True)

    v = torch.stack(leaves + ([p] if p is not None else []), dim=2)
    k, _ = _keys(v, gam, eps, rmsnorm)
    z = scale * torch.einsum("btld,d->btl", k, w64)
    alpha = torch.softmax(z, dim=-1)
    h = torch.einsum("btl,btld->btd", alpha, v)

    inputs: List[torch.Tensor] = leaves + ([p] if p is not None else []) + [w64]
    if gam is not None:
        inputs.append(gam)
    grads = torch.autograd.grad(h, inputs, grad_outputs=_f64(grad_h), allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(inputs, grads)]
    n = len(blocks)
    grad_blocks = grads[:n]
    grad_partial = grads[n] if p is not None else None
    off = n + (1 if p is not None else 0)
    dw = grads[off]
    dgamma = grads[off + 1] if gam is not None else None
    return grad_blocks, grad_partial, dw, dgamma


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max|x - ref| / max|ref|, in float64 (the SPEC section 3 measure).

    The denominator is at least `floor` (when given), for references that are ~0 only
    by cancellation; an exactly-zero reference gives the absolute error."""
    x = x.detach().to(F64)
    ref = ref.detach().to(F64)
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    if ref.numel() == 0:
        return 0.0
    scale = max(ref.abs().max().item(), floor)
    diff = (x - ref).abs().max().item()
    if scale == 0.0:
        return diff
    return diff / scale


# ---------------------------------------------------------------------------------
# The two-phase schedule (SPEC section 5), plain float64 torch ops: autograd through
# these functions is the oracle of every phase gradient. Inputs are upcast with
# .to(F64), which keeps the autograd graph (pass float64 leaves to get gradients).
#
#   phase 1  (u_s = w_s * gamma_s; gamma ignored without RMSNorm; r_i = 1 without it)
#       z_{s,i} = scale * dot(u_s, v_i) / r_i,  lse_s = logsumexp_i z_{s,i}
#       o_s     = sum_i exp(z_{s,i} - lse_s) v_i
#   phase 2  z_p = scale * dot(u, p) / r_p,  beta = sigmoid(lse - z_p)
#       h = beta * o + keep * p, keep = 1 - beta = sigmoid(z_p - lse)   (h = o without p)
#       out = h, or h / sqrt(mean(h^2) + norm_eps) * norm_weight  (input_norm)
# ---------------------------------------------------------------------------------

def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[...] from [..., D]: sqrt(mean_d(x^2) + eps)."""
    return torch.sqrt((x * x).mean(dim=-1) + eps)


def reference_phase1(blocks, w, gamma, scale, eps, rmsnorm):
    """blocks: N x [..., D]; w, gamma: [S, D] (gamma None: ones).
    Returns (outs: S x [..., D], lses: S x [...]), float64."""
    v = torch.stack([b.to(F64) for b in blocks], dim=-2)           # [..., N, D]
    u = w.to(F64)                                                   # [S, D]
    if rmsnorm and gamma is not None:
        u = u * gamma.to(F64)
    r = _rms(v, eps) if rmsnorm else torch.ones(v.shape[:-1], dtype=F64)   # [..., N]
    z = scale * torch.einsum("...nd,sd->...sn", v, u) / r.unsqueeze(-2)   # [..., S, N]
    lse = torch.logsumexp(z, dim=-1)                                # [..., S]
    a = torch.exp(z - lse.unsqueeze(-1))                            # [..., S, N]
    o = torch.einsum("...sn,...nd->...sd", a, v)                    # [..., S, D]
    num_queries = u.shape[0]
    return [o[..., s, :] for s in range(num_queries)], [lse[..., s] for s in range(num_queries)]


def reference_phase2(out, lse, partial, w, gamma, scale, eps, rmsnorm, norm_weight=None,
                     input_norm=False, norm_eps=1e-6):
    """out: [..., D] (o), lse: [...], partial: [..., D] or None, w, gamma, norm_weight: [D]
    (None: ones). Returns h (or RMSNorm(h) * norm_weight with input_norm), [..., D] float64."""
    h = out.to(F64)                                                 # [..., D]
    if partial is not None:
        p = partial.to(F64)                                         # [..., D]
        u = w.to(F64)                                               # [D]
        if rmsnorm and gamma is not None:
            u = u * gamma.to(F64)
        r_p = _rms(p, eps) if rmsnorm else torch.ones(p.shape[:-1], dtype=F64)   # [...]
        z_p = scale * (p * u).sum(dim=-1) / r_p                     # [...]
        # Each weight from its own exponent: 1 - beta would lose a weight of 1e-13.
        beta = torch.sigmoid(lse.to(F64) - z_p).unsqueeze(-1)       # [..., 1]
        keep = torch.sigmoid(z_p - lse.to(F64)).unsqueeze(-1)       # 1 - beta
        h = beta * h + keep * p
    if input_norm:
        h = h / _rms(h, norm_eps).unsqueeze(-1)
        if norm_weight is not None:
            h = h * norm_weight.to(F64)
    return h
