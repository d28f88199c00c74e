"""The eager fast path of the PyTorch front ends (each op's autograd.Function, made by
attnres._op.OpDef, and the direct native call without autograd) against the
torch.library custom ops they bypass.

The two paths run the same native calls, so they must agree bit for bit: outputs and
every gradient, for every dtype, with and without the partial block and gamma, for the
single op, both phases and the residual stream. The custom-op path is taken by calling
torch.ops.attnres.* directly, or by running the public function under a do-nothing
TorchFunctionMode (any active mode sends the front ends through the custom ops). Which
path ran is read from attnres.ops.custom_op_calls, which counts the runs of each
custom op's implementation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

import block_attnres as attnres
from block_attnres import _native, block_attn_res_fn, block_attn_res_phase1, block_attn_res_phase2
from block_attnres.nn import BlockAttnRes, BlockAttnResStream
from block_attnres.ops import custom_op_calls

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
DTYPE_IDS = ["bf16", "f16", "f32", "f64"]
SHAPE = (2, 3, 8)
D = SHAPE[-1]


class CustomOpPath(TorchFunctionMode):
    """Changes nothing, but while it is active the front ends take the custom ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Yields a dict that, on exit, holds how often each custom op ran inside."""
    before = dict(custom_op_calls)
    ran = {}
    yield ran
    ran.update({k: v - before.get(k, 0) for k, v in custom_op_calls.items()
                if v != before.get(k, 0)})


def bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def assert_same_bits(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a is None} vs {b is None}"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), f"{what}: the paths differ"


def assert_same_grads(fast, slow, what):
    """The gradients of the two paths' leaves (None: not an input) have the same bits."""
    for i, (a, b) in enumerate(zip(fast, slow)):
        if a is not None:
            assert_same_bits(a.grad, b.grad, f"{what} {i}")


def leaves(tensors, requires_grad=True):
    return [None if t is None else t.detach().clone().requires_grad_(requires_grad)
            for t in tensors]


def single_op_inputs(dtype, partial=True, gamma=True, num_blocks=3, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    blocks = [randn(*SHAPE, scale=0.5 + i) for i in range(num_blocks)]
    return (blocks, randn(*SHAPE) if partial else None, randn(D, scale=0.5),
            (1 + randn(D, scale=0.2)) if gamma else None)


# ---------------------------------------------------------------------------------
# The single op
# ---------------------------------------------------------------------------------

CASES = {  # partial, gamma, rmsnorm
    "full": (True, True, True),
    "no_partial": (False, True, True),
    "no_gamma": (True, False, True),
    "no_rmsnorm": (True, True, False),
    "bare": (False, False, False),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_single_op_paths_agree_bitwise(dtype, case):
    partial, gamma, rmsnorm = CASES[case]
    blocks, p, w, g = single_op_inputs(dtype, partial, gamma)
    kw = dict(eps=1e-5, scale=0.7, rmsnorm=rmsnorm)
    grad_h = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9)).to(dtype)

    fast = leaves([*blocks, p, w, g])
    with counting() as ran:
        h_fast = block_attn_res_fn(fast[:3], fast[3], fast[4], fast[5], **kw)
        h_fast.backward(grad_h)
    assert ran == {}, "the fast path ran a custom op"
    assert isinstance(h_fast.grad_fn, attnres.ops.block_attn_res.OP.function._backward_cls)

    slow = leaves([*blocks, p, w, g])
    with counting() as ran:
        h_slow = torch.ops.attnres.block_attn_res(slow[:3], slow[3], slow[4],
                                                  slow[5] if rmsnorm else None, kw["eps"],
                                                  kw["scale"], rmsnorm)
        h_slow.backward(grad_h)
    assert ran == {"attnres::block_attn_res": 1, "attnres::block_attn_res_backward": 1}

    assert_same_bits(h_fast, h_slow, "h")
    assert_same_grads(fast, slow, "grad of input")

    # The public function itself under a mode: the custom ops, the same bits.
    moded = leaves([*blocks, p, w, g])
    with counting() as ran, CustomOpPath():
        h_moded = block_attn_res_fn(moded[:3], moded[3], moded[4], moded[5], **kw)
        h_moded.backward(grad_h)
    assert ran["attnres::block_attn_res"] == 1
    assert_same_bits(h_moded, h_fast, "h under a mode")
    for a, b in zip(moded, fast):
        if a is not None:
            assert_same_bits(a.grad, b.grad, "grad under a mode")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_single_op_without_autograd(dtype):
    """No input requires grad, or grad mode is off: the native forward is called
    directly and h is the custom op's, with no graph."""
    blocks, p, w, g = single_op_inputs(dtype)
    expected = torch.ops.attnres.block_attn_res(blocks, p, w, g, 1e-6, 1.0, True)
    with counting() as ran:
        h = block_attn_res_fn(blocks, p, w, g)
        with torch.no_grad():  # inputs that require grad, grad mode off
            h_no_grad = block_attn_res_fn(leaves(blocks), p, *leaves([w]), g)
        with torch.inference_mode():
            h_inference = block_attn_res_fn(blocks, p, w, g)
    assert ran == {}
    for name, got in (("no requires_grad", h), ("no_grad", h_no_grad),
                      ("inference_mode", h_inference)):
        assert got.grad_fn is None and not got.requires_grad, name
        assert_same_bits(got, expected, name)


