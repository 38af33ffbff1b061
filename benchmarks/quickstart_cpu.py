"""Benchmark: the quick start's speedup on this CPU (issue 20's CPU target), repeated in one process.

Each repeat is the quick start's main command (`python3 -m examples.engine --forward circuit`,
its defaults: the embedded default, 12 held-out prompts x 64 tokens, batch 4, k = 3 on CPU): the
speculative run, then target-only greedy on the same prompts with the outputs checked identical.
A 2-core machine shared with other work moves one run's wall-time speedup by tens of percent, so
this repeats the pair and reports every repeat's speedup in tokens/s (wall) and in process CPU
time, their medians and ranges; the first repeat also pays the process's warm-up. Extra
arguments go to the engine (e.g. `-- --max-batch 1`). `--versus "ARGS"` measures a second
engine configuration interleaved with the first (repeat i of each back to back, alternating
which goes first), so an A/B sees the same moments of a shared machine.

    python3 -m benchmarks.quickstart_cpu --repeats 5 --out benchmarks/results/DATE-cpu-quickstart.json
    python3 -m benchmarks.quickstart_cpu --repeats 8 --versus "--num-drafts 4"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

from examples.engine.__main__ import check_args, parser, run


def one_repeat(engine_args: list[str]) -> dict:
    """The quick start's command once (speculative run, then its baseline): the summary's fields."""
    ap = parser()
    args = ap.parse_args(["--forward", "circuit", "--quiet", *engine_args])
    check_args(ap, args)
    info = run(args)
    if "baseline" not in info:
        raise SystemExit("quickstart_cpu: the engine ran without its baseline (--no-compare?)")
    return ({k: info[k] for k in ("num_drafts", "tokens_per_s", "wall_s", "cpu_s", "speedup",
                                  "cpu_speedup", "mean_accepted_per_verify", "draft_time_share")}
            | {"baseline_tokens_per_s": info["baseline"]["tokens_per_s"],
               "baseline_cpu_s": info["baseline"]["cpu_s"]})


def spread(rows: list[dict], key: str) -> dict:
    values = [r[key] for r in rows]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(repeats: int, engine_args: list[str], versus: list[str] | None = None) -> dict:
    """`repeats` repeats of the quick start with `engine_args`; with `versus`, as many of that
    configuration interleaved (back to back, alternating which runs first)."""
    configs = [engine_args] if versus is None else [engine_args, versus]
    rows: list[list[dict]] = [[] for _ in configs]
    for i in range(repeats):
        order = range(len(configs)) if i % 2 == 0 else reversed(range(len(configs)))
        for c in order:
            row = one_repeat(configs[c])
            rows[c].append(row)
            print(f"repeat {i}{'' if versus is None else ' ' + 'AB'[c]}: speedup {row['speedup']:.2f}x "
                  f"wall, {row['cpu_speedup']:.2f}x CPU time ({row['tokens_per_s']:.1f} vs "
                  f"{row['baseline_tokens_per_s']:.1f} tokens/s, k={row['num_drafts']}, "
                  f"{row['mean_accepted_per_verify']:.2f} accepted/verify)", flush=True)

    def result(args: list[str], got: list[dict]) -> dict:
        return {"engine_args": ["--forward", "circuit", *args], "repeats": got,
                "median_speedup": statistics.median(r["speedup"] for r in got),
                "median_cpu_speedup": statistics.median(r["cpu_speedup"] for r in got),
                "speedup": spread(got, "speedup"), "cpu_speedup": spread(got, "cpu_speedup"),
                "mean_accepted_per_verify": got[-1]["mean_accepted_per_verify"]}
    out = result(engine_args, rows[0])
    if versus is not None:
        out["versus"] = result(versus, rows[1])
    return out | {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                              "torch": torch.__version__, "processor": platform.processor()}}


def _line(name: str, r: dict, repeats: int) -> str:
    w, c = r["speedup"], r["cpu_speedup"]
    return (f"{name}median over {repeats}: {w['median']:.2f}x wall ({w['min']:.2f}-{w['max']:.2f}), "
            f"{c['median']:.2f}x CPU time ({c['min']:.2f}-{c['max']:.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--versus", metavar="ARGS",
                    help="engine arguments of a second configuration, measured interleaved")
    ap.add_argument("engine_args", nargs="*", help="passed to the engine (after --)")
    args = ap.parse_args(argv)
    versus = shlex.split(args.versus) if args.versus is not None else None
    result = measure(args.repeats, args.engine_args, versus)
    if versus is None:
        print(_line("", result, args.repeats))
    else:
        print(_line(f"A {args.engine_args}: ", result, args.repeats))
        print(_line(f"B {versus}: ", result["versus"], args.repeats))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
