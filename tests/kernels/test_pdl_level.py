"""The PDL arguments a launch gives its kernel (`kernels._common.pdl_args`): `USE_PDL`, a
constexpr, PDL off or on (the wait); and `pdl_release`, a runtime int no kernel specialises on,
1 where the launch also releases the next one early (PDL on and at most EARLY_RELEASE_MAX_ROWS
rows). Checked here: the rule itself; that every chain kernel's early release sits behind
`pdl_release` after its wait (an AST walk over kernels/, so a new kernel cannot release at every
width by accident) and that argument is in its `do_not_specialize`, every launch passing the
pair of its rows; that no kernel does anything before its wait that a still-running launch
before it could see or spoil (what makes the early release safe); and that the kernel compiles
(sm90, no GPU needed, in an interpreter-free process) to ONE variant for both `pdl_release`
values, whose PTX holds the wait, then the release behind a branch on that argument."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from draft_circuit.kernels import _common
from draft_circuit.kernels._common import EARLY_RELEASE_MAX_ROWS, PDL_OFF, PDL_WAIT, pdl_args
from tests import sm90_compile

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: releases of the next launch not behind `pdl_release`, and why: the input guard is a step's
#: first launch and reads nothing a launch before it wrote; the prologue linear's PREFETCH path
#: releases after its first K step whenever PDL is on (its prefetch is the point of the overlap)
UNGATED = {("input_guard.py", "input_guard_kernel", "TRIGGER"),
           ("linear_fused.py", "linear_prologue_kernel", "PREFETCH and USE_PDL")}
#: the kernels (or the attention kernels' shared helper, `_program_rows`) releasing behind
#: `pdl_release`
GATED = 27
#: the kernels launched with a `pdl_release` argument: GATED less the helper, plus the two
#: attention split kernels that hand theirs to it
RELEASING_KERNELS = 28
#: kernel launches passing `**pdl_args(...)`: one a kernel, but decode attention's shared
#: dict serves its three kernels and the fused split-K's `consts` its two
PDL_LAUNCHES = 31
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
RELEASE = "pdl_release"


def test_the_release_follows_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off without PDL at any width; with it (what launch_kwargs gives a PDL device) the wait at
    every width and the release exactly up to EARLY_RELEASE_MAX_ROWS rows; plain ints (a bool
    would reach the kernel as another type: a second compile)."""
    assert _common.launch_kwargs(torch.empty(1)) == {}  # a CPU tensor: no PDL
    monkeypatch.setattr(_common, "pdl_supported", lambda t: True)
    pdl = _common.launch_kwargs(torch.empty(1))
    assert pdl == {"launch_pdl": True}
    assert (PDL_OFF, PDL_WAIT) == (0, 1)
    widths = (0, 1, 8, EARLY_RELEASE_MAX_ROWS - 1, EARLY_RELEASE_MAX_ROWS,
              EARLY_RELEASE_MAX_ROWS + 1, 64, 4096)
    for n in widths:
        off, on = pdl_args({}, n), pdl_args(pdl, n)
        assert off == {"USE_PDL": PDL_OFF, "pdl_release": 0}, n
        assert on == {"USE_PDL": PDL_WAIT, "pdl_release": int(n <= EARLY_RELEASE_MAX_ROWS)}, n
        assert all(type(v) is int for v in (*off.values(), *on.values())), (n, off, on)
    assert pdl_args(pdl, EARLY_RELEASE_MAX_ROWS)["pdl_release"] == 1
    assert pdl_args(pdl, EARLY_RELEASE_MAX_ROWS + 1)["pdl_release"] == 0


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text())) for path in sorted(KERNELS.glob("*.py"))]


def _functions() -> list[tuple[str, ast.FunctionDef]]:
    return [(file, n) for file, tree in _modules() for n in tree.body
            if isinstance(n, ast.FunctionDef)]


def _calls(fn: ast.FunctionDef) -> list[ast.Call]:
    """Every call in fn's body (not its decorators), in source order."""
    calls = [c for stmt in fn.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _name(call: ast.Call) -> str:
    return ast.unparse(call.func).split(".")[-1]


def _is_constexpr(arg: ast.arg) -> bool:
    return arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)


def _releases(fn: ast.FunctionDef) -> list[tuple[ast.Call, list[ast.expr]]]:
    """Every gdc_launch_dependents() call in fn with the `if` tests enclosing it, outermost first."""
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


def _terms(test: ast.expr) -> list[ast.expr]:
    return test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]


def _is_release_gate(test: ast.expr) -> bool:
    """`pdl_release != 0`, alone or as a term of an `and`."""
    return any(ast.unparse(t) == f"{RELEASE} != 0" for t in _terms(test))


