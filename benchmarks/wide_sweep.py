"""H200 sweep of tensor-core tilings for wide n (issue 15 item 3): which tilings give every row
bitwise the bits of the pinned kernel (kernels.linear: BLOCK_M 16, BLOCK_N 32, BLOCK_K 128, 4
warps, 4 stages) and what each costs at n in {1, 8, 16, 32, 64}, at the 8B draft chain's shapes
(bf16): q/k/v 4096->6144, o 4096->4096, gate_up 4096->2x14336 (SwiGLU fused), down 14336->4096,
eh_proj 8192->4096, lm-head 4096->128256 (logits; plus the fused partial-argmax lm-head).

Candidates (family = the kernel whose per-row bits they are compared against):
  linear family (ref `pinned`): (a) bm32 / bm64_w4 (wgmma expected) / bm64_w2 (mma.sync
  forced): kernels.linear's kernel at BLOCK_M 32 / 64; (c) bn64 / bn128 at BLOCK_M 16; (d) w8,
  s3: warps / stages; (b) mloop / mloop_bn64: kernels.linear_wide, M_TILES = cdiv(n, 16) <= 4
  row tiles of 16 per program, weight tile loaded once a K step (bitwise by construction).
  splitk family (ref `splitk`, kernels.linear_splitk at its default config; K-split shapes):
  splitk_mloop, the split-K partials with the M-tile loop. cublas (torch.matmul; gate_up: the
  [n, 2I] product only) and lm_fused (kernels.argmax_logprob, token + logprob) have no ref:
  only their own width invariance is checked. `rule` / `splitk_rule`: the production launcher
  at kernels.tiles' rule (pinned tiles at n <= 16; at n > 16 BLOCK_M 64 / 4 warps, split-K the
  M-tile loop); the refs force the pinned tiles (tiles="pinned").
  chain shapes (benchmarks/wide_chain.py): the 8B chain's fused linears as it binds them (q/k/v
  with its norm, gate_up with norm + SwiGLU, the eh_proj split-K prologue with embedding, two
  norms and concat, o / down split-K with the residual add), `pinned` (ref) against `rule` and
  for the split-K ones a forced `mloop` and `bm64`.

Per (shape, candidate, n): us per launch (a CUDA graph of 20 launches cycling weight copies
that exceed the L2, replayed REPLAYS times, events, median), GB/s of weight bytes, and per row
of the n: bitwise equal (integer view) to the family ref run on that row alone (`eq_ref`), and
to the candidate itself run on that row alone (`eq_self`, width invariance), the max abs diff
to the ref, and the MMA instruction in the PTX (wgmma / mma.sync). Failures are recorded.
First, --precompile-jobs worker processes (8) compile every kernel into Triton's disk cache side
by side; (shape, candidate, n) not started by --deadline-s (130) are recorded as skipped. The
JSON (rewritten after every shape) has `results` (one entry per shape, candidate, n) and
`summary` (per shape and n: the refs' us, the fastest candidate bitwise equal to its ref on
every row, the fastest width-invariant one, cuBLAS).

    PYTHONPATH=$PWD python3 -m benchmarks.wide_sweep --out DIR        # H200, < 150 s
    PYTHONPATH=$PWD python3 -m benchmarks.wide_sweep --dry-run --out DIR  # CPU interpreter
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

if "--dry-run" in sys.argv:  # before triton is imported: its interpreter runs the kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import wide_chain as wc  # noqa: E402
from draft_circuit.kernels import argmax_logprob as am  # noqa: E402
from draft_circuit.kernels import linear_splitk as sk  # noqa: E402
from draft_circuit.kernels import linear_wide as lw  # noqa: E402
from draft_circuit.kernels import tiles  # noqa: E402
from draft_circuit.kernels.linear import linear, linear_silu_mul  # noqa: E402

WIDTHS, DRY_WIDTHS = (1, 8, 16, 32, 64), (1, 17)
LAUNCHES, REPLAYS = 20, 5
ROTATE_BYTES = 128 << 20  # > 2x the H200's 50 MB L2: every launch streams its weight from HBM
# (name, weight rows, K, SwiGLU); 8B-class draft chain: its fused linears first (the rule's
# verdict), then the plain products
SHAPES = wc.CHAIN_SHAPES + [("gate_up", 2 * 14336, 4096, True), ("down", 4096, 14336, False),
          ("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("eh_proj", 4096, 8192, False),
          ("lm_head", 128256, 4096, False)]
DRY_SHAPES = [("gate_up", 2 * 40, 64, True), ("down", 40, 256, False), ("lm_head", 72, 64, False)
              ] + wc.DRY_CHAIN_SHAPES
DRY_SPLIT = sk.SplitKConfig(block_n=16, split_k=128, block_k=32, num_stages=2)
# candidate -> (family, tiles (block_m, block_n, warps, stages) for linear_tiles, or None)
TILES = {"pinned": (16, 32, 4, 4), "bm32": (32, 32, 4, 4), "bm64_w4": (64, 32, 4, 4),
         "bm64_w2": (64, 32, 2, 4), "bn64": (16, 64, 4, 4), "bn128": (16, 128, 4, 4),
         "w8": (16, 32, 8, 4), "s3": (16, 32, 4, 3)}


def graph_us(launch: Callable[[int], Any], cuda: bool) -> float:
    """Median us per launch of a CUDA graph of LAUNCHES calls launch(0..), REPLAYS replays (the
    interpreter: wall time of two calls)."""
    if not cuda:
        t0 = time.perf_counter()
        launch(0), launch(1)
        return (time.perf_counter() - t0) * 1e6 / 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up (cuBLAS handles) outside the capture
        launch(0), launch(1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            launch(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / LAUNCHES)
    del graph
    return statistics.median(times)


def mma_of(handle: Any) -> str | None:
    """The tensor-core instruction in a compiled kernel's PTX (None in the interpreter)."""
    try:
        ptx = handle.asm["ptx"]
    except Exception:  # the interpreter, or a launcher that returns nothing
        return None
    return "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"


