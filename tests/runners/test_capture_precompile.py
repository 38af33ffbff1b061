"""GraphRunner's precompile (issue 15 item 5): `precompile_kernels` visits every launch the
captured widths make, with Triton's launch entry diverted so nothing runs, and compiles each
distinct specialisation once. On CPU (TRITON_INTERPRET=1) it runs the very launchers the
program runs, so the test records the real launches of every width under the interpreter and
checks the keys the precompile visited cover them (and that it launched nothing); on a GPU, a
capture after the precompile compiles no kernel at all."""
from __future__ import annotations

import json
import threading

import pytest
import torch
import triton
import triton.language as tl

from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.circuit.program import REFERENCE
from draft_circuit.kernels.input_guard import MIN_BLOCK_N
from draft_circuit.runners.precompile import _compile_only, precompile_kernels
from draft_circuit.runners.specialisation import specialisation_key
from draft_circuit.runners.padding import fill_neutral
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import cuda, random_mtp_weights
from tests import sm90_compile
from tests.runners.tiny_chain import tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
# 1 (the ==1 class), powers of two and their neighbours (a constexpr next_power_of_2(n) changes
# there), 16 and 32 (the %16 class) and 17 / 33 beside them
WIDTHS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33]


@triton.jit
def _probe(x_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@triton.jit(do_not_specialize=["flag"])
def _unspecialised_probe(x_ptr, n, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if flag != 0:
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _runner(k: int, widths: list[int]) -> ProgramRunner:
    """The tiny head's k-step chain compiled for `widths` (interpreted kernels), its static
    inputs at their neutral values (what GraphRunner captures over)."""
    head = MtpHead(CFG)
    circuit = emit_draft_chain(head, k, max_width=max(widths), kv=KV)
    params = head.bind(random_mtp_weights(CFG, seed=5))
    compiled = compile_draft(circuit, params, widths, options=CompileOptions(interpret_kernels=True))
    states = {"k_cache": torch.zeros(KV.num_blocks, KV.block_size, CFG.num_key_value_heads, CFG.head_dim),
              "v_cache": torch.zeros(KV.num_blocks, KV.block_size, CFG.num_key_value_heads, CFG.head_dim)}
    runner = ProgramRunner(compiled, states, debug=0)
    fill_neutral(compiled.circuit, runner.static_inputs, 0, 0)
    return runner


@pytest.fixture(scope="module")
def program():
    return _runner(2, WIDTHS)


@pytest.fixture
def launched(monkeypatch):
    """The specialisation keys of the interpreter's real (not warm-up) launches, in order."""
    from triton.runtime import interpreter

    seen: list[tuple] = []
    run = interpreter.InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        if not warmup:
            seen.append(specialisation_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recorded)
    return seen


def test_precompile_covers_every_launch_the_widths_make(program, launched):
    for w in WIDTHS:
        program.execute(w)
    real = set(launched)
    assert real, "the interpreted program launched no Triton kernel"
    before = {k: v.clone() for k, v in program.states.items()}
    out_before = {k: v.clone() for k, v in program.output_buffers(max(WIDTHS)).items()}
    launched.clear()
    done = precompile_kernels(program, WIDTHS, threads=2)
    assert launched == [], "precompile launched kernels instead of only compiling them"
    for k, v in program.states.items():
        assert torch.equal(v, before[k]), f"precompile wrote state {k}"
    for k, v in program.output_buffers(max(WIDTHS)).items():
        assert torch.equal(v, out_before[k]), f"precompile wrote output {k}"
    assert real <= done.keys, f"launches precompile never saw: {sorted(real - done.keys)[:3]}"
    assert done.keys == real  # nothing it compiles is never launched either
    # every kernel launch of every width was visited, and the keys dedupe them
    expected = sum(1 for w in WIDTHS for x in program.kernel_launches(w))
    assert done.launches >= expected > len(done.keys)
    assert done.kernels == 0  # the interpreter compiles nothing
    assert not done.forked and done.children_failed == 0  # forks only for a CUDA device


def _names(keys):
    return {k[0].rsplit(".", 1)[-1] for k in keys}


def test_widths_split_compiles_only_through_their_constexprs(program, launched):
    """Which compiles a width needs: only those its constexprs ask for (tiles, the input
    guard's block of max(MIN_BLOCK_N, next_power_of_2(n)) rows). Every runtime int that follows
    the width (n_rows, the input guard's n, a prologue's table_rows, which is the rows of x when
    nothing is gathered) is in its kernel's `do_not_specialize`: else Triton compiles n == 1
    and n % 16 == 0 apart (what GraphRunner's once-per-`warmup_class` warm-up was for: widths 2,
    4, 8, 15, 16, 31, 32 compiled inside their capture on the H200). So no two compiles of a
    kernel share their constexprs and launch options; widths of one power-of-two block share
    every compile."""
    assert MIN_BLOCK_N == 16  # the widths below are chosen around it
    by_width = {}
    for w in WIDTHS:
        launched.clear()
        program.execute(w)
        by_width[w] = frozenset(launched)
    every = frozenset().union(*by_width.values())
    compiles: dict[tuple, list] = {}  # a key less its runtime arguments' classes
    for key in every:
        compiles.setdefault((key[0], repr(key[2:])), []).append(key)
    split = sorted(_names([keys[0] for keys in compiles.values() if len(keys) > 1]))
    assert not split, f"compiled apart by a runtime int's value: {split}"
    # the input guard's block is at least MIN_BLOCK_N rows: widths up to it share every compile
    assert len({by_width[w] for w in WIDTHS if w <= MIN_BLOCK_N}) == 1
    assert by_width[17] == by_width[32]
    assert _names(by_width[16] ^ by_width[17]) >= {"input_guard_kernel"}
    assert _names(by_width[17] ^ by_width[33]) == {"input_guard_kernel"}


def _chain_keys(k: int) -> set[tuple]:
    return precompile_kernels(_runner(k, [4]), [4], threads=1).keys


def test_draft_steps_share_their_compiles():
    """A k-step chain compiles what a one-step chain does: the step-dependent ints a kernel
    takes (attention's row_offset, RoPE's pos_offset: 0, 1, 2, ... by step) are in its
    `do_not_specialize`, else Triton compiles step 1 (== 1) and every step past it apart from
    step 0 (a multiple of 16): for k >= 3 three compiles each of the attention split, its merge
    and rope_kv_write. Only the input guard differs, once a chain: it takes the chain's step
    count."""
    one, four = _chain_keys(1), _chain_keys(4)
    guard = {"input_guard_kernel"}
    assert _names(one) > guard
    assert {key for key in four if _names([key]) != guard} == {key for key in one if _names([key]) != guard}
    assert len(four) == len(one)


def _sm90_plan_keys() -> None:
    """Run in tests/sm90_compile.py's process (compiled Triton, no GPU, `pretend_sm90`): the
    small head's (benchmarks/draft_chain.py's "small", bf16) 4-step chain over widths 1..64,
    each width executed with `kernel[grid](...)` recording its specialisation key instead of
    launching (the reference ops run on CPU). Prints one JSON line: the kernels' names by key,
    each key's constexprs and launch options, and whether PDL and sm90's wide tiles were on."""
    import json

    from triton.runtime.jit import KernelInterface

    from benchmarks.draft_chain import CONFIGS
    from tests import sm90_compile

    sm90_compile.pretend_sm90()
    keys: set[tuple] = set()
    setattr(KernelInterface, "__getitem__", lambda kernel, grid: lambda *args, **kwargs:
            keys.add(specialisation_key(kernel, args, kwargs)))
    config = CONFIGS["small"]
    head = MtpHead(config, "bfloat16")
    kv = KvLayout(num_blocks=257, block_size=16, max_blocks_per_seq=64)
    weights = {k: v.to(torch.bfloat16) for k, v in random_mtp_weights(config, seed=0).items()}
    compiled = compile_draft(emit_draft_chain(head, 4, max_width=64, kv=kv), head.bind(weights),
                             list(range(1, 65)), options=CompileOptions(interpret_kernels=True))
    k_shape, v_shape = head.cache_shapes(kv)
    runner = ProgramRunner(compiled, {"k_cache": torch.zeros(k_shape, dtype=torch.bfloat16),
                                      "v_cache": torch.zeros(v_shape, dtype=torch.bfloat16)})
    fill_neutral(compiled.circuit, runner.static_inputs, 0, 0)
    for w in range(1, 65):
        runner.execute(w)
    print(json.dumps([[key[0].rsplit(".", 1)[-1], repr(key[2:])] for key in keys]))


def test_sm90_plan_compiles_apart_only_by_constexprs():
    """On the path an H100/H200 takes (PDL on, sm90's wide tiles past 16 rows), the small
    head's 64-width plan compiles each kernel once per set of constexprs: no runtime int that
    follows the width or the step (n, offsets, the attention grid's splits) splits a compile.
    17 compiles (58 at ff6eae9, whose constexpr PDL level split every kernel at 32 rows; 37 at
    the runtime `pdl_release`, before the offsets and width ints were unspecialised and the
    input guard's block was at least 16 rows); the eleventh session's cold capture on the H200
    compiled 54 kernels for this plan."""
    proc = sm90_compile.run("from tests.runners import test_capture_precompile as t\n"
                            "t._sm90_plan_keys()\n", None)
    keys = json.loads(proc.stdout.strip().splitlines()[-1])
    compiles: dict[tuple[str, str], int] = {}
    for name, rest in keys:
        compiles[(name, rest)] = compiles.get((name, rest), 0) + 1
    split = sorted({name for (name, _), count in compiles.items() if count > 1})
    assert not split, f"compiled apart by a runtime int's value on sm90: {split}"
    assert any("('USE_PDL', 1)" in rest for _, rest in keys)  # the sm90 path: PDL on
    assert "linear_wide_kernel" in {name for name, _ in keys}  # and its wide tiles
    assert len(keys) <= 17, sorted(name for name, _ in keys)


def test_kernel_launches_leave_out_reference_ops(program):
    """The precompile visits what may compile: kernels, not reference ops or collectives; a
    plan of reference ops only (CPU, no interpreted kernels) gives it nothing to visit."""
    for w in WIDTHS:
        visited = program.kernel_launches(w)
        assert visited and all(x.kernel != REFERENCE and not x.collective for x in visited)
    plain = ProgramRunner(compile_draft(program.compiled.source, program.compiled.params, [1, 4]),
                          program.states, debug=0)
    assert plain._bound[4] and plain.kernel_launches(4) == []
    assert precompile_kernels(plain, [1, 4], threads=1).launches == 0


def test_specialisation_key_follows_triton_rules():
    x = torch.zeros(64, dtype=torch.float16)

    def key(t, n, scale=1.0, block=64, **kw):
        return specialisation_key(_probe, (t, n, scale), {"BLOCK": block, **kw})
    assert key(x, 17) == key(x, 18) == key(x, 31)  # neither 1 nor a multiple of 16
    assert len({key(x, 1), key(x, 16), key(x, 17), key(x, 2**33), key(x, 2**64 - 16)}) == 5  # u64
    assert key(x, 16) == key(x, 48)
    assert key(x, 17, block=32) != key(x, 17)      # a constexpr by value
    assert key(x[1:], 17) != key(x, 17)            # 2 bytes off 16-byte alignment
    assert key(x[8:], 17) == key(x, 17)            # 16 bytes in: aligned again
    assert key(x.float(), 17) != key(x, 17)        # dtype
    assert key(x, 17, scale=2.5) == key(x, 17)     # floats are not specialised
    assert key(x, 17, num_warps=4) != key(x, 17)   # launch options are part of a compile


def test_specialisation_key_follows_do_not_specialize():
    """An int the kernel's `do_not_specialize` names is one compile whatever its value (0 and
    1: the kernels' runtime `pdl_release`; a multiple of 16), given in place or by name; one
    it does not name is Triton's usual split (1 and multiples of 16 apart)."""
    x = torch.zeros(64, dtype=torch.float16)

    def key(flag, n=17, named=False):
        if named:
            return specialisation_key(_unspecialised_probe, (x, n), {"flag": flag, "BLOCK": 64})
        return specialisation_key(_unspecialised_probe, (x, n, flag), {"BLOCK": 64})
    assert key(0) == key(1) == key(16) == key(7)
    assert key(0, named=True) == key(1, named=True)
    assert len({key(0), key(2**33), key(2**63)}) == 3  # the width still counts: i32, i64, u64
    assert key(0, n=1) != key(0, n=17) != key(0, n=16)  # n is specialised as ever


def test_diversion_is_this_threads_only(launched):
    x = torch.arange(16, dtype=torch.float32)
    seen = []

    def other():
        _probe[(1,)](x, 16, 2.0, BLOCK=16)
    with _compile_only(lambda k, a, kw: seen.append(a)):
        _probe[(1,)](x, 16, 2.0, BLOCK=16)  # this thread: visited, not launched
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1 and len(launched) == 1  # the other thread launched for real
    assert torch.equal(x, torch.arange(16, dtype=torch.float32) * 2)
    _probe[(1,)](x, 16, 2.0, BLOCK=16)  # restored after the block
    assert len(launched) == 2


@cuda
def test_capture_after_precompile_compiles_nothing():
    """On the GPU: precompile a plan's widths through one program runner, then capture them
    with precompile off; Triton's post-compile hook must not fire once (every specialisation
    the warm-ups and captures launch was compiled ahead), and every width is captured. A
    vocabulary no other test uses keeps the kernels out of this process's caches before."""
    from draft_circuit.runners.cudagraph import GraphRunner

    cfg = tiny_config(vocab_size=173)
    head = MtpHead(cfg, "float16")
    circuit = emit_draft_chain(head, 2, max_width=max(WIDTHS), kv=KV)
    params = head.bind(random_mtp_weights(cfg, seed=5, dtype=torch.float16, device="cuda"))
    compiled = compile_draft(circuit, params, WIDTHS, device="cuda")
    shape = (KV.num_blocks, KV.block_size, cfg.num_key_value_heads, cfg.head_dim)
    states = {k: torch.zeros(shape, dtype=torch.float16, device="cuda") for k in ("k_cache", "v_cache")}
    program = ProgramRunner(compiled, states, debug=0)
    done = precompile_kernels(program, WIDTHS)
    assert 0 < done.kernels <= len(done.keys)  # two keys may name one compile, never the reverse
    assert_captures_without_compiling(compiled, states, WIDTHS)
    precompiled = GraphRunner(compiled, states, strict=True).stats.precompile
    assert precompiled is not None and precompiled.keys == done.keys



def test_a_launchers_own_torch_ops_do_no_work_on_what_diverted_kernels_left(monkeypatch):
    """The H200 regression: the diverted kernels leave their outputs unwritten, so a launcher's
    own torch ops met garbage: an embedding over ids an argmax kernel would have written was an
    out-of-range gather, a device-side assert that killed the CUDA context. The launchers now
    run under `no_device_work`: nothing computes, nothing is written, the Triton launch beside
    them is still visited."""
    from types import SimpleNamespace

    table, state = torch.randn(10, 4), torch.zeros(6, 4)
    ids = torch.full((3,), 10_000_000)  # what an unwritten arena slot may hold

    def launcher(inputs, outputs, workspace, attrs):
        emb = table.index_select(0, ids)  # IndexError if it ran
        state.index_copy_(0, torch.tensor([0, 1, 2]), emb)
        _probe[(1,)](emb, 3, 2.0, BLOCK=4)

    x = SimpleNamespace(fn=launcher, inputs=[], outputs=[], workspace=None, attrs=None)
    fake = SimpleNamespace(kernel_launches=lambda w: [x], device=torch.device("cpu"))
    done = precompile_kernels(fake, [1, 2], threads=1, fork=False)  # type: ignore[arg-type]
    assert done.launches == 2 and len(done.keys) == 1
    assert torch.equal(state, torch.zeros(6, 4)), "a launcher's torch write ran"


def test_precompile_mode_reads_its_knob_and_names_a_bad_value(monkeypatch):
    from draft_circuit.runners.precompile import precompile_mode

    monkeypatch.delenv("CIRCUIT_PRECOMPILE", raising=False)
    assert precompile_mode() == "fork"
    for v in ("threads", "off", " fork "):
        monkeypatch.setenv("CIRCUIT_PRECOMPILE", v)
        assert precompile_mode() == v.strip()
    monkeypatch.setenv("CIRCUIT_PRECOMPILE", "yes")
    with pytest.raises(ValueError, match="CIRCUIT_PRECOMPILE.*'yes'"):
        precompile_mode()


def assert_captures_without_compiling(compiled, states, widths) -> None:
    """A GraphRunner without its own precompile captures `widths` compiling nothing (Triton's
    post-compile hook never fires): everything it launches was compiled before (CUDA only)."""
    from triton import knobs

    from draft_circuit.runners.cudagraph import GraphRunner

    fired = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: fired.append(k.get("key"))
    try:
        runner = GraphRunner(compiled, states, strict=True, precompile=False)
    finally:
        knobs.runtime.jit_post_compile_hook = old
    assert fired == [] and runner.widths == tuple(widths)
