#!/usr/bin/env python3
"""Does Block AttnRes train better than plain residuals, and what does it cost?

A small byte-level decoder-only language model (causal self-attention with RoPE,
SwiGLU MLP, RMSNorm) trained on real text that is on every machine with Python: the
standard library's own .py sources. The residual scheme is the only thing that varies:

    --residual plain    pre-norm residual stream: x += f(norm(x)) after every sub-layer
    --residual block    Block AttnRes (arXiv:2603.15031): before every sub-layer, a
                        softmax over depth mixes the completed blocks and the running
                        partial block; --block-size sub-layers make one block
    --residual full     full AttnRes: block size 1, every sub-layer output is a source

Every scheme builds the same embedding, sub-layers and head from the same generator,
sees the same batches in the same order and is evaluated on the same held-out bytes,
so curves from different schemes with one --seed differ only by the residual.

    python3 examples/train_lm.py --quick --residual block   # ~10 s: a smoke test
    python3 examples/train_lm.py --residual plain --seed 0  # ~6 min on 2 idle cores
    python3 examples/train_lm.py --resume runs/plain-d96-l8-s0   # continue after a stop
    python3 examples/plot.py runs/*-d96-l8-s0 --out curves.png   # docs/RESULTS.md

Each run writes to --out (default runs/<name>): config.json, metrics.jsonl (one JSON
object per evaluation) and checkpoint.pt, from which --resume continues bit for bit
as if the run had never stopped (Ctrl-C saves a checkpoint after the current step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import signal
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import block_attnres as attnres
from block_attnres.nn import BlockAttnRes

try:
    from tqdm import tqdm
except ImportError:  # progress falls back to one printed line per evaluation
    tqdm = None

VOCAB = 256  # bytes

# --quick: a tiny model that still learns visibly within a few dozen steps.
QUICK = dict(dim=64, depth=2, heads=4, context=64, batch=8, steps=40, warmup=5,
             eval_every=10, eval_batches=4, lr=3e-3, block_size=2)


# ---------------------------------------------------------------------------------
# Data: the standard library's .py sources as one byte string
# ---------------------------------------------------------------------------------

class ByteCorpus:
    """Sorted .py files under a root, concatenated; every 20th file held out.

    Holding out whole files (rather than the tail of the concatenation) makes the
    validation bytes come from the same mix of modules as the training bytes without
    sharing any file with them. The file list is sorted, so the split and the bytes
    are the same on every run on a machine; ``sha256`` identifies the corpus in
    config.json (another Python version has another standard library).
    """

    VAL_EVERY = 20

    def __init__(self, root: Optional[str] = None):
        if root is None:
            root = sysconfig.get_paths()["stdlib"]
        self.root = str(Path(root).resolve())
        rootp = Path(self.root)
        if rootp.is_file():
            files = [rootp]
        else:
            # Installed packages are not the standard library and differ between machines.
            files = sorted(p for p in rootp.rglob("*.py")
                           if p.is_file() and not {"site-packages", "dist-packages"}
                           & set(p.relative_to(rootp).parts))
        if not files:
            raise SystemExit(f"no .py files under {self.root}")
        contents = [path.read_bytes() for path in files]
        if len(files) >= self.VAL_EVERY:
            last = self.VAL_EVERY - 1
            train_bytes = b"".join(c for i, c in enumerate(contents) if i % self.VAL_EVERY != last)
            val_bytes = b"".join(c for i, c in enumerate(contents) if i % self.VAL_EVERY == last)
        else:  # too few files to hold out whole ones: the last 5 % of the bytes
            everything = b"".join(contents)
            cut = len(everything) * 95 // 100
            train_bytes, val_bytes = everything[:cut], everything[cut:]
        self.num_files = len(files)
        self.sha256 = hashlib.sha256(train_bytes + val_bytes).hexdigest()
        self.train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
        self.val = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)

    def describe(self) -> dict:
        return {"root": self.root, "files": self.num_files, "train_bytes": len(self.train),
                "val_bytes": len(self.val), "sha256": self.sha256}


def train_batch(data: Tensor, step: int, seed: int, batch: int, context: int) -> Tensor:
    """The batch of training step `step`: random windows of context + 1 bytes.

    A pure function of (seed, step), so the data order is the same for every residual
    scheme and a resumed run needs nothing but the step number to continue it.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()


