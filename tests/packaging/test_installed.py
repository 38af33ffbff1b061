"""draft_circuit.installed.prefer_installed: another distribution's top-level module wins over
this checkout's folder of the same name even with the checkout's root first on sys.path (what
pytest's pythonpath and `python -m` from the root do). transformers 5.25 imports Hugging Face's
`kernels`; without this it found our kernels/ and every transformers-oracle test failed."""
import os
import sys

import pytest

from draft_circuit import installed

ROOT = installed._ROOT


def _under_root(module) -> bool:
    path = getattr(module, "__file__", None) or getattr(module, "origin", None) or ""
    return os.path.abspath(path).startswith(ROOT + os.sep)


def test_the_installed_module_wins_over_the_checkouts_folder(monkeypatch):
    monkeypatch.setattr(sys, "path", [ROOT, *sys.path])
    saved = sys.modules.pop("kernels", None)
    try:
        import importlib.util
        if importlib.util.find_spec("kernels") is None or \
                not _under_root(importlib.util.find_spec("kernels")):
            pytest.fail("with the root first on the path, `kernels` must find the checkout's folder")
        got = installed.prefer_installed("kernels")
        if got is None:  # no other distribution installs `kernels`: nothing to prefer
            assert "kernels" not in sys.modules
            return
        assert not _under_root(got)
        import kernels
        assert kernels is got and sys.path[0] == ROOT  # the path is given back as it was
    finally:
        if saved is not None:
            sys.modules["kernels"] = saved


def test_a_checkout_module_already_imported_is_replaced(monkeypatch):
    monkeypatch.setattr(sys, "path", [ROOT, *sys.path])
    saved = sys.modules.pop("kernels", None)
    try:
        import kernels as ours
        assert _under_root(ours)
        got = installed.prefer_installed("kernels")
        assert got is None or not _under_root(got)
    finally:
        sys.modules.pop("kernels", None)
        if saved is not None:
            sys.modules["kernels"] = saved


def test_a_name_only_the_checkout_has_is_not_imported(monkeypatch):
    # benchmarks/: a package of the checkout's root alone (no distribution, no test folder)
    monkeypatch.setattr(sys, "path", [ROOT, *sys.path])
    monkeypatch.delitem(sys.modules, "benchmarks", raising=False)
    assert installed.prefer_installed("benchmarks") is None
    assert "benchmarks" not in sys.modules
