"""Kernel sweep for the H200: linear variants and decode_attention split sizes, one script (< 2 min).

For the small and 8B configs' linears (eh_proj, q, k, v, o, gate_up with SwiGLU, down) at n in
{1, 8, 64}: kernels.linear, the split-K kernel at its default and three fixed configurations, and
cuBLAS (torch.matmul; for gate_up the [n, 2I] product only). For decode_attention at the same
widths (~100 live rows, 64-block tables): split_rows in {32, 64, 128, 256}. bf16, random inputs.

Timing: one CUDA graph of >= 20 launches, replayed; the median over replays of (graph time /
launches). Launches cycle through copies of the weights (of the KV blocks) totalling
ROTATE_BYTES, more than the L2 holds, so every launch streams from HBM as it does in the chain
(where the lm_head alone evicts the L2). GB/s = weight (KV) bytes a launch must read / its time.
A variant that fails is recorded with its error; the JSON is rewritten after every shape.

    PYTHONPATH=$PWD python3 benchmarks/tune_kernels.py --out $OUT/tune_kernels.json
    PYTHONPATH=$PWD python3 benchmarks/tune_kernels.py --dry-run --out /tmp/tune.json  # CPU, tiny, fp16
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before triton is imported: its interpreter runs the kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from draft_circuit.kernels import linear_splitk as sk  # noqa: E402
from draft_circuit.kernels.decode_attention import decode_attention, decode_attention_workspace_shape  # noqa: E402
from draft_circuit.kernels.linear import linear, linear_silu_mul  # noqa: E402

ROTATE_BYTES = 128 << 20  # > 2x the H200's 50 MB L2
MAX_COPIES = 256
MIN_LAUNCHES = 20
REPLAYS = 7
MAX_REL_ERR = 0.02  # bf16 results against fp32 references (attention: against split_rows=256)
WIDTHS = (1, 8, 64)
SPLIT_ROWS = (32, 64, 128, 256)
FIXED_SPLITK = {"splitk_n16_s256": sk.SplitKConfig(block_n=16, split_k=256),
                "splitk_n32_s512": sk.SplitKConfig(block_n=32, split_k=512),
                "splitk_n64_s1024": sk.SplitKConfig(block_n=64, split_k=1024)}


@dataclass(frozen=True)
class Config:
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int


CONFIGS = {"small": Config(1024, 2816, 16, 4, 64), "8b": Config(4096, 14336, 32, 8, 128)}
DRY_CONFIGS = {"dry": Config(64, 96, 4, 2, 16)}
BLOCK_SIZE, TABLE_BLOCKS, LIVE_ROWS = 16, 64, 100


def linear_shapes(c: Config) -> list[tuple[str, int, int, bool]]:
    """(names, weight rows, K, SwiGLU); shapes that repeat (q = o, k = v) are timed once."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    named = [("eh_proj", c.hidden, 2 * c.hidden, False), ("q", q, c.hidden, False),
             ("k", kv, c.hidden, False), ("v", kv, c.hidden, False), ("o", c.hidden, q, False),
             ("gate_up", 2 * c.inter, c.hidden, True), ("down", c.hidden, c.inter, False)]
    merged: dict[tuple[int, int, bool], list[str]] = {}
    for name, rows, k, silu in named:
        merged.setdefault((rows, k, silu), []).append(name)
    return [("/".join(names), rows, k, silu) for (rows, k, silu), names in merged.items()]


# ---- timing ------------------------------------------------------------------------------------
def time_launches(launch: Callable[[int], None], num_launches: int, device: torch.device) -> float:
    """Median us per launch of a graph of `num_launches` calls launch(0..num_launches-1)."""
    if device.type != "cuda":  # dry run: the interpreter, timed directly
        t0 = time.perf_counter()
        for i in range(num_launches):
            launch(i)
        return (time.perf_counter() - t0) * 1e6 / num_launches
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up (cuBLAS handles) outside the capture
        for i in range(min(2, num_launches)):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_launches):
            launch(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_launches)
    del graph
    return statistics.median(times)


