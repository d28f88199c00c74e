#!/usr/bin/env python3
"""CPU benchmark of the attnres Python API against a PyTorch eager implementation
of the seed's structure (SPEC §4), side by side in one process.

Timed, per shape (B = 1, T = tokens):
  forward      attnres.block_attn_res (no caches requested)
               vs seed_eager_forward: torch.stack + RMSNorm (fp32) + einsum +
               softmax + einsum, cast to the input dtype.
  backward     attnres.block_attn_res_backward given the forward's caches
               vs seed_eager_backward: the seed's backward written out in fp32
               (stack, grad_alpha = einsum, softmax backward, RMSNorm backward,
               dw/dgamma sums, split grad_v into N + 1 contiguous tensors).
  bwd (no caches)  attnres.ops.block_attn_res.gradients(...) without the caches
               (recomputes the softmax), against the same baseline.

Minimal bytes (what the operator must move; elem = bytes per element):
  forward : tokens * (L*D + D) * elem      (read L sources, write h)
  backward: tokens * (2*L*D + D) * elem    (read L sources + grad_h, write L grads)
GB/s = minimal bytes / median time; "frac" divides it by the machine's streaming
bandwidth measured in this run (read-only sum for forward, copy for backward).

Also measures the fixed per-call time of the Python front ends on a 1-token input
(the eager fast path, the same calls through the torch.library custom ops, the
two-phase calls, one stream step), next to the C++ forward of `attnres run` and the
cost of a trivial custom op and autograd.Function (--overhead-only for just that).

Both sides allocate fresh outputs on every call (the seed API returns new tensors),
so the times include first-touch page faults on them (about 0.5 ms per MB measured
on this machine under load); bench.cc times the kernels with preallocated buffers.
Measurements whose estimated RAM exceeds --max-gb (default 8) are skipped and listed;
a shape is timed partly when only some of them fit.

Usage:  python bench/bench_torch.py [--quick] [--json] [--threads N] [--repeat R]
        [--max-gb 8] [--no-overhead | --overhead-only [--overhead-calls N] [--cli PATH]]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import List, Optional, Sequence

import torch

import block_attnres as attnres
from block_attnres.ops import block_attn_res

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FULL_DIMS = (512, 1536, 4096)
FULL_SOURCES = (4, 9, 17, 33, 128)
FULL_TOKENS = (4096, 65536)


# --------------------------------------------------------------------------
# The baseline: the seed's structure in PyTorch eager, fp32 compute.
# Same signatures, defaults and return conventions as the seed (and as
# attnres.block_attn_res / attnres.block_attn_res_backward), so tests can use
# them as a drop-in reference:  from bench.bench_torch import seed_eager_forward
# --------------------------------------------------------------------------
def seed_eager_forward(blocks: List[torch.Tensor], proj_weight: torch.Tensor,
                       partial_block: Optional[torch.Tensor] = None, scale: float = 1.0,
                       rmsnorm_eps: float = 1e-6, rmsnorm_gamma: Optional[torch.Tensor] = None,
                       enable_rmsnorm: bool = True, rms_out_flag: bool = False,
                       alpha_out_flag: bool = False):
    """Seed forward: stack -> [B*T, L, D], fp32 RMSNorm, logits = einsum, softmax,
    h = einsum, cast. Returns out, or (out[, rms_cache [B,T,L,1]][, alpha_cache [B,T,L]])."""
    sources = list(blocks) + ([partial_block] if partial_block is not None else [])
    b, t, d = sources[0].shape
    n_src = len(sources)
    dtype = sources[0].dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    v = torch.stack(sources, dim=2).reshape(b * t, n_src, d)       # the seed's stacked copy
    vf = v.to(acc)                                                  # fp32 compute copy
    del v
    rms = None
    if enable_rmsnorm:
        rms = vf.pow(2).mean(dim=-1, keepdim=True).add_(rmsnorm_eps).sqrt_()   # [BT, L, 1]
        k = (vf / rms).mul_(rmsnorm_gamma.to(acc))
    else:
        k = vf
    logits = torch.einsum("nld,d->nl", k, proj_weight.to(acc))
    del k
    if scale != 1.0:
        logits = logits * scale
    alpha = torch.softmax(logits, dim=-1)                           # [BT, L]
    out = torch.einsum("nl,nld->nd", alpha, vf).to(dtype).reshape(b, t, d)
    if not (rms_out_flag or alpha_out_flag):
        return out
    results = [out]
    if rms_out_flag:
        results.append(rms.reshape(b, t, n_src, 1))
    if alpha_out_flag:
        results.append(alpha.reshape(b, t, n_src))
    return tuple(results)


def seed_eager_backward(grad_h: torch.Tensor, blocks: List[torch.Tensor],
                        proj_weight: torch.Tensor, alpha_cache: torch.Tensor,
                        partial_block: Optional[torch.Tensor] = None,
                        rmsnorm_gamma: Optional[torch.Tensor] = None,
                        rms_cache: Optional[torch.Tensor] = None, scale: float = 1.0,
                        enable_rmsnorm: bool = True):
    """Seed backward, written explicitly (no autograd), fp32 compute.

    Returns (grad_blocks, grad_partial_block or None, grad_proj_weight[, grad_gamma]).
    """
    sources = list(blocks) + ([partial_block] if partial_block is not None else [])
    n = len(blocks)
    b, t, d = sources[0].shape
    n_src = len(sources)
    bt = b * t
    dtype = sources[0].dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    v = torch.stack(sources, dim=2).reshape(bt, n_src, d)           # the seed's stacked copy
    vf = v.to(acc)
    del v
    g = grad_h.reshape(bt, d).to(acc)
    alpha = alpha_cache.reshape(bt, n_src).to(acc)
    w_s = proj_weight.to(acc) * scale

    # Weighted-sum backward: grad_alpha_i = <g, v_i>.
    grad_alpha = torch.einsum("nd,nld->nl", g, vf)
    # Softmax backward.
    gz = alpha * (grad_alpha - (alpha * grad_alpha).sum(dim=-1, keepdim=True))
    # Scores backward: grad_k_i = gz_i * scale * w; dw = scale * sum gz_i k_i.
    if enable_rmsnorm:
        gamma = rmsnorm_gamma.to(acc)
        rms = rms_cache.reshape(bt, n_src, 1).to(acc)
        k = (vf / rms).mul_(gamma)                                  # keys recomputed from rms
        grad_w = torch.einsum("nl,nld->d", gz, k) * scale
        del k
        # RMSNorm backward: dv = (gamma*gk - v * <gamma*gk, v> / (D r^2)) / r
        gkg = gz.unsqueeze(-1) * (w_s * gamma)                      # gamma * grad_k  [BT, L, D]
        c = torch.einsum("nld,nld->nl", gkg, vf).unsqueeze(-1)
        grad_gamma = torch.einsum("nl,nld->d", gz / rms.squeeze(-1), vf) * w_s   # sum gk * v / r
        grad_v = gkg.div_(rms)
        del gkg
        grad_v.addcmul_(vf, c / (d * rms.pow(3)), value=-1.0)
    else:
        grad_w = torch.einsum("nl,nld->d", gz, vf) * scale
        grad_v = gz.unsqueeze(-1) * w_s
        grad_gamma = None
    del vf
    # Plus the weighted-sum path: dv_i += alpha_i * g.
    grad_v.addcmul_(alpha.unsqueeze(-1), g.unsqueeze(1))
    grad_v = grad_v.to(dtype).reshape(b, t, n_src, d)
    # Split the stacked gradient back into separate contiguous tensors.
    grad_blocks = [grad_v[:, :, i, :].contiguous() for i in range(n)]
    grad_partial = grad_v[:, :, n, :].contiguous() if partial_block is not None else None
    del grad_v
    grad_w = grad_w.to(dtype)
    if enable_rmsnorm:
        return grad_blocks, grad_partial, grad_w, grad_gamma.to(dtype)
    return grad_blocks, grad_partial, grad_w


# --------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------
def time_ms(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall milliseconds of fn() over `repeat` calls after `warmup` calls.
    The result of each call is dropped at once so that only one is alive."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_us_each(fn, calls: int) -> float:
    """Median microseconds of one call, each call timed on its own."""
    for _ in range(min(200, calls)):
        fn()
    clock = time.perf_counter_ns
    times = [0] * calls
    for i in range(calls):
        t0 = clock()
        fn()
        times[i] = clock() - t0
    return statistics.median(times) / 1e3


def stream_bandwidth(repeat: int, mib: int = 512):
    """Streaming GB/s on this machine: read-only (sum of fp32) and copy (read+write)."""
    n = mib * (1 << 20) // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    read_ms = time_ms(lambda: x.sum(), repeat, warmup=2)
    copy_ms = time_ms(lambda: y.copy_(x), repeat, warmup=2)
    del x, y
    return {"read_GBps": n * 4 / read_ms / 1e6, "copy_GBps": 2 * n * 4 / copy_ms / 1e6,
            "buffer_MiB": mib}


# --------------------------------------------------------------------------
# Memory budget. Estimated peak RAM of each measurement, from the bytes per
# element of the L*tokens*D sources: the sources themselves plus, for the
# baseline, its peak extra as measured with the process RSS (T=8192, D=1536,
# L=9): forward 8.0 B/elem (stack or fp32 copy + one fp32 temporary), backward
# 12.1 (fp32) / 12.5 (bf16) B/elem including the returned gradients. A margin of
# 0.5 B/elem is added; the per-token vectors (h, grad_h, caches) are added exactly.
# --------------------------------------------------------------------------
def estimated_bytes(kind: str, tokens: int, dim: int, num_sources: int, elem: int) -> float:
    n_el = tokens * dim * num_sources
    per_token = tokens * (2 * dim * elem + 2 * num_sources * 4)       # h, grad_h, caches
    per_elem = {"attnres_fwd": elem, "attnres_bwd": 2 * elem,
                "eager_fwd": elem + 8.5, "eager_bwd": elem + 13.0}[kind]
    return n_el * per_elem + per_token


def make_inputs(tokens: int, dim: int, num_sources: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(1, tokens, dim, generator=gen).to(dtype) for _ in range(num_sources - 1)]
    partial = torch.randn(1, tokens, dim, generator=gen).to(dtype)
    w = (torch.randn(dim, generator=gen) / math.sqrt(dim)).to(dtype)
    gamma = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    grad_h = torch.randn(1, tokens, dim, generator=gen).to(dtype)
    return blocks, partial, w, gamma, grad_h


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.float()
    return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bench_shape(tokens, dim, num_sources, dtype_name, repeat, max_bytes, stream):
    dtype = DTYPES[dtype_name]
    elem = torch.empty((), dtype=dtype).element_size()
    need = {k: estimated_bytes(k, tokens, dim, num_sources, elem)
            for k in ("attnres_fwd", "attnres_bwd", "eager_fwd", "eager_bwd")}
    fits = {k: v <= max_bytes for k, v in need.items()}
    row = {"dtype": dtype_name, "tokens": tokens, "dim": dim, "L": num_sources,
           "est_GB": {k: round(v / 1e9, 2) for k, v in need.items()}}
    if not fits["attnres_fwd"]:
        row["skipped"] = (f"sources alone need {need['attnres_fwd'] / 1e9:.1f} GB "
                          f"(--max-gb {max_bytes / 1e9:g})")
        return row
    row["skipped_parts"] = [k for k, ok in fits.items() if not ok]

    blocks, partial, w, gamma, grad_h = make_inputs(tokens, dim, num_sources, dtype)
    kw = dict(partial_block=partial, rmsnorm_gamma=gamma, scale=1.0, rmsnorm_eps=1e-6)
    fwd_bytes = tokens * (num_sources * dim + dim) * elem
    bwd_bytes = tokens * (2 * num_sources * dim + dim) * elem

    # ---- forward
    row["fwd_ms"] = time_ms(lambda: attnres.block_attn_res(blocks, w, **kw), repeat)
    row["fwd_GBps"] = fwd_bytes / row["fwd_ms"] / 1e6
    row["fwd_frac"] = row["fwd_GBps"] / stream["read_GBps"] if stream else None
    if fits["eager_fwd"]:
        with torch.no_grad():
            ref = seed_eager_forward(blocks, w, **kw)
            row["fwd_err"] = rel_err(attnres.block_attn_res(blocks, w, **kw), ref)
            del ref
            row["eager_fwd_ms"] = time_ms(lambda: seed_eager_forward(blocks, w, **kw), repeat)
        row["fwd_speedup"] = row["eager_fwd_ms"] / row["fwd_ms"]

    # ---- backward
    if fits["attnres_bwd"]:
        _, rms_cache, alpha_cache = attnres.block_attn_res(
            blocks, w, **kw, rms_out_flag=True, alpha_out_flag=True)
        bkw = dict(partial_block=partial, rmsnorm_gamma=gamma, rms_cache=rms_cache, scale=1.0)
        row["bwd_ms"] = time_ms(
            lambda: attnres.block_attn_res_backward(grad_h, blocks, w, alpha_cache, **bkw), repeat)
        row["bwd_GBps"] = bwd_bytes / row["bwd_ms"] / 1e6
        row["bwd_frac"] = row["bwd_GBps"] / stream["copy_GBps"] if stream else None
        row["bwd_nc_ms"] = time_ms(
            lambda: block_attn_res.gradients("bench", grad_h, blocks, partial, w, gamma, 1e-6,
                                             1.0, True), repeat)
        row["bwd_nc_GBps"] = bwd_bytes / row["bwd_nc_ms"] / 1e6
        row["bwd_nc_frac"] = row["bwd_nc_GBps"] / stream["copy_GBps"] if stream else None
        if fits["eager_bwd"]:
            with torch.no_grad():
                got = attnres.block_attn_res_backward(grad_h, blocks, w, alpha_cache, **bkw)
                ref = seed_eager_backward(grad_h, blocks, w, alpha_cache, **bkw)
                row["bwd_err"] = max(rel_err(torch.stack(list(got[0]) + [got[1]]),
                                             torch.stack(list(ref[0]) + [ref[1]])),
                                     rel_err(got[2], ref[2]), rel_err(got[3], ref[3]))
                del got, ref
                row["eager_bwd_ms"] = time_ms(
                    lambda: seed_eager_backward(grad_h, blocks, w, alpha_cache, **bkw), repeat)
            row["bwd_speedup"] = row["eager_bwd_ms"] / row["bwd_ms"]
            row["bwd_nc_speedup"] = row["eager_bwd_ms"] / row["bwd_nc_ms"]
    return row


# --------------------------------------------------------------------------
# Fixed per-call overhead on a 1-token input.
# --------------------------------------------------------------------------
def cli_forward_us(cli: str, dim: int, blocks: int, threads: int, repeat: int) -> Optional[float]:
    """The C++ forward of `attnres run --tokens 1 ... --partial` (median of `repeat`)."""
    try:
        out = subprocess.run([cli, "run", "--tokens", "1", "--dim", str(dim), "--blocks",
                              str(blocks), "--partial", "--threads", str(threads), "--repeat",
                              str(repeat), "--no-check"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().startswith("forward"):
            return float(line.split(":")[1].split()[0]) * 1e3
    return None


def _one_token(dim: int, num_sources: int, dtype: torch.dtype, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(1)
    blocks = [torch.randn(1, 1, dim, generator=gen).to(dtype) for _ in range(num_sources - 1)]
    partial = torch.randn(1, 1, dim, generator=gen).to(dtype)
    w = (torch.randn(dim, generator=gen) / math.sqrt(dim)).to(dtype)
    gamma = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    if requires_grad:
        for t in (*blocks, partial, w, gamma):
            t.requires_grad_(True)
    return blocks, partial, w, gamma


def _stream_steps(dim: int, dtype: torch.dtype, calls: int, block_size: int = 8) -> float:
    """Median us of one stream step (next_input() + add()) at 1 token, no grad; a new
    block every block_size steps (phase 1 then runs in the step: the median is a
    phase-2 step)."""
    steps = min(200, calls) + calls
    res = attnres.nn.BlockAttnResStream(dim, steps, block_size, dtype=dtype)
    x = torch.randn(1, 1, dim).to(dtype)
    times = []
    clock = time.perf_counter_ns
    with torch.no_grad():
        stream = res.begin(x)
        for i in range(steps):
            t0 = clock()
            stream.add(stream.next_input())
            times.append(clock() - t0)
    return statistics.median(times[min(200, calls):]) / 1e3


def bench_overhead(calls: int, cli: Optional[str] = None, threads: int = 1):
    """Per-call times at 1 token (B = T = 1), L = 10 sources (N = 9 + partial), bf16
    unless named: the Python front ends on the eager fast path, the same calls through
    the custom ops, the C++ forward, and references. Rows: (name, us or None)."""
    bf16 = torch.bfloat16
    rows = []

    def add(name, fn, grad=False):
        with contextlib.nullcontext() if grad else torch.no_grad():
            rows.append((name, time_us_each(fn, calls)))

    for dim in (64, 1024, 7168):
        blocks, partial, w, gamma = _one_token(dim, 10, bf16)
        add(f"block_attn_res_fn D={dim}, no grad",
            lambda: attnres.block_attn_res_fn(blocks, partial, w, gamma))
        gb, gp, gw, gg = _one_token(dim, 10, bf16, requires_grad=True)
        add(f"block_attn_res_fn D={dim}, autograd",
            lambda: attnres.block_attn_res_fn(gb, gp, gw, gg), grad=True)
        if dim == 7168:
            rows.append((f"C++ forward D={dim} (attnres run --tokens 1 --partial)",
                         cli_forward_us(cli, dim, 9, threads, calls) if cli else None))
    blocks, partial, w, gamma = _one_token(64, 10, bf16)
    gb, gp, gw, gg = _one_token(64, 10, bf16, requires_grad=True)
    # The custom op itself: what block_attn_res_fn called before it had a fast path
    # (and what it calls under torch.compile).
    add("torch.ops.attnres.block_attn_res D=64, no grad",
        lambda: torch.ops.attnres.block_attn_res(blocks, partial, w, gamma, 1e-6, 1.0, True))
    add("torch.ops.attnres.block_attn_res D=64, autograd",
        lambda: torch.ops.attnres.block_attn_res(gb, gp, gw, gg, 1e-6, 1.0, True), grad=True)
    add("seed API attnres.block_attn_res D=64",
        lambda: attnres.block_attn_res(blocks, w, partial, rmsnorm_gamma=gamma))
    module = attnres.nn.BlockAttnRes(64, dtype=bf16)
    add("BlockAttnRes module D=64, no grad", lambda: module(blocks, partial))
    add("BlockAttnRes module D=64, autograd", lambda: module(gb, gp), grad=True)

    with torch.no_grad():
        outs, lses = attnres.block_attn_res_phase1(blocks[:-1], w[None], gamma[None])
    add("block_attn_res_phase2 D=64, no grad",
        lambda: attnres.block_attn_res_phase2(outs[0], lses[0], partial, w, gamma))
    go, gl = outs[0].detach().requires_grad_(), lses[0].detach().requires_grad_()
    add("block_attn_res_phase2 D=64, autograd",
        lambda: attnres.block_attn_res_phase2(go, gl, gp, gw, gg), grad=True)
    rows.append(("stream step (next_input + add) D=64, no grad",
                 _stream_steps(64, bf16, calls)))

    # References: what the dispatcher and autograd cost on their own.
    @torch.library.custom_op("attnres_bench::trivial", mutates_args=())
    def trivial(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    trivial.register_fake(lambda x: torch.empty_like(x))
    trivial.register_autograd(lambda ctx, g: g)

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    add("trivial custom_op (autograd registered), no grad", lambda: trivial(w))
    add("trivial custom_op (autograd registered), autograd", lambda: trivial(gw), grad=True)
    add("trivial autograd.Function, autograd", lambda: Trivial.apply(gw), grad=True)
    add("torch.empty_like (reference)", lambda: torch.empty_like(partial))

    # The seed API's rows of earlier versions of this table (fp32, D=64, L=2).
    gen = torch.Generator().manual_seed(1)
    b2, p2 = [torch.randn(1, 1, 64, generator=gen)], torch.randn(1, 1, 64, generator=gen)
    w2, g2, gh2 = torch.randn(64, generator=gen) / 8, torch.ones(64), torch.randn(1, 1, 64)
    _, rms2, alpha2 = attnres.block_attn_res(b2, w2, p2, rmsnorm_gamma=g2, rms_out_flag=True,
                                             alpha_out_flag=True)
    add("seed block_attn_res fp32 D=64 L=2",
        lambda: attnres.block_attn_res(b2, w2, p2, rmsnorm_gamma=g2))
    add("seed block_attn_res_backward fp32 D=64 L=2",
        lambda: attnres.block_attn_res_backward(gh2, b2, w2, alpha2, partial_block=p2,
                                                rmsnorm_gamma=g2, rms_cache=rms2))
    return rows


def overhead_goals(rows) -> List[str]:
    """The issue's goals, met or not, from the rows."""
    us = dict(rows)
    lines = []
    for name, goal in (("block_attn_res_fn D=64, autograd", 20.0),
                       ("block_attn_res_fn D=64, no grad", 12.0)):
        lines.append(f"{name} <= {goal:g} us: {'met' if us[name] <= goal else 'NOT met'} "
                     f"({us[name]:.1f} us)")
    cpp = us.get("C++ forward D=7168 (attnres run --tokens 1 --partial)")
    python = us["block_attn_res_fn D=7168, no grad"]
    if cpp:
        lines.append(f"block_attn_res_fn D=7168 within 1.5x of the C++ forward: "
                     f"{'met' if python <= 1.5 * cpp else 'NOT met'} ({python / cpp:.2f}x)")
    return lines


