"""The precompile: every Triton specialisation a plan's widths launch, compiled before any
capture (issue 15 item 5), so no warm-up or capture of GraphRunner (runners/cudagraph.py)
compiles.

`precompile_kernels` walks every launch that may compile with Triton's launch entry diverted to
a visit; each new `specialisation_key` becomes `run(..., warmup=True)` under Triton's
AsyncCompileMode, whose executor is `ForkCompiler` on a GPU (compiles in forked children, which
fill Triton's file cache; the parent then completes each future itself, a cache hit) or a thread
pool; then the kernels are loaded in pool threads. `Precompiled` says what it did and how long
each phase took.

A warm file cache (a server restart) must cost little, but Triton's AsyncCompileMode submits
every specialisation new to the process to its executor whether or not the file cache holds it:
3.6's `JITFunction._do_compile` (runtime/jit.py) never looks, only `compile()` does, inside the
submitted job. So `ForkCompiler` makes `compile()`'s own lookup first (`in_file_cache`, on the
key AsyncCompileMode hands each job) and forks only for the jobs it misses: a warm cache forks
no child. The probe only saves time: a job it calls cached that is not compiles in the parent,
in place, as a plain compile would; one it cannot answer is forked, as before.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from draft_circuit.runners.no_device_work import no_device_work
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.specialisation import specialisation_key

log = logging.getLogger(__name__)


@dataclass
class Precompiled:
    """What `precompile_kernels` did: the launches' distinct `specialisation_key`s, how many
    launches it visited, the kernels compiled (or found cached) and loaded, the wall time
    `seconds`, and where it went (seconds each, summing to about `seconds`): `key_s` Triton's
    once-a-process cache key of itself (a hash of libtriton), `visit_s` the walk of the launchers
    (each new specialisation submitted), `probe_s` the file-cache lookups, `fork_s` the forked
    children (forking them to reaping the last), `complete_s` the parent completing every
    compile (a cache hit after a child) and Triton finalizing them, `load_s` the loads."""

    keys: set[tuple[Any, ...]]
    launches: int
    kernels: int
    seconds: float
    threads: int
    forked: bool = False       # the fork executor (ForkCompiler) ran the compiles
    children_failed: int = 0   # of its children, those that failed or hung (their work ran here)
    jobs: int = 0              # compiles submitted: specialisations new to this process
    cached: int = 0            # of those, found in Triton's file cache (no child compiled them)
    children: int = 0          # children forked (0: all cached, or not the fork executor)
    key_s: float = 0.0
    visit_s: float = 0.0
    probe_s: float = 0.0
    fork_s: float = 0.0
    complete_s: float = 0.0
    load_s: float = 0.0

    def phases(self) -> dict[str, float]:
        """The phase timings by name (what benchmarks/capture_time.py prints)."""
        return {"key_s": self.key_s, "visit_s": self.visit_s, "probe_s": self.probe_s,
                "fork_s": self.fork_s, "complete_s": self.complete_s, "load_s": self.load_s}


_DIVERT = threading.local()   # set in the thread whose Triton launches only compile
_PRECOMPILE_LOCK = threading.Lock()  # one diversion of Triton's launch entry at a time


@contextlib.contextmanager
def _compile_only(visit: Callable[[Any, tuple[Any, ...], dict[str, Any]], None]) -> Iterator[None]:
    """In this thread, `kernel[grid](...)` calls `visit(kernel, args, kwargs)` instead of
    launching (Triton's `KernelInterface.__getitem__`, the entry of JIT and interpreted kernels
    alike, is diverted while inside; other threads launch as before)."""
    from triton.runtime.jit import KernelInterface

    original = KernelInterface.__getitem__

    def getitem(self: Any, grid: Any) -> Any:
        if not getattr(_DIVERT, "on", False):
            return original(self, grid)
        return lambda *args, **kwargs: visit(self, args, kwargs)

    KernelInterface.__getitem__ = getitem
    _DIVERT.on = True
    try:
        yield
    finally:
        _DIVERT.on = False
        KernelInterface.__getitem__ = original


def in_file_cache(key: str, name: str) -> bool:
    """Whether Triton's cache holds the compile AsyncCompileMode keys by `key` (3.6 and later:
    `get_cache_key(src, backend, options, env_vars)`, the string `compile()` computes again
    and hashes) of the kernel named `name`: `compile()`'s own lookup (compiler/compiler.py: the
    cache manager of the key's sha256 holds a group `<name[:150]>.json`), so True here is a
    cache hit there. False where Triton compiles anyway (`knobs.compilation.always_compile`);
    a Triton without this lookup raises (the caller treats that as a miss)."""
    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    if knobs.compilation.always_compile:
        return False
    file = f"{name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(file)
    return bool(group) and file in group


@dataclass
class _Job:
    fn: Callable[[], Any]
    future: Future[Any]
    label: str | None  # the kernel's name, for the file-cache probe


class ForkCompiler(Executor):
    """Triton's AsyncCompileMode executor that compiles in forked children (Triton 3.6 holds the
    GIL through most of a compile: two threads compiled no faster than one). `submit` only
    collects (tagging the job with `label`, the kernel name the caller set); `run` first asks
    `cached(key, label)` of each job (the key is the one AsyncCompileMode set on its future;
    a probe that raises or a job without key or label counts as a miss), then forks
    min(`workers`, misses) children from the calling thread before any thread of ours starts (a
    fork while a thread holds an import lock hangs the child): none when every job is cached.
    They share the missed jobs through a pipe, run each (a compile fills Triton's file cache)
    and `then(result)`; then it completes every future here, where a compile is a cache hit. A
    child that fails or passes `timeout_s` leaves its jobs to this process (which raises as a
    plain compile would), and so does a fork that fails. `run` completes every future whatever
    happens (AsyncCompileMode's exit waits on them all). `probe_s`, `fork_s`, `complete_s`: where
    `run`'s time went."""

    def __init__(self, workers: int, timeout_s: float = 30.0,
                 then: Callable[[Any], None] | None = None,
                 cached: Callable[[str, str], bool] | None = None) -> None:
        self.workers, self.timeout_s, self.then, self.cached = workers, timeout_s, then, cached
        self.label: str | None = None
        self._jobs: list[_Job] = []
        self.jobs = self.cached_jobs = self.children = self.children_failed = 0
        self.probe_s = self.fork_s = self.complete_s = 0.0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self._jobs.append(_Job(functools.partial(fn, *args, **kwargs), Future(), self.label))
        self.jobs += 1
        return self._jobs[-1].future

    def _is_cached(self, job: _Job) -> bool:
        key = getattr(job.future, "_key", None)
        if self.cached is None or not isinstance(key, str) or not job.label:
            return False
        try:
            return bool(self.cached(key, job.label))
        except Exception as e:  # noqa: BLE001 - unknown: fork it, as without a probe
            log.debug("file-cache probe of %s failed: %r", job.label, e)
            return False

    def run(self) -> None:
        jobs, self._jobs = self._jobs, []
        # every future must complete, whatever happens: AsyncCompileMode's exit waits on them all
        try:
            start = time.perf_counter()
            missed = [job.fn for job in jobs if not self._is_cached(job)]
            self.cached_jobs += len(jobs) - len(missed)
            self.probe_s += time.perf_counter() - start
            if missed:
                start = time.perf_counter()
                self._fork(missed)
                self.fork_s += time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - only a speed-up: the jobs compile here below
            log.warning("compiling in forked children failed (%r); compiling here", e)
        except BaseException as e:  # an interrupt: fail the futures rather than compile on
            for job in jobs:
                job.future.set_exception(e)
            raise
        start = time.perf_counter()
        for job in jobs:
            try:
                job.future.set_result(job.fn())
            except BaseException as e:  # noqa: BLE001 - the future carries it to the caller
                job.future.set_exception(e)
        self.complete_s += time.perf_counter() - start

    def _fork(self, fns: list[Callable[[], Any]]) -> None:
        read, write = os.pipe()
        os.write(write, b"".join(i.to_bytes(4, "little") for i in range(len(fns))))
        os.close(write)  # the children read to its end: one 4-byte index per job
        pids = []
        for _ in range(min(self.workers, len(fns))):
            try:
                pid = os.fork()
            except OSError as e:  # EAGAIN, ENOMEM: a big process may not fork; fewer children
                log.warning("forking a compile child failed (%r); its share compiles here", e)
                break
            if pid == 0:  # a child: run jobs until the pipe is empty, then leave at once
                code = 0
                try:
                    while len(got := os.read(read, 4)) == 4:
                        try:
                            result = fns[int.from_bytes(got, "little")]()
                            if self.then is not None:
                                self.then(result)
                        except BaseException:  # noqa: BLE001 - the parent does it again
                            code = 1
                finally:
                    os._exit(code)
            pids.append(pid)
        os.close(read)
        self.children += len(pids)
        deadline = time.monotonic() + self.timeout_s
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    pids.remove(pid)
                    self.children_failed += status != 0
            time.sleep(0.002)
        for pid in pids:  # hung (or slow): what is left runs here
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        self.children_failed += len(pids)


def _build_launcher(kernel: Any) -> None:
    """A compile child's `then`: build the kernel's launcher (Triton 3.x: a C module, gcc) into
    Triton's file cache, host code only, so the parent's `_load` finds it built."""
    from triton.runtime.driver import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)


def _load(kernel: Any, device: int | None) -> None:
    """Get a kernel's launcher and load its binary onto CUDA device `device`, what its first
    launch would do (so not in a capture). A failure is left to that launch to retry and raise."""
    try:
        if device is not None:
            torch.cuda.set_device(device)  # a pool thread starts on device 0
        kernel._init_handles()
    except Exception as e:  # noqa: BLE001 - retried (and raised) by the kernel's first launch
        log.debug("loading %s ahead of its first launch failed: %s", kernel, e)
        if getattr(kernel, "module", 1) is None and not isinstance(kernel._run, functools.partial):
            kernel._run = None  # a launcher without its module: the lazy path builds both again


def _triton_key() -> None:
    """Triton's key of itself (runtime/cache.py `triton_key`, cached once a process: a sha256
    of libtriton, ~400 MB in 3.6), which the first compile of a process computes; computed
    here so the visit's timing leaves it out. A Triton without it: nothing to do."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    triton_key()


def precompile_mode() -> str:
    """CIRCUIT_PRECOMPILE: `fork` (unset; forked children on CUDA), `threads` or `off`."""
    mode = os.environ.get("CIRCUIT_PRECOMPILE", "").strip() or "fork"
    if mode not in ("fork", "threads", "off"):
        raise ValueError(f"CIRCUIT_PRECOMPILE must be fork, threads or off, got {mode!r}")
    return mode


def precompile_kernels(program: ProgramRunner, widths: Sequence[int], *, threads: int | None = None,
                       fork: bool | None = None,
                       cached: Callable[[str, str], bool] | None = in_file_cache) -> Precompiled:
    """Compile every Triton specialisation `widths`' launches need, in parallel, launching
    nothing: each launch that may compile (`ProgramRunner.kernel_launches`) runs its launcher
    with `kernel[grid](...)` diverted to a visit; a new `specialisation_key` becomes
    `run(..., warmup=True)` under Triton's AsyncCompileMode (3.4+; without it compiles run in
    place), compiled `threads` at a time in forked children (`ForkCompiler`, forking only for
    what `cached` says the file cache misses; `fork` defaults to a CUDA device) or pool
    threads, a failed one left to its launch; then the kernels are loaded in pool threads.
    Interpreted (CPU), it only visits and records the keys."""
    from triton.runtime import _async_compile

    threads = threads or min(16, os.cpu_count() or 1)
    fork = program.device.type == "cuda" and precompile_mode() == "fork" if fork is None else fork
    keys: set[tuple[Any, ...]] = set()
    compiled: dict[int, Any] = {}
    visited = 0
    forked = ForkCompiler(threads, then=_build_launcher, cached=cached) \
        if fork and hasattr(os, "fork") else None

    def visit(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal visited
        visited += 1
        key = specialisation_key(kernel, args, kwargs)
        if key not in keys:
            keys.add(key)
            if forked is not None:  # what Triton's ASTSource names the compile (its cache group)
                fn = getattr(kernel, "fn", kernel)
                forked.label = getattr(fn, "__name__", None)
            got = kernel.run(*args, grid=None, warmup=True, **kwargs)
            if got is not None:
                compiled.setdefault(id(got), got)

    start = time.perf_counter()
    if program.device.type == "cuda":
        _triton_key()
    key_s = time.perf_counter() - start
    # the pool's threads start at its first use: after the forks
    with _PRECOMPILE_LOCK, ThreadPoolExecutor(threads, thread_name_prefix="precompile") as pool:
        mode = getattr(_async_compile, "AsyncCompileMode", None)
        # no_device_work: the diverted kernels leave their outputs unwritten, so a launcher's own
        # torch ops (an embedding over an argmax's ids) must not compute on them either
        with (mode(forked or pool, ignore_errors=True) if mode else contextlib.nullcontext()), \
                _compile_only(visit), no_device_work(program.device.type):
            t = time.perf_counter()
            for w in widths:
                for x in program.kernel_launches(w):
                    x.fn(x.inputs, x.outputs, x.workspace, x.attrs)
            visit_s = time.perf_counter() - t
            t = time.perf_counter()
            if forked is not None:
                forked.run()  # AsyncCompileMode's exit then finds every future done
            run_s = time.perf_counter() - t
        jobs = sum(hasattr(f, "result") for f in compiled.values())
        done = (f.result(ignore_errors=True) if hasattr(f, "result") else f for f in compiled.values())
        kernels = {id(k): k for k in done if k is not None and hasattr(k, "_init_handles")}
        complete_s = time.perf_counter() - t - run_s  # the mode's exit and the results
        device = program.device
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        t = time.perf_counter()
        list(pool.map(functools.partial(_load, device=index), kernels.values()))
        load_s = time.perf_counter() - t
    probe_s = forked.probe_s if forked is not None else 0.0
    fork_s = forked.fork_s if forked is not None else 0.0
    return Precompiled(keys=keys, launches=visited, kernels=len(kernels),
                       seconds=time.perf_counter() - start, threads=threads,
                       forked=forked is not None,
                       children_failed=forked.children_failed if forked is not None else 0,
                       jobs=jobs, cached=forked.cached_jobs if forked is not None else 0,
                       children=forked.children if forked is not None else 0,
                       key_s=key_s, visit_s=visit_s, probe_s=probe_s, fork_s=fork_s,
                       complete_s=complete_s + (forked.complete_s if forked is not None else 0.0),
                       load_s=load_s)
