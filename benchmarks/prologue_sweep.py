"""H200 sweep of the norm-prologue kernels' one free knob (issue 15): the chunk width of the
row-norm pass (`NORM_BLOCK_K`, which changes only the order of that fp32 sum, never a row's
dependence on n), at the 8B shapes, against the same kernel without a norm (its floor in
practice). Also the split-K prologue linear where kernels.linear_fused_splitk exists.

Timing: a CUDA graph of 20 launches replayed 10 times; median us per launch.

    PYTHONPATH=$PWD python3 -m benchmarks.prologue_sweep --out $OUT/prologue_sweep.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch

from draft_circuit.kernels import argmax_logprob as am
from draft_circuit.kernels import linear_fused as lf


def graph_us(fn: Callable[[], None], launches: int = 20, replays: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, I, V = 4096, 14336, 128256
    r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt)  # noqa: E731
    W_lm, W_eh, W_gu = r(V, H) * H ** -0.5, r(H, 2 * H) * (2 * H) ** -0.5, r(2 * I, H) * H ** -0.5
    W_q, W_k, W_v = r(4096, H) * H ** -0.5, r(1024, H) * H ** -0.5, r(1024, H) * H ** -0.5
    nw = 1 + 0.1 * r(H)
    table = r(V, H)
    out: dict[str, dict[str, float]] = {}
    for n in (1, 8, 64):
        x = r(n, H)
        ids = torch.randint(0, V, (n,), generator=g, device=dev, dtype=torch.int32)
        tok = torch.empty(n, dtype=torch.int32, device=dev)
        lp = torch.empty(n, dtype=torch.float32, device=dev)
        ws = torch.empty(am.linear_argmax_workspace_shape(n, V), dtype=torch.float32, device=dev)
        o_eh, o_gu = torch.empty(n, H, dtype=dt, device=dev), torch.empty(n, I, dtype=dt, device=dev)
        o_q, o_k, o_v = (torch.empty(n, w.shape[0], dtype=dt, device=dev) for w in (W_q, W_k, W_v))
        row: dict[str, float] = {}
        row["lm_head_no_norm"] = graph_us(lambda: am.linear_argmax_logprob(x, W_lm, tok, lp, None, ws))
        for nb in (64, 128, 256):
            am.LINEAR_NORM_BLOCK_K = nb
            row[f"lm_head_norm_nb{nb}"] = graph_us(
                lambda: am.linear_argmax_logprob(x, W_lm, tok, lp, None, ws, norm_weight=nw, eps=1e-5))
        am.LINEAR_NORM_BLOCK_K = 64
        row["gate_up_no_norm"] = graph_us(lambda: lf.linear_prologue(x, W_gu, o_gu, silu_mul=True))
        for nb in (128, 256, 512):
            lf.NORM_BLOCK_K = nb
            row[f"eh_proj_nb{nb}"] = graph_us(lambda: lf.linear_prologue(
                table, W_eh, o_eh, ids=ids, norm1=nw, eps1=1e-5, x2=x, norm2=nw, eps2=1e-5))
            row[f"gate_up_nb{nb}"] = graph_us(lambda: lf.linear_prologue(
                x, W_gu, o_gu, norm1=nw, eps1=1e-5, silu_mul=True))
            row[f"qkv_nb{nb}"] = graph_us(lambda: lf.rmsnorm_linear_qkv(
                x, nw, 1e-5, (W_q, W_k, W_v), (o_q, o_k, o_v)))
        lf.NORM_BLOCK_K = lf.BLOCK_K
        try:
            from draft_circuit.kernels import linear_fused_splitk as lfs
            from draft_circuit.kernels.linear_splitk import splitk_workspace_shape
            wsk = torch.empty(splitk_workspace_shape(n, H, 2 * H), dtype=torch.float32, device=dev)
            row["eh_proj_splitk"] = graph_us(lambda: lfs.linear_prologue_splitk(
                table, W_eh, o_eh, wsk, ids=ids, norm1=nw, eps1=1e-5, x2=x, norm2=nw, eps2=1e-5))
        except Exception as e:  # noqa: BLE001 - a missing or failing variant is a result
            row["eh_proj_splitk_error"] = str(e)[:300]  # type: ignore[assignment]
        out[str(n)] = row
        print(n, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
