"""The one runner protocol: every chain runner, compiled or the eager oracle, answers `serves(n)`,
`widths`, `max_width`, `plan(n)` (how width n runs) and `run(n, inputs)`.

The proposer and the host engine see runners only through `DraftRunner`, so the oracle and the
compiled runners are interchangeable behind one call (no branch on a runner's type). A runner's
outputs may be its own buffers, overwritten by its next run: a caller copies what it keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Protocol, runtime_checkable

import torch

#: own: the width's program; pad: a wider program, extra rows inert; split: a sum of programs;
#: eager: the oracle interprets the circuit at width n itself
PlanKind = Literal["own", "pad", "split", "eager"]


@dataclass(frozen=True)
class WidthPlan:
    """How width n runs: parts of (program width, live rows), in row order, and the plan's
    cost (floor plus launch overhead, microseconds; 0 for the eager oracle, which has none)."""

    kind: PlanKind
    parts: tuple[tuple[int, int], ...]
    cost_us: float


@runtime_checkable
class DraftRunner(Protocol):
    """A runner of one draft circuit over n rows (DESIGN.md, "Runners").

    Every width in 1..max_width that `serves` is run by exactly the plan `plan(n)` names; a
    width it does not serve is refused (`serves(n)` False, `plan`/`run` raise `WidthError`),
    never run on a silent slow path.
    """

    @property
    def widths(self) -> tuple[int, ...]:
        """Every served width, ascending."""
        ...

    @property
    def max_width(self) -> int:
        """The widest served width (0 when nothing is served)."""
        ...

    def serves(self, n: int) -> bool:
        """Whether width n runs here."""
        ...

    def plan(self, n: int) -> WidthPlan:
        """How width n runs; `WidthError` when it is not served."""
        ...

    def run(self, n: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run n rows; states are mutated in place; outputs may be overwritten by the next run."""
        ...


#: the name issue 12 uses for the same protocol
ChainRunner = DraftRunner
