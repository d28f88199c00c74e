"""The seed-compatible entry points (SPEC 2.1) against the float64 oracle (SPEC 1, 3).

attnres.block_attn_res / attnres.block_attn_res_backward (and their seed names
ai_infra_block_attn_res / ai_infra_block_attn_res_backward) must be drop-in
replacements for the seed: same parameters, defaults, return tuples, cache shapes.
"""
import inspect
import json
import os
from typing import NamedTuple

import pytest
import torch

import block_attnres as attnres
from torch_reference import (
    TOLERANCE,
    reference_backward,
    reference_backward_autograd,
    reference_forward,
    reference_logits,
    rel_err,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DTYPES = [BF16, FP16, FP32, FP64]
DTYPE_IDS = {BF16: "bf16", FP16: "fp16", FP32: "fp32", FP64: "fp64"}
GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data",
                           "block_attn_res_f64.json")

# SPEC 3: max|x - ref| / max|ref|. The caches are accumulation-type values (fp32, or
# fp64 for fp64 inputs) computed from the same rounded inputs as the oracle, so they are
# held to fp32 accuracy.
H_TOL, GRAD_TOL, CACHE_TOL = ({d: t[k] for d, t in TOLERANCE.items()} for k in range(3))


def dtype_param(dtypes=DTYPES):
    return pytest.mark.parametrize("dtype", dtypes, ids=[DTYPE_IDS[d] for d in dtypes])


# --------------------------------------------------------------------------- helpers


class Case(NamedTuple):
    N: int
    partial: bool
    D: int
    B: int
    T: int
    rmsnorm: bool
    scale: float
    eps: float
    gamma_when_off: bool = False  # pass rmsnorm_gamma even though rmsnorm is off

    @property
    def L(self):
        return self.N + int(self.partial)

    def __str__(self):
        return (f"N{self.N}{'+p' if self.partial else ''}-D{self.D}-B{self.B}T{self.T}-"
                f"{'rms' if self.rmsnorm else 'norms'}{'+g' if self.gamma_when_off else ''}-"
                f"s{self.scale:g}-e{self.eps:g}")


# Sampled so that every N in {1,2,7,16,127}, with and without partial (L up to 128),
# every D in {1,7,64,123,512,1536,4096}, rmsnorm on and off, every scale and eps
# appear; the large D only with few tokens.
CASES = [
    Case(1, False, 1, 2, 3, True, 1.0, 1e-6),       # L = 1: alpha == 1, h == v
    Case(1, True, 7, 2, 3, False, 3.0, 1e-6, True),
    Case(2, False, 64, 2, 3, True, 0.25, 1e-2),
    Case(2, True, 123, 3, 5, True, 3.0, 1e-6),
    Case(2, True, 512, 2, 3, False, 3.0, 1e-2),
    Case(7, True, 1, 2, 3, False, 1.0, 1e-2),
    Case(7, False, 512, 2, 3, True, 1.0, 1e-6),
    Case(7, True, 1536, 1, 3, False, 0.25, 1e-6),
    Case(2, True, 1536, 3, 1, True, 1.0, 1e-2),
    Case(16, True, 7, 2, 3, True, 3.0, 1e-2),
    Case(16, True, 64, 2, 3, False, 1.0, 1e-6, True),
    Case(16, False, 4096, 1, 2, True, 0.25, 1e-6),
    Case(1, False, 4096, 1, 3, False, 1.0, 1e-6),
    Case(127, False, 123, 2, 3, False, 3.0, 1e-2),
    Case(127, True, 64, 2, 3, True, 1.0, 1e-6),     # L = 128, the seed's maximum
    Case(127, True, 4096, 1, 1, True, 3.0, 1e-2),   # L = 128, large D
]
CASE_IDS = [str(c) for c in CASES]


def assert_rel(x, ref, tol, what, floor=0.0):
    err = rel_err(x, ref, floor)
    assert err <= tol, f"{what}: max|x-ref|/max|ref| = {err:.3g} > {tol:g}"


def assert_source_grads(gb, gp, gb_ref, gp_ref, tol, per_source):
    """The gradients of all L sources, measured as one tensor [L,B,T,D] (the seed's grad_v,
    before it is split). per_source additionally holds each source's gradient to the bound
    relative to its own max: meaningful where the dtype's range does not underflow tiny
    gradients (not fp16, not when some alpha is ~exp(-700))."""
    got = list(gb) + ([gp] if gp is not None else [])
    ref = list(gb_ref) + ([gp_ref] if gp_ref is not None else [])
    assert len(got) == len(ref)
    assert_rel(torch.stack([g.to(FP64) for g in got]), torch.stack(ref), tol,
               "grad of all sources (grad_blocks + grad_partial_block)")
    if per_source:
        names = [f"grad_blocks[{i}]" for i in range(len(gb))] + ["grad_partial_block"]
        for name, g, r in zip(names, got, ref):
            assert_rel(g, r, tol, name)


