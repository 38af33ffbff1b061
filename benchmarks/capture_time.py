"""Benchmark: how long a compiled draft chain takes to capture its 64 widths (issue 15 item 5,
target < 3 s compile + capture on the H200), with GraphRunner's parallel precompile off
("before": every kernel specialisation compiles inside the first warm-up or capture that meets
it) and on ("after": `runners.precompile.precompile_kernels` compiles them all first, in forked
children), from a cold Triton cache; with --warm also from a warm one (a server restart): after
a config's "after" run, "warm" runs it again on the same cache dir, and "warm-unprobed" does too
with the precompile's file-cache probe off (every compile forked to a child, what the warm path
did before the probe), the two in alternating order.

Fair by construction: every (config, variant) runs in a child process of its own, with a fresh
empty TRITON_CACHE_DIR (so each starts from a cold Triton cache, on disk and in memory; the warm
variants reuse their config's "after" dir, in memory still cold), the same weights and inputs
(benchmarks/draft_chain.py's Bench at its seed), variants alternating per config. Each child
reports: compile_s (compile_draft), bind_s (the program runner's construction), precompile_s
(and its kernels, distinct specialisation keys, launches visited, threads, compile jobs, jobs
found in the file cache, children forked, and its phases: key_s, visit_s, probe_s, fork_s,
complete_s, load_s), capture_wall_s (GraphRunner's whole construction, then a device sync), the
sum and the per-width capture_ms, the graph pool's reserved growth per width and in all, the
widths that took a warm-up, failures, and whether replays equal the program's eager run at 3
widths.

    PYTHONPATH=$PWD python3 -m benchmarks.capture_time --configs small,8b --out FILE
    PYTHONPATH=$PWD python3 -m benchmarks.capture_time --configs small,8b --variants after --warm --out FILE
    PYTHONPATH=$PWD python3 -m benchmarks.capture_time --dry-run --out FILE   # CPU, interpreter
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("before", "after")             # each from an empty Triton cache
WARM_VARIANTS = ("warm", "warm-unprobed")  # on the cache dir of their config's "after" run
CHECK_WIDTHS = (1, 17, 64)


def _child(config: str, variant: str, widths: int) -> dict[str, Any]:
    """One (config, variant) in this (fresh) process: build, capture, measure, check."""
    import torch

    from benchmarks import draft_chain as dc
    from draft_circuit.circuit.layers.mtp import emit_draft_chain
    from draft_circuit.circuit.planner import CompileOptions, compile_draft
    from draft_circuit.runners import cudagraph, precompile
    from draft_circuit.runners.cudagraph import GraphRunner

    if variant == "warm-unprobed":  # GraphRunner looks the name up at each construction
        cudagraph.precompile_kernels = functools.partial(precompile.precompile_kernels, cached=None)
    t0 = time.perf_counter()
    s, configs, _ = dc.build(dc.parse_args(["--configs", config, "--max-width", str(widths),
                                            "--widths", str(widths)]))
    b = dc.Bench(config, configs[config], s)
    chain = emit_draft_chain(b.head, s.num_drafts, max_width=s.max_width, kv=b.kv(),
                             draft_vocab=b.draft_vocab)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    t = time.perf_counter()
    compiled = compile_draft(chain, b.params, widths=list(range(1, widths + 1)), device="cuda",
                             options=CompileOptions(kv_rows=round(b.mean_live)))
    compile_s = time.perf_counter() - t
    states = {"k_cache": b.k_cache, "v_cache": b.v_cache}
    reserved = torch.cuda.memory_reserved()
    t = time.perf_counter()
    runner = GraphRunner(compiled, states, scratch_block=0, precompile=variant != "before")
    torch.cuda.synchronize()
    capture_wall_s = time.perf_counter() - t
    st = runner.stats
    pre = st.precompile
    agree = {}
    for n in CHECK_WIDTHS:
        if not runner.serves(n):
            continue
        bufs = runner.input_buffers(n)
        for k, v in b.inputs(0, n, tuple(bufs)).items():
            bufs[k].copy_(v)
        runner.execute(n)
        graph = runner.output_buffers(n)["drafts"].clone()
        runner.program.execute(n)
        agree[n] = bool(torch.equal(graph, runner.program.output_buffers(n)["drafts"]))
    torch.cuda.synchronize()
    return {
        "config": config, "variant": variant, "widths": len(compiled.widths),
        "setup_s": setup_s, "compile_s": compile_s, "bind_s": st.bind_s,
        "precompile_s": pre.seconds if pre else 0.0,
        "precompile_kernels": pre.kernels if pre else 0,
        "precompile_keys": len(pre.keys) if pre else 0,
        "precompile_launches": pre.launches if pre else 0,
        "precompile_threads": pre.threads if pre else 0,
        "precompile_forked": pre.forked if pre else False,
        "precompile_children_failed": pre.children_failed if pre else 0,
        "precompile_jobs": pre.jobs if pre else 0,
        "precompile_cached": pre.cached if pre else 0,
        "precompile_children": pre.children if pre else 0,
        "precompile_phases": pre.phases() if pre else {},
        "capture_wall_s": capture_wall_s,
        "compile_plus_capture_s": compile_s + capture_wall_s,
        "capture_ms_sum": sum(st.capture_ms.values()),
        "capture_ms": {int(w): round(v, 3) for w, v in sorted(st.capture_ms.items())},
        "pool_bytes": {int(w): int(v) for w, v in sorted(st.pool_bytes.items())},
        "pool_bytes_sum": sum(st.pool_bytes.values()),
        "reserved_growth_bytes": torch.cuda.memory_reserved() - reserved,
        "arena_bytes": int(compiled.arena_bytes),
        "warmed_widths": sorted(w for w, k in st.warmed.items() if k),
        "failures": dict(st.failures),
        "replay_equals_program": agree,
        "device": torch.cuda.get_device_name(),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }


def _dry_child() -> dict[str, Any]:
    """CPU: the tiny config under the interpreter through the precompile's visit (no capture)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from benchmarks import draft_chain as dc
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from draft_circuit.circuit.planner import CompileOptions, compile_draft
    from draft_circuit.runners.padding import fill_neutral
    from draft_circuit.runners.precompile import precompile_kernels
    from draft_circuit.runners.program import ProgramRunner
    from draft_circuit.runners.testing import random_mtp_weights

    cfg = dc.DRY_CONFIG
    head = MtpHead(cfg)
    kv = KvLayout(num_blocks=33, block_size=16, max_blocks_per_seq=4)
    chain = emit_draft_chain(head, 2, max_width=8, kv=kv)
    params = head.bind(random_mtp_weights(cfg, seed=0))
    compiled = compile_draft(chain, params, list(range(1, 9)),
                             options=CompileOptions(interpret_kernels=True))
    k_shape, v_shape = head.cache_shapes(kv)
    program = ProgramRunner(compiled, {"k_cache": torch.zeros(k_shape), "v_cache": torch.zeros(v_shape)})
    fill_neutral(compiled.circuit, program.static_inputs, 0, 0)
    pre = precompile_kernels(program, compiled.widths, threads=2)
    return {"config": "tiny", "variant": "dry-run", "widths": len(compiled.widths),
            "precompile_s": pre.seconds, "precompile_keys": len(pre.keys),
            "precompile_launches": pre.launches, "precompile_kernels": pre.kernels,
            "precompile_jobs": pre.jobs, "precompile_phases": pre.phases()}


