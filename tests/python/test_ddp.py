"""DistributedDataParallel (gloo, 2 CPU processes) over a Block AttnRes stack.

After one SGD step on half a batch each, the parameters equal those of one process
that took the same step on the whole batch.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import block_attnres as attnres
from model_reference import TinyAttnResLM, lm_loss, randomize_attn_res

WORLD_SIZE = 2
BATCH = 4
LR = 0.1


def _make_model_and_batch():
    torch.manual_seed(0)
    model = TinyAttnResLM(num_layers=4, layers_per_block=2, impl="native", scale=0.8)
    model = model.double()
    randomize_attn_res(model)
    tokens = torch.randint(0, 32, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _sgd_step(model, loss):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _worker(rank: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    attnres.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
        model, tokens = _make_model_and_batch()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        shard = tokens.chunk(WORLD_SIZE)[rank]
        _sgd_step(ddp, lm_loss(ddp, shard))
        if rank == 0:
            torch.save({k: v.detach() for k, v in model.state_dict().items()}, out_path)
        # Both ranks done before either tears down.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # os._exit here too (test_fast_path.py, _ddp_worker)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Leave without the interpreter's teardown: under load a worker whose work had
    # finished sometimes aborted at exit ("terminate called without an active
    # exception", SIGABRT, from a C++ thread object still joinable while torch's
    # process group was destroyed), which failed the test after the fact. Only a
    # worker that got here exits this way; an exception above still fails it.
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_one_step_matches_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out_path = str(tmp_path / "rank0.pt")
    mp.spawn(_worker, args=(_free_port(), out_path), nprocs=WORLD_SIZE, join=True)
    ddp_state = torch.load(out_path)

    model, tokens = _make_model_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _sgd_step(model, lm_loss(model, tokens))
    state = model.state_dict()

    assert ddp_state.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(ddp_state[name], value, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    # The step moved every AttnRes parameter (so the comparison above is not vacuous),
    # except those of layer 0's first AttnRes: it sees one source, the embedding, and a
    # softmax over one logit has no gradient.
    for name in state:
        if name.endswith((".w", "_res.gamma")) and not name.startswith("layers.0.attn_res."):
            assert not torch.equal(state[name], before[name]), name