def val_batches(data: Tensor, num_batches: int, batch: int, context: int) -> list[Tensor]:
    """Fixed windows spread evenly over the held-out bytes; the same for every run
    (independent of --seed), so validation losses of all runs are comparable."""
    count = num_batches * batch
    span = len(data) - context - 1
    if span <= 0:
        raise SystemExit(f"validation split ({len(data)} bytes) is shorter than the context")
    starts = [i * span // count for i in range(count)]
    windows = torch.stack([data[s:s + context + 1] for s in starts]).long()
    return list(windows.split(batch))


# ---------------------------------------------------------------------------------
# Sub-layers (shared by every scheme)
# ---------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with rotary position embeddings on q and k."""

    def __init__(self, dim: int, heads: int, context: int, rope_base: float = 10000.0):
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise SystemExit(f"--dim {dim} must be a multiple of 2 * --heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        head_dim = dim // heads
        inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
        # Derived from the config, so not saved (persistent=False) but rebuilt.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rope(self, x: Tensor) -> Tensor:                          # x [B, H, T, Dh]
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)                                # rotate-half pairing
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x: Tensor) -> Tensor:                        # x [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


# ---------------------------------------------------------------------------------
# Residual schemes
#
# All of the residual bookkeeping lives behind the interface of
# attnres.nn.BlockAttnResStream with input_norm=True:
#     stream = residual.begin(embedding)
#     for each sub-layer:  stream.add(sublayer(stream.next_input()))
#     y = stream.finish()
# next_input() and finish() return normalised tensors (each sub-layer's own pre-norm,
# the final norm), so the sub-layers and the head carry no norms and are the same
# modules for every scheme. Block AttnRes comes in two implementations of one model
# (same parameters up to layout, same init, equal within the kernels' tolerances):
#   --attnres-impl stream   attnres.nn.BlockAttnResStream, the library's residual
#                           stream (two-phase schedule: each completed block is read
#                           once per block of sub-layers, not once per sub-layer);
#   --attnres-impl modules  BlockAttnResidual below: one attnres.nn.BlockAttnRes per
#                           sub-layer, as in docs/PYTORCH.md (for attnres builds
#                           without the stream, and as a cross-check of it).
# ---------------------------------------------------------------------------------

class _Stream:
    """One forward pass through a scheme: counts the sub-layers it has fed."""

    def __init__(self, owner: "_Residual"):
        self.owner, self.i = owner, 0

    def check_finished(self) -> None:
        assert self.i == self.owner.num_sublayers, (self.i, self.owner.num_sublayers)


class _PlainStream(_Stream):
    def __init__(self, owner: "PlainResidual", embedding: Tensor):
        super().__init__(owner)
        self.h = embedding

    def next_input(self) -> Tensor:
        return self.owner.norms[self.i](self.h)

    def add(self, out: Tensor) -> None:
        self.h = self.h + out
        self.i += 1

    def finish(self) -> Tensor:
        self.check_finished()
        return self.owner.final_norm(self.h)


class _BlockStream(_Stream):
    def __init__(self, owner: "BlockAttnResidual", embedding: Tensor):
        super().__init__(owner)
        self.blocks: list[Tensor] = [embedding]
        self.partial: Optional[Tensor] = None

    def next_input(self) -> Tensor:
        if self.i % self.owner.block_size == 0 and self.partial is not None:
            # Close the block. A new list, never an in-place append: earlier AttnRes
            # calls saved the old list's tensors for their backward.
            self.blocks = self.blocks + [self.partial]
            self.partial = None
        h = self.owner.attn_res[self.i](self.blocks, self.partial)
        return self.owner.norms[self.i](h)

    def add(self, out: Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out
        self.i += 1

    def finish(self) -> Tensor:
        self.check_finished()
        return self.owner.final_norm(self.owner.final_res(self.blocks, self.partial))


class _Residual(nn.Module):
    """What every scheme owns: each sub-layer's input RMSNorm and the final RMSNorm.

    add_norms registers them after the scheme's own parameters: the order of
    model.parameters() fixes the order in which gradient clipping sums the norms, and
    the names are the checkpoints' keys.
    """

    stream_class: type

    def add_norms(self, dim: int, num_sublayers: int, eps: float) -> None:
        self.num_sublayers = num_sublayers
        self.norms = nn.ModuleList(nn.RMSNorm(dim, eps=eps) for _ in range(num_sublayers))
        self.final_norm = nn.RMSNorm(dim, eps=eps)

    def begin(self, embedding: Tensor) -> _Stream:
        return self.stream_class(self, embedding)


class PlainResidual(_Residual):
    """Pre-norm residual stream: h <- h + f_i(norm_i(h)); output final_norm(h)."""

    stream_class = _PlainStream

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6):
        super().__init__()
        self.add_norms(dim, num_sublayers, eps)