def dtype_of(device: torch.device) -> torch.dtype:
    """bf16 on the GPU; fp16 in the dry run (the Triton interpreter gets bf16 wrong)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float16


def copies_for(nbytes: int, dry: bool) -> int:
    return 1 if dry else max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def measure(launch: Callable[[int], None], num_launches: int, nbytes: int, device: torch.device,
            check: Callable[[], float]) -> dict:
    """Time a variant, then check what its last launch (of copy 0) wrote: a fast wrong kernel
    must not win. A result off by more than MAX_REL_ERR is recorded as an error."""
    try:
        us = time_launches(launch, num_launches, device)
        launch(0)
        err = check()
        if not err <= MAX_REL_ERR:
            return {"error": f"wrong result: max error {err:.3g} of the largest value", "us": None}
        return {"us": round(us, 3), "gbps": round(nbytes / (us * 1e3), 1), "rel_err": round(err, 5)}
    except Exception as e:  # recorded, and the sweep goes on (a sticky CUDA error ends it below)
        traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.synchronize()  # raises again if the context is gone: nothing more can run
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


# ---- linears -----------------------------------------------------------------------------------
def linear_variants(x, out, wide, silu: bool, rows: int, k: int) -> dict[str, tuple[Callable, torch.Tensor]]:
    """name -> (launch(weight), the tensor it writes); each split-K variant has its own workspace.
    wide [n, rows]: cuBLAS's gate_up writes the [n, 2I] product only (silu_mul is not timed)."""
    n = x.shape[0]
    plain = linear_silu_mul if silu else linear
    split = sk.linear_silu_mul_splitk if silu else sk.linear_splitk
    default = sk.default_config(rows, k)
    configs = {f"splitk(n{default.block_n},s{default.split_k})": default, **FIXED_SPLITK}
    variants = {"linear": (lambda w: plain(x, w, out), out)}
    for label, cfg in configs.items():
        buf = torch.empty(sk.splitk_workspace_shape(n, rows, k, cfg), dtype=torch.float32, device=x.device)
        variants[label] = (lambda w, cfg=cfg, buf=buf: split(x, w, out, buf, cfg), out)
    variants["cublas"] = (lambda w: torch.matmul(x, w.t(), out=wide if silu else out), wide if silu else out)
    return variants


