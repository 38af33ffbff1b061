"""The compiled draft runner behind the `DraftRunner` protocol (runners/protocol.py).

`CircuitDraftRunner` runs a compiled draft on CUDA graphs (GPU) or the program runner (CPU).
Every width 1..max_width is served by exactly one plan, chosen once by cost: its own program,
padding to a larger program (the extra rows inert), or a split into served widths (13 = 8 + 4 +
1). A width nothing serves (beyond max_width, or refused by the policy) gives serves(n) False,
never a silent slow path. Outputs are the runner's buffers: the next run overwrites them.
Single-caller: a second thread entering `run` while one is inside raises `ConcurrentCallError`.
Input values: the backend's input guard makes a bad row inert; `check_faults()` raises its
`RunnerInputError` (on CPU `run` calls it itself: reading the record costs no sync there).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Protocol

import numpy as np
import torch

from draft_circuit.circuit.ir import ROW
from draft_circuit.circuit.planner import CompiledDraft
from draft_circuit.circuit.binding import WidthError, check_inputs, root_states
from draft_circuit.runners.input_guard import check_runner_faults
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.padding import fill_neutral
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.protocol import DraftRunner, WidthPlan
from draft_circuit.runners.single_caller import single_caller

__all__ = ["Backend", "CircuitDraftRunner", "DraftRunner", "WidthPlan", "WidthPolicy", "plan_widths"]


class Backend(Protocol):
    """What executes a width's program over static buffers: `ProgramRunner` or `GraphRunner`."""

    def serves(self, n: int) -> bool: ...

    def input_buffers(self, n: int) -> dict[str, torch.Tensor]: ...

    def output_buffers(self, n: int) -> dict[str, torch.Tensor]: ...

    def execute(self, n: int) -> None: ...


@dataclass(frozen=True)
class WidthPolicy:
    allow_padding: bool = True
    allow_split: bool = True
    replay_overhead_us: float = 6.0  # per program launch (graph replay) on top of its floor


def plan_widths(costs: Mapping[int, float], max_width: int, policy: WidthPolicy) -> dict[int, WidthPlan]:
    """For every n in 1..max_width the cheapest way to run it from the programs in `costs`
    (width -> floor us). Padding goes to the smallest program at least as wide. A split is a sum
    of whole programs (never a padded part: a padded part's inert rows would overwrite the
    rows of row-dim states another part already placed), the cheapest found by dynamic
    programming, parts widest first."""
    widths = sorted(costs)
    unit = {w: costs[w] + policy.replay_overhead_us for w in widths}
    exact: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for n in range(1, max_width + 1):
        sums = [(exact[n - w][0] + unit[w], tuple(sorted((w, *exact[n - w][1]), reverse=True)))
                for w in widths if w <= n and (n - w) in exact]
        if sums:
            exact[n] = min(sums, key=lambda s: (s[0], len(s[1])))
    best: dict[int, WidthPlan] = {}
    for n in range(1, max_width + 1):
        if n in unit:
            best[n] = WidthPlan("own", ((n, n),), unit[n])
            continue
        options: list[WidthPlan] = []
        wider = [w for w in widths if w > n]
        if policy.allow_padding and wider:
            options.append(WidthPlan("pad", ((wider[0], n),), unit[wider[0]]))
        if policy.allow_split and n in exact:
            cost, parts = exact[n]
            options.append(WidthPlan("split", tuple((w, w) for w in parts), cost))
        if options:
            best[n] = min(options, key=lambda p: (p.cost_us, len(p.parts)))
    return best


