"""The PDL arguments a launch gives its kernel (`kernels._common.pdl_args`): `USE_PDL`, a
constexpr, PDL off or on (the wait); and `pdl_release`, a runtime int no kernel specialises on,
1 where the launch also releases the next one early (PDL on and at most EARLY_RELEASE_MAX_ROWS
rows). Checked here: the rule itself; that every chain kernel's early release sits behind
`pdl_release` after its wait (an AST walk over kernels/, so a new kernel cannot release at every
width by accident) and that argument is in its `do_not_specialize`, every launch passing the
pair of its rows; that no kernel does anything before its wait that a still-running launch
before it could see or spoil (what makes the early release safe); and that every kernel taking
`pdl_release`, launched by its own launcher at a real head's shapes, compiles (sm90, no GPU
needed, in an interpreter-free process) to ONE variant for both `pdl_release` values, whose PTX
holds the wait, then the release behind a branch on that argument, and neither with PDL off."""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch

from draft_circuit.kernels import _common
from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels._common import EARLY_RELEASE_MAX_ROWS, PDL_OFF, PDL_WAIT, pdl_args
from draft_circuit.kernels.argmax_logprob import argmax_logprob, linear_argmax_logprob
from draft_circuit.kernels.decode_attention import decode_attention
from draft_circuit.kernels.head_linear import head_linear
from draft_circuit.kernels.linear import linear
from draft_circuit.kernels.linear_fp8 import linear_fp8
from draft_circuit.kernels.linear_fused import linear_prologue, rmsnorm_linear_qkv
from draft_circuit.kernels.linear_fused_splitk import linear_prologue_splitk
from draft_circuit.kernels.linear_multi import linear_concat, linear_qkv
from draft_circuit.kernels.linear_splitk import linear_splitk
from draft_circuit.kernels.mla_decode import mla_decode_attention
from draft_circuit.kernels.mla_kv_write import mla_kv_write
from draft_circuit.kernels.qkv_rope import rmsnorm_qkv_rope_kv_write
from draft_circuit.kernels.remap_bitmask import remap_bitmask
from draft_circuit.kernels.rmsnorm import rmsnorm
from draft_circuit.kernels.rope_freqs import rope_freqs
from draft_circuit.kernels.rope_kv_write import rope_kv_write
from draft_circuit.kernels.sigmoid_mul import sigmoid_mul
from draft_circuit.kernels.silu_mul import silu_mul
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


def _releasing_kernels() -> set[tuple[str, str]]:
    """(file, name) of every kernel launched with a `pdl_release` argument: the kernels/
    functions taking it, less the jit helpers inlined into them."""
    helpers = _called_names()
    return {(file, fn.name) for file, fn in _functions()
            if any(a.arg == RELEASE for a in fn.args.args) and fn.name not in helpers}


def test_release_is_a_runtime_argument_no_kernel_specialises_on() -> None:
    """Every kernel taking `pdl_release` lists it in its decorator's `do_not_specialize` (else
    Triton compiles 1 as a constant: a second variant for the widths past 32, what this argument
    is for), takes it as its last non-constexpr parameter and `USE_PDL` as a constexpr; and no
    kernel compares `USE_PDL` with anything (it is on/off only: a level 2 would be a constexpr
    variant again)."""
    helpers = _called_names()
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
        assert RELEASE in (_do_not_specialize(fn) or []), \
            f"{where}: {RELEASE} not in its @triton.jit's do_not_specialize"
    assert len(_releasing_kernels()) == RELEASING_KERNELS, sorted(_releasing_kernels())


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


