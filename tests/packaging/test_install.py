"""Installing draft-circuit never overwrites another distribution's import package.

A fresh venv first gets Hugging Face's `kernels` (the name our `kernels/` folder shares), then
this project, as a wheel and as an editable install: `kernels/__init__.py` must be byte-for-byte
what it was (its `get_kernel` still there), and everything we install lies under
`draft_circuit/`. Needs the package index (CI reaches PyPI); it is the slowest CPU test (~1 min).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOREIGN = ("kernels", "ops", "circuit", "runners")


def _pip(py: Path, *args: str, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def _site(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _exports(init: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked tree without build leftovers, so an egg-info of the checkout cannot leak in."""
    dst = tmp_path_factory.mktemp("src") / "draft-circuit"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info",
                                                             "build", ".whl", ".pytest_cache"))
    return dst


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_install_leaves_huggingface_kernels_alone(tmp_path: Path, source_copy: Path,
                                                  editable: bool) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    _pip(py, "--no-deps", "kernels", cwd=tmp_path)
    site = _site(py)
    theirs = site / "kernels" / "__init__.py"
    before = theirs.read_bytes()
    assert "get_kernel" in _exports(theirs)

    _pip(py, "--no-deps", *(["-e"] if editable else []), str(source_copy), cwd=tmp_path)

    assert theirs.read_bytes() == before, "installing draft-circuit rewrote kernels/__init__.py"
    assert "get_kernel" in _exports(theirs)
    for name in FOREIGN[1:]:
        assert not (site / name).exists(), f"draft-circuit installed a top-level {name!r}"
    # resolved from outside the checkout: `kernels` is theirs, our packages sit under the root
    probe = ("import importlib.util as u, json; print(json.dumps({m: (s.origin if (s := "
             "u.find_spec(m)) else None) for m in ['kernels', 'ops', 'runners', 'circuit', "
             "'draft_circuit.circuit', 'draft_circuit.kernels', 'draft_circuit.runners']}))")
    out = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "")}, check=True)
    import json
    found = json.loads(out.stdout)
    assert found["kernels"] == str(theirs)
    assert found["ops"] is None and found["runners"] is None and found["circuit"] is None
    base = source_copy if editable else site / "draft_circuit"
    assert found["draft_circuit.circuit"] == str(base / "circuit" / "__init__.py")
    assert found["draft_circuit.kernels"] == str(base / "kernels" / "__init__.py")
    if not editable:
        record = next(site.glob("draft_circuit-*.dist-info")) / "RECORD"
        tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
        assert tops <= {"draft_circuit", record.parent.name, "..", "bin"}, tops
        assert (site / "draft_circuit" / "circuit" / "viz" / "static" / "page.js").exists()
