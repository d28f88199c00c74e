"""attnres.block_attn_res_fn: gradients, what autograd saves, validation, autocast."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import block_attnres.ops as ops
from block_attnres.functional import block_attn_res_fn
from model_reference import reference_block_attn_res
from torch_reference import TOLERANCE

SHAPE = (2, 3, 8)  # [B, T, D]


def sample_inputs(num_blocks=3, partial=True, gamma=True, dtype=torch.float64, shape=SHAPE, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    blocks = [rand(*shape) for _ in range(num_blocks)]
    p = rand(*shape) if partial else None
    w = rand(shape[-1])
    g = (1 + 0.3 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)).to(dtype) \
        .requires_grad_() if gamma else None
    return blocks, p, w, g


def grads_of(tensors):
    return [None if t is None else t.grad for t in tensors]


OPTIONS = [
    dict(num_blocks=n, partial=p, gamma=g, rmsnorm=r, scale=s, eps=e)
    for n, p, g, r, (s, e) in itertools.product(
        (1, 3), (True, False), (True, False), (True, False), ((1.0, 1e-6), (0.37, 0.5)))
]


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_gradcheck_float64(opt):
    blocks, p, w, g = sample_inputs(opt["num_blocks"], opt["partial"], opt["gamma"],
                                    shape=(1, 3, 5))
    n = len(blocks)
    kwargs = dict(eps=opt["eps"], scale=opt["scale"], rmsnorm=opt["rmsnorm"])
    inputs = [*blocks] + [t for t in (p, w, g) if t is not None]

    def fn(*args):
        it = iter(args[n:])
        pp = next(it) if p is not None else None
        ww = next(it)
        gg = next(it) if g is not None else None
        return block_attn_res_fn(list(args[:n]), pp, ww, gg, **kwargs)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [
    (d, *TOLERANCE[d][:2]) for d in (torch.float64, torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("rmsnorm", [True, False])
def test_matches_reference(dtype, fwd_tol, grad_tol, rmsnorm):
    shape = (2, 5, 32)
    blocks, p, w, g = sample_inputs(4, True, True, dtype=dtype, shape=shape, seed=1)
    ref_in = [t.detach().clone().requires_grad_() for t in (*blocks, p, w, g)]
    kwargs = dict(scale=0.5, rmsnorm=rmsnorm)
    h = block_attn_res_fn(blocks, p, w, g, **kwargs)
    h_ref = reference_block_attn_res(ref_in[:4], ref_in[4], ref_in[5], ref_in[6], **kwargs)
    assert h.dtype == dtype and h.shape == shape

    def close(a, b, tol):
        b = b.double()
        return (a.double() - b).abs().max().item() <= tol * max(b.abs().max().item(), 1e-30)

    assert close(h, h_ref, fwd_tol)
    grad_h = torch.randn(shape, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64).to(dtype)
    h.backward(grad_h)
    h_ref.backward(grad_h)
    for t, r in zip((*blocks, p, w), ref_in[:6]):
        assert t.grad.dtype == dtype
        assert close(t.grad, r.grad, grad_tol)
    if rmsnorm:
        assert close(g.grad, ref_in[6].grad, grad_tol)
    else:
        assert g.grad is None


def test_saves_inputs_by_reference_only():
    blocks, p, w, g = sample_inputs(3)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = block_attn_res_fn(blocks, p, w, g)
    inputs = [*blocks, p, w, g]
    assert len(packed) == len(inputs)
    for saved, original in zip(packed, inputs):
        assert saved is original  # the caller's tensor itself: no stack, no copy, no cache
    h.sum().backward()

    packed.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_attn_res_fn(blocks, p, w, g, rmsnorm=False)
    assert len(packed) == len(blocks) + 2  # gamma plays no part without the RMSNorm
    assert all(s is o for s, o in zip(packed, [*blocks, p, w]))


def test_mixed_requires_grad(monkeypatch):
    blocks, p, w, g = sample_inputs(4)
    blocks[1].requires_grad_(False)
    blocks[3].requires_grad_(False)
    g.requires_grad_(False)
    calls = []
    native_backward = ops.block_attn_res.OP.backward

    def spy(grads, saved, attrs, needs):
        calls.append(needs)
        return native_backward(grads, saved, attrs, needs)

    monkeypatch.setattr(ops.block_attn_res.OP, "backward", spy)
    block_attn_res_fn(blocks, p, w, g).square().sum().backward()

    assert len(calls) == 1
    # One flag per block, then the partial block, w and gamma.
    assert list(calls[0]) == [True, False, True, False, True, True, False]
    assert blocks[0].grad is not None and blocks[2].grad is not None
    assert blocks[1].grad is None and blocks[3].grad is None and g.grad is None

    # Each gradient equals the one computed with everything requiring grad.
    full = [t.detach().clone().requires_grad_() for t in (*blocks, p, w, g)]
    block_attn_res_fn(full[:4], full[4], full[5], full[6]).square().sum().backward()
    for t, f in zip((blocks[0], blocks[2], p, w), (full[0], full[2], full[4], full[5])):
        torch.testing.assert_close(t.grad, f.grad, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["block", "partial", "w", "gamma"])
def test_single_input_requires_grad(which):
    blocks, p, w, g = sample_inputs(2)
    for t in (*blocks, p, w, g):
        t.requires_grad_(False)
    target = {"block": blocks[1], "partial": p, "w": w, "gamma": g}[which]
    target.requires_grad_(True)
    h = block_attn_res_fn(blocks, p, w, g)
    assert h.requires_grad
    (grad,) = torch.autograd.grad(h.sum(), target)
    ref = target.detach().clone().requires_grad_()
    args = [ref if t is target else t for t in (*blocks, p, w, g)]
    (ref_grad,) = torch.autograd.grad(
        reference_block_attn_res(args[:2], args[2], args[3], args[4]).sum(), ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_no_grad_gives_plain_tensor():
    blocks, p, w, g = sample_inputs(2)
    with torch.no_grad():
        h = block_attn_res_fn(blocks, p, w, g)
    assert not h.requires_grad and h.grad_fn is None


def test_gamma_none_means_ones():
    blocks, p, w, _ = sample_inputs(3, gamma=False)
    ones = torch.ones_like(w)
    torch.testing.assert_close(block_attn_res_fn(blocks, p, w, None),
                               block_attn_res_fn(blocks, p, w, ones), rtol=0, atol=0)


def test_partial_only_is_identity():
    _, p, w, g = sample_inputs(0)
    h = block_attn_res_fn([], p, w, g)
    torch.testing.assert_close(h, p, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(h, p, torch.ones_like(h))
    torch.testing.assert_close(grad, torch.ones_like(p))


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 20, generator=gen, dtype=torch.float64, requires_grad=True)
    transposed = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64,
                             requires_grad=True)
    blocks = [wide[..., :8], wide[..., 10:18], transposed.transpose(0, 1)]
    w = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)[::2]
    h = block_attn_res_fn(blocks, None, w, None)
    torch.testing.assert_close(h, reference_block_attn_res(blocks, None, w, None))
    grads = torch.autograd.grad(h.sum(), (wide, transposed, w))
    ref = torch.autograd.grad(reference_block_attn_res(blocks, None, w, None).sum(),
                              (wide, transposed, w))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


def test_accepts_any_leading_shape():
    blocks, p, w, g = sample_inputs(2, shape=(7, 8))
    h = block_attn_res_fn(blocks, p, w, g)
    assert h.shape == (7, 8)
    torch.testing.assert_close(h, reference_block_attn_res(blocks, p, w, g))


# ----------------------------------------------------------------------------- validation

def test_mixed_dtype_names_argument():
    blocks, p, w, g = sample_inputs(3, dtype=torch.float32)
    cases = {
        "blocks[2]": ([*blocks[:2], blocks[2].double()], p, w, g),
        "partial": (blocks, p.bfloat16(), w, g),
        "w": (blocks, p, w.double(), g),
        "gamma": (blocks, p, w, g.half()),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError,
                           match=re.escape(name) + r" must be a torch\.float32 tensor .*, got torch\."):
            block_attn_res_fn(*args)


def test_bad_shapes_and_no_sources():
    blocks, p, w, g = sample_inputs(2)
    with pytest.raises(ValueError, match=r"blocks must be non-empty when partial is None"):
        block_attn_res_fn([], None, w, g)
    with pytest.raises(ValueError,
                       match=r"blocks\[1\] must be of shape \(2, 3, 8\) .*, got shape \(2, 3, 4\)"):
        block_attn_res_fn([blocks[0], blocks[1][..., :4]], p, w, g)
    with pytest.raises(ValueError, match=r"partial must be of shape"):
        block_attn_res_fn(blocks, p[:1], w, g)
    with pytest.raises(ValueError, match=r"w must be of shape \(8,\) .*, got shape \(4,\)"):
        block_attn_res_fn(blocks, p, w[:4], g)
    with pytest.raises(ValueError, match=r"blocks\[0\] must be .*, got torch\.int64"):
        block_attn_res_fn([torch.zeros(2, 8, dtype=torch.long)], None, w, g)


# ----------------------------------------------------------------------------- autocast

def test_autocast_runs_in_input_dtype():
    blocks, p, w, g = sample_inputs(3, dtype=torch.float32)
    expected = block_attn_res_fn(blocks, p, w, g)
    expected.sum().backward()
    expected_grads = grads_of([*blocks, p, w, g])
    for t in (*blocks, p, w, g):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = block_attn_res_fn(blocks, p, w, g)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, expected, rtol=0, atol=0)
    h.sum().backward()
    for got, want in zip(grads_of([*blocks, p, w, g]), expected_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    low = [t.detach().bfloat16() for t in (*blocks, p, w, g)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h_low = block_attn_res_fn(low[:3], low[3], low[4], low[5])
    assert h_low.dtype == torch.bfloat16


def test_autocast_mixed_dtype_is_a_clear_error():
    blocks, p, w, g = sample_inputs(2, dtype=torch.float32)
    lin = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sub_layer_out = lin(blocks[0])  # bf16 under autocast; the blocks stay fp32
        with pytest.raises(ValueError, match=r"partial must be a torch\.float32 tensor .*, "
                                             r"got torch\.bfloat16 .*autocast"):
            block_attn_res_fn(blocks, sub_layer_out, w, g)
