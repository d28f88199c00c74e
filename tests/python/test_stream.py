"""attnres.nn.BlockAttnResStream (SPEC section 5: the residual stream of a Block
AttnRes model) against a plain-torch twin written from the spec: the embedding is
block b_0; sub-layer j reads a softmax mix over depth of the completed blocks and the
partial block (the running sum of this block's sub-layer outputs) with query w[j]
(then its input RMSNorm with norm_weight[j] when the stream owns it); after
block_size sub-layers the partial block becomes a completed block; the output mixes
everything with the last query w[L].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import block_attnres.stream as stream_module
from block_attnres.nn import BlockAttnResStream
from block_attnres.ops import phase1
from block_attnres.two_phase import block_attn_res_phase1
from block_attnres.ops import custom_op_calls
from model_reference import reference_block_attn_res
from torch_reference import TOLERANCE, rel_err

F64 = torch.float64
D = 12
REAL_PHASE1_IN_STREAM = stream_module.phase1_in_stream


def twin(embedding, sublayers, w, gamma, norm_weight, *, block_size, eps, scale, rmsnorm,
         norm_eps, partial_dtype=None, inputs=None):
    """The stream in plain torch: one single-op AttnRes (stack + softmax) per sub-layer.

    partial_dtype: round each partial sum to this dtype in value (the gradient passes
    unchanged), as a stream in that dtype does. inputs: a list that receives every
    mix (the sub-layer inputs, then the output)."""
    blocks, partial = [embedding], None

    def mix(j):
        g = gamma[j] if gamma is not None else None
        h = reference_block_attn_res(blocks, partial, w[j], g, eps=eps, scale=scale,
                                     rmsnorm=rmsnorm)
        if norm_weight is not None:
            h = F.rms_norm(h, (h.shape[-1],), weight=norm_weight[j], eps=norm_eps)
        if inputs is not None:
            inputs.append(h)
        return h

    for j, sublayer in enumerate(sublayers):
        out = sublayer(mix(j))
        partial = out if partial is None else partial + out
        if partial_dtype is not None:
            partial = partial + (partial.detach().to(partial_dtype).to(partial.dtype)
                                 - partial.detach())
        if (j + 1) % block_size == 0:
            blocks.append(partial)
            partial = None
    return mix(len(sublayers))


def make_sublayers(num, dtype=F64, seed=0):
    torch.manual_seed(seed)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(num))
    return layers.to(dtype)


def randomize(res, seed=1):
    """Non-trivial queries and weights (the defaults are uniform attention)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        res.w.copy_(torch.randn(res.w.shape, generator=g, dtype=F64) * 0.6)
        for p in (res.gamma, res.norm_weight):
            if p is not None:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=F64))


def run_stream(res, embedding, sublayers, wrap=None):
    stream = res.begin(embedding)
    for layer in sublayers:
        f = layer if wrap is None else wrap(layer)
        stream.add(f(stream.next_input()))
    return stream.finish()


def stream_params(res):
    return [p for p in (res.w, res.gamma, res.norm_weight) if p is not None]


CONFIGS = {
    "default": dict(),
    "input_norm": dict(input_norm=True, norm_eps=1e-5, scale=0.8),
    "input_norm_no_gamma": dict(input_norm=True, gamma=False, eps=0.1),
    "rmsnorm_off": dict(rmsnorm=False, scale=1.3),
    "rmsnorm_off_input_norm": dict(rmsnorm=False, input_norm=True),
}
# (num_sublayers, block_size): full AttnRes (1), blocks of 2 and 3 that end inside the
# model or exactly at its end, and a block longer than the model.
SIZES = [(5, 1), (5, 2), (5, 3), (5, 7), (6, 2), (6, 3)]
TWIN_CASES = ([("default", s) for s in SIZES] + [("input_norm", s) for s in SIZES]
              + [("input_norm_no_gamma", s) for s in ((5, 1), (5, 3), (6, 2))]
              + [("rmsnorm_off", s) for s in ((5, 2), (5, 7), (6, 3))]
              + [("rmsnorm_off_input_norm", s) for s in ((5, 1), (5, 3), (6, 2))])


