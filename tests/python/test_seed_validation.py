"""Every validation rule of the seed's entry points raises ValueError (SPEC 2.1).

The rules are those of the seed's _validate_forward_inputs / _validate_backward_inputs,
plus its hardware limits, which the seed-compatible functions keep: forward N in
[1, 127] (so L = N + partial <= 128), backward L <= 128. Every message names the
offending argument and gives the expected and the actual value; a failed call writes
nothing and leaves every input as it was.
"""
import re

import pytest
import torch

import block_attnres as attnres
from torch_reference import reference_forward

B, T, D, N = 2, 3, 5, 3  # distinct sizes, so a shape in a message is unambiguous
L = N + 1  # with the partial block
FP32 = torch.float32

DTYPE_NAMES = {
    torch.float32: ("float32", "fp32", "f32"),
    torch.float64: ("float64", "fp64", "f64", "double"),
    torch.float16: ("float16", "fp16", "f16", "half"),
    torch.bfloat16: ("bfloat16", "bf16"),
}


def shapes_in(msg):
    """Every shape written in msg as (a, b, ...), [a, b, ...], torch.Size([...]) or (a,)."""
    found = set()
    for m in re.findall(r"[\[\(]\s*(-?\d+(?:\s*,\s*-?\d+)*)?\s*,?\s*[\]\)]", msg):
        found.add(tuple(int(x) for x in m.split(",")) if m else ())
    return found


def assert_shapes_named(msg, expected, actual):
    shapes = shapes_in(msg)
    assert tuple(expected) in shapes, f"expected shape {tuple(expected)} not in message: {msg!r}"
    assert tuple(actual) in shapes, f"actual shape {tuple(actual)} not in message: {msg!r}"


def assert_dtypes_named(msg, expected, actual):
    # Whole words, so "bfloat16" does not count as "float16".
    words = set(re.findall(r"[a-z0-9]+", msg.lower().replace("torch.", " ")))
    for what, dt in (("expected", expected), ("actual", actual)):
        assert words & set(DTYPE_NAMES[dt]), f"{what} dtype {dt} not in message: {msg!r}"


@pytest.fixture
def expect_value_error(snapshot, assert_unchanged):
    """expect_value_error(fn, kwargs, match) -> message. Also checks that the failed call
    modified none of its tensor arguments."""
    def run(fn, kwargs, match):
        before = snapshot(kwargs)
        with pytest.raises(ValueError, match=match) as info:
            fn(**kwargs)
        assert_unchanged(before, kwargs)
        return str(info.value)
    return run


def _randn(gen, *shape, dtype=FP32):
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.fixture
def fwd(make_inputs):
    """Valid forward keyword arguments (N = 3 blocks + partial, rmsnorm on, both caches)."""
    inp = make_inputs(B, T, D, N, True, FP32)
    return dict(blocks=inp["blocks"], proj_weight=inp["proj_weight"],
                partial_block=inp["partial_block"], rmsnorm_gamma=inp["rmsnorm_gamma"],
                enable_rmsnorm=True, rms_out_flag=True, alpha_out_flag=True)


@pytest.fixture
def bwd(make_inputs):
    """Valid backward keyword arguments, with caches of the right shapes and values."""
    inp = make_inputs(B, T, D, N, True, FP32)
    _, rms, alpha = reference_forward(inp["blocks"], inp["partial_block"], inp["proj_weight"],
                                      inp["rmsnorm_gamma"], 1.0, 1e-6, True)
    return dict(grad_h=inp["grad_h"], blocks=inp["blocks"], proj_weight=inp["proj_weight"],
                alpha_cache=alpha.float(), partial_block=inp["partial_block"],
                rmsnorm_gamma=inp["rmsnorm_gamma"], rms_cache=rms.unsqueeze(-1).float(),
                scale=1.0, enable_rmsnorm=True)


def test_valid_arguments_are_accepted(fwd, bwd):
    """The fixtures below are valid: every failure is due to the one change a test makes."""
    out, rms, alpha = attnres.block_attn_res(**fwd)
    assert out.shape == (B, T, D) and rms.shape == (B, T, L, 1) and alpha.shape == (B, T, L)
    grads = attnres.block_attn_res_backward(**bwd)
    assert len(grads) == 4


# ------------------------------------------------------------------------ forward


def test_forward_empty_blocks(fwd, expect_value_error):
    expect_value_error(attnres.block_attn_res, dict(fwd, blocks=[]), "blocks")


