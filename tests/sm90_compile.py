"""Compiling a kernels/ module's Triton functions for sm90 with no GPU, for tests that read what
the compiler makes of a kernel (its TTGIR or PTX), which the CPU interpreter never shows.

`run(body, source, *args)` runs PREAMBLE + body in a fresh Python process without
TRITON_INTERPRET, in the checkout's root: the preamble imports Triton's compiler (exit 77, a
skip, where the NVIDIA backend is missing) and loads `source`'s @triton.jit functions alone as
`module` (not the launcher module around them, so the process never imports torch), with `text`
and `tree` (its source and AST); body compiles from there and prints what the test asserts on.
With `source` None there is no `module`: body imports what it compiles (this checkout's
draft_circuit and tests, torch with them), and may call `pretend_sm90()` first so the launchers
take the path they take on an H100/H200."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout: draft_circuit and tests import from it
PREAMBLE = textwrap.dedent("""
    import ast, importlib.util, pathlib, re, shutil, sys, tempfile
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import triton.backends.nvidia  # noqa: F401
    except ImportError as e:
        print(e)
        sys.exit(77)
    if sys.argv[1]:  # a source (else ""): its jit functions alone, as `module`
        path = pathlib.Path(sys.argv[1])
        text = path.read_text()
        tree = ast.parse(text)
        # every @triton.jit function of the module (the kernels and the helpers they inline), alone
        jitted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.decorator_list
                  and "jit" in ast.unparse(n.decorator_list[0])]
        lines = []
        for n in jitted:
            lines += text.splitlines()[n.decorator_list[0].lineno - 1:n.end_lineno] + ["", ""]
        tmp = pathlib.Path(tempfile.mkdtemp()) / "kernels_only.py"
        tmp.write_text("import triton\\nimport triton.language as tl\\n\\n\\n"
                       + "\\n".join(lines) + "\\n")
        spec = importlib.util.spec_from_file_location("kernels_only", tmp)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
""")


def run(body: str, source: Path | None, *args: str) -> subprocess.CompletedProcess:
    """PREAMBLE + body (dedented) on `source` (None: no `module`), `args` after it in sys.argv;
    skips the test when Triton has no NVIDIA backend, fails it on any other error."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body),
                           str(source or ""), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 77:
        pytest.skip(f"no Triton NVIDIA backend to compile with: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def pretend_sm90() -> None:
    """In `run`'s process (compiled Triton, no GPU): Triton's driver and this project's
    launchers answer as on device 0 of an sm90 GPU: the compile target, the device and stream
    JITFunction.run asks for; a tensor's compiled CUDA index (0: compiled, PDL on, whatever its
    device); kernels.tiles' sm90 tile rule. A launch can then be compiled for sm90 (warm-up) or
    visited; nothing can run."""
    import importlib
    import pkgutil

    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import draft_circuit.kernels
    import draft_circuit.runners
    from draft_circuit.kernels import _common
    from draft_circuit.kernels import tiles as tiling

    class Sm90:  # what JITFunction.run asks the driver: the target, the device, its stream
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

    driver.set_active(Sm90())
    # every module binding compiled_cuda_index by name gets the answer (import them all first)
    for package in (draft_circuit.kernels, draft_circuit.runners):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name.startswith("draft_circuit.") and hasattr(module, "compiled_cuda_index"):
            setattr(module, "compiled_cuda_index", lambda t: 0)
    setattr(_common, "_device_is_hopper_plus", lambda index: True)
    setattr(tiling, "_arch", lambda index: tiling.MEASURED_ARCH)
