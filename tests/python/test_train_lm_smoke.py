"""Smoke test of the training example: examples/train_lm.py --quick and examples/plot.py.

For every residual scheme a --quick run (a few seconds) must lower the loss and write
a parseable metrics.jsonl; a run stopped half way and resumed must end bit for bit
where the uninterrupted run ends; plot.py must turn the runs into a PNG. Which scheme
wins is not tested: at this size that is noise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_lm.py"
PLOT = ROOT / "examples" / "plot.py"
SCHEMES = ["plain", "block", "full"]


# One thread: the quick model is too small to gain from two, and on a loaded CI machine
# idle OpenMP workers waiting at barriers only slow every step down.
QUICK = ("--quick", "--threads", "1", "--progress", "lines")


def run(script: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, \
        f"{script.name} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def import_train_lm():
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import train_lm
    finally:
        sys.path.remove(str(TRAIN.parent))
    return train_lm


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One uninterrupted --quick run per scheme, shared by the tests below."""
    base = tmp_path_factory.mktemp("train_lm")
    dirs = {}
    for scheme in SCHEMES:
        dirs[scheme] = base / scheme
        run(TRAIN, *QUICK, "--residual", scheme, "--out", str(dirs[scheme]))
    return dirs


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quick_run_learns(runs, scheme):
    rows = metrics(runs[scheme])
    config = json.loads((runs[scheme] / "config.json").read_text())
    assert config["args"]["residual"] == scheme
    assert [r["step"] for r in rows] == list(range(0, config["args"]["steps"] + 1,
                                                   config["args"]["eval_every"]))
    for row in rows:
        assert set(row) >= {"step", "train_time_s", "wall_time_s", "train_loss", "val_loss",
                            "tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb"}
    assert rows[0]["train_loss"] is None and rows[0]["step"] == 0
    # ln(256) = 5.55 at initialisation; a few dozen steps learn at least the byte statistics.
    assert rows[0]["val_loss"] > 5.0
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 1.0
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0 for r in rows[1:])
    assert (runs[scheme] / "checkpoint.pt").is_file()


def test_shared_weights_identical_across_schemes():
    """With one seed, every scheme starts from the same embedding, sub-layers and head:
    only the residual's own parameters (norms, pseudo-queries) differ between them."""
    train_lm = import_train_lm()
    models = {s: train_lm.LM(train_lm.parse_config(["--quick", "--residual", s]))
              for s in SCHEMES}
    shared = {s: {k: v for k, v in m.state_dict().items() if not k.startswith("residual.")}
              for s, m in models.items()}
    assert shared["plain"].keys() == shared["block"].keys() == shared["full"].keys()
    for key, value in shared["plain"].items():
        assert torch.equal(value, shared["block"][key]), key
        assert torch.equal(value, shared["full"][key]), key


@pytest.mark.parametrize("scheme", ["block", "full"])
def test_stream_equals_modules(scheme):
    """--attnres-impl stream (attnres.nn.BlockAttnResStream, two-phase schedule) and
    --attnres-impl modules (one BlockAttnRes per sub-layer) are one model: from the same
    init they give the same loss and gradients on a batch, up to fp32 rounding."""
    import block_attnres as attnres
    if not hasattr(attnres.nn, "BlockAttnResStream"):
        pytest.skip("this attnres has no BlockAttnResStream")
    train_lm = import_train_lm()
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (4, 33))
    results = {}
    for impl in ("modules", "stream"):
        model = train_lm.LM(train_lm.parse_config(
            ["--quick", "--residual", scheme, "--block-size", "3", "--attnres-impl", impl]))
        loss = train_lm.loss_fn(model, batch)
        loss.backward()
        residual_grads = [p.grad.flatten() for p in model.residual.parameters()]
        shared_grads = [p.grad.flatten() for m in model.shared_modules() for p in m.parameters()]
        results[impl] = (loss.item(), torch.cat(shared_grads), torch.cat(residual_grads).sum())
    (loss_a, shared_a, sum_a), (loss_b, shared_b, sum_b) = results["modules"], results["stream"]
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    torch.testing.assert_close(shared_a, shared_b, rtol=1e-4, atol=1e-6)
    # The residual parameters are laid out differently (per-sub-layer modules vs one
    # [L + 1, D] tensor each), so compare the sums of their gradients.
    assert sum_a.item() == pytest.approx(sum_b.item(), rel=1e-4, abs=1e-5)


def test_resume_is_bit_identical(runs, tmp_path):
    """Stop after a step that is not an evaluation step, resume, and end exactly where the
    uninterrupted run ends: same losses at every evaluation, same final weights."""
    scheme = "block"  # the scheme with the most state in flight (blocks, partial block)
    interrupted = tmp_path / "interrupted"
    run(TRAIN, *QUICK, "--residual", scheme, "--out", str(interrupted), "--stop-after", "15")
    assert torch.load(interrupted / "checkpoint.pt", weights_only=False)["step"] == 15
    run(TRAIN, "--resume", str(interrupted), "--progress", "lines")

    loss_keys = ("step", "train_loss", "val_loss", "lr")
    expected = [{k: r[k] for k in loss_keys} for r in metrics(runs[scheme])]
    assert [{k: r[k] for k in loss_keys} for r in metrics(interrupted)] == expected
    final_a = torch.load(runs[scheme] / "checkpoint.pt", weights_only=False)
    final_b = torch.load(interrupted / "checkpoint.pt", weights_only=False)
    assert final_a["step"] == final_b["step"]
    for key, value in final_a["model"].items():
        assert torch.equal(value, final_b["model"][key]), key


def test_plot_writes_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    for time_axis in ("wall", "cpu"):
        png = tmp_path / f"curves-{time_axis}.png"
        run(PLOT, *(str(runs[s]) for s in SCHEMES), "--time", time_axis, "--out", str(png))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