def test_mixed_requires_grad_and_layouts():
    """Some inputs without requires_grad (no gradient is made for them), a tuple of
    blocks, a block that is a slice (read in place) and a transposed one (copied): the
    fast path still, and the custom op's bits."""
    blocks, p, w, g = single_op_inputs(torch.float32, num_blocks=4)
    wide = torch.randn(*SHAPE[:-1], 2 * D)
    wide[..., :D] = blocks[1]
    transposed = blocks[2].transpose(0, 1).contiguous().transpose(0, 1)
    inputs = [blocks[0], wide[..., :D], transposed, blocks[3], p, w, g]

    def run(path):
        xs = leaves(inputs)
        xs[1] = wide.clone().requires_grad_()[..., :D]  # a non-leaf view of a leaf
        xs[3].requires_grad_(False)
        xs[6].requires_grad_(False)
        if path == "fast":
            h = block_attn_res_fn(tuple(xs[:4]), xs[4], xs[5], xs[6], scale=0.5)
        else:
            h = torch.ops.attnres.block_attn_res(xs[:4], xs[4], xs[5], xs[6], 1e-6, 0.5, True)
        h.square().sum().backward()
        return h, xs

    with counting() as ran:
        h_fast, fast = run("fast")
    assert ran == {}
    h_slow, slow = run("op")
    assert_same_bits(h_fast, h_slow, "h")
    for i, (a, b) in enumerate(zip(fast, slow)):
        if i == 1:
            a, b = a._base, b._base
        assert_same_bits(a.grad, b.grad, f"grad {i}")
    assert fast[3].grad is None and fast[6].grad is None


def test_module_takes_the_fast_path_and_casts_parameters():
    """BlockAttnRes with fp32 parameters on bf16 activations (the cast is part of the
    graph), the fast path, the custom op's bits."""
    torch.manual_seed(0)
    m = BlockAttnRes(D, scale=0.8)
    with torch.no_grad():
        m.w.normal_()
        m.gamma.uniform_(0.5, 1.5)
    blocks, p, _, _ = single_op_inputs(torch.bfloat16)

    def run(mode):
        m.zero_grad(set_to_none=True)
        xs = leaves([*blocks, p])
        with mode:
            h = m(xs[:3], xs[3])
            h.float().square().sum().backward()
        return h, [x.grad for x in xs] + [m.w.grad.clone(), m.gamma.grad.clone()]

    with counting() as ran:
        h_fast, g_fast = run(contextlib.nullcontext())
    assert ran == {}
    with counting() as ran:
        h_slow, g_slow = run(CustomOpPath())
    assert ran["attnres::block_attn_res"] == 1
    assert_same_bits(h_fast, h_slow, "h")
    for i, (a, b) in enumerate(zip(g_fast, g_slow)):
        assert_same_bits(a, b, f"grad {i}")
    assert g_fast[-1].dtype == torch.float32  # fp32 master parameters get fp32 gradients


def test_saved_tensors_are_the_inputs_and_in_place_edits_are_caught():
    blocks, p, w, g = single_op_inputs(torch.float64)
    blocks, (p, w, g) = leaves(blocks), leaves([p, w, g])
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        h = block_attn_res_fn(blocks, p, w, g)
    assert len(packed) == 6 and all(a is b for a, b in zip(packed, [*blocks, p, w, g]))

    partial = p.detach().clone().requires_grad_()
    q = partial * 1.0
    h = block_attn_res_fn(blocks, q, w, g)
    q.add_(1.0)  # modifies a saved tensor after the forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


