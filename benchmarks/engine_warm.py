"""Diagnostic: what of the quick start's run is one-time work. Each of the quick start's two
engines (speculation, then target-only with the same settings) is built once and runs
`generate` `--runs` times on the same prompts; per run: its wall, tokens/s, first and median
step (`engine_steps.step_walls`), and the speedup of the runs with the same index. Run 1 is what
`python3 -m examples.engine` measures (a fresh engine each); later runs find every lazily made
buffer, graph upload and cache already there. Every run's outputs must equal target-only's.

    PYTHONPATH=$PWD python3 -m benchmarks.engine_warm --runs 3 --out $OUT/warm.json \\
        -- --device cuda --quiet
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_steps import step_walls
from examples.engine.__main__ import engine_config, parser as engine_parser, prompts_for
from examples.engine.checkpoints import load_checkpoint
from examples.engine.compare import release_device_memory
from examples.engine.engine import Engine
from examples.engine.sequence import Request


def _synced(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(engine_argv: list[str], runs: int) -> dict[str, Any]:
    """Both engines' `runs` generates with `engine_argv`'s settings (speculation must be on)."""
    args = engine_parser().parse_args(engine_argv)
    if args.no_speculation or args.draft_vocab is not None or args.tp != 1:
        raise SystemExit("engine_warm runs the quick start's speculation and its baseline: drop "
                         "--no-speculation / --draft-vocab / --tp")
    checkpoint = load_checkpoint(args.checkpoint, draft_path=args.draft_checkpoint, with_mtp=True)
    prompts = prompts_for(args, checkpoint)
    torch.set_num_threads(args.threads)
    config = engine_config(args)
    got: dict[str, list[dict[str, Any]]] = {}
    outputs: dict[str, list[list[list[int]]]] = {}
    baseline = dataclasses.replace(config, speculate=False)
    for name, cfg in (("speculation", config), ("baseline", baseline)):
        engine = Engine(checkpoint, cfg)
        got[name], outputs[name] = [], []
        with step_walls() as walls:
            for _ in range(runs):
                _synced(args.device)
                t0 = time.perf_counter()
                result = engine.generate([Request(p, args.max_new_tokens) for p in prompts])
                _synced(args.device)
                wall = time.perf_counter() - t0
                tokens = sum(len(o) for o in result.outputs)
                steps = [w for w, _, _ in walls[-1]]
                got[name].append({"wall_ms": round(wall * 1e3, 2), "tokens": tokens,
                                  "tokens_per_s": round(tokens / wall, 1), "steps": len(steps),
                                  "first_step_ms": round(steps[0], 3),
                                  "median_step_ms": round(statistics.median(steps), 4)})
                outputs[name].append(result.outputs)
        del engine, result
        release_device_memory()
    reference = outputs["baseline"][0]
    return {"engine_args": engine_argv, "runs": runs, **got,
            "speedup": [round(s["tokens_per_s"] / b["tokens_per_s"], 3)
                        for s, b in zip(got["speculation"], got["baseline"])],
            "outputs_identical": all(o == reference for per in outputs.values() for o in per)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="generates per engine (>= 2)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("engine_args", nargs="*", help="after --: examples.engine's own arguments")
    a = p.parse_args(argv)
    if a.runs < 2:
        p.error("--runs must be >= 2: the first run against the warm ones")
    got = measure(a.engine_args, a.runs)
    for name in ("speculation", "baseline"):
        print(f"{name}: " + "; ".join(
            f"run {i + 1} {r['wall_ms']} ms ({r['tokens_per_s']} tokens/s, first step "
            f"{r['first_step_ms']} ms, median {r['median_step_ms']})"
            for i, r in enumerate(got[name])))
    print("speedup by run: " + ", ".join(f"{x}x" for x in got["speedup"])
          + f"; outputs identical: {got['outputs_identical']}")
    if a.out:
        a.out.write_text(json.dumps(got, indent=1) + "\n")
    return 0 if got["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
