"""Benchmark: what the in-graph input guard (issue 19 item 1, runners/input_guard.py) costs a run.

In one process, on the same compiled chain, weights, KV pool and inputs, two GraphRunners are
captured: one with the guard (the default) and one with `guard=False`. For each width the two
are replayed in turn, and reported per run (one replay of the whole k-step chain):

  back_to_back_us  CUDA-event time of `--iters` replays issued back to back, over iters: the
                   device time a run takes when the host keeps the GPU fed (the guard's launch
                   and its dependency gap count here)
  idle_us          the median of single replays each timed from an idle device (synchronised
                   before it), as benchmarks/draft_chain.py times a chain: host launch included
  guard_alone_us   a graph of 20 guard launches alone, per launch: the guard's own device time
  check_faults_us  host time of one `check_faults()` after a sync (a small device-to-host read;
                   the proposer pays it where it already syncs)

Each delta is guarded minus unguarded, the median over `--reps` alternating rounds; the goal is
<= 2 us a run (`goal_us`). The guard is always on in the runners; this says whether that is right.
The plan's launches per draft step do not include the guard (it is one launch per run).

    python3 -m benchmarks.guard_cost --out $OUT/guard.json
    python3 -m benchmarks.guard_cost --dry-run --out /tmp/guard.json   # CPU, tiny: code path only
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

GOAL_US = 2.0
# draft_chain.py's "small" and "8b" shapes (not imported: that module pulls in every head's loader)
CONFIGS: dict[str, MtpConfig] = {
    "small": MtpConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                       tie_word_embeddings=False, max_position_embeddings=8192),
    "8b": MtpConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    rms_norm_eps=1e-5, rope_theta=500000.0, num_hidden_layers=1,
                    tie_word_embeddings=False, max_position_embeddings=131072),
}
DRY_CONFIG = MtpConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                       tie_word_embeddings=False, max_position_embeddings=512)


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def _time_gpu(fn: Callable[[], None], iters: int) -> float:
    """Device microseconds per call of `fn` issued `iters` times back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _time_idle(fn: Callable[[], None], iters: int) -> float:
    """The median of `iters` single calls, each timed with events from an idle device."""
    out = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return statistics.median(out)


def _time_host(fn: Callable[[], None], iters: int) -> float:
    best = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        best.append((time.perf_counter() - t) * 1e6)
    return statistics.median(best)