class BlockAttnResidual(_Residual):
    """Block AttnRes in the report's layout (docs/PYTORCH.md), per sub-layer.

    The embedding is block b_0. Sub-layer outputs are summed into the partial block;
    before sub-layer i with i % block_size == 0 (i > 0) the partial block is closed
    and appended to the completed blocks. Each sub-layer's input is an AttnRes (its
    own pseudo-query w, zeros at init, and key-norm gamma) over the completed blocks
    and the partial block, followed by the sub-layer's own RMSNorm; the output is a
    final AttnRes over all blocks and the partial block, then the final RMSNorm.
    block_size=1 is full AttnRes: every sub-layer output is its own source.
    """

    stream_class = _BlockStream

    def __init__(self, dim: int, num_sublayers: int, block_size: int, eps: float = 1e-6):
        super().__init__()
        if block_size < 1:
            raise SystemExit(f"--block-size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.attn_res = nn.ModuleList(BlockAttnRes(dim, eps=eps) for _ in range(num_sublayers))
        self.final_res = BlockAttnRes(dim, eps=eps)
        self.add_norms(dim, num_sublayers, eps)


def make_residual(cfg: argparse.Namespace, num_sublayers: int) -> nn.Module:
    if cfg.residual == "plain":
        return PlainResidual(cfg.dim, num_sublayers)
    block_size = 1 if cfg.residual == "full" else cfg.block_size
    if cfg.attnres_impl == "stream":
        return attnres.nn.BlockAttnResStream(cfg.dim, num_sublayers, block_size, eps=1e-6,
                                             input_norm=True)
    return BlockAttnResidual(cfg.dim, num_sublayers, block_size, eps=1e-6)


# ---------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------

class LM(nn.Module):
    """Embedding -> depth x (attention, SwiGLU) through a residual scheme -> head."""

    def __init__(self, cfg: argparse.Namespace):
        super().__init__()
        hidden = 32 * math.ceil(cfg.dim * 8 / 3 / 32)   # SwiGLU's 8/3 D, rounded up
        # The shared parts first, the residual last (see init_shared_weights).
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.sublayers = nn.ModuleList()
        for _ in range(cfg.depth):
            self.sublayers.append(CausalSelfAttention(cfg.dim, cfg.heads, cfg.context))
            self.sublayers.append(SwiGLU(cfg.dim, hidden))
        self.head = nn.Linear(cfg.dim, VOCAB, bias=False)
        self.residual = make_residual(cfg, len(self.sublayers))
        self.init_shared_weights(cfg.seed, cfg.depth)

    def shared_modules(self) -> list[nn.Module]:
        return [self.embed, self.sublayers, self.head]

    @torch.no_grad()
    def init_shared_weights(self, seed: int, depth: int) -> None:
        """Draw every shared weight from one generator, in module order.

        The residual's own parameters have constant inits (norm weights 1, pseudo-
        queries 0, as in the report), so with one seed the embedding, sub-layers and
        head start bit-identical in every scheme. GPT-2 style: N(0, 0.02), and the
        projections that write into the residual scaled by 1/sqrt(2 * depth).
        """
        gen = torch.Generator().manual_seed(seed)
        for module in self.shared_modules():
            for name, p in module.named_parameters():
                std = 0.02
                if name.endswith("out.weight") or name.endswith("down.weight"):
                    std /= math.sqrt(2 * depth)
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: Tensor) -> Tensor:                    # tokens [B, T]
        embedding = self.embed(tokens)
        stream = self.residual.begin(embedding)
        for sublayer in self.sublayers:
            # Under bf16 autocast the sub-layers return bf16; the residual stream stays
            # in the embedding's fp32 (and every source of one AttnRes shares a dtype).
            stream.add(sublayer(stream.next_input()).to(embedding.dtype))
        return self.head(stream.finish())                            # [B, T, 256]


