"""Where a captured draft chain's GPU time goes: per-kernel device time of the circuit's chain.

`benchmarks/draft_chain.py` says how long a whole chain takes against its floor; this says which
kernels make up the gap. It builds the same chain (same Bench: weights, KV pool, inputs) with
the same CompileOptions, replays the captured chain under torch.profiler (CUPTI records the
kernels inside a graph replay), and sums each kernel's device time per chain. For every kernel
it prints µs per chain, the share of the chain, and the calls per chain; with the plan's bytes
per node it cannot pair names to nodes (Triton names are the jit function's), so it reports
names as the GPU ran them.

    PYTHONPATH=$PWD python3 -m benchmarks.chain_profile --configs small,8b --widths 1,64 \
        --out $OUT/chain_profile.json [--tuning measure]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks import draft_chain as dc


def profile_width(build: dc.CircuitBuild, b: dc.Bench, n: int, chains: int) -> dict[str, Any]:
    """Per-kernel device µs per chain at width n, from `chains` replays under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    case = build.case(b, n)
    case.prepare(0)
    for _ in range(5):  # warm: the first replays pay lazy module loads
        case.run()
    torch.cuda.synchronize()
    events: list[torch.cuda.Event] = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(chains):
            case.prepare(i % b.s.num_sets)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            case.run()
            end.record()
            events.append(start)
            events.append(end)
        torch.cuda.synchronize()
    wall = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(0, len(events), 2)]
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            per_kernel[e.name].append(e.device_time)  # µs
    rows = []
    for name, ts in per_kernel.items():
        rows.append({"kernel": name, "us_per_chain": sum(ts) / chains, "calls_per_chain": len(ts) / chains,
                     "median_us": statistics.median(ts)})
    rows.sort(key=lambda r: -r["us_per_chain"])
    busy = sum(r["us_per_chain"] for r in rows)
    return {"chain_us_median": statistics.median(wall), "kernel_us_per_chain": busy, "kernels": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="small,8b")
    p.add_argument("--widths", default="1,8,64")
    p.add_argument("--chains", type=int, default=20)
    p.add_argument("--tuning", choices=("off", "cached", "measure"), default="off")
    p.add_argument("--fast", action="store_true", help="the width-dependent plan (circuit_fast)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dc.T0 = time.perf_counter()
    widths = [int(x) for x in args.widths.split(",")]
    s = dc.Settings(device=torch.device("cuda"), dtype=torch.bfloat16, num_drafts=4, widths=widths,
                    max_width=max(64, max(widths)), block_size=16, max_blocks=64, num_sets=4,
                    live_min=90, live_max=110, iters=0, warmup=0, seed=0, circuit_widths="bench",
                    compile_dynamic=None, compile_backend=None, tuning=args.tuning)
    bw, _ = dc.copy_bandwidth(s.device, 2 << 30)
    out: dict[str, Any] = {"device": dc.device_name(s.device), "copy_bandwidth_gbps": bw,
                           "tuning": args.tuning, "fast": args.fast, "configs": {}}
    for name in args.configs.split(","):
        b = dc.Bench(name, dc.CONFIGS[name], s)
        build = dc.CircuitBuild(b, widths, args.fast, bw)
        summary = build.summary()
        entry: dict[str, Any] = {"kernel_choices": summary["kernel_choices"],
                                 "plan_floor_us": summary["plan_floor_us"], "widths": {}}
        for n in widths:
            r = profile_width(build, b, n, args.chains)
            entry["widths"][str(n)] = r
            floor = summary["plan_floor_us"].get(n) or 0.0
            print(f"== {name} n={n}: chain {r['chain_us_median']:.1f} us (plan floor {floor:.1f}), "
                  f"kernels busy {r['kernel_us_per_chain']:.1f} us")
            for k in r["kernels"][:14]:
                print(f"   {k['us_per_chain']:8.1f} us  x{k['calls_per_chain']:4.1f}  "
                      f"{k['median_us']:7.1f} us/call  {k['kernel'][:90]}")
        for w, cs in summary["kernel_choices"].items():
            for c in cs:
                print(f"   choice w={w}: {json.dumps(c)[:300]}")
        out["configs"][name] = entry
        del build, b
        dc.free_memory(s.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