def sweep_linear(cfg_name: str, c: Config, widths, device, dry: bool, deadline: float) -> list[dict]:
    rows_out = []
    for names, rows, k, silu in linear_shapes(c):
        nbytes = rows * k * 2
        copies = copies_for(nbytes, dry)
        weights = [torch.randn(rows, k, device=device).div_(k ** 0.5).to(dtype_of(device))
                   for _ in range(copies)]
        launches = 2 if dry else max(MIN_LAUNCHES, copies)
        for n in widths:
            x = torch.randn(n, k, device=device).to(dtype_of(device))
            out = torch.empty(n, rows // 2 if silu else rows, dtype=dtype_of(device), device=device)
            wide = torch.empty(n, rows, dtype=dtype_of(device), device=device)
            want_wide = x.float() @ weights[0].float().t()
            want = F.silu(want_wide[:, :rows // 2]) * want_wide[:, rows // 2:] if silu else want_wide
            entry = dict(config=cfg_name, shape=names, rows=rows, k=k, silu=silu, n=n,
                         weight_bytes=nbytes, copies=copies, launches=launches,
                         default=asdict(sk.default_config(rows, k)), variants={})
            for label, (fn, dst) in linear_variants(x, out, wide, silu, rows, k).items():
                if time.perf_counter() > deadline:
                    entry["variants"][label] = {"error": "skipped: past --deadline-s"}
                    continue
                dst.fill_(float("nan"))
                ref = want_wide if dst is wide else want
                entry["variants"][label] = measure(lambda i, fn=fn: fn(weights[i % copies]), launches,
                                                  nbytes, device, lambda dst=dst, ref=ref: rel_err(dst, ref))
            entry["best"] = best_of(entry["variants"])
            print_row(entry)
            rows_out.append(entry)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


# ---- decode attention --------------------------------------------------------------------------
def sweep_attention(cfg_name: str, c: Config, widths, device, dry: bool, deadline: float) -> list[dict]:
    rows_out = []
    d, kvh = c.head_dim, c.kv_heads
    live_blocks = -(-LIVE_ROWS // BLOCK_SIZE)
    for n in widths:
        nbytes = n * LIVE_ROWS * kvh * d * 2 * 2  # K and V rows read, bf16
        copies = copies_for(nbytes, dry)
        launches = 2 if dry else max(MIN_LAUNCHES, copies)
        num_blocks = copies * n * live_blocks + 1
        kc = torch.randn(num_blocks, BLOCK_SIZE, kvh, d, device=device).to(dtype_of(device))
        vc = torch.randn_like(kc)
        # copy i, sequence j: its own live blocks (shuffled); the tail (never read) is block 0
        perm = torch.randperm(num_blocks - 1, device=device).int() + 1
        tables = torch.zeros(copies, n, TABLE_BLOCKS, dtype=torch.int32, device=device)
        tables[:, :, :live_blocks] = perm.view(copies, n, live_blocks)
        live = torch.full((n,), LIVE_ROWS - 1, dtype=torch.int32, device=device)  # L = live + 1
        q = torch.randn(n, c.heads * d, device=device).to(dtype_of(device))
        out = torch.empty_like(q)
        entry = dict(config=cfg_name, shape=f"attention {c.heads}/{kvh}x{d}", n=n, kv_bytes=nbytes,
                     copies=copies, launches=launches, variants={})
        want = torch.empty_like(q)
        decode_attention(q, kc, vc, tables[0], live, want, num_heads=c.heads, num_kv_heads=kvh,
                         head_dim=d, scale=d ** -0.5, row_offset=0)  # the default split size
        for split in SPLIT_ROWS:
            label = f"split_rows={split}"
            if time.perf_counter() > deadline:
                entry["variants"][label] = {"error": "skipped: past --deadline-s"}
                continue
            ws = torch.empty(decode_attention_workspace_shape(n, c.heads, d, TABLE_BLOCKS * BLOCK_SIZE, split),
                             dtype=torch.float32, device=device)

            def launch(i: int, split=split, ws=ws) -> None:
                decode_attention(q, kc, vc, tables[i % copies], live, out, num_heads=c.heads,
                                 num_kv_heads=kvh, head_dim=d, scale=d ** -0.5, row_offset=0,
                                 workspace=ws, split_rows=split)
            out.fill_(float("nan"))
            entry["variants"][label] = measure(launch, launches, nbytes, device, lambda: rel_err(out, want))
        entry["best"] = best_of(entry["variants"])
        print_row(entry)
        rows_out.append(entry)
        del kc, vc
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


# ---- output ------------------------------------------------------------------------------------
def best_of(variants: dict) -> str | None:
    timed = {k: v["us"] for k, v in variants.items() if v.get("us") is not None and "error" not in v}
    return min(timed, key=timed.get) if timed else None


def print_row(e: dict) -> None:
    cells = []
    for label, v in e["variants"].items():
        cells.append(f"{label} ERR" if "error" in v else f"{label} {v['us']:.1f}us {v['gbps']:.0f}GB/s")
    print(f"{e['config']:5s} {e['shape']:24s} n={e['n']:<3d} | " + " | ".join(cells)
          + f" || best {e['best']}", flush=True)


def summary(results: list[dict]) -> None:
    print("\nbest per shape (us at n=" + "/".join(str(w) for w in WIDTHS) + "):")
    by_shape: dict[tuple, list[dict]] = {}
    for e in results:
        by_shape.setdefault((e["config"], e["shape"]), []).append(e)
    for (cfg, shape), es in by_shape.items():
        cells = [f"n={e['n']}: {e['best']} {e['variants'][e['best']]['us']:.1f}us" if e["best"] else
                 f"n={e['n']}: none" for e in es]
        base = [f"{e['variants']['linear'].get('us') or float('nan'):.1f}" for e in es
                if "linear" in e["variants"]]
        print(f"  {cfg:5s} {shape:24s} " + " | ".join(cells)
              + (f"   (linear: {'/'.join(base)}us)" if base else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file (a directory gets tune_kernels.json)")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, n in {1, 3}")
    p.add_argument("--deadline-s", type=float, default=110.0,
                   help="variants not started by then are recorded as skipped")
    p.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    args = p.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.deadline_s
    out_path = os.path.join(args.out, "tune_kernels.json") if os.path.isdir(args.out) else args.out
    device = torch.device("cpu" if args.dry_run else "cuda")
    configs = DRY_CONFIGS if args.dry_run else CONFIGS
    if args.configs:
        configs = {k: configs[k] for k in args.configs.split(",")}
    widths = (1, 3) if args.dry_run else WIDTHS
    import triton
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__, dry_run=args.dry_run,
                  rotate_bytes=ROTATE_BYTES, replays=REPLAYS, linear=[], attention=[])

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - t0, 1)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)

    torch.manual_seed(0)
    try:
        for name, c in configs.items():
            report["attention"] += sweep_attention(name, c, widths, device, args.dry_run, deadline)
            save()
        for name, c in configs.items():
            report["linear"] += sweep_linear(name, c, widths, device, args.dry_run, deadline)
            save()
    finally:
        save()
        summary(report["attention"] + report["linear"])
        print(f"\nwrote {out_path} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