def _guard_alone(runner: Any, n: int, iters: int) -> float:
    """Per launch: a CUDA graph of 20 launches of width n's guard (its bound launch) alone."""
    x = runner.program._bound[n][0]
    assert x.op == "input_guard", x.op
    def launch() -> None:
        x.fn(x.inputs, x.outputs, x.workspace, x.attrs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            launch()
    return _time_gpu(graph.replay, iters) / 20


def bench_config(name: str, config: MtpConfig, args: argparse.Namespace) -> dict[str, Any]:
    from draft_circuit.runners.cudagraph import GraphRunner

    widths = [int(w) for w in args.widths.split(",")]
    max_width = max(widths)
    kv = KvLayout(num_blocks=max_width * args.max_blocks + 1, block_size=args.block_size,
                  max_blocks_per_seq=args.max_blocks)
    head = MtpHead(config, "bfloat16")
    chain = emit_draft_chain(head, args.num_drafts, max_width=max_width, kv=kv)
    params = head.bind(random_mtp_weights(config, seed=0, dtype=torch.bfloat16, device="cuda"))
    compiled = compile_draft(chain, params, widths, device="cuda")
    batch = random_draft_batch(config, kv, max_width, seed=1, num_drafts=args.num_drafts,
                               dtype=torch.bfloat16, device="cuda")
    runners = {guard: GraphRunner(compiled, batch.clone_states(), scratch_block=0, strict=True,
                                  guard=guard) for guard in (True, False)}
    rows: dict[str, Any] = {}
    for n in widths:
        for r in runners.values():  # the same inputs in both; replays read the static buffers
            for k, dst in r.input_buffers(n).items():
                dst.copy_(batch.inputs[k][:n])
        b2b: dict[bool, list[float]] = {True: [], False: []}
        idle: dict[bool, list[float]] = {True: [], False: []}
        for guard, r in runners.items():
            _time_gpu(lambda: r.execute(n), args.warmup)  # noqa: B023  (called here)
        for _ in range(args.reps):
            for guard, r in runners.items():
                b2b[guard].append(_time_gpu(lambda: r.execute(n), args.iters))  # noqa: B023
                idle[guard].append(_time_idle(lambda: r.execute(n), args.idle_iters))  # noqa: B023
        runners[True].check_faults()  # valid inputs: nothing recorded
        deltas = [a - b for a, b in zip(b2b[True], b2b[False])]
        idle_deltas = [a - b for a, b in zip(idle[True], idle[False])]
        rows[str(n)] = {
            "back_to_back_us": {"guard": _median_us(b2b[True]), "no_guard": _median_us(b2b[False]),
                                "delta": _median_us(deltas)},
            "idle_us": {"guard": _median_us(idle[True]), "no_guard": _median_us(idle[False]),
                        "delta": _median_us(idle_deltas)},
            "guard_alone_us": round(_guard_alone(runners[True], n, args.iters), 3),
            "launches_per_run": {"guard": len(runners[True].program._bound[n]),
                                 "no_guard": len(runners[False].program._bound[n])},
        }
        print(f"{name} n={n}: {json.dumps(rows[str(n)])}", flush=True)
    guarded = runners[True]
    torch.cuda.synchronize()
    check_us = _time_host(guarded.check_faults, 200)
    worst = max(v["back_to_back_us"]["delta"] for v in rows.values())
    return {"widths": rows, "check_faults_us": round(check_us, 3),
            "worst_back_to_back_delta_us": worst, "meets_goal": worst <= GOAL_US}


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """CPU: the guarded and unguarded program runners on a tiny chain, timed on the host (the
    code path only; the numbers mean nothing for a GPU)."""
    from draft_circuit.runners.program import ProgramRunner

    kv = KvLayout(num_blocks=9, block_size=8, max_blocks_per_seq=4)
    head = MtpHead(DRY_CONFIG)
    chain = emit_draft_chain(head, 2, max_width=2, kv=kv)
    params = head.bind(random_mtp_weights(DRY_CONFIG, seed=0))
    compiled = compile_draft(chain, params, [2])
    batch = random_draft_batch(DRY_CONFIG, kv, 2, seed=1, num_drafts=2)
    out = {}
    for guard in (True, False):
        r = ProgramRunner(compiled, batch.clone_states(), guard=guard)
        r.copy_in(2, batch.inputs)
        out["guard" if guard else "no_guard"] = round(_time_host(lambda: r.execute(2), 5), 1)  # noqa: B023
        r.check_faults()
    return {"widths": {"2": {"host_us": out}}, "dry_run": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--configs", default="small", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--widths", default="1,8,64")
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-blocks", type=int, default=64, help="block-table width per sequence")
    p.add_argument("--iters", type=int, default=200, help="replays per back-to-back sample")
    p.add_argument("--idle-iters", type=int, default=50, help="single replays per idle sample")
    p.add_argument("--reps", type=int, default=7, help="alternating rounds (median reported)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny chain: exercise the code")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"goal_us": GOAL_US, "torch": torch.__version__}
    if args.dry_run:
        result["configs"] = {"dry": dry_run(args)}
    else:
        if not torch.cuda.is_available():
            print("error: guard_cost needs a CUDA GPU (use --dry-run on CPU)", file=sys.stderr)
            return 2
        import triton
        result.update(device=torch.cuda.get_device_name(), triton=triton.__version__,
                      configs={})
        for name in args.configs.split(","):
            result["configs"][name] = bench_config(name, CONFIGS[name], args)
            with open(args.out, "w") as f:  # rewritten after every config: a cut run keeps its numbers
                json.dump(result, f, indent=2)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
