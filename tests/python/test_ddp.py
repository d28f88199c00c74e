"""DistributedDataParallel (gloo, 2 CPU processes) over a Block AttnRes stack.

After one SGD step on half a batch each, the parameters equal those of one process
that took the same step on the whole batch.
"""

from __future__ import annotations

import torch

from data_parallel import assert_same_state, one_step_both_ways
from model_reference import TinyAttnResLM, lm_loss, randomize_attn_res

BATCH = 4


def _make_model_and_batch():
    torch.manual_seed(0)
    model = TinyAttnResLM(num_layers=4, layers_per_block=2, impl="native", scale=0.8)
    model = model.double()
    randomize_attn_res(model)
    tokens = torch.randint(0, 32, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def test_ddp_one_step_matches_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    parallel, state, before = one_step_both_ways(str(tmp_path / "rank0.pt"),
                                                 _make_model_and_batch, lm_loss, _ddp)
    assert_same_state(parallel, state)
    # The step moved every AttnRes parameter (so the comparison above is not vacuous),
    # except those of layer 0's first AttnRes: it sees one source, the embedding, and a
    # softmax over one logit has no gradient.
    for name in state:
        if name.endswith((".w", "_res.gamma")) and not name.startswith("layers.0.attn_res."):
            assert not torch.equal(state[name], before[name]), name
