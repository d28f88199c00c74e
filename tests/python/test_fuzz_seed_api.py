"""Fuzzing the seed-compatible entry points with a seeded random generator.

Each case starts from valid arguments of attnres.block_attn_res or
attnres.block_attn_res_backward (random B, T, D, N, dtype, flags; B or T may be 0)
and applies up to three random perturbations: wrong dtype, shape, rank or device
of one tensor, a non-tensor where a tensor belongs, an empty, oversized or
non-list block list, non-contiguous, expanded (stride 0), aliased or sparse
tensors, missing caches or gamma, and scalars that are NaN, Inf, negative, None
or of the wrong type.

The contract (SPEC 2.1, docs/RELIABILITY.md): a call either returns results of
the documented shapes or raises ValueError/TypeError; it never crashes the
process, never raises anything else, and never modifies its inputs (checked
bitwise). The generator is seeded, so a failure names the case that reproduces it.
"""
import os
import random
import time

import pytest
import torch

import block_attnres as attnres

from conftest import assert_bitwise_unchanged, clone_tree

SEED = int(os.environ.get("ATTNRES_FUZZ_SEED", "20240611"))  # another seed: a longer hunt
NUM_CASES = 3000
TIME_BUDGET_S = 20.0  # stop early on a slow machine; the case count is reported
# Sparse tensors reach torch calls that raise RuntimeError before any check
# rejects them (see test_sparse_tensor_raises_value_error); left out of the fuzz
# until that is fixed.
ALLOW_SPARSE = True

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
BAD_DTYPES = [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8, torch.float64,
              torch.float32, torch.bfloat16]
BAD_SCALARS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e308, None, "1.0", 1j,
               [1.0], True, 3]
BAD_OBJECTS = [None, 1.0, "tensor", [1.0, 2.0], (), object()]


def _rand(rng, shape, dtype):
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _valid_case(rng):
    B, T, D = rng.choice([0, 1, 2]), rng.choice([0, 1, 3]), rng.randint(1, 9)
    if rng.random() < 0.8:
        B, T = max(B, 1), max(T, 1)
    N = rng.randint(1, 4)
    dtype = rng.choice(DTYPES)
    rmsnorm = rng.random() < 0.7
    shape = (B, T, D)
    blocks = [_rand(rng, shape, dtype) for _ in range(N)]
    partial = _rand(rng, shape, dtype) if rng.random() < 0.6 else None
    L = N + (partial is not None)
    w = _rand(rng, (D,), dtype) * 0.3
    gamma = 1 + 0.1 * _rand(rng, (D,), dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if rng.random() < 0.5:
        kwargs = dict(blocks=blocks, proj_weight=w, partial_block=partial,
                      scale=rng.choice([1.0, 0.5, -2.0]), rmsnorm_eps=1e-6,
                      rmsnorm_gamma=gamma if rmsnorm or rng.random() < 0.3 else None,
                      enable_rmsnorm=rmsnorm, rms_out_flag=rmsnorm and rng.random() < 0.5,
                      alpha_out_flag=rng.random() < 0.5)
        return attnres.block_attn_res, kwargs, shape, L
    alpha = torch.softmax(_rand(rng, (B, T, L), acc), dim=-1)
    rms = (1 + _rand(rng, (B, T, L, 1), acc).abs()) if rmsnorm else None
    kwargs = dict(grad_h=_rand(rng, shape, dtype), blocks=blocks, proj_weight=w,
                  alpha_cache=alpha, partial_block=partial,
                  rmsnorm_gamma=gamma if rmsnorm else None, rms_cache=rms,
                  scale=rng.choice([1.0, 0.25]), enable_rmsnorm=rmsnorm)
    return attnres.block_attn_res_backward, kwargs, shape, L


def _tensor_keys(kwargs):
    """Keys of ordinary (strided, CPU) tensors: the ones later changes start from."""
    return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)
            and v.layout == torch.strided and v.device.type == "cpu"]


