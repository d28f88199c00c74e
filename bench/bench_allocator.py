"""What fresh outputs cost from Python under each allocator setting, side by side.

Every call of the Python API returns new tensors (the output; in the backward one
gradient per source). With glibc's defaults a tensor of more than 32 MiB is a fresh
mmap, and the kernel zeroes each of its pages on first touch, inside the call, so
at large shapes the page faults can cost more than the kernel. This benchmark runs
the same measurement in one child process per setting (allocators are chosen at
process start):

  glibc default          nothing set
  glibc keeps memory     MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge> (freed
                         memory stays in the heap and is reused without faults)
  jemalloc / tcmalloc    LD_PRELOAD of Debian's libjemalloc2 / libtcmalloc-minimal4
                         (skipped when not installed)
  torch THP              THP_MEM_ALLOC_ENABLE=1 (torch asks for transparent huge
                         pages on every large CPU allocation)
  no attnres THP advice  ATTNRES_HUGEPAGES=0 (attnres' own madvise on its outputs off)

and reports, per setting, the medians of `block_attn_res_fn` forward and backward
(bf16 by default, D = 1536, L = 17, 16384 tokens) with the GB/s they move, and
torch's own `clone()` of a 512 MiB tensor (fresh output) against `copy_` into
memory already mapped (the ceiling).

    python3 bench/bench_allocator.py [--tokens N] [--repeat R] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

_LIBDIR = Path("/usr/lib") / f"{platform.machine()}-linux-gnu"
SETTINGS = [
    ("glibc default", {}),
    ("glibc keeps memory", {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 62)}),
    ("jemalloc", {"LD_PRELOAD": str(_LIBDIR / "libjemalloc.so.2")}),
    ("tcmalloc", {"LD_PRELOAD": str(_LIBDIR / "libtcmalloc_minimal.so.4")}),
    ("torch THP", {"THP_MEM_ALLOC_ENABLE": "1"}),
    ("no attnres THP advice", {"ATTNRES_HUGEPAGES": "0"}),
]


def measure(tokens: int, dim: int, sources: int, repeat: int, threads: int) -> dict:
    """One setting, in this process: medians in ms and the bytes each call moves."""
    import torch
    import block_attnres as attnres

    torch.set_num_threads(threads)
    attnres.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(tokens, dim, generator=gen).to(torch.bfloat16).requires_grad_()
              for _ in range(sources - 1)]
    partial = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(dim, generator=gen) / dim ** 0.5).to(torch.bfloat16).requires_grad_()
    gamma = torch.ones(dim, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)

    forward, backward = [], []
    for i in range(repeat + 1):  # the first is a warm-up
        start = time.perf_counter()
        h = attnres.block_attn_res_fn(blocks, partial, w, gamma)
        middle = time.perf_counter()
        grads = torch.autograd.grad(h, [*blocks, partial, w, gamma], grad)
        end = time.perf_counter()
        del h, grads
        if i:
            forward.append((middle - start) * 1e3)
            backward.append((end - middle) * 1e3)

    big = torch.randn(128 << 20)  # 512 MiB of fp32
    into = torch.empty_like(big)
    into.copy_(big)  # map it once
    clone, copy = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        fresh = big.clone()
        clone.append(time.perf_counter() - start)
        del fresh
        start = time.perf_counter()
        into.copy_(big)
        copy.append(time.perf_counter() - start)
    row_bytes = tokens * dim * 2
    return {
        "fwd_ms": statistics.median(forward),
        "bwd_ms": statistics.median(backward),
        # forward: read L sources, write h; backward: read g and L sources, write L grads
        "fwd_bytes": (sources + 1) * row_bytes,
        "bwd_bytes": (2 * sources + 1) * row_bytes,
        "clone_gbs": 2 * big.nbytes / statistics.median(clone) / 1e9,
        "copy_gbs": 2 * big.nbytes / statistics.median(copy) / 1e9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--sources", type=int, default=17, help="L (the last is the partial block)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.tokens, args.dim, args.sources, args.repeat, args.threads)
    if args.child:
        print(json.dumps(measure(*shape)))
        return 0

    rows = []
    for name, env in SETTINGS:
        preload = env.get("LD_PRELOAD")
        if preload and not Path(preload).exists():
            rows.append({"setting": name, "skipped": f"{preload} not installed"})
            continue
        child = subprocess.run(
            [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--dim",
             str(args.dim), "--sources", str(args.sources), "--repeat", str(args.repeat),
             "--threads", str(args.threads)],
            env={**os.environ, **env}, capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"{name}: the measurement failed:\n{child.stderr}")
        rows.append({"setting": name, "env": env, **json.loads(child.stdout.splitlines()[-1])})

    if args.json:
        print(json.dumps({"tokens": args.tokens, "dim": args.dim, "sources": args.sources,
                          "threads": args.threads, "rows": rows}, indent=1))
        return 0
    print(f"block_attn_res_fn bf16, {args.tokens} tokens, D = {args.dim}, L = {args.sources}, "
          f"{args.threads} threads, median of {args.repeat}; torch clone()/copy_ of 512 MiB fp32")
    print(f"{'setting':24s} {'fwd ms':>8s} {'GB/s':>6s} {'bwd ms':>8s} {'GB/s':>6s} "
          f"{'clone GB/s':>10s} {'copy_ GB/s':>10s}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['setting']:24s} skipped: {r['skipped']}")
            continue
        print(f"{r['setting']:24s} {r['fwd_ms']:8.1f} {r['fwd_bytes'] / r['fwd_ms'] / 1e6:6.1f} "
              f"{r['bwd_ms']:8.1f} {r['bwd_bytes'] / r['bwd_ms'] / 1e6:6.1f} "
              f"{r['clone_gbs']:10.1f} {r['copy_gbs']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
