"""Benchmark: the torch ops and host time of one steady-state decode step's draft side (issue 14).

The decode loop is benchmarks/decode_step.py's, built and driven by its own code (`Loop`,
`Loop.begin`, `Loop._step`: propose -> the host's one read of the drafts -> after_verify ->
catchup_batch), without its replay timer. The proposer's public methods the step calls are
wrapped, so everything is attributed to a call (`propose_batch_on_device`, `last_drafts`,
`after_verify`, `catchup_batch`, `last_pair_key`, ...) or to the driver (the loop's own Python
between them). Three passes a width, each on fresh states, `--warmup` steps then `--steps`
measured:

  time     perf_counter around every call, the device synchronised (untimed) before each, so a
           call never waits on the GPU: its host cost alone. `backend.execute` (a graph replay
           on CUDA, the program itself on CPU) is timed apart: on CPU its time is the program's
           and is left out of `host_us`; on CUDA it is the replay's launch, host time, kept in.
  ops      a TorchDispatchMode counts every aten op the calls dispatch (not the programs': it
           is off inside `backend.execute`), split into `device` (a tensor of the runner's
           device among its arguments, not a view: on CUDA a kernel launch or a copy, ~5-10 us
           of host time each), `device_views` (views and metadata of device tensors: no launch,
           a dispatch each) and `host` (host tensors only: pinned mirrors). On CPU every tensor
           is the runner's device's, and a few CUDA-only ops are absent (the staging mirror is
           the region there: no host-to-device copy; no pinned copies back).
  profile  CUDA only: torch.profiler (CPU and CUDA activities) over the steps; the CUDA
           runtime and driver calls (cudaLaunchKernel, cudaMemcpyAsync, cudaGraphLaunch,
           cudaEventRecord, cuLaunchKernel, ...) counted per step and attributed to the call
           whose range holds them.

Per step: graph replays (`backend.execute` calls), each call's count, host us and ops, the
totals. JSON via --out.

    PYTHONPATH=$PWD python3 -m benchmarks.host_ops --device cuda --configs small,8b \\
        --widths 1,64 --out $OUT/host_ops.json                      # < 60 s on an H200
    python3 -m benchmarks.host_ops --device cpu --quick --widths 1,8,32,64 --out /tmp/h.json
"""
from __future__ import annotations

import bisect
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import decode_step as ds  # noqa: E402
from benchmarks import draft_chain as dc  # noqa: E402

#: the proposer methods a decode step calls (decode_step._step) or a host may call instead
CALLS = ("propose_batch", "propose_batch_on_device", "last_drafts", "after_verify",
         "after_verify_batch", "catchup_batch", "last_pair_key", "last_pair_keys", "step_batch")
DRIVER = "driver"  # the loop's own work between the proposer's calls
#: CUDA runtime and driver calls that enqueue device work or wait for it (the profile's rows)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")
_VIEWS = {"view", "_unsafe_view", "as_strided", "slice", "select", "detach", "alias", "t",
          "unsqueeze", "squeeze", "expand", "reshape", "_reshape_alias", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `where` names a bucket (None: not counting), by
    (kind, op): kind `device`, `device_views` or `host` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.where: str | None = None
        self.counts: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)

    def _on_device(self, args: Any, kwargs: dict[str, Any]) -> bool:
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and x.device.type == self.device.type \
                    and not (x.device.type == "cpu" and x.is_pinned()):
                return True
        dev = kwargs.get("device")  # a factory with no tensor argument
        return dev is not None and torch.device(dev).type == self.device.type

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.where is not None:
            name = func.overloadpacket.__name__
            if not self._on_device(args, kwargs):
                kind = "host"
            elif getattr(func, "is_view", False) or name in _VIEWS:
                kind = "device_views"
            else:
                kind = "device"
            self.counts[self.where][(kind, name)] += 1
        return func(*args, **kwargs)


