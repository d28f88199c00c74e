"""The import names: the package is block_attnres, and ``import attnres`` is an alias of
it only where no other package named attnres is installed (fast-attnres installs one).
Each case runs in a fresh interpreter, as the alias is set up at interpreter start."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import block_attnres

REPO = Path(__file__).resolve().parents[2]


def _alias_dir() -> Path:
    """Where block_attnres-alias.pth lies: site-packages for an installed package, else
    the source tree's python/alias."""
    spec = importlib.util.find_spec("_block_attnres_alias")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return REPO / "python" / "alias"


def _run(code: str, first_on_path: str = "") -> None:
    """Runs `code` in a new interpreter whose site-packages (the alias's .pth) are
    processed as at start-up, with block_attnres importable as here and `first_on_path`
    (a folder) ahead of everything."""
    package_parent = str(Path(block_attnres.__file__).resolve().parents[1])
    prelude = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(_alias_dir())!r})
        sys.path.insert(0, {package_parent!r})
        if {first_on_path!r}:
            sys.path.insert(0, {first_on_path!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_attnres_is_block_attnres_when_no_other_is_installed():
    _run("""
        import attnres, block_attnres
        assert attnres is block_attnres
        import attnres.nn, attnres.ops.phase1
        from attnres.nn import BlockAttnResStream
        assert attnres.nn is block_attnres.nn
        assert attnres.ops.phase1 is block_attnres.ops.phase1
        assert BlockAttnResStream is block_attnres.nn.BlockAttnResStream
        import torch
        h = attnres.block_attn_res_fn([torch.ones(2, 4)], None, torch.zeros(4))
        assert torch.equal(h, torch.ones(2, 4))
    """)


def test_another_attnres_package_wins_the_name(tmp_path):
    """As with fast-attnres installed: `import attnres` is theirs, block_attnres ours,
    and the torch ops are registered once."""
    other = tmp_path / "attnres"
    other.mkdir()
    (other / "__init__.py").write_text("WHO = 'the other attnres'\n")
    _run("""
        import attnres
        assert attnres.WHO == 'the other attnres'
        import block_attnres, torch
        assert block_attnres.block_attn_res_fn is not None
        assert hasattr(torch.ops.attnres, "block_attn_res")
        try:
            import attnres.nn
        except ImportError:
            pass
        else:
            raise AssertionError("attnres.nn must not come from block_attnres here")
    """, first_on_path=str(tmp_path))


def test_an_installed_package_ships_the_alias():
    """A wheel install puts the alias module and its .pth next to the package."""
    installed = Path(block_attnres.__file__).resolve().parents[1]
    if installed == REPO / "python":
        pytest.skip("block_attnres runs from the source tree, not from an install")
    assert (installed / "_block_attnres_alias.py").is_file()
    assert (installed / "block_attnres-alias.pth").is_file()
