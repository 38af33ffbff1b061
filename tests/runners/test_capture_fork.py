"""`ForkCompiler`, the executor GraphRunner's precompile hands Triton's AsyncCompileMode on a
GPU (Triton 3.6 holds the GIL through most of a compile, so threads do not overlap compiles):
each compile runs first in a forked child (where it fills Triton's file cache), then in the
parent, which completes the future; a child that fails or hangs leaves the work to the
parent. Checked here with plain functions standing in for compiles (CPU, no Triton needed)."""
from __future__ import annotations

import inspect
import os
import time

import pytest

from draft_circuit.runners.precompile import ForkCompiler

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def _marker(tmp_path, i):
    return tmp_path / f"job{i}"


def test_each_job_runs_in_a_child_then_here(tmp_path):
    parent = os.getpid()

    def job(i):
        if os.getpid() != parent:  # in a child: leave what a compile leaves, its cache entry
            _marker(tmp_path, i).write_text(str(os.getpid()))
        return i * i
    pool = ForkCompiler(3)
    futures = [pool.submit(job, i) for i in range(7)]
    assert not any(f.done() for f in futures)  # submit only collects
    pool.run()
    assert [f.result() for f in futures] == [i * i for i in range(7)]
    pids = {int(_marker(tmp_path, i).read_text()) for i in range(7)}
    assert parent not in pids and 1 <= len(pids) <= 3  # at most `workers` children
    assert pool.children_failed == 0


def test_then_runs_in_the_child_on_each_result(tmp_path):
    parent = os.getpid()
    pool = ForkCompiler(2, then=lambda r: (tmp_path / f"then{r}").write_text(str(os.getpid())))
    futures = [pool.submit(lambda i=i: i + 10) for i in range(4)]
    pool.run()
    assert [f.result() for f in futures] == [10, 11, 12, 13]
    assert all(int((tmp_path / f"then{r}").read_text()) != parent for r in range(10, 14))


def test_a_failing_child_leaves_the_job_to_the_parent():
    parent = os.getpid()

    def job():
        if os.getpid() != parent:
            raise RuntimeError("only in the child")
        return "done here"

    def broken():
        raise ValueError("a compile error")
    pool = ForkCompiler(2)
    ok, bad = pool.submit(job), pool.submit(broken)
    pool.run()
    assert ok.result() == "done here"
    with pytest.raises(ValueError, match="a compile error"):  # raised where a compile would
        bad.result()
    assert pool.children_failed >= 1


def test_a_hung_child_is_killed_at_the_timeout():
    parent = os.getpid()

    def job():
        if os.getpid() != parent:
            time.sleep(60)  # what a child deadlocked on an inherited lock does
        return 7
    pool = ForkCompiler(1, timeout_s=0.5)
    f = pool.submit(job)
    start = time.monotonic()
    pool.run()
    assert f.result() == 7 and time.monotonic() - start < 10
    assert pool.children_failed == 1


def test_triton_async_compile_mode_drives_it(tmp_path):
    """The contract precompile relies on: Triton's AsyncCompileMode submits each compile to the
    executor, `run` completes the futures, and the mode's exit finalizes every one of them."""
    from triton.runtime._async_compile import AsyncCompileMode

    parent = os.getpid()
    finalized = {}

    def compile_fn(i):
        if os.getpid() != parent:
            (tmp_path / f"c{i}").write_text("compiled in a child")
        return f"kernel{i}"
    # Triton 3.6 (the GPU host's) submits (key, compile, finalize); later ones add a cleanup
    cleanup = (lambda k: None,) if "cleanup_fn" in inspect.signature(AsyncCompileMode.submit).parameters else ()
    pool = ForkCompiler(2)
    with AsyncCompileMode(pool, ignore_errors=True) as mode:
        kernels = [mode.submit(("key", i), lambda i=i: compile_fn(i),
                               lambda k, i=i: finalized.__setitem__(i, k), *cleanup) for i in range(3)]
        again = mode.submit(("key", 0), lambda: compile_fn(99), lambda k: None, *cleanup)
        pool.run()
    assert again is kernels[0]  # one compile per key
    assert finalized == {0: "kernel0", 1: "kernel1", 2: "kernel2"}
    assert [k.result() for k in kernels] == ["kernel0", "kernel1", "kernel2"]
    assert all((tmp_path / f"c{i}").exists() for i in range(3)) and not (tmp_path / "c99").exists()
