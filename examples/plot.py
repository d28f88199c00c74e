#!/usr/bin/env python3
"""Validation loss of train_lm.py runs vs step and vs training time, in one PNG.

    python3 examples/plot.py runs/plain-* runs/block4-* runs/full-* --out curves.png

Left panel: validation loss vs optimizer step (does the scheme learn more per step?).
Right panel: the same vs training time, evaluation excluded (is it better per second
of compute on this machine?): wall-clock time, or with --time cpu the CPU time of all
threads, which other processes on a shared machine disturb far less (compare runs
with one thread count). Runs of one scheme share a colour; seeds differ by line
style. The legend comes from each run's config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import matplotlib
except ImportError:
    sys.exit("plot.py needs matplotlib: python3 -m pip install matplotlib")
matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"plain": "#444444", "block": "#1f77b4", "full": "#d62728"}
EXTRA_COLORS = ["#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
STYLES = ["-", "--", ":", "-."]


def load_run(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    if not rows:
        raise SystemExit(f"{path}/metrics.jsonl has no evaluations yet")
    return {"path": path, "args": config["args"], "params": config.get("params", {}),
            "rows": rows}


def scheme_of(args: dict) -> str:
    if args["residual"] == "block":
        return f"block AttnRes (block size {args['block_size']})"
    return {"plain": "plain residual", "full": "full AttnRes"}[args["residual"]]


def label_of(run: dict, differing: set[str]) -> str:
    """The scheme, plus whatever else differs between the plotted runs."""
    args = run["args"]
    parts = [scheme_of(args)]
    parts += [f"{key}={args[key]}" for key in sorted(differing)
              if key not in {"residual", "block_size", "name", "out"}]
    last = run["rows"][-1]
    parts.append(f"→ {last['val_loss']:.3f}")
    return ", ".join(parts)


def cpu_minutes(run: dict) -> list[float]:
    """Cumulative training CPU time at each evaluation, from each interval's tokens
    per CPU-second (metrics.jsonl logs the rate; the tokens follow from the steps)."""
    tokens_per_step = run["args"]["batch"] * run["args"]["context"]
    total, out, prev = 0.0, [], 0
    for row in run["rows"]:
        rate = row.get("tokens_per_cpu_s")
        if rate is None:
            raise SystemExit(f"{run['path']}: no tokens_per_cpu_s in metrics.jsonl; "
                             "use --time wall")
        if row["step"] > prev and rate > 0:
            total += (row["step"] - prev) * tokens_per_step / rate
        prev = row["step"]
        out.append(total / 60)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories of train_lm.py")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--title", default=None)
    p.add_argument("--time", choices=["wall", "cpu"], default="wall",
                   help="right panel: training wall time, or CPU time of all threads")
    p.add_argument("--ylim", nargs=2, type=float, metavar=("LO", "HI"),
                   help="loss axis range (default: the interesting part of the curves)")
    args = p.parse_args(argv)

    runs = [load_run(path) for path in args.runs]
    keys = set().union(*(r["args"] for r in runs))
    differing = {k for k in keys if len({json.dumps(r["args"].get(k)) for r in runs}) > 1}
    labels = [label_of(run, differing) for run in runs]
    for run, label in zip(runs, labels):  # runs that differ only by name: say which is which
        run["label"] = label + (f" [{run['path'].name}]" if labels.count(label) > 1 else "")

    # One colour per scheme (fixed for the three standard ones), one line style per
    # seed (or per run, when a scheme appears several times with one seed).
    color_of, style_of, seen = {}, {}, {}
    extra = iter(EXTRA_COLORS * len(runs))
    for run in runs:
        scheme = scheme_of(run["args"])
        if scheme not in color_of:
            base = COLORS[run["args"]["residual"]]  # taken if another block size has it
            color_of[scheme] = base if base not in color_of.values() else next(extra)
        style_of[id(run)] = STYLES[seen.get(scheme, 0) % len(STYLES)]
        seen[scheme] = seen.get(scheme, 0) + 1

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(13, 5.2), constrained_layout=True)
    for run in runs:
        rows = run["rows"]
        steps = [r["step"] for r in rows]
        minutes = ([r["train_time_s"] / 60 for r in rows] if args.time == "wall"
                   else cpu_minutes(run))
        losses = [r["val_loss"] for r in rows]
        kw = dict(color=color_of[scheme_of(run["args"])], linestyle=style_of[id(run)],
                  linewidth=1.6, marker="o" if len(rows) <= 12 else None, markersize=3)
        ax_step.plot(steps, losses, label=run["label"], **kw)
        ax_time.plot(minutes, losses, **kw)

    # The first evaluations (loss ~5.5 at init) would squash the part where schemes
    # differ: by default the axis starts at the loss reached after 10 % of the steps.
    if args.ylim:
        lo, hi = args.ylim
    else:
        lo = min(min(r["val_loss"] for r in run["rows"]) for run in runs)
        hi = max(next((r["val_loss"] for r in run["rows"]
                       if r["step"] >= 0.1 * run["rows"][-1]["step"]), run["rows"][0]["val_loss"])
                 for run in runs)
        pad = 0.05 * max(hi - lo, 1e-3)
        lo, hi = lo - pad, hi + pad
    time_label = {"wall": "training time (min, evaluation excluded)",
                  "cpu": "training CPU time (min, all threads, evaluation excluded)"}
    for ax, xlabel in ((ax_step, "step"), (ax_time, time_label[args.time])):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_ylim(lo, hi)
        ax.grid(True, alpha=0.3)
    ax_step.set_title("per step")
    ax_time.set_title("per second of training" if args.time == "wall"
                      else "per CPU-second of training")
    ax_step.legend(fontsize=8, loc="upper right")

    if args.title:
        title = args.title
    else:
        a = runs[0]["args"]
        shape = (f"d={a['dim']} layers={a['depth']} heads={a['heads']} context={a['context']} "
                 f"batch={a['batch']} steps={a['steps']} {a['dtype']}")
        same_shape = all(all(r["args"][k] == a[k] for k in
                             ("dim", "depth", "heads", "context", "batch", "steps", "dtype"))
                         for r in runs)
        title = "byte-level LM on the Python stdlib" + (f" — {shape}" if same_shape else "")
    fig.suptitle(title)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
