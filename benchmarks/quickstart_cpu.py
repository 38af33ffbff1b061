"""Benchmark: the quick start's speedup on this CPU (issue 20's CPU target), repeated in one process.

Each repeat is the quick start's main command (`python3 -m examples.engine --forward circuit`,
its defaults: the embedded default, 12 held-out prompts x 64 tokens, batch 4, k = 4): the
speculative run, then target-only greedy on the same prompts with the outputs checked identical.
A 2-core machine shared with other work moves one run's wall-time speedup by tens of percent, so
this repeats the pair and reports every repeat's speedup in tokens/s (wall) and in process CPU
time, and their medians; the first repeat also pays the process's warm-up. Extra arguments go
to the engine (e.g. `-- --max-batch 1`).

    python3 -m benchmarks.quickstart_cpu --repeats 5 --out benchmarks/results/DATE-cpu-quickstart.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from examples.engine.__main__ import check_args, parser, run


def measure(repeats: int, engine_args: list[str]) -> dict:
    rows = []
    for i in range(repeats):
        ap = parser()
        args = ap.parse_args(["--forward", "circuit", "--quiet", *engine_args])
        check_args(ap, args)
        info = run(args)
        if "baseline" not in info:
            raise SystemExit("quickstart_cpu: the engine ran without its baseline (--no-compare?)")
        rows.append({k: info[k] for k in ("tokens_per_s", "wall_s", "cpu_s", "speedup", "cpu_speedup",
                                          "mean_accepted_per_verify", "draft_time_share")}
                    | {"baseline_tokens_per_s": info["baseline"]["tokens_per_s"],
                       "baseline_cpu_s": info["baseline"]["cpu_s"]})
        print(f"repeat {i}: speedup {info['speedup']:.2f}x wall, {info['cpu_speedup']:.2f}x CPU time "
              f"({info['tokens_per_s']:.1f} vs {info['baseline']['tokens_per_s']:.1f} tokens/s)", flush=True)
    return {"engine_args": ["--forward", "circuit", *engine_args], "repeats": rows,
            "median_speedup": statistics.median(r["speedup"] for r in rows),
            "median_cpu_speedup": statistics.median(r["cpu_speedup"] for r in rows),
            "mean_accepted_per_verify": rows[-1]["mean_accepted_per_verify"],
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "processor": platform.processor()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("engine_args", nargs="*", help="passed to the engine (after --)")
    args = ap.parse_args(argv)
    result = measure(args.repeats, args.engine_args)
    print(f"median over {args.repeats}: {result['median_speedup']:.2f}x wall, "
          f"{result['median_cpu_speedup']:.2f}x CPU time")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
