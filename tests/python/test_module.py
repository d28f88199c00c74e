"""attnres.nn.BlockAttnRes, and a small report-layout stack against a pure-torch twin."""

from __future__ import annotations

import io

import pytest
import torch

import block_attnres.ops as ops
from block_attnres.nn import BlockAttnRes
from block_attnres.functional import block_attn_res_fn
from model_reference import TinyAttnResLM, lm_loss, randomize_attn_res


def test_init_and_repr():
    m = BlockAttnRes(16, eps=1e-5, scale=0.5)
    assert dict(m.named_parameters()).keys() == {"w", "gamma"}
    assert torch.equal(m.w, torch.zeros(16)) and torch.equal(m.gamma, torch.ones(16))
    assert repr(m) == "BlockAttnRes(16, eps=1e-05, scale=0.5, rmsnorm=True)"

    m = BlockAttnRes(4, rmsnorm=False, dtype=torch.float64)
    assert m.gamma is None and [n for n, _ in m.named_parameters()] == ["w"]
    assert m.w.dtype == torch.float64
    assert "rmsnorm=False" in repr(m)


def test_rmsnorm_without_learned_gamma(monkeypatch):
    """gamma=False: RMSNorm on, no gamma parameter (like nn.RMSNorm(elementwise_affine=False));
    the op is called with gamma=None, which the C ABI takes as ones."""
    m = BlockAttnRes(8, gamma=False, dtype=torch.float64)
    assert m.gamma is None and [n for n, _ in m.named_parameters()] == ["w"]
    assert m.state_dict().keys() == {"w"}
    assert repr(m) == "BlockAttnRes(8, eps=1e-06, scale=1.0, rmsnorm=True, gamma=False)"
    assert "gamma" not in repr(BlockAttnRes(8, rmsnorm=False, gamma=False))
    with torch.no_grad():
        m.w.normal_()
    blocks = [torch.randn(2, 3, 8, dtype=torch.float64) * (i + 1) for i in range(3)]
    partial = torch.randn(2, 3, 8, dtype=torch.float64)

    calls = []
    native_forward = ops.block_attn_res.OP.forward

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return native_forward(*args, **kwargs)

    monkeypatch.setattr(ops.block_attn_res.OP, "forward", spy)
    h = m(blocks, partial)
    (args, kwargs), = calls
    assert args[3] is None and args[6] is True  # gamma, rmsnorm

    ones = torch.ones(8, dtype=torch.float64)
    torch.testing.assert_close(h, block_attn_res_fn(blocks, partial, m.w, ones), rtol=0, atol=0)
    # The RMSNorm is on: the blocks' different scales do not change the keys.
    assert not torch.allclose(h, block_attn_res_fn(blocks, partial, m.w, rmsnorm=False))
    h.sum().backward()
    assert m.w.grad is not None


def test_zero_w_is_uniform_attention():
    m = BlockAttnRes(8)
    blocks = [torch.randn(2, 3, 8) for _ in range(3)]
    partial = torch.randn(2, 3, 8)
    torch.testing.assert_close(m(blocks, partial), sum([*blocks, partial]) / 4)
    torch.testing.assert_close(m(blocks), sum(blocks) / 3)


def test_forward_matches_function_and_grads_reach_parameters():
    m = BlockAttnRes(8, eps=1e-4, scale=0.3, dtype=torch.float64)
    with torch.no_grad():
        m.w.normal_()
        m.gamma.uniform_(0.5, 1.5)
    blocks = [torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    partial = torch.randn(2, 3, 8, dtype=torch.float64)
    h = m(blocks, partial)
    torch.testing.assert_close(
        h, block_attn_res_fn(blocks, partial, m.w, m.gamma, eps=1e-4, scale=0.3), rtol=0, atol=0)
    h.square().sum().backward()
    assert m.w.grad is not None and m.gamma.grad is not None
    assert all(b.grad is not None for b in blocks)


def test_state_dict_round_trip():
    src = BlockAttnRes(8, scale=0.7)
    with torch.no_grad():
        src.w.normal_()
        src.gamma.uniform_(0.5, 1.5)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = BlockAttnRes(8, scale=0.7)
    dst.load_state_dict(torch.load(buf))
    assert src.state_dict().keys() == dst.state_dict().keys() == {"w", "gamma"}
    blocks = [torch.randn(3, 8) for _ in range(3)]
    torch.testing.assert_close(dst(blocks, blocks[0]), src(blocks, blocks[0]), rtol=0, atol=0)


def test_parameters_cast_to_activation_dtype():
    m = BlockAttnRes(8)  # fp32 master parameters
    with torch.no_grad():
        m.w.normal_()
    blocks = [torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = m(blocks)
    assert h.dtype == torch.bfloat16
    h.float().sum().backward()
    assert m.w.grad.dtype == torch.float32 and m.gamma.grad.dtype == torch.float32
    with pytest.raises(ValueError,
                       match=r"partial must be a torch\.bfloat16 tensor .*, got torch\.float32"):
        m(blocks, torch.randn(2, 8))


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-9, 1e-12),
                                             (torch.float32, 1e-4, 1e-6)])
@pytest.mark.parametrize("rmsnorm", [True, False])
def test_stack_matches_reference_model(dtype, rtol, atol, rmsnorm):
    """8 layers, a new block every 2 (4 completed blocks + the partial at the end)."""
    torch.manual_seed(0)
    kwargs = dict(num_layers=8, layers_per_block=2, rmsnorm=rmsnorm, scale=0.8)
    native = TinyAttnResLM(impl="native", **kwargs).to(dtype)
    randomize_attn_res(native)
    reference = TinyAttnResLM(impl="reference", **kwargs).to(dtype)
    reference.load_state_dict(native.state_dict())
    tokens = torch.randint(0, 32, (4, 7))

    loss = lm_loss(native, tokens)
    loss.backward()
    ref_loss = lm_loss(reference, tokens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    ref_params = dict(reference.named_parameters())
    names = [n for n, _ in native.named_parameters()]
    assert names == list(ref_params)
    assert sum(n.endswith((".w", "_res.gamma")) for n in names) == 17 * (2 if rmsnorm else 1)
    for name, p in native.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
