"""Sharp depth attention (SPEC section 3) through the Python front end, in float32
against float64 on the same values, every output relative to its own max-abs (h 1e-5,
gradients 1e-4), so a gradient scaled by a weight of 1e-13 counts as much as any:

- the single op (block_attn_res_fn) and phase 1 + phase 2 composed, on the family of
  tests/cpp/test_util.h SharpFamily: sources along +1 (favoured) or -1, w a multiple
  of ones whose mean logits span `gap`, the partial block 1e-3, 1 and 1e3 times the
  blocks;
- a model: a stream of three real sub-layers in one block of four whose final query
  favours the embedding (the partial block's weight 1e-12 to 1e-9), both schedules,
  every parameter's gradient against the same model in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch

from block_attnres import block_attn_res_fn, block_attn_res_phase1, block_attn_res_phase2
from model_reference import embedding_favouring_stream, reference_block_attn_res
from torch_reference import TOLERANCE, rel_err

F32, F64 = torch.float32, torch.float64
SCALE = 0.9
FAVOURED = ["blocks", "partial", "first block", "all but the first block"]


def sharp_problem(favoured, gap, partial_size, rmsnorm, *, num_blocks=3, dim=32, seed=0):
    """(blocks, partial, w, gamma), float64 holding float32 values."""
    g = torch.Generator().manual_seed(seed)
    signs = []
    for i in range(num_blocks + 1):
        is_partial = i == num_blocks
        signs.append({"blocks": not is_partial, "partial": is_partial, "first block": i == 0,
                      "all but the first block": i != 0}[favoured])
    sources = []
    for i, plus in enumerate(signs):
        size = partial_size if i == num_blocks else (0.5 + 1.5 * torch.rand((), generator=g).item()
                                                      if rmsnorm else 1.0)
        noise = 1 + 0.2 * torch.randn(4, 8, dim, generator=g, dtype=F64)
        sources.append((size * (1.0 if plus else -1.0) * noise).to(F32).to(F64))
    gamma = (1 + 0.2 * torch.randn(dim, generator=g, dtype=F64)).to(F32).to(F64) if rmsnorm else None
    # Each source's mean logit for w = ones; w then spans `gap` with them.
    ones = torch.ones(dim, dtype=F64)
    means = []
    for v in sources:
        k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma if rmsnorm else v
        means.append((SCALE * (k * ones).sum(-1)).mean().item())
    w = (ones * gap / (max(means) - min(means))).to(F32).to(F64)
    return sources[:-1], sources[-1], w, gamma


def leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in tensors]


def single_op(blocks, partial, w, gamma, rmsnorm):
    return block_attn_res_fn(blocks, partial, w, gamma, scale=SCALE, rmsnorm=rmsnorm)


def two_phases(blocks, partial, w, gamma, rmsnorm):
    outs, lses = block_attn_res_phase1(blocks, w.unsqueeze(0),
                                       None if gamma is None else gamma.unsqueeze(0),
                                       scale=SCALE, rmsnorm=rmsnorm)
    return block_attn_res_phase2(outs[0], lses[0], partial, w, gamma, scale=SCALE, rmsnorm=rmsnorm)


def gradients(fn, problem, dtype, grad, rmsnorm):
    blocks, partial, w, gamma = problem
    xs = leaves(list(blocks) + [partial, w, gamma], dtype)
    n = len(blocks)
    h = fn(xs[:n], xs[n], xs[n + 1], xs[n + 2], rmsnorm)
    inputs = [x for x in xs if x is not None]
    return h, torch.autograd.grad((h * grad.to(dtype)).sum(), inputs)


@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rmsnorm", "no-rmsnorm"])
@pytest.mark.parametrize("partial_size", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("gap", [0, 5, 10, 20, 30])
@pytest.mark.parametrize("favoured", FAVOURED)
@pytest.mark.parametrize("path", ["single_op", "two_phases"])
def test_fp32_matches_float64(path, favoured, gap, partial_size, rmsnorm):
    problem = sharp_problem(favoured, gap, partial_size, rmsnorm)
    grad = torch.randn(problem[0][0].shape, generator=torch.Generator().manual_seed(1),
                       dtype=F64).to(F32)
    fn = single_op if path == "single_op" else two_phases
    h, grads = gradients(fn, problem, F32, grad, rmsnorm)
    ref_h, ref_grads = gradients(lambda b, p, w, g, r: reference_block_attn_res(
        b, p, w, g, scale=SCALE, rmsnorm=r), problem, F64, grad, rmsnorm)
    h_tol, grad_tol, _ = TOLERANCE[F32]
    assert rel_err(h, ref_h) <= h_tol
    names = [f"block {i}" for i in range(len(problem[0]))] + ["partial", "w", "gamma"]
    for name, a, b in zip(names, grads, ref_grads):
        err = rel_err(a, b)
        assert err <= grad_tol, f"d{name}: relative error {err:.3g}"


# ---------------------------------------------------------------------------------
# A model whose final query favours the embedding.
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
def test_stream_whose_final_query_favours_the_embedding(schedule):
    res, layers, emb, gy = embedding_favouring_stream(schedule)
    num = len(layers)

    def run(res, layers, dtype, outputs=None):
        e = emb.to(dtype).requires_grad_(True)
        stream = res.begin(e)
        for layer in layers:
            out = layer(stream.next_input())
            if outputs is not None:
                outputs.append(out.detach())
            stream.add(out)
        y = stream.finish()
        params = [e] + [p for p in res.parameters()] + list(layers.parameters())
        return y, torch.autograd.grad((y * gy.to(dtype)).sum(), params)

    outputs = []
    y, grads = run(res, layers, F32)
    res64 = copy.deepcopy(res).double()
    y64, grads64 = run(res64, copy.deepcopy(layers).double(), F64, outputs)
    # The regime under test: the final mix leaves the partial block a weight below 1e-5.
    partial = sum(outputs)
    keys = [v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + res.eps) * res64.gamma[num]
            for v in (emb.double(), partial)]
    logits = torch.stack([res.scale * (k * res64.w[num].detach()).sum(-1) for k in keys], -1)
    assert logits.softmax(-1)[..., 1].max() < 1e-5
    h_tol, grad_tol, _ = TOLERANCE[F32]
    assert rel_err(y, y64) <= h_tol
    names = ["embedding"] + [n for n, _ in res.named_parameters()] + \
        [f"sublayer.{n}" for n, _ in layers.named_parameters()]
    for name, a, b in zip(names, grads, grads64):
        err = rel_err(a, b)
        assert err <= grad_tol, f"{schedule}: d{name}: relative error {err:.3g}"
