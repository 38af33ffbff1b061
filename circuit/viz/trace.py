"""`trace_events(report)`: each width's schedule as a Chrome trace (chrome://tracing, Perfetto).
One process per width (pid = width); each launch a complete event lasting its bytes over the
report's bandwidth, back to back in schedule order; live arena bytes as a counter track."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draft_circuit.circuit.report import PlanReport, WidthReport
from draft_circuit.circuit.viz.graph import live_bytes

LAUNCH_TID = 0
COUNTER = "arena live bytes"


def _us(x: float) -> float:
    return round(x, 6)  # picoseconds: enough for sub-nanosecond launches, stable JSON


def width_events(w: WidthReport, bandwidth_gbps: float, alignment: int) -> list[dict[str, Any]]:
    pid = w.width
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": LAUNCH_TID,
         "args": {"name": f"width {w.width}"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": LAUNCH_TID,
         "args": {"sort_index": w.width}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": LAUNCH_TID,
         "args": {"name": "launches"}},
    ]
    live = live_bytes(w, alignment)
    # GB/s = 1e3 bytes per microsecond; the same floor as the report's floor_us
    bytes_per_us = bandwidth_gbps * 1e3
    t = 0.0
    for i, x in enumerate(w.schedule):
        dur = (x.bytes_read + x.bytes_written) / bytes_per_us
        events.append({"ph": "C", "name": COUNTER, "pid": pid, "ts": _us(t),
                       "args": {"bytes": live[i]}})
        events.append({
            "ph": "X", "name": x.node, "cat": x.op, "pid": pid, "tid": LAUNCH_TID,
            "ts": _us(t), "dur": _us(dur),
            "args": {"index": i, "node": x.node, "op": x.op, "kernel": x.kernel, "step": x.step,
                     "fused": list(x.fused), "bytes_read": x.bytes_read,
                     "bytes_written": x.bytes_written, "flops": x.flops}})
        t += dur
    # the arena is empty once the last launch ends: closes the counter's last segment
    events.append({"ph": "C", "name": COUNTER, "pid": pid, "ts": _us(t), "args": {"bytes": 0}})
    return events


def trace_events(report: PlanReport) -> dict[str, Any]:
    bandwidth = float(report.options["bandwidth_gbps"])
    alignment = int(report.options.get("alignment", 1))
    events = [e for w in report.widths for e in width_events(w, bandwidth, alignment)]
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"circuit": report.circuit, "fingerprint": report.fingerprint,
                          "device": report.device, "bandwidth_gbps": bandwidth,
                          "timing": "cost model: (bytes_read + bytes_written) / bandwidth"}}


def write_trace(report: PlanReport, path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace_events(report), indent=None, separators=(",", ":")))
    return path
