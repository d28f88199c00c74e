#!/usr/bin/env python3
"""Model-level benchmark of the residual machinery: plain residuals vs Block AttnRes
with the single op per sub-layer (schedule "per_layer") vs the two-phase schedule
("two_phase"), through attnres.nn.BlockAttnResStream, alternated in one process.

Sub-layers are f(x) = 0.5 x, so only the residual machinery is timed: for plain
residuals ``x = x + f(x)``; for Block AttnRes ``stream.add(f(stream.next_input()))``.
Timed: forward, and forward + backward (the backward of sum(y * g) for a fixed g).
Reported: medians of --repeat runs, ms, and the ratio to plain residuals.

Phase 1's kernels are also timed alone (forward and backward at the shape of one
block start with the most completed blocks), with their minimal bytes and the
fraction of the machine's streaming bandwidth measured in the same run, and a
compute ceiling: phase 1 forward does S + 1 multiply-adds per block element in its
first pass and S in its second; the ceiling is that count at the FMA rate of a
cache-resident matrix product measured here (torch.mm of L2-resident matrices).

Shapes: "48b" (the report's 48B model: D=2304, 54 sub-layers, blocks of 6, 4096
tokens) and "k3" (Kimi K3-like: D=7168, blocks of 24 sub-layers, 9 completed
blocks at the end, 1024 tokens).

Usage: python bench/bench_stream.py [--shape 48b|k3|both] [--repeat 3] [--json]
       [--threads N] [--dtype bf16|fp32] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, Optional, Sequence

import torch

import block_attnres as attnres
from block_attnres.ops import phase1
from block_attnres.nn import BlockAttnResStream

SHAPES = {
    "48b": dict(dim=2304, num_sublayers=54, block_size=6, tokens=4096),
    "k3": dict(dim=7168, num_sublayers=24 * 9, block_size=24, tokens=1024),
    "quick": dict(dim=256, num_sublayers=12, block_size=3, tokens=256),
}


def timed(fn, repeat: int) -> float:
    fn()  # warm-up: allocator, first-touch pages
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_plain(x: torch.Tensor, num_sublayers: int, backward: bool, grad: torch.Tensor):
    x = x.detach().requires_grad_(backward)
    h = x
    for _ in range(num_sublayers):
        h = h + 0.5 * h
    if backward:
        h.backward(grad)


def run_stream(module: BlockAttnResStream, x: torch.Tensor, backward: bool, grad: torch.Tensor):
    x = x.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        stream = module.begin(x)
        for _ in range(module.num_sublayers):
            stream.add(0.5 * stream.next_input())
        y = stream.finish()
        if backward:
            y.backward(grad)
            module.zero_grad(set_to_none=True)


def stream_bandwidth(repeat: int, mib: int = 512) -> Dict[str, float]:
    """Read (sum) and copy bandwidth of torch on this machine, GB/s (best of repeat)."""
    n = mib * (1 << 20) // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    b.copy_(a)
    read = min(timed(lambda: a.sum(), 1) for _ in range(repeat))
    copy = min(timed(lambda: b.copy_(a), 1) for _ in range(repeat))
    return {"read_gbs": n * 4 / read / 1e6, "copy_gbs": 2 * n * 4 / copy / 1e6}


def fma_ceiling(repeat: int) -> float:
    """Multiply-adds per second of a cache-resident fp32 matrix product (torch.mm of
    256 x 256 matrices, 256 KB each, with the run's threads): the machine's FMA rate,
    so FMAs / this rate is a floor no kernel goes below. (A matrix-vector product,
    used before, is bound by its loads: on the Xeon it measured 13 GFMA/s, a "floor"
    above phase 1's measured times.)"""
    n, calls = 256, 200
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)

    def many():
        for _ in range(calls):
            torch.mm(a, b, out=out)
    ms = min(timed(many, 1) for _ in range(repeat))
    return n ** 3 * calls / (ms * 1e-3)


def bench_phase1(dim: int, num_blocks: int, num_queries: int, tokens: int, dtype, repeat: int,
                 bandwidth: Dict[str, float], fma_per_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(tokens, dim, generator=gen).to(dtype) for _ in range(num_blocks)]
    w = (0.05 * torch.randn(num_queries, dim, generator=gen)).to(dtype)
    gamma = torch.ones(num_queries, dim, dtype=dtype)
    grads = [torch.randn(tokens, dim, generator=gen).to(dtype) for _ in range(num_queries)]
    fwd = timed(lambda: phase1.forward(blocks, w, gamma, 1e-6, 1.0, True), repeat)
    bwd = timed(lambda: phase1.gradients("phase1", grads, [None] * num_queries, blocks, w, gamma,
                                         1e-6, 1.0, True), repeat)
    elem = torch.tensor([], dtype=dtype).element_size()
    n, s, d = num_blocks, num_queries, dim
    fwd_bytes = tokens * d * elem * (n + s) + tokens * s * 4
    bwd_bytes = tokens * d * elem * (2 * n + s)
    fwd_fmas = tokens * d * n * (2 * s + 1)
    bwd_fmas = tokens * d * n * (5 * s + 1)
    return {
        "dim": d, "blocks": n, "queries": s, "tokens": tokens,
        "fwd_ms": fwd, "bwd_ms": bwd,
        "fwd_gbs": fwd_bytes / fwd / 1e6, "bwd_gbs": bwd_bytes / bwd / 1e6,
        "fwd_fraction": fwd_bytes / fwd / 1e6 / bandwidth["read_gbs"],
        "bwd_fraction": bwd_bytes / bwd / 1e6 / bandwidth["copy_gbs"],
        "fwd_compute_ms": fwd_fmas / fma_per_s * 1e3,
        "bwd_compute_ms": bwd_fmas / fma_per_s * 1e3,
    }


def bench_phase2_step(dim: int, tokens: int, dtype, repeat: int,
                      bandwidth: Dict[str, float]) -> dict:
    """One sub-layer's residual step inside a block, with the input norm: the partial
    block grows by the last output y, then phase 2 merges it. Separate (torch's add,
    then phase 2) against fused (phase 2 with update=y), forward and backward through
    autograd (the backward with a gradient arriving at the new partial block too, as
    from the next sub-layer), alternated; the results are checked bitwise first."""
    gen = torch.Generator().manual_seed(0)
    rows = lambda: torch.randn(tokens, dim, generator=gen).to(dtype).requires_grad_()
    o, p, y = rows(), rows(), rows()
    lse = torch.randn(tokens, generator=gen).requires_grad_()
    w = (0.02 * torch.randn(dim, generator=gen)).to(dtype).requires_grad_()
    gamma, nw = (torch.ones(dim, dtype=dtype, requires_grad=True) for _ in range(2))
    g_x, g_p = (torch.randn(tokens, dim, generator=gen).to(dtype) for _ in range(2))
    kw = dict(norm_weight=nw, input_norm=True)

    def separate():
        q = p + y
        return attnres.block_attn_res_phase2(o, lse, q, w, gamma, **kw), q

    def fused():
        return attnres.block_attn_res_phase2(o, lse, p, w, gamma, update=y, **kw)

    with torch.no_grad():
        a, b = separate(), fused()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "fused != separate"
    leaves = (o, lse, p, y, w, gamma, nw)
    runs = {k: [] for k in ("separate_fwd", "fused_fwd", "separate_bwd", "fused_bwd")}
    for _ in range(max(repeat, 5)):
        for name, step in (("separate", separate), ("fused", fused)):
            with torch.no_grad():
                runs[name + "_fwd"].append(timed(step, 1))
            x, q = step()
            start = time.perf_counter()  # once: the graph is freed by the backward
            torch.autograd.backward([x, q], [g_x, g_p])
            runs[name + "_bwd"].append((time.perf_counter() - start) * 1e3)
            for t in leaves:
                t.grad = None
    med = {k: statistics.median(v) for k, v in runs.items()}
    elem = torch.tensor([], dtype=dtype).element_size()
    row = tokens * dim * elem
    # Forward rows moved: fused reads o, p, y and writes p', x (5); separate, the add's
    # 3 (p, y in, p' out) and phase 2's 3 (o, p' in, x out).
    med["fused_fwd_gbs"] = 5 * row / med["fused_fwd"] / 1e6
    med["fused_fwd_fraction"] = med["fused_fwd_gbs"] / bandwidth["read_gbs"]
    return {"dim": dim, "tokens": tokens, **med}


def bench_model(shape: dict, dtype, repeat: int) -> dict:
    dim, layers, block_size, tokens = (shape[k] for k in ("dim", "num_sublayers", "block_size",
                                                           "tokens"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    grad = torch.randn(tokens, dim, generator=gen).to(dtype)
    modules = {s: BlockAttnResStream(dim, layers, block_size, schedule=s, dtype=dtype)
               for s in ("per_layer", "two_phase")}
    results = {}
    for backward in (False, True):
        key = "fwd_bwd" if backward else "fwd"
        runs = {"plain": [], "per_layer": [], "two_phase": []}
        for _ in range(repeat):  # alternated, so drift hits every scheme alike
            runs["plain"].append(timed(lambda: run_plain(x, layers, backward, grad), 1))
            for s, m in modules.items():
                runs[s].append(timed(lambda: run_stream(m, x, backward, grad), 1))
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[key] = {k: {"ms": v, "vs_plain": v / med["plain"]} for k, v in med.items()}
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="48b", choices=["48b", "k3", "both", "quick"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    attnres.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    names = ["48b", "k3"] if args.shape == "both" else [args.shape]
    bandwidth = stream_bandwidth(args.repeat)
    fma_per_s = fma_ceiling(args.repeat)
    report = {"cpu": platform.processor() or platform.machine(), "isa": attnres.cpu_isa(),
              "threads": args.threads, "dtype": args.dtype, **bandwidth,
              "fma_per_s": fma_per_s, "shapes": {}}
    for name in names:
        shape = SHAPES[name]
        model = bench_model(shape, dtype, args.repeat)
        n = shape["num_sublayers"] // shape["block_size"]  # completed blocks at the last start
        phase1 = bench_phase1(shape["dim"], n, shape["block_size"], shape["tokens"], dtype,
                              args.repeat, bandwidth, fma_per_s)
        step = bench_phase2_step(shape["dim"], shape["tokens"], dtype, args.repeat, bandwidth)
        report["shapes"][name] = {"shape": shape, "model": model, "phase1": phase1,
                                  "phase2_step": step}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print(f"attnres stream bench: isa {report['isa']}, {args.threads} threads, {args.dtype}, "
          f"median of {args.repeat}; torch read {bandwidth['read_gbs']:.1f} GB/s, copy "
          f"{bandwidth['copy_gbs']:.1f} GB/s, mm {fma_per_s / 1e9:.1f} GFMA/s")
    for name, r in report["shapes"].items():
        s = r["shape"]
        print(f"\n{name}: D={s['dim']}, {s['num_sublayers']} sub-layers, blocks of "
              f"{s['block_size']}, {s['tokens']} tokens")
        print(f"{'':12s} {'plain ms':>10s} {'per_layer':>18s} {'two_phase':>18s}")
        for key in ("fwd", "fwd_bwd"):
            m = r["model"][key]
            print(f"{key:12s} {m['plain']['ms']:10.1f} "
                  f"{m['per_layer']['ms']:9.1f} ({m['per_layer']['vs_plain']:4.2f}x) "
                  f"{m['two_phase']['ms']:9.1f} ({m['two_phase']['vs_plain']:4.2f}x)")
        p = r["phase1"]
        print(f"phase 1 alone (N={p['blocks']}, S={p['queries']}): forward {p['fwd_ms']:.1f} ms "
              f"= {p['fwd_gbs']:.1f} GB/s = {p['fwd_fraction']:.2f} of read, compute floor "
              f"{p['fwd_compute_ms']:.1f} ms; backward {p['bwd_ms']:.1f} ms = "
              f"{p['bwd_gbs']:.1f} GB/s = {p['bwd_fraction']:.2f} of copy, compute floor "
              f"{p['bwd_compute_ms']:.1f} ms")
        t = r["phase2_step"]
        print(f"phase 2 step with the partial-block update (add + phase 2 -> fused): forward "
              f"{t['separate_fwd']:.2f} -> {t['fused_fwd']:.2f} ms "
              f"({t['separate_fwd'] / t['fused_fwd']:.2f}x; fused {t['fused_fwd_gbs']:.1f} GB/s "
              f"= {t['fused_fwd_fraction']:.2f} of read), backward {t['separate_bwd']:.2f} -> "
              f"{t['fused_bwd']:.2f} ms ({t['separate_bwd'] / t['fused_bwd']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