def _every_mix(res, emb, cs):
    """(embedding leaf, sub-layer output leaves, every mix: each sub-layer's input, then
    the final output) of a pass of `res` whose sub-layers return `cs`."""
    e = emb.clone().requires_grad_(True)
    c = [x.clone().requires_grad_(True) for x in cs]
    return e, c, run_leaf_stream(res, e, c)


@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
@pytest.mark.parametrize("config,sizes", TWIN_CASES,
                         ids=[f"{c}-L{s[0]}-bs{s[1]}" for c, s in TWIN_CASES])
def test_matches_plain_torch_twin_fp64(config, sizes, schedule):
    num, block_size = sizes
    kw = CONFIGS[config]
    res = BlockAttnResStream(D, num, block_size, schedule=schedule, dtype=F64, **kw)
    randomize(res)
    layers = make_sublayers(num)
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(2, 5, D, generator=g, dtype=F64, requires_grad=True)
    gy = torch.randn(2, 5, D, generator=g, dtype=F64)

    y = run_stream(res, emb, layers)
    y_ref = twin(emb, layers, res.w, res.gamma, res.norm_weight, block_size=block_size,
                 eps=res.eps, scale=res.scale, rmsnorm=res.rmsnorm, norm_eps=res.norm_eps)
    assert y.dtype == F64 and y.shape == emb.shape
    assert rel_err(y, y_ref) <= 1e-12

    params = [emb] + stream_params(res) + list(layers.parameters())
    names = (["embedding"] + [n for n in ("w", "gamma", "norm_weight")
                              if getattr(res, n) is not None]
             + [f"sublayer.{n}" for n, _ in layers.named_parameters()])
    grads = torch.autograd.grad((y * gy).sum(), params)
    ref_grads = torch.autograd.grad((y_ref * gy).sum(), params)
    for name, a, b in zip(names, grads, ref_grads):
        err = rel_err(a, b)
        assert err <= 1e-10, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("sizes", [(5, 2), (6, 3), (4, 1), (3, 5)], ids=lambda s: f"L{s[0]}-bs{s[1]}")