def candidates(name: str, rows: int, k: int, silu: bool, dry: bool) -> dict[str, tuple[str | None, Callable]]:
    """candidate -> (family ref or None, fn(x, w, out, ws) -> Triton handle or None)."""
    out: dict[str, tuple[str | None, Callable]] = {}
    fn = linear_silu_mul if silu else linear
    for cand, (bm, bn, warps, stages) in TILES.items():
        if cand == "pinned":  # the production launcher at its pinned tiles (its PTX: linear_tiles')
            out[cand] = ("pinned", lambda x, w, o, ws: fn(x, w, o, tiles=tiles.PINNED))
        else:
            out[cand] = ("pinned", lambda x, w, o, ws, t=(bm, bn, warps, stages): lw.linear_tiles(
                x, w, o, silu, t[0], t[1], t[2], t[3]))
    for cand, bn in (("mloop", 32), ("mloop_bn64", 64)):
        cfg = lw.WideConfig(block_n=bn)
        out[cand] = ("pinned", lambda x, w, o, ws, cfg=cfg: lw.linear_wide(x, w, o, silu, config=cfg))
    out["rule"] = ("pinned", lambda x, w, o, ws: fn(x, w, o))
    split = DRY_SPLIT if dry else sk.default_config(rows, k)
    if name != "lm_head" and not silu and sk.num_splits(rows, k, split) >= 2:
        out["splitk"] = ("splitk", lambda x, w, o, ws: sk.linear_splitk(x, w, o, ws, split,
                                                                        tiles=tiles.PINNED))
        out["splitk_rule"] = ("splitk", lambda x, w, o, ws: sk.linear_splitk(x, w, o, ws, split))
        out["splitk_mloop"] = ("splitk", lambda x, w, o, ws: lw.linear_wide_splitk(x, w, o, ws, split))
    out["cublas"] = (None, lambda x, w, o, ws: torch.matmul(x, w.t(), out=o))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def row_report(got: torch.Tensor, ref: torch.Tensor | None, own: torch.Tensor) -> dict:
    n = got.shape[0]
    eq_self = (bits(got) == bits(own[:n])).flatten(1).all(1)
    r: dict[str, Any] = {"eq_self": int(eq_self.sum())}
    if ref is not None:
        eq = (bits(got) == bits(ref[:n])).flatten(1).all(1)
        r["eq_ref"] = int(eq.sum())
        r["first_diff_rows"] = [int(i) for i in (~eq).nonzero().flatten()[:4]]
        r["max_abs_diff_ref"] = float((got.float() - ref[:n].float()).abs().max())
    return r