def gamma_arg(inp, case):
    return inp["rmsnorm_gamma"] if (case.rmsnorm or case.gamma_when_off) else None


def lib_forward(inp, case, fn=None):
    """Forward with every cache the configuration allows. Returns (out, rms|None, alpha)."""
    fn = fn or attnres.block_attn_res
    res = fn(inp["blocks"], inp["proj_weight"], partial_block=inp["partial_block"],
             scale=case.scale, rmsnorm_eps=case.eps, rmsnorm_gamma=gamma_arg(inp, case),
             enable_rmsnorm=case.rmsnorm, rms_out_flag=case.rmsnorm, alpha_out_flag=True)
    assert isinstance(res, tuple) and len(res) == (3 if case.rmsnorm else 2)
    if case.rmsnorm:
        return res
    return res[0], None, res[1]


def lib_backward(inp, case, rms, alpha, fn=None):
    """Backward from the forward's caches. Returns (grad_blocks, grad_partial, dw, dgamma|None)."""
    fn = fn or attnres.block_attn_res_backward
    res = fn(inp["grad_h"], inp["blocks"], inp["proj_weight"], alpha,
             partial_block=inp["partial_block"], rmsnorm_gamma=gamma_arg(inp, case),
             rms_cache=rms, scale=case.scale, enable_rmsnorm=case.rmsnorm)
    assert isinstance(res, tuple) and len(res) == (4 if case.rmsnorm else 3)
    if case.rmsnorm:
        return res
    return (*res, None)


def ref_forward(inp, case):
    return reference_forward(inp["blocks"], inp["partial_block"], inp["proj_weight"],
                             inp["rmsnorm_gamma"], case.scale, case.eps, case.rmsnorm)


def ref_backward(inp, case):
    return reference_backward(inp["grad_h"], inp["blocks"], inp["partial_block"],
                              inp["proj_weight"], inp["rmsnorm_gamma"], case.scale, case.eps,
                              case.rmsnorm)


def all_outputs(inp, case):
    """Forward + backward through the library, flattened into a dict of tensors."""
    out, rms, alpha = lib_forward(inp, case)
    gb, gp, dw, dg = lib_backward(inp, case, rms, alpha)
    res = {"out": out, "alpha": alpha, "dw": dw}
    res.update({f"grad_blocks[{i}]": g for i, g in enumerate(gb)})
    if rms is not None:
        res["rms"] = rms
    if gp is not None:
        res["grad_partial"] = gp
    if dg is not None:
        res["dgamma"] = dg
    return res


# --------------------------------------------------------------------- the reference


def load_golden():
    with open(GOLDEN_PATH) as f:
        return json.load(f)


GOLDEN = load_golden()["cases"]


def golden_inputs(c, dtype=FP64):
    t = lambda x: None if x is None else torch.tensor(x, dtype=FP64).to(dtype)  # noqa: E731
    return {
        "blocks": [t(b) for b in c["blocks"]],
        "partial_block": t(c["partial_block"]),
        "proj_weight": t(c["proj_weight"]),
        "rmsnorm_gamma": t(c["rmsnorm_gamma"]),
        "grad_h": t(c["grad_h"]),
    }


def golden_case(c):
    return Case(c["N"], c["partial"], c["D"], c["B"], c["T"], c["enable_rmsnorm"],
                c["scale"], c["eps"], gamma_when_off=c["rmsnorm_gamma"] is not None)


