"""Shared helpers for the Python tests of the seed-compatible attnres API.

The float64 oracle lives in torch_reference.py beside this file; this directory is
put on sys.path so the test modules can `import torch_reference` however pytest is
invoked (from the repository root or from tests/python).
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

DATA_DIR = os.path.join(os.path.dirname(HERE), "data")
GOLDEN_PATH = os.path.join(DATA_DIR, "block_attn_res_f64.json")


# The tests `scripts/test.sh --quick` leaves out (pytest -m "not slow"): each spends
# seconds in training runs, worker processes with a process group, compiled autograd
# or thousands of fuzz cases, while the fast tests cover the same code paths on small
# problems. An entry "file::function" covers every parametrization of the function;
# the full run (scripts/test.sh, CI) runs them all.
SLOW_TESTS = (
    "test_train_lm_smoke.py::test_quick_run_learns",
    "test_train_lm_smoke.py::test_resume_is_bit_identical",
    "test_train_lm_smoke.py::test_plot_writes_png",
    "test_fuzz_seed_api.py::test_seed_api_fuzz",
    "test_stream.py::test_compiled_autograd_backward_of_an_eager_stream",
    "test_ddp.py::test_ddp_one_step_matches_single_process",
    "test_stream_distributed.py::test_stream_one_step_matches_single_process",
    "test_fast_path.py::test_ddp_gradients_through_the_fast_path",
)


def pytest_collection_modifyitems(config, items):
    """Marks SLOW_TESTS slow; warns about an entry that names a collected file but
    no test in it (a renamed test would otherwise drop out of the list unseen)."""
    files = {os.path.basename(item.path) for item in items}
    matched = set()
    for item in items:
        entry = f"{os.path.basename(item.path)}::{getattr(item, 'originalname', item.name)}"
        if entry in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
            matched.add(entry)
    for entry in SLOW_TESTS:
        if entry not in matched and entry.split("::")[0] in files:
            config.issue_config_time_warning(
                pytest.PytestWarning(f"conftest.SLOW_TESTS: {entry} matches no test"), 2)


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator seeded from the test's node id, so every test is reproducible
    on its own and tests do not share random streams."""
    seed = sum((i + 1) * ord(c) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return make_generator(seed)


def random_inputs(g: torch.Generator, B: int, T: int, D: int, N: int, partial: bool,
                  dtype: torch.dtype) -> dict:
    """One seed-API case: N blocks (+ optional partial) [B,T,D], proj_weight [D],
    rmsnorm_gamma [D] and an upstream gradient grad_h [B,T,D], all of `dtype`.

    Values are drawn in float32 and rounded once to `dtype`; the reference is fed
    these rounded values. Blocks get different magnitudes so their RMS differ, and
    w is scaled by 1/sqrt(D) so the logits stay O(scale) for every D (a softmax that
    is not saturated keeps every gradient term alive)."""
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    blocks = [(randn(B, T, D) * (0.5 + 1.5 * i / max(N - 1, 1))).to(dtype) for i in range(N)]
    return {
        "blocks": blocks,
        "partial_block": (randn(B, T, D) * 0.8).to(dtype) if partial else None,
        "proj_weight": (randn(D) / D ** 0.5).to(dtype),
        "rmsnorm_gamma": (1.0 + 0.3 * randn(D)).to(dtype),
        "grad_h": randn(B, T, D).to(dtype),
    }


@pytest.fixture
def make_inputs(gen):
    """Factory fixture: make_inputs(B, T, D, N, partial, dtype) -> dict (see random_inputs)."""
    def make(B, T, D, N, partial, dtype):
        return random_inputs(gen, B, T, D, N, partial, dtype)
    return make


def clone_tree(x):
    """Deep copy of tensors inside (nested) lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


def assert_bitwise_unchanged(before, after, path="inputs"):
    """Every tensor in `after` has the same layout, device, shape, dtype and bits as in
    `before` (a meta tensor has no bits; a sparse one is compared dense)."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert before.layout == after.layout and before.device == after.device, path
        assert after.shape == before.shape and after.dtype == before.dtype, path
        if before.device.type == "meta":
            return
        if before.layout != torch.strided:
            before, after = before.to_dense(), after.to_dense()
        # Compare raw bits so NaNs compare equal to themselves.
        assert torch.equal(_bits(after), _bits(before)), f"{path} was modified"
    elif isinstance(before, dict):
        for k in before:
            assert_bitwise_unchanged(before[k], after[k], f"{path}[{k!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), f"{path}: length changed"
        for i, (b, a) in enumerate(zip(before, after)):
            assert_bitwise_unchanged(b, a, f"{path}[{i}]")
    else:
        assert before is after or before == after, path


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(int_type)


@pytest.fixture
def bits_equal():
    """bits_equal(a, b): same shape, dtype and bits (NaNs included)."""
    def eq(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    return eq


@pytest.fixture
def snapshot():
    """snapshot(tree) -> deep copy of every tensor in a nested list/tuple/dict."""
    return clone_tree


@pytest.fixture
def assert_unchanged():
    """assert_unchanged(before, after): every tensor has the same bits as its snapshot."""
    return assert_bitwise_unchanged
