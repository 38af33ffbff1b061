"""The PDL level a launch gives its kernel (`kernels._common.pdl_level`): no PDL, wait only, or
wait and release the next launch early (at most EARLY_RELEASE_MAX_ROWS rows). Checked here: the
rule itself; that every chain kernel's early release sits behind the level (an AST walk over
kernels/, so a new kernel cannot release at every width by accident) and every launch passes the
level; that no kernel does anything before its wait that a still-running launch before it could
see or spoil (what makes the early release safe); and that the levels compile to the PTX they
name (sm90, no GPU needed, in an interpreter-free process)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draft_circuit.kernels._common import (EARLY_RELEASE_MAX_ROWS, PDL_EARLY, PDL_OFF, PDL_WAIT,
                                           pdl_level)

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: kernels releasing their successor unconditionally, and why: the input guard is a step's first
#: launch and reads nothing a launch before it wrote; the prologue linear's PREFETCH path releases
#: after its first K step at every width (its prefetch is the point of the overlap)
UNGATED = {("input_guard.py", "input_guard_kernel"), ("linear_fused.py", "linear_prologue_kernel")}


def test_the_level_follows_the_rows() -> None:
    pdl = {"launch_pdl": True}
    assert pdl_level({}, 1) == pdl_level({}, 64) == PDL_OFF  # no PDL on this device
    assert pdl_level(pdl, 1) == pdl_level(pdl, EARLY_RELEASE_MAX_ROWS) == PDL_EARLY == 2
    assert pdl_level(pdl, EARLY_RELEASE_MAX_ROWS + 1) == pdl_level(pdl, 4096) == PDL_WAIT == 1


def _release_calls(fn: ast.FunctionDef) -> list[tuple[ast.Call, list[ast.expr]]]:
    """Every gdc_launch_dependents() call in fn with the `if` tests enclosing it."""
    found: list[tuple[ast.Call, list[ast.expr]]] = []

    def walk(node: ast.AST, tests: list[ast.expr]) -> None:
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("gdc_launch_dependents"):
            found.append((node, tests))
        for name, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            inner = tests + [node.test] if isinstance(node, ast.If) and name == "body" else tests
            for child in children:
                if isinstance(child, ast.AST):
                    walk(child, inner)
    walk(fn, [])
    return found


def test_every_early_release_is_behind_the_level() -> None:
    """A release outside `if USE_PDL == 2` would release at every width, which measured slower
    on the small head at n = 64 (RESULTS.md, the tenth session): only UNGATED may."""
    gated, ungated = 0, set()
    for path in sorted(KERNELS.glob("*.py")):
        for fn in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)):
            for _, tests in _release_calls(fn):
                if any("USE_PDL == 2" in ast.unparse(t) for t in tests):
                    gated += 1
                else:
                    ungated.add((path.name, fn.name))
    assert ungated == UNGATED
    assert gated >= 25  # every chain kernel of kernels/ (27 when this was written)


def test_every_pdl_launch_passes_the_level() -> None:
    """`USE_PDL=` at a launch is `pdl_level(...)`, never a bare bool (which would read as
    PDL_WAIT at every width, and silently drop the early release)."""
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "USE_PDL":
                assert ast.unparse(node.value).startswith("pdl_level("), \
                    f"{path.name}:{node.lineno}: USE_PDL={ast.unparse(node.value)}"


#: the loads a kernel makes before its PDL wait, each of a parameter no launch writes (with an
#: early release the launch before may still be running then): a new one must be added here
PRE_WAIT_LOADS = {("linear_fused.py", "linear_prologue_kernel", "w_ptrs"),
                  ("linear_fused.py", "linear_prologue_kernel", "w_ptrs + up_offset"),
                  ("remap_bitmask.py", "remap_bitmask_kernel", "ids_ptr + s"),
                  ("rope_freqs.py", "rope_freqs_kernel", "freq_ptr + j")}


def _before_wait(fn: ast.FunctionDef) -> list[ast.stmt]:
    """fn's statements before the first one that holds its PDL wait (a gdc_wait call, or the
    attention kernels' `_program_rows`, which waits first thing)."""
    def waits(node: ast.AST) -> bool:
        return any(isinstance(c, ast.Call) and ast.unparse(c.func).split(".")[-1]
                   in ("gdc_wait", "_program_rows") for c in ast.walk(node))
    body = fn.body
    return body[:next((i for i, s in enumerate(body) if waits(s)), len(body))]


def test_nothing_is_written_or_read_from_a_launch_before_the_wait() -> None:
    """The early release is safe because a kernel does nothing before its wait that the launch
    before it (still running, once released early) could see or spoil: no store, no atomic,
    and loads of parameters only (PRE_WAIT_LOADS)."""
    loads = set()
    for path in sorted(KERNELS.glob("*.py")):
        for fn in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)
                   and any(isinstance(a, ast.arg) and a.arg == "USE_PDL" for a in n.args.args)):
            for stmt in _before_wait(fn):
                for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                    name = ast.unparse(call.func)
                    assert not (name.endswith(".store") or "atomic" in name), \
                        f"{path.name}:{fn.name}:{call.lineno}: {name} before the PDL wait"
                    if name.endswith(".load"):
                        loads.add((path.name, fn.name, ast.unparse(call.args[0])))
    assert loads == PRE_WAIT_LOADS


# rmsnorm's kernel alone (not its launcher module: the process never imports torch), compiled
# for sm90 at each level; prints what the PTX holds
_COMPILE_SCRIPT = textwrap.dedent("""
    import ast, importlib.util, pathlib, sys, tempfile
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import triton.backends.nvidia  # noqa: F401
    except ImportError as e:
        print(e)
        sys.exit(77)
    path = pathlib.Path(sys.argv[1])
    text = path.read_text()
    fn = next(n for n in ast.parse(text).body
              if isinstance(n, ast.FunctionDef) and n.name == "rmsnorm_kernel")
    source = "\\n".join(text.splitlines()[fn.decorator_list[0].lineno - 1:fn.end_lineno])
    tmp = pathlib.Path(tempfile.mkdtemp()) / "rmsnorm_only.py"
    tmp.write_text("import triton\\nimport triton.language as tl\\n\\n\\n" + source + "\\n")
    spec = importlib.util.spec_from_file_location("rmsnorm_only", tmp)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sig = dict.fromkeys(["x_ptr", "res_ptr", "sum_ptr", "out_ptr", "w_ptr"], "*bf16")
    sig.update(dict.fromkeys(["stride_x", "stride_res", "stride_sum", "stride_out", "hidden"], "i32"))
    sig["eps"] = "fp32"
    for level in (0, 1, 2):
        const = dict(HAS_RESIDUAL=False, ZERO_CENTRED=False, BLOCK=128, USE_PDL=level)
        kernel = triton.compile(
            ASTSource(fn=module.rmsnorm_kernel, signature=dict(sig, **dict.fromkeys(const, "constexpr")),
                      constexprs=const),
            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ptx = kernel.asm["ptx"]
        print("level", level, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
""")


def test_the_levels_compile_to_their_ptx() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(KERNELS / "rmsnorm.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 77:
        pytest.skip(f"no Triton NVIDIA backend to compile with: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("level")]
    assert lines == ["level 0 False False",   # PDL_OFF: neither
                     "level 1 True False",    # PDL_WAIT: the wait only
                     "level 2 True True"]     # PDL_EARLY: the wait, then the release