class Head(NamedTuple):
    """A dense head's shapes, as its launches take them."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


#: benchmarks/draft_chain.py's "small" and "8b" heads (bf16)
SMALL = Head(hidden=1024, inter=2816, heads=16, kv_heads=4, head_dim=64, vocab=32000)
LLAMA_8B = Head(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)
DRAFT_VOCAB = 32768  # the 8B's reduced draft vocabulary (FR-Spec's most frequent ids, issue 18)
#: DeepSeek-V3's MLA (benchmarks/deepseek_head.py): hidden, q_lora_rank, heads, the latent
#: (kv_lora_rank), the rope part (qk_rope_head_dim), qk_nope_head_dim; fp8 weights, scale blocks
#: of 128 columns. Its YaRN rope (factor 40, mscale = mscale_all_dim = 1; circuit/layers/rope.py):
#: cos and sin unscaled (attention factor 1), the softmax scale (qk_nope + qk_rope) ** -0.5 times
#: DS_MSCALE ** 2
DS_HIDDEN, DS_Q_LORA, DS_HEADS, DS_LATENT, DS_ROPE, DS_NOPE = 7168, 1536, 128, 512, 64, 128
DS_MSCALE = 0.1 * math.log(40.0) + 1.0
#: the paged KV pool: the engine's 16-row blocks (examples/engine), 64 blocks a row
BLOCK_ROWS, MAX_BLOCKS = 16, 64
#: the launches' rows: at most EARLY_RELEASE_MAX_ROWS, so every launch releases (pdl_release 1);
#: N_WIDE, the most rows that still release, where sm90's tile rule (kernels.tiles) widens
N, N_WIDE = 8, EARLY_RELEASE_MAX_ROWS
BF16, I32, F32 = torch.bfloat16, torch.int32, torch.float32


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """Uninitialised CPU memory: a launcher reads a tensor's shape, strides, dtype and address
    only (its kernel is compiled here, never run)."""
    return torch.empty(shape, dtype=dtype)


def _cache(n: int, heads: int, dim: int) -> torch.Tensor:
    """A paged cache [blocks, BLOCK_ROWS, heads, dim]: block 0 the scratch one, MAX_BLOCKS a row."""
    return _t(1 + n * MAX_BLOCKS, BLOCK_ROWS, heads, dim)


def _eh_proj(head: Head, n: int) -> dict[str, torch.Tensor]:
    """The MTP head's eh_proj, as its prologue linears take it: [enorm(embed[tokens]) |
    hnorm(hidden)] @ W^T, W [hidden, 2 hidden]."""
    h = head.hidden
    return dict(x1=_t(head.vocab, h), weight=_t(h, 2 * h), out=_t(n, h), ids=_t(n, dtype=I32),
                norm1=_t(h), x2=_t(n, h), norm2=_t(h))


def _qkv(head: Head, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """q/k/v's weights [heads * D, hidden], [kv_heads * D, hidden] (twice) and their outputs."""
    rows = [head.heads * head.head_dim] + [head.kv_heads * head.head_dim] * 2
    return [_t(r, head.hidden) for r in rows], [_t(n, r) for r in rows]


def _decode_attention(dot: bool) -> None:  # the small head's GQA attention over the pool
    h = SMALL
    q = _t(N, h.heads * h.head_dim)
    decode_attention(q, _cache(N, h.kv_heads, h.head_dim), _cache(N, h.kv_heads, h.head_dim),
                     _t(N, MAX_BLOCKS, dtype=I32), _t(N, dtype=I32), torch.empty_like(q),
                     num_heads=h.heads, num_kv_heads=h.kv_heads, head_dim=h.head_dim,
                     scale=h.head_dim ** -0.5, row_offset=1, dot=dot)


def _mla_decode() -> None:  # DeepSeek-V3's absorbed attention over the latent pool
    q_lat = _t(N, DS_HEADS * DS_LATENT)
    mla_decode_attention(q_lat, _t(N, DS_HEADS * DS_ROPE), _cache(N, 1, DS_ROPE),
                         _cache(N, 1, DS_LATENT), _t(N, MAX_BLOCKS, dtype=I32), _t(N, dtype=I32),
                         torch.empty_like(q_lat),
                         scale=(DS_NOPE + DS_ROPE) ** -0.5 * DS_MSCALE ** 2, row_offset=1)


def _mla_kv_write() -> None:  # DeepSeek-V3's latent and rope key into their pools
    mla_kv_write(_cache(N, 1, DS_ROPE), _cache(N, 1, DS_LATENT), _t(N, DS_LATENT), _t(N, DS_ROPE),
                 _t(N, MAX_BLOCKS, dtype=I32), _t(N, dtype=I32), row_offset=1,
                 active=_t(N, dtype=I32))


def _rope_kv_write() -> None:  # the small head's q/k rope and paged k/v write
    h = SMALL
    q = _t(N, h.heads * h.head_dim)
    rope_kv_write(q, _t(N, h.kv_heads * h.head_dim), _t(N, h.kv_heads * h.head_dim),
                  _t(N, dtype=I32), _t(N, dtype=I32), _t(N, MAX_BLOCKS, dtype=I32),
                  _cache(N, h.kv_heads, h.head_dim), _cache(N, h.kv_heads, h.head_dim),
                  torch.empty_like(q), num_heads=h.heads, num_kv_heads=h.kv_heads,
                  head_dim=h.head_dim, theta=10000.0, pos_offset=1, row_offset=1,
                  active=_t(N, dtype=I32))