def _perturb(rng, kwargs, shape):
    """One random change; returns a short description."""
    kind = rng.randrange(14)
    tensor_keys = _tensor_keys(kwargs)
    if kind == 0 and tensor_keys:  # dtype
        k, dt = rng.choice(tensor_keys), rng.choice(BAD_DTYPES)
        kwargs[k] = kwargs[k].to(dt) if dt != torch.bool else kwargs[k] > 0
        return f"{k}.dtype={dt}"
    if kind == 1 and tensor_keys:  # shape
        k = rng.choice(tensor_keys)
        t = kwargs[k]
        new_shape = list(t.shape)
        op = rng.randrange(4)
        if op == 0 and new_shape:
            new_shape[rng.randrange(len(new_shape))] += 1
        elif op == 1:
            new_shape.append(1)
        elif op == 2 and new_shape:
            new_shape.pop()
        else:
            new_shape = []
        kwargs[k] = torch.zeros(new_shape, dtype=t.dtype)
        return f"{k}.shape={tuple(new_shape)}"
    if kind == 2:  # a non-tensor where a tensor belongs
        k = rng.choice(tensor_keys + ["blocks"])
        kwargs[k] = rng.choice(BAD_OBJECTS)
        return f"{k}={kwargs[k]!r}"
    if kind == 3:  # block list shape
        op = rng.randrange(5)
        blocks = kwargs["blocks"]
        if op == 0:
            kwargs["blocks"] = []
        elif op == 1:
            kwargs["blocks"] = tuple(blocks) if isinstance(blocks, list) else blocks
        elif op == 2 and isinstance(blocks, list) and blocks:
            kwargs["blocks"] = blocks[0]  # a tensor, not a list
        elif op == 3 and isinstance(blocks, list) and blocks:
            kwargs["blocks"] = [blocks[0]] * 128  # beyond the seed's N <= 127
        elif isinstance(blocks, list) and blocks:
            kwargs["blocks"] = blocks + [blocks[0]]  # aliased inputs: valid
        return f"blocks variant {op}"
    if kind == 4 and tensor_keys:  # non-contiguous / expanded / sliced views
        k = rng.choice(tensor_keys)
        t = kwargs[k]
        op = rng.randrange(3)
        if op == 0 and t.dim() >= 2:
            kwargs[k] = t.transpose(0, 1).contiguous().transpose(0, 1)
        elif op == 1 and t.dim() >= 1:
            wide = torch.zeros(t.shape[:-1] + (t.shape[-1] + 3,), dtype=t.dtype)
            wide[..., : t.shape[-1]] = t
            kwargs[k] = wide[..., : t.shape[-1]]
        elif t.dim() >= 1 and t.numel() > 0:
            kwargs[k] = t[..., :1].expand(t.shape)  # stride 0 along D
        return f"{k} view {op}"
    if kind == 5:  # scale / eps
        k = rng.choice([k for k in ("scale", "rmsnorm_eps") if k in kwargs] or ["scale"])
        kwargs[k] = rng.choice(BAD_SCALARS)
        return f"{k}={kwargs[k]!r}"
    if kind == 6:  # flags of other types or values
        flags = [k for k in ("enable_rmsnorm", "rms_out_flag", "alpha_out_flag") if k in kwargs]
        k = rng.choice(flags)
        kwargs[k] = rng.choice([True, False, 0, 1, 2, None, "yes", ""])
        return f"{k}={kwargs[k]!r}"
    if kind == 7:  # optional tensors removed
        k = rng.choice([k for k in ("rmsnorm_gamma", "rms_cache", "alpha_cache", "partial_block")
                        if k in kwargs])
        kwargs[k] = None
        return f"{k}=None"
    if kind == 8 and tensor_keys:  # meta device
        k = rng.choice(tensor_keys)
        kwargs[k] = kwargs[k].to("meta")
        return f"{k} on meta"
    if kind == 9 and tensor_keys and ALLOW_SPARSE:  # sparse layout
        k = rng.choice(tensor_keys)
        kwargs[k] = kwargs[k].to_sparse()
        return f"{k} sparse"
    if kind == 10 and tensor_keys:  # non-finite values: valid input
        k = rng.choice(tensor_keys)
        t = kwargs[k].clone()
        if t.is_floating_point() and t.numel():
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf")])
        kwargs[k] = t
        return f"{k} has a non-finite value"
    if kind == 11 and tensor_keys:  # requires_grad inputs: valid
        k = rng.choice(tensor_keys)
        if kwargs[k].is_floating_point():
            kwargs[k] = kwargs[k].detach().requires_grad_(True)
        return f"{k} requires grad"
    if kind == 12 and "blocks" in kwargs and isinstance(kwargs["blocks"], list) and kwargs["blocks"]:
        i = rng.randrange(len(kwargs["blocks"]))
        blocks = list(kwargs["blocks"])
        blocks[i] = rng.choice(BAD_OBJECTS + [torch.zeros(shape[-1:])])
        kwargs["blocks"] = blocks
        return f"blocks[{i}] = {type(blocks[i]).__name__}"
    return "none"