class Instrument:
    """Wraps a loop's proposer calls and its runners' `backend.execute`: per call its count,
    host seconds (after an untimed device sync) and the seconds inside `execute`; the op
    counter's bucket follows the call; under the profiler each call is a record_function range."""

    def __init__(self, loop: ds.Loop) -> None:
        self.loop, self.cuda = loop, loop.s.cuda
        self.counter: OpCounter | None = None
        self.profiling = False
        self.depth = 0
        self.calls: Counter[str] = Counter()
        self.secs: dict[str, float] = defaultdict(float)
        self.exec_secs: dict[str, float] = defaultdict(float)
        self.sync_secs = 0.0
        self.replays = 0
        self._current = DRIVER
        p = loop.p
        for name in CALLS:
            setattr(p, name, self._wrap(name, getattr(p, name)))
        for runner in p.chains.runners():
            backend = getattr(runner, "backend", None)
            if backend is not None and hasattr(backend, "execute"):
                backend.execute = self._wrap_execute(backend.execute)

    def reset(self) -> None:
        self.calls.clear()
        self.secs.clear()
        self.exec_secs.clear()
        self.sync_secs, self.replays = 0.0, 0
        if self.counter is not None:
            self.counter.counts.clear()

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # a call inside a wrapped call is the outer call's work
                return real(*args, **kwargs)
            if self.cuda and not self.profiling:
                t = time.perf_counter()
                torch.cuda.synchronize()
                self.sync_secs += time.perf_counter() - t
            self.depth, self._current = 1, name
            if self.counter is not None:
                self.counter.where = name
            t0 = time.perf_counter()
            try:
                if self.profiling:
                    with torch.profiler.record_function(f"host_ops::{name}"):
                        return real(*args, **kwargs)
                return real(*args, **kwargs)
            finally:
                self.secs[name] += time.perf_counter() - t0
                self.calls[name] += 1
                self.depth, self._current = 0, DRIVER
                if self.counter is not None:
                    self.counter.where = DRIVER
        return call

    def _wrap_execute(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def execute(w: int) -> None:
            where = self.counter.where if self.counter is not None else None
            if self.counter is not None:
                self.counter.where = None  # the program's own ops are not the host's
            t = time.perf_counter()
            try:
                real(w)
            finally:
                self.exec_secs[self._current] += time.perf_counter() - t
                self.replays += 1
                if self.counter is not None:
                    self.counter.where = where
        return execute


def _steps(loop: ds.Loop, inst: Instrument, n: int, mode: str,
           measure: Callable[[list[Any]], None]) -> None:
    """Fresh states, the warm-up steps, then `measure(states)` (it runs the measured steps)."""
    states = loop.begin(n, mode)
    try:
        for _ in range(loop.s.warmup):
            loop._step(states, mode)
        inst.reset()
        measure(states)
    finally:
        for st in states:
            loop.p.free_state(st)


def time_pass(loop: ds.Loop, inst: Instrument, n: int, mode: str) -> dict[str, Any]:
    """Per step: host us of each call and of the driver, and the totals (medians of steps)."""
    s = loop.s
    per_step: list[dict[str, float]] = []

    def measure(states: list[Any]) -> None:
        for _ in range(s.steps):
            inst.reset()
            t0 = time.perf_counter()
            loop._step(states, mode)
            wall = time.perf_counter() - t0
            calls = sum(inst.secs.values())
            # on CPU a program run is the program's time, not host overhead; on CUDA it is the
            # replay's launch (host time) and stays in
            programs = 0.0 if s.cuda else sum(inst.exec_secs.values())
            row = {f"{k}_us": (v - (0.0 if s.cuda else inst.exec_secs[k])) * 1e6
                   for k, v in inst.secs.items()}
            row["proposer_us"] = (calls - programs) * 1e6
            row["driver_us"] = (wall - calls - inst.sync_secs) * 1e6
            row["host_us"] = row["proposer_us"] + row["driver_us"]
            row["replay_us"] = sum(inst.exec_secs.values()) * 1e6
            row["replays"] = inst.replays
            per_step.append(row)
    _steps(loop, inst, n, mode, measure)
    keys = sorted({k for r in per_step for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in per_step) for k in keys}


def ops_pass(loop: ds.Loop, inst: Instrument, n: int, mode: str) -> dict[str, Any]:
    """Per step: the ops each call (and the driver) dispatched, by kind and by op."""
    s = loop.s
    counter = OpCounter(s.device)
    device_ops: list[int] = []
    per_call: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    calls: Counter[str] = Counter()

    def measure(states: list[Any]) -> None:
        inst.counter = counter
        try:
            with counter:
                for _ in range(s.steps):
                    counter.counts.clear()
                    counter.where = DRIVER
                    inst.calls.clear()
                    loop._step(states, mode)
                    counter.where = None
                    device_ops.append(sum(c for b, got in counter.counts.items() if b != DRIVER
                                          for (kind, _), c in got.items() if kind == "device"))
                    for b, got in counter.counts.items():
                        per_call[b].update(got)
                    calls.update(inst.calls)
        finally:
            inst.counter = None
    _steps(loop, inst, n, mode, measure)
    steps = s.steps
    out: dict[str, Any] = {"calls": {}, "device_ops_per_step": device_ops}
    totals: Counter[str] = Counter()
    for b in sorted(set(per_call) | set(calls)):
        got = per_call.get(b, Counter())
        kinds: Counter[str] = Counter()
        for (kind, _), c in got.items():
            kinds[kind] += c
        if b != DRIVER:
            totals.update(kinds)
        out["calls"][b] = {"calls": calls.get(b, 0) / steps if b != DRIVER else None,
                           **{k: kinds[k] / steps for k in ("device", "device_views", "host")},
                           "ops": {f"{kind}:{op}": c / steps for (kind, op), c in
                                   sorted(got.items(), key=lambda x: -x[1])}}
    out["proposer"] = {k: totals[k] / steps for k in ("device", "device_views", "host")}
    return out


def profile_pass(loop: ds.Loop, inst: Instrument, n: int, mode: str) -> dict[str, Any]:
    """CUDA: the runtime and driver calls per step, by call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    s = loop.s
    holder: dict[str, Any] = {}

    def measure(states: list[Any]) -> None:
        torch.cuda.synchronize()
        inst.profiling = True
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(s.steps):
                    loop._step(states, mode)
                torch.cuda.synchronize()
        finally:
            inst.profiling = False
        holder["events"] = prof.events()
    _steps(loop, inst, n, mode, measure)
    by = attribute(holder["events"], lambda name: name.startswith("cu")
                   and not name.startswith("cudaDeviceSynchronize"))
    steps = s.steps
    calls = {b: {k: c / steps for k, c in sorted(got.items(), key=lambda x: -x[1])}
             for b, got in sorted(by.items())}
    total: Counter[str] = Counter()
    for b, got in by.items():
        if b != DRIVER:
            total.update(got)
    return {"calls": calls, "proposer": {k: c / steps for k, c in sorted(total.items())},
            "launches": sum(total[k] for k in LAUNCHES) / steps}


def attribute(events: Any, match: Callable[[str], bool]) -> dict[str, Counter[str]]:
    """Count the host-side profiler events whose name `match`es (CUDA runtime and driver API
    calls), by the `host_ops::<call>` range that holds each (none: the driver's)."""
    from torch.autograd import DeviceType
    ranges: list[tuple[float, float, str]] = []
    hits: list[tuple[float, str]] = []
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue  # kernels, copies and the GPU side of an annotation
        name = e.name
        if name.startswith("host_ops::"):
            ranges.append((e.time_range.start, e.time_range.end, name[len("host_ops::"):]))
        elif match(name):
            hits.append((e.time_range.start, name))
    ranges.sort()
    starts = [r[0] for r in ranges]
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for t, name in hits:
        i = bisect.bisect_right(starts, t) - 1
        by[ranges[i][2] if i >= 0 and t <= ranges[i][1] else DRIVER][name] += 1
    return by


def measure_width(loop: ds.Loop, inst: Instrument, n: int, mode: str,
                  profile: bool) -> dict[str, Any]:
    entry = {"time": time_pass(loop, inst, n, mode), "ops": ops_pass(loop, inst, n, mode)}
    if profile and loop.s.cuda:
        entry["runtime"] = profile_pass(loop, inst, n, mode)
    return entry


def summary(name: str, n: int, mode: str, e: dict[str, Any]) -> str:
    t, o = e["time"], e["ops"]["proposer"]
    line = (f"{name} n={n} {mode}: host {t['host_us']:.1f} us a step (proposer "
            f"{t['proposer_us']:.1f}, driver {t['driver_us']:.1f}), {t['replays']:.0f} replays, "
            f"device ops {o['device']:.1f}, views {o['device_views']:.1f}, host ops {o['host']:.1f}")
    if "runtime" in e:
        line += f", runtime launches {e['runtime']['launches']:.1f}"
    return line


def parse_args(argv: list[str] | None = None) -> Any:
    p = ds.make_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(configs="small,8b", widths="1,8,32,64", steps=10, warmup=3)
    p.add_argument("--modes", default="after",
                   help="decode_step modes to count: after (device-resident drafts, KV-only "
                        "catch-up), step (the same in one step_batch a step) and/or before "
                        "(host-returning propose_batch)")
    p.add_argument("--no-profile", action="store_true", help="CUDA: skip the profiler pass")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configs, s, _ = ds.setup(args)
    widths = sorted({int(x) for x in args.widths.split(",") if x.strip()})
    s = replace(s, widths=widths, steps=args.steps, warmup=args.warmup)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - {"before", "after"}:
        raise SystemExit(f"--modes: before and/or after, got {modes}")
    threads = torch.get_num_threads()
    if not s.cuda:
        torch.set_num_threads(1)  # as decode_step: tiny CPU ops
    data: dict[str, Any] = {"benchmark": "host_ops", "device": dc.device_name(s.device),
                            "torch": torch.__version__, "quick": args.quick,
                            "dtype": str(s.dtype), "num_drafts": s.num_drafts,
                            "steps": s.steps, "warmup": s.warmup, "live_rows": s.live,
                            "widths": widths, "configs": {}}
    t_start = time.perf_counter()
    try:
        for name, config in configs.items():
            ds.log(f"{name}: building the proposer")
            loop = ds.Loop(name, config, s, 1.0, timed=False)
            inst = Instrument(loop)
            cfg: dict[str, Any] = {"build_s": loop.build_s, "widths": {}}
            data["configs"][name] = cfg
            for n in widths:
                cfg["widths"][str(n)] = got = {}
                for mode in modes:
                    got[mode] = measure_width(loop, inst, n, mode, not args.no_profile)
                    ds.log(summary(name, n, mode, got[mode]))
            del loop, inst
            dc.free_memory(s.device)
    finally:
        torch.set_num_threads(threads)
    data["total_s"] = time.perf_counter() - t_start
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        ds.log(f"wrote {args.out} ({data['total_s']:.1f} s)")
    return data


if __name__ == "__main__":
    main()
