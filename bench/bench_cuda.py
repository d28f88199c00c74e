#!/usr/bin/env python3
"""GPU benchmark of attnres (SPEC §4) against PyTorch eager, torch.compile and,
when importable, Liger-Kernel's attn_res, side by side in one process.

attnres is called through its C ABI (ctypes on libattnres.so, device = CUDA,
stream = torch's current stream), so the benchmark needs only torch and the
built library, not the Python package.

Minimal bytes per token (bf16 = 2 bytes per element):
  forward : reads L*D, writes D
  backward: reads L*D + D (sources, grad_out), writes L*D (one grad per source)
Effective bandwidth = minimal bytes / time, reported as a fraction of the
device's streaming bandwidth measured in the same run: a read-only stream for
the forward, a device-to-device copy (read + write) for the backward.

Also per shape: the pipelined kernels (ATTNRES_CUDA_FORWARD_PIPELINE=1,
ATTNRES_CUDA_BACKWARD_PIPELINE=1) against the register ones, medians of three
alternated timings each, and whether both gave the same bits (h; the first and
last source gradients, dw, dgamma); the backward without dw/dgamma (what the weight gradients' fixed
per-chunk partial rows and their reduction cost), and the host time of one call
(argument checks, including one cudaPointerGetAttributes per pointer, and the
launches), measured without synchronising.

Prints one JSON document on stdout; progress goes to stderr.
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time

import torch

DTYPES = {"bf16": (torch.bfloat16, 2), "f16": (torch.float16, 3), "f32": (torch.float32, 0)}


# --- The C ABI ------------------------------------------------------------------
# The ctypes mirror of attnres_params lives in the package (python/block_attnres/_native.py);
# run with PYTHONPATH=python (scripts/gpu_check.sh does) so that no installed
# package is needed. _native loads the library named by ATTNRES_LIBRARY.
Params = None  # bound in main() once --lib is known
ABI_VERSION = None


class Native:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for name in ("attnres_forward", "attnres_backward"):
            getattr(self.lib, name).argtypes = [ctypes.POINTER(Params)]
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.attnres_params_init.argtypes = [ctypes.POINTER(Params)]
        self.lib.attnres_last_error.restype = ctypes.c_char_p
        self.lib.attnres_cuda_available.restype = ctypes.c_int
        probe = Params()
        self.lib.attnres_params_init(ctypes.byref(probe))
        if probe.abi_version != ABI_VERSION:
            raise RuntimeError(f"libattnres ABI {probe.abi_version}, the Python mirror is ABI {ABI_VERSION}")

    def params(self, blocks, partial, w, gamma, dtype_code):
        p = Params()
        self.lib.attnres_params_init(ctypes.byref(p))
        x = partial if partial is not None else blocks[0]
        p.num_tokens, p.dim = x.shape[0], x.shape[1]
        p.num_blocks = len(blocks)
        p.dtype = dtype_code
        p.device = 1
        p.stream = torch.cuda.current_stream().cuda_stream
        block_ptrs = (ctypes.c_void_p * max(1, len(blocks)))(*[b.data_ptr() for b in blocks])
        p.blocks = block_ptrs
        p.keep_alive = [block_ptrs]
        p.partial = partial.data_ptr() if partial is not None else None
        p.source_row_stride = x.stride(0)
        p.proj_weight = w.data_ptr()
        p.gamma = gamma.data_ptr()
        return p

    def check(self, status):
        if status != 0:
            raise RuntimeError(f"attnres status {status}: {self.lib.attnres_last_error().decode()}")


# --- The baseline: the seed's structure, written plainly in torch -----------
def reference_forward(blocks, partial, w, gamma, scale=1.0, eps=1e-6):
    """stack + RMSNorm + einsum + softmax + einsum, fp32 compute."""
    v = torch.stack(list(blocks) + ([partial] if partial is not None else []), dim=0)  # [L, T, D]
    vf = v.float()
    k = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    logits = torch.einsum("d,ltd->lt", w.float(), k) * scale
    alpha = logits.softmax(dim=0)
    return torch.einsum("lt,ltd->td", alpha, vf).to(v.dtype)


def liger_forward():
    """Liger-Kernel's attn_res forward, if this environment has one."""
    try:
        from liger_kernel.ops import attn_res as liger_attn_res  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    fn = getattr(liger_attn_res, "LigerAttnResFunction", None)
    if fn is None:
        return None

    def run(blocks, partial, w, gamma):
        return fn.apply(torch.stack(list(blocks) + [partial], dim=0), w, gamma)

    return run


