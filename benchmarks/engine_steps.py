"""Diagnostic: the wall time of each `Engine.step` of the quick start's two engines (speculation,
then its target-only baseline, as `python3 -m examples.engine` runs them), to say where a short
run's speedup goes: its median steps, or the steps above them (prefills, admissions).

No profiler (unlike benchmarks/engine_timeline.py): a wrapper times each step and the wrappers
are undone after. A step ends with its verify's (or decode's) read, so its wall is the host's and
the device's time together. Per engine: the run's wall, the number of steps and their median, the
first step (the first prefill), the tokens a step, steps by the width they ran at, and every step
over 1.5x the median with its width and the requests still waiting. `median_speedup` is the
speedup the run would have if every step took its median: (tokens a step / median step) of
speculation over the baseline's; `speedup` is the run's own.

    PYTHONPATH=$PWD python3 -m benchmarks.engine_steps --out $OUT/steps.json \\
        -- --device cuda --quiet
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from examples.engine import engine as engine_module
from examples.engine.__main__ import parser as engine_parser, run as engine_run

SLOW = 1.5  # a step over this many medians is listed


@contextmanager
def step_walls() -> Iterator[list[list[tuple[float, int, int]]]]:
    """While open, every Engine.generate appends a list, and each of its steps appends
    (wall ms, sequences running before it, requests waiting before it) to that list; an
    engine's warm-up (`Engine.warm_up`, at construction on CUDA) is not recorded."""
    runs: list[list[tuple[float, int, int]]] = []
    step, generate = engine_module.Engine.step, engine_module.Engine.generate

    def timed_step(self: Any) -> None:
        if self.warming_up:  # Engine.warm_up's dummy requests are not a run's
            return step(self)
        running = sum(not s.finished for s in self.scheduler.running)
        waiting = len(self.scheduler.waiting)
        t0 = time.perf_counter()
        step(self)
        runs[-1].append(((time.perf_counter() - t0) * 1e3, running, waiting))

    def recorded_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.warming_up:
            return generate(self, *args, **kwargs)
        runs.append([])
        return generate(self, *args, **kwargs)

    engine_module.Engine.step = timed_step  # type: ignore[method-assign]
    engine_module.Engine.generate = recorded_generate  # type: ignore[method-assign]
    try:
        yield runs
    finally:
        engine_module.Engine.step = step  # type: ignore[method-assign]
        engine_module.Engine.generate = generate  # type: ignore[method-assign]


def summarize(steps: list[tuple[float, int, int]], tokens: int, wall_s: float) -> dict[str, Any]:
    """One engine's steps (step_walls' tuples), its generated tokens and its run's wall."""
    walls = [w for w, _, _ in steps]
    median = statistics.median(walls)
    by_width: dict[int, list[float]] = {}
    for w, running, _ in steps:
        by_width.setdefault(running, []).append(w)
    return {"wall_ms": round(wall_s * 1e3, 2), "steps": len(steps), "tokens": tokens,
            "tokens_per_step": round(tokens / len(steps), 3), "median_step_ms": round(median, 4),
            "first_step_ms": round(walls[0], 3), "steps_ms": round(sum(walls), 2),
            "above_median_ms": round(sum(w - median for w in walls if w > median), 2),
            "by_width": {str(k): {"steps": len(v), "ms": round(sum(v), 2)}
                         for k, v in sorted(by_width.items())},
            "slow_steps": [{"step": i, "ms": round(w, 3), "running": r, "waiting": q}
                           for i, (w, r, q) in enumerate(steps) if w > SLOW * median]}


def measure(engine_argv: list[str]) -> dict[str, Any]:
    """The quick start's main job with `engine_argv` (its baseline on), its steps timed."""
    args = engine_parser().parse_args(engine_argv)
    if args.no_speculation or not args.compare:
        raise SystemExit("engine_steps compares speculation with its baseline: drop "
                         "--no-speculation / --no-compare")
    with step_walls() as runs:
        info = engine_run(args)
    if len(runs) != 2:
        raise SystemExit(f"expected two engines' runs (speculation, baseline), got {len(runs)}")
    base = info["baseline"]
    spec = summarize(runs[0], info["generated_tokens"], info["wall_s"])
    ref = summarize(runs[1], base["generated_tokens"], base["wall_s"])
    rate = spec["tokens_per_step"] / spec["median_step_ms"]
    return {"engine_args": engine_argv, "speedup": info.get("speedup"),
            "median_speedup": round(rate / (ref["tokens_per_step"] / ref["median_step_ms"]), 3),
            "outputs_identical": info.get("outputs_identical"),
            "speculation": spec, "baseline": ref}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("engine_args", nargs="*", help="after --: examples.engine's own arguments")
    a = p.parse_args(argv)
    got = measure(a.engine_args)
    for name in ("speculation", "baseline"):
        d = got[name]
        print(f"{name}: {d['steps']} steps, {d['wall_ms']} ms, median step "
              f"{d['median_step_ms']} ms, first {d['first_step_ms']} ms, "
              f"{d['tokens_per_step']} tokens a step, "
              f"{d['above_median_ms']} ms above the median, {len(d['slow_steps'])} steps over "
              f"{SLOW}x it")
    print(f"speedup {got['speedup']}x; at the median steps {got['median_speedup']}x")
    if a.out:
        a.out.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
