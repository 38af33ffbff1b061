"""Diagnostic: where the engine's decode steps lose the GPU (issue 20: speculation's speedup on
CUDA is bounded by host time a step, not by kernels).

Each `Engine.generate` of one `examples.engine` main (speculation, then its target-only
baseline) runs under torch.profiler with the host's phases annotated (`record_function`
around the engine's, the target's and the proposer's step calls, PHASES). The timeline is
reduced to what decides tokens/s: per decode step its wall time, the GPU's busy time (the
union of every kernel, copy and memset interval, graph replays' kernels included) and its
idle time; and every microsecond the GPU is idle inside a step is charged to the innermost
host phase running at that instant ("idle under"), so the table names the host work that
stands between two launches. A phase that waits for the GPU (a read) is not charged: the GPU
is busy then. The profiler slows the host (each op is recorded), so the absolute host times
are inflated; the split between phases is what to read.

    PYTHONPATH=$PWD python3 -m benchmarks.engine_timeline --out $OUT/timeline.json \\
        --trace-dir $OUT/traces -- --device cuda --quiet

On a CPU build there is no GPU timeline; the tool then reports host phases only (a smoke
test runs it that way).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from examples.engine import engine as engine_module
from examples.engine import model as target_model
from examples.engine.__main__ import main as engine_main
from examples.engine.engine import Engine
from examples.engine.runner import TargetRunner
from draft_circuit.runners import proposer_ahead
from draft_circuit.runners.accept_counts import AcceptCounts
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.proposer_device import DeviceDrafts

STEP = "engine.step"
#: (owner, attribute, label): the host phases annotated; a missing attribute is skipped (an
#: engine or proposer from another commit)
PHASES: tuple[tuple[Any, str, str], ...] = (
    (Engine, "step", STEP),
    (Engine, "_decode", "engine._decode"),
    (Engine, "_decode_plain", "engine._decode_plain"),
    (Engine, "_end_step", "engine._end_step"),
    (Engine, "_prefill", "engine._prefill"),
    (Engine, "_finish", "engine._finish"),
    (Engine, "_account", "engine._account"),
    (target_model.TargetModel, "forward", "target.forward"),
    (target_model.TargetModel, "launch", "target.launch"),
    (TargetRunner, "verify_on_device", "target.verify_on_device"),
    (TargetRunner, "launch_verify", "target.launch_verify"),
    (TargetRunner, "read_verify", "target.read_verify"),
    (MtpProposer, "step_ahead", "proposer.step_ahead"),
    (MtpProposer, "step_batch", "proposer.step_batch"),
    (MtpProposer, "last_drafts", "proposer.last_drafts"),
    (MtpProposer, "propose_batch_on_device", "proposer.propose_batch_on_device"),
    (MtpProposer, "propose_batch", "proposer.propose_batch"),
    (MtpProposer, "catchup_batch", "proposer.catchup_batch"),
    (MtpProposer, "after_verify_batch", "proposer.after_verify_batch"),
    # engine.py binds these by name: annotate its bindings
    (engine_module, "end_step", "draft_side.end_step"),
    (engine_module, "draft_on_device", "speculate.draft_on_device"),
    (engine_module, "accept", "speculate.accept"),
    # inside step_ahead: its catch-up, the chain runs, the advance and the fill
    (proposer_ahead, "write_rows", "ahead.catchup"),
    (MtpProposer, "_execute", "proposer._execute"),
    (AcceptCounts, "_apply", "counts.advance"),
    (DeviceDrafts, "fill", "drafts.fill"),
)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def annotate() -> Callable[[], None]:
    """Wrap every PHASES callable in a record_function of its label; returns the undo."""
    undo = []
    for owner, attr, label in PHASES:
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def wrapped(*args: Any, __fn: Callable[..., Any] = fn, __label: str = label,
                    **kwargs: Any) -> Any:
            with torch.profiler.record_function(__label):
                return __fn(*args, **kwargs)
        setattr(owner, attr, wrapped)
        undo.append((owner, attr, fn))

    def restore() -> None:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)
    return restore


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged [start, end) intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(busy: list[tuple[float, float]], starts: list[float], s: float, e: float) -> float:
    """Length of [s, e) covered by the merged intervals `busy` (starts: their start points)."""
    i = max(0, bisect.bisect_right(starts, s) - 1)
    got = 0.0
    while i < len(busy) and busy[i][0] < e:
        got += max(0.0, min(e, busy[i][1]) - max(s, busy[i][0]))
        i += 1
    return got


def idle_gaps(busy: list[tuple[float, float]], starts: list[float], s: float,
              e: float) -> list[tuple[float, float]]:
    """The parts of [s, e) no busy interval covers (starts: the intervals' start points)."""
    gaps, t = [], s
    i = max(0, bisect.bisect_right(starts, s) - 1)
    while i < len(busy) and busy[i][0] < e:
        bs, be = busy[i]
        if be > t:
            if bs > t:
                gaps.append((t, min(bs, e)))
            t = max(t, be)
        i += 1
    if t < e:
        gaps.append((t, e))
    return gaps


def reduce_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step table of one generate's chrome-trace events (module docstring)."""
    labels = {label for _, _, label in PHASES}
    host = [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), ev["name"])
            for ev in events if ev.get("ph") == "X" and ev.get("name") in labels
            and ev.get("cat") == "user_annotation"]
    gpu = union((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)))
                for ev in events if ev.get("ph") == "X" and ev.get("cat") in GPU_CATS)
    starts = [b[0] for b in gpu]
    steps = sorted((s, e) for s, e, name in host if name == STEP)
    step_starts = [s for s, _ in steps]

    def in_a_step(ev: dict[str, Any]) -> bool:
        t = float(ev["ts"])
        i = bisect.bisect_right(step_starts, t) - 1
        return i >= 0 and t < steps[i][1]
    runtime: dict[str, list[float]] = defaultdict(list)
    kernels = 0
    launched_at: dict[Any, float] = {}  # a runtime call's correlation id -> its start
    for ev in events:
        if ev.get("ph") != "X":
            continue
        if ev.get("cat") == "cuda_runtime":
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launched_at[corr] = float(ev["ts"])
        if not in_a_step(ev):
            continue
        if ev.get("cat") == "cuda_runtime":
            runtime[ev["name"]].append(float(ev.get("dur", 0.0)))
        elif ev.get("cat") == "kernel":
            kernels += 1
    phases = sorted((s, e, name) for s, e, name in host if name != STEP)
    # GPU time charged to the host phase that launched it (a graph replay's kernels carry
    # its cudaGraphLaunch's correlation id): what each part of a step costs the GPU
    gpu_by_phase: dict[str, float] = defaultdict(float)
    # and per phase, each kernel (or copy) name's time and count
    by_kernel: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    launched = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in GPU_CATS:
            continue
        at = launched_at.get((ev.get("args") or {}).get("correlation"))
        if at is not None and in_a_step({"ts": at}):
            launched.append((at, ev))
    launched.sort(key=lambda x: x[0])
    for (at, ev), phase in zip(launched, innermost(phases, [at for at, _ in launched])):
        gpu_by_phase[phase] += float(ev.get("dur", 0.0))
        entry = by_kernel[phase][str(ev.get("name", "?"))[:60]]
        entry[0] += float(ev.get("dur", 0.0))
        entry[1] += 1
    charged: dict[str, float] = defaultdict(float)
    per_phase: dict[str, list[float]] = defaultdict(list)
    rows = []
    for s, e in steps:
        busy = overlap(gpu, starts, s, e)
        inside = [p for p in phases if p[0] < e and p[1] > s]
        for ps, pe, name in inside:
            per_phase[name].append(pe - ps)
        for gs, ge in idle_gaps(gpu, starts, s, e):
            # charge each piece of the gap to the innermost phase covering it (none: "step")
            cuts = sorted({gs, ge, *(x for p in inside for x in p[:2] if gs < x < ge)})
            for a, b in zip(cuts, cuts[1:]):
                mid = (a + b) / 2
                cover = [p for p in inside if p[0] <= mid < p[1]]
                name = min(cover, key=lambda p: p[1] - p[0])[2] if cover else STEP
                charged[name] += b - a
        rows.append({"wall_us": e - s, "gpu_busy_us": busy, "gpu_idle_us": e - s - busy})
    n = max(1, len(rows))
    return {
        "steps": len(rows),
        "step_wall_us": _med([r["wall_us"] for r in rows]),
        "step_gpu_busy_us": _med([r["gpu_busy_us"] for r in rows]),
        "step_gpu_idle_us": _med([r["gpu_idle_us"] for r in rows]),
        "total_wall_us": round(sum(r["wall_us"] for r in rows), 1),
        "total_gpu_idle_us": round(sum(r["gpu_idle_us"] for r in rows), 1),
        "idle_under_us_per_step": {k: round(v / n, 1) for k, v in
                                   sorted(charged.items(), key=lambda kv: -kv[1])},
        "phase_us_median": {k: _med(v) for k, v in sorted(per_phase.items())},
        "phase_calls_per_step": {k: round(len(v) / n, 2) for k, v in sorted(per_phase.items())},
        # the runtime calls and kernels that start inside a step (not the setup around them)
        "runtime_per_step": {k: {"calls": round(len(v) / n, 2), "host_us": round(sum(v) / n, 1)}
                             for k, v in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:8]},
        "kernels_per_step": round(kernels / n, 1),
        "gpu_us_per_step_by_phase": {k: round(v / n, 1) for k, v in
                                     sorted(gpu_by_phase.items(), key=lambda kv: -kv[1])},
        # the 12 costliest names of each phase: [us a step, launches a step]
        "gpu_kernels_by_phase": {
            phase: {name: [round(t / n, 1), round(c / n, 2)] for name, (t, c) in
                    sorted(names.items(), key=lambda kv: -kv[1][0])[:12]}
            for phase, names in by_kernel.items()},
    }