def test_every_early_release_follows_the_wait_behind_the_runtime_argument() -> None:
    """A release outside `if pdl_release != 0` would release at every width, which measured
    slower on the small head at n = 64 (RESULTS.md, the tenth session): only UNGATED may. A
    gated one sits inside the kernel's `if USE_PDL:` and tests its own runtime parameter (not a
    constexpr: one compiled variant whatever the width). Every release comes after the kernel's
    wait (else the next launch could start before this one has waited for its own predecessor)."""
    gated, ungated = 0, set()
    for file, fn in _functions():
        calls = _calls(fn)
        params = {a.arg: a for a in fn.args.args}
        for release, tests in _releases(fn):
            where = f"{file}:{fn.name}:{release.lineno}"
            waited = [c for c in calls if _name(c) in WAITS
                      and (c.lineno, c.col_offset) < (release.lineno, release.col_offset)]
            if file != "input_guard.py":  # the guard, a step's first launch, waits for nothing
                assert waited, f"{where}: a release before the wait"
            gates = [i for i, t in enumerate(tests) if _is_release_gate(t)]
            if not gates:
                ungated.add((file, fn.name, " and ".join(map(ast.unparse, tests)) or "always"))
                continue
            gated += 1
            assert RELEASE in params and not _is_constexpr(params[RELEASE]), \
                f"{where}: the release's gate is not a runtime parameter of {fn.name}"
            pdl_on = [i for i, t in enumerate(tests) if ast.unparse(t) == "USE_PDL"]
            assert pdl_on and pdl_on[0] < gates[0], f"{where}: the release is not inside `if USE_PDL:`"
            wait = waited[0]
            assert any(wait in ast.walk(t) for t in fn.body if isinstance(t, ast.If)
                       and ast.unparse(t.test) == "USE_PDL" and release in ast.walk(t)) \
                or _name(wait) == "_program_rows", f"{where}: the wait is not in the release's `if USE_PDL:`"
    assert ungated == UNGATED
    assert gated == GATED


def _called_names() -> set[str]:
    """Every function name called inside a kernels/ function: the jit helpers among them are
    inlined, never launched themselves."""
    return {_name(c) for _, fn in _functions() for c in _calls(fn)}


def _do_not_specialize(fn: ast.FunctionDef) -> list[str] | None:
    """The names in `@triton.jit(do_not_specialize=[...])` (or `unspecialized_jit([...], ...)`,
    its first argument); None where the decorator has no such list."""
    dec = fn.decorator_list[0] if fn.decorator_list else None
    if not isinstance(dec, ast.Call):
        return None
    if ast.unparse(dec.func) == "unspecialized_jit" and dec.args:
        return ast.literal_eval(dec.args[0])
    lists = [k.value for k in dec.keywords if k.arg == "do_not_specialize"]
    return ast.literal_eval(lists[0]) if lists else None


def test_release_is_a_runtime_argument_no_kernel_specialises_on() -> None:
    """Every kernel taking `pdl_release` lists it in its decorator's `do_not_specialize` (else
    Triton compiles 1 as a constant: a second variant for the widths past 32, what this argument
    is for), takes it as its last non-constexpr parameter and `USE_PDL` as a constexpr; and no
    kernel compares `USE_PDL` with anything (it is on/off only: a level 2 would be a constexpr
    variant again)."""
    helpers = _called_names()
    kernels = set()
    for file, fn in _functions():
        where = f"{file}:{fn.name}"
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                assert "USE_PDL" not in names, f"{where}:{node.lineno}: {ast.unparse(node)}"
        params = {a.arg: a for a in fn.args.args}
        if RELEASE not in params:
            continue
        assert "USE_PDL" in params and _is_constexpr(params["USE_PDL"]), f"{where}: USE_PDL not a constexpr"
        runtime = [a.arg for a in fn.args.args if not _is_constexpr(a)]
        assert runtime[-1] == RELEASE and not _is_constexpr(params[RELEASE]), \
            f"{where}: {RELEASE} must be the last runtime parameter"
        if fn.name in helpers:  # inlined into its callers, which take their own
            continue
        kernels.add((file, fn.name))
        assert RELEASE in (_do_not_specialize(fn) or []), \
            f"{where}: {RELEASE} not in its @triton.jit's do_not_specialize"
    assert len(kernels) == RELEASING_KERNELS, sorted(kernels)