def test_double_backward_is_refused_as_by_the_op():
    """With create_graph=True the backward is the custom backward op, whose own missing
    autograd formula refuses the second backward: not a silent zero."""
    blocks, p, w, g = single_op_inputs(torch.float64)
    xs = leaves([*blocks, p, w, g])
    h = block_attn_res_fn(xs[:3], xs[3], xs[4], xs[5])
    (grad_w,) = torch.autograd.grad(h.sum(), xs[4], create_graph=True)
    assert grad_w.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        grad_w.sum().backward()
    blocks, w, g, p, _ = phase_inputs(torch.float64)
    xs = leaves([*blocks, w, g, p])
    outs, lses = block_attn_res_phase1(xs[:3], xs[3], xs[4])
    h = block_attn_res_phase2(outs[0], lses[0], xs[5], xs[3][0], xs[4][0])
    (grad_w,) = torch.autograd.grad(h.sum(), xs[3], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        grad_w.sum().backward()


def test_errors_are_those_of_the_validator():
    """Bad inputs leave the fast path and are named by the validator, as before."""
    blocks, p, w, g = single_op_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"^block_attn_res_fn: partial must be a torch\.float32"):
        block_attn_res_fn(blocks, p.double(), w, g)
    with pytest.raises(ValueError, match=r"^block_attn_res_fn: blocks\[1\] must be .* shape"):
        block_attn_res_fn([blocks[0], blocks[1][:1]], p, w, g)
    with pytest.raises(ValueError, match=r"^block_attn_res_fn: w must be"):
        block_attn_res_fn(blocks, p, w[:4], g)
    with pytest.raises(ValueError, match=r"^block_attn_res_fn: scale must be finite"):
        block_attn_res_fn(blocks, p, w, g, scale=float("nan"))
    with pytest.raises(ValueError, match=r"^block_attn_res_fn: blocks\[0\] must be a dense"):
        block_attn_res_fn([blocks[0].to_sparse()], p, w, g)
    with pytest.raises(ValueError, match=r"^BlockAttnRes: blocks must be a list or tuple"):
        BlockAttnRes(D)(blocks[0])
    with pytest.raises(ValueError, match=r"^BlockAttnRes: blocks\[0\] must be a tensor \[\.\.\., "
                                         r"D\], got a 0-d tensor"):
        BlockAttnRes(D)([torch.tensor(1.0)])


# ---------------------------------------------------------------------------------
# Tracing goes through the custom ops
# ---------------------------------------------------------------------------------

def test_eager_check():
    assert _native.eager()
    with CustomOpPath():
        assert not _native.eager()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not _native.eager()
    seen = []

    def probe(x):
        seen.append(_native.eager())
        return x

    torch.func.vmap(probe)(torch.ones(2, 3))
    torch.func.grad(lambda x: probe(x).sum())(torch.ones(3))
    assert seen == [False, False]


def test_compiled_function_runs_the_custom_ops():
    torch._dynamo.reset()
    blocks, p, w, g = single_op_inputs(torch.float32)

    def fn(b0, b1, b2, p, w, g):
        return block_attn_res_fn([b0, b1, b2], p, w, g, scale=0.5)

    eager = leaves([*blocks, p, w, g])
    with counting() as ran:
        h_eager = fn(*eager)
        h_eager.sum().backward()
    assert ran == {}
    compiled = leaves([*blocks, p, w, g])
    with counting() as ran:
        h_compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*compiled)
        h_compiled.sum().backward()
    assert ran == {"attnres::block_attn_res": 1, "attnres::block_attn_res_backward": 1}
    assert_same_bits(h_compiled, h_eager, "h")
    for a, b in zip(compiled, eager):
        assert_same_bits(a.grad, b.grad, "grad")