@pytest.mark.parametrize("c", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_reference_matches_golden(c):
    inp, case, exp = golden_inputs(c), golden_case(c), c["expected"]
    tens = lambda x: torch.tensor(x, dtype=FP64)  # noqa: E731
    h, r, alpha = ref_forward(inp, case)
    gb, gp, dw, dg = ref_backward(inp, case)
    assert_rel(h, tens(exp["out"]), 1e-12, "out")
    assert_rel(alpha, tens(exp["alpha"]), 1e-12, "alpha")
    if case.rmsnorm:
        assert_rel(r.unsqueeze(-1), tens(exp["rms"]), 1e-12, "rms")
        assert_rel(dg, tens(exp["grad_gamma"]), 1e-12, "grad_gamma")
    else:
        assert r is None and exp["rms"] is None and dg is None and exp["grad_gamma"] is None
    assert len(gb) == len(exp["grad_blocks"]) == case.N
    for i, (g, e) in enumerate(zip(gb, exp["grad_blocks"])):
        assert_rel(g, tens(e), 1e-12, f"grad_blocks[{i}]")
    if case.partial:
        assert_rel(gp, tens(exp["grad_partial"]), 1e-12, "grad_partial")
    else:
        assert gp is None and exp["grad_partial"] is None
    assert_rel(dw, tens(exp["grad_proj_weight"]), 1e-12, "grad_proj_weight")


@pytest.mark.parametrize("case", [
    Case(1, False, 1, 2, 3, True, 1.0, 1e-6),
    Case(1, True, 5, 1, 2, False, 3.0, 1e-6),
    Case(4, True, 9, 2, 3, True, 0.25, 1e-2),
    Case(6, False, 16, 3, 1, False, 1.0, 1e-6),
    Case(5, True, 33, 2, 2, True, 3.0, 1e-6),
], ids=str)
def test_reference_backward_matches_autograd(make_inputs, case):
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, FP64)
    explicit = ref_backward(inp, case)
    auto = reference_backward_autograd(inp["grad_h"], inp["blocks"], inp["partial_block"],
                                       inp["proj_weight"], inp["rmsnorm_gamma"], case.scale,
                                       case.eps, case.rmsnorm)
    for i, (a, b) in enumerate(zip(explicit[0], auto[0])):
        assert_rel(a, b, 1e-12, f"grad_blocks[{i}]")
    if case.partial:
        assert_rel(explicit[1], auto[1], 1e-12, "grad_partial")
    assert_rel(explicit[2], auto[2], 1e-12, "dw")
    if case.rmsnorm:
        assert_rel(explicit[3], auto[3], 1e-12, "dgamma")
    else:
        assert explicit[3] is None and auto[3] is None


# ------------------------------------------------------------------ API surface


def test_seed_names_are_the_same_functions():
    assert attnres.ai_infra_block_attn_res is attnres.block_attn_res
    assert attnres.ai_infra_block_attn_res_backward is attnres.block_attn_res_backward


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_forward_signature_matches_seed():
    E = inspect.Parameter.empty
    assert _params(attnres.block_attn_res) == [
        ("blocks", E), ("proj_weight", E), ("partial_block", None), ("scale", 1.0),
        ("rmsnorm_eps", 1e-6), ("rmsnorm_gamma", None), ("enable_rmsnorm", True),
        ("rms_out_flag", False), ("alpha_out_flag", False)]


def test_backward_signature_matches_seed():
    E = inspect.Parameter.empty
    assert _params(attnres.block_attn_res_backward) == [
        ("grad_h", E), ("blocks", E), ("proj_weight", E), ("alpha_cache", E),
        ("partial_block", None), ("rmsnorm_gamma", None), ("rms_cache", None), ("scale", 1.0),
        ("enable_rmsnorm", True)]


def test_positional_arguments_in_seed_order(make_inputs):
    inp = make_inputs(2, 3, 16, 3, True, FP32)
    case = Case(3, True, 16, 2, 3, True, 0.25, 1e-2)
    out, rms, alpha = attnres.block_attn_res(
        inp["blocks"], inp["proj_weight"], inp["partial_block"], 0.25, 1e-2,
        inp["rmsnorm_gamma"], True, True, True)
    h_ref, r_ref, a_ref = ref_forward(inp, case)
    assert_rel(out, h_ref, H_TOL[FP32], "out")
    gb, gp, dw, dg = attnres.block_attn_res_backward(
        inp["grad_h"], inp["blocks"], inp["proj_weight"], alpha, inp["partial_block"],
        inp["rmsnorm_gamma"], rms, 0.25, True)
    _, _, dw_ref, dg_ref = ref_backward(inp, case)
    assert_rel(dw, dw_ref, GRAD_TOL[FP32], "dw")
    assert_rel(dg, dg_ref, GRAD_TOL[FP32], "dgamma")


def test_defaults_are_rmsnorm_on_scale_one_eps_1e6(make_inputs):
    inp = make_inputs(2, 3, 32, 4, False, FP32)
    out = attnres.block_attn_res(inp["blocks"], inp["proj_weight"],
                                 rmsnorm_gamma=inp["rmsnorm_gamma"])
    h_ref, _, _ = ref_forward(inp, Case(4, False, 32, 2, 3, True, 1.0, 1e-6))
    assert isinstance(out, torch.Tensor)
    assert_rel(out, h_ref, H_TOL[FP32], "out")


# ------------------------------------------------------------- return conventions