@single_caller("run")
class CircuitDraftRunner:
    """A compiled draft behind the `DraftRunner` protocol (graphs on CUDA, programs on CPU).
    Outputs are the backend's static buffers: the next run overwrites them."""

    def __init__(self, compiled: CompiledDraft, states: Mapping[str, torch.Tensor], *,
                 scratch_block: int = 0, policy: WidthPolicy = WidthPolicy(),
                 backend: Backend | None = None) -> None:
        self.compiled, self.scratch_block, self.policy = compiled, scratch_block, policy
        if backend is None:
            if torch.device(compiled.device).type == "cuda":
                from draft_circuit.runners.cudagraph import GraphRunner
                backend = GraphRunner(compiled, states, scratch_block=scratch_block)
            else:
                backend = ProgramRunner(compiled, states, scratch_block=scratch_block)
        self.backend = backend
        self.states = dict(states)
        report = compiled.report()
        costs = {w.width: w.floor_us for w in report.widths if backend.serves(w.width)}
        self.plans = plan_widths(costs, compiled.max_width, policy) if costs else {}
        # read once a catch-up (its chunk width): a max over up to several hundred plans
        self._max_width = max(self.plans, default=0)
        self._row_states = [n for n, v in root_states(compiled.circuit).items()
                            if v.shape and v.shape[0] == ROW]
        # the split path's snapshot of each row-dim state (allocated once, not per run)
        self._saved = {n: torch.empty_like(self.states[n]) for n in self._row_states}
        out = backend.output_buffers(compiled.max_width)
        # split results are gathered here: one buffer per output at the max width
        self._gathered = {k: torch.empty_like(v) for k, v in out.items()}
        self._host_sync_free = torch.device(compiled.device).type == "cpu"
        # the CPU fault record's numpy view (run's check of a clear record; None: ask the guard)
        record = self.fault_record()
        self._fault_word: np.ndarray | None = record.numpy() \
            if record is not None and record.device.type == "cpu" else None
        self._last: tuple[int, WidthPlan] | None = None  # the latest run: to place a fault's row
        # staged_inputs' read-only views and the outputs of a staged run, per width (made once)
        self._staged: dict[int, MappingProxyType[str, torch.Tensor]] = {}
        self._staged_out: dict[int, dict[str, torch.Tensor]] = {}
        #: runs given inputs other than staged_inputs' (they copy into, and pad, the buffers a
        #: stager fills): a stager that sees this change must not trust its record of the rows
        self.unstaged_runs = 0

    def uncaptured_fallback(self, policy: WidthPolicy | None = None) -> CircuitDraftRunner | None:
        """A runner over this one's own program, launched from the host, for the widths whose CUDA
        graph capture failed (the graph runner serves the rest); None when nothing failed or the
        backend captures nothing. It shares the arena and the compiled program: no second copy.
        `policy`: its width policy (None: this runner's)."""
        from draft_circuit.runners.cudagraph import GraphRunner  # importable on a CPU build
        backend = self.backend
        if not isinstance(backend, GraphRunner) or not backend.stats.failures:
            return None
        return CircuitDraftRunner(backend.compiled, self.states, scratch_block=self.scratch_block,
                                  policy=self.policy if policy is None else policy,
                                  backend=backend.program)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.plans))

    @property
    def max_width(self) -> int:
        return self._max_width

    def serves(self, n: int) -> bool:
        return n in self.plans

    def plan(self, n: int) -> WidthPlan:
        if n not in self.plans:
            raise WidthError(f"width {n} is not served (served: 1..{self.max_width} by policy "
                             f"{sorted(set(p.kind for p in self.plans.values()))})")
        return self.plans[n]

    def staged_inputs(self, n: int) -> Mapping[str, torch.Tensor] | None:
        """The backend's own input buffers of an n-row run, read-only: rows [:n] of the max-width
        static buffers the plan's program reads (None for a split plan, whose parts each read
        rows 0..). A caller that writes the run's rows into them and keeps every row past n at
        its input's neutral value (`padding.neutral_value`: a padded program reads those rows)
        passes this very mapping to `run(n, ...)`, which then neither checks (the views were
        checked when made), copies nor pads: the proposer's steady-state path (staging.py).
        Anything else given to `run` is checked and copied in as always."""
        views = self._staged.get(n)
        if views is None:
            plan = self.plan(n)
            if plan.kind == "split":
                return None
            (w, rows), = plan.parts
            made = {k: v[:rows] for k, v in self.backend.input_buffers(w).items()}
            if check_inputs(self.compiled.circuit, made) != n:
                raise WidthError(f"staged_inputs({n}): the width-{w} buffers give another width")
            views = self._staged[n] = MappingProxyType(made)
            self._staged_out[n] = {k: v[:rows] for k, v in self.backend.output_buffers(w).items()}
        return views

    def run(self, n: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self.plans.get(n)
        if plan is None:
            plan = self.plan(n)  # raises WidthError naming the width
        if inputs is self._staged.get(n):  # O(1): the caller filled our own buffers in place
            (w, _), = plan.parts
            self._last = (n, plan)
            self.backend.execute(w)
            if self._host_sync_free:
                self._check_faults_host()
            return dict(self._staged_out[n])
        if check_inputs(self.compiled.circuit, inputs) != n:
            raise WidthError(f"run({n}) was given inputs of another width")
        self._last = (n, plan)
        self.unstaged_runs += 1
        if plan.kind == "split":
            out = self._run_split(plan, inputs)
        else:
            (w, rows), = plan.parts
            out = self._run_part(w, rows, 0, inputs)
        if self._host_sync_free:
            self._check_faults_host()
        return out

    def _check_faults_host(self) -> None:
        """`check_faults` after a run on CPU, where the record is host memory: a clear record
        (word 0 zero) is told by one read of its numpy view, made at construction (the
        guard's one tensor, cleared in place, never replaced); anything else asks
        `check_faults` (a fault, or a backend without a record)."""
        word = self._fault_word
        if word is None or word[0]:
            self.check_faults()

    def fault_record(self) -> torch.Tensor | None:
        """The device int32[8] record the backend's input guard keeps its first fault in (word 0
        nonzero: a fault), None without a guard. A host that copies it beside its own outputs
        learns of a fault with no read of its own; `check_faults` then reads, clears and raises
        it (the proposer's staging.read and device-resident batches do so)."""
        guard = getattr(self.backend, "guard", None)
        if guard is None:  # a GraphRunner's guard is its program runner's
            guard = getattr(getattr(self.backend, "program", None), "guard", None)
        faults = getattr(guard, "faults", None)
        return faults if isinstance(faults, torch.Tensor) else None

    def check_faults(self) -> None:
        """Raise the backend's `RunnerInputError` for the first bad row since the last check
        (cleared). Own and padded plans run the caller's rows at their own indices; a split runs
        each part at rows 0.., so the error then says which caller rows a part row may be."""
        try:
            check_runner_faults(self.backend)
        except RunnerInputError as e:
            if self._last is None or self._last[1].kind != "split":
                raise
            n, plan = self._last
            starts, at = [], 0
            for w, rows in plan.parts:
                starts.append(f"{at} (width {w})")
                at += rows
            raise RunnerInputError(f"{e}; the latest run, width {n}, was split into parts "
                                   f"starting at caller rows {', '.join(starts)}: the row is "
                                   f"that part-relative row", row=e.row, input=e.input,
                                   value=e.value) from e

    def _run_part(self, w: int, rows: int, start: int,
                  inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        buffers = self.backend.input_buffers(w)
        for name, dst in buffers.items():
            dst[:rows].copy_(inputs[name][start:start + rows], non_blocking=True)
        if rows < w:
            fill_neutral(self.compiled.circuit, buffers, rows, self.scratch_block)
        self.backend.execute(w)
        return {k: v[:rows] for k, v in self.backend.output_buffers(w).items()}

    def _run_split(self, plan: WidthPlan, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        starts, offset = [], 0
        for w, rows in plan.parts:
            starts.append(offset)
            offset += rows
        # a part runs at rows 0..rows-1 of each row-dim state, so it must see its own rows'
        # values there (an inactive row keeps what it held, as in eager and padding) and not
        # another part's: snapshot rows 0..n-1, hand each part its slice, then put it back at
        # its offset. Highest offset first, so the part at offset 0 runs last, in place.
        for name, snap in self._saved.items():
            snap[:offset].copy_(self.states[name][:offset])
        for (w, rows), start in sorted(zip(plan.parts, starts), key=lambda p: -p[1]):
            for name, snap in self._saved.items():
                self.states[name][:rows].copy_(snap[start:start + rows])
            out = self._run_part(w, rows, start, inputs)
            for k, v in out.items():
                self._gathered[k][start:start + rows].copy_(v)
            if start:
                for name in self._row_states:
                    state = self.states[name]
                    state[start:start + rows].copy_(state[:rows])
        return {k: v[:offset] for k, v in self._gathered.items()}
