"""Diagnostic: the engine built again and again in one process, each target pass timed (synced).

Found on the H200 (RESULTS.md, 2026-12-03 second session): with `main()` of examples.engine
called several times in one process, the second and later engines' 20-row verify pass (a
32-row graph) sometimes ran 5.4-5.7 ms against 1.06 ms in the first engine, after a first
engine that precompiled into a cold Triton cache; CIRCUIT_PRECOMPILE=off did not show it. This
runs the same thing so the next look starts from numbers: each repeat is one
`examples.engine.__main__.main(ARGS + --no-compare)`, and every `TargetModel.forward` and
proposer call is timed with the device synchronised before and after (so each phase's GPU
time is its own), grouped by the pass's row count. Prints per repeat tokens/s and the top
phases; `--out` writes them as JSON. A timing tool, not a test: the syncs slow the engine.

    PYTHONPATH=$PWD TRITON_CACHE_DIR=$(mktemp -d) python3 -m benchmarks.engine_repeat \\
        --repeats 3 --out $OUT/engine_repeat.json -- --device cuda --quiet
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from examples.engine import model as target_model
from examples.engine.__main__ import main as engine_main
from examples.engine.engine import Engine
from draft_circuit.runners.proposer import MtpProposer

PROPOSER_CALLS = ("propose_batch", "propose_batch_on_device", "catchup_batch", "last_drafts",
                  "after_verify_batch")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, keyed "name:tid" (Linux
    /proc/self/task; elsewhere empty). Native threads (CUDA's, Triton's) are listed too."""
    root, out = Path("/proc/self/task"), {}
    if not root.is_dir():
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for task in root.iterdir():
        try:
            stat, comm = (task / "stat").read_text(), (task / "comm").read_text().strip()
        except OSError:  # the thread ended while listed
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 0
        out[f"{comm}:{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], wall_s: float) -> list[dict[str, Any]]:
    """Threads by CPU seconds spent between two `thread_cpu` readings, busiest first, with the
    Python thread of the same native id named where there is one."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    rows = []
    for key, cpu in after.items():
        comm, tid = key.rsplit(":", 1)
        spent = cpu - before.get(key, 0.0)
        rows.append({"thread": comm, "tid": int(tid), "python": names.get(int(tid)),
                     "cpu_s": round(spent, 4), "share_of_wall": round(spent / wall_s, 3) if wall_s else None})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def target_runners(engine: Any) -> dict[str, Any]:
    """How the engine's target passes run: each runner's backend class, the widths it captured
    and the captures that failed (a pass on an uncaptured backend launches every kernel from
    the host), and the plan of each served width up to 32."""
    passes = getattr(getattr(engine.target, "model", None), "runner", None)
    out: dict[str, Any] = {"runner": type(passes).__name__}
    for name in ("graphs", "wide"):
        r = getattr(passes, name, None)
        if r is None:
            continue
        backend = getattr(r, "backend", None)
        stats = getattr(backend, "stats", None)
        out[name] = {"backend": type(backend).__name__, "widths": list(getattr(r, "widths", ()))[:40],
                     "captured": sorted(getattr(backend, "graphs", {})),
                     "failures": dict(getattr(stats, "failures", {}) or {}),
                     "plans": {n: repr(r.plan(n)) for n in range(1, 33) if r.serves(n)}
                     if name == "graphs" else {}}
    return out


def probe_target(engine: Any, widths: tuple[int, ...] = (16, 32), replays: int = 20) -> dict[str, Any]:
    """CUDA, after an engine's generate: each of `widths`' target graphs replayed `replays`
    times over inert rows (every static input at its neutral value: the same work in every
    engine), its GPU time by CUDA events; then the same width's program launched uncaptured,
    launch by launch between events, its slowest launches. A later engine whose graph is slower
    here than the first engine's, with the same launches, points at the graph; slower launches
    point at the kernels. Empty off CUDA or without captured target passes."""
    import statistics
    from draft_circuit.runners.padding import fill_neutral

    passes = getattr(getattr(engine.target, "model", None), "runner", None)
    graphs = getattr(passes, "graphs", None)
    backend = getattr(graphs, "backend", None)
    if not torch.cuda.is_available() or backend is None or not hasattr(backend, "graphs"):
        return {}
    program = backend.program
    fill_neutral(graphs.compiled.circuit, program.static_inputs, 0, graphs.scratch_block)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn: Callable[[], None]) -> float:
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3  # us

    out: dict[str, Any] = {}
    for w in widths:
        if w not in backend.graphs:
            continue
        graph = backend.graphs[w]
        replay = statistics.median(timed(graph.replay) for _ in range(replays))
        per: dict[str, float] = defaultdict(float)
        for _ in range(3):
            for x in program._bound[w]:
                per[x.node] += timed(lambda x=x: x.fn(x.inputs, x.outputs, x.workspace, x.attrs)) / 3
        top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
        out[str(w)] = {"replay_gpu_us": round(replay, 1), "launches": len(program._bound[w]),
                       "uncaptured_gpu_us": round(sum(per.values()), 1),
                       "slowest": [(k, round(v, 1)) for k, v in top]}
    torch.cuda.synchronize()
    return out


def _probe(engine: Any) -> dict[str, Any]:
    try:
        return probe_target(engine)
    except Exception as e:  # noqa: BLE001 - a diagnostic: say what failed, keep the run's data
        return {"error": {"replay_gpu_us": None, "uncaptured_gpu_us": None, "launches": 0,
                          "slowest": [f"{type(e).__name__}: {e}"]}}


class Timers:
    """Seconds, main-thread CPU seconds and calls per phase name, filled by the wrappers
    `install` puts in place; `threads`: the busy threads of each `Engine.generate`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.threads: list[dict[str, Any]] = []

    def wrap(self, owner: type, name: str, key: Callable[[tuple], str]) -> Callable[[], None]:
        """Time owner.name (synced around it) under key(args); returns the undo."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync()
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                k = key(args)
                self.seconds[k] += time.perf_counter() - start
                self.cpu[k] += time.thread_time() - cpu
                self.calls[k] += 1
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def wrap_replay(self) -> Callable[[], None]:
        """On CUDA, time every graph replay (`GraphRunner.execute`) with CUDA events as well as
        synced wall: "replay[<nodes> nodes, width n]" is its wall, "...gpu" the events' time,
        so a replay whose GPU time is short but wall long, or the reverse, shows which."""
        from draft_circuit.runners.cudagraph import GraphRunner

        original = GraphRunner.execute

        def timed(runner: Any, n: int) -> None:
            k = f"replay[{len(runner.compiled.circuit.nodes)} nodes, width {n}]"
            _sync()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            original(runner, n)
            end.record()
            end.synchronize()
            self.seconds[k] += time.perf_counter() - start
            self.calls[k] += 1
            self.seconds[k + " gpu"] += begin.elapsed_time(end) / 1e3
            self.calls[k + " gpu"] += 1
        GraphRunner.execute = timed  # type: ignore[method-assign]
        return lambda: setattr(GraphRunner, "execute", original)

    def install(self) -> list[Callable[[], None]]:
        undo = [self.wrap(target_model.TargetModel, "forward",
                          lambda a: f"target.forward[{a[1].tokens.shape[0]} rows]"),
                self.wrap(target_model.TargetModel, "stage_inputs",
                          lambda a: f"target.stage_inputs[{a[1].tokens.shape[0]} rows]")]
        if torch.cuda.is_available():
            undo.append(self.wrap_replay())
        undo += [self.wrap(MtpProposer, n, lambda a, n=n: f"proposer.{n}") for n in PROPOSER_CALLS]
        generate = Engine.generate

        def watched(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if engine.warming_up:  # Engine.warm_up's dummy requests: their phases are dropped
                kept = (dict(self.seconds), dict(self.cpu), dict(self.calls))
                try:
                    return generate(engine, *args, **kwargs)
                finally:
                    for timers, was in zip((self.seconds, self.cpu, self.calls), kept):
                        timers.clear()
                        timers.update(was)
            before, start = thread_cpu(), time.perf_counter()
            try:
                return generate(engine, *args, **kwargs)
            finally:
                self.threads.append({"wall_s": round(time.perf_counter() - start, 4),
                                     "threads": busy_threads(before, thread_cpu(),
                                                             time.perf_counter() - start),
                                     "target": target_runners(engine),
                                     "probe": _probe(engine)})
        Engine.generate = watched  # type: ignore[method-assign]
        return undo + [lambda: setattr(Engine, "generate", generate)]

    def table(self) -> list[dict[str, Any]]:
        rows = [{"phase": k, "calls": self.calls[k], "ms": self.seconds[k] * 1e3,
                 "cpu_ms": self.cpu[k] * 1e3,
                 "us_per_call": self.seconds[k] / self.calls[k] * 1e6} for k in self.seconds]
        return sorted(rows, key=lambda r: -r["ms"])


RUNTIME_CALLS = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister",
                 "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch", "cudaLaunchKernel",
                 "cuLaunchKernel", "cudaStreamWaitEvent", "cudaEventQuery", "cudaEventRecord")


class Profiled:
    """`--profile`: no timers, no syncs (the engine as it runs); each `Engine.generate` under
    torch.profiler, and the CUDA runtime calls (count, host µs) and the busiest ops kept, so a
    slow repeat names what its host waits in (an implicit sync in cudaFree, a pinned alloc, a
    memcpy from pageable memory) without the timers' syncs hiding it."""

    def __init__(self) -> None:
        self.threads: list[dict[str, Any]] = []

    def install(self) -> list[Callable[[], None]]:
        from torch.profiler import ProfilerActivity, profile
        generate = Engine.generate

        def watched(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if engine.warming_up:  # Engine.warm_up's dummy requests: not one of the repeats
                return generate(engine, *args, **kwargs)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            start = time.perf_counter()
            with profile(activities=acts) as prof:
                got = generate(engine, *args, **kwargs)
            wall = time.perf_counter() - start
            events = prof.key_averages()
            runtime = {e.key: {"calls": e.count, "host_us": round(e.cpu_time_total, 1)}
                       for e in events if any(e.key.startswith(c) for c in RUNTIME_CALLS)}
            top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
            self.threads.append({"wall_s": round(wall, 4), "runtime": runtime,
                                 "top_self_cpu": [(e.key, e.count, round(e.self_cpu_time_total, 1))
                                                  for e in top]})
            return got
        Engine.generate = watched  # type: ignore[method-assign]
        return [lambda: setattr(Engine, "generate", generate)]

    def table(self) -> list[dict[str, Any]]:
        return []


def run(repeats: int, engine_args: list[str], profiled: bool = False) -> list[dict[str, Any]]:
    """One entry a repeat: the engine's summary fields and its timed phases (or, profiled, its
    CUDA runtime calls)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            timers: Timers | Profiled = Profiled() if profiled else Timers()
            undo = timers.install()
            summary = Path(tmp) / f"engine{r}.json"
            try:
                rc = engine_main([*engine_args, "--no-compare", "--summary-json", str(summary)])
            finally:
                for u in undo:
                    u()
            got = json.loads(summary.read_text())
            out.append({"repeat": r, "rc": rc, "tokens_per_s": got["tokens_per_s"],
                        "wall_s": got["wall_s"], "mode": got["mode"], "phases": timers.table(),
                        "generate": timers.threads,
                        "python_threads": [t.name for t in threading.enumerate()]})
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true",
                   help="no timers or syncs: each generate under torch.profiler (see Profiled)")
    p.add_argument("engine_args", nargs="*", help="after --: the engine's own arguments")
    args = p.parse_args(argv)
    got = run(args.repeats, args.engine_args, args.profile)
    for r in got:
        print(f"repeat {r['repeat']}: {r['mode']}, {r['tokens_per_s']} tokens/s, wall {r['wall_s']} s")
        for ph in r["phases"][:args.top]:
            print(f"   {ph['phase']:40s} {ph['calls']:5d} calls {ph['ms']:9.2f} ms "
                  f"(main thread CPU {ph['cpu_ms']:8.2f}) {ph['us_per_call']:9.1f} us a call")
        for g in r["generate"]:
            if "runtime" in g:
                print(f"   generate {g['wall_s']} s; runtime calls: " + ", ".join(
                    f"{k} {v['calls']}x {v['host_us']:.0f}us" for k, v in sorted(g["runtime"].items())))
                print(f"   top self CPU: {g['top_self_cpu']}")
                continue
            print(f"   target runners: {json.dumps(g['target'])[:600]}")
            for w, pr in g["probe"].items():
                print(f"   probe width {w}: replay {pr['replay_gpu_us']} us GPU, uncaptured "
                      f"{pr['uncaptured_gpu_us']} us over {pr['launches']} launches; slowest "
                      f"{pr['slowest']}")
            busy = [t for t in g["threads"] if t["cpu_s"] > 0.01 * g["wall_s"]]
            print(f"   generate {g['wall_s']} s; busy threads: " + ", ".join(
                f"{t['thread']}({t['python'] or 'native'}) {t['cpu_s']} s" for t in busy))
        print(f"   python threads after: {r['python_threads']}")
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1))
    return got


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