@dtype_param()
@pytest.mark.parametrize("rms_flag,alpha_flag,rmsnorm", [
    (False, False, True), (True, False, True), (False, True, True), (True, True, True),
    (False, False, False), (False, True, False),
], ids=["bare", "rms", "alpha", "rms+alpha", "bare-norms", "alpha-norms"])
def test_forward_return_convention(make_inputs, dtype, rms_flag, alpha_flag, rmsnorm):
    B, T, D, N = 2, 3, 24, 4
    L = N + 1
    inp = make_inputs(B, T, D, N, True, dtype)
    res = attnres.block_attn_res(inp["blocks"], inp["proj_weight"], inp["partial_block"],
                                 rmsnorm_gamma=inp["rmsnorm_gamma"] if rmsnorm else None,
                                 enable_rmsnorm=rmsnorm, rms_out_flag=rms_flag,
                                 alpha_out_flag=alpha_flag)
    cache_dtypes = (FP32, FP64) if dtype == FP64 else (FP32,)
    if not (rms_flag or alpha_flag):
        assert isinstance(res, torch.Tensor), f"expected a bare tensor, got {type(res)}"
        out, rest = res, []
    else:
        assert isinstance(res, tuple), f"expected a tuple, got {type(res)}"
        assert len(res) == 1 + rms_flag + alpha_flag
        out, rest = res[0], list(res[1:])
    assert out.shape == (B, T, D) and out.dtype == dtype and out.is_contiguous()
    if rms_flag:
        rms = rest.pop(0)
        assert rms.shape == (B, T, L, 1), rms.shape
        assert rms.dtype in cache_dtypes, rms.dtype
    if alpha_flag:
        alpha = rest.pop(0)
        assert alpha.shape == (B, T, L), alpha.shape
        assert alpha.dtype in cache_dtypes, alpha.dtype
        assert_rel(alpha.sum(-1), torch.ones(B, T), 1e-6, "sum of alpha")
    # The bare output agrees with the reference whatever caches were requested.
    h_ref, _, _ = ref_forward(inp, Case(N, True, D, B, T, rmsnorm, 1.0, 1e-6))
    assert_rel(out, h_ref, H_TOL[dtype], "out")


@dtype_param()
@pytest.mark.parametrize("partial", [False, True], ids=["nopartial", "partial"])
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_forward_without_caches_is_the_cached_call(make_inputs, bits_equal, monkeypatch, dtype,
                                                   partial, rmsnorm):
    # Without caches the forward skips the seed's validator (one pass of the native
    # checks) -- the same kernel, so the same bits as a call that asks for a cache.
    inp = make_inputs(2, 3, 37, 5, partial, dtype)
    gamma = inp["rmsnorm_gamma"] if rmsnorm else None
    args = (inp["blocks"], inp["proj_weight"], inp["partial_block"])
    kwargs = dict(rmsnorm_gamma=gamma, enable_rmsnorm=rmsnorm, scale=0.7)
    cached = attnres.block_attn_res(*args, alpha_out_flag=True, **kwargs)[0]
    ran = []
    monkeypatch.setattr(attnres._validate, "seed_forward",
                        lambda *a: ran.append(a) or pytest.fail("full validator ran"))
    bare = attnres.block_attn_res(*args, **kwargs)
    assert not ran
    assert bits_equal(bare, cached)


@dtype_param()
@pytest.mark.parametrize("partial", [False, True], ids=["nopartial", "partial"])
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_backward_return_convention(make_inputs, dtype, partial, rmsnorm):
    B, T, D, N = 3, 1, 10, 3
    inp = make_inputs(B, T, D, N, partial, dtype)
    case = Case(N, partial, D, B, T, rmsnorm, 1.0, 1e-6)
    out, rms, alpha = lib_forward(inp, case)
    res = attnres.block_attn_res_backward(
        inp["grad_h"], inp["blocks"], inp["proj_weight"], alpha,
        partial_block=inp["partial_block"], rmsnorm_gamma=gamma_arg(inp, case),
        rms_cache=rms, enable_rmsnorm=rmsnorm)
    assert isinstance(res, tuple)
    assert len(res) == (4 if rmsnorm else 3)
    grad_blocks, grad_partial, dw = res[:3]
    assert isinstance(grad_blocks, list), type(grad_blocks)
    assert len(grad_blocks) == N
    for i, g in enumerate(grad_blocks):
        assert g.shape == (B, T, D) and g.dtype == dtype and g.is_contiguous(), f"grad_blocks[{i}]"
    if partial:
        assert grad_partial.shape == (B, T, D) and grad_partial.dtype == dtype
        assert grad_partial.is_contiguous()
    else:
        assert grad_partial is None
    assert dw.shape == (D,) and dw.dtype == dtype
    if rmsnorm:
        assert res[3].shape == (D,) and res[3].dtype == dtype
    # Separate buffers: no gradient aliases another or an input.
    outs = grad_blocks + ([grad_partial] if partial else []) + list(res[2:])
    ins = inp["blocks"] + ([inp["partial_block"]] if partial else []) + [
        inp["grad_h"], inp["proj_weight"], inp["rmsnorm_gamma"], alpha]
    ptrs = [t.data_ptr() for t in outs]
    assert len(set(ptrs)) == len(ptrs), "two gradients share storage"
    assert not set(ptrs) & {t.data_ptr() for t in ins}, "a gradient aliases an input"