def test_phase1_runs_once_per_block_of_sublayers(sizes, monkeypatch):
    """SPEC section 5: phase 1 once per block of sub-layers (the final query joins the
    last block's phase 1 when no block completes in between); per_layer never runs it."""
    num, block_size = sizes
    calls = []
    real = stream_module.phase1_in_stream

    def spy(blocks, w, *args, **kwargs):
        calls.append((len(blocks), w.shape[0]))
        return real(blocks, w, *args, **kwargs)

    monkeypatch.setattr(stream_module, "phase1_in_stream", spy)
    emb = torch.randn(2, 3, D, dtype=F64)
    layers = make_sublayers(num)
    for schedule in ("two_phase", "per_layer"):
        calls.clear()
        res = BlockAttnResStream(D, num, block_size, schedule=schedule, dtype=F64)
        with torch.no_grad():
            run_stream(res, emb, layers)
        if schedule == "per_layer":
            assert calls == []
            continue
        # Blocks of sub-layers: queries [k*bs, (k+1)*bs) over 1 + k completed blocks.
        expected = []
        for k, first in enumerate(range(0, num, block_size)):
            queries = min(block_size, num - first)
            if first + queries == num and num % block_size != 0:
                queries += 1  # the final query mixes the same blocks
            expected.append((1 + k, queries))
        if num % block_size == 0:
            expected.append((1 + num // block_size, 1))  # the final mix on its own
        assert calls == expected
        assert sum(s for _, s in calls) == num + 1


@pytest.mark.parametrize("config", ["default", "input_norm", "rmsnorm_off"])
def test_schedules_agree_in_bf16(config):
    """two_phase and per_layer in bf16 (fp32 parameters, as in mixed-precision training).

    SPEC section 5 holds the schedule to section 3 "against the float64 single op on the
    same sources". So that both schedules see the same sources, each sub-layer returns a
    fixed bf16 tensor c_j (a leaf): then every mix x_j (each next_input() and finish())
    and every gradient of <gy_j, x_j> (embedding, c_k, w, gamma, norm_weight) is checked
    against the float64 twin on the same bf16 values: 8e-3 for x_j, 1e-2 for gradients.
    The two schedules then agree within twice that (one error on each side).
    (Through real bf16 sub-layers the schedules' rounding differences compound layer
    after layer: a whole-model comparison measures the model, not the op.)"""
    num, block_size = 7, 3
    bf16 = torch.bfloat16
    h_tol, grad_tol, _ = TOLERANCE[bf16]
    kw = CONFIGS[config]
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(4, 8, D, generator=g).to(bf16)
    cs = [(0.7 * torch.randn(4, 8, D, generator=g)).to(bf16) for _ in range(num)]
    gys = [torch.randn(4, 8, D, generator=g).to(bf16) for _ in range(num + 1)]

    per_schedule = {}
    for schedule in ("two_phase", "per_layer"):
        res = BlockAttnResStream(D, num, block_size, schedule=schedule, **kw)
        randomize(res)
        e, c, xs = _every_mix(res, emb, cs)
        leaves = [e] + c + stream_params(res)
        grads = [torch.autograd.grad((x.float() * gy.float()).sum(), leaves, retain_graph=True,
                                     allow_unused=True) for x, gy in zip(xs, gys)]

        # The oracle: float64 leaves holding the same (bf16) values.
        ref_params = [p.detach().to(bf16).to(F64).requires_grad_(True) for p in stream_params(res)]
        it = iter(ref_params)
        w_ref = next(it)
        gamma_ref = next(it) if res.gamma is not None else None
        nw_ref = next(it) if res.norm_weight is not None else None
        e_ref = emb.to(F64).requires_grad_(True)
        c_ref = [x.to(F64).requires_grad_(True) for x in cs]
        xs_ref = []
        twin(e_ref, [(lambda h, x=x: x) for x in c_ref], w_ref, gamma_ref, nw_ref,
             block_size=block_size, eps=res.eps, scale=res.scale, rmsnorm=res.rmsnorm,
             norm_eps=res.norm_eps, partial_dtype=bf16, inputs=xs_ref)
        ref_leaves = [e_ref] + c_ref + ref_params
        names = ["embedding"] + [f"c_{k}" for k in range(num)] + \
            [n for n in ("w", "gamma", "norm_weight") if getattr(res, n) is not None]
        for j, (x, x_ref, gy) in enumerate(zip(xs, xs_ref, gys)):
            assert x.dtype == bf16
            err = rel_err(x, x_ref)
            assert err <= h_tol, f"{schedule}: x_{j} relative error {err:.3g}"
            ref_grads = torch.autograd.grad((x_ref * gy.to(F64)).sum(), ref_leaves,
                                            retain_graph=True, allow_unused=True)
            for name, a, r in zip(names, grads[j], ref_grads):
                if r is None or not r.any():
                    assert a is None or not a.any(), f"{schedule}: d{name} of x_{j} not zero"
                    continue
                err = rel_err(a, r)
                assert err <= grad_tol, f"{schedule}: d{name} of x_{j}: relative error {err:.3g}"
        per_schedule[schedule] = (xs, grads)

    (xs2, g2), (xs1, g1) = per_schedule["two_phase"], per_schedule["per_layer"]
    for j in range(num + 1):
        assert rel_err(xs2[j], xs1[j]) <= 2 * h_tol
        for a, b in zip(g2[j], g1[j]):
            if a is not None and b is not None and b.any():
                assert rel_err(a, b) <= 2 * grad_tol


# ---------------------------------------------------------------------------------
# The fused partial-block update: inside a block, add(out) leaves the sum to the next
# phase 2 (block_attn_res_phase2(..., update=out)).
# ---------------------------------------------------------------------------------

class CountingMode(TorchFunctionMode):
    """Counts the additions of two tensors it sees; while it is active the front ends
    take the custom ops, so attnres.ops.custom_op_calls counts those."""

    def __init__(self):
        super().__init__()
        self.adds = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__add__, torch.Tensor.add, torch.add) and all(
                isinstance(a, torch.Tensor) for a in args[:2]):
            self.adds += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
@pytest.mark.parametrize("sizes", [(7, 3), (6, 3), (5, 2), (4, 1), (3, 5), (8, 4)],
                         ids=lambda s: f"L{s[0]}-bs{s[1]}")
def test_two_phase_stream_adds_only_at_block_ends(sizes, schedule):
    """two_phase: the only separate additions are those that close a block (its sum
    becomes a completed block); every mix at position >= 2 of its block runs the fused
    phase 2, the one at position 1 plain phase 2. per_layer adds as before. The results
    have the bits of the eager fast path."""
    num, block_size = sizes
    res = BlockAttnResStream(D, num, block_size, schedule=schedule, dtype=F64)
    randomize(res)
    emb = torch.randn(2, 3, D, dtype=F64)
    layers = [(lambda h, k=k: torch.tanh(h) * (0.5 + 0.1 * k)) for k in range(num)]
    positions = [j % block_size for j in range(num + 1)]  # of each mix in its block
    with torch.no_grad():
        eager = run_stream(res, emb, layers)
        before = dict(custom_op_calls)
        mode = CountingMode()
        with mode:
            traced = run_stream(res, emb, layers)
    ran = {k: v - before.get(k, 0) for k, v in custom_op_calls.items()}
    assert torch.equal(traced, eager)
    if schedule == "per_layer":
        # One per add() onto a partial block: every sub-layer's but a block's first.
        assert mode.adds == sum(1 for q in positions[:num] if q >= 1)
        assert ran.get("attnres::phase2_update", 0) == 0
        return
    assert mode.adds == (num // block_size if block_size > 1 else 0)
    assert ran.get("attnres::phase2_update", 0) == sum(1 for q in positions if q >= 2)
    assert ran.get("attnres::phase2", 0) == sum(1 for q in positions if q == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("config", ["default", "input_norm"])
def test_fused_stream_equals_the_unfused_stream(config, dtype, monkeypatch):
    """The stream against itself with the fusion undone (torch's add, then phase 2): every
    mix bit for bit; gradients bitwise in fp32 (the kernel adds in fp32, as torch
    does) and within a unit of bf16 in bf16 (the fused backward rounds dp + grad once,
    the unfused twice). Sub-layers return fixed leaves c_j (see
    test_schedules_agree_in_bf16)."""
    num, block_size = 8, 4
    kw = CONFIGS[config]
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(3, 5, D, generator=g).to(dtype)
    cs = [(0.7 * torch.randn(3, 5, D, generator=g)).to(dtype) for _ in range(num)]
    gys = [torch.randn(3, 5, D, generator=g).to(dtype) for _ in range(num + 1)]
    real = stream_module.phase2_in_stream

    def unfused(out, lse, partial, *args, update=None, **kwargs):
        if update is not None:
            partial = partial + update
        return real(out, lse, partial, *args, update=None, **kwargs)

    results = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(stream_module, "phase2_in_stream", unfused)
        res = BlockAttnResStream(D, num, block_size, **kw)
        randomize(res)
        e, c, xs = _every_mix(res, emb, cs)
        loss = sum((x.float() * gy.float()).sum() for x, gy in zip(xs, gys))
        grads = torch.autograd.grad(loss, [e] + c + stream_params(res))
        results.append(([x.detach() for x in xs], grads))
    (xs, grads), (xs_ref, grads_ref) = results
    for j, (a, b) in enumerate(zip(xs, xs_ref)):
        assert torch.equal(a, b), f"x_{j} differs from the unfused stream"
    names = ["embedding"] + [f"c_{k}" for k in range(num)] + ["w", "gamma", "norm_weight"]
    for name, a, b in zip(names, grads, grads_ref):
        if dtype == torch.float32:
            assert torch.equal(a, b), f"d{name} differs from the unfused stream"
        else:
            err = rel_err(a.float(), b.float())
            assert err <= 1e-2, f"d{name}: relative error {err:.3g} against the unfused stream"


# ---------------------------------------------------------------------------------
# Block gradients summed inside phase 1's backward (attnres.ops.phase1.BlockGradSums): each
# phase 1 call's kernel adds its share of a block's gradient into one running sum,
# and the block's first reader hands the sum to autograd.
# ---------------------------------------------------------------------------------

def pick(items, indices):
    return items if indices is None else [items[i] for i in indices]


def run_leaf_stream(res, emb, cs):
    """The stream with sub-layers that return fixed leaves c_j: (every mix, output last)."""
    stream = res.begin(emb)
    xs = []
    for c in cs:
        xs.append(stream.next_input())
        stream.add(c)
    xs.append(stream.finish())
    return xs


def phase1_spy(calls, skip=()):
    """A stand-in for stream.phase1_in_stream that appends each call's number of blocks
    to `calls`; the calls numbered in `skip` take the public function instead (as a
    call off the eager fast path does), leaving the sums to the others."""
    real = REAL_PHASE1_IN_STREAM

    def spy(blocks, w, gamma, sums, token, **kwargs):
        calls.append(len(blocks))
        if len(calls) - 1 in skip:
            outs, lses = block_attn_res_phase1(blocks, w, gamma, **kwargs)
            return outs, lses, token
        return real(blocks, w, gamma, sums, token, **kwargs)

    return spy


@pytest.mark.parametrize("sizes", [(6, 2), (7, 3), (4, 1)], ids=lambda s: f"L{s[0]}-bs{s[1]}")
def test_each_block_gradient_is_handed_to_autograd_once(sizes, monkeypatch):
    """Block i is read by every phase 1 call after its completion, so without the sums
    autograd receives sum_k N_k block gradients (N_k: the k-th call's blocks) and adds
    them; with them, the calls hand over one per block (the sum), and the gradients
    agree with those of the stream with every call off the sums."""
    num, block_size = sizes
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(2, 3, D, generator=g, dtype=F64)
    gy = torch.randn(2, 3, D, generator=g, dtype=F64)
    layers = make_sublayers(num)
    handed = []
    # Where the block gradients start in what each Function's backward returns.
    for cls, first in ((phase1.Phase1InStream, 4), (phase1.OP.function, 2)):
        def counting(ctx, *grads, real=cls.backward, first=first):
            num_blocks = len(ctx.saved_tensors) - 2  # the blocks, then w and gamma
            result = real(ctx, *grads)
            handed.append(sum(1 for x in result[first:first + num_blocks] if x is not None))
            return result
        monkeypatch.setattr(cls, "backward", staticmethod(counting))
    results = []
    for skip in ((), range(num + 1)):  # summing, then every call off the sums
        calls = []
        handed.clear()
        monkeypatch.setattr(stream_module, "phase1_in_stream", phase1_spy(calls, skip))
        res = BlockAttnResStream(D, num, block_size, dtype=F64)
        randomize(res)
        e = emb.clone().requires_grad_(True)
        y = run_stream(res, e, layers)
        grads = torch.autograd.grad((y * gy).sum(),
                                    [e] + stream_params(res) + list(layers.parameters()))
        results.append((sum(handed), grads, calls))
    (summed, grads, calls), (unsummed, grads_ref, _) = results
    assert summed == calls[-1] and unsummed == sum(calls) > summed
    for a, b in zip(grads, grads_ref):
        assert rel_err(a, b) <= 1e-13


@pytest.mark.parametrize("sizes", [(7, 3), (6, 2), (5, 1), (8, 4), (4, 6)],
                         ids=lambda s: f"L{s[0]}-bs{s[1]}")
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16], ids=["f64", "bf16"])
def test_two_phase_backward_runs_no_additions(sizes, dtype):
    """Every tensor the two-phase stream reads twice has its gradients added inside a
    kernel: a completed block's (phase 1's sums), a block's first output (phase 2 passes
    it through to its next reader). So autograd adds no stream-shaped gradients (the
    profiler sees every aten addition, and a dispatch mode would turn the fast path
    off); the same stream through per_layer adds them."""
    num, block_size = sizes
    emb = torch.randn(2, 3, D, dtype=dtype)
    layers = make_sublayers(num, dtype=dtype)
    for schedule in ("two_phase", "per_layer"):
        res = BlockAttnResStream(D, num, block_size, schedule=schedule, input_norm=True,
                                 dtype=dtype)
        randomize(res)
        e = emb.clone().requires_grad_(True)
        y = run_stream(res, e, layers)
        with torch.profiler.profile(record_shapes=True) as prof:
            torch.autograd.grad(y.float().square().sum(), [e] + stream_params(res))
        adds = sum(1 for ev in prof.events() if ev.name in ("aten::add", "aten::add_")
                   and ev.input_shapes[:2] == [list(emb.shape)] * 2)
        assert (adds == 0) == (schedule == "two_phase"), f"{schedule}: {adds} additions"


@pytest.mark.parametrize("block_size", [1, 2])
def test_block_gradient_sums_in_every_kind_of_backward(block_size, monkeypatch):
    """Against the float64 twin, sub-layers returning fixed leaves c_j (so that a block's
    gradient reaches it only through the phase 1 calls that read it, and early calls
    receive no gradient of their own outputs from the final output): the whole
    backward; backward passes from single mixes over one retained graph, each twice;
    and a stream whose second phase 1 call is off the eager path (not summing)."""
    num = 5
    g = torch.Generator().manual_seed(6)
    emb = torch.randn(2, 3, D, generator=g, dtype=F64)
    cs = [torch.randn(2, 3, D, generator=g, dtype=F64) for _ in range(num)]
    gys = [torch.randn(2, 3, D, generator=g, dtype=F64) for _ in range(num + 1)]
    res = BlockAttnResStream(D, num, block_size, dtype=F64)
    randomize(res)
    ref_leaves = [emb.clone().requires_grad_(True)] + [c.clone().requires_grad_(True)
                                                        for c in cs]
    xs_ref = []
    twin(ref_leaves[0], [(lambda h, c=c: c) for c in ref_leaves[1:]], res.w, res.gamma, None,
         block_size=block_size, eps=res.eps, scale=res.scale, rmsnorm=res.rmsnorm,
         norm_eps=res.norm_eps, inputs=xs_ref)
    for skip in ((), (1,)):
        monkeypatch.setattr(stream_module, "phase1_in_stream", phase1_spy([], skip))
        leaves = [emb.clone().requires_grad_(True)] + [c.clone().requires_grad_(True)
                                                        for c in cs]
        xs = run_leaf_stream(res, leaves[0], leaves[1:])
        params = leaves + stream_params(res)
        ref_params = ref_leaves + stream_params(res)
        # The output for all leaves, then for one (autograd runs only the calls on its
        # paths, leaving earlier blocks' sums behind), then single mixes.
        for j, wrt in [(num, None), (num, [3]), (num, None), (0, None), (2, None),
                       (num - 1, None)]:
            for _ in range(2):
                grads = torch.autograd.grad((xs[j] * gys[j]).sum(), pick(params, wrt),
                                            retain_graph=True, allow_unused=True)
                ref = torch.autograd.grad((xs_ref[j] * gys[j]).sum(), pick(ref_params, wrt),
                                          retain_graph=True, allow_unused=True)
                for k, (a, b) in enumerate(zip(grads, ref)):
                    if b is None or not b.any():
                        assert a is None or not a.any(), f"skip {skip}: x_{j} leaf {k}"
                    else:
                        assert rel_err(a, b) <= 1e-12, f"skip {skip}: x_{j} leaf {k}"


class StreamModel(nn.Module):
    def __init__(self, num, block_size, schedule, input_norm):
        super().__init__()
        self.res = BlockAttnResStream(D, num, block_size, schedule=schedule,
                                      input_norm=input_norm, scale=0.9)
        randomize(self.res)
        self.layers = make_sublayers(num, dtype=torch.float32)

    def forward(self, x):
        return run_stream(self.res, x, self.layers)


@pytest.mark.parametrize("schedule,input_norm", [("two_phase", True), ("per_layer", False)])
def test_compiled_fullgraph_matches_eager(schedule, input_norm):
    torch._dynamo.reset()
    model = StreamModel(5, 2, schedule, input_norm)
    x = torch.randn(2, 4, D)
    gy = torch.randn(2, 4, D)
    results = []
    for m in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        grads = torch.autograd.grad((y * gy).sum(), [xx] + list(model.parameters()))
        results.append((y.detach(), grads))
    (y, grads), (cy, cgrads) = results
    torch.testing.assert_close(cy, y)
    for a, b in zip(cgrads, grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("schedule", ["two_phase", "per_layer"])
def test_checkpointed_sublayers_give_the_same_gradients(schedule):
    num, block_size = 5, 2
    res = BlockAttnResStream(D, num, block_size, schedule=schedule, input_norm=True, dtype=F64)
    randomize(res)
    layers = make_sublayers(num)
    emb = torch.randn(2, 3, D, dtype=F64)
    results = []
    for wrap in (None, lambda layer: (lambda x: checkpoint(layer, x, use_reentrant=False))):
        e = emb.clone().requires_grad_(True)
        y = run_stream(res, e, layers, wrap=wrap)
        params = [e] + stream_params(res) + list(layers.parameters())
        results.append((y.detach(), torch.autograd.grad(y.square().sum(), params)))
    (y, grads), (cy, cgrads) = results
    torch.testing.assert_close(cy, y, rtol=0, atol=0)
    for a, b in zip(cgrads, grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def stream_grads(res, layers, emb, wrap_stream=None, backward=None):
    """Gradients of the stream's output (squared, summed) for the embedding, the stream's
    and the sub-layers' parameters; `wrap_stream(f, e)` runs f(e) (checkpointing),
    `backward(loss)` replaces loss.backward()."""
    e = emb.clone().requires_grad_(True)
    params = [e] + stream_params(res) + list(layers.parameters())
    for p in params:
        p.grad = None
    run = lambda x: run_stream(res, x, layers)
    y = run(e) if wrap_stream is None else wrap_stream(run, e)
    loss = y.square().sum()
    (backward or torch.Tensor.backward)(loss)
    return [p.grad.clone() for p in params]


def normed_stream(num, block_size):
    """(stream with the input norm, its sub-layers, an embedding), float64."""
    res = BlockAttnResStream(D, num, block_size, input_norm=True, dtype=F64)
    randomize(res)
    return res, make_sublayers(num), torch.randn(2, 3, D, dtype=F64)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_the_whole_stream(use_reentrant):
    """Activation checkpointing around the whole stream (recomputed in the backward,
    with a saved-tensor hook that lets each saved tensor be unpacked once when not
    reentrant): the gradients of the plain backward, and every phase 1 backward reads
    its saved tensors once."""
    res, layers, emb = normed_stream(7, 2)
    ref = stream_grads(res, layers, emb)
    grads = stream_grads(res, layers, emb, wrap_stream=lambda f, e: checkpoint(
        f, e, use_reentrant=use_reentrant))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    counts = {"pack": 0, "unpack": 0}

    def pack(t):
        counts["pack"] += 1
        return t

    def unpack(t):
        counts["unpack"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        stream_grads(res, layers, emb)
    assert counts["unpack"] == counts["pack"] > 0


def test_compiled_autograd_backward_of_an_eager_stream():
    """The backward traced by compiled autograd after an eager forward: each phase 1
    call returns its own block gradients there (no sums), with the eager gradients."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch._dynamo.reset()
    res, layers, emb = normed_stream(5, 2)
    ref = stream_grads(res, layers, emb)

    def traced(loss):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()

    for _ in range(2):  # the second backward reuses the compiled graph
        grads = stream_grads(res, layers, emb, backward=traced)
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_partial_backward_leaves_no_gradient_sums_behind():
    """autograd.grad for one sub-layer's parameters runs only the phase 1 calls on its
    paths, so earlier blocks' sums are never handed over; the end of the pass drops
    them rather than keeping them alive with the graph."""
    num, block_size = 6, 2
    res = BlockAttnResStream(D, num, block_size, dtype=F64)
    randomize(res)
    layers = make_sublayers(num)
    e = torch.randn(2, 3, D, dtype=F64, requires_grad=True)
    stream = res.begin(e)
    for layer in layers:
        stream.add(layer(stream.next_input()))
    loss = stream.finish().square().sum()
    torch.autograd.grad(loss, list(layers[3].parameters()), retain_graph=True)
    assert stream._grad_sums.sums == {}
    torch.autograd.grad(loss, [e])
    assert stream._grad_sums.sums == {}


# ---------------------------------------------------------------------------------
# Misuse.
# ---------------------------------------------------------------------------------

@pytest.fixture(params=["two_phase", "per_layer"])
def fresh(request):
    res = BlockAttnResStream(D, 3, 2, schedule=request.param, dtype=F64)
    emb = torch.randn(2, 3, D, dtype=F64)
    return res, emb


def test_next_input_twice_without_add(fresh):
    res, emb = fresh
    s = res.begin(emb)
    s.next_input()
    with pytest.raises(RuntimeError, match="next_input"):
        s.next_input()


def test_add_before_next_input(fresh):
    res, emb = fresh
    s = res.begin(emb)
    with pytest.raises(RuntimeError, match="add"):
        s.add(emb)
    s.add(s.next_input())  # still usable
    with pytest.raises(RuntimeError, match="add"):
        s.add(emb)


def test_more_sublayers_than_declared(fresh):
    res, emb = fresh
    s = res.begin(emb)
    for _ in range(3):
        s.add(s.next_input())
    with pytest.raises(RuntimeError, match="3"):
        s.next_input()


def test_calls_after_finish(fresh):
    res, emb = fresh
    s = res.begin(emb)
    for _ in range(3):
        s.add(s.next_input())
    s.finish()
    for call in (s.next_input, s.finish, lambda: s.add(emb)):
        with pytest.raises(RuntimeError, match="finish"):
            call()


def test_finish_early(fresh):
    res, emb = fresh
    s = res.begin(emb)
    with pytest.raises(RuntimeError, match="finish"):
        s.finish()
    s.add(s.next_input())
    x = s.next_input()
    with pytest.raises(RuntimeError, match="finish"):
        s.finish()  # awaiting add
    s.add(x)
    with pytest.raises(RuntimeError, match="finish"):
        s.finish()  # 2 of 3


@pytest.mark.parametrize("bad", ["shape", "dtype", "not_a_tensor"])
def test_add_wrong_out(fresh, bad):
    res, emb = fresh
    s = res.begin(emb)
    x = s.next_input()
    out = {"shape": x[..., :-1], "dtype": x.float(), "not_a_tensor": [1.0]}[bad]
    with pytest.raises(ValueError, match=r"\bout\b"):
        s.add(out)
    s.add(x)  # the failed add left the stream as it was


@pytest.mark.parametrize("kwargs,name", [
    (dict(block_size=0), "block_size"), (dict(num_sublayers=0), "num_sublayers"),
    (dict(schedule="fused"), "schedule"), (dict(eps=-1.0), "eps"),
    (dict(scale=float("nan")), "scale")])
def test_bad_construction(kwargs, name):
    args = dict(dim=D, num_sublayers=3, block_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        BlockAttnResStream(**args)


def test_begin_with_wrong_embedding():
    res = BlockAttnResStream(D, 3, 2)
    with pytest.raises(ValueError, match="embedding"):
        res.begin(torch.zeros(2, 3, D + 1))