@pytest.mark.parametrize("partial", [False, True], ids=["nopartial", "partial"])
def test_forward_more_than_127_blocks(gen, expect_value_error, partial):
    """The seed's limit N <= 127 (L <= 128) is kept by the seed-compatible function."""
    blocks = [_randn(gen, 1, 1, 4) for _ in range(128)]
    kwargs = dict(blocks=blocks, proj_weight=_randn(gen, 4), rmsnorm_gamma=_randn(gen, 4),
                  partial_block=_randn(gen, 1, 1, 4) if partial else None)
    msg = expect_value_error(attnres.block_attn_res, kwargs, r"blocks|\bL\b")
    # The limit and the actual value: N <= 127 and 128, or (with the partial block) L <= 128
    # and 129.
    assert ("127" in msg and "128" in msg) or (partial and "128" in msg and "129" in msg), msg


@pytest.mark.parametrize("bad_shape", [(B, T, D + 1), (B, T + 1, D), (B + 1, T, D), (B, T),
                                       (B, T, D, 1), (B * T, D)], ids=str)
@pytest.mark.parametrize("index", [1, 2])
def test_forward_block_shape(fwd, gen, expect_value_error, bad_shape, index):
    blocks = list(fwd["blocks"])
    blocks[index] = _randn(gen, *bad_shape)
    msg = expect_value_error(attnres.block_attn_res, dict(fwd, blocks=blocks),
                             rf"blocks\[{index}\]")
    assert_shapes_named(msg, (B, T, D), bad_shape)


def test_forward_first_block_not_3d(fwd, gen, expect_value_error):
    blocks = [_randn(gen, B * T, D)] + list(fwd["blocks"][1:])
    expect_value_error(attnres.block_attn_res, dict(fwd, blocks=blocks), r"blocks")


