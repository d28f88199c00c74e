"""Accuracy under sharp depth attention (SPEC section 3), not a timing: float32 through
attnres against float64, each output's max error relative to its own max-abs.

Cases (N = 64 tokens, D = 32, RMSNorm without gamma): one completed block along +1,
the partial block along -1, w a multiple of ones giving a logit gap of 9.2 (the
partial block's weight ~1e-4) or 13.8 (~1e-6), optionally with the partial block
1000x the block; then a model (tests/python/model_reference.py
embedding_favouring_stream: three Linear+tanh sub-layers in one block of four, the
final query favouring the embedding), both schedules, every parameter's gradient.
Run it against another build with PYTHONPATH pointing at that build's package.

    python3 bench/sharp_accuracy.py
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import block_attnres as attnres  # noqa: E402
from model_reference import embedding_favouring_stream, reference_block_attn_res  # noqa: E402

F32, F64 = torch.float32, torch.float64


def rel(a, b):
    a, b = a.detach().to(F64), b.detach().to(F64)
    return ((a - b).abs().max() / b.abs().max()).item()


def op_errors(path, gap, partial_size):
    g = torch.Generator().manual_seed(0)
    dim = 32
    block = (1 + 0.1 * torch.randn(64, dim, generator=g, dtype=F64)).to(F32)
    partial = (-partial_size * (1 + 0.1 * torch.randn(64, dim, generator=g, dtype=F64))).to(F32)
    w = torch.full((dim,), gap / (2 * dim), dtype=F32)  # keys ~ +-1: z_block - z_partial ~ gap
    grad = torch.randn(64, dim, generator=g, dtype=F64)

    def run(dtype, fn):
        b, p, q = (x.to(dtype).requires_grad_(True) for x in (block, partial, w))
        h = fn(b, p, q)
        return (h, *torch.autograd.grad((h * grad.to(dtype)).sum(), (p, b, q)))

    def ours(b, p, q):
        if path == "single op":
            return attnres.block_attn_res_fn([b], p, q)
        outs, lses = attnres.block_attn_res_phase1([b], q.unsqueeze(0))
        return attnres.block_attn_res_phase2(outs[0], lses[0], p, q)

    got = run(F32, ours)
    want = run(F64, lambda b, p, q: reference_block_attn_res([b], p, q))
    return [rel(a, b) for a, b in zip(got, want)]


def stream_error(schedule):
    res, layers, emb, gy = embedding_favouring_stream(schedule)

    def run(res, layers, dtype):
        stream = res.begin(emb.to(dtype))
        for layer in layers:
            stream.add(layer(stream.next_input()))
        y = stream.finish()
        params = list(res.parameters()) + list(layers.parameters())
        return torch.autograd.grad((y * gy.to(dtype)).sum(), params)

    got = run(res, layers, F32)
    want = run(copy.deepcopy(res).double(), copy.deepcopy(layers).double(), F64)
    return max(rel(a, b) for a, b in zip(got, want))


def main():
    print(f"attnres from {os.path.dirname(attnres.__file__)}")
    print("| path | partial weight | partial size | h | d_partial | d_block | dw |")
    print("|---|---|---|---|---|---|---|")
    for path in ("single op", "phase 1 + phase 2"):
        for gap, weight, size in ((9.2, "1e-4", 1), (9.2, "1e-4", 1000), (13.8, "1e-6", 1)):
            errors = op_errors(path, gap, size)
            print(f"| {path} | {weight} | {size}x | " + " | ".join(f"{e:.2g}" for e in errors) + " |")
    for schedule in ("two_phase", "per_layer"):
        print(f"stream ({schedule}), final query favouring the embedding: worst parameter "
              f"gradient {stream_error(schedule):.2g} of its max-abs")


if __name__ == "__main__":
    main()
