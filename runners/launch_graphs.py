"""Per-step launches outside the chains' graphs, replayed as small CUDA graphs (issues 14, 20).

A decode step drafted ahead (`step_ahead`) issues a few device operations of its own around the
chain's and the catch-up's graph replays: the accepted counts' kernel, their copy to pinned
host memory and the hidden gather; the drafts' pack kernel and its copy to the host. On the
H100's host each Triton launch costs its Python launcher's argument binding (~30-45 us, three
torch ops' worth) and each copy ~15 us, against ~5-10 us for a `cudaGraphLaunch` of the same
work: the sixth session's diag put "advance" at 142 us and "fill" at 124 us a step.

`LaunchGraphs.run(key, operands, launch)` runs `launch()` (a short, fixed sequence of device
operations that allocates nothing) eagerly; the (after + 1)-th time the same key and operands
come it also captures it into a CUDA graph, and from the next time on replays that graph.
A replay is the eager launch exactly when every argument the launch bakes in is the same: the
caller's `key` carries what changes between calls (data pointers of per-call views, widths),
and `operands` are the persistent tensors it launches on, compared by identity (the same
cached view objects a step; kept alive by the entry, so their storage cannot be reused).
Capturing syncs nothing (the capture's side stream waits on the work queued so far) and is
thread-local (another host thread's CUDA calls are not refused meanwhile); `after` keeps a key
seen a few times (a width served for one or two steps at a run's end) from
paying a capture it cannot repay.

Nothing is captured where it cannot be: on CPU (or the interpreter) and while the current
stream is itself being captured (a host capturing the proposer), `launch` simply runs. A
capture that fails leaves the key eager for good (logged once), never a half-made graph.
`LaunchGraphs.enabled = False` (or CIRCUIT_LAUNCH_GRAPHS=0) turns captures and replays off
(graphs already made stay unused while it is off), for measuring them against the eager
launches in one process.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)

#: eager runs of a key (after its first) before the one that also captures it: a capture (~0.5-1 ms of host time, once) repays
#: itself after ~10-20 replays at ~50-100 us saved each; a width served only a few steps
#: (the last sequences of a run) stays eager
CAPTURE_AFTER = 8
#: keys kept; past it every entry is dropped (runners rebuilt: their views are new objects)
MAX_KEYS = 64


class _Entry:
    __slots__ = ("operands", "uses", "graph", "failed")

    def __init__(self, operands: tuple[object, ...]) -> None:
        self.operands = operands
        self.uses = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class LaunchGraphs:
    """See the module docstring. `device`: where the launches run (graphs on CUDA only);
    `capture`: how a launch becomes a replayable graph (tests pass a recorder; None: CUDA)."""

    enabled = os.environ.get("CIRCUIT_LAUNCH_GRAPHS", "1") != "0"

    def __init__(self, device: torch.device, *, after: int = CAPTURE_AFTER,
                 capture: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.active = self.cuda or capture is not None  # where graphs can be made at all
        self.after = max(int(after), 1)
        self._capture = capture or _cuda_graph
        self._entries: dict[Hashable, _Entry] = {}
        self.captured = 0  # graphs made (the tests and the diag read it)
        self.replays = 0

    def run(self, key: Hashable, operands: tuple[object, ...], launch: Callable[[], None]) -> None:
        """`launch()`, or the replay of its graph: captured at the (after + 1)-th run of `key`
        with these `operands`, replayed from the next on (see the module docstring)."""
        # the operands' identities are part of the entry's key: two sets that alternate under
        # one key (two staging regions of a width) each get their graph
        ident = (key, tuple(map(id, operands)))
        entry = self._entries.get(ident)
        on = type(self).enabled
        if entry is not None and entry.graph is not None and on \
                and _same(entry.operands, operands) and not _capturing(self.cuda):
            entry.graph.replay()  # (a recorder's stand-in in the tests)
            self.replays += 1
            return
        launch()
        if not self.active or not on:
            return
        if entry is None or not _same(entry.operands, operands):  # (an id reused: start over)
            if len(self._entries) >= MAX_KEYS:
                self._entries.clear()
            self._entries[ident] = _Entry(operands)
            return
        entry.uses += 1
        if entry.graph is not None or entry.failed or entry.uses < self.after \
                or _capturing(self.cuda):
            return
        try:
            entry.graph = self._capture(launch)  # type: ignore[assignment]
            self.captured += 1
        except Exception as e:  # a launch that cannot be captured stays eager
            entry.failed = True
            log.warning("launch graph %r: capture failed, launching eagerly (%s: %s)", key,
                        type(e).__name__, e)


def _capturing(cuda: bool) -> bool:
    """Whether the current stream is being captured (a host capturing the proposer): then
    nothing is replayed or captured here. False on CPU (a CPU build raises on the query)."""
    if not cuda:
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return True  # unknown: stay eager


def _cuda_graph(launch: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`launch` captured on a side stream after the work queued so far (capture needs a
    stream of its own; torch.cuda.graph's context would also collect garbage and empty the
    allocator's cache, milliseconds for nothing here: the launch allocates nothing)."""
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stub
    side.wait_stream(main)
    with torch.cuda.stream(side):
        # thread-local: a global-mode capture would make another host thread's CUDA calls
        # (an allocation, a sync) fail while it is open
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            launch()
        finally:
            graph.capture_end()
    main.wait_stream(side)
    return graph