@pytest.mark.parametrize("bad", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_forward_block_dtype(fwd, expect_value_error, bad):
    blocks = list(fwd["blocks"])
    blocks[1] = blocks[1].to(bad)
    msg = expect_value_error(attnres.block_attn_res, dict(fwd, blocks=blocks), r"blocks\[1\]")
    assert_dtypes_named(msg, FP32, bad)


def _seed_call(request, direction: str):
    """(function, its valid keyword arguments) of the seed API's forward or backward."""
    if direction == "forward":
        return attnres.block_attn_res, request.getfixturevalue("fwd")
    return attnres.block_attn_res_backward, request.getfixturevalue("bwd")


@pytest.mark.parametrize("direction,bad_shape", [
    ("forward", (B, T, D - 1)), ("forward", (B, 1, D)), ("forward", (T, B, D)),
    ("forward", (B, T, D, 1)), ("backward", (B, T, D - 1)), ("backward", (B, 1, D))], ids=str)
def test_partial_block_shape(request, gen, expect_value_error, direction, bad_shape):
    function, kwargs = _seed_call(request, direction)
    msg = expect_value_error(function, dict(kwargs, partial_block=_randn(gen, *bad_shape)),
                             "partial_block")
    assert_shapes_named(msg, (B, T, D), bad_shape)


@pytest.mark.parametrize("direction,bad", [("forward", torch.bfloat16),
                                           ("backward", torch.float16)], ids=str)
def test_partial_block_dtype(request, expect_value_error, direction, bad):
    function, kwargs = _seed_call(request, direction)
    msg = expect_value_error(function, dict(kwargs, partial_block=kwargs["partial_block"].to(bad)),
                             "partial_block")
    assert_dtypes_named(msg, FP32, bad)


@pytest.mark.parametrize("bad_shape", [(D + 1,), (D - 1,), (1, D), (D, 1), ()], ids=str)
def test_forward_proj_weight_shape(fwd, gen, expect_value_error, bad_shape):
    msg = expect_value_error(attnres.block_attn_res,
                             dict(fwd, proj_weight=_randn(gen, *bad_shape)), "proj_weight")
    assert_shapes_named(msg, (D,), bad_shape)


@pytest.mark.parametrize("bad", [torch.float16, torch.float64], ids=str)
def test_forward_proj_weight_dtype(fwd, expect_value_error, bad):
    msg = expect_value_error(attnres.block_attn_res,
                             dict(fwd, proj_weight=fwd["proj_weight"].to(bad)), "proj_weight")
    assert_dtypes_named(msg, FP32, bad)


def test_forward_rmsnorm_gamma_required(fwd, expect_value_error):
    expect_value_error(attnres.block_attn_res, dict(fwd, rmsnorm_gamma=None), "rmsnorm_gamma")


def test_forward_rmsnorm_gamma_required_by_default(fwd, expect_value_error):
    """enable_rmsnorm defaults to True, so the seed's minimal call without gamma fails."""
    kwargs = dict(blocks=fwd["blocks"], proj_weight=fwd["proj_weight"])
    expect_value_error(attnres.block_attn_res, kwargs, "rmsnorm_gamma")


@pytest.mark.parametrize("enable_rmsnorm", [True, False], ids=["rms", "norms"])
@pytest.mark.parametrize("bad_shape", [(D + 1,), (1, D), ()], ids=str)
def test_forward_rmsnorm_gamma_shape(fwd, gen, expect_value_error, bad_shape, enable_rmsnorm):
    """The seed checks a given gamma even when RMSNorm is off."""
    kwargs = dict(fwd, rmsnorm_gamma=_randn(gen, *bad_shape), enable_rmsnorm=enable_rmsnorm,
                  rms_out_flag=enable_rmsnorm)
    msg = expect_value_error(attnres.block_attn_res, kwargs, "rmsnorm_gamma")
    assert_shapes_named(msg, (D,), bad_shape)


@pytest.mark.parametrize("enable_rmsnorm", [True, False], ids=["rms", "norms"])
def test_forward_rmsnorm_gamma_dtype(fwd, expect_value_error, enable_rmsnorm):
    kwargs = dict(fwd, rmsnorm_gamma=fwd["rmsnorm_gamma"].to(torch.float16),
                  enable_rmsnorm=enable_rmsnorm, rms_out_flag=enable_rmsnorm)
    msg = expect_value_error(attnres.block_attn_res, kwargs, "rmsnorm_gamma")
    assert_dtypes_named(msg, FP32, torch.float16)


@pytest.mark.parametrize("gamma", [True, False], ids=["gamma", "nogamma"])
def test_forward_rms_out_flag_needs_rmsnorm(fwd, expect_value_error, gamma):
    kwargs = dict(fwd, enable_rmsnorm=False, rms_out_flag=True,
                  rmsnorm_gamma=fwd["rmsnorm_gamma"] if gamma else None)
    expect_value_error(attnres.block_attn_res, kwargs, "rms_out_flag")


def test_forward_seed_name_validates_too(fwd, expect_value_error):
    expect_value_error(attnres.ai_infra_block_attn_res, dict(fwd, rmsnorm_gamma=None),
                       "rmsnorm_gamma")


# ----------------------------------------------------------------------- backward


def test_backward_empty_blocks(bwd, expect_value_error):
    expect_value_error(attnres.block_attn_res_backward, dict(bwd, blocks=[]), "blocks")


@pytest.mark.parametrize("bad_shape", [(B, T, D + 1), (T, B, D), (B, T), (B, T, D, 1)], ids=str)
def test_backward_grad_h_shape(bwd, gen, expect_value_error, bad_shape):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, grad_h=_randn(gen, *bad_shape)), "grad_h")
    assert_shapes_named(msg, (B, T, D), bad_shape)


@pytest.mark.parametrize("bad", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_backward_grad_h_dtype(bwd, expect_value_error, bad):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, grad_h=bwd["grad_h"].to(bad)), "grad_h")
    assert_dtypes_named(msg, FP32, bad)


@pytest.mark.parametrize("bad_shape", [(B, T, D + 1), (B, T + 1, D), (B, T)], ids=str)
def test_backward_block_shape(bwd, gen, expect_value_error, bad_shape):
    blocks = list(bwd["blocks"])
    blocks[2] = _randn(gen, *bad_shape)
    msg = expect_value_error(attnres.block_attn_res_backward, dict(bwd, blocks=blocks),
                             r"blocks\[2\]")
    assert_shapes_named(msg, (B, T, D), bad_shape)


def test_backward_block_dtype(bwd, expect_value_error):
    blocks = list(bwd["blocks"])
    blocks[1] = blocks[1].to(torch.bfloat16)
    msg = expect_value_error(attnres.block_attn_res_backward, dict(bwd, blocks=blocks),
                             r"blocks\[1\]")
    assert_dtypes_named(msg, FP32, torch.bfloat16)


@pytest.mark.parametrize("name,bad_shape", [
    ("proj_weight", (D + 1,)), ("proj_weight", (1, D)), ("proj_weight", ()),
    ("rmsnorm_gamma", (D + 1,)), ("rmsnorm_gamma", (1, D))], ids=str)
def test_backward_vector_shape(bwd, gen, expect_value_error, name, bad_shape):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, **{name: _randn(gen, *bad_shape)}), name)
    assert_shapes_named(msg, (D,), bad_shape)


