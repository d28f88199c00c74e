"""BlockAttnResStream scaled out: DistributedDataParallel and FSDP2 (fully_shard), gloo,
2 CPU processes, each against one process taking the same step on the whole batch.

The model is a small stack whose sub-layers are Linear + tanh, with the two-phase
stream as its residual (input norm fused), in float64 so the comparison is tight.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import block_attnres as attnres
from data_parallel import assert_same_state, one_step_both_ways

BATCH = 4
DIM = 16


class StreamModel(nn.Module):
    def __init__(self, num_sublayers: int = 6, block_size: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.sublayers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(num_sublayers))
        self.res = attnres.nn.BlockAttnResStream(DIM, num_sublayers, block_size, scale=0.8,
                                                 input_norm=True)
        self.head = nn.Linear(DIM, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        stream = self.res.begin(self.embed(tokens))
        for layer in self.sublayers:
            stream.add(torch.tanh(layer(stream.next_input())))
        return self.head(stream.finish())


def _make_model_and_batch():
    torch.manual_seed(0)
    model = StreamModel().double()
    with torch.no_grad():  # away from the initial zeros/ones, so every gradient matters
        model.res.w.normal_(0, 0.5)
        model.res.gamma.add_(0.1 * torch.randn_like(model.res.gamma))
        model.res.norm_weight.add_(0.1 * torch.randn_like(model.res.norm_weight))
    tokens = torch.randint(0, 32, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def _fsdp2(model):
    return _fully_shard()(model)


# FSDP2 on the CPU with gloo (torch 2.13.0) takes a different step than one process for
# this model whatever its residual: with the stream replaced by plain residuals
# (x = x + tanh(layer(x))) every parameter still differs by ~1e-2 after one step,
# while a Linear/Embedding stack without the 3-D token batch matches to 1e-17. So the
# mismatch is FSDP2's on this platform, not the stream's; strict, so that a torch in
# which it works turns this into a failure to update.
FSDP2_MISMATCH = pytest.mark.xfail(strict=True, reason=(
    "FSDP2 + gloo on the CPU (torch 2.13.0) does not match one process for this "
    "harness even with plain residuals"))


@pytest.mark.parametrize("wrapper", ["ddp", pytest.param("fsdp2", marks=FSDP2_MISMATCH)])
def test_stream_one_step_matches_single_process(tmp_path, monkeypatch, wrapper):
    if wrapper == "fsdp2":
        try:
            _fully_shard()
        except ImportError as e:
            pytest.skip(f"this torch has no FSDP2 fully_shard: {e}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parallel, state, before = one_step_both_ways(
        str(tmp_path / "rank0.pt"), _make_model_and_batch, _loss,
        {"ddp": _ddp, "fsdp2": _fsdp2}[wrapper])
    assert_same_state(parallel, state)
    for name in ("res.w", "res.gamma", "res.norm_weight"):
        assert not torch.equal(state[name], before[name]), name
