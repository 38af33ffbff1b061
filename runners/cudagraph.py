"""`GraphRunner`: one CUDA graph per width of a compiled draft, all in one memory pool.

The lifecycle reads in the constructor: bind the program runner (arena and static buffers are
allocated before any capture, so no address moves), make every static input row inert, compile
every Triton specialisation the widths launch, in parallel (`precompile_kernels` in
runners/precompile.py: no warm-up or capture compiles then; a warm Triton file cache forks no
compile child), then for each width, largest first, warm up (once per `warmup_class`) and
capture, on one stream with no device sync between widths; each width's capture time and the
graph pool's reserved growth go to `stats` and into the plan report
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

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from draft_circuit.circuit.capture_rng import release_rng_capture
from draft_circuit.circuit.planner import CompiledDraft
from draft_circuit.circuit.binding import WidthError, check_inputs
from draft_circuit.runners.padding import fill_neutral
from draft_circuit.runners.program import ProgramRunner, RebindError, debug_level
from draft_circuit.runners.device import cuda_available
from draft_circuit.runners.precompile import Precompiled, precompile_kernels, precompile_mode
from draft_circuit.runners.single_caller import single_caller

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """Capturing a width failed (raised only with strict=True; otherwise counted)."""


def warmup_class(n: int) -> tuple[bool, bool]:
    """Width n's warm-up class: Triton specialises ints equal to 1 or divisible by 16. After the
    precompile a warm-up compiles nothing and settles what else the class launches; without it,
    a width meeting a compile its class did not foresee (a constexpr following n, e.g. the input
    guard's block of max(16, next_power_of_2(n)) rows) fails its capture and is retried with a
    warm-up."""
    return (n == 1, n % 16 == 0)


@dataclass
class CaptureStats:
    capture_ms: dict[int, float] = field(default_factory=dict)
    # the graph pool's reserved growth per width (segments the allocator took, not bytes in them)
    pool_bytes: dict[int, int] = field(default_factory=dict)
    warmed: dict[int, int] = field(default_factory=dict)  # warm-up runs each width took
    failures: dict[int, str] = field(default_factory=dict)
    bind_s: float = 0.0        # the program runner's construction (arena, static buffers, binds)
    precompile: Precompiled | None = None  # None: precompile was off


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
            release_rng_capture(self._stream)
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