def _spreads(call: ast.Call, fn: ast.FunctionDef) -> tuple[list[str], list[str]]:
    """What a launch spreads (`**x`) and names (`k=...`), through the dicts it spreads:
    `**shared` with `shared = dict(..., **y)` in fn, or `**{**shared, ...}`."""
    assigned = {t.id: node.value for node in ast.walk(fn) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    spread: list[str] = []
    named: list[str] = []

    def visit(keywords: list[ast.keyword], values: list[ast.expr]) -> None:
        named.extend(k.arg for k in keywords if k.arg is not None)
        for value in [k.value for k in keywords if k.arg is None] + values:
            spread.append(ast.unparse(value))
            bound = assigned.get(value.id) if isinstance(value, ast.Name) else None
            if isinstance(bound, ast.Call) and ast.unparse(bound.func) == "dict":
                visit(bound.keywords, [])
            elif isinstance(value, ast.Dict):
                named.extend(ast.unparse(k) for k in value.keys if k is not None)
                visit([], [v for k, v in zip(value.keys, value.values) if k is None])
    visit(call.keywords, [])
    return spread, named


def test_every_pdl_launch_passes_the_pair_of_its_rows() -> None:
    """A launch with PDL (spreading `**pdl` / `**kw`: a name bound to launch_kwargs(...)) spreads
    `**pdl_args(that, n)` (the launcher's row count), and names neither `USE_PDL` nor
    `pdl_release` itself: a bare value would wait, or release, at every width. Every kernel
    taking `pdl_release` is launched so, and nothing else is."""
    launches, launched = 0, set()
    for file, fn in _functions():
        pdl_names = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Call) and _name(node.value) == "launch_kwargs"
                     for t in node.targets if isinstance(t, ast.Name)} | {"pdl"}
        for call in _calls(fn):
            if not isinstance(call.func, ast.Subscript):  # not kernel[grid](...)
                continue
            spread, named = _spreads(call, fn)
            pdl = [name for name in spread if name in pdl_names]
            where = f"{file}:{call.lineno}: {ast.unparse(call.func.value)}"
            if not pdl:
                assert not any(s.startswith("pdl_args(") for s in spread), where
                continue
            launches += 1
            launched.add(ast.unparse(call.func.value))
            assert f"pdl_args({pdl[0]}, n)" in spread, f"{where}: a PDL launch spreading {spread}"
            assert not {"USE_PDL", RELEASE} & set(named), f"{where}: names {named}"
    kernels = {fn.name for _, fn in _functions() if any(a.arg == RELEASE for a in fn.args.args)}
    assert launched == kernels - _called_names()
    assert launches == PDL_LAUNCHES


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


# rmsnorm's kernel bound as JITFunction.run binds a launch (the sm90 backend's specialisation,
# Triton's in-memory cache key) for pdl_release 0 and 1 with PDL on, compiled for sm90 after
# tests/sm90_compile.py's preamble; then PDL off. Prints whether the two bind and compile to one
# kernel, and whether the PTX holds the wait and the release, in order, the release skipped by a
# branch on a predicate set from pdl_release's parameter
_VARIANTS = """
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    fn = module.rmsnorm_kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    runtime = [p.name for p in fn.params if not p.is_constexpr]
    class Ptr:  # what a launch's bf16 tensor binds as (16-byte aligned)
        dtype = triton.language.bfloat16
        @staticmethod
        def data_ptr():
            return 0
    def bound(use_pdl, release):
        args = [Ptr()] * 5 + [4096, 4096, 4096, 4096, 4096, 1e-6, release]
        assert len(args) == len(runtime) and runtime[-1] == "pdl_release", runtime
        return binder(*args, HAS_RESIDUAL=False, ZERO_CENTRED=False, BLOCK=4096, USE_PDL=use_pdl,
                      num_warps=4)
    def compiled(use_pdl, release):
        params, spec, opts = bound(use_pdl, release)
        options, signature, constexprs, attrs = fn._pack_args(backend, opts, params, spec, opts)
        return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    specs = [bound(1, r)[1] for r in (0, 1)]
    print("spec", specs[0][runtime.index("pdl_release")], specs[1][runtime.index("pdl_release")])
    print("key same", compute_cache_key({}, specs[0], {"num_warps": 4})
          == compute_cache_key({}, specs[1], {"num_warps": 4}))
    k0, k1 = compiled(1, 0), compiled(1, 1)
    print("hash same", k0.hash == k1.hash, "ptx same", k0.asm["ptx"] == k1.asm["ptx"])
    ptx = k1.asm["ptx"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    index = runtime.index("pdl_release")
    param = re.search(r"ld\\.param\\.[bsu]32\\s+(%r\\d+), \\[rmsnorm_kernel_param_" + str(index) + r"\\];",
                      ptx)
    pred = param and re.search(r"setp\\.\\w+\\.[bsu]32\\s+(%p\\d+), " + param[1] + ", 0;", ptx)
    skip = pred and [b for b in re.finditer("@!?" + pred[1] + r" bra\\s+([$\\w]+);", ptx)
                     if wait < b.start() < release]
    label = skip and ptx.find(skip[-1][1] + ":")
    print("on", wait >= 0, release >= 0, "in order" if 0 <= wait < release else "",
          "branch" if skip and label > release else "straight",
          ptx.count("griddepcontrol.launch_dependents"))
    ptx = compiled(0, 1).asm["ptx"]
    print("off", "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
    shutil.rmtree(tmp.parent)
"""


def test_one_variant_compiles_the_release_behind_its_argument() -> None:
    proc = sm90_compile.run(_VARIANTS, KERNELS / "rmsnorm.py")
    lines = [line for line in proc.stdout.splitlines()
             if line.split(" ")[0] in ("spec", "key", "hash", "on", "off")]
    assert lines == [
        "spec ('i32', None) ('i32', None)",  # 0 and 1 bind alike: no constant, no divisibility
        "key same True",                     # one entry in the JIT's kernel cache
        "hash same True ptx same True",      # one compiled kernel
        "on True True in order branch 1",    # the wait, then the release a branch skips
        "off False False",                   # PDL off: neither
    ], proc.stdout
