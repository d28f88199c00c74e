"""The two-phase schedule (SPEC section 5) through attnres.block_attn_res_phase1 /
block_attn_res_phase2 and the ops torch.ops.attnres.phase1(_backward) /
phase2(_backward), held to SPEC section 3.

Oracles: plain float64 torch autograd of section 5 (torch_reference.reference_phase1 /
reference_phase2), and the single op of section 1 (model_reference.
reference_block_attn_res) for "phase 1 + phase 2 is the single op". The oracle is fed
the same (rounded) values as the op; errors are max|x - ref| / max|ref| (rel_err).
"""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
import torch.nn.functional as F

import block_attnres as attnres
from block_attnres import block_attn_res_phase1, block_attn_res_phase2
from block_attnres.ops import custom_op_calls
from model_reference import reference_block_attn_res
from torch_reference import TOLERANCE, reference_phase1, reference_phase2, rel_err

F64 = torch.float64
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
DTYPE_IDS = ["bf16", "f16", "f32", "f64"]

# SPEC section 3: (h, gradients). The LSEs are stored in the accumulation type
# (fp32; fp64 for fp64): held to fp32's output tolerance whatever the input dtype.
TOL = {d: t[:2] for d, t in TOLERANCE.items()}
LSE_TOL = {d: t[2] for d, t in TOLERANCE.items()}


def acc_dtype(dtype):
    return F64 if dtype == F64 else torch.float32


def randn(gen, *shape, mean=0.0, std=1.0, dtype=F64):
    """Drawn in float64, rounded once to dtype."""
    return (mean + std * torch.randn(*shape, generator=gen, dtype=F64)).to(dtype)


def leaf(t, dtype=None):
    t = t.detach().clone() if dtype is None else t.detach().to(dtype)
    return t.requires_grad_(True)


def assert_close_rel(name, actual, ref, tol):
    assert actual is not None, f"{name}: no gradient"
    err = rel_err(actual, ref)
    assert err <= tol, f"{name}: relative max error {err:.3g} > {tol:g}"


# ---------------------------------------------------------------------------------
# Phase 1 vs the oracle: every S in {1, 2, 6, 24} meets every N in {1, 2, 9, 33} once,
# D in {1, 7, 33, 130} spread over them (a Latin square), options varied alongside.
# ---------------------------------------------------------------------------------

