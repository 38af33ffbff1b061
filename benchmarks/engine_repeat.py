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
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from examples.engine import model as target_model
from examples.engine.__main__ import main as engine_main
from draft_circuit.runners.proposer import MtpProposer

PROPOSER_CALLS = ("propose_batch", "propose_batch_on_device", "catchup_batch", "last_drafts",
                  "after_verify_batch")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timers:
    """Seconds and calls per phase name, filled by the wrappers `install` puts in place."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: type, name: str, key: Callable[[tuple], str]) -> Callable[[], None]:
        """Time owner.name (synced around it) under key(args); returns the undo."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                k = key(args)
                self.seconds[k] += time.perf_counter() - start
                self.calls[k] += 1
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def install(self) -> list[Callable[[], None]]:
        undo = [self.wrap(target_model.TargetModel, "forward",
                          lambda a: f"target.forward[{a[1].tokens.shape[0]} rows]")]
        undo += [self.wrap(MtpProposer, n, lambda a, n=n: f"proposer.{n}") for n in PROPOSER_CALLS]
        return undo

    def table(self) -> list[dict[str, Any]]:
        rows = [{"phase": k, "calls": self.calls[k], "ms": self.seconds[k] * 1e3,
                 "us_per_call": self.seconds[k] / self.calls[k] * 1e6} for k in self.seconds]
        return sorted(rows, key=lambda r: -r["ms"])


def run(repeats: int, engine_args: list[str]) -> list[dict[str, Any]]:
    """One entry a repeat: the engine's summary fields and its timed phases."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            timers = Timers()
            undo = timers.install()
            summary = Path(tmp) / f"engine{r}.json"
            try:
                rc = engine_main([*engine_args, "--no-compare", "--summary-json", str(summary)])
            finally:
                for u in undo:
                    u()
            got = json.loads(summary.read_text())
            out.append({"repeat": r, "rc": rc, "tokens_per_s": got["tokens_per_s"],
                        "wall_s": got["wall_s"], "mode": got["mode"], "phases": timers.table()})
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("engine_args", nargs="*", help="after --: the engine's own arguments")
    args = p.parse_args(argv)
    got = run(args.repeats, args.engine_args)
    for r in got:
        print(f"repeat {r['repeat']}: {r['mode']}, {r['tokens_per_s']} tokens/s, wall {r['wall_s']} s")
        for ph in r["phases"][:args.top]:
            print(f"   {ph['phase']:40s} {ph['calls']:5d} calls {ph['ms']:9.2f} ms "
                  f"{ph['us_per_call']:9.1f} us a call")
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1))
    return got


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
