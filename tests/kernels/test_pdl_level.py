"""The PDL level a launch gives its kernel (`kernels._common.pdl_level`): no PDL, wait only, or
wait and release the next launch early (at most EARLY_RELEASE_MAX_ROWS rows). Checked here: the
rule itself; that every chain kernel's early release sits behind the level (an AST walk over
kernels/, so a new kernel cannot release at every width by accident) and every launch passes the
level; that no kernel does anything before its wait that a still-running launch before it could
see or spoil (what makes the early release safe); and that the levels compile to the PTX they
name (sm90, no GPU needed, in an interpreter-free process)."""
from __future__ import annotations

import ast
from pathlib import Path

from draft_circuit.kernels._common import (EARLY_RELEASE_MAX_ROWS, PDL_EARLY, PDL_OFF, PDL_WAIT,
                                           pdl_level)
from tests import sm90_compile

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: releases of the next launch not behind `USE_PDL == 2`, and why: the input guard is a step's
#: first launch and reads nothing a launch before it wrote; the prologue linear's PREFETCH path
#: releases after its first K step at every PDL level (its prefetch is the point of the overlap)
UNGATED = {("input_guard.py", "input_guard_kernel", "TRIGGER"),
           ("linear_fused.py", "linear_prologue_kernel", "PREFETCH and USE_PDL")}
#: the kernels (or the attention kernels' shared helper) releasing behind `USE_PDL == 2`
GATED = 27
#: the loads a kernel makes before its PDL wait, each of a parameter no launch writes (with an
#: early release the launch before may still be running then): weights, the draft vocabulary's
#: ids (DRAFT_VOCAB_IDS, circuit/layers/mtp.py) and RoPE's inv_freq (INV_FREQ, a bound param).
#: A new one must be added here, and must be such a parameter
PRE_WAIT_LOADS = {("linear_fused.py", "linear_prologue_kernel", "w_ptrs"),
                  ("linear_fused.py", "linear_prologue_kernel", "w_ptrs + up_offset"),
                  ("remap_bitmask.py", "remap_bitmask_kernel", "ids_ptr + s"),
                  ("rope_freqs.py", "rope_freqs_kernel", "freq_ptr + j")}
#: jit helpers a kernel may call before its wait: arithmetic on its arguments, no memory
PURE_HELPERS = {"rope_inv_freq"}
WAITS = ("gdc_wait", "_program_rows")  # _program_rows: the attention kernels' wait, first thing


def test_the_level_follows_the_rows() -> None:
    pdl = {"launch_pdl": True}
    assert pdl_level({}, 1) == pdl_level({}, 64) == PDL_OFF  # no PDL on this device
    assert pdl_level(pdl, 1) == pdl_level(pdl, EARLY_RELEASE_MAX_ROWS) == PDL_EARLY == 2
    assert pdl_level(pdl, EARLY_RELEASE_MAX_ROWS + 1) == pdl_level(pdl, 4096) == PDL_WAIT == 1