def _check_result(fn, kwargs, result):
    """Shape sanity of a successful call (the numerics are tested elsewhere)."""
    first = kwargs["blocks"][0]
    if fn is attnres.block_attn_res:
        out = result[0] if isinstance(result, tuple) else result
        assert out.shape == first.shape and out.dtype == first.dtype
    else:
        grad_blocks = result[0]
        assert len(grad_blocks) == len(kwargs["blocks"])
        for g in grad_blocks:
            assert g.shape == first.shape and g.dtype == first.dtype


def test_seed_api_fuzz():
    rng = random.Random(SEED)
    start = time.monotonic()
    outcomes = {"ok": 0, "ValueError": 0, "TypeError": 0}
    for case in range(NUM_CASES):
        if time.monotonic() - start > TIME_BUDGET_S:
            break
        case_seed = rng.getrandbits(32)
        crng = random.Random(case_seed)
        fn, kwargs, shape, _ = _valid_case(crng)
        changes = [_perturb(crng, kwargs, shape) for _ in range(crng.choice([0, 1, 1, 2, 3]))]
        snapshot = clone_tree(kwargs)
        where = f"case {case} (random.Random({case_seed})): {fn.__name__} after {changes}"
        try:
            result = fn(**kwargs)
        except (ValueError, TypeError) as e:
            outcomes["ValueError" if isinstance(e, ValueError) else "TypeError"] += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{where}: raised {type(e).__name__}: {e}")
        else:
            outcomes["ok"] += 1
            _check_result(fn, kwargs, result)
        with torch.no_grad():
            try:
                assert_bitwise_unchanged(snapshot, kwargs)
            except AssertionError as e:
                pytest.fail(f"{where}: an input was modified: {e}")
    total = sum(outcomes.values())
    print(f"seed API fuzz: {total} cases in {time.monotonic() - start:.1f} s: {outcomes}")
    assert total >= 200, f"too few cases ran: {outcomes}"
    assert outcomes["ok"] > 0 and outcomes["ValueError"] > 0, outcomes


@pytest.mark.parametrize("which", ["blocks", "partial_block", "proj_weight", "rmsnorm_gamma"])
def test_sparse_tensor_raises_value_error(which):
    rng = random.Random(7)
    while True:
        fn, kwargs, _, _ = _valid_case(rng)
        if fn is attnres.block_attn_res and kwargs["partial_block"] is not None \
                and kwargs["rmsnorm_gamma"] is not None:
            break
    if which == "blocks":
        kwargs["blocks"] = [kwargs["blocks"][0].to_sparse()] + kwargs["blocks"][1:]
    else:
        kwargs[which] = kwargs[which].to_sparse()
    with pytest.raises(ValueError):
        fn(**kwargs)
