"""`GraphRunner`: one CUDA graph per width of a compiled draft, all in one memory pool.

The lifecycle reads in the constructor: bind the program runner (arena and static buffers are
allocated before any capture, so no address moves), make every static input row inert, compile
every Triton specialisation the widths launch, in parallel (`precompile_kernels`: no warm-up or
capture compiles then), then for each width, largest first, warm up (once per `warmup_class`)
and capture, on one stream with no device sync between widths; each width's capture time and
the graph pool's reserved growth go to `stats` and into the plan report
(`CompiledDraft.record_capture`). A width whose capture fails is not served (the reason is
logged and counted; `strict=True` raises instead) and the others keep working.
Every CUDA call is behind `cuda_available()`, so importing this on a CPU-only torch is safe.
Single-caller: a second thread entering `run`/`execute` while one is inside raises
`ConcurrentCallError` (runners/single_caller.py).
A draft chain's graphs capture the input guard's launch first (runners/input_guard.py): a bad
input row replays inert, and `check_faults()`, called where the host syncs anyway, raises
`RunnerInputError` naming its row, input and value. `run` and `execute` never sync.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from draft_circuit.circuit.planner import CompiledDraft
from draft_circuit.circuit.binding import WidthError, check_inputs
from draft_circuit.runners.padding import fill_neutral
from draft_circuit.runners.program import ProgramRunner, RebindError, debug_level, specialisation_key
from draft_circuit.runners.device import cuda_available
from draft_circuit.runners.no_device_work import no_device_work
from draft_circuit.runners.single_caller import single_caller

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """Capturing a width failed (raised only with strict=True; otherwise counted)."""


def warmup_class(n: int) -> tuple[bool, bool]:
    """Width n's warm-up class: Triton specialises ints equal to 1 or divisible by 16. After the
    precompile a warm-up compiles nothing and settles what else the class launches; without it,
    a width meeting a compile its class did not foresee (a constexpr following n, e.g. the input
    guard's next_power_of_2(n) block) fails its capture and is retried with a warm-up."""
    return (n == 1, n % 16 == 0)


@dataclass
class CaptureStats:
    capture_ms: dict[int, float] = field(default_factory=dict)
    # the graph pool's reserved growth per width (segments the allocator took, not bytes in them)
    pool_bytes: dict[int, int] = field(default_factory=dict)
    warmed: dict[int, int] = field(default_factory=dict)  # warm-up runs each width took
    failures: dict[int, str] = field(default_factory=dict)
    bind_s: float = 0.0        # the program runner's construction (arena, static buffers, binds)
    precompile: "Precompiled | None" = None  # None: precompile was off


# ---- precompile: every Triton specialisation the widths launch, compiled before any capture ----
@dataclass
class Precompiled:
    """What `precompile_kernels` did: the launches' distinct `specialisation_key`s, how many
    launches it visited, the kernels compiled (or found cached) and loaded, the wall time."""

    keys: set[tuple[Any, ...]]
    launches: int
    kernels: int
    seconds: float
    threads: int
    forked: bool = False       # compiled in forked children (ForkCompiler)
    children_failed: int = 0   # of those, children that failed or hung (their work ran here)


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


class ForkCompiler(Executor):
    """Triton's AsyncCompileMode executor that compiles in forked children (Triton 3.6 holds the
    GIL through most of a compile: two threads compiled no faster than one). `submit` only
    collects; `run` forks `workers` children from the calling thread before any thread of ours
    starts (a fork while a thread holds an import lock hangs the child), which share the jobs
    through a pipe, run each (a compile fills Triton's file cache) and `then(result)`; then it
    completes every future here, where a compile is a cache hit. A child that fails or passes
    `timeout_s` leaves its jobs to this process (which raises as a plain compile would)."""

    def __init__(self, workers: int, timeout_s: float = 30.0,
                 then: Callable[[Any], None] | None = None) -> None:
        self.workers, self.timeout_s, self.then = workers, timeout_s, then
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self.children_failed = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self._jobs.append((functools.partial(fn, *args, **kwargs), Future()))
        return self._jobs[-1][1]

    def run(self) -> None:
        jobs, self._jobs = self._jobs, []
        if jobs:
            self._fork([fn for fn, _ in jobs])
        for fn, future in jobs:
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the future carries it to the caller
                future.set_exception(e)

    def _fork(self, fns: list[Callable[[], Any]]) -> None:
        read, write = os.pipe()
        os.write(write, b"".join(i.to_bytes(4, "little") for i in range(len(fns))))
        os.close(write)  # the children read to its end: one 4-byte index per job
        pids = []
        for _ in range(min(self.workers, len(fns))):
            pid = os.fork()
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


def precompile_mode() -> str:
    """CIRCUIT_PRECOMPILE: `fork` (unset; forked children on CUDA), `threads` or `off`."""
    mode = os.environ.get("CIRCUIT_PRECOMPILE", "").strip() or "fork"
    if mode not in ("fork", "threads", "off"):
        raise ValueError(f"CIRCUIT_PRECOMPILE must be fork, threads or off, got {mode!r}")
    return mode


def precompile_kernels(program: ProgramRunner, widths: Sequence[int], *, threads: int | None = None,
                       fork: bool | None = None) -> Precompiled:
    """Compile every Triton specialisation `widths`' launches need, in parallel, launching
    nothing: each launch that may compile (`ProgramRunner.kernel_launches`) runs its launcher
    with `kernel[grid](...)` diverted to a visit; a new `specialisation_key` becomes
    `run(..., warmup=True)` under Triton's AsyncCompileMode (3.4+; without it compiles run in
    place), compiled `threads` at a time in forked children (`ForkCompiler`; `fork` defaults to
    a CUDA device) or pool threads, a failed one left to its launch; then the kernels are
    loaded in pool threads. Interpreted (CPU), it only visits and records the keys."""
    from triton.runtime import _async_compile

    threads = threads or min(16, os.cpu_count() or 1)
    fork = program.device.type == "cuda" and precompile_mode() == "fork" if fork is None else fork
    keys: set[tuple[Any, ...]] = set()
    compiled: dict[int, Any] = {}
    visited = 0

    def visit(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal visited
        visited += 1
        key = specialisation_key(kernel, args, kwargs)
        if key not in keys:
            keys.add(key)
            got = kernel.run(*args, grid=None, warmup=True, **kwargs)
            if got is not None:
                compiled.setdefault(id(got), got)

    start = time.perf_counter()
    forked = ForkCompiler(threads, then=_build_launcher) if fork and hasattr(os, "fork") else None
    # the pool's threads start at its first use: after the forks
    with _PRECOMPILE_LOCK, ThreadPoolExecutor(threads, thread_name_prefix="precompile") as pool:
        mode = getattr(_async_compile, "AsyncCompileMode", None)
        # no_device_work: the diverted kernels leave their outputs unwritten, so a launcher's own
        # torch ops (an embedding over an argmax's ids) must not compute on them either
        with (mode(forked or pool, ignore_errors=True) if mode else contextlib.nullcontext()), \
                _compile_only(visit), no_device_work(program.device.type):
            for w in widths:
                for x in program.kernel_launches(w):
                    x.fn(x.inputs, x.outputs, x.workspace, x.attrs)
            if forked is not None:
                forked.run()  # AsyncCompileMode's exit then finds every future done
        done = (f.result(ignore_errors=True) if hasattr(f, "result") else f for f in compiled.values())
        kernels = {id(k): k for k in done if k is not None and hasattr(k, "_init_handles")}
        device = program.device
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        list(pool.map(functools.partial(_load, device=index), kernels.values()))
    return Precompiled(keys=keys, launches=visited, kernels=len(kernels),
                       seconds=time.perf_counter() - start, threads=threads,
                       forked=forked is not None,
                       children_failed=forked.children_failed if forked is not None else 0)


def _progress_bar(total: int) -> Any:
    """tqdm over the widths to capture: drawn on a terminal (or with CIRCUIT_PROGRESS set)."""
    from tqdm import tqdm

    show = sys.stderr.isatty() or bool(os.environ.get("CIRCUIT_PROGRESS"))
    return tqdm(total=total, desc="capturing widths", unit="width", disable=not show,
                file=sys.stderr, leave=False)


@single_caller("run", "execute")
class GraphRunner:
    def __init__(self, compiled: CompiledDraft, states: Mapping[str, torch.Tensor], *,
                 scratch_block: int = 0, strict: bool = False, warmup: int = 2,
                 fail_widths: frozenset[int] = frozenset(), group: Any = None,
                 guard: bool = True, precompile: bool = True,
                 precompile_threads: int | None = None) -> None:
        """`fail_widths` makes those widths' capture fail on purpose (tests of the fallback).
        `group`: the process group of the circuit's collectives (NCCL; they are captured too).
        `guard=False` captures a chain without its input guard (benchmarks/guard_cost.py).
        `precompile` (default): `precompile_kernels` over `precompile_threads` workers first, so
        no warm-up or capture compiles; False leaves compiles to the warm-ups (the old path)."""
        if not cuda_available():
            raise CaptureError("GraphRunner needs a CUDA device; use ProgramRunner on CPU")
        start = time.perf_counter()
        # per-launch checks sync the host: never inside a capture
        self.program = ProgramRunner(compiled, states, debug=0, group=group,
                                     scratch_block=scratch_block, guard=guard)
        self.compiled, self.strict, self.scratch_block = compiled, strict, scratch_block
        self.stats = CaptureStats(bind_s=time.perf_counter() - start)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # warm-up writes no KV
        fill_neutral(compiled.circuit, self.program.static_inputs, 0, scratch_block)
        widths = sorted(compiled.widths, reverse=True)  # largest first: the pool fits the rest
        if precompile and precompile_mode() != "off":
            try:
                self.stats.precompile = precompile_kernels(self.program, widths,
                                                           threads=precompile_threads)
            except Exception as e:  # noqa: BLE001 - only a speed-up: the warm-ups compile instead
                log.warning("precompiling the kernels failed (%r); the warm-ups compile them", e)
        # one capture stream for every width, and no device sync between widths (what
        # torch.cuda.graph adds per capture: a sync and an empty_cache); warm-up only for the
        # first width of each warmup_class
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stub
        self._stream.wait_stream(torch.cuda.current_stream())
        warmed: set[tuple[bool, bool]] = set()
        self._warmup = warmup
        with _progress_bar(len(widths)) as bar:
            for w in widths:
                bar.set_postfix_str(f"n={w}")
                cls = warmup_class(w)
                self._capture(w, warmup if cls not in warmed else 0, fail=w in fail_widths)
                warmed.add(cls)
                bar.update(1)
        torch.cuda.current_stream().wait_stream(self._stream)
        torch.cuda.synchronize()
        self._debug = debug_level()
        self._ptrs = {n: t.data_ptr() for n, t in self.program.static_inputs.items()}

    def _capture(self, w: int, warmup: int, fail: bool, retry: bool = True) -> None:
        before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self._stream):
                for _ in range(warmup):  # compile kernels, settle allocations
                    self.program.execute(w)
                graph.capture_begin(pool=self.pool)
                try:
                    if fail:
                        torch.cuda.synchronize()  # a sync inside capture: what a bad op would do
                    self.program.execute(w)
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - any failure makes this one width unserved
            # a capture that failed at its end leaves the allocator routing to our pool; end
            # that, or the next width's capture finds the pool "already recording"
            try:
                torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), self.pool)
            except RuntimeError as end_error:
                log.debug("endAllocateToPool after a failed capture: %s", end_error)
            # and capture the remaining widths into a fresh pool: the failed capture's pool
            # may still be marked as recording (seen on torch 2.11)
            self.pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize()
            if retry and warmup == 0 and not fail:
                # a width that skipped its warm-up may have met a kernel configuration
                # warmup_class did not foresee: warm it up and capture it once more
                log.info("capture of width %d without warm-up failed (%s); retrying with it", w, e)
                self._capture(w, max(self._warmup, 1), fail, retry=False)
                return
            self.stats.failures[w] = f"{type(e).__name__}: {e}"
            log.warning("capture of width %d failed; it will not be served: %s", w, e)
            if self.strict:
                raise CaptureError(f"capture of width {w} failed: {e}") from e
            return
        self.graphs[w] = graph
        self.stats.capture_ms[w] = (time.perf_counter() - start) * 1e3
        self.stats.pool_bytes[w] = torch.cuda.memory_reserved() - before
        self.stats.warmed[w] = warmup
        # the plan report (and so the plan page) shows both from now on
        self.compiled.record_capture(w, self.stats.capture_ms[w], self.stats.pool_bytes[w])

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def serves(self, n: int) -> bool:
        return n in self.graphs

    def input_buffers(self, n: int) -> dict[str, torch.Tensor]:
        return self.program.input_buffers(n)

    def output_buffers(self, n: int) -> dict[str, torch.Tensor]:
        return self.program.output_buffers(n)

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        return self.program.static_inputs

    def check_faults(self) -> None:
        """`RunnerInputError` for the first bad input row a replay's guard found since the last
        check, which it clears; one small device-to-host read (a sync): call it where the host
        syncs anyway (after reading the drafts)."""
        self.program.check_faults()

    def execute(self, n: int) -> None:
        """Replay width n over whatever the static inputs hold. Under CIRCUIT_DEBUG>=1 first check
        that nothing the graph reads was rebound: an entry of `input_buffers(n)` replaced or its
        storage swapped, or a max-width static buffer moved (`RebindError`; host-side only)."""
        if self._debug:
            self.program.check_bindings(n)
            for k, t in self.program.static_inputs.items():
                if t.data_ptr() != self._ptrs[k]:
                    raise RebindError(f"static input buffer {k!r} was rebound; copy into it "
                                      f"instead")
        self.graphs[n].replay()

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy in, replay, return the static outputs (overwritten by the next replay)."""
        n = check_inputs(self.compiled.circuit, inputs)
        if n not in self.graphs:
            raise WidthError(f"width {n} is not captured; captured: {list(self.widths)}")
        self.program.copy_in(n, inputs)
        self.execute(n)
        return self.program.output_buffers(n)