@pytest.mark.parametrize("name,bad", [("proj_weight", torch.float64),
                                      ("rmsnorm_gamma", torch.bfloat16)], ids=str)
def test_backward_vector_dtype(bwd, expect_value_error, name, bad):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, **{name: bwd[name].to(bad)}), name)
    assert_dtypes_named(msg, FP32, bad)


@pytest.mark.parametrize("enable_rmsnorm", [True, False], ids=["rms", "norms"])
def test_backward_alpha_cache_required(bwd, expect_value_error, enable_rmsnorm):
    kwargs = dict(bwd, alpha_cache=None, enable_rmsnorm=enable_rmsnorm)
    expect_value_error(attnres.block_attn_res_backward, kwargs, "alpha_cache")


@pytest.mark.parametrize("bad_shape", [(B, T, L + 1), (B, T, L - 1), (B, T, L, 1), (B * T, L),
                                       (T, B, L)], ids=str)
def test_backward_alpha_cache_shape(bwd, gen, expect_value_error, bad_shape):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, alpha_cache=_randn(gen, *bad_shape)), "alpha_cache")
    assert_shapes_named(msg, (B, T, L), bad_shape)


def test_backward_alpha_cache_shape_without_partial(bwd, expect_value_error):
    """Dropping the partial block makes L = N: the L = N + 1 cache no longer fits."""
    kwargs = dict(bwd, partial_block=None, rms_cache=bwd["rms_cache"][:, :, :N])
    msg = expect_value_error(attnres.block_attn_res_backward, kwargs, "alpha_cache")
    assert_shapes_named(msg, (B, T, N), (B, T, L))


def test_backward_rmsnorm_gamma_required(bwd, expect_value_error):
    expect_value_error(attnres.block_attn_res_backward, dict(bwd, rmsnorm_gamma=None),
                       "rmsnorm_gamma")


def test_backward_rms_cache_required(bwd, expect_value_error):
    expect_value_error(attnres.block_attn_res_backward, dict(bwd, rms_cache=None), "rms_cache")


@pytest.mark.parametrize("bad_shape", [(B, T, L), (B, T, L + 1, 1), (B, T, L - 1, 1),
                                       (B, T, 1, L), (B * T, L, 1)], ids=str)
def test_backward_rms_cache_shape(bwd, gen, expect_value_error, bad_shape):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, rms_cache=_randn(gen, *bad_shape)), "rms_cache")
    assert_shapes_named(msg, (B, T, L, 1), bad_shape)


def test_backward_without_rmsnorm_needs_no_gamma_or_rms_cache(bwd):
    """The seed only asks for rmsnorm_gamma and rms_cache when enable_rmsnorm=True."""
    res = attnres.block_attn_res_backward(**dict(bwd, rmsnorm_gamma=None, rms_cache=None,
                                                 enable_rmsnorm=False))
    assert len(res) == 3


def test_backward_more_than_128_sources(gen, expect_value_error):
    """N = 128 blocks + partial: L = 129 > 128, the seed's limit."""
    n, d = 128, 4
    kwargs = dict(grad_h=_randn(gen, 1, 1, d), blocks=[_randn(gen, 1, 1, d) for _ in range(n)],
                  proj_weight=_randn(gen, d), alpha_cache=torch.full((1, 1, n + 1), 1 / (n + 1)),
                  partial_block=_randn(gen, 1, 1, d), rmsnorm_gamma=_randn(gen, d),
                  rms_cache=torch.ones(1, 1, n + 1, 1))
    msg = expect_value_error(attnres.block_attn_res_backward, kwargs,
                             r"blocks|partial_block|\bL\b|alpha_cache|rms_cache")
    assert "128" in msg and "129" in msg, msg


def test_backward_seed_name_validates_too(bwd, expect_value_error):
    expect_value_error(attnres.ai_infra_block_attn_res_backward, dict(bwd, alpha_cache=None),
                       "alpha_cache")


# ------------------------------------------------------------------------- devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forward_device_mismatch(fwd, expect_value_error):
    blocks = list(fwd["blocks"])
    blocks[1] = blocks[1].cuda()
    msg = expect_value_error(attnres.block_attn_res, dict(fwd, blocks=blocks), r"blocks\[1\]")
    assert "cuda" in msg and "cpu" in msg, msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backward_device_mismatch(bwd, expect_value_error):
    msg = expect_value_error(attnres.block_attn_res_backward,
                             dict(bwd, grad_h=bwd["grad_h"].cuda()), "grad_h")
    assert "cuda" in msg and "cpu" in msg, msg
