"""Phase 2 alone, for A/B timing of two builds: one sub-layer's merge with the partial
block and the input norm (the stream's configuration), forward without autograd and
forward + backward through autograd, median of --repeat alternated runs, with the
bytes moved and the read bandwidth this process measures (bench_torch's
stream_bandwidth). Point PYTHONPATH at another build's package to time that one, and
alternate the two processes:

    for i in 1 2 3; do python3 bench/phase2_step.py; PYTHONPATH=/tmp/old python3 bench/phase2_step.py; done
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import block_attnres as attnres
from bench_torch import stream_bandwidth, time_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    rows = lambda: torch.randn(args.tokens, args.dim, generator=gen).to(dtype).requires_grad_()
    o, p = rows(), rows()
    lse = torch.randn(args.tokens, generator=gen).requires_grad_()
    w = (0.02 * torch.randn(args.dim, generator=gen)).to(dtype).requires_grad_()
    gamma, nw = (torch.ones(args.dim, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(args.tokens, args.dim, generator=gen).to(dtype)
    kw = dict(norm_weight=nw, input_norm=True)

    def forward():
        with torch.no_grad():
            attnres.block_attn_res_phase2(o, lse, p, w, gamma, **kw)

    def forward_backward():
        x = attnres.block_attn_res_phase2(o, lse, p, w, gamma, **kw)
        torch.autograd.backward(x, grad)
        for t in (o, lse, p, w, gamma, nw):
            t.grad = None

    read_gbps = stream_bandwidth(5, mib=256)["read_GBps"]
    fwd, both = [], []
    for _ in range(args.repeat):  # alternated: drift hits both alike
        fwd.append(time_ms(forward, 1, warmup=0))
        both.append(time_ms(forward_backward, 1, warmup=0))
    row = args.tokens * args.dim * o.element_size()
    fwd_ms, both_ms = statistics.median(fwd), statistics.median(both)
    # Forward rows: o, p in, x out. Backward: o, p, g in, do, dp out (h recomputed).
    print(f"{os.path.dirname(attnres.__file__)}: {args.dtype} D={args.dim} T={args.tokens}: "
          f"forward {fwd_ms:.2f} ms ({3 * row / fwd_ms / 1e6:.1f} GB/s), forward+backward "
          f"{both_ms:.2f} ms ({8 * row / both_ms / 1e6:.1f} GB/s); read stream "
          f"{read_gbps:.1f} GB/s")


if __name__ == "__main__":
    main()