def _functions() -> list[tuple[str, ast.FunctionDef]]:
    return [(path.name, n) for path in sorted(KERNELS.glob("*.py"))
            for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


def _calls(fn: ast.FunctionDef) -> list[ast.Call]:
    """Every call in fn's body (not its decorators), in source order."""
    calls = [c for stmt in fn.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _name(call: ast.Call) -> str:
    return ast.unparse(call.func).split(".")[-1]


def _releases(fn: ast.FunctionDef) -> list[tuple[ast.Call, list[ast.expr]]]:
    """Every gdc_launch_dependents() call in fn with the `if` tests enclosing it."""
    found: list[tuple[ast.Call, list[ast.expr]]] = []

    def walk(node: ast.AST, tests: list[ast.expr]) -> None:
        if isinstance(node, ast.Call) and _name(node) == "gdc_launch_dependents":
            found.append((node, tests))
        for name, value in ast.iter_fields(node):
            inner = tests + [node.test] if isinstance(node, ast.If) and name == "body" else tests
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    walk(child, inner)
    for stmt in fn.body:
        walk(stmt, [])
    return found


def _is_level_2(test: ast.expr) -> bool:
    """`USE_PDL == 2`, alone or as a term of an `and`."""
    terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return any(ast.unparse(t) == "USE_PDL == 2" for t in terms)


def test_every_early_release_follows_the_wait_behind_the_level() -> None:
    """A release outside `if USE_PDL == 2` would release at every width, which measured slower
    on the small head at n = 64 (RESULTS.md, the tenth session): only UNGATED may. Every
    release comes after the kernel's wait (else the next launch could start before this one
    has waited for its own predecessor)."""
    gated, ungated = 0, set()
    for file, fn in _functions():
        calls = _calls(fn)
        for release, tests in _releases(fn):
            waited = [c for c in calls if _name(c) in WAITS
                      and (c.lineno, c.col_offset) < (release.lineno, release.col_offset)]
            if file != "input_guard.py":  # the guard, a step's first launch, waits for nothing
                assert waited, f"{file}:{fn.name}:{release.lineno}: a release before the wait"
            if any(_is_level_2(t) for t in tests):
                gated += 1
            else:
                ungated.add((file, fn.name, " and ".join(map(ast.unparse, tests)) or "always"))
    assert ungated == UNGATED
    assert gated == GATED


def _use_pdl(call: ast.Call, fn: ast.FunctionDef) -> str | None:
    """The USE_PDL a launch passes: its keyword, or one of a dict it spreads (`**shared` with
    `shared = dict(..., USE_PDL=...)` in fn, or `**{**shared, ...}`)."""
    assigned = {t.id: node.value for node in ast.walk(fn) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}

    def find(keywords: list[ast.keyword], spread: list[ast.expr]) -> str | None:
        for k in keywords:
            if k.arg == "USE_PDL":
                return ast.unparse(k.value)
        for value in spread:
            if isinstance(value, ast.Name) and isinstance(assigned.get(value.id), ast.Call):
                found = find(assigned[value.id].keywords, [])  # type: ignore[union-attr]
            elif isinstance(value, ast.Dict):
                found = find([], [v for k, v in zip(value.keys, value.values) if k is None])
            else:
                found = None
            if found:
                return found
        return None
    return find(call.keywords, [k.value for k in call.keywords if k.arg is None])


def test_every_pdl_launch_passes_the_level_of_its_rows() -> None:
    """A launch with PDL (`**pdl` / `**kw`: a name bound to launch_kwargs(...)) passes
    `USE_PDL=pdl_level(that, n)` (the launcher's row count): never a bare bool, which would read
    as PDL_WAIT at every width and silently drop the early release."""
    launches = 0
    for file, fn in _functions():
        pdl_names = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and _name(node.value) == "launch_kwargs"
                     for t in node.targets if isinstance(t, ast.Name)} | {"pdl"}
        for call in _calls(fn):
            spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            pdl = [name for name in spread if name in pdl_names]
            if not pdl or not isinstance(call.func, ast.Subscript):  # not kernel[grid](...)
                continue
            launches += 1
            level = _use_pdl(call, fn)
            assert level == f"pdl_level({pdl[0]}, n)", \
                f"{file}:{call.lineno}: a PDL launch with USE_PDL={level}"
    assert launches >= GATED


def test_nothing_is_written_or_read_from_a_launch_before_the_wait() -> None:
    """The early release is safe because a kernel does nothing before its wait that the launch
    before it (still running, once released early) could see or spoil: no store, no atomic, no
    helper that could do either (PURE_HELPERS only), and loads of parameters only
    (PRE_WAIT_LOADS)."""
    loads, kernels = set(), 0
    for file, fn in _functions():
        if not any(a.arg == "USE_PDL" for a in fn.args.args):
            continue
        calls = _calls(fn)
        wait = next((c for c in calls if _name(c) in WAITS), None)
        assert wait is not None, f"{file}:{fn.name}: USE_PDL but no wait"
        kernels += 1
        for call in calls:
            if (call.lineno, call.col_offset) >= (wait.lineno, wait.col_offset):
                break
            name = ast.unparse(call.func)
            where = f"{file}:{fn.name}:{call.lineno}: {name} before the PDL wait"
            assert name.startswith("tl.") or _name(call) == "to" or name in PURE_HELPERS, where
            assert not (name.endswith(".store") or "atomic" in name), where
            if name.endswith(".load"):
                loads.add((file, fn.name, ast.unparse(call.args[0])))
    assert loads == PRE_WAIT_LOADS
    assert kernels >= GATED


# rmsnorm's kernel, compiled for sm90 at each level after tests/sm90_compile.py's preamble: whether
# the PTX holds the wait and the release, and in which order
_LEVELS = """
    sig = dict.fromkeys(["x_ptr", "res_ptr", "sum_ptr", "out_ptr", "w_ptr"], "*bf16")
    sig.update(dict.fromkeys(["stride_x", "stride_res", "stride_sum", "stride_out"], "i32"))
    sig["hidden"] = "i32"
    sig["eps"] = "fp32"
    for level in (0, 1, 2):
        const = dict(HAS_RESIDUAL=False, ZERO_CENTRED=False, BLOCK=128, USE_PDL=level)
        kernel = triton.compile(
            ASTSource(fn=module.rmsnorm_kernel, constexprs=const,
                      signature=dict(sig, **dict.fromkeys(const, "constexpr"))),
            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ptx = kernel.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        release = ptx.find("griddepcontrol.launch_dependents")
        print("level", level, wait >= 0, release >= 0, "in order" if wait < release else "")
"""


def test_the_levels_compile_to_their_ptx() -> None:
    proc = sm90_compile.run(_LEVELS, KERNELS / "rmsnorm.py")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("level")]
    assert lines == ["level 0 False False ",          # PDL_OFF: neither
                     "level 1 True False ",           # PDL_WAIT: the wait only
                     "level 2 True True in order"]    # PDL_EARLY: the wait, then the release
