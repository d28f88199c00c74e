"""What every Python front end shares: where the names live, how blocks are passed, and
one validator with one message style, "<function>: <argument> must be <expected>, got
<actual>"."""

from __future__ import annotations

import os
import re

import pytest
import torch

import block_attnres as attnres
import block_attnres.compat
import block_attnres.functional
from block_attnres.nn import BlockAttnRes

B, T, D = 2, 3, 8


def inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(B, T, D, generator=gen).to(dtype) for _ in range(3)]
    partial = torch.randn(B, T, D, generator=gen).to(dtype)
    w = (0.3 * torch.randn(D, generator=gen)).to(dtype)
    gamma = (1 + 0.2 * torch.randn(D, generator=gen)).to(dtype)
    return blocks, partial, w, gamma


# ----------------------------------------------------------------------------- module paths

def test_names_live_in_the_modules_that_say_what_they_hold():
    assert attnres.block_attn_res is attnres.compat.block_attn_res
    assert attnres.block_attn_res_backward is attnres.compat.block_attn_res_backward
    assert attnres.ai_infra_block_attn_res is attnres.compat.ai_infra_block_attn_res
    assert attnres.ai_infra_block_attn_res_backward is \
        attnres.compat.ai_infra_block_attn_res_backward
    assert attnres.compat.ai_infra_block_attn_res is attnres.compat.block_attn_res
    assert attnres.block_attn_res_fn is attnres.functional.block_attn_res_fn
    assert not hasattr(attnres.functional, "block_attn_res")  # the seed's API is in compat
    for name in attnres.__all__:
        assert getattr(attnres, name) is not None, name


# ----------------------------------------------------------------------------- blocks

def _front_ends_taking_blocks():
    blocks, partial, w, gamma = inputs()
    h, rms, alpha = attnres.block_attn_res(blocks, w, partial, rmsnorm_gamma=gamma,
                                          rms_out_flag=True, alpha_out_flag=True)
    return {
        "block_attn_res_fn": lambda b: attnres.block_attn_res_fn(b, None, w, gamma),
        "BlockAttnRes": lambda b: BlockAttnRes(D)(b),
        "block_attn_res": lambda b: attnres.block_attn_res(b, w, rmsnorm_gamma=gamma),
        "block_attn_res_backward": lambda b: attnres.block_attn_res_backward(
            h, b, w, alpha[..., :1], rmsnorm_gamma=gamma, rms_cache=rms[..., :1, :]),
    }


@pytest.mark.parametrize("function", list(_front_ends_taking_blocks()))
@pytest.mark.parametrize("not_a_list", ["tensor", "generator", "none"])
def test_blocks_must_be_a_list_or_tuple(function, not_a_list):
    """A single [B, T, D] tensor used to be iterated over its first dimension: B blocks of
    [T, D], a silently wrong result. Anything but a list or tuple is refused."""
    call = _front_ends_taking_blocks()[function]
    x = inputs()[0][0]
    blocks = {"tensor": x, "generator": (b for b in [x]), "none": None}[not_a_list]
    with pytest.raises(ValueError, match=rf"^{re.escape(function)}: blocks must be a list or "
                                         r"tuple of tensors, got "):
        call(blocks)
    call([x])  # the same block in a list is accepted
    call((x,))  # and in a tuple


def test_tuple_and_list_of_blocks_give_the_same_result():
    blocks, partial, w, gamma = inputs()
    expected = attnres.block_attn_res_fn(blocks, partial, w, gamma)
    torch.testing.assert_close(attnres.block_attn_res_fn(tuple(blocks), partial, w, gamma),
                               expected, rtol=0, atol=0)
    m = BlockAttnRes(D)
    torch.testing.assert_close(m(tuple(blocks), partial), m(blocks, partial), rtol=0, atol=0)


# ----------------------------------------------------------------------------- one message style