def innermost(phases: list[tuple[float, float, str]], times: list[float]) -> list[str]:
    """For each of the ascending host times, the innermost annotated phase running then (none:
    STEP). Phases are one thread's record_function ranges, so they nest: a sweep keeps the
    stack of open ones (a parent opened at its child's instant goes first: sorted by start,
    then by the later end)."""
    order = sorted(phases, key=lambda p: (p[0], -p[1]))
    stack: list[tuple[float, float, str]] = []
    out, i = [], 0
    for t in times:
        while i < len(order) and order[i][0] <= t:
            while stack and stack[-1][1] <= order[i][0]:  # closed before this one opened
                stack.pop()
            stack.append(order[i])
            i += 1
        while stack and stack[-1][1] <= t:
            stack.pop()
        out.append(stack[-1][2] if stack else STEP)
    return out


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else 0.0


def run(engine_args: list[str], trace_dir: Path | None) -> list[dict[str, Any]]:
    """One entry per `Engine.generate` of one engine main: its mode and reduced timeline."""
    from torch.profiler import ProfilerActivity, profile
    got: list[dict[str, Any]] = []
    generate = Engine.generate
    cuda = torch.cuda.is_available()

    def watched(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if engine.warming_up:  # Engine.warm_up's dummy requests: not one of main's runs
            return generate(engine, *args, **kwargs)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        mode = "target-only" if engine.proposer is None else "speculation"
        start = time.perf_counter()
        with profile(activities=acts) as prof:
            out = generate(engine, *args, **kwargs)
        wall = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
            if trace_dir is not None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                with gzip.open(trace_dir / f"{len(got)}-{mode}.json.gz", "wt") as f:
                    f.write(path.read_text())
        got.append({"mode": mode, "generate_wall_s": round(wall, 4),
                    "tokens": engine.stats.generated, **reduce_trace(events)})
        return out
    restore = annotate()
    Engine.generate = watched  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine_main([*engine_args, "--summary-json", str(Path(tmp) / "summary.json")])
    finally:
        Engine.generate = generate  # type: ignore[method-assign]
        restore()
    return got


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="write each generate's chrome trace here (gzipped)")
    p.add_argument("engine_args", nargs="*", help="after --: the engine's own arguments")
    args = p.parse_args(argv)
    got = run(args.engine_args, args.trace_dir)
    for g in got:
        print(f"{g['mode']}: {g['tokens']} tokens, {g['steps']} steps; a step: wall "
              f"{g['step_wall_us']} us, GPU busy {g['step_gpu_busy_us']}, idle "
              f"{g['step_gpu_idle_us']}; {g['kernels_per_step']} kernels a step")
        print("   GPU idle under (us a step): " + ", ".join(
            f"{k} {v}" for k, v in g["idle_under_us_per_step"].items()))
        print("   phases (median us): " + ", ".join(
            f"{k} {v} x{g['phase_calls_per_step'][k]}" for k, v in g["phase_us_median"].items()))
        print("   GPU time by launching phase (us a step): " + ", ".join(
            f"{k} {v}" for k, v in g["gpu_us_per_step_by_phase"].items()))
        print("   runtime a step: " + ", ".join(
            f"{k} {v['calls']}x {v['host_us']}us" for k, v in g["runtime_per_step"].items()))
    if args.out:
        args.out.write_text(json.dumps(got, indent=1))
    return got


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