# --- Timing ------------------------------------------------------------------
def time_cuda(fn, min_iters=3, min_seconds=0.15, max_iters=50):
    """Median milliseconds of fn() over CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    start_wall = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start_wall < min_seconds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def host_us(fn, calls=50):
    """Median host microseconds of one enqueueing call (no synchronisation inside)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def pipelined_vs_register(knob, call, outputs):
    """Times `call` with the pipelined kernels (environment `knob` = 1: rows through a ring
    of asynchronous copies in shared memory) and with the register ones (0), alternated
    so both see the same device state: the medians of three timings each, and whether
    both left the same bits in `outputs`."""
    os.environ[knob] = "0"
    call()
    expected = [t.clone() for t in outputs]
    pipelined, register = [], []
    for _ in range(3):
        os.environ[knob] = "1"
        pipelined.append(time_cuda(call))
        os.environ[knob] = "0"
        register.append(time_cuda(call))
    os.environ[knob] = "1"
    call()
    torch.cuda.synchronize()
    os.environ[knob] = "0"
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outputs, expected))
    return sorted(pipelined)[1], sorted(register)[1], same


def stream_bandwidth(num_bytes=4 << 30):
    """Bytes/s of a read-only pass (sum) and of a DtoD copy (read + write)."""
    n = num_bytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = time_cuda(lambda: dst.copy_(src))
    out = torch.empty((), dtype=torch.float32, device="cuda")
    read_ms = time_cuda(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out))
    del src, dst
    torch.cuda.empty_cache()
    return {"read_GBps": num_bytes / read_ms / 1e6, "copy_GBps": 2 * num_bytes / copy_ms / 1e6}