def _bad_calls():
    """(function named in the message, argument named, call) for every front end."""
    blocks, partial, w, gamma = inputs()
    h, rms, alpha = attnres.block_attn_res(blocks, w, partial, rmsnorm_gamma=gamma,
                                          rms_out_flag=True, alpha_out_flag=True)
    half = partial.half()
    return [
        ("block_attn_res_fn", "partial", lambda: attnres.block_attn_res_fn(blocks, half, w)),
        ("block_attn_res_fn", "w", lambda: attnres.block_attn_res_fn(blocks, None, w[:4])),
        ("block_attn_res_fn", "gamma", lambda: attnres.block_attn_res_fn(blocks, None, w, w[:1])),
        ("block_attn_res_fn", "blocks", lambda: attnres.block_attn_res_fn([], None, w)),
        ("block_attn_res_fn", "scale",
         lambda: attnres.block_attn_res_fn(blocks, None, w, scale=float("inf"))),
        ("block_attn_res_fn", "eps", lambda: attnres.block_attn_res_fn(blocks, None, w, eps=-1.0)),
        ("BlockAttnRes", "dim", lambda: BlockAttnRes(0)),
        ("BlockAttnRes", "blocks", lambda: BlockAttnRes(D)([])),
        ("attnres::block_attn_res", "blocks[1]",
         lambda: torch.ops.attnres.block_attn_res([blocks[0], half], None, w, None, 1e-6, 1.0,
                                                  True)),
        ("attnres::block_attn_res (backward)", "grad_out",
         lambda: torch.ops.attnres.block_attn_res_backward(
             [h[:1]], [*blocks, None, w, gamma], 1e-6, 1.0, True, [True] * 6)),
        ("gradients", "alpha_cache",
         lambda: attnres.ops.block_attn_res.gradients(
             "gradients", h, blocks, None, w, gamma, 1e-6, 1.0, True,
             alpha_cache=alpha[..., :2])),
        ("block_attn_res", "partial_block",
         lambda: attnres.block_attn_res(blocks, w, half, rmsnorm_gamma=gamma)),
        ("block_attn_res", "rmsnorm_eps",
         lambda: attnres.block_attn_res(blocks, w, rmsnorm_gamma=gamma, rmsnorm_eps=float("nan"))),
        ("block_attn_res", "blocks[0]",
         lambda: attnres.block_attn_res([w], w, rmsnorm_gamma=gamma)),
        ("block_attn_res_backward", "grad_h",
         lambda: attnres.block_attn_res_backward(h.double(), blocks, w, alpha, partial,
                                                 rmsnorm_gamma=gamma, rms_cache=rms)),
        ("block_attn_res_backward", "rms_cache",
         lambda: attnres.block_attn_res_backward(h, blocks, w, alpha, partial,
                                                 rmsnorm_gamma=gamma, rms_cache=alpha)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_every_front_end_uses_one_message_style(case):
    function, argument, call = _bad_calls()[case]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    pattern = rf"{re.escape(function)}: {re.escape(argument)} must be \S.*, got \S"
    assert re.match(pattern, message), message


@pytest.mark.parametrize("bad", [None, "1.0"])
def test_scalars_that_are_not_numbers_are_refused_before_the_library(bad):
    """A non-number never reaches the packed struct (where it would raise struct.error)."""
    blocks, partial, w, gamma = inputs()
    calls = [
        lambda: attnres.block_attn_res_fn(blocks, partial, w, gamma, scale=bad),
        lambda: attnres.block_attn_res_fn(blocks, partial, w, gamma, eps=bad),
        lambda: attnres.block_attn_res(blocks, w, partial, rmsnorm_gamma=gamma, scale=bad),
        lambda: attnres.block_attn_res(blocks, w, partial, rmsnorm_gamma=gamma, rmsnorm_eps=bad),
        lambda: attnres.block_attn_res_phase1(blocks, w[None], gamma[None], eps=bad),
        lambda: attnres.block_attn_res_phase2(blocks[0], blocks[0][..., 0], partial, w, gamma,
                                              norm_eps=bad),
    ]
    for call in calls:
        with pytest.raises((ValueError, TypeError)):
            call()


def test_cpu_isas_lists_what_set_cpu_isa_accepts_best_first():
    isas = attnres.cpu_isas()
    assert isas and isas[-1] == "baseline", isas
    automatic = attnres.cpu_isa()
    try:
        for name in isas:
            attnres.set_cpu_isa(name)
            assert attnres.cpu_isa() == name
        with pytest.raises(ValueError, match="no-such-isa"):
            attnres.set_cpu_isa("no-such-isa")
    finally:
        attnres.set_cpu_isa(None)
    assert attnres.cpu_isa() == automatic
    if "ATTNRES_CPU_ISA" not in os.environ:
        assert automatic == isas[0]
