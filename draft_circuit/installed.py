"""`prefer_installed(name)`: import an installed distribution's top-level module `name` ahead of
this checkout's folder of the same name.

From a source checkout the repository root is on `sys.path` (pytest's `pythonpath = ["."]`, or
`python -m ...` run from the root), so its top-level folders `kernels`, `ops`, `circuit` and
`runners` can shadow other distributions' modules of those names. Our code never imports them
that way (always `draft_circuit.kernels`, ...), but other libraries do: transformers 5.25 imports
Hugging Face's `kernels` (its hub-kernels integration) as soon as its activations load, and found
our `kernels/__init__.py` instead, an ImportError in every test that takes transformers as its
oracle. Importing the installed module once, with the root left off the path, puts the right one
in `sys.modules` for every later `import kernels`. Call it before such a library is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_root(entry: str) -> bool:
    return os.path.abspath(entry or os.getcwd()) == _ROOT


def prefer_installed(name: str) -> ModuleType | None:
    """The installed top-level module `name`, imported with this checkout's root off the path
    (None when no other distribution provides it: nothing is imported then). A module of that
    name already imported from elsewhere is returned as it is; one already imported from the
    checkout is replaced."""
    loaded = sys.modules.get(name)
    if loaded is not None and not _from_checkout(loaded):
        return loaded
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if not _is_root(p)]
    try:
        if importlib.util.find_spec(name) is None:
            return None
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


def _from_checkout(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None) or ""
    return os.path.abspath(path).startswith(_ROOT + os.sep) and \
        os.path.dirname(os.path.dirname(os.path.abspath(path))) == _ROOT