def two_phase_rows(args, torch_dtype, elem, bw):
    """SPEC section 5 on the device, through the package's entry points (no autograd):
    phase 1 of S queries over N blocks, and one sub-layer's phase 2 (partial block on,
    input RMSNorm on), forward and backward, against the read / copy streams.

    Minimal bytes per token: phase 1 forward reads N*D, writes S*D (+ S fp32 LSEs);
    backward reads N*D + S*D (+ S LSE gradients), writes N*D. Phase 2 forward reads
    o, p, writes h (3*D); backward reads grad, o, p, writes grad_o, grad_p (5*D)."""
    from block_attnres.ops import phase1, phase2  # noqa: E402 - needs ATTNRES_LIBRARY set
    rows, T = [], args.two_phase_tokens
    for shape in args.two_phase.split(","):
        N, S, D = (int(x) for x in shape.split("x"))
        row = {"tokens": T, "blocks": N, "queries": S, "dim": D}
        rows.append(row)
        gen = torch.Generator(device="cuda").manual_seed(N * S + D)
        rand = lambda *sh, std=1.0: (torch.randn(*sh, device="cuda", generator=gen) * std  # noqa: E731
                                     ).to(torch_dtype)
        blocks = [rand(T, D) for _ in range(N)]
        w, gamma = rand(S, D, std=D ** -0.5), 1 + rand(S, D, std=0.1)
        attrs = (1e-6, 1.0, True)  # eps, scale, rmsnorm
        result = phase1.forward(blocks, w, gamma, *attrs)
        outs, lses = result[:S], result[S:]
        grad_outs = [rand(T, D) for _ in range(S)]
        grad_lses = [torch.randn(T, device="cuda", generator=gen) for _ in range(S)]
        ms = time_cuda(lambda: phase1.forward(blocks, w, gamma, *attrs))
        gbps = ((N + S) * D * elem + 4 * S) * T / ms / 1e6
        row["phase1_fwd_ms"], row["phase1_fwd_frac_of_read_bw"] = ms, gbps / bw["read_GBps"]
        ms = time_cuda(lambda: phase1.gradients("phase1", grad_outs, grad_lses, blocks, w, gamma,
                                                *attrs))
        gbps = ((2 * N + S) * D * elem + 4 * S) * T / ms / 1e6
        row["phase1_bwd_ms"], row["phase1_bwd_frac_of_copy_bw"] = ms, gbps / bw["copy_GBps"]
        runs = [phase1.gradients("phase1", grad_outs, grad_lses, blocks, w, gamma, *attrs)[1:]
                for _ in range(2)]
        row["phase1_weight_grads_bitwise_equal"] = all(
            torch.equal(a, b) for a, b in zip(*runs))
        # Phase 2 of the last query with a partial block and the input RMSNorm.
        p, nw, grad = rand(T, D), 1 + rand(D, std=0.1), rand(T, D)
        attrs2 = (*attrs, True, 1e-6)  # then input_norm, norm_eps
        o, lse, wq, gq = outs[-1], lses[-1], w[-1], gamma[-1]
        ms = time_cuda(lambda: phase2.forward(o, lse, p, wq, gq, nw, *attrs2))
        gbps = (3 * D * elem + 4) * T / ms / 1e6
        row["phase2_fwd_ms"], row["phase2_fwd_frac_of_copy_bw"] = ms, gbps / bw["copy_GBps"]
        ms = time_cuda(lambda: phase2.gradients("phase2", grad, o, lse, p, wq, gq, nw, *attrs2))
        gbps = (5 * D * elem + 8) * T / ms / 1e6
        row["phase2_bwd_ms"], row["phase2_bwd_frac_of_copy_bw"] = ms, gbps / bw["copy_GBps"]
        print(json.dumps(row), file=sys.stderr)
        del blocks, result, outs, lses, grad_outs, grad_lses, runs
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="path to libattnres.so (built with CUDA)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--dims", default="1536,4096,16384",
                    help="16384: the wide-row fused kernels (bf16/fp16; fp32 rows past 4096)")
    ap.add_argument("--sources", default="9,17,33", help="L values (N blocks + the partial block)")
    ap.add_argument("--tokens", default="65536,262144")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="wall-clock budget: baselines are skipped once it is spent")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--two-phase", default="9x6x2304,16x8x7168",
                    help="phase 1 / phase 2 shapes NxSxD (N blocks, S queries), comma separated")
    ap.add_argument("--two-phase-tokens", type=int, default=65536)
    ap.add_argument("--no-two-phase", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    global Params, ABI_VERSION
    os.environ["ATTNRES_LIBRARY"] = args.lib
    # Importing _native also checks its mirror of attnres_params against the library.
    from block_attnres._native import _Params as Params, _ABI_VERSION as ABI_VERSION  # noqa: E402
    native = Native(args.lib)
    if not native.lib.attnres_cuda_available():
        print(json.dumps({"error": "attnres_cuda_available() == 0"}))
        return 1
    torch_dtype, dtype_code = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    props = torch.cuda.get_device_properties(0)
    bw = stream_bandwidth()
    print(f"stream bandwidth: {bw}", file=sys.stderr)
    compiled = None if args.no_compile else torch.compile(reference_forward, dynamic=False)
    liger = liger_forward()
    report = {
        "device": props.name,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "bandwidth": bw,
        "liger": "available" if liger else "not importable",
        "results": [],
    }

    def over_budget():
        return time.perf_counter() - t0 > args.budget_s

    for T in [int(x) for x in args.tokens.split(",")]:
        for D in [int(x) for x in args.dims.split(",")]:
            for L in [int(x) for x in args.sources.split(",")]:
                row = {"tokens": T, "dim": D, "sources": L}
                report["results"].append(row)
                free, _ = torch.cuda.mem_get_info()
                # Sources + their grads + out + grad_out, with headroom.
                need = (2 * L + 2) * T * D * elem
                if need > 0.9 * free:
                    row["skipped"] = f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                    print(f"T={T} D={D} L={L}: {row['skipped']}", file=sys.stderr)
                    continue
                gen = torch.Generator(device="cuda").manual_seed(T + D + L)
                blocks = [torch.randn(T, D, device="cuda", dtype=torch_dtype, generator=gen) for _ in range(L - 1)]
                partial = torch.randn(T, D, device="cuda", dtype=torch_dtype, generator=gen)
                w = (torch.randn(D, device="cuda", generator=gen) / math.sqrt(D)).to(torch_dtype)
                gamma = (1 + 0.1 * torch.randn(D, device="cuda", generator=gen)).to(torch_dtype)
                grad_out = torch.randn(T, D, device="cuda", dtype=torch_dtype, generator=gen)
                out = torch.empty(T, D, device="cuda", dtype=torch_dtype)
                grads = [torch.empty_like(partial) for _ in range(L)]
                dw = torch.empty_like(w)
                dgamma = torch.empty_like(gamma)

                p = native.params(blocks, partial, w, gamma, dtype_code)
                p.out, p.out_row_stride = out.data_ptr(), out.stride(0)
                fwd = lambda: native.check(native.lib.attnres_forward(ctypes.byref(p)))  # noqa: E731
                q = native.params(blocks, partial, w, gamma, dtype_code)
                grad_ptrs = (ctypes.c_void_p * max(1, L - 1))(*[g.data_ptr() for g in grads[:-1]])
                q.grad_out, q.grad_out_row_stride = grad_out.data_ptr(), grad_out.stride(0)
                q.grad_blocks, q.grad_partial = grad_ptrs, grads[-1].data_ptr()
                q.keep_alive.append(grad_ptrs)
                q.grad_source_row_stride = grads[0].stride(0)
                q.grad_proj_weight, q.grad_gamma = dw.data_ptr(), dgamma.data_ptr()
                bwd = lambda: native.check(native.lib.attnres_backward(ctypes.byref(q)))  # noqa: E731

                fwd_bytes = (L + 1) * T * D * elem
                bwd_bytes = (2 * L + 1) * T * D * elem
                ms = time_cuda(fwd)
                row["attnres_fwd_ms"] = ms
                row["attnres_fwd_GBps"] = fwd_bytes / ms / 1e6
                row["attnres_fwd_frac_of_read_bw"] = row["attnres_fwd_GBps"] / bw["read_GBps"]
                ms, reg_ms, same = pipelined_vs_register("ATTNRES_CUDA_FORWARD_PIPELINE", fwd, [out])
                row["pipelined_fwd_ms"] = ms
                row["pipelined_fwd_frac_of_read_bw"] = fwd_bytes / ms / 1e6 / bw["read_GBps"]
                row["speedup_pipelined_vs_register_fwd"] = reg_ms / ms
                row["pipelined_fwd_bits_equal"] = same
                ms = time_cuda(bwd)
                row["attnres_bwd_ms"] = ms
                row["attnres_bwd_GBps"] = bwd_bytes / ms / 1e6
                row["attnres_bwd_frac_of_copy_bw"] = row["attnres_bwd_GBps"] / bw["copy_GBps"]
                ms, reg_ms, same = pipelined_vs_register("ATTNRES_CUDA_BACKWARD_PIPELINE", bwd,
                                                         [grads[0], grads[-1], dw, dgamma])
                row["pipelined_bwd_ms"] = ms
                row["pipelined_bwd_frac_of_copy_bw"] = bwd_bytes / ms / 1e6 / bw["copy_GBps"]
                row["speedup_pipelined_vs_register_bwd"] = reg_ms / ms
                row["pipelined_bwd_bits_equal"] = same
                # The same backward without dw/dgamma: no partial rows, no reduction.
                q.grad_proj_weight, q.grad_gamma = None, None
                row["attnres_bwd_no_weight_grads_ms"] = time_cuda(bwd)
                q.grad_proj_weight, q.grad_gamma = dw.data_ptr(), dgamma.data_ptr()
                row["host_us_per_call"] = {"fwd": host_us(fwd), "bwd": host_us(bwd)}

                # Sanity: attnres agrees with the baseline on a slice of tokens.
                with torch.no_grad():
                    sl = slice(0, min(T, 4096))
                    ref = reference_forward([b[sl] for b in blocks], partial[sl], w, gamma)
                    fwd()
                    err = ((out[sl].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    row["max_rel_err_vs_eager"] = err

                baselines = [("eager", reference_forward)]
                if compiled is not None:
                    baselines.append(("compile", compiled))
                if liger is not None:
                    baselines.append(("liger", liger))
                for name, fn in baselines:
                    if over_budget():
                        row[f"{name}_skipped"] = "time budget spent"
                        continue
                    # Eager materialises the stack plus ~3 fp32 copies of it.
                    if (L * T * D * (elem + 12) + need) > 0.9 * free:
                        row[f"{name}_skipped"] = "would not fit in device memory"
                        continue
                    try:
                        with torch.no_grad():
                            ms = time_cuda(lambda: fn(blocks, partial, w, gamma), min_iters=2, min_seconds=0.05)
                        row[f"{name}_fwd_ms"] = ms
                        row[f"speedup_fwd_vs_{name}"] = ms / row["attnres_fwd_ms"]
                        leaves = [t.detach().requires_grad_() for t in blocks + [partial, w, gamma]]
                        h = fn(leaves[: L - 1], leaves[L - 1], leaves[L], leaves[L + 1])
                        ms = time_cuda(lambda: torch.autograd.grad(h, leaves, grad_out, retain_graph=True),
                                       min_iters=2, min_seconds=0.05)
                        row[f"{name}_bwd_ms"] = ms
                        row[f"speedup_bwd_vs_{name}"] = ms / row["attnres_bwd_ms"]
                        del h, leaves
                    except torch.cuda.OutOfMemoryError:
                        row[f"{name}_skipped"] = "out of memory"
                    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                    torch.cuda.empty_cache()
                print(json.dumps(row), file=sys.stderr)
                del blocks, partial, grads, out, grad_out
                torch.cuda.empty_cache()
    if not args.no_two_phase:
        report["two_phase"] = two_phase_rows(args, torch_dtype, elem, bw)
    report["wall_s"] = time.perf_counter() - t0
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
