"""The compiled target's passes (`--target-forward circuit`): where each row count runs.

The target circuit is compiled for power-of-two row counts (buckets) up to max_rows; a pass of
n rows runs on the smallest bucket >= n, its extra rows inert (never split: one sequence's rows
must run in order). Buckets up to `graph_rows` (by default every bucket of the engine's default
max_rows) are CUDA graphs on CUDA, captured once, all in one pool: a decode, verify or prefill
pass is one replay. A bucket past graph_rows runs the same compiled program (the same kernels,
the same bits per row) launched from the host, uncaptured: every launch then pays Triton's
Python launch path, about 60 us a kernel on the H100, so a 12-layer target's ~90-launch pass
took ~6 ms uncaptured against ~0.6 ms replayed (benchmarks/engine_timeline.py, 2026-12-06: the
quick start's prefills were a third of its speculative wall time). Capturing the wide buckets
costs little: the arena is sized for max_rows whatever is captured, so the graph pool grows by
the kernels' few allocations only. A bucket whose capture failed runs uncaptured on the graph
runner's own program (slow, never refused). On CPU both are the program runner.

`TargetPasses` is the `DraftRunner` the target model calls; `captured(n)` says which way n runs.
"""
from __future__ import annotations

from typing import Mapping

import torch

from draft_circuit.circuit.binding import WidthError
from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.protocol import WidthPlan

#: buckets up to this many rows are captured: the engine's default max_rows (EngineConfig), so
#: prefills replay too; a wider max_rows runs its widest buckets uncaptured
GRAPH_ROWS = 1024


def buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, and max_rows itself."""
    return sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})


class TargetPasses:
    """The compiled target over its buckets: graphs (CUDA) for buckets <= graph_rows, the
    uncaptured program for wider ones. Outputs are the runners' static buffers: the next pass
    overwrites them. `graph_rows=0` captures nothing (every pass uncaptured: the reference the
    captured passes are tested against)."""

    def __init__(self, circuit: Circuit, params: Mapping[str, torch.Tensor],
                 states: Mapping[str, torch.Tensor], *, max_rows: int, device: str,
                 graph_rows: int = GRAPH_ROWS, scratch_block: int = 0) -> None:
        if graph_rows < 0:
            raise ValueError(f"graph_rows must be >= 0, got {graph_rows}")
        all_buckets = buckets(max_rows)
        small = [w for w in all_buckets if w <= graph_rows]
        wide = [w for w in all_buckets if w > graph_rows]
        policy = WidthPolicy(allow_split=False)
        self.device, self.states = torch.device(device), dict(states)
        # the graphs' runner: CircuitDraftRunner picks GraphRunner on CUDA, ProgramRunner on CPU
        self.graphs = (CircuitDraftRunner(compile_draft(circuit, params, small, device=device), states,
                                          scratch_block=scratch_block, policy=policy)
                       if small else None)
        wide_compiled = compile_draft(circuit, params, wide, device=device) if wide else None
        self.wide = (CircuitDraftRunner(wide_compiled, states, scratch_block=scratch_block, policy=policy,
                                        backend=ProgramRunner(wide_compiled, states))
                     if wide_compiled is not None else None)
        self._small_max = max(small, default=0)
        # a bucket whose capture failed (GraphRunner serves the rest) runs uncaptured on the graph
        # runner's own program: the same arena and launches, no second copy of either
        self.uncaptured = (self.graphs.uncaptured_fallback()  # the graphs' policy
                           if self.graphs is not None else None)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(n for n in range(1, self.max_width + 1) if self.serves(n))

    @property
    def max_width(self) -> int:
        return max((r.max_width for r in (self.graphs, self.wide, self.uncaptured) if r is not None),
                   default=0)

    def _runner(self, n: int) -> CircuitDraftRunner:
        if self.graphs is not None and n <= self._small_max and self.graphs.serves(n):
            return self.graphs
        if self.wide is not None and self.wide.serves(n):
            return self.wide
        if self.uncaptured is not None and self.uncaptured.serves(n):
            return self.uncaptured
        raise WidthError(f"a target pass of {n} rows is not served (buckets up to {self.max_width})")

    def serves(self, n: int) -> bool:
        try:
            self._runner(n)
        except WidthError:
            return False
        return True

    def captured(self, n: int) -> bool:
        """Whether a pass of n rows replays a CUDA graph (False on CPU, and past graph_rows)."""
        return self.device.type == "cuda" and self.serves(n) and self._runner(n) is self.graphs

    def plan(self, n: int) -> WidthPlan:
        return self._runner(n).plan(n)

    def run(self, n: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._runner(n).run(n, inputs)
