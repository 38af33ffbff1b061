"""Renderings of a plan report, which they only read: `write_html` (plan.html, self-contained),
`write_dot` (circuit.dot, Graphviz) and `write_trace` (schedule.json, Chrome trace events);
`write_all(report_or_compiled, out_dir)` writes all three and returns their paths."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, Union

from draft_circuit.circuit.report import PlanReport
from draft_circuit.circuit.viz.dot import to_dot, write_dot
from draft_circuit.circuit.viz.html import render_html, write_html
from draft_circuit.circuit.viz.trace import trace_events, write_trace

__all__ = ["write_all", "write_html", "write_dot", "write_trace", "render_html", "to_dot",
           "trace_events"]


class Reports(Protocol):
    """Anything that reports its plan, such as a `CompiledDraft`."""

    def report(self) -> PlanReport: ...


def write_all(report: Union[PlanReport, Reports], out: Path) -> list[Path]:
    plan = report if isinstance(report, PlanReport) else report.report()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [write_html(plan, out / "plan.html"), write_dot(plan, out / "circuit.dot"),
            write_trace(plan, out / "schedule.json")]