def test_make_fx_and_fake_tensors_see_the_custom_ops():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    blocks, p, w, g = single_op_inputs(torch.float32)
    graph = make_fx(lambda b0, b1, b2, p, w, g: block_attn_res_fn([b0, b1, b2], p, w, g))(
        *blocks, p, w, g)
    assert "attnres.block_attn_res" in graph.code
    graph = make_fx(lambda o, l, p, w: block_attn_res_phase2(o, l, p, w))(
        blocks[0], torch.zeros(SHAPE[:-1]), p, w)
    assert "attnres.phase2" in graph.code
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (*blocks, p, w, g)]
        h = block_attn_res_fn(fake[:3], fake[3], fake[4], fake[5])
        outs, lses = block_attn_res_phase1(fake[:3], fake[4][None], None)
    assert h.shape == SHAPE and type(h).__name__ == "FakeTensor"
    assert lses[0].shape == SHAPE[:-1]


# ---------------------------------------------------------------------------------
# The two phases
# ---------------------------------------------------------------------------------

def phase_inputs(dtype, num_queries=2, num_blocks=3, seed=1):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, mean=0.0, scale=1.0):
        return (mean + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    blocks = [randn(*SHAPE, scale=0.5 + i) for i in range(num_blocks)]
    return (blocks, randn(num_queries, D, scale=0.5), randn(num_queries, D, mean=1, scale=0.2),
            randn(*SHAPE), randn(D, mean=1, scale=0.2))


@pytest.mark.parametrize("gamma,rmsnorm", [(True, True), (False, True), (True, False)],
                         ids=["gamma", "no_gamma", "no_rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_phase1_paths_agree_bitwise(dtype, gamma, rmsnorm):
    blocks, w, g, _, _ = phase_inputs(dtype)
    g = g if gamma else None
    kw = dict(eps=1e-5, scale=0.7, rmsnorm=rmsnorm)

    def loss(outs, lses):  # lses[1] unused: its gradient is zero on both paths
        return (outs[0].float().square().sum() + 0.5 * outs[1].float().sum()
                + lses[0].float().sin().sum())

    fast = leaves([*blocks, w, g])
    with counting() as ran:
        outs, lses = block_attn_res_phase1(fast[:3], fast[3], fast[4], **kw)
        loss(outs, lses).backward()
    assert ran == {}
    slow = leaves([*blocks, w, g])
    with counting() as ran:
        result = torch.ops.attnres.phase1(slow[:3], slow[3], slow[4] if rmsnorm else None,
                                          kw["eps"], kw["scale"], rmsnorm)
        loss(result[:2], result[2:]).backward()
    assert ran == {"attnres::phase1": 1, "attnres::phase1_backward": 1}
    for a, b in zip([*outs, *lses], result):
        assert_same_bits(a, b, "phase 1 output")
    assert_same_grads(fast, slow, "phase 1 grad")
    with torch.no_grad(), counting() as ran:
        outs_ng, lses_ng = block_attn_res_phase1(blocks, w, g, **kw)
    assert ran == {}
    for a, b in zip([*outs_ng, *lses_ng], result):
        assert_same_bits(a, b, "phase 1 output without grad")


P2_CASES = {  # partial, gamma, rmsnorm, input_norm
    "full": (True, True, True, False),
    "input_norm": (True, True, True, True),
    "no_partial_input_norm": (False, True, True, True),
    "no_gamma": (True, False, True, False),
    "no_rmsnorm": (True, True, False, True),
}


@pytest.mark.parametrize("case", P2_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_phase2_paths_agree_bitwise(dtype, case):
    partial, gamma, rmsnorm, input_norm = P2_CASES[case]
    blocks, w, g, p, nw = phase_inputs(dtype, num_queries=1)
    with torch.no_grad():
        outs, lses = block_attn_res_phase1(blocks, w, g)
    inputs = [outs[0], lses[0], p if partial else None, w[0], g[0] if gamma else None,
              nw if input_norm else None]
    kw = dict(eps=1e-5, scale=0.7, rmsnorm=rmsnorm, norm_eps=1e-4)
    grad = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(dtype)

    fast = leaves(inputs)
    with counting() as ran:
        h_fast = block_attn_res_phase2(fast[0], fast[1], fast[2], fast[3], fast[4],
                                       norm_weight=fast[5], input_norm=input_norm, **kw)
        h_fast.backward(grad)
    assert ran == {}
    slow = leaves(inputs)
    with counting() as ran:
        h_slow = torch.ops.attnres.phase2(slow[0], slow[1], slow[2], slow[3],
                                          slow[4] if rmsnorm else None, slow[5], kw["eps"],
                                          kw["scale"], rmsnorm, input_norm, kw["norm_eps"])
        h_slow.backward(grad)
    assert ran == {"attnres::phase2": 1, "attnres::phase2_backward": 1}
    assert_same_bits(h_fast, h_slow, "h")
    assert_same_grads(fast, slow, "phase 2 grad")
    with torch.no_grad(), counting() as ran:
        h_ng = block_attn_res_phase2(*inputs[:5], norm_weight=inputs[5], input_norm=input_norm,
                                     **kw)
    assert ran == {}
    assert_same_bits(h_ng, h_slow, "h without grad")


# ---------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
@pytest.mark.parametrize("input_norm", [False, True])
def test_stream_paths_agree_bitwise(schedule, input_norm):
    torch.manual_seed(0)
    num, block_size = 5, 2
    res = BlockAttnResStream(D, num, block_size, schedule=schedule, input_norm=input_norm,
                             scale=0.8)
    with torch.no_grad():
        res.w.normal_(std=0.6)
        res.gamma.uniform_(0.7, 1.3)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh())
                                 for _ in range(num))
    embedding = torch.randn(SHAPE)
    params = list(res.parameters()) + list(layers.parameters())

    def run(mode):
        for q in params:
            q.grad = None
        e = embedding.clone().requires_grad_()
        with mode:
            y = res(e, layers)
            y.square().sum().backward()
        return [y, e.grad] + [q.grad.clone() for q in params]

    with counting() as ran:
        fast = run(contextlib.nullcontext())
    assert ran == {}
    with counting() as ran:
        slow = run(CustomOpPath())
    assert sum(ran.values()) > 0
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert_same_bits(a, b, f"stream result {i}")


def test_stream_without_grad_takes_the_fast_path():
    torch.manual_seed(0)
    res = BlockAttnResStream(D, 4, 2, input_norm=True)
    embedding = torch.randn(SHAPE).to(torch.bfloat16)
    with torch.no_grad(), counting() as ran:
        stream = res.begin(embedding)
        for _ in range(4):
            x = stream.next_input()
            assert x.dtype == torch.bfloat16 and not x.requires_grad
            stream.add(torch.tanh(x))
        y = stream.finish()
    assert ran == {} and y.shape == SHAPE


# ---------------------------------------------------------------------------------
# DistributedDataParallel: the gradient hooks see the fast path's gradients
# ---------------------------------------------------------------------------------

def _tiny_lm():
    from model_reference import TinyAttnResLM, randomize_attn_res
    torch.manual_seed(0)
    model = TinyAttnResLM(num_layers=3, layers_per_block=2, impl="native", scale=0.8).double()
    randomize_attn_res(model)
    return model


def _lm_tokens():
    return torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))


