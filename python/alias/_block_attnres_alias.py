"""``import attnres`` for block_attnres, unless another package named ``attnres`` is
installed.

The PyPI package fast-attnres also installs a top-level package named ``attnres``.
Ours is ``block_attnres``, so both can be installed side by side; this module (run at
interpreter start by ``block_attnres-alias.pth``, and importing only importlib) makes
``attnres`` and every ``attnres.<sub>`` name the same module objects as
``block_attnres`` and ``block_attnres.<sub>``, but only when no other ``attnres`` is
found on sys.path. With fast-attnres installed, ``import attnres`` is theirs and
``import block_attnres`` is ours.
"""

import importlib
import importlib.machinery
import sys

_ALIAS, _REAL = "attnres", "block_attnres"


class _Loader:
    """Gives the module of the real name: the alias is the same object, not a copy
    (a copy would register the torch ops twice)."""

    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec):
        return importlib.import_module(self.real)

    def exec_module(self, module) -> None:
        pass


class _Finder:
    """First on sys.meta_path: `attnres` when sys.path has no other, and `attnres.<sub>`
    once `attnres` is ours (else the path finder would load a second copy of the
    submodule from block_attnres's folder)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == _ALIAS:
            if importlib.machinery.PathFinder.find_spec(name) is not None:
                return None  # another package named attnres: it wins
        elif not (name.startswith(_ALIAS + ".") and
                  getattr(sys.modules.get(_ALIAS), "__name__", None) == _REAL):
            return None
        return importlib.machinery.ModuleSpec(name, _Loader(_REAL + name[len(_ALIAS):]))


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