def _run_child(config: str, variant: str, widths: int, timeout_s: float, cache: str) -> dict[str, Any]:
    """One (config, variant) in a child process whose TRITON_CACHE_DIR is `cache`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "benchmarks.capture_time", "--child", config,
               "--variant", variant, "--max-width", str(widths), "--out", out.name]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"config": config, "variant": variant, "error": f"timed out after {timeout_s:.0f} s"}
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            return {"config": config, "variant": variant, "error": proc.stderr[-3000:]}
        with open(out.name) as f:
            got: dict[str, Any] = json.load(f)
        os.unlink(out.name)
        got["child_wall_s"] = wall
        return got


def plan(names: list[str], variants: list[str], warm: bool) -> list[tuple[str, list[str]]]:
    """The children to run: per config, groups of variants that share one fresh cache dir, in
    order. Cold variants alternate per config (neither always meets the colder machine); with
    `warm`, "after" (run even if not asked for: it fills the cache) is followed by the two warm
    variants on its dir, their order alternating too."""
    groups: list[tuple[str, list[str]]] = []
    for i, name in enumerate(names):
        cold = [v for v in VARIANTS if v in variants or (warm and v == "after")]
        for v in (cold if i % 2 == 0 else cold[::-1]):
            if v == "after" and warm:
                groups.append((name, [v, *(WARM_VARIANTS if i % 2 == 0 else WARM_VARIANTS[::-1])]))
            else:
                groups.append((name, [v]))
    return groups


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['config']:>12} {r['variant']:>13}: ERROR {r['error'][-300:]}"
    phases = " ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in r.get("precompile_phases", {}).items())
    return (f"{r['config']:>12} {r['variant']:>13}: compile {r['compile_s']:.2f} s + precompile "
            f"{r['precompile_s']:.2f} s ({r['precompile_kernels']} kernels, {r['precompile_keys']} "
            f"keys, {r.get('precompile_jobs', 0)} jobs, {r.get('precompile_cached', 0)} in the file "
            f"cache, " + (f"{r.get('precompile_children', 0)} of {r['precompile_threads']} children "
                          f"forked, {r['precompile_children_failed']} failed"
                          if r['precompile_forked'] else f"{r['precompile_threads']} threads")
            + f"; {phases or 'no phases'}) + rest of capture "
            f"{r['capture_wall_s'] - r['precompile_s']:.2f} s = {r['compile_plus_capture_s']:.2f} s; "
            f"sum capture_ms {r['capture_ms_sum']:.0f}, max {max(r['capture_ms'].values(), default=0):.0f} ms; "
            f"pool {r['pool_bytes_sum'] / 2**20:.1f} MiB reserved beyond the "
            f"{r['arena_bytes'] / 2**20:.1f} MiB arena; warmed {r['warmed_widths']}; failures "
            f"{len(r['failures'])}; replay == program {r['replay_equals_program']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="small,8b", help="benchmarks/draft_chain.py config names")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--max-width", type=int, default=64, help="capture widths 1..this")
    p.add_argument("--budget-s", type=float, default=115.0, help="all children together")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="cold-cache variants to run, of before,after (before: ~35 s a config)")
    p.add_argument("--warm", action="store_true",
                   help="after each config's 'after' run, the warm and warm-unprobed variants on its cache")
    p.add_argument("--dry-run", action="store_true", help="CPU: the tiny config's precompile visit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS + WARM_VARIANTS, default="after", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.dry_run:
        result = _dry_child() if args.dry_run else _child(args.child, args.variant, args.max_width)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if args.dry_run:
            print(json.dumps(result))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: {bad} not among {list(VARIANTS)}")
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    for name, group in plan(names, variants, args.warm):
        with tempfile.TemporaryDirectory(prefix=f"triton_{name}_{group[0]}_") as cache:
            for variant in group:
                left = args.budget_s - (time.perf_counter() - start)
                if left < 10:
                    results.append({"config": name, "variant": variant, "error": "skipped: budget spent"})
                    continue
                r = _run_child(name, variant, args.max_width, left, cache)
                results.append(r)
                print(_line(r), flush=True)
                with open(args.out, "w") as f:  # after every child: a run cut short keeps its numbers
                    json.dump({"results": results, "elapsed_s": time.perf_counter() - start}, f, indent=1)
    print(f"capture_time: {time.perf_counter() - start:.1f} s in all; {args.out}")


if __name__ == "__main__":
    main()