def count_params(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def loss_fn(model: nn.Module, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def lr_at(step: int, cfg: argparse.Namespace) -> float:
    """Linear warmup to --lr, then cosine decay to --min-lr-ratio * --lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: nn.Module, cfg: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, w or gamma)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


# ---------------------------------------------------------------------------------
# Command line, run directory, checkpoint
# ---------------------------------------------------------------------------------

# Options that control a process, not the experiment: they may differ on --resume.
RUN_CONTROL = {"resume", "stop_after", "progress", "quick"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--residual", choices=["plain", "block", "full"], default="block")
    a("--block-size", type=int, default=4,
      help="sub-layers per block for --residual block (a layer has two sub-layers)")
    a("--attnres-impl", choices=["auto", "stream", "modules"], default="auto",
      help="Block AttnRes through attnres.nn.BlockAttnResStream (stream) or one "
      "attnres.nn.BlockAttnRes per sub-layer (modules); auto: stream if this attnres has it")
    a("--dim", type=int, default=96)
    a("--depth", type=int, default=8, help="transformer layers (2 sub-layers each)")
    a("--heads", type=int, default=4)
    a("--context", type=int, default=128, help="bytes per training window")
    a("--batch", type=int, default=16)
    a("--steps", type=int, default=800)
    a("--lr", type=float, default=2e-3, help="peak learning rate")
    a("--warmup", type=int, default=50, help="linear warmup steps")
    a("--min-lr-ratio", type=float, default=0.1, help="final lr of the cosine / peak lr")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    a("--dtype", choices=["fp32", "bf16"], default="fp32",
      help="bf16: autocast the matmuls to bf16; parameters and residual stream stay fp32")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--seed", type=int, default=0, help="weights and data order")
    a("--eval-every", type=int, default=50, help="steps between evaluations/checkpoints")
    a("--eval-batches", type=int, default=16, help="fixed validation batches per evaluation")
    a("--threads", type=int, default=0, help="torch and attnres threads (0: their default)")
    a("--data", default=None,
      help="train on this directory of .py files (or one file), not the stdlib")
    a("--name", default=None, help="run name (None: made from the config)")
    a("--out", default=None, help="run directory (None: runs/<name>)")
    a("--quick", action="store_true", help="a tiny config for a smoke test: " +
      " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    a("--resume", metavar="DIR", default=None,
      help="continue the run in DIR from its checkpoint, with its config.json")
    a("--stop-after", type=int, default=None, metavar="STEP",
      help="save a checkpoint and exit after STEP (simulates an interruption)")
    a("--progress", choices=["auto", "bar", "lines"], default="auto",
      help="tqdm bar (auto: when tqdm is installed and stderr is a terminal) or lines")
    return p


def parse_config(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = build_parser()
    cfg = parser.parse_args(argv)
    if cfg.quick:  # --quick sets defaults; options given explicitly still win
        parser.set_defaults(**QUICK)
        cfg = parser.parse_args(argv)
    if cfg.resume:
        saved = json.loads((Path(cfg.resume) / "config.json").read_text())["args"]
        for key, value in vars(cfg).items():
            if key not in RUN_CONTROL:
                setattr(cfg, key, saved[key])
        cfg.out = cfg.resume
    if cfg.residual == "full":  # full AttnRes is block size 1; say so in config.json
        cfg.block_size = 1
    if cfg.attnres_impl == "auto":  # resolved here, so config.json says which ran
        cfg.attnres_impl = "stream" if hasattr(attnres.nn, "BlockAttnResStream") else "modules"
    if cfg.name is None:
        scheme = {"plain": "plain", "full": "full", "block": f"block{cfg.block_size}"}
        cfg.name = f"{scheme[cfg.residual]}-d{cfg.dim}-l{cfg.depth}-s{cfg.seed}"
    if cfg.out is None:
        cfg.out = str(Path("runs") / cfg.name)
    for key in ("steps", "eval_every", "eval_batches", "batch", "context", "depth"):
        if getattr(cfg, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1")
    return cfg


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash while saving leaves the previous checkpoint intact


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Progress:
    """A tqdm bar (loss, tokens/s, ETA) or, without tqdm, a line per evaluation."""

    def __init__(self, cfg: argparse.Namespace, start: int):
        use_bar = cfg.progress == "bar" or (cfg.progress == "auto" and sys.stderr.isatty())
        if use_bar and tqdm is None:
            print("tqdm is not installed: printing a line per evaluation", file=sys.stderr)
        self.bar = (tqdm(total=cfg.steps, initial=start, desc=cfg.name, unit="step",
                         dynamic_ncols=True) if use_bar and tqdm is not None else None)
        self.total, self.t0, self.start = cfg.steps, time.perf_counter(), start

    def step(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def log(self, row: dict) -> None:
        done = row["step"] - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - row["step"]) if done else float("nan")
        train = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        line = (f"step {row['step']:>6}/{self.total}  train {train}  val {row['val_loss']:.4f}"
                f"  {row['tokens_per_s']:,.0f} tok/s  rss {row['peak_rss_mb']:.0f} MB"
                f"  eta {eta / 60:.1f} min")
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_config(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        attnres.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, metrics_path = out / "checkpoint.pt", out / "metrics.jsonl"

    corpus = ByteCorpus(cfg.data)
    evals = val_batches(corpus.val, cfg.eval_batches, cfg.batch, cfg.context)
    model = LM(cfg)
    optimizer = make_optimizer(model, cfg)
    run_model = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")

    if cfg.resume:
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["corpus_sha256"] != corpus.sha256:
            raise SystemExit("the corpus differs from the one this run started on")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"])
        random.setstate(ckpt["python_rng"])
        step, clock, interval = ckpt["step"], ckpt["clock"], ckpt["interval"]
        # Evaluations logged after the checkpoint are redone (and logged again).
        rows = [ln for ln in metrics_path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= step]
        metrics_path.write_text("".join(r + "\n" for r in rows))
    else:
        if ckpt_path.exists():
            raise SystemExit(f"{ckpt_path} exists: pass --resume {out} or another --out")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        step = 0
        clock = {"train_s": 0.0, "wall_s": 0.0}        # accumulated over all sessions
        interval = {"loss_sum": 0.0, "steps": 0, "tokens": 0, "train_s": 0.0, "cpu_s": 0.0}
        metrics_path.write_text("")
        shared = count_params(model.shared_modules())
        (out / "config.json").write_text(json.dumps({
            "args": {k: v for k, v in vars(cfg).items() if k not in RUN_CONTROL},
            "params": {"total": count_params([model]), "shared": shared,
                       "residual": count_params([model.residual])},
            "corpus": corpus.describe(),
            "env": {"torch": torch.__version__, "attnres": attnres.__version__,
                    "cpu_isa": attnres.cpu_isa(), "torch_threads": torch.get_num_threads(),
                    "python": sys.version.split()[0]},
        }, indent=2) + "\n")

    # Ctrl-C (or SIGTERM) stops after the current step with a checkpoint, never inside
    # an optimizer update.
    stop_requested = []
    def request_stop(signum, _frame):
        if stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        stop_requested.append(signum)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), autocast:
            losses = [loss_fn(run_model, b).item() for b in evals]
        model.train()
        return sum(losses) / len(losses)

    def log_eval() -> None:
        def ratio(num, den, empty):
            return num / den if den else empty
        row = {"step": step,
               "train_time_s": round(clock["train_s"], 3),
               "wall_time_s": round(clock["wall_s"] + time.perf_counter() - session_t0, 3),
               "train_loss": ratio(interval["loss_sum"], interval["steps"], None),
               "val_loss": evaluate(),
               "lr": lr_at(max(step - 1, 0), cfg),
               "tokens_per_s": ratio(interval["tokens"], interval["train_s"], 0.0),
               # CPU seconds of all threads: on a shared machine, with --threads 1, a
               # measure of cost that other processes disturb far less than wall time.
               "tokens_per_cpu_s": ratio(interval["tokens"], interval["cpu_s"], 0.0),
               "peak_rss_mb": round(peak_rss_mb(), 1)}
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        progress.log(row)
        interval.update(loss_sum=0.0, steps=0, tokens=0, train_s=0.0, cpu_s=0.0)

    def checkpoint() -> None:
        save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step,  # also the data position: batches are f(seed, step)
                     "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                     "clock": {"train_s": clock["train_s"],
                               "wall_s": clock["wall_s"] + time.perf_counter() - session_t0},
                     "interval": dict(interval), "corpus_sha256": corpus.sha256}, ckpt_path)

    session_t0 = time.perf_counter()
    progress = Progress(cfg, step)
    if step == 0:
        log_eval()  # the loss at initialisation
    tokens_per_step = cfg.batch * cfg.context
    while step < cfg.steps:
        t0, cpu0 = time.perf_counter(), time.process_time()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = train_batch(corpus.train, step, cfg.seed, cfg.batch, cfg.context)
        with autocast:
            loss = loss_fn(run_model, batch)
        loss.backward()
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise SystemExit(f"step {step}: loss is {loss_value}")
        dt = time.perf_counter() - t0
        interval["cpu_s"] += time.process_time() - cpu0
        step += 1
        clock["train_s"] += dt
        interval["loss_sum"] += loss_value
        interval["steps"] += 1
        interval["tokens"] += tokens_per_step
        interval["train_s"] += dt
        progress.step(loss_value, tokens_per_step / dt)

        if step % cfg.eval_every == 0 or step == cfg.steps:
            log_eval()
            checkpoint()
        elif stop_requested or step == cfg.stop_after:
            checkpoint()
        if stop_requested or step == cfg.stop_after:
            progress.close()
            print(f"stopped after step {step}; continue with: {sys.argv[0]} --resume {out}",
                  file=sys.stderr)
            return 0
    progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