# ------------------------------------------------------------ values vs the oracle


@dtype_param()
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_reference(make_inputs, dtype, case):
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    out, rms, alpha = lib_forward(inp, case)
    h_ref, r_ref, a_ref = ref_forward(inp, case)
    assert out.dtype == dtype and out.shape == (case.B, case.T, case.D)
    assert_rel(out, h_ref, H_TOL[dtype], "out")
    assert alpha.shape == (case.B, case.T, case.L)
    assert_rel(alpha, a_ref, CACHE_TOL[dtype], "alpha_cache")
    if case.rmsnorm:
        assert rms.shape == (case.B, case.T, case.L, 1)
        assert_rel(rms, r_ref.unsqueeze(-1), CACHE_TOL[dtype], "rms_cache")
    if case.L == 1:
        assert torch.equal(alpha, torch.ones_like(alpha)), "one source: alpha must be exactly 1"
        assert torch.equal(out, inp["blocks"][0]), "one source: h must be exactly the source"


@dtype_param()
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_matches_reference(make_inputs, dtype, case):
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    _, rms, alpha = lib_forward(inp, case)
    gb, gp, dw, dg = lib_backward(inp, case, rms, alpha)
    gb_ref, gp_ref, dw_ref, dg_ref = ref_backward(inp, case)
    tol = GRAD_TOL[dtype]
    assert len(gb) == case.N and all(g.dtype == dtype for g in gb)
    if case.partial:
        assert gp.dtype == dtype
    else:
        assert gp is None
    assert_source_grads(gb, gp, gb_ref, gp_ref, tol, per_source=dtype != FP16)
    assert dw.dtype == dtype
    assert_rel(dw, dw_ref, tol, "grad_proj_weight")
    if case.rmsnorm:
        assert dg.dtype == dtype
        assert_rel(dg, dg_ref, tol, "grad_rmsnorm_gamma")


