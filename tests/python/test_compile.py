"""The torch.library registration: opcheck, and torch.compile(fullgraph=True) vs eager."""

from __future__ import annotations

import pytest
import torch

import block_attnres.ops  # noqa: F401  (registers torch.ops.attnres.*)
from block_attnres.nn import BlockAttnRes
from block_attnres.functional import block_attn_res_fn
from model_reference import TinyAttnResLM, lm_loss, randomize_attn_res


def sample(num_blocks=3, partial=True, gamma=True, dtype=torch.float32, shape=(2, 3, 8),
           requires_grad=True):
    gen = torch.Generator().manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=gen, dtype=dtype).requires_grad_(requires_grad)

    return ([rand(*shape) for _ in range(num_blocks)], rand(*shape) if partial else None,
            rand(shape[-1]), rand(shape[-1]) if gamma else None)


OPCHECK_CASES = {
    "full": dict(),
    "no_partial": dict(partial=False),
    "no_gamma": dict(gamma=False),
    "one_block_fp64": dict(num_blocks=1, dtype=torch.float64),
    "no_grad": dict(requires_grad=False),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
@pytest.mark.parametrize("rmsnorm", [True, False])
def test_opcheck_forward(case, rmsnorm):
    blocks, p, w, g = sample(**OPCHECK_CASES[case])
    torch.library.opcheck(torch.ops.attnres.block_attn_res.default,
                          (blocks, p, w, g if rmsnorm else None, 1e-6, 0.5, rmsnorm))


def test_opcheck_forward_mixed_requires_grad():
    blocks, p, w, g = sample()
    blocks[1].requires_grad_(False)
    g.requires_grad_(False)
    torch.library.opcheck(torch.ops.attnres.block_attn_res.default,
                          (blocks, p, w, g, 1e-6, 1.0, True))


@pytest.mark.parametrize("need", [
    [True, True, True, True, True, True],
    [False, True, False, False, True, False],
    [False, False, False, True, False, True],
])
def test_opcheck_backward(need):
    """The backward op (grads, saved, attrs, needs): one flag per saved tensor, here the
    three blocks, the partial block, w and gamma."""
    blocks, p, w, g = sample(requires_grad=False)
    grad_out = torch.randn_like(blocks[0])
    torch.library.opcheck(torch.ops.attnres.block_attn_res_backward.default,
                          ([grad_out], [*blocks, p, w, g], 1e-6, 0.5, True, need))


def _eager_and_compiled(fn, inputs, backend):
    """Runs fn eagerly and compiled (fullgraph) on clones; returns outputs and input grads."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
        args = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = f(*args)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
        results.append((out.detach(), [a.grad for a in args]))
    return results


def _assert_same(results):
    (out, grads), (c_out, c_grads) = results
    torch.testing.assert_close(c_out, out)
    for a, b in zip(c_grads, grads):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b)


def test_compiled_function_matches_eager():
    torch._dynamo.reset()
    blocks, p, w, g = sample(num_blocks=3)
    blocks[2].requires_grad_(False)

    def fn(b0, b1, b2, p, w, g):
        h = block_attn_res_fn([b0, b1, b2], torch.tanh(p), w, g, scale=0.5)
        h2 = block_attn_res_fn([b0, h], None, w, None, rmsnorm=False)
        return h2 * h

    _assert_same(_eager_and_compiled(fn, [*blocks, p, w, g], "aot_eager"))


def test_inductor_matches_eager():
    # Only the two opaque custom ops in the graphs: inductor emits no C++ kernel to
    # compile, which keeps this test fast with a cold cache.
    torch._dynamo.reset()
    blocks, p, w, g = sample(num_blocks=2)
    blocks[1].requires_grad_(False)

    def fn(b0, b1, p, w, g):
        return block_attn_res_fn([b0, b1], p, w, g, scale=0.5)

    _assert_same(_eager_and_compiled(fn, [*blocks, p, w, g], "inductor"))


def test_compiled_stack_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    torch.manual_seed(0)
    # 3 layers, a new block every 2: AttnRes calls without a partial block, with one, and
    # right after a block closes. fullgraph=True raises on any graph break.
    model = TinyAttnResLM(num_layers=3, layers_per_block=2, impl="native", scale=0.8)
    randomize_attn_res(model)
    tokens = torch.randint(0, 32, (2, 6))

    loss = lm_loss(model, tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    c_loss = lm_loss(compiled, tokens)
    c_loss.backward()
    torch.testing.assert_close(c_loss, loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=lambda m: f"{n}: {m}")


def test_compiled_module_under_autocast():
    torch._dynamo.reset()
    m = BlockAttnRes(8)
    blocks, p, _, _ = sample(dtype=torch.bfloat16)

    def fn(blocks, p):
        return m(blocks, p)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(blocks, p)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(blocks, p)
    assert compiled.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager)