def _ddp_worker(rank: int, store_path: str, out_path: str) -> None:
    """One process of DDP (gloo) in a process of its own: torch 2.13's gloo workers can
    deadlock against a process group freed right after a backward (the worker frees
    the backward's allreduce, whose saved thread-local state holds a Python object, so
    it waits for the GIL that ~ProcessGroupGloo holds while it joins the worker). It
    hung CI one run in ten; here, as in test_ddp.py, the C++ group is never freed: DDP
    holds it past destroy_process_group and the process leaves with os._exit, also
    after an error (exit status 1, which fails mp.spawn in the test)."""
    from model_reference import lm_loss
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=rank,
                                world_size=1)
        model = _tiny_lm()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with counting() as ran:
            lm_loss(ddp, _lm_tokens()).backward()
        torch.save({"ran": ran, "grads": [p.grad for p in model.parameters()]}, out_path)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def test_ddp_gradients_through_the_fast_path(tmp_path):
    """DDP's reducer hooks fire on every parameter and the all-reduced gradients equal
    the custom-op path's bit for bit."""
    from model_reference import lm_loss
    reference = _tiny_lm()
    with CustomOpPath():
        lm_loss(reference, _lm_tokens()).backward()

    out_path = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_worker, args=(str(tmp_path / "store"), out_path), nprocs=1, join=True)
    result = torch.load(out_path)
    assert result["ran"] == {}
    names = [name for name, _ in reference.named_parameters()]
    assert len(result["grads"]) == len(names)
    for name, a, b in zip(names, result["grads"], reference.parameters()):
        assert_same_bits(a, b.grad, name)