@pytest.mark.parametrize("dtype", [FP32, FP64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("c", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_library_matches_golden(c, dtype):
    """The library on the golden cases: fp64 tight, fp32 within the SPEC 3 bounds."""
    inp, case, exp = golden_inputs(c, dtype), golden_case(c), c["expected"]
    tens = lambda x: torch.tensor(x, dtype=FP64)  # noqa: E731
    out, rms, alpha = lib_forward(inp, case)
    gb, gp, dw, dg = lib_backward(inp, case, rms, alpha)
    assert_rel(out, tens(exp["out"]), H_TOL[dtype], "out")
    assert_rel(alpha, tens(exp["alpha"]), CACHE_TOL[dtype], "alpha_cache")
    if case.rmsnorm:
        assert_rel(rms, tens(exp["rms"]), CACHE_TOL[dtype], "rms_cache")
        assert_rel(dg, tens(exp["grad_gamma"]), GRAD_TOL[dtype], "grad_rmsnorm_gamma")
    assert_source_grads(gb, gp, [tens(e) for e in exp["grad_blocks"]],
                        tens(exp["grad_partial"]) if case.partial else None, GRAD_TOL[dtype],
                        per_source=True)
    assert_rel(dw, tens(exp["grad_proj_weight"]), GRAD_TOL[dtype], "grad_proj_weight")


def test_backward_accepts_128_blocks_without_partial(make_inputs):
    """The seed's backward only limits L (<= 128); N = 128 without a partial block is L = 128."""
    case = Case(128, False, 8, 1, 3, True, 1.0, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, FP32)
    _, r_ref, a_ref = ref_forward(inp, case)
    gb, gp, dw, dg = lib_backward(inp, case, r_ref.unsqueeze(-1).float(), a_ref.float())
    gb_ref, _, dw_ref, dg_ref = ref_backward(inp, case)
    assert len(gb) == 128 and gp is None
    assert_source_grads(gb, gp, gb_ref, None, GRAD_TOL[FP32], per_source=True)
    assert_rel(dw, dw_ref, GRAD_TOL[FP32], "grad_proj_weight")
    assert_rel(dg, dg_ref, GRAD_TOL[FP32], "grad_rmsnorm_gamma")


# ------------------------------------------------------------------ huge logits


def _check_against_reference(inp, case, dtype, weight_grad_floor=0.0):
    out, rms, alpha = lib_forward(inp, case)
    gb, gp, dw, dg = lib_backward(inp, case, rms, alpha)
    h_ref, r_ref, a_ref = ref_forward(inp, case)
    gb_ref, gp_ref, dw_ref, dg_ref = ref_backward(inp, case)
    for name, t in [("out", out), ("alpha_cache", alpha), ("grad_proj_weight", dw)] + [
            (f"grad_blocks[{i}]", g) for i, g in enumerate(gb)]:
        assert torch.isfinite(t).all(), f"{name} is not finite"
    assert_rel(out, h_ref, H_TOL[dtype], "out")
    assert_rel(alpha, a_ref, CACHE_TOL[dtype], "alpha_cache")
    if case.partial:
        assert torch.isfinite(gp).all()
    assert_source_grads(gb, gp, gb_ref, gp_ref, GRAD_TOL[dtype], per_source=False)
    assert_rel(dw, dw_ref, GRAD_TOL[dtype], "grad_proj_weight", weight_grad_floor)
    if case.rmsnorm:
        assert torch.isfinite(rms).all() and torch.isfinite(dg).all()
        assert_rel(dg, dg_ref, GRAD_TOL[dtype], "grad_rmsnorm_gamma", weight_grad_floor)
    return out, alpha, gb, gp, dw, dg


def set_huge_proj_weight(inp, case, dtype, gen, accept):
    """Sets inp['proj_weight'] to a random w of magnitude ~1e4 (logits ~ +-1e4), drawing
    again until accept(logits) holds, so the test's premise is checked, not hoped for."""
    for _ in range(200):
        w = (1e4 * torch.randn(case.D, generator=gen) / case.D ** 0.5).to(dtype)
        z = reference_logits(inp["blocks"], inp["partial_block"], w, inp["rmsnorm_gamma"],
                             case.scale, case.eps, case.rmsnorm)
        if accept(z):
            inp["proj_weight"] = w
            return
    raise AssertionError("test construction: no proj_weight met the premise")


@dtype_param()
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_huge_logits_are_finite_and_match(make_inputs, gen, dtype, rmsnorm):
    """|logits| ~ 1e4: a softmax that does not subtract the max overflows to inf/NaN."""
    case = Case(5, True, 16, 2, 3, rmsnorm, 1.0, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)

    def ok(z):
        # The logits really are huge, and the top two are far enough apart that the
        # softmax is one-hot in every precision (no rounding-sensitive near-ties).
        top2 = z.topk(2, dim=-1).values
        return z.abs().amax() > 5e3 and (top2[..., 0] - top2[..., 1]).min() > 200

    set_huge_proj_weight(inp, case, dtype, gen, ok)
    # A one-hot softmax has dw, dgamma ~ exp(-hundreds) ~ 0: held to the bound relative to
    # the O(1) they have when the softmax is not saturated.
    _check_against_reference(inp, case, dtype, weight_grad_floor=1.0)


@dtype_param()
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_huge_tied_logits_split_evenly(make_inputs, gen, dtype, rmsnorm):
    """Two identical sources with logits ~ +-1e4: alpha is exactly 1/2 and h is the source."""
    case = Case(1, True, 16, 2, 3, rmsnorm, 1.0, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    inp["partial_block"] = inp["blocks"][0].clone()
    # Every logit huge, some of each sign (+1e4 overflows exp, -1e4 underflows it to 0/0).
    set_huge_proj_weight(inp, case, dtype, gen,
                         lambda z: z.abs().amin() > 500 and z.amax() > 2e3 and z.amin() < -2e3)
    out, alpha, *_ = _check_against_reference(inp, case, dtype, weight_grad_floor=1.0)
    assert torch.equal(alpha, torch.full_like(alpha, 0.5))
    assert torch.equal(out, inp["blocks"][0])


# -------------------------------------------------------------- memory layouts


def _fill_nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def noncontiguous(x, kind):
    """A view of (a copy of) `x` with an unusual layout; padding is NaN so a kernel that
    reads outside the view is caught. Returns the view; its values are those of x, except
    for 'broadcast', whose values are x[:, :1] repeated over T."""
    B, T, D = x.shape
    if kind == "slice":  # rows uniformly strided, stride D + 5
        base = _fill_nan((B, T, D + 5), x.dtype)
        base[..., :D] = x
        return base[..., :D]
    if kind == "bt_transposed":  # strides (D, B*D, 1): rows not uniformly strided
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "d_stride2":  # last dim stride 2
        base = _fill_nan((B, T, 2 * D), x.dtype)
        base[..., ::2] = x
        return base[..., ::2]
    if kind == "dt_transposed":  # strides (T*D, 1, T): last dim not unit-stride
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "broadcast":  # stride 0 over T
        return x[:, :1].expand(B, T, D)
    raise AssertionError(kind)


def _strided_vector(x):
    base = _fill_nan((2 * x.shape[0],), x.dtype)
    base[::2] = x
    return base[::2]


def _strided_cache(c):
    """A cache as a slice of a wider NaN-padded tensor (last-dim slice)."""
    base = _fill_nan(c.shape[:-1] + (c.shape[-1] + 3,), c.dtype)
    base[..., : c.shape[-1]] = c
    return base[..., : c.shape[-1]]


LAYOUTS = ["slice", "bt_transposed", "d_stride2", "dt_transposed", "broadcast"]


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("target", ["block", "partial", "grad_h", "all"])
def test_noncontiguous_inputs_match_contiguous(make_inputs, bits_equal, dtype, kind, target):
    case = Case(4, True, 37, 2, 3, True, 1.0, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    odd = dict(inp, blocks=list(inp["blocks"]))
    if target in ("block", "all"):
        odd["blocks"][1] = noncontiguous(inp["blocks"][1], kind)
    if target == "all":
        odd["blocks"] = [noncontiguous(b, kind) for b in inp["blocks"]]
        odd["proj_weight"] = _strided_vector(inp["proj_weight"])
        odd["rmsnorm_gamma"] = _strided_vector(inp["rmsnorm_gamma"])
    if target in ("partial", "all"):
        odd["partial_block"] = noncontiguous(inp["partial_block"], kind)
    if target in ("grad_h", "all"):
        odd["grad_h"] = noncontiguous(inp["grad_h"], kind)
    dense = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in odd.items()}
    dense["blocks"] = [b.contiguous() for b in odd["blocks"]]
    assert any(not t.is_contiguous() for t in odd["blocks"] + [odd["partial_block"], odd["grad_h"]])

    expected = all_outputs(dense, case)
    if target == "all":
        # The caches as views too.
        out, rms, alpha = lib_forward(odd, case)
        gb, gp, dw, dg = lib_backward(odd, case, _strided_cache(rms), _strided_cache(alpha))
        got = {"out": out, "rms": rms, "alpha": alpha, "dw": dw, "dgamma": dg,
               "grad_partial": gp, **{f"grad_blocks[{i}]": g for i, g in enumerate(gb)}}
    else:
        got = all_outputs(odd, case)
    assert got.keys() == expected.keys()
    for name in expected:
        assert bits_equal(got[name], expected[name]), f"{name} differs from the contiguous run"


# ------------------------------------------------------------------ no side effects


@dtype_param([FP32, BF16])
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_inputs_are_not_modified(make_inputs, snapshot, assert_unchanged, dtype, rmsnorm):
    case = Case(5, True, 33, 2, 3, rmsnorm, 0.25, 1e-6, gamma_when_off=True)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    before = snapshot(inp)
    _, rms, alpha = lib_forward(inp, case)
    assert_unchanged(before, inp)
    caches = snapshot({"rms": rms, "alpha": alpha})
    lib_backward(inp, case, rms, alpha)
    assert_unchanged(before, inp)
    assert_unchanged(caches, {"rms": rms, "alpha": alpha})


# --------------------------------------------------------- NaN / Inf propagation


@dtype_param([FP32, BF16])
@pytest.mark.parametrize("bad,rmsnorm", [("nan", True), ("nan", False), ("inf", True)])
def test_nonfinite_input_stays_in_its_token(make_inputs, bits_equal, dtype, bad, rmsnorm):
    case = Case(4, True, 64, 2, 3, rmsnorm, 1.0, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    clean = all_outputs(inp, case)
    poisoned_blocks = [b.clone() for b in inp["blocks"]]
    poisoned_blocks[1][0, 1, 5] = float(bad)
    dirty = all_outputs(dict(inp, blocks=poisoned_blocks), case)

    token = torch.zeros(case.B, case.T, dtype=torch.bool)
    token[0, 1] = True
    for name in ["out", "alpha", "rms", "grad_partial"] + [f"grad_blocks[{i}]" for i in range(4)]:
        if name not in clean:
            continue
        d, c = dirty[name], clean[name]
        assert not torch.isfinite(d[token]).all(), f"{name}: the poisoned token stayed finite"
        assert torch.isfinite(d[~token]).all(), f"{name}: the non-finite value leaked"
        assert bits_equal(d[~token], c[~token]), f"{name}: other tokens changed"


# ---------------------------------------------------------------------- no tokens


@dtype_param([FP32, BF16])
@pytest.mark.parametrize("B,T", [(0, 3), (2, 0)])
@pytest.mark.parametrize("rmsnorm", [True, False], ids=["rms", "norms"])
def test_zero_tokens(make_inputs, dtype, B, T, rmsnorm):
    case = Case(3, True, 8, B, T, rmsnorm, 1.0, 1e-6)
    inp = make_inputs(B, T, case.D, case.N, case.partial, dtype)
    out, rms, alpha = lib_forward(inp, case)
    assert out.shape == (B, T, 8) and out.dtype == dtype
    assert alpha.shape == (B, T, 4)
    if rmsnorm:
        assert rms.shape == (B, T, 4, 1)
    bare = attnres.block_attn_res(inp["blocks"], inp["proj_weight"], inp["partial_block"],
                                  rmsnorm_gamma=gamma_arg(inp, case), enable_rmsnorm=rmsnorm)
    assert isinstance(bare, torch.Tensor) and bare.shape == (B, T, 8)
    gb, gp, dw, dg = lib_backward(inp, case, rms, alpha)
    assert len(gb) == 3 and all(g.shape == (B, T, 8) and g.dtype == dtype for g in gb)
    assert gp.shape == (B, T, 8)
    assert dw.shape == (8,) and dw.dtype == dtype and torch.equal(dw, torch.zeros_like(dw))
    if rmsnorm:
        assert dg.shape == (8,) and torch.equal(dg, torch.zeros_like(dg))


# -------------------------------------------------------------------- determinism


@pytest.fixture
def restore_threads():
    get = getattr(attnres, "get_num_threads", None)
    before = get() if get is not None else None
    yield
    attnres.set_num_threads(before if before is not None else 0)


@dtype_param([FP32, BF16])
def test_weight_gradients_bitwise_deterministic(make_inputs, bits_equal, restore_threads, dtype):
    """dw and dgamma reduce over tokens in a fixed order: identical bits run to run and for
    any thread count (SPEC 3). Enough tokens for several chunks per thread."""
    case = Case(7, True, 123, 8, 257, True, 0.25, 1e-6)
    inp = make_inputs(case.B, case.T, case.D, case.N, case.partial, dtype)
    runs = {"default#1": all_outputs(inp, case), "default#2": all_outputs(inp, case)}
    for n in (1, 2):
        attnres.set_num_threads(n)
        runs[f"threads={n}"] = all_outputs(inp, case)
    first_name, first = next(iter(runs.items()))
    for name, res in runs.items():
        for key in ("dw", "dgamma", "out", "grad_blocks[3]", "grad_partial"):
            assert bits_equal(res[key], first[key]), f"{key}: {name} differs from {first_name}"


@dtype_param([BF16, FP32])
def test_large_outputs_on_huge_pages_match_the_reference(dtype):
    """Outputs of 4 MB and more are allocated with the huge-page advice (and, in
    the library, written with non-temporal stores): values as for small ones."""
    gen = torch.Generator().manual_seed(11)
    tokens, dim = 2560, 1024  # 5 MB (bf16) and 10 MB (fp32) per output
    blocks = [torch.randn(1, tokens, dim, generator=gen).to(dtype) for _ in range(2)]
    partial = torch.randn(1, tokens, dim, generator=gen).to(dtype)
    w = (torch.randn(dim, generator=gen) / 32).to(dtype)
    gamma = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    grad_h = torch.randn(1, tokens, dim, generator=gen).to(dtype)
    out, rms, alpha = attnres.block_attn_res(blocks, w, partial_block=partial, rmsnorm_gamma=gamma,
                                             rms_out_flag=True, alpha_out_flag=True)
    ref_h = reference_forward(blocks, partial, w, gamma, 1.0, 1e-6, True)[0]
    assert out.is_contiguous() and out.shape == partial.shape and out.dtype == dtype
    assert rel_err(out, ref_h) <= H_TOL[dtype]
    grads = attnres.block_attn_res_backward(grad_h, blocks, w, alpha, partial_block=partial,
                                            rmsnorm_gamma=gamma, rms_cache=rms)
    ref = reference_backward(grad_h, blocks, partial, w, gamma, 1.0, 1e-6, True)
    for got, want in zip(grads[0] + [grads[1]], ref[0] + [ref[1]]):
        assert got.is_contiguous() and rel_err(got, want) <= GRAD_TOL[dtype]
