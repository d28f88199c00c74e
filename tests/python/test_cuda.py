"""The Python front ends on CUDA tensors (SPEC section 3 tolerances), run by
scripts/gpu_check.sh on a GPU machine.

Every public entry point (the seed API, block_attn_res_fn and its module, the custom
ops under opcheck and torch.compile, the two phases, the stream) is fed CUDA tensors
and held to the float64 oracle of the CPU tests, its weight gradients to bitwise
reruns, and its errors to the same messages as on the CPU.

Without a CUDA device and a CUDA build of libattnres the module is skipped, unless
ATTNRES_EXPECT_CUDA=1 (set by gpu_check.sh when nvidia-smi lists a GPU), which turns
the skip into a failure. ATTNRES_CUDA_TEST_DEVICE=cpu runs the same tests on the CPU,
to check the tests themselves on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import block_attnres as attnres
from block_attnres import block_attn_res_fn, block_attn_res_phase1, block_attn_res_phase2
from block_attnres.nn import BlockAttnRes, BlockAttnResStream
from model_reference import reference_block_attn_res
from torch_reference import TOLERANCE, reference_phase1, reference_phase2, rel_err

F64 = torch.float64
DEVICE = os.environ.get("ATTNRES_CUDA_TEST_DEVICE", "cuda")
HAVE_DEVICE = DEVICE == "cpu" or (torch.cuda.is_available() and attnres.cuda_available())


def test_cuda_is_present_when_expected():
    if os.environ.get("ATTNRES_EXPECT_CUDA") == "1":
        assert torch.cuda.is_available(), "a GPU is listed but torch sees no CUDA device"
        assert attnres.cuda_available(), "libattnres was built without CUDA or sees no device"


pytestmark = pytest.mark.skipif(
    not HAVE_DEVICE and os.environ.get("ATTNRES_EXPECT_CUDA") != "1",
    reason="needs a CUDA device and libattnres built with ATTNRES_CUDA=ON")

# SPEC section 3: (output, gradients) relative to max|reference|.
TOL = {d: TOLERANCE[d][:2] for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
DTYPES = list(TOL)
DTYPE_IDS = ["f64", "f32", "bf16", "f16"]


def randn(gen, *shape, std=1.0, dtype=F64):
    """Drawn on the CPU (the same values on every device), rounded once to dtype."""
    return (torch.randn(*shape, generator=gen, dtype=F64) * std).to(dtype).to(DEVICE)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def f64_leaves(*tensors):
    return [None if t is None else t.detach().to(F64).requires_grad_() for t in tensors]


def assert_close(name, actual, ref, tol):
    assert actual.device.type == torch.device(DEVICE).type, name
    err = rel_err(actual.cpu(), ref.cpu())
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


# (B, T, D, N blocks, partial, rmsnorm, scale): L = 1, odd D, D past the fused
# kernels' widest rows on some dtypes, many sources, tokens of several CTAs.
CASES = [
    (1, 1, 64, 1, False, True, 1.0),
    (1, 3, 7, 1, True, True, 0.5),
    (2, 3, 1031, 9, True, True, 0.7),
    (1, 37, 1536, 16, True, False, 1.3),
    (1, 5, 7168, 3, True, True, 1.0),
    (1, 2, 20000, 2, False, True, 1.0),
    (1, 4, 96, 130, True, True, 2.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}D{}N{}{}{}s{}".format(
    c[0], c[1], c[2], c[3], "p" if c[4] else "", "r" if c[5] else "", c[6]))
def test_fn_forward_and_gradients_match_the_oracle(case, dtype):
    B, T, D, N, partial, rmsnorm, scale = case
    gen = torch.Generator().manual_seed(D * 31 + N)
    blocks = [randn(gen, B, T, D, std=0.5 + i / max(N - 1, 1), dtype=dtype) for i in range(N)]
    p = randn(gen, B, T, D, std=0.8, dtype=dtype) if partial else None
    w = randn(gen, D, std=D ** -0.5, dtype=dtype)
    g = (1 + 0.3 * randn(gen, D)).to(dtype)
    grad_h = randn(gen, B, T, D, dtype=dtype)
    ours = leaves(*blocks, p, w, g)
    ref = f64_leaves(*blocks, p, w, g)
    h = block_attn_res_fn(ours[:N], ours[N], ours[N + 1], ours[N + 2], scale=scale,
                          rmsnorm=rmsnorm)
    h_ref = reference_block_attn_res(ref[:N], ref[N], ref[N + 1], ref[N + 2], scale=scale,
                                     rmsnorm=rmsnorm)
    fwd_tol, grad_tol = TOL[dtype]
    assert h.dtype == dtype
    assert_close("h", h, h_ref, fwd_tol)
    h.backward(grad_h)
    h_ref.backward(grad_h.to(F64))
    for i, (t, r) in enumerate(zip(ours, ref)):
        if t is None or (i == N + 2 and not rmsnorm):
            continue
        assert_close(f"grad {i}", t.grad, r.grad, grad_tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_weight_gradients_are_bitwise_reproducible(dtype):
    """dw and dgamma sum over every token through fixed per-chunk partial rows: two
    runs over 8192 tokens (many CTAs) give the same bits, as do the block gradients."""
    gen = torch.Generator().manual_seed(5)
    D, N = 1536, 16
    blocks = [randn(gen, 8192, D, dtype=dtype) for _ in range(N)]
    p, w, g = randn(gen, 8192, D, dtype=dtype), randn(gen, D, std=0.03, dtype=dtype), \
        (1 + 0.2 * randn(gen, D)).to(dtype)
    grad_h = randn(gen, 8192, D, dtype=dtype)
    runs = []
    for _ in range(2):
        ins = leaves(*blocks, p, w, g)
        block_attn_res_fn(ins[:N], ins[N], ins[N + 1], ins[N + 2]).backward(grad_h)
        runs.append([t.grad for t in ins])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"gradient {i} differs between runs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_pipelined_kernels_give_the_same_bits(dtype, monkeypatch):
    """ATTNRES_CUDA_FORWARD_PIPELINE=1 / ATTNRES_CUDA_BACKWARD_PIPELINE=1 (read per call)
    send aligned calls to the pipelined kernels: h and every gradient bit for bit as
    the register kernels give them (on the CPU the knobs change nothing)."""
    gen = torch.Generator().manual_seed(11)
    D, N, T = 1536, 8, 3000
    blocks = [randn(gen, T, D, dtype=dtype) for _ in range(N)]
    p, w, g = randn(gen, T, D, dtype=dtype), randn(gen, D, std=0.03, dtype=dtype), \
        (1 + 0.2 * randn(gen, D)).to(dtype)
    grad_h = randn(gen, T, D, dtype=dtype)
    runs = []
    for knob in ("0", "1"):
        monkeypatch.setenv("ATTNRES_CUDA_FORWARD_PIPELINE", knob)
        monkeypatch.setenv("ATTNRES_CUDA_BACKWARD_PIPELINE", knob)
        ins = leaves(*blocks, p, w, g)
        h = block_attn_res_fn(ins[:N], ins[N], ins[N + 1], ins[N + 2])
        h.backward(grad_h)
        runs.append([h.detach()] + [t.grad for t in ins])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"output {i} (0: h) differs between the kernels"


def test_seed_api_with_caches_matches_the_cpu():
    gen = torch.Generator().manual_seed(3)
    B, T, D, N = 2, 5, 300, 4
    blocks = [randn(gen, B, T, D, dtype=torch.float32) for _ in range(N)]
    p, w, g = randn(gen, B, T, D, dtype=torch.float32), randn(gen, D, std=0.05,
                                                              dtype=torch.float32), \
        (1 + 0.3 * randn(gen, D)).to(torch.float32)
    grad_h = randn(gen, B, T, D, dtype=torch.float32)
    outs = {}
    for where in (DEVICE, "cpu"):
        move = [t.to(where) for t in (*blocks, p, w, g, grad_h)]
        h, rms, alpha = attnres.block_attn_res(move[:N], move[N + 1], move[N], 0.5, 1e-6,
                                               move[N + 2], True, True, True)
        grads = attnres.block_attn_res_backward(move[N + 3], move[:N], move[N + 1], alpha,
                                                move[N], move[N + 2], rms, 0.5, True)
        outs[where] = [h, rms, alpha, *[t for t in _flatten(grads) if t is not None]]
    assert all(t.device.type == torch.device(DEVICE).type for t in outs[DEVICE])
    for i, (a, b) in enumerate(zip(outs[DEVICE], outs["cpu"])):
        assert_close(f"seed output {i}", a, b, 1e-5)


def _flatten(items):
    for x in items:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def test_module_and_compile_fullgraph_match_eager():
    torch.manual_seed(0)
    D = 256
    mod = BlockAttnRes(D).to(DEVICE)
    with torch.no_grad():
        mod.w.normal_(0, 0.1)
    blocks = [torch.randn(2, 9, D, device=DEVICE) for _ in range(5)]
    p = torch.randn(2, 9, D, device=DEVICE)
    eager = mod(blocks, p)
    compiled = torch.compile(mod, fullgraph=True)(blocks, p)
    assert torch.equal(eager, compiled)
    ref = reference_block_attn_res([b.double() for b in blocks], p.double(), mod.w.double(),
                                   mod.gamma.double())
    assert_close("module", eager, ref, 1e-5)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_opcheck_on_the_device(requires_grad):
    gen = torch.Generator().manual_seed(7)
    blocks = [randn(gen, 2, 3, 40, dtype=torch.float32).requires_grad_(requires_grad)
              for _ in range(3)]
    p = randn(gen, 2, 3, 40, dtype=torch.float32).requires_grad_(requires_grad)
    w = randn(gen, 40, std=0.2, dtype=torch.float32).requires_grad_(requires_grad)
    g = (1 + 0.3 * randn(gen, 40, dtype=torch.float32)).requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.attnres.block_attn_res.default,
                          (blocks, p, w, g, 1e-6, 0.5, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("S,N,D", [(1, 1, 64), (6, 9, 2304), (40, 3, 1031)])
def test_two_phases_match_the_oracle(S, N, D, dtype):
    gen = torch.Generator().manual_seed(S * 100 + N)
    T = 33
    blocks = [randn(gen, T, D, std=0.5 + i / max(N - 1, 1), dtype=dtype) for i in range(N)]
    w, g = randn(gen, S, D, std=D ** -0.5, dtype=dtype), (1 + 0.3 * randn(gen, S, D)).to(dtype)
    ours, ref = leaves(*blocks, w, g), f64_leaves(*blocks, w, g)
    outs, lses = block_attn_res_phase1(ours[:N], ours[N], ours[N + 1], scale=0.8)
    outs_ref, lses_ref = reference_phase1(ref[:N], ref[N], ref[N + 1], 0.8, 1e-6, True)
    fwd_tol, grad_tol = TOL[dtype]
    for s in range(S):
        assert_close(f"out {s}", outs[s], outs_ref[s], fwd_tol)
        assert_close(f"lse {s}", lses[s], lses_ref[s], 1e-12 if dtype == F64 else 1e-5)
    # Phase 2 of the last query with a partial block, input RMSNorm on.
    p = leaves(randn(gen, T, D, std=0.8, dtype=dtype))[0]
    p_ref = f64_leaves(p)[0]
    nw = leaves((1 + 0.2 * randn(gen, D)).to(dtype))[0]
    nw_ref = f64_leaves(nw)[0]
    h = block_attn_res_phase2(outs[-1], lses[-1], p, ours[N][-1], ours[N + 1][-1],
                              scale=0.8, norm_weight=nw, input_norm=True)
    h_ref = reference_phase2(outs_ref[-1], lses_ref[-1], p_ref, ref[N][-1], ref[N + 1][-1],
                             0.8, 1e-6, True, nw_ref, True, 1e-6)
    assert_close("phase 2", h, h_ref, fwd_tol)
    grad = randn(gen, T, D, dtype=dtype)
    loss = (h.to(F64) * grad.to(F64)).sum() + sum((o.to(F64) ** 2).sum() for o in outs[:-1])
    loss_ref = (h_ref * grad.to(F64)).sum() + sum((o ** 2).sum() for o in outs_ref[:-1])
    loss.backward()
    loss_ref.backward()
    for i, (t, r) in enumerate(zip(ours + [p, nw], ref + [p_ref, nw_ref])):
        assert_close(f"grad {i}", t.grad, r.grad, grad_tol)


@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
def test_stream_on_the_device_matches_the_cpu(schedule):
    """float64 (a loss through the stream's input RMSNorms leaves dw the small
    difference of large terms: in fp32 even the CPU is 2% from float64 there)."""
    D, L, bs = 128, 7, 3
    torch.manual_seed(1)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(L)).to(F64)
    res = BlockAttnResStream(D, L, bs, input_norm=True, schedule=schedule, dtype=F64)
    with torch.no_grad():
        res.w.normal_(0, 0.3)
    x, probe = torch.randn(4, 16, D, dtype=F64), torch.randn(4, 16, D, dtype=F64)
    results = {}
    for where in (DEVICE, "cpu"):
        lay, r = [m.to(where) for m in (layers, res)]
        lay.zero_grad(set_to_none=True)
        r.zero_grad(set_to_none=True)
        out = r(x.to(where), list(lay))
        (out * probe.to(where)).sum().backward()
        results[where] = [out.detach().clone(), r.w.grad.clone(), r.gamma.grad.clone(),
                          r.norm_weight.grad.clone(), lay[0][0].weight.grad.clone()]
    for i, (a, b) in enumerate(zip(results[DEVICE], results["cpu"])):
        assert_close(f"stream tensor {i}", a, b, 1e-10)


def test_non_finite_stays_in_its_token():
    gen = torch.Generator().manual_seed(11)
    blocks = [randn(gen, 6, 512, dtype=torch.bfloat16) for _ in range(4)]
    blocks[2][3, 17] = float("nan")
    blocks[1][1, 5] = float("inf")
    w, g = randn(gen, 512, std=0.05, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16,
                                                                      device=DEVICE)
    h = block_attn_res_fn(blocks, None, w, g)
    bad = ~torch.isfinite(h.float()).all(dim=-1)
    assert bad[3] and bad[1]
    assert not bad[[0, 2, 4, 5]].any()


def test_mixed_devices_are_a_clear_error():
    if DEVICE == "cpu":
        pytest.skip("needs two devices")
    blocks = [torch.randn(2, 8, device=DEVICE) for _ in range(2)]
    with pytest.raises((ValueError, TypeError, RuntimeError), match="device"):
        block_attn_res_fn(blocks, None, torch.randn(8), torch.ones(8, device=DEVICE))
