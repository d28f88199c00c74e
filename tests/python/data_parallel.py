"""One data-parallel SGD step on gloo (2 CPU processes, half the batch each) and the
same step in one process on the whole batch, for tests to compare: shared by
test_ddp.py and test_stream_distributed.py."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import block_attnres as attnres

WORLD_SIZE = 2
LR = 0.1


def sgd_step(model, loss) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_path: str, make: Callable, loss: Callable,
            wrap: Callable) -> None:
    torch.set_num_threads(1)
    attnres.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
        model, tokens = make()
        wrapped = wrap(model)
        # Each rank's loss is the mean over its half: the data-parallel mean of the two
        # equals the whole batch's mean.
        sgd_step(wrapped, loss(wrapped, tokens.chunk(WORLD_SIZE)[rank]))
        state = {}
        for k, v in model.state_dict().items():
            if hasattr(v, "full_tensor"):  # FSDP2 DTensor shards
                v = v.full_tensor()
            state[k] = v.detach().clone()
        if rank == 0:
            torch.save(state, out_path)
        dist.barrier()  # both ranks done before either tears down
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


def one_step_both_ways(out_path: str, make: Callable, loss: Callable, wrap: Callable):
    """(parallel state, one-process state, state before the step): `make()` returns
    (model, tokens) the same way in every process, `wrap(model)` the data-parallel
    model, `loss(model, tokens)` the mean loss. All three are module-level functions
    (the spawned workers import them by name)."""
    mp.spawn(_worker, args=(_free_port(), out_path, make, loss, wrap), nprocs=WORLD_SIZE,
             join=True)
    parallel: Dict[str, torch.Tensor] = torch.load(out_path)
    model, tokens = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd_step(model, loss(model, tokens))
    return parallel, model.state_dict(), before


def assert_same_state(parallel: dict, state: dict) -> None:
    assert parallel.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(parallel[name], value, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