def _phase1_cases():
    cases = []
    for i in range(16):
        cases.append(dict(
            S=(1, 2, 6, 24)[i % 4],
            N=(1, 2, 9, 33)[i // 4],
            D=(1, 7, 33, 130)[(i + i // 4) % 4],
            rmsnorm=i % 3 != 2,
            gamma=(i // 2) % 2 == 0,
            scale=(1.0, 0.37, 2.5)[i % 3],
            eps=(1e-6, 0.3)[(i // 3) % 2],
            lead=((2, 3), (5,), (1, 4), (3, 1, 2))[i % 4],
        ))
    return cases


PHASE1_CASES = _phase1_cases()


def _case_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items()).replace(" ", "")


def phase1_inputs(case, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    S, N, D, lead = case["S"], case["N"], case["D"], case["lead"]
    blocks = [randn(g, *lead, D, std=0.5 + 1.5 * i / max(N - 1, 1), dtype=dtype) for i in range(N)]
    w = randn(g, S, D, std=1 / math.sqrt(D), dtype=dtype)
    gamma = randn(g, S, D, mean=1.0, std=0.3, dtype=dtype) if case["gamma"] else None
    grad_outs = [randn(g, *lead, D, dtype=dtype) for _ in range(S)]
    grad_lses = [randn(g, *lead, dtype=acc_dtype(dtype)) for _ in range(S)]
    return blocks, w, gamma, grad_outs, grad_lses


def _used(S):
    """Which outputs enter the loss: some o_s and some lse_s are left out, so that
    phase 1's backward gets None (zero) gradients for them."""
    use_o = [not (s % 4 == 2) for s in range(S)]
    use_lse = [not (s % 3 == 1) for s in range(S)]
    return use_o, use_lse


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PHASE1_CASES, ids=_case_id)
def test_phase1_matches_oracle(case, dtype):
    blocks, w, gamma, grad_outs, grad_lses = phase1_inputs(case, dtype, seed=len(_case_id(case)))
    kw = dict(eps=case["eps"], scale=case["scale"], rmsnorm=case["rmsnorm"])
    tol_h, tol_g = TOL[dtype]
    S = case["S"]

    b = [leaf(x) for x in blocks]
    ww = leaf(w)
    gg = leaf(gamma) if gamma is not None else None
    outs, lses = block_attn_res_phase1(b, ww, gg, **kw)

    b64 = [leaf(x, F64) for x in blocks]
    w64 = leaf(w, F64)
    g64 = leaf(gamma, F64) if gamma is not None else None
    ref_outs, ref_lses = reference_phase1(b64, w64, g64, **kw)

    assert len(outs) == len(lses) == S
    for s in range(S):
        assert outs[s].dtype == dtype and outs[s].shape == blocks[0].shape
        assert lses[s].dtype == acc_dtype(dtype) and lses[s].shape == blocks[0].shape[:-1]
        assert_close_rel(f"o_{s}", outs[s], ref_outs[s], tol_h)
        assert_close_rel(f"lse_{s}", lses[s], ref_lses[s], LSE_TOL[dtype])

    use_o, use_lse = _used(S)
    tensors, grads, ref_tensors, ref_grads = [], [], [], []
    for s in range(S):
        if use_o[s]:
            tensors.append(outs[s]); grads.append(grad_outs[s])
            ref_tensors.append(ref_outs[s]); ref_grads.append(grad_outs[s].to(F64))
        if use_lse[s]:
            tensors.append(lses[s]); grads.append(grad_lses[s])
            ref_tensors.append(ref_lses[s]); ref_grads.append(grad_lses[s].to(F64))
    torch.autograd.backward(tensors, grads)
    torch.autograd.backward(ref_tensors, ref_grads)

    for i, (x, r) in enumerate(zip(b, b64)):
        assert x.grad.dtype == dtype
        assert_close_rel(f"dblocks[{i}]", x.grad, r.grad, tol_g)
    assert ww.grad.dtype == dtype and ww.grad.shape == (S, case["D"])
    assert_close_rel("dw", ww.grad, w64.grad, tol_g)
    if gg is not None:
        if case["rmsnorm"]:
            assert_close_rel("dgamma", gg.grad, g64.grad, tol_g)
        else:  # gamma plays no part without the RMSNorm
            assert gg.grad is None or not gg.grad.any()


# ---------------------------------------------------------------------------------
# Phase 2 vs the oracle: partial x input norm x keys, D cycling through {1, 7, 33, 130}.
# ---------------------------------------------------------------------------------

def _phase2_cases():
    cases, k = [], 0
    for partial in (True, False):
        for norm in ("off", "on", "weight"):          # input_norm off / on / with norm_weight
            for keys in ("gamma", "ones", "raw"):     # RMSNorm + gamma / RMSNorm / none (gamma given)
                D = (1, 7, 33, 130)[k % 4]
                cases.append(dict(
                    D=D, partial=partial, norm=norm, keys=keys,
                    scale=(1.0, 0.6, 1.7)[k % 3], eps=(1e-6, 0.25)[k % 2],
                    # D = 1 with the input norm: RMSNorm(h) = sign(h) * weight up to
                    # norm_eps, every gradient through it is pure cancellation; a large
                    # norm_eps keeps that case well conditioned.
                    norm_eps=0.5 if D == 1 else (1e-6, 0.1)[k % 2],
                ))
                k += 1
    return cases


PHASE2_CASES = _phase2_cases()


def phase2_inputs(case, dtype, seed, lead=(2, 3)):
    g = torch.Generator().manual_seed(seed)
    D = case["D"]
    out = randn(g, *lead, D, dtype=dtype)
    lse = randn(g, *lead, mean=0.5, dtype=acc_dtype(dtype))
    partial = randn(g, *lead, D, std=1.2, dtype=dtype) if case["partial"] else None
    w = randn(g, D, std=1 / math.sqrt(D), dtype=dtype)
    gamma = randn(g, D, mean=1.0, std=0.3, dtype=dtype) if case["keys"] != "ones" else None
    norm_weight = randn(g, D, mean=1.0, std=0.3, dtype=dtype) if case["norm"] == "weight" else None
    grad = randn(g, *lead, D, dtype=dtype)
    return out, lse, partial, w, gamma, norm_weight, grad


def phase2_kwargs(case):
    return dict(eps=case["eps"], scale=case["scale"], rmsnorm=case["keys"] != "raw",
                input_norm=case["norm"] != "off", norm_eps=case["norm_eps"])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PHASE2_CASES, ids=_case_id)
def test_phase2_matches_oracle(case, dtype):
    inputs = phase2_inputs(case, dtype, seed=len(_case_id(case)) + 7)
    out, lse, partial, w, gamma, norm_weight, grad = inputs
    kw = phase2_kwargs(case)
    tol_h, tol_g = TOL[dtype]

    names = ["out", "lse", "partial", "w", "gamma", "norm_weight"]
    xs = [None if t is None else leaf(t) for t in inputs[:6]]
    refs = [None if t is None else leaf(t, F64) for t in inputs[:6]]
    h = block_attn_res_phase2(*xs[:5], norm_weight=xs[5], **kw)
    h_ref = reference_phase2(*refs[:5], norm_weight=refs[5], **kw)
    assert h.dtype == dtype and h.shape == out.shape
    assert_close_rel("h", h, h_ref, tol_h)

    h.backward(grad)
    h_ref.backward(grad.to(F64))
    for name, x, r in zip(names, xs, refs):
        if x is None:
            continue
        if (name == "gamma" and not kw["rmsnorm"]) or r.grad is None:
            # Not part of the result (gamma without the RMSNorm; lse, w, gamma without
            # a partial block): no gradient, or zeros.
            assert x.grad is None or not x.grad.any(), f"d{name} should be zero"
            continue
        assert x.grad is not None, f"no gradient for {name}"
        assert x.grad.dtype == x.dtype
        assert_close_rel(f"d{name}", x.grad, r.grad, tol_g)


# ---------------------------------------------------------------------------------
# Phase 1 + phase 2 is the single op over [blocks..., partial] (SPEC section 5).
# ---------------------------------------------------------------------------------

COMPOSE_CASES = [
    dict(rmsnorm=True, gamma=True, input_norm=False, N=4, D=33, scale=1.0),
    dict(rmsnorm=True, gamma=False, input_norm=True, N=1, D=7, scale=0.5),
    dict(rmsnorm=False, gamma=False, input_norm=False, N=9, D=130, scale=1.5),
    dict(rmsnorm=True, gamma=True, input_norm=True, N=2, D=16, scale=2.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", COMPOSE_CASES, ids=_case_id)
def test_phases_compose_to_the_single_op(case, dtype):
    """S = 3 sub-layers of one block: the first has no partial block, the others do.
    Outputs and every gradient (blocks, partials, w, gamma, norm_weight) against the
    float64 single op on the same sources, SPEC section 3 tolerances."""
    g = torch.Generator().manual_seed(11)
    S, N, D, lead = 3, case["N"], case["D"], (2, 5)
    eps, scale, rmsnorm = 1e-6, case["scale"], case["rmsnorm"]
    blocks = [randn(g, *lead, D, std=0.5 + 0.4 * i, dtype=dtype) for i in range(N)]
    partials = [None] + [randn(g, *lead, D, dtype=dtype) for _ in range(S - 1)]
    w = randn(g, S, D, std=1 / math.sqrt(D), dtype=dtype)
    gamma = randn(g, S, D, mean=1.0, std=0.3, dtype=dtype) if case["gamma"] else None
    nw = randn(g, S, D, mean=1.0, std=0.3, dtype=dtype) if case["input_norm"] else None
    grads = [randn(g, *lead, D, dtype=dtype) for _ in range(S)]
    tol_h, tol_g = TOL[dtype]

    def run(blocks, partials, w, gamma, nw, native):
        hs = []
        if native:
            outs, lses = block_attn_res_phase1(blocks, w, gamma, eps=eps, scale=scale,
                                               rmsnorm=rmsnorm)
        for s in range(S):
            gs = gamma[s] if gamma is not None else None
            if native:
                h = block_attn_res_phase2(outs[s], lses[s], partials[s], w[s], gs, eps=eps,
                                          scale=scale, rmsnorm=rmsnorm,
                                          norm_weight=nw[s] if nw is not None else None,
                                          input_norm=case["input_norm"], norm_eps=1e-6)
            else:
                h = reference_block_attn_res(blocks, partials[s], w[s], gs, eps=eps,
                                             scale=scale, rmsnorm=rmsnorm)
                if case["input_norm"]:
                    h = F.rms_norm(h, (D,), weight=nw[s], eps=1e-6)
            hs.append(h)
        return hs

    def leaves(dt):
        conv = (lambda t: None if t is None else leaf(t, dt))
        return ([conv(b) for b in blocks], [conv(p) for p in partials], conv(w), conv(gamma),
                conv(nw))

    nat = leaves(dtype)
    ref = leaves(F64)
    hs = run(*nat, native=True)
    hs_ref = run(*ref, native=False)
    for s in range(S):
        assert hs[s].dtype == dtype
        assert_close_rel(f"h_{s}", hs[s], hs_ref[s], tol_h)
    torch.autograd.backward(hs, grads)
    torch.autograd.backward(hs_ref, [x.to(F64) for x in grads])
    for i in range(N):
        assert_close_rel(f"dblocks[{i}]", nat[0][i].grad, ref[0][i].grad, tol_g)
    for s in range(1, S):
        assert_close_rel(f"dpartial_{s}", nat[1][s].grad, ref[1][s].grad, tol_g)
    assert_close_rel("dw", nat[2].grad, ref[2].grad, tol_g)
    if gamma is not None:
        assert_close_rel("dgamma", nat[3].grad, ref[3].grad, tol_g)
    if nw is not None:
        assert_close_rel("dnorm_weight", nat[4].grad, ref[4].grad, tol_g)


# ---------------------------------------------------------------------------------
# Non-finite inputs and saturated logits (SPEC section 3).
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_phase1_non_finite_stays_in_its_token(bad, dtype):
    g = torch.Generator().manual_seed(5)
    lead, D, N, S = (3, 4), 9, 3, 2
    blocks = [randn(g, *lead, D, dtype=dtype) for _ in range(N)]
    w = randn(g, S, D, std=0.3, dtype=dtype)
    gamma = randn(g, S, D, mean=1.0, std=0.2, dtype=dtype)
    grad_outs = [randn(g, *lead, D, dtype=dtype) for _ in range(S)]
    grad_lses = [randn(g, *lead) .float() for _ in range(S)]
    dirty = [b.clone() for b in blocks]
    dirty[1][1, 2, 4] = bad
    results = []
    for src in (blocks, dirty):
        b = [leaf(x) for x in src]
        ww, gg = leaf(w), leaf(gamma)
        outs, lses = block_attn_res_phase1(b, ww, gg)
        torch.autograd.backward(outs + lses, grad_outs + grad_lses)
        results.append(([o.detach() for o in outs], [x.detach() for x in lses],
                        [x.grad for x in b]))
    (c_outs, c_lses, c_grads), (d_outs, d_lses, d_grads) = results
    others = torch.ones(lead, dtype=torch.bool)
    others[1, 2] = False
    for s in range(S):
        assert torch.equal(d_outs[s][others], c_outs[s][others]), f"o_{s}: other tokens changed"
        assert torch.equal(d_lses[s][others], c_lses[s][others]), f"lse_{s}: other tokens changed"
        assert not torch.isfinite(d_outs[s][1, 2]).all(), "the bad token's output is finite"
    for i in range(N):
        assert torch.equal(d_grads[i][others], c_grads[i][others]), f"dblocks[{i}]: other tokens changed"


@pytest.mark.parametrize("where", ["partial", "lse", "out"])
def test_phase2_non_finite_stays_in_its_token(where):
    g = torch.Generator().manual_seed(6)
    case = dict(D=11, partial=True, norm="weight", keys="gamma", scale=1.0, eps=1e-6,
                norm_eps=1e-6)
    inputs = list(phase2_inputs(case, torch.float32, seed=3, lead=(4, 3)))
    grad = inputs.pop()
    index = {"out": 0, "lse": 1, "partial": 2}[where]
    dirty = [None if t is None else t.clone() for t in inputs]
    if where == "lse":
        dirty[1][2, 1] = float("nan")
    else:
        dirty[index][2, 1, 5] = float("nan")
    results = []
    for src in (inputs, dirty):
        xs = [None if t is None else leaf(t) for t in src]
        h = block_attn_res_phase2(*xs[:5], norm_weight=xs[5], **phase2_kwargs(case))
        h.backward(grad)
        results.append((h.detach(), [x.grad for x in xs[:3]]))
    (ch, cg), (dh, dg) = results
    others = torch.ones(4, 3, dtype=torch.bool)
    others[2, 1] = False
    assert torch.equal(dh[others], ch[others])
    assert torch.isnan(dh[2, 1]).all()
    for name, a, b in zip(("out", "lse", "partial"), dg, cg):
        assert torch.equal(a[others], b[others]), f"d{name}: other tokens changed"


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["f32", "bf16", "f64"])
def test_logits_of_1e4_stay_finite(sign, dtype):
    """Every logit near +-1e4 (sources along one direction, scale +-1e4): a softmax
    that does not subtract the max overflows (+) or divides 0 by 0 (-)."""
    g = torch.Generator().manual_seed(9)
    lead, D, N, S = (2, 3), 16, 4, 2
    e = randn(g, D)
    e = e / e.norm()
    blocks = [((0.9 + 0.05 * i) * e + 0.01 * randn(g, *lead, D)).to(dtype) for i in range(N)]
    w = torch.stack([e, 0.8 * e]).to(dtype)
    kw = dict(scale=sign * 1e4, rmsnorm=False)
    b = [leaf(x) for x in blocks]
    ww = leaf(w)
    outs, lses = block_attn_res_phase1(b, ww, None, **kw)
    ref_outs, ref_lses = reference_phase1([x.to(F64) for x in blocks], w.to(F64), None, eps=1e-6,
                                          **kw)
    for s in range(S):
        assert torch.isfinite(outs[s]).all() and torch.isfinite(lses[s]).all()
        assert_close_rel(f"o_{s}", outs[s], ref_outs[s], TOL[dtype][0])
        assert_close_rel(f"lse_{s}", lses[s], ref_lses[s], LSE_TOL[dtype])
    # Phase 2 with lse - z_p of about +-1e4 (beta saturated at 0 or 1).
    p = leaf((1.0 * e + 0.01 * randn(g, *lead, D)).to(dtype))
    h = block_attn_res_phase2(outs[0], lses[0], p, ww[0], None, **kw)
    h_ref = reference_phase2(ref_outs[0], ref_lses[0], p.detach().to(F64), w[0].to(F64), None,
                             eps=1e-6, **kw)
    assert torch.isfinite(h).all()
    assert_close_rel("h", h, h_ref, TOL[dtype][0])
    h.backward(torch.ones_like(h))
    for x in b + [ww, p]:
        assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------
# gradcheck (float64), opcheck, torch.compile.
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rmsnorm,gamma", [(True, True), (True, False), (False, False)])
def test_gradcheck_phase1(rmsnorm, gamma):
    g = torch.Generator().manual_seed(1)
    blocks = [leaf(randn(g, 2, 2, 5, std=1 + 0.3 * i)) for i in range(3)]
    w = leaf(randn(g, 2, 5, std=0.5))
    gm = leaf(randn(g, 2, 5, mean=1.0, std=0.3)) if gamma else None
    inputs = blocks + [w] + ([gm] if gamma else [])

    def fn(*args):
        outs, lses = block_attn_res_phase1(list(args[:3]), args[3], args[4] if gamma else None,
                                           eps=0.1, scale=0.7, rmsnorm=rmsnorm)
        return tuple(outs + lses)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("partial,input_norm,norm_weight,rmsnorm", [
    (True, False, False, True), (True, True, True, True), (True, True, False, False),
    (False, True, True, True), (False, False, False, True)])
def test_gradcheck_phase2(partial, input_norm, norm_weight, rmsnorm):
    g = torch.Generator().manual_seed(2)
    out = leaf(randn(g, 2, 2, 5))
    lse = leaf(randn(g, 2, 2))
    p = leaf(randn(g, 2, 2, 5)) if partial else None
    w = leaf(randn(g, 5, std=0.5))
    gm = leaf(randn(g, 5, mean=1.0, std=0.3))
    nw = leaf(randn(g, 5, mean=1.0, std=0.3)) if norm_weight else None
    inputs = [t for t in (out, lse, p, w, gm, nw) if t is not None]

    def fn(*args):
        it = iter(args)
        o, l = next(it), next(it)
        pp = next(it) if partial else None
        ww, gg = next(it), next(it)
        nn_ = next(it) if norm_weight else None
        return block_attn_res_phase2(o, l, pp, ww, gg, eps=0.05, scale=0.8, rmsnorm=rmsnorm,
                                     norm_weight=nn_, input_norm=input_norm, norm_eps=0.01)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)


def _opcheck_phase1_args(requires_grad, gamma=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    blocks = [randn(g, 2, 3, 8, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]
    w = randn(g, 2, 8, std=0.3, dtype=dtype).requires_grad_(requires_grad)
    gm = randn(g, 2, 8, mean=1.0, std=0.2, dtype=dtype).requires_grad_(requires_grad) if gamma else None
    return blocks, w, gm


@pytest.mark.parametrize("requires_grad,gamma,rmsnorm,dtype", [
    (True, True, True, torch.float32), (False, True, True, torch.float32),
    (True, False, True, torch.float64), (True, False, False, torch.float32)])
def test_opcheck_phase1(requires_grad, gamma, rmsnorm, dtype):
    blocks, w, gm = _opcheck_phase1_args(requires_grad, gamma, dtype)
    torch.library.opcheck(torch.ops.attnres.phase1.default, (blocks, w, gm, 1e-6, 0.5, rmsnorm))


@pytest.mark.parametrize("need", [
    ([True, True, True], True, True), ([False, True, False], False, True),
    ([False, False, False], True, False)])
def test_opcheck_phase1_backward(need):
    blocks, w, gm = _opcheck_phase1_args(False)
    g = torch.Generator().manual_seed(4)
    grad_outs = [randn(g, 2, 3, 8, dtype=torch.float32), None]
    grad_lses = [None, randn(g, 2, 3, dtype=torch.float32)]
    need_blocks, need_w, need_gamma = need  # the backward op: one flag per saved tensor
    torch.library.opcheck(torch.ops.attnres.phase1_backward.default,
                          (grad_outs + grad_lses, [*blocks, w, gm], 1e-6, 0.5, True,
                           [*need_blocks, need_w, need_gamma]))


def _opcheck_phase2_args(requires_grad, partial=True, norm_weight=True):
    g = torch.Generator().manual_seed(5)
    r = lambda *s, **k: randn(g, *s, dtype=torch.float32, **k).requires_grad_(requires_grad)  # noqa: E731
    return (r(2, 3, 8), r(2, 3), r(2, 3, 8) if partial else None, r(8, std=0.3),
            r(8, mean=1.0, std=0.2), r(8, mean=1.0, std=0.2) if norm_weight else None)


@pytest.mark.parametrize("requires_grad,partial,input_norm,norm_weight", [
    (True, True, True, True), (True, True, False, False), (True, False, True, False),
    (False, True, True, True)])
def test_opcheck_phase2(requires_grad, partial, input_norm, norm_weight):
    out, lse, p, w, gm, nw = _opcheck_phase2_args(requires_grad, partial, norm_weight)
    torch.library.opcheck(torch.ops.attnres.phase2.default,
                          (out, lse, p, w, gm, nw, 1e-6, 0.5, True, input_norm, 1e-5))


@pytest.mark.parametrize("need,partial,rmsnorm,input_norm", [
    ([True] * 6, True, True, True), ([False, True, True, False, True, False], True, True, False),
    ([True, False, True, True, False, True], False, False, True)])
def test_opcheck_phase2_backward(need, partial, rmsnorm, input_norm):
    out, lse, p, w, gm, nw = _opcheck_phase2_args(False, partial, input_norm)
    grad = torch.randn(2, 3, 8)
    torch.library.opcheck(torch.ops.attnres.phase2_backward.default,
                          ([grad], [out, lse, p, w, gm if rmsnorm else None, nw], 1e-6, 0.5,
                           rmsnorm, input_norm, 1e-5, need))


def _assert_compiled_matches_eager(fn, seed: int) -> None:
    """fn(b0, b1, b2, w, gamma, p, nw) (three blocks [2, 3, 8], S = 3 query rows, a
    partial block and norm weights) compiled (fullgraph) gives eager's output and
    gradients."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    D = 8
    args = [randn(g, 2, 3, D, dtype=torch.float32) for _ in range(3)]            # blocks
    args += [randn(g, 3, D, std=0.4, dtype=torch.float32),                        # w
             randn(g, 3, D, mean=1.0, std=0.2, dtype=torch.float32),              # gamma
             randn(g, 2, 3, D, dtype=torch.float32),                              # partial
             randn(g, 3, D, mean=1.0, std=0.2, dtype=torch.float32)]              # norm weights
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [leaf(a) for a in args]
        y = f(*xs)
        y.backward(torch.linspace(-1, 1, y.numel()).view(y.shape))
        results.append((y.detach(), [x.grad for x in xs]))
    (y, grads), (cy, cgrads) = results
    torch.testing.assert_close(cy, y)
    for a, b in zip(cgrads, grads):
        torch.testing.assert_close(a, b)


def test_compiled_fullgraph_matches_eager():
    def fn(b0, b1, b2, w, gamma, p, nw):
        outs, lses = block_attn_res_phase1([b0, b1, b2], w, gamma, scale=0.7)
        h0 = block_attn_res_phase2(outs[0], lses[0], None, w[0], gamma[0], scale=0.7,
                                   norm_weight=nw[0])
        p1 = torch.tanh(p) + h0
        h1 = block_attn_res_phase2(outs[1], lses[1], p1, w[1], gamma[1], scale=0.7)
        h2 = block_attn_res_phase2(outs[2], lses[2], p1 + h1, w[2], None, scale=0.7,
                                   norm_weight=nw[2], norm_eps=1e-5)
        return h2 * h0 + h1

    _assert_compiled_matches_eager(fn, seed=12)


# ---------------------------------------------------------------------------------
# Determinism (SPEC section 3): dw, dgamma (and dnorm_weight) bitwise identical run to
# run and for 1 vs 2 threads.
# ---------------------------------------------------------------------------------

@pytest.fixture
def restore_threads():
    before = attnres.get_num_threads()
    yield
    attnres.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_weight_gradients_bitwise_deterministic(dtype, restore_threads):
    g = torch.Generator().manual_seed(13)
    lead, D, N, S = (4, 75), 33, 5, 3        # 300 tokens: several token chunks
    blocks = [randn(g, *lead, D, dtype=dtype) for _ in range(N)]
    w = randn(g, S, D, std=0.2, dtype=dtype)
    gamma = randn(g, S, D, mean=1.0, std=0.2, dtype=dtype)
    p = randn(g, *lead, D, dtype=dtype)
    nw = randn(g, D, mean=1.0, std=0.2, dtype=dtype)
    grads = [randn(g, *lead, D, dtype=dtype) for _ in range(S)]

    def run():
        xs = [leaf(x) for x in blocks]
        ww, gg, nn_ = leaf(w), leaf(gamma), leaf(nw)
        outs, lses = block_attn_res_phase1(xs, ww, gg, scale=0.8)
        h = block_attn_res_phase2(outs[1], lses[1], p, ww[1], gg[1], scale=0.8, norm_weight=nn_)
        torch.autograd.backward([outs[0], outs[2], h], grads)
        return [ww.grad, gg.grad, nn_.grad] + [x.grad for x in xs]

    attnres.set_num_threads(2)
    first = run()
    for threads in (2, 1, 2, 1):
        attnres.set_num_threads(threads)
        again = run()
        for name, a, b in zip(["dw", "dgamma", "dnorm_weight"] + [f"dblocks[{i}]" for i in range(N)],
                              again, first):
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
                f"{name} differs with {threads} thread(s)"


# ---------------------------------------------------------------------------------
# Layouts and sizes.
# ---------------------------------------------------------------------------------

def test_strided_inputs_and_zero_tokens():
    g = torch.Generator().manual_seed(14)
    wide = leaf(randn(g, 2, 3, 20))
    transposed = leaf(randn(g, 3, 2, 8))
    blocks = [wide[..., :8], transposed.transpose(0, 1)]   # row stride 20; not row-major
    w_wide = leaf(randn(g, 2, 16, std=0.3))
    w = w_wide[:, ::2]                                      # element stride 2
    outs, lses = block_attn_res_phase1(blocks, w, None)
    ref_outs, ref_lses = reference_phase1(blocks, w, None, scale=1.0, eps=1e-6, rmsnorm=True)
    for a, b in zip(outs + lses, ref_outs + ref_lses):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    out_t = outs[0].transpose(0, 1).contiguous().transpose(0, 1)   # same values, other layout
    h = block_attn_res_phase2(out_t, lses[0], blocks[1], w[0].contiguous(), None)
    h_ref = reference_phase2(ref_outs[0], ref_lses[0], blocks[1], w[0], None, scale=1.0,
                             eps=1e-6, rmsnorm=True)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(h.sum() + outs[1].sum(), (wide, transposed, w_wide))
    ref_grads = torch.autograd.grad(h_ref.sum() + ref_outs[1].sum(), (wide, transposed, w_wide))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    # Zero tokens: empty outputs, zero weight gradients.
    empty = [leaf(torch.empty(0, 3, 5, dtype=torch.float32)) for _ in range(2)]
    ww = leaf(torch.randn(2, 5))
    gg = leaf(torch.ones(2, 5))
    outs, lses = block_attn_res_phase1(empty, ww, gg)
    assert outs[0].shape == (0, 3, 5) and lses[0].shape == (0, 3)
    h = block_attn_res_phase2(outs[0], lses[0], empty[1], ww[0], gg[0], norm_weight=gg[1])
    (h.sum() + outs[1].sum() + lses[1].sum()).backward()
    assert torch.equal(ww.grad, torch.zeros(2, 5)) and torch.equal(gg.grad, torch.zeros(2, 5))


# ---------------------------------------------------------------------------------
# Bad inputs raise ValueError naming the argument.
# ---------------------------------------------------------------------------------

def _valid():
    g = torch.Generator().manual_seed(15)
    blocks = [randn(g, 2, 3, 8, dtype=torch.float32) for _ in range(2)]
    w = randn(g, 2, 8, std=0.3, dtype=torch.float32)
    gamma = randn(g, 2, 8, mean=1.0, dtype=torch.float32)
    return blocks, w, gamma


def _names(name):
    """A regex matching the argument's name as a word (blocks[1], w, ...)."""
    return rf"(?<![\w.]){re.escape(name)}(?![\w\[])"


PHASE1_BAD = {
    "blocks not a list": (lambda b, w, g: (b[0], w, g), "blocks"),
    "blocks empty": (lambda b, w, g: ([], w, g), "blocks"),
    "blocks shapes differ": (lambda b, w, g: ([b[0], b[1][:, :2]], w, g), "blocks[1]"),
    "blocks dtypes differ": (lambda b, w, g: ([b[0], b[1].double()], w, g), "blocks[1]"),
    "w 1-D": (lambda b, w, g: (b, w[0], g), "w"),
    "w wrong D": (lambda b, w, g: (b, torch.zeros(2, 9), g), "w"),
    "w wrong dtype": (lambda b, w, g: (b, w.double(), g), "w"),
    "gamma wrong shape": (lambda b, w, g: (b, w, g[:1]), "gamma"),
    "gamma wrong dtype": (lambda b, w, g: (b, w, g.half()), "gamma"),
}


@pytest.mark.parametrize("case", PHASE1_BAD)
def test_phase1_bad_inputs(case):
    edit, name = PHASE1_BAD[case]
    with pytest.raises(ValueError, match=_names(name)):
        block_attn_res_phase1(*edit(*_valid()))


@pytest.mark.parametrize("kwargs,name", [
    (dict(eps=-1.0), "eps"), (dict(eps=float("nan")), "eps"), (dict(scale=float("inf")), "scale")])
def test_phase1_bad_scalars(kwargs, name):
    with pytest.raises(ValueError, match=name):
        block_attn_res_phase1(*_valid(), **kwargs)


def _valid2():
    blocks, w, gamma = _valid()
    outs, lses = block_attn_res_phase1(blocks, w, gamma)
    return dict(out=outs[0], lse=lses[0], partial=blocks[1], w=w[0], gamma=gamma[0])


PHASE2_BAD = {
    "lse shape": (dict(lse=torch.zeros(2, 4)), {}, "lse"),
    "lse dtype": (dict(lse=torch.zeros(2, 3, dtype=torch.float64)), {}, "lse"),
    "partial shape": (dict(partial=torch.zeros(2, 3, 7)), {}, "partial"),
    "partial dtype": (dict(partial=torch.zeros(2, 3, 8, dtype=torch.bfloat16)), {}, "partial"),
    "w 2-D": (dict(w=torch.zeros(1, 8)), {}, "w"),
    "w dtype": (dict(w=torch.zeros(8, dtype=torch.float64)), {}, "w"),
    "gamma shape": (dict(gamma=torch.zeros(7)), {}, "gamma"),
    "norm_weight shape": ({}, dict(norm_weight=torch.ones(9)), "norm_weight"),
    "norm_weight without input_norm": ({}, dict(norm_weight=torch.ones(8), input_norm=False),
                                       "norm_weight"),
    "norm_eps": ({}, dict(input_norm=True, norm_eps=-1.0), "norm_eps"),
    "eps": ({}, dict(eps=-1.0), "eps"),
}


@pytest.mark.parametrize("case", PHASE2_BAD)
def test_phase2_bad_inputs(case):
    edit, kwargs, name = PHASE2_BAD[case]
    args = _valid2()
    args.update(edit)
    with pytest.raises(ValueError, match=_names(name)):
        block_attn_res_phase2(args["out"], args["lse"], args["partial"], args["w"], args["gamma"],
                              **kwargs)


def test_phase2_bad_inputs_without_partial():
    args = _valid2()
    with pytest.raises(ValueError, match=r"\bw\b"):
        block_attn_res_phase2(args["out"], args["lse"], None, torch.zeros(3, 3), None)


def test_phase2_non_tensor_out_raises_value_error():
    args = _valid2()
    with pytest.raises(ValueError, match=_names("out")):
        block_attn_res_phase2([1.0], args["lse"], args["partial"], args["w"], args["gamma"])


def test_phase2_non_contiguous_weights_and_lse():
    g = torch.Generator().manual_seed(16)
    out, p = randn(g, 2, 3, 8), randn(g, 2, 3, 8)
    lse = randn(g, 2, 6)[:, ::2]                      # element stride 2
    w, gamma, nw = (randn(g, 16, std=0.4)[::2], randn(g, 16, mean=1.0, std=0.2)[::2],
                    randn(g, 16, mean=1.0, std=0.2)[::2])
    assert not any(t.is_contiguous() for t in (lse, w, gamma, nw))
    kw = dict(scale=0.9, eps=1e-6, rmsnorm=True, input_norm=True, norm_eps=1e-6)
    ref_in = [leaf(t) for t in (out, lse, p, w, gamma, nw)]
    h_ref = reference_phase2(*ref_in[:5], norm_weight=ref_in[5], **kw)
    h_ref.backward(torch.ones_like(h_ref))
    for _ in range(10):
        churn = [torch.randn(8, dtype=F64) for _ in range(64)]  # reuse freed memory
        xs = [leaf(t) for t in (out, p)]
        leaves = [leaf(t.contiguous()) for t in (lse, w, gamma, nw)]
        # Strided views of leaves: the op sees non-contiguous lse/w/gamma/norm_weight.
        views = [torch.stack([x, x], dim=-1)[..., 0] for x in leaves]
        assert not any(v.is_contiguous() for v in views)
        h = block_attn_res_phase2(xs[0], views[0], xs[1], views[1], views[2],
                                  norm_weight=views[3], **kw)
        h.backward(torch.ones_like(h))
        del churn
        torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
        for name, a, r in zip(("out", "partial", "lse", "w", "gamma", "norm_weight"),
                              xs + leaves, [ref_in[0], ref_in[2]] + [ref_in[1]] + ref_in[3:]):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"d{name}: {m}")


def test_phase1_backward_bad_gradients():
    blocks, w, gamma = _valid()
    go = torch.zeros(2, 3, 8)
    gl = torch.zeros(2, 3)
    op = torch.ops.attnres.phase1_backward
    common = ([*blocks, w, gamma], 1e-6, 1.0, True, [True] * (len(blocks) + 2))
    with pytest.raises(ValueError, match=r"grads must be 2S = 4 gradients"):
        op([go, gl, gl], *common)
    with pytest.raises(ValueError, match=r"grad_lses\[1\]"):
        op([go, go, gl, torch.zeros(2, 4)], *common)
    with pytest.raises(ValueError, match=r"grad_outs\[0\]"):
        op([torch.zeros(2, 3, 7), go, gl, gl], *common)


def test_phase2_backward_bad_gradient():
    args = _valid2()
    with pytest.raises(ValueError, match=r"\bgrad\b"):
        torch.ops.attnres.phase2_backward(
            [torch.zeros(2, 3, 7)], [args["out"], args["lse"], args["partial"], args["w"],
                                     args["gamma"], None], 1e-6, 1.0, True, False, 1e-6,
            [True] * 6)


# ---------------------------------------------------------------------------------
# Only some inputs require grad: the others get none, the rest are unchanged.
# ---------------------------------------------------------------------------------

def test_mixed_requires_grad():
    g = torch.Generator().manual_seed(17)
    blocks = [randn(g, 2, 3, 9) for _ in range(3)]
    w = randn(g, 2, 9, std=0.4)
    gamma = randn(g, 2, 9, mean=1.0, std=0.2)
    p = randn(g, 2, 3, 9)
    nw = randn(g, 9, mean=1.0, std=0.2)
    grad = randn(g, 2, 3, 9)

    def run(requires):
        xs = [t.detach().clone().requires_grad_(r) for t, r in zip(blocks + [w, gamma, p, nw],
                                                                  requires)]
        outs, lses = block_attn_res_phase1(xs[:3], xs[3], xs[4], scale=0.8)
        h = block_attn_res_phase2(outs[1], lses[1], xs[5], xs[3][1], xs[4][1], scale=0.8,
                                  norm_weight=xs[6])
        torch.autograd.backward([h, outs[0]], [grad, grad])
        return [x.grad for x in xs]

    full = run([True] * 7)
    mixed = run([True, False, True, False, True, False, True])
    for i, (a, b) in enumerate(zip(mixed, full)):
        if i in (1, 3, 5):
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    # No gradient needed at all: a plain forward.
    with torch.no_grad():
        outs, lses = block_attn_res_phase1(blocks, w, gamma)
    assert not outs[0].requires_grad and outs[0].grad_fn is None


# ---------------------------------------------------------------------------------
# The fused partial-block update (ABI 3): block_attn_res_phase2(..., update=y) returns
# (h, p') with p' = partial + y formed by the kernel; h merges p'.
# ---------------------------------------------------------------------------------

UPDATE_CASES = {  # rmsnorm, gamma, input_norm, norm_weight
    "keys": (True, True, False, False),
    "input_norm": (True, True, True, True),
    "no_gamma_input_norm_ones": (True, False, True, False),
    "raw_keys": (False, False, False, False),
}


def update_inputs(dtype, seed, D=33, lead=(2, 5)):
    """(out, lse, partial, update, w, gamma, norm_weight, grad_h, grad_p): partial and the
    update of different magnitudes, so that their sum rounds in every dtype."""
    g = torch.Generator().manual_seed(seed)
    return (randn(g, *lead, D, dtype=dtype), randn(g, *lead, mean=0.5, dtype=acc_dtype(dtype)),
            randn(g, *lead, D, std=1.5, dtype=dtype), randn(g, *lead, D, std=0.7, dtype=dtype),
            randn(g, D, std=1 / math.sqrt(D), dtype=dtype),
            randn(g, D, mean=1.0, std=0.3, dtype=dtype),
            randn(g, D, mean=1.0, std=0.3, dtype=dtype),
            randn(g, *lead, D, dtype=dtype), randn(g, *lead, D, dtype=dtype))


def update_kwargs(case):
    rmsnorm, _, input_norm, _ = UPDATE_CASES[case]
    return dict(eps=1e-6, scale=0.8, rmsnorm=rmsnorm, input_norm=input_norm, norm_eps=1e-5)


def update_weights(case, gamma, norm_weight):
    _, has_gamma, _, has_nw = UPDATE_CASES[case]
    return gamma if has_gamma else None, norm_weight if has_nw else None


def same_bits(a, b):
    a, b = a.detach().contiguous(), b.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("case", UPDATE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_update_forward_is_torch_add_then_phase2_bitwise(dtype, case, grad):
    """p' has the bits of torch's partial + update and h those of phase 2 over it, on
    the fast path (with and without autograd) and through the op."""
    out, lse, p, y, w, gamma, nw, _, _ = update_inputs(dtype, seed=21)
    gamma, nw = update_weights(case, gamma, nw)
    kw = update_kwargs(case)
    with torch.no_grad():
        expected_h = block_attn_res_phase2(out, lse, p + y, w, gamma, norm_weight=nw, **kw)
    args = [leaf(t) if grad else t for t in (out, lse, p, y, w)]
    h, p_new = block_attn_res_phase2(args[0], args[1], args[2], args[4], gamma, norm_weight=nw,
                                     update=args[3], **kw)
    assert h.requires_grad == grad and p_new.requires_grad == grad
    assert same_bits(p_new, p + y), "new_partial differs from torch's add"
    assert same_bits(h, expected_h), "h differs from phase 2 over torch's add"
    op_h, op_p = torch.ops.attnres.phase2_update(out, lse, p, y, w,
                                                 gamma if kw["rmsnorm"] else None, nw,
                                                 kw["eps"], kw["scale"], kw["rmsnorm"],
                                                 kw["input_norm"], kw["norm_eps"])
    assert same_bits(op_p, p + y) and same_bits(op_h, expected_h)


@pytest.mark.parametrize("case", UPDATE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_update_gradients_match_oracle(dtype, case):
    """Every gradient, with h and p' both in the loss, against float64 autograd over
    p + y, SPEC section 3 tolerances; and against the unfused composition (torch's add,
    then phase 2) in the same dtype: bitwise, but for dpartial and dupdate in bf16 and
    fp16, where the fused backward rounds once (dp + grad_p) instead of twice (dp, then
    the sum with grad_p)."""
    inputs = update_inputs(dtype, seed=22)
    out, lse, p, y, w, gamma, nw, grad_h, grad_p = inputs
    gamma, nw = update_weights(case, gamma, nw)
    kw = update_kwargs(case)
    tol_h, tol_g = TOL[dtype]
    names = ["out", "lse", "partial", "update", "w", "gamma", "norm_weight"]
    tensors = [out, lse, p, y, w, gamma, nw]

    xs = [None if t is None else leaf(t) for t in tensors]
    h, p_new = block_attn_res_phase2(xs[0], xs[1], xs[2], xs[4], xs[5], norm_weight=xs[6],
                                     update=xs[3], **kw)
    torch.autograd.backward([h, p_new], [grad_h, grad_p])

    refs = [None if t is None else leaf(t, F64) for t in tensors]
    p_ref = refs[2] + refs[3]
    h_ref = reference_phase2(refs[0], refs[1], p_ref, refs[4], refs[5], norm_weight=refs[6],
                             **kw)
    assert_close_rel("h", h, h_ref, tol_h)
    torch.autograd.backward([h_ref, p_ref], [grad_h.to(F64), grad_p.to(F64)])

    unfused = [None if t is None else leaf(t) for t in tensors]
    p_sum = unfused[2] + unfused[3]
    h_un = block_attn_res_phase2(unfused[0], unfused[1], p_sum, unfused[4], unfused[5],
                                 norm_weight=unfused[6], **kw)
    torch.autograd.backward([h_un, p_sum], [grad_h, grad_p])

    for name, x, r, u in zip(names, xs, refs, unfused):
        if x is None:
            continue
        if name == "gamma" and not kw["rmsnorm"]:
            assert x.grad is None or not x.grad.any(), "dgamma should be zero"
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype, f"no gradient for {name}"
        assert_close_rel(f"d{name}", x.grad, r.grad, tol_g)
        if name in ("partial", "update") and dtype in (torch.bfloat16, torch.float16):
            # dp is accumulated in fp32 either way; the unfused sum rounds it to the
            # dtype before adding grad_p: they differ by about a unit of the dtype.
            assert_close_rel(f"d{name} vs unfused", x.grad, u.grad, 2 * tol_h)
        else:
            assert same_bits(x.grad, u.grad), f"d{name} differs from the unfused composition"
    assert torch.equal(xs[2].grad, xs[3].grad)  # one gradient for both


@pytest.mark.parametrize("partial_grad,update_grad,others", [
    (True, True, True), (True, False, False), (False, True, False), (False, True, True),
    (False, False, True)])
def test_update_requires_grad_combinations(partial_grad, update_grad, others):
    """Only what requires grad gets a gradient, equal to that of the full run; nothing
    requiring grad gives plain tensors (no graph)."""
    out, lse, p, y, w, gamma, nw, grad_h, grad_p = update_inputs(torch.float32, seed=23)
    kw = dict(eps=1e-6, scale=0.8, rmsnorm=True, input_norm=True, norm_eps=1e-5)

    def run(requires):
        xs = [t.detach().clone().requires_grad_(r)
              for t, r in zip((out, lse, p, y, w, gamma, nw), requires)]
        h, p_new = block_attn_res_phase2(xs[0], xs[1], xs[2], xs[4], xs[5], norm_weight=xs[6],
                                         update=xs[3], **kw)
        if any(requires):
            torch.autograd.backward([h, p_new], [grad_h, grad_p])
        else:
            assert h.grad_fn is None and p_new.grad_fn is None
        return [x.grad for x in xs], (h.detach(), p_new.detach())

    full, (h_full, p_full) = run([True] * 7)
    requires = [others, others, partial_grad, update_grad, others, others, others]
    mixed, (h, p_new) = run(requires)
    assert same_bits(h, h_full) and same_bits(p_new, p_full)
    for i, (a, b, r) in enumerate(zip(mixed, full, requires)):
        if not r:
            assert a is None, f"input {i} got a gradient"
        else:
            assert same_bits(a, b), f"input {i}: gradient differs from the full run"
    with torch.no_grad():
        h_ng, p_ng = block_attn_res_phase2(out, lse, p, w, gamma, norm_weight=nw, update=y, **kw)
    assert same_bits(h_ng, h_full) and same_bits(p_ng, p_full)


@pytest.mark.parametrize("use", ["h", "new_partial"])
def test_update_with_one_output_unused(use):
    """Only one output in the loss: the other's gradient is None on the fast path (no
    zeros made for p', zeros for h) and zeros through the op; both equal the unfused
    composition in float64."""
    out, lse, p, y, w, gamma, nw, grad_h, grad_p = update_inputs(F64, seed=24)
    kw = dict(eps=1e-6, scale=0.8, rmsnorm=True, input_norm=False, norm_eps=1e-6)
    results = []
    for path in ("fast", "op", "unfused"):
        xs = [leaf(t) for t in (out, lse, p, y, w, gamma)]
        if path == "fast":
            h, p_new = block_attn_res_phase2(*xs[:3], xs[4], xs[5], update=xs[3], **kw)
        elif path == "op":
            h, p_new = torch.ops.attnres.phase2_update(*xs, None, kw["eps"], kw["scale"], True,
                                                       False, 1e-6)
        else:
            p_new = xs[2] + xs[3]
            h = block_attn_res_phase2(xs[0], xs[1], p_new, xs[4], xs[5], **kw)
        loss = (h * grad_h).sum() if use == "h" else (p_new * grad_p).sum()
        loss.backward()
        results.append([x.grad for x in xs])
    fast, op, unfused = results
    for i, (a, b, c) in enumerate(zip(fast, op, unfused)):
        if c is None:
            assert a is None or not a.any(), f"input {i}"
            continue
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-14, msg=lambda m: f"{i}: {m}")
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-14, msg=lambda m: f"{i}: {m}")


def test_update_strided_inputs_and_zero_tokens():
    """out, partial and the update as views with one row stride (read in place), or one
    of them transposed (copied), and a non-contiguous gradient of p': the bits of
    contiguous inputs."""
    g = torch.Generator().manual_seed(25)
    D = 8
    out, lse, w, gamma = randn(g, 3, 2, 20), randn(g, 3, 2), randn(g, D, std=0.4), \
        randn(g, D, mean=1.0, std=0.2)
    wide, transposed = randn(g, 3, 2, 20), randn(g, 2, 3, D)
    grad_h, grad_p = randn(g, 3, 2, D), randn(g, 2, 3, D).transpose(0, 1)
    assert not grad_p.is_contiguous()
    layouts = {
        "row stride 20": lambda wd, tr: (wd[..., :D], wd[..., 10:10 + D]),
        "update transposed": lambda wd, tr: (wd[..., :D], tr.transpose(0, 1)),
        "partial transposed": lambda wd, tr: (tr.transpose(0, 1), wd[..., 5:5 + D]),
    }
    for name, views in layouts.items():
        results = []
        for contiguous in (False, True):
            xs = [leaf(t) for t in (out, lse, w, gamma, wide, transposed)]
            p_in, y_in = views(*xs[4:])
            o_in = xs[0][..., 3:3 + D]
            if contiguous:
                o_in, p_in, y_in = o_in.contiguous(), p_in.contiguous(), y_in.contiguous()
            else:
                assert not (p_in.is_contiguous() or y_in.is_contiguous())
            h, p_new = block_attn_res_phase2(o_in, xs[1], p_in, xs[2], xs[3], update=y_in,
                                             scale=0.9)
            assert same_bits(p_new, p_in + y_in), name
            torch.autograd.backward([h, p_new], [grad_h, grad_p])
            results.append([h, p_new] + [x.grad for x in xs])
        for i, (a, b) in enumerate(zip(*results)):
            assert (a is None and b is None) or same_bits(a, b), f"{name}: result {i}"

    # Zero tokens: empty outputs, zero weight gradients.
    empty = [leaf(torch.empty(0, 3, 5)) for _ in range(3)]
    ww, gg = leaf(torch.randn(5)), leaf(torch.ones(5))
    h, p_new = block_attn_res_phase2(empty[0], torch.empty(0, 3), empty[1], ww, gg,
                                     update=empty[2])
    assert h.shape == p_new.shape == (0, 3, 5)
    (h.sum() + p_new.sum()).backward()
    assert torch.equal(ww.grad, torch.zeros(5)) and torch.equal(gg.grad, torch.zeros(5))
    assert empty[1].grad.shape == empty[2].grad.shape == (0, 3, 5)


@pytest.mark.parametrize("input_norm", [False, True])
def test_gradcheck_update(input_norm):
    g = torch.Generator().manual_seed(26)
    inputs = [leaf(randn(g, 2, 2, 5)), leaf(randn(g, 2, 2)), leaf(randn(g, 2, 2, 5)),
              leaf(randn(g, 2, 2, 5, std=0.6)), leaf(randn(g, 5, std=0.5)),
              leaf(randn(g, 5, mean=1.0, std=0.3)), leaf(randn(g, 5, mean=1.0, std=0.3))]

    def fn(out, lse, p, y, w, gm, nw):
        return block_attn_res_phase2(out, lse, p, w, gm, eps=0.05, scale=0.8,
                                     norm_weight=nw if input_norm else None,
                                     input_norm=input_norm, norm_eps=0.01, update=y)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)
    # Through the op (make_fx-style tracing takes it; here a function mode does).
    with CustomOpMode():
        assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)


class CustomOpMode(torch.overrides.TorchFunctionMode):
    """Changes nothing, but while it is active the front ends take the custom ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("requires_grad,input_norm,norm_weight,dtype", [
    (True, True, True, torch.float32), (True, False, False, torch.float32),
    (False, True, False, torch.float32), (True, True, True, torch.bfloat16)])
def test_opcheck_phase2_update(requires_grad, input_norm, norm_weight, dtype):
    out, lse, p, w, gm, nw = _opcheck_phase2_args(requires_grad, True, norm_weight)
    y = torch.randn(p.shape, generator=torch.Generator().manual_seed(6))
    if dtype != torch.float32:
        out, p, w, gm, y = (t.detach().to(dtype).requires_grad_(requires_grad)
                            for t in (out, p, w, gm, y))
        nw = nw.detach().to(dtype).requires_grad_(requires_grad) if nw is not None else None
    y.requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.attnres.phase2_update.default,
                          (out, lse, p, y, w, gm, nw, 1e-6, 0.5, True, input_norm, 1e-5))


@pytest.mark.parametrize("need", [[True] * 6, [False, False, True, False, False, False],
                                  [True, True, False, True, True, True]])
def test_opcheck_phase2_backward_with_grad_partial_in(need):
    out, lse, p, w, gm, nw = _opcheck_phase2_args(False, True, True)
    g = torch.Generator().manual_seed(7)
    grad, grad_in = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    torch.library.opcheck(torch.ops.attnres.phase2_update_backward.default,
                          ([grad, grad_in], [out, lse, p, w, gm, nw], 1e-6, 0.5, True, True,
                           1e-5, need))


def test_update_compiled_fullgraph_matches_eager():

    def fn(b0, b1, b2, w, gamma, p, nw):
        outs, lses = block_attn_res_phase1([b0, b1, b2], w, gamma, scale=0.7)
        h1 = block_attn_res_phase2(outs[1], lses[1], p, w[1], gamma[1], scale=0.7)
        h2, p2 = block_attn_res_phase2(outs[2], lses[2], p, w[2], gamma[2], scale=0.7,
                                       norm_weight=nw[2], update=torch.tanh(h1))
        return h2 * p2 + h1

    before = custom_op_calls["attnres::phase2_update"]
    _assert_compiled_matches_eager(fn, seed=27)
    assert custom_op_calls["attnres::phase2_update"] > before  # the compiled graph's op ran


PHASE2_UPDATE_BAD = {
    "update shape": (dict(update=torch.zeros(2, 3, 7)), "update"),
    "update dtype": (dict(update=torch.zeros(2, 3, 8, dtype=torch.float64)), "update"),
    "update device": (dict(update=torch.zeros(2, 3, 8, device="meta")), "update"),
    "update not a tensor": (dict(update=[0.0] * 8), "update"),
    "update without partial": (dict(partial=None, update=torch.zeros(2, 3, 8)), "update"),
    "partial wrong with update": (dict(partial=torch.zeros(2, 3, 7),
                                       update=torch.zeros(2, 3, 8)), "partial"),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("case", PHASE2_UPDATE_BAD)
def test_phase2_update_bad_inputs(case, grad):
    edit, name = PHASE2_UPDATE_BAD[case]
    args = _valid2()
    args["update"] = torch.zeros(2, 3, 8)
    args.update(edit)
    if grad:
        args["w"] = args["w"].detach().requires_grad_(True)
    with pytest.raises(ValueError, match=_names(name)):
        block_attn_res_phase2(args["out"], args["lse"], args["partial"], args["w"], args["gamma"],
                              update=args["update"])


def test_phase2_update_op_refuses_bad_update():
    args = _valid2()
    with pytest.raises(ValueError, match=_names("update")):
        torch.ops.attnres.phase2_update(args["out"], args["lse"], args["partial"],
                                        torch.zeros(2, 3, 7), args["w"], args["gamma"], None,
                                        1e-6, 1.0, True, False, 1e-6)


def test_phase2_backward_bad_grad_partial_in():
    args = _valid2()
    common = (args["out"], args["lse"])
    rest = (args["w"], args["gamma"], None)
    attrs = (1e-6, 1.0, True, False, 1e-6, [True] * 6)
    op = torch.ops.attnres.phase2_update_backward
    grads = [torch.zeros(2, 3, 8), torch.zeros(2, 3, 7)]
    with pytest.raises(ValueError, match=_names("grad_partial_in")):
        op(grads, [*common, args["partial"], *rest], *attrs)
    with pytest.raises(ValueError, match=_names("grad_partial_in")):
        op([grads[0], grads[0]], [*common, None, *rest], *attrs)


def test_update_takes_the_fast_path_and_matches_the_op_bitwise():
    """Eager calls reach the library directly (no custom op runs) and give the op's bits,
    forward and backward."""
    out, lse, p, y, w, gamma, nw, grad_h, grad_p = update_inputs(torch.bfloat16, seed=28)
    kw = dict(eps=1e-6, scale=0.8, rmsnorm=True, input_norm=True, norm_eps=1e-5)
    results = []
    for mode in (contextlib.nullcontext(), CustomOpMode()):
        before = dict(custom_op_calls)
        xs = [leaf(t) for t in (out, lse, p, y, w, gamma, nw)]
        with mode:
            h, p_new = block_attn_res_phase2(xs[0], xs[1], xs[2], xs[4], xs[5], norm_weight=xs[6],
                                             update=xs[3], **kw)
            torch.autograd.backward([h, p_new], [grad_h, grad_p])
        ran = {k: v - before.get(k, 0) for k, v in custom_op_calls.items()
               if v != before.get(k, 0)}
        results.append(([h, p_new] + [x.grad for x in xs], ran))
    (fast, fast_ran), (slow, slow_ran) = results
    assert fast_ran == {}
    assert slow_ran == {"attnres::phase2_update": 1, "attnres::phase2_update_backward": 1}
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert same_bits(a, b), f"result {i}"
