"""The precompile's warm-cache path (issue 15 item 5): Triton's AsyncCompileMode submits every
specialisation new to the process to the executor, cached on disk or not, so `ForkCompiler`
asks Triton's file cache itself (`in_file_cache`) and forks children only for the misses; a
warm cache forks none. A probe that is wrong costs only time (a "cached" job that is not
compiles in the parent, in place). On CPU the compiles are stand-ins submitted the way Triton's
JIT submits them; on a GPU (`cuda`) a second precompile over a filled cache forks no child."""
from __future__ import annotations

import hashlib
import inspect
import os
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from draft_circuit.runners import precompile as pc
from draft_circuit.runners.precompile import ForkCompiler, in_file_cache, precompile_kernels
from draft_circuit.runners.testing import cuda

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


@triton.jit
def _scaled(x_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def _keyed(pool, key, fn, label):
    """Submit as AsyncCompileMode does: the executor's future gets the compile's key after."""
    pool.label = label
    future = pool.submit(fn)
    future._key = key
    return future


def _no_fork(monkeypatch):
    """os.fork refused (as a process that cannot fork sees it); the attempts, to assert none."""
    tried = []

    def refuse():
        tried.append(1)
        raise OSError(11, "fork refused by the test")
    monkeypatch.setattr(os, "fork", refuse)
    return tried


def test_every_job_cached_forks_no_child_and_completes_here(monkeypatch):
    forks = _no_fork(monkeypatch)
    asked = []
    pool = ForkCompiler(4, cached=lambda key, name: asked.append((key, name)) or True)
    futures = [_keyed(pool, f"k{i}", lambda i=i: (os.getpid(), i), "kern") for i in range(5)]
    pool.run()
    assert [f.result() for f in futures] == [(os.getpid(), i) for i in range(5)]
    assert asked == [(f"k{i}", "kern") for i in range(5)]
    assert pool.children == 0 and pool.cached_jobs == 5 and pool.jobs == 5 and pool.fork_s == 0.0
    assert forks == []


def test_only_the_misses_go_to_children(tmp_path):
    parent = os.getpid()

    def job(i):
        if os.getpid() != parent:
            (tmp_path / f"job{i}").write_text(str(os.getpid()))
        return i
    pool = ForkCompiler(8, cached=lambda key, name: key in ("k0", "k2", "k4"))
    futures = [_keyed(pool, f"k{i}", lambda i=i: job(i), "kern") for i in range(6)]
    pool.run()
    assert [f.result() for f in futures] == list(range(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job1", "job3", "job5"]
    assert pool.children == 3 and pool.cached_jobs == 3  # min(workers, misses) children


def test_a_wrong_probe_only_moves_the_compile_here(monkeypatch):
    """A job the probe calls cached that is not (a file deleted since, another Triton's keys):
    the parent's completion is then the compile itself, so the result is the same."""
    forks = _no_fork(monkeypatch)
    compiled_here = []
    pool = ForkCompiler(2, cached=lambda key, name: True)
    f = _keyed(pool, "k", lambda: compiled_here.append(os.getpid()) or "kernel", "kern")
    pool.run()
    assert f.result() == "kernel" and compiled_here == [os.getpid()] and forks == []


def test_a_failed_fork_compiles_here_and_never_hangs_the_mode(monkeypatch):
    """os.fork raising (EAGAIN/ENOMEM in a big process): the jobs compile in the parent and
    every future completes; before, the error left the futures pending and AsyncCompileMode's
    exit waited on them for ever (run in a thread here, so a hang fails instead of hanging)."""
    import threading

    from triton.runtime._async_compile import AsyncCompileMode

    forks = _no_fork(monkeypatch)
    got: list = []
    cleanup = (lambda k: None,) if "cleanup_fn" in inspect.signature(AsyncCompileMode.submit).parameters else ()

    def body():
        pool = ForkCompiler(2, cached=lambda key, name: False)
        with AsyncCompileMode(pool, ignore_errors=True) as mode:
            kernels = [mode.submit(f"key{i}", lambda i=i: i * 10, lambda k: None, *cleanup) for i in range(3)]
            pool.run()
        got.extend(k.result() for k in kernels)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "AsyncCompileMode's exit hung on futures a failed fork left pending"
    assert got == [0, 10, 20] and len(forks) == 1  # one refused fork, then no more tries


def test_an_unanswered_probe_forks_as_before(tmp_path):
    """A probe that raises, a job without a key (an executor used outside AsyncCompileMode) or
    without a label: a miss, forked as without any probe."""
    parent = os.getpid()

    def job(i):
        if os.getpid() != parent:
            (tmp_path / f"job{i}").write_text("child")
        return i

    def broken(key, name):
        raise OSError("cache unreadable")
    pool = ForkCompiler(3, cached=broken)
    a = _keyed(pool, "k0", lambda: job(0), "kern")
    b = pool.submit(lambda: job(1))         # no key
    c = _keyed(pool, "k2", lambda: job(2), None)  # no label
    pool.run()
    assert [a.result(), b.result(), c.result()] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job0", "job1", "job2"]
    assert pool.cached_jobs == 0 and pool.children >= 1


def test_async_compile_mode_hands_the_probe_its_key():
    """Triton's own AsyncCompileMode sets the key the probe reads on the executor's future."""
    from triton.runtime._async_compile import AsyncCompileMode

    asked = []
    pool = ForkCompiler(2, cached=lambda key, name: asked.append(key) or True)
    cleanup = (lambda k: None,) if "cleanup_fn" in inspect.signature(AsyncCompileMode.submit).parameters else ()
    with AsyncCompileMode(pool, ignore_errors=True) as mode:
        pool.label = "kern"
        got = [mode.submit(f"key{i}", lambda i=i: i, lambda k: None, *cleanup) for i in range(3)]
        pool.run()
    assert asked == ["key0", "key1", "key2"] and [g.result() for g in got] == [0, 1, 2]


def _fill_cache(key, name, files=(".json", ".cubin")):
    """Leave what Triton's `compile()` leaves for `key` (compiler/compiler.py): the files under
    the cache manager of the key's sha256, and the group `<name>.json` naming them."""
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    group = {f"{name}{ext}": manager.put(b"{}" if ext == ".json" else b"\0", f"{name}{ext}", binary=True)
             for ext in files}
    manager.put_group(f"{name}.json", group)
    return group


def test_in_file_cache_finds_what_compile_leaves(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_ALWAYS_COMPILE", raising=False)
    assert not in_file_cache("some-key", "kern")
    group = _fill_cache("some-key", "kern")
    assert in_file_cache("some-key", "kern")
    assert not in_file_cache("other-key", "kern") and not in_file_cache("some-key", "other")
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")  # compile() would not look: neither do we
    assert not in_file_cache("some-key", "kern")
    monkeypatch.delenv("TRITON_ALWAYS_COMPILE")
    os.unlink(group["kern.json"])  # a group whose metadata is gone: compile() misses it too
    assert not in_file_cache("some-key", "kern")
    long = "k" * 200  # compile() cuts a kernel name to 150 characters for its files
    _fill_cache("long-key", long[:150])
    assert in_file_cache("long-key", long)


def test_an_interrupt_fails_the_futures_instead_of_compiling_on(monkeypatch):
    """A KeyboardInterrupt while forking: no job is compiled here after it, each future carries
    it (so AsyncCompileMode's exit returns at once) and it propagates."""
    ran = []

    def interrupted(fns):
        raise KeyboardInterrupt
    pool = ForkCompiler(2, cached=lambda key, name: False)
    monkeypatch.setattr(pool, "_fork", interrupted)
    futures = [_keyed(pool, f"k{i}", lambda i=i: ran.append(i), "kern") for i in range(2)]
    with pytest.raises(KeyboardInterrupt):
        pool.run()
    assert ran == [] and all(isinstance(f.exception(timeout=0), KeyboardInterrupt) for f in futures)


@pytest.fixture
def async_kernels(monkeypatch, tmp_path):
    """The interpreter's warm-up `run` submits to the active AsyncCompileMode the way 3.6's
    `JITFunction._do_compile` does (a key string per specialisation; the job a stand-in compile
    that writes `tmp_path/pid-<pid>-<key>`); compiled stand-ins record their loads."""
    from triton.runtime import _async_compile, interpreter

    loads = []

    class Compiled:
        def __init__(self, key):
            self.key = key

        def _init_handles(self):
            loads.append(self.key)

    def compile_fn(key):
        (tmp_path / f"pid-{os.getpid()}-{key}").write_text("")
        return Compiled(key)
    cleanup = (lambda k: None,) if "cleanup_fn" in inspect.signature(
        _async_compile.AsyncCompileMode.submit).parameters else ()

    def run(self, *args, grid, warmup, **kwargs):
        mode = _async_compile.active_mode.get()
        assert warmup and mode is not None
        key = f"{self.fn.__name__}-n{args[1] == 1}{args[1] % 16 == 0}-B{kwargs['BLOCK']}"
        return mode.submit(key, lambda: compile_fn(key), lambda k: None, *cleanup)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    monkeypatch.setattr(pc, "_build_launcher", lambda kernel: None)  # no Triton driver on CPU
    return SimpleNamespace(loads=loads, where=lambda: sorted(p.name for p in tmp_path.iterdir()))


def _program(widths):
    x = torch.zeros(32)

    def launcher(inputs, outputs, workspace, attrs):
        _scaled[(1,)](x, launcher.w, 2.0, BLOCK=32)

    def launches(w):
        launcher.w = w
        return [SimpleNamespace(fn=launcher, inputs=[], outputs=[], workspace=None, attrs=None)]
    return SimpleNamespace(kernel_launches=launches, device=torch.device("cpu"))


WIDTHS = [1, 2, 3, 16, 32]  # three specialisations: n == 1, neither, n % 16 == 0


def test_a_warm_precompile_forks_no_child(async_kernels, monkeypatch):
    asked = []
    forks = _no_fork(monkeypatch)
    done = precompile_kernels(_program(WIDTHS), WIDTHS, threads=4, fork=True,  # type: ignore[arg-type]
                              cached=lambda key, name: asked.append(name) or True)
    assert done.forked and done.jobs == 3 and done.cached == 3 and done.children == 0
    assert asked == ["_scaled"] * 3  # the name Triton's ASTSource gives the compile
    here = f"pid-{os.getpid()}-"
    assert all(name.startswith(here) for name in async_kernels.where())  # compiled here only
    assert done.kernels == 3 and sorted(async_kernels.loads) == sorted(
        name.removeprefix(here) for name in async_kernels.where())
    assert done.fork_s == 0.0 and done.launches == len(WIDTHS) and forks == []


def test_a_cold_precompile_still_compiles_in_children(async_kernels):
    done = precompile_kernels(_program(WIDTHS), WIDTHS, threads=4, fork=True,  # type: ignore[arg-type]
                              cached=lambda key, name: False)
    assert done.forked and done.jobs == 3 and done.cached == 0 and 1 <= done.children <= 3
    pids = {name.split("-")[1] for name in async_kernels.where()}
    assert str(os.getpid()) in pids and len(pids) >= 2  # compiled in children, completed here
    assert done.kernels == 3 and len(async_kernels.loads) == 3 and done.fork_s > 0.0


def test_the_phase_timings_add_up(async_kernels):
    done = precompile_kernels(_program(WIDTHS), WIDTHS, threads=2, fork=True,  # type: ignore[arg-type]
                              cached=lambda key, name: False)
    phases = done.phases()
    assert set(phases) == {"key_s", "visit_s", "probe_s", "fork_s", "complete_s", "load_s"}
    assert all(v >= 0.0 for v in phases.values()) and phases["visit_s"] > 0.0
    assert sum(phases.values()) <= done.seconds + 1e-6


@cuda
def test_a_warm_file_cache_forks_no_compile_child(tmp_path, monkeypatch):
    """On the GPU (Triton 3.6): precompile a plan into an empty file cache (every compile in a
    forked child), forget the compiled kernels in memory (what a server restart does), precompile
    again: every job is found in the file cache, no child is forked, the same kernels load, and
    a capture after it compiles nothing."""
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from draft_circuit.circuit.planner import compile_draft
    from draft_circuit.runners.no_device_work import no_device_work
    from draft_circuit.runners.program import ProgramRunner
    from draft_circuit.runners.testing import random_mtp_weights
    from tests.runners.test_capture_precompile import assert_captures_without_compiling
    from tests.runners.tiny_chain import tiny_config

    monkeypatch.delenv("CIRCUIT_PRECOMPILE", raising=False)
    widths = [1, 2, 3, 16, 17, 32]
    kv = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
    cfg = tiny_config(vocab_size=181)
    head = MtpHead(cfg, "float16")
    compiled = compile_draft(emit_draft_chain(head, 2, max_width=max(widths), kv=kv),
                             head.bind(random_mtp_weights(cfg, seed=3, dtype=torch.float16,
                                                          device="cuda")), widths, device="cuda")
    shape = (kv.num_blocks, kv.block_size, cfg.num_key_value_heads, cfg.head_dim)
    states = {k: torch.zeros(shape, dtype=torch.float16, device="cuda") for k in ("k_cache", "v_cache")}
    program = ProgramRunner(compiled, states, debug=0)
    kernels = set()
    with pc._compile_only(lambda k, a, kw: kernels.add(k)), no_device_work("cuda"):
        for w in widths:
            for x in program.kernel_launches(w):
                x.fn(x.inputs, x.outputs, x.workspace, x.attrs)
    assert kernels and all(hasattr(k, "device_caches") for k in kernels)

    def forget():  # Triton's in-memory caches of these kernels, as in a fresh process
        for k in kernels:
            k.device_caches.clear()
    forget()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty: whatever ran before compiled elsewhere
    cold = precompile_kernels(program, widths)
    assert cold.forked and cold.jobs > 0 and cold.cached == 0 and cold.children > 0
    assert cold.children_failed == 0
    forget()
    warm = precompile_kernels(program, widths)
    assert warm.jobs == cold.jobs and warm.cached == warm.jobs and warm.children == 0
    assert warm.kernels == cold.kernels and warm.keys == cold.keys and warm.fork_s == 0.0
    assert_captures_without_compiling(compiled, states, widths)
