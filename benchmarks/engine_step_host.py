"""Benchmark: the engine's host time per decode step on the device path (issue 14 item 4).

The engine runs with `Engine.device_drafts = True` (CUDA's default path; on CPU the same code)
over n requests in n slots on a small random checkpoint, long enough that steady steps
dominate. Every `TargetModel.forward` and every drafter program run (`backend.execute` of the
proposer's compiled runners) is timed and taken out of the step's time: what is left is the
host's own work a step (the engine's Python, the proposer's checks, slot bookkeeping, staging
outside the programs), the part issue 14 bounds. Times are this thread's CPU time
(`time.thread_time`), not wall: on a CPU shared with other work, being preempted is not the
step's host work. On CPU a program run is compute and is left out; on a GPU the same wrappers
would take the launches out too, so these are the host's Python and numpy work only, a CPU
number, not the H200's. `ops/step`: the torch ops dispatched a steady step outside the
programs (host_ops.OpCounter; deterministic where the times are not; on CUDA a non-view op is
a launch or a copy, several us of host time each).

Modes, interleaved repeat by repeat so a shared CPU's moments fall on both alike:
  before_read  `Engine.draft_before_read = True` (the default, `--draft-before-read`): `step_ahead` right after
            the verify's launch, before its read (accepted counts on the device)
  ahead     `Engine.propose_ahead = True`, read first: trims, catch-up and the next propose
            in one `step_batch` at each step's end (when the next batch is known)
  separate  `Engine.propose_ahead = False`: propose_batch_on_device, last_drafts,
            after_verify_batch, last_pair_keys, catchup_batch
An engine from before issue 14 item 4 ignores `propose_ahead` (one before `step_ahead`,
`draft_before_read`): run this file from a worktree of it (`--modes separate`) for a before column.

`--accept forced` replaces the acceptance rule with a count that varies step to step up to every
draft (tests/examples/test_engine_step_batch.py's `forced_accept`): random heads accept almost
nothing, so without it no step has rows to catch up, unlike a trained drafter's (the output is
then not greedy's; the host's work is a trained drafter's). It is the host's count alone, so
`before_read`, which counts on the device by the real rule, runs only with `--accept greedy`.
Per mode and width: the median over
repeats of each repeat's median host us per steady step (not the first step, its prefill's,
nor the last), the range, ops and proposer calls per step, and the bubble: the median host time
from a verify's read returning to the next launch, a drafter program's or a target pass's (read
first, step_batch's first replay: on a GPU it idles all that window, the one issue 20
shrinks; before the read, the next verify's: the GPU drafts through it and idles only for
what outlasts the drafter's work).

    python3 -m benchmarks.engine_step_host --widths 1,4,8 --repeats 5 --accept forced
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

import examples.engine.engine as engine_module
from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from benchmarks.host_ops import OpCounter
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG

# tests/examples/helpers.SMALL's shapes: the host work per step does not grow with them
CONFIG = dataclasses.replace(DEFAULT_CONFIG, hidden_size=96, intermediate_size=160,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                             num_hidden_layers=2)
CALLS = ("propose_batch_on_device", "last_drafts", "after_verify_batch", "last_pair_keys",
         "catchup_batch", "step_batch", "step_ahead")
MODES = {"before_read": (True, True), "ahead": (True, False), "separate": (False, False)}


def forced_accept(drafts: list[int], target_tokens: list[int]) -> int:
    return (sum(drafts) + 7 * len(target_tokens)) % (len(drafts) + 1)


def one_run(path: Path, width: int, mode: tuple[bool, bool], k: int, new_tokens: int,
            count_ops: bool = False) -> dict[str, Any]:
    """One generate of `width` requests in `width` slots: the median host us per steady step,
    proposer calls per step, and with `count_ops` the torch ops dispatched a steady step
    outside the programs (host_ops.OpCounter: deterministic, where the times are noisy; the
    counter's own cost makes that run's times meaningless, so they come from runs without it)."""
    engine = Engine(load_checkpoint(path),
                    EngineConfig(forward="circuit", num_drafts=k, widths=(1, 2, 4, 8, 16),
                                 max_batch=width))
    engine.device_drafts = True
    # an engine without them (before issue 14 item 4, before step_ahead) ignores them
    engine.propose_ahead, engine.draft_before_read = mode
    p, inside, calls = engine.proposer, [0.0], Counter[str]()
    assert p is not None
    counter = OpCounter(torch.device("cpu")) if count_ops else None

    read_at: list[float | None] = [None]  # when the last verify's read returned
    bubbles: list[float] = []  # each: host time from that read to the next launch

    def timed(real: Callable[..., Any]) -> Callable[..., Any]:
        """A launch (a drafter program or a target pass): taken out of the host's time; the
        first after a read ends that read's bubble."""
        def call(*args: Any, **kwargs: Any) -> Any:
            where = counter.where if counter is not None else None
            if counter is not None:
                counter.where = None  # a program's own ops are not the host's
            t = time.thread_time()
            if read_at[0] is not None:
                bubbles.append(t - read_at[0])
                read_at[0] = None
            try:
                return real(*args, **kwargs)
            finally:
                inside[0] += time.thread_time() - t
                if counter is not None:
                    counter.where = where
        return call

    def read(real: Callable[..., Any]) -> Callable[..., Any]:
        """A pass's read (the host waits for it): a bubble starts when it returns."""
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return real(*args, **kwargs)
            finally:
                read_at[0] = time.thread_time()
        return call

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)
        return call
    model = engine.target.model
    model.launch = timed(model.launch)  # type: ignore[method-assign]
    model.forward = read(model.forward)  # type: ignore[method-assign]  # (launch, then the read)
    if hasattr(engine.target, "read_verify"):  # the device path's read (an engine before it
        # read inside forward)
        engine.target.read_verify = read(engine.target.read_verify)  # type: ignore[method-assign]
    for runner in p.chains.runners():
        backend = getattr(runner, "backend", None)
        if backend is not None and hasattr(backend, "execute"):
            backend.execute = timed(backend.execute)
    for name in CALLS:
        if hasattr(p, name):
            setattr(p, name, counted(name, getattr(p, name)))
    steps: list[tuple[float, float, Counter[str], int]] = []  # (time, in programs, calls, ops)
    last = [0.0]

    def on_step(_: Engine) -> None:
        now = time.thread_time()
        ops = sum(counter.counts["step"].values()) if counter is not None else 0
        steps.append((now - last[0], inside[0], Counter(calls), ops))
        inside[0] = 0.0
        calls.clear()
        if counter is not None:
            counter.counts.clear()
        last[0] = time.thread_time()
    g = torch.Generator().manual_seed(width)
    requests = [Request(torch.randint(0, CONFIG.vocab_size, (12 + 3 * i,), generator=g).tolist(),
                        new_tokens) for i in range(width)]
    last[0] = time.thread_time()
    if counter is not None:
        counter.where = "step"
        with counter:
            engine.generate(requests, on_step=on_step)
    else:
        engine.generate(requests, on_step=on_step)
    steady = steps[1:-1]  # not the first (its prefill), not the last (nothing left to draft)
    per_step: Counter[str] = Counter()
    for _, _, c, _ in steady:
        per_step.update(c)
    return {"host_us": statistics.median((t - prog) * 1e6 for t, prog, _, _ in steady),
            # the first's is the prefill's, the last's (no launch after it) never ends
            "bubble_us": statistics.median(b * 1e6 for b in bubbles[1:] or [0.0]),
            "ops": statistics.median(ops for *_, ops in steady),
            "steps": len(steps),
            "calls_per_step": {k: v / len(steady) for k, v in sorted(per_step.items())}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--modes", default="before_read,ahead,separate")
    ap.add_argument("--accept", choices=("greedy", "forced"), default="greedy")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: {sorted(set(modes) - set(MODES))} unknown (of {', '.join(MODES)})")
    if args.accept == "forced" and "before_read" in modes:
        ap.error("--accept forced is the host's count; before_read counts on the device by the "
                 "real rule: leave before_read out of --modes, or accept greedily")
    threads, rule = torch.get_num_threads(), engine_module.accept
    torch.set_num_threads(1)
    if args.accept == "forced":
        setattr(engine_module, "accept", forced_accept)  # the rule _decode calls
    try:  # both put back after: a caller in the same process (a test) decodes greedily again
        with tempfile.TemporaryDirectory() as tmp:
            path = write_random_checkpoint(Path(tmp) / "small", CONFIG, seed=3)
            one_run(path, 2, MODES[modes[0]], args.num_drafts, 8)  # warm-up: first compiles, imports
            rows: dict[str, dict[int, list[dict[str, Any]]]] = {m: {w: [] for w in widths}
                                                                 for m in modes}
            ops = {m: {w: one_run(path, w, MODES[m], args.num_drafts, args.new_tokens, True)["ops"]
                       for w in widths} for m in modes}
            for r in range(args.repeats):
                for w in widths:
                    for m in (modes if r % 2 == 0 else modes[::-1]):
                        rows[m][w].append(one_run(path, w, MODES[m], args.num_drafts,
                                                  args.new_tokens))
    finally:
        setattr(engine_module, "accept", rule)
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"device": "cpu", "num_drafts": args.num_drafts, "accept": args.accept,
                           "results": {}}
    print(f"{'mode':<10}{'n':>4}{'host us/step':>14}{'range':>18}{'bubble us':>11}{'ops/step':>10}"
          "  calls/step")
    for m in modes:
        for w in widths:
            got = [x["host_us"] for x in rows[m][w]]
            res = {"median_us": statistics.median(got), "min_us": min(got), "max_us": max(got),
                   "bubble_us": statistics.median(x["bubble_us"] for x in rows[m][w]),
                   "ops_per_step": ops[m][w], "calls_per_step": rows[m][w][0]["calls_per_step"]}
            out["results"].setdefault(m, {})[w] = res
            calls = " ".join(f"{k}={v:.2f}" for k, v in res["calls_per_step"].items())
            print(f"{m:<10}{w:>4}{res['median_us']:>14.0f}{res['min_us']:>9.0f}-{res['max_us']:<8.0f}"
                  f"{res['bubble_us']:>11.0f}{res['ops_per_step']:>10.0f}  {calls}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