# --------------------------------------------------------------------------
def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "-"


def print_header(out):
    hdr = (f"{'dtype':5} {'tokens':>6} {'D':>5} {'L':>4} | "
           f"{'fwd ms':>8} {'eager':>8} {'x':>6} {'GB/s':>6} {'frac':>5} | "
           f"{'bwd ms':>8} {'eager':>8} {'x':>6} {'GB/s':>6} {'frac':>5} | "
           f"{'bwd-nc ms':>9} {'x':>6} {'GB/s':>6} {'frac':>5} | {'err fwd/bwd':>15}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out, flush=True)


def print_row(r, out):
    head = f"{r['dtype']:5} {r['tokens']:>6} {r['dim']:>5} {r['L']:>4} | "
    if "skipped" in r:
        print(head + "skipped: " + r["skipped"], file=out, flush=True)
        return
    g = r.get
    line = (head
            + f"{fmt(g('fwd_ms'), '8.2f'):>8} {fmt(g('eager_fwd_ms'), '8.2f'):>8} "
            f"{fmt(g('fwd_speedup'), '6.2f'):>6} {fmt(g('fwd_GBps'), '6.1f'):>6} "
            f"{fmt(g('fwd_frac'), '5.2f'):>5} | "
            f"{fmt(g('bwd_ms'), '8.2f'):>8} {fmt(g('eager_bwd_ms'), '8.2f'):>8} "
            f"{fmt(g('bwd_speedup'), '6.2f'):>6} {fmt(g('bwd_GBps'), '6.1f'):>6} "
            f"{fmt(g('bwd_frac'), '5.2f'):>5} | "
            f"{fmt(g('bwd_nc_ms'), '9.2f'):>9} {fmt(g('bwd_nc_speedup'), '6.2f'):>6} "
            f"{fmt(g('bwd_nc_GBps'), '6.1f'):>6} {fmt(g('bwd_nc_frac'), '5.2f'):>5} | "
            f"{fmt(g('fwd_err'), '7.0e'):>7}/{fmt(g('bwd_err'), '7.0e'):>7}")
    if r.get("skipped_parts"):
        line += "  (over budget: " + ", ".join(r["skipped_parts"]) + ")"
    print(line, file=out, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="bf16, D=1536, L in {4,17,33}, 65536 tokens only")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for torch and attnres (default: all cores)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per measurement (median)")
    ap.add_argument("--max-gb", type=float, default=8.0,
                    help="skip measurements whose estimated RAM exceeds this many GB")
    ap.add_argument("--overhead-calls", type=int, default=2000)
    ap.add_argument("--cli", default=None, help="the attnres tool, for the C++ forward row "
                    "(default: build/attnres or build-cpu/attnres when present)")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the per-call table (no bandwidth, no shapes)")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--dtypes", default=None, help="comma list from bf16,fp32")
    ap.add_argument("--dims", default=None, help="comma list of D")
    ap.add_argument("--sources", default=None, help="comma list of L")
    ap.add_argument("--tokens", default=None, help="comma list of B*T")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    attnres.set_num_threads(args.threads)
    log = sys.stderr if args.json else sys.stdout

    def ints(s, default):
        return tuple(int(x) for x in s.split(",")) if s else default

    if args.quick:
        dtypes, dims, sources, tokens = ("bf16",), (1536,), (4, 17, 33), (65536,)
    else:
        dtypes, dims, sources, tokens = ("bf16", "fp32"), FULL_DIMS, FULL_SOURCES, FULL_TOKENS
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else dtypes
    dims, sources, tokens = ints(args.dims, dims), ints(args.sources, sources), ints(args.tokens, tokens)

    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_start": os.getloadavg()},
        "torch": torch.__version__, "attnres": attnres.__version__, "isa": attnres.cpu_isa(),
        "threads": {"torch": torch.get_num_threads(), "attnres": attnres.get_num_threads()},
        "repeat": args.repeat, "max_gb": args.max_gb,
    }
    print(f"attnres {attnres.__version__} ({attnres.cpu_isa()}), torch {torch.__version__}, "
          f"threads torch={torch.get_num_threads()} attnres={attnres.get_num_threads()}, "
          f"repeat={args.repeat} (median after 1 warm-up), load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=log)

    if args.overhead_only:
        args.no_stream, args.no_overhead = True, False
        dtypes = ()
    stream = None
    if not args.no_stream:
        stream = stream_bandwidth(args.repeat)
        report["stream"] = stream
        print(f"stream: read {stream['read_GBps']:.1f} GB/s, copy {stream['copy_GBps']:.1f} GB/s "
              f"({stream['buffer_MiB']} MiB fp32 buffers)", file=log)
    if dtypes:
        print("x = eager ms / attnres ms; GB/s from minimal bytes; frac = GB/s / stream "
              "(read for fwd, copy for bwd); bwd-nc = the backward without caches\n",
              file=log)

    rows = []
    max_bytes = int(args.max_gb * 1e9)
    if dtypes:
        print_header(log)
    for dt in dtypes:
        for tk in tokens:
            for d in dims:
                for L in sources:
                    row = bench_shape(tk, d, L, dt, args.repeat, max_bytes, stream)
                    rows.append(row)
                    print_row(row, log)
    report["results"] = rows
    skipped = [r for r in rows if "skipped" in r or r.get("skipped_parts")]
    if skipped:
        print("\nskipped (estimated RAM over --max-gb "
              f"{args.max_gb:g}):", file=log)
        for r in skipped:
            parts = ["attnres_fwd", "attnres_bwd", "eager_fwd", "eager_bwd"] if "skipped" in r \
                else r["skipped_parts"]
            what = ", ".join(f"{k} ~{r['est_GB'][k]:.1f} GB" for k in parts)
            print(f"  {r['dtype']} tokens={r['tokens']} D={r['dim']} L={r['L']}: "
                  f"{'whole shape' if 'skipped' in r else 'partly'} ({what})", file=log)

    if not args.no_overhead:
        cli = args.cli
        if cli is None:
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            for build in ("build", "build-cpu"):
                candidate = os.path.join(here, build, "attnres")
                if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                    cli = candidate
                    break
        ov = bench_overhead(args.overhead_calls, cli, attnres.get_num_threads())
        report["overhead_us"] = dict(ov)
        print(f"\nper-call time, 1 token, L=10 (N=9 + partial), bf16 unless named, median of "
              f"{args.overhead_calls} calls:", file=log)
        for name, us in ov:
            print(f"  {name:56} {fmt(us, '8.2f'):>8} us", file=log)
        for line in overhead_goals(ov):
            print(f"  {line}", file=log)

    report["machine"]["loadavg_end"] = os.getloadavg()
    print(f"\nload avg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=log)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
