#!/usr/bin/env python3
"""CPU time of the single op's forward and backward with one thread, for comparing two
builds on a machine shared with other work (wall time there measures the other work
too). Best of 5, after a warm-up. bf16, D = 1536, L = 17 (16 blocks + partial).

Usage: python3 bench/kernel_cpu_time.py LABEL [--tokens N]
       (ATTNRES_LIBRARY and PYTHONPATH select the build; alternate two builds' runs)
"""
import argparse
import time

import torch

import block_attnres as attnres
from block_attnres.ops import block_attn_res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    attnres.set_num_threads(1)
    torch.set_num_threads(1)
    tokens, dim, sources = args.tokens, 1536, 17
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(tokens, dim, generator=g).bfloat16() for _ in range(sources)]
    w = (0.05 * torch.randn(dim, generator=g)).bfloat16()
    gamma = torch.ones(dim).bfloat16()
    grad = torch.randn(tokens, dim, generator=g).bfloat16()
    args_ = (1e-6, 1.0, True)  # eps, scale, rmsnorm

    def best(fn, k=5):
        fn()
        times = []
        for _ in range(k):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times) * 1e3

    fwd = best(lambda: block_attn_res.forward(src[:-1], src[-1], w, gamma, *args_))
    bwd = best(lambda: block_attn_res.gradients("bench", grad, src[:-1], src[-1], w, gamma,
                                                *args_))
    print(f"{args.label}: forward {fwd:.1f} ms, backward {bwd:.1f} ms (CPU time, 1 thread)")


if __name__ == "__main__":
    main()