def _qkv_rope() -> None:  # the same, its q/k/v products and input norm in the one launch
    h = SMALL
    weights, _ = _qkv(h, N)
    rmsnorm_qkv_rope_kv_write(
        _t(N, h.hidden), _t(h.hidden), 1e-6, weights, _t(N, dtype=I32), _t(N, dtype=I32),
        _t(N, MAX_BLOCKS, dtype=I32), _cache(N, h.kv_heads, h.head_dim),
        _cache(N, h.kv_heads, h.head_dim), _t(N, h.heads * h.head_dim), head_dim=h.head_dim,
        theta=10000.0, pos_offset=1, row_offset=1, active=_t(N, dtype=I32))


def _lm_head() -> None:  # the small head's draft: final norm, lm head, argmax, keep, last, gate
    h, rows = SMALL, [_t(N, dtype=I32) for _ in range(5)]
    linear_argmax_logprob(_t(N, h.hidden), _t(h.vocab, h.hidden), rows[0], _t(N, dtype=F32),
                          active=rows[1], kept_out=rows[2], norm_weight=_t(h.hidden),
                          fallback=rows[3], last_out=rows[4], log_tau=_t(N, dtype=F32),
                          active_out=_t(N, dtype=I32))


#: every kernel taking `pdl_release`, launched by its own launcher at a real head's shapes (a
#: kernel's constexprs, warps, stages and argument types are then its launcher's): entry -> the
#: call. Each compiles for sm90 in the launch it makes there (the sm90 tile rule of kernels.tiles
#: included); a new such kernel needs an entry here
LAUNCHES: dict[str, Callable[[], object]] = {
    "rmsnorm": lambda: rmsnorm(_t(N, SMALL.hidden), _t(SMALL.hidden), _t(N, SMALL.hidden), 1e-6),
    "silu_mul": lambda: silu_mul(_t(N, 2 * SMALL.inter), _t(N, SMALL.inter)),
    # Qwen3-Next's gated attention output: 16 heads of 256
    "sigmoid_mul": lambda: sigmoid_mul(_t(N, 4096), _t(N, 4096), _t(N, 4096)),
    "linear": lambda: linear(_t(N, SMALL.hidden), _t(SMALL.hidden, SMALL.hidden),
                             _t(N, SMALL.hidden)),
    # the 8B's o_proj at 32 rows: sm90's BLOCK_M 64 tile (kernels.tiles)
    "linear wide": lambda: linear(_t(N_WIDE, LLAMA_8B.hidden), _t(LLAMA_8B.hidden, LLAMA_8B.hidden),
                                  _t(N_WIDE, LLAMA_8B.hidden)),
    # DeepSeek-V3's q_a_proj, its fp8 weight's 128-column scales expanded to rows
    "linear_fp8": lambda: linear_fp8(_t(N, DS_HIDDEN), _t(DS_Q_LORA, DS_HIDDEN,
                                                          dtype=torch.float8_e4m3fn),
                                     _t(DS_Q_LORA, DS_HIDDEN // 128, dtype=F32), _t(N, DS_Q_LORA)),
    # DeepSeek-V3's W_UK^T: each head's nope query into the latent
    "head_linear": lambda: head_linear(_t(N, DS_HEADS * DS_NOPE), _t(DS_HEADS, DS_LATENT, DS_NOPE),
                                       _t(N, DS_HEADS * DS_LATENT)),
    "linear_prologue": lambda: linear_prologue(**_eh_proj(SMALL, N)),
    # the tuning variant: the first weight tile before the wait, the release after the first K
    # step whatever pdl_release says (UNGATED)
    "linear_prologue prefetch": lambda: linear_prologue(**_eh_proj(SMALL, N), prefetch=True),
    "rmsnorm_linear_qkv": lambda: rmsnorm_linear_qkv(_t(N, SMALL.hidden), _t(SMALL.hidden), 1e-6,
                                                     *_qkv(SMALL, N)),
    # the 8B's q/k/v on their normed input (prologue_norm.QKV_PRENORM_FROM_N)
    "linear_qkv": lambda: linear_qkv(_t(N, LLAMA_8B.hidden), *_qkv(LLAMA_8B, N)),
    "linear_concat": lambda: linear_concat(_t(N, SMALL.hidden), _t(N, SMALL.hidden),
                                           _t(SMALL.hidden, 2 * SMALL.hidden), _t(N, SMALL.hidden)),
    # the 8B's down_proj and its residual: split-K partials, then the reduce
    "linear_splitk": lambda: linear_splitk(
        _t(N, LLAMA_8B.inter), _t(LLAMA_8B.hidden, LLAMA_8B.inter), _t(N, LLAMA_8B.hidden),
        residual=_t(N, LLAMA_8B.hidden)),
    # the same at 32 rows: the partials in sm90's M-loop (kernels.linear_wide)
    "linear_splitk wide": lambda: linear_splitk(
        _t(N_WIDE, LLAMA_8B.inter), _t(LLAMA_8B.hidden, LLAMA_8B.inter),
        _t(N_WIDE, LLAMA_8B.hidden), residual=_t(N_WIDE, LLAMA_8B.hidden)),
    # the 8B's eh_proj (linear_fused_splitk.splitk_pays): the prologue in the partials
    "linear_prologue_splitk": lambda: linear_prologue_splitk(**_eh_proj(LLAMA_8B, N)),
    # its M-loop partials, a tile mode the sweeps force (the rule keeps this kind pinned)
    "linear_prologue_splitk mloop": lambda: linear_prologue_splitk(**_eh_proj(LLAMA_8B, N_WIDE),
                                                                   tiles=tiling.MLOOP),
    # at 32 rows its prologue is a launch of its own (prologue_norm.prenorm_pays)
    "linear_prologue_splitk prenorm": lambda: linear_prologue_splitk(
        **_eh_proj(LLAMA_8B, N_WIDE), normed=_t(N_WIDE, 2 * LLAMA_8B.hidden)),
    # logits already made, a grammar's bitmask on them
    "argmax_logprob": lambda: argmax_logprob(_t(N, SMALL.vocab), _t(N, dtype=I32), _t(N, dtype=F32),
                                             _t(N, -(-SMALL.vocab // 32), dtype=I32)),
    "linear_argmax_logprob": _lm_head,
    "decode_attention": lambda: _decode_attention(dot=True),
    "decode_attention elementwise": lambda: _decode_attention(dot=False),
    "mla_decode_attention": _mla_decode,
    "mla_kv_write": _mla_kv_write,
    "rope_kv_write": _rope_kv_write,
    "rmsnorm_qkv_rope_kv_write": _qkv_rope,
    # DeepSeek-V3's YaRN rope on the query's rope part
    "rope_freqs": lambda: rope_freqs(_t(N, DS_HEADS * DS_ROPE), _t(N, dtype=I32),
                                     _t(DS_ROPE // 2, dtype=F32), _t(N, DS_HEADS * DS_ROPE),
                                     head_dim=DS_ROPE, attention_factor=1.0, pos_offset=1),
    # the 8B's grammar bitmask onto its draft vocabulary
    "remap_bitmask": lambda: remap_bitmask(_t(N, -(-LLAMA_8B.vocab // 32), dtype=I32),
                                           _t(DRAFT_VOCAB, dtype=I32),
                                           _t(N, DRAFT_VOCAB // 32, dtype=I32)),
}
#: the (entry, "file:kernel") launches whose release is not behind pdl_release: UNGATED's
UNCONDITIONAL = {("linear_prologue prefetch", "linear_fused.py:linear_prologue_kernel")}


def _pdl_in_ptx(ptx: str, kernel: str, index: int) -> str:
    """What a kernel's PTX does with PDL: 'none' without griddepcontrol; else whether it waits,
    how many releases (griddepcontrol.launch_dependents) follow the wait, and whether the
    release is 'behind pdl_release' (a branch between the two, on a predicate set from its
    parameter `index` compared with 0, jumps past it) or 'unconditional'."""
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    if wait < 0 and release < 0:
        return "none"
    param = re.search(rf"ld\.param\.[bsu]32\s+(%r\d+), \[{kernel}_param_{index}\];", ptx)
    pred = param and re.search(rf"setp\.\w+\.[bsu]32\s+(%p\d+), {param[1]}, 0;", ptx)
    skips = [b for b in re.finditer(rf"@!?{pred[1]} bra\s+([$\w]+);", ptx)
             if wait < b.start() < release] if pred else []
    gated = bool(skips) and ptx.find(skips[-1][1] + ":") > release
    count = ptx.count("griddepcontrol.launch_dependents")
    return (f"{'wait' if wait >= 0 else 'no wait'}, {count} release "
            f"{'after' if 0 <= wait < release else 'not after'} it, "
            f"{'behind pdl_release' if gated else 'unconditional'}")


def _compile_launches() -> None:
    """Run in tests/sm90_compile.py's process (compiled Triton, no GPU). Every LAUNCHES entry's
    launcher runs as on an sm90 GPU (device 0: compiled, PDL, kernels.tiles' sm90 rule); each
    `kernel[grid](...)` it makes is compiled for GPUTarget("cuda", 90, 32) by JITFunction.run's
    warm-up (its binding, cache key and compile: a launch's, less the launch), then again with
    pdl_release 0 and with PDL off. Prints a JSON line per launch: the entry, the kernel
    ("file:name"), pdl_release's value and signature type, whether 0 got the kernel compiled for
    1 (the JIT's one cache entry), and _pdl_in_ptx with PDL on and off."""
    from triton.runtime.jit import JITFunction, KernelInterface

    sm90_compile.pretend_sm90()
    # an entry's launches, in order: (kernel, grid, args, kwargs)
    made: list[tuple[JITFunction, object, tuple[object, ...], dict[str, object]]] = []
    # `kernel[grid](...)` records the launch instead of making it
    setattr(KernelInterface, "__getitem__", lambda kernel, grid: lambda *args, **kwargs:
            made.append((kernel, grid, args, kwargs)))
    for entry, launcher in LAUNCHES.items():
        made.clear()  # (and its tensors: a head's weights, uninitialised but allocated)
        launcher()
        for kernel, grid, args, kwargs in made:
            on = kernel.run(*args, grid=grid, warmup=True, **kwargs)
            again = kernel.run(*args, grid=grid, warmup=True, **{**kwargs, RELEASE: 0})
            plain = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
            off = kernel.run(*args, grid=grid, warmup=True, **{**plain, **pdl_args({}, N)})
            name = kernel.fn.__name__
            runtime = [p for p, kind in on.src.signature.items() if kind != "constexpr"]
            # -1: specialised to a constant, no parameter of the compiled kernel
            index = runtime.index(RELEASE) if RELEASE in runtime else -1
            print(json.dumps(dict(
                entry=entry, kernel=f"{Path(kernel.fn.__code__.co_filename).name}:{name}",
                release=[kwargs[RELEASE], on.src.signature[RELEASE]], one=again is on,
                on=_pdl_in_ptx(on.asm["ptx"], name, index),
                off=_pdl_in_ptx(off.asm["ptx"], name, index))))


def test_every_kernel_compiles_one_variant_releasing_behind_its_argument() -> None:
    """Every kernel taking `pdl_release` (the AST walk's set: one LAUNCHES entry at least each),
    compiled for sm90 as its launcher launches it at up to EARLY_RELEASE_MAX_ROWS rows: an i32
    pdl_release of 1; one compiled kernel for 0 and 1 (the JIT's cache key: no constant, no
    divisibility); PTX holding the wait, then one release, which a branch on pdl_release's
    parameter skips (UNCONDITIONAL: after the prefetching prologue's first K step instead); with
    PDL off, neither instruction."""
    proc = sm90_compile.run("from tests.kernels import test_pdl_level\n"
                            "test_pdl_level._compile_launches()\n", None)
    assert {tuple(k.split(":")) for _, k in UNCONDITIONAL} <= {(f, k) for f, k, _ in UNGATED}
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    compiled = {tuple(r["kernel"].split(":")) for r in records}
    missing = sorted(_releasing_kernels() - compiled)
    assert not missing, f"no LAUNCHES entry launches {missing}: add one, at a real head's shapes"
    assert compiled == _releasing_kernels(), proc.stdout
    got = {(r["entry"], r["kernel"]): (r["release"], r["one"], r["on"], r["off"]) for r in records}
    gated = "wait, 1 release after it, behind pdl_release"
    straight = "wait, 1 release after it, unconditional"
    assert got == {key: ([1, "i32"], True, straight if key in UNCONDITIONAL else gated, "none")
                   for key in got}