def sweep_shape(name: str, rows: int, k: int, silu: bool, widths, dev, dt, dry: bool,
                deadline: float, only: set[str] | None) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)
    nbytes = rows * k * 2
    copies = 1 if dry else max(1, math.ceil(ROTATE_BYTES / nbytes))
    ws_ = [(torch.randn(rows, k, generator=gen, device=dev) * k ** -0.5).to(dt) for _ in range(copies)]
    nmax = max(widths)
    X = torch.randn(nmax, k, generator=gen, device=dev).to(dt)
    cols = rows // 2 if silu else rows
    split = DRY_SPLIT if dry else sk.default_config(rows, k)
    chain = name in wc.NAMES
    cands = (wc.chain_candidates(name, rows, k, X, split, dev, dt) if chain
             else candidates(name, rows, k, silu, dry))
    if name == "lm_head":
        cands["lm_fused"] = (None, None)  # type: ignore[assignment]
    if only:
        cands = {c: v for c, v in cands.items() if c in only or c in ("pinned", "splitk")}

    def workspace(n: int) -> torch.Tensor:
        return torch.empty(sk.splitk_workspace_shape(n, rows, k, split), dtype=torch.float32, device=dev)

    def runner(cand: str, fn, n: int) -> tuple[Callable[[int, torch.Tensor], Any], torch.Tensor]:
        """(launch(copy index, x rows) writing `dst`, dst) for a width n."""
        if cand == "lm_fused":
            tok = torch.empty(n, dtype=torch.int32, device=dev)
            lp = torch.empty(n, dtype=torch.float32, device=dev)
            wsa = torch.empty(am.linear_argmax_workspace_shape(n, rows), dtype=torch.float32, device=dev)
            dst = torch.empty(n, 2, dtype=torch.float32, device=dev)

            def fused(i: int, x: torch.Tensor) -> Any:
                am.linear_argmax_logprob(x, ws_[max(i, 0) % copies], tok, lp, None, wsa)
                if i < 0:  # the check call: token and logprob as the row's result
                    dst[:, 0].copy_(tok)
                    dst[:, 1].copy_(lp)
            return fused, dst
        wide = cand == "cublas" and silu  # the [n, 2I] product only
        dst = torch.empty(n, rows if wide else cols, dtype=dt, device=dev)
        ws = workspace(n) if cand.startswith("splitk") or name in wc.SPLIT_SHAPES else None
        return (lambda i, x: fn(x, ws_[max(i, 0) % copies], dst, ws)), dst  # i < 0: the check, copy 0

    def alone(cand: str, fn) -> torch.Tensor:
        """The candidate on each row alone (n = 1), weight copy 0, stacked."""
        launch, dst = runner(cand, fn, 1)
        rows_out = []
        for i in range(nmax):
            launch(-1, X[i:i + 1])
            rows_out.append(dst.clone())
        return torch.cat(rows_out)

    results: list[dict] = []
    refs: dict[str, torch.Tensor] = {}
    for cand, (family, fn) in cands.items():
        own = None
        for n in widths:
            e: dict[str, Any] = dict(shape=name, rows=rows, k=k, silu=silu, n=n, candidate=cand,
                                     family=family, weight_bytes=nbytes, copies=copies)
            results.append(e)
            if time.perf_counter() > deadline:
                e["error"] = "skipped: past --deadline-s"
                continue
            try:
                if own is None:
                    own = alone(cand, fn)
                    if cand == family:
                        refs[cand] = own
                launch, dst = runner(cand, fn, n)
                x = X[:n]
                e["us"] = round(graph_us(lambda i: launch(i, x), dev.type == "cuda"), 2)
                e["gbps"] = round(nbytes / (e["us"] * 1e3), 1)
                handle = launch(-1, x)
                if cand == "pinned" and not chain:  # kernels.linear's kernel, constants, launch
                    handle = lw.linear_tiles(x, ws_[0], torch.empty_like(dst), silu, *TILES[cand])
                e["mma"] = mma_of(handle)
                e.update(row_report(dst.clone(), refs.get(family) if family else None, own))
            except Exception as ex:  # recorded; a sticky CUDA error ends the run below
                traceback.print_exc()
                e["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                if dev.type == "cuda":
                    torch.cuda.synchronize()
    del ws_
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return results


def compile_only(worker: int, jobs: int, shapes, dev, dt, dry: bool, only: set[str] | None) -> None:
    """Worker `worker` of `jobs`: launch its share of the (shape, candidate) kernels once at
    n = 1, 32, 64 (every M_TILES the sweep uses) on weights of few rows, so that Triton's disk
    cache holds them when the sweep reaches them. Few rows give the same specialisation (every
    row count here is a multiple of 16) and the same split config (it follows K alone)."""
    j = 0
    for name, rows, k, silu in shapes:
        # q/k/v's thirds stay multiples of 16 (as 4096 / 1024 / 1024): the same specialisation
        small = rows if dry else 256 if name == "lm_head" else 128 if silu else 96 if name == "qkv_norm" else 64
        w = torch.randn(small, k, device=dev).to(dt)
        X = torch.randn(64, k, device=dev).to(dt)
        split = DRY_SPLIT if dry else sk.default_config(small, k)
        cands: dict[str, Any] = (wc.chain_candidates(name, small, k, X, split, dev, dt)
                                 if name in wc.NAMES else candidates(name, small, k, silu, dry))
        if name == "lm_head":
            cands["lm_fused"] = (None, lambda x, w, o, ws: am.linear_argmax_logprob(
                x, w, torch.empty(x.shape[0], dtype=torch.int32, device=dev),
                torch.empty(x.shape[0], dtype=torch.float32, device=dev)))
        for cand, (_, fn) in cands.items():
            j += 1
            if (j - 1) % jobs != worker or cand == "cublas" or (only and cand not in only
                                                                  and cand not in ("pinned", "splitk")):
                continue
            # X[1:2]: a lone row past the first, as the sweep's row-alone runs launch it (the
            # chain's ids slice there is not 16-byte aligned: a specialisation of its own)
            for r0, n in ((0, 1), (1, 1), (0, 32), (0, 64)):
                x = X[r0:r0 + n]
                dst = torch.empty(n, small // 2 if silu else small, dtype=dt, device=dev)
                ws = torch.empty(sk.splitk_workspace_shape(n, small, k, split), dtype=torch.float32,
                                 device=dev)
                fn(x, w, dst, ws)
                if cand == "pinned" and name not in wc.NAMES:
                    lw.linear_tiles(x, w, dst, silu, *TILES[cand])
    if dev.type == "cuda":
        torch.cuda.synchronize()


def precompile(jobs: int, argv_tail: list[str], timeout_s: float) -> dict:
    """Run `jobs` compile-only workers side by side (Triton compiles one kernel at a time per
    process; ~40 kernels serially would take most of the time budget) and wait for them. A
    worker that fails or overruns costs only time: the sweep compiles what is missing itself."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.wide_sweep", "--compile-only",
                               f"{i}/{jobs}", *argv_tail]) for i in range(jobs)]
    codes = []
    for pr in procs:
        try:
            codes.append(pr.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0))))
        except subprocess.TimeoutExpired:
            pr.kill()  # only the workers this run started
            pr.wait()
            codes.append(None)
    return {"jobs": jobs, "seconds": round(time.perf_counter() - t0, 1), "exit_codes": codes}


def cell(e: dict) -> str:
    if "error" in e:
        return "skip" if e["error"].startswith("skipped") else "ERR"
    mark = ("=" if e.get("eq_ref") == e["n"] else "~" if e["eq_self"] == e["n"] else "!") \
        if "eq_ref" in e else ("s" if e["eq_self"] == e["n"] else "!")
    return f"{e['us']:.1f}{mark}"


def print_table(results: list[dict], widths) -> None:
    """Per shape: us per launch; '=' every row bitwise the family ref's, '~' not the ref's but
    the candidate's own row alone (width invariant), 's' (no ref) width invariant, '!' neither."""
    for shape in dict.fromkeys(e["shape"] for e in results):
        es = [e for e in results if e["shape"] == shape]
        print(f"\n{shape}: us per launch at n = {'/'.join(map(str, widths))}  (= ref bits, ~ own bits, ! neither)")
        for cand in dict.fromkeys(e["candidate"] for e in es):
            row = [e for e in es if e["candidate"] == cand]
            mma = next((e.get("mma") for e in row if e.get("mma")), "-")
            print(f"  {cand:13s} {str(mma):8s} " + " ".join(f"{cell(e):>9s}" for e in row), flush=True)


def summary(results: list[dict], widths) -> dict:
    """Per shape and n: the pinned (ref) us, the fastest candidate whose rows are all bitwise the
    ref's (switchable per width), the fastest width-invariant one, cuBLAS."""
    out: dict[str, dict] = {}
    for shape in dict.fromkeys(e["shape"] for e in results):
        out[shape] = {}
        for n in widths:
            es = [e for e in results if e["shape"] == shape and e["n"] == n and "us" in e
                  and "error" not in e]
            best = lambda c: min(c, key=lambda e: e["us"], default=None)  # noqa: E731
            pick = lambda e: {"candidate": e["candidate"], "us": e["us"]} if e else None  # noqa: E731
            out[shape][str(n)] = {
                "ref": {e["candidate"]: e["us"] for e in es if e["candidate"] == e["family"]},
                "best_bitwise_ref": pick(best([e for e in es if e.get("eq_ref") == n])),
                "best_width_invariant": pick(best([e for e in es if e.get("eq_self") == n])),
                "cublas": next((e["us"] for e in es if e["candidate"] == "cublas"), None)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for wide_sweep.json (or a .json path)")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, fp32")
    p.add_argument("--deadline-s", type=float, default=130.0,
                   help="(shape, candidate, n) not started by then are recorded as skipped")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shape names")
    p.add_argument("--candidates", default=None, help="comma-separated subset (refs always run)")
    p.add_argument("--precompile-jobs", type=int, default=None,
                   help="compile-only worker processes first (default 8 on the GPU, 0 in a dry run)")
    p.add_argument("--compile-only", default=None, metavar="I/J", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out_path = args.out if args.out.endswith(".json") else os.path.join(args.out, "wide_sweep.json")
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    dt = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter gets bf16 wrong
    shapes, widths = (DRY_SHAPES, DRY_WIDTHS) if args.dry_run else (SHAPES, WIDTHS)
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    only = set(args.candidates.split(",")) if args.candidates else None
    if args.compile_only:
        worker, jobs = map(int, args.compile_only.split("/"))
        compile_only(worker, jobs, shapes, dev, dt, args.dry_run, only)
        return
    report: dict[str, Any] = dict(
        benchmark="wide_sweep", device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, dtype=str(dt), widths=list(widths),
        launches=LAUNCHES, replays=REPLAYS, rotate_bytes=ROTATE_BYTES, results=[])

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        report["summary"] = summary(report["results"], widths)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)

    jobs = args.precompile_jobs if args.precompile_jobs is not None else 0 if args.dry_run else 8
    if jobs > 0:
        tail = ["--out", args.out] + (["--dry-run"] if args.dry_run else []) + (
            ["--shapes", args.shapes] if args.shapes else []) + (
            ["--candidates", args.candidates] if args.candidates else [])
        report["precompile"] = precompile(jobs, tail, timeout_s=0.5 * args.deadline_s)
        print("precompile:", report["precompile"], flush=True)
    try:
        for name, rows, k, silu in shapes:
            res = sweep_shape(name, rows, k, silu, widths, dev, dt, args.dry_run,
                              t0 + args.deadline_s, only)
            report["results"] += res
            print_table(res, widths)
            save()
    finally:
        save()
        print(f"\nwrote {out_path} in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
