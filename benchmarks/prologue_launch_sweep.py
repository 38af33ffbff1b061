"""Hopper sweep of how the 8B chain's eh_proj split-K prologue runs (issue 15;
kernels.linear_fused_splitk, W [4096, 8192], embedding + two norms + concat). Each candidate is a
`Launch`: the norm pass's loads in flight and, on sm90, the pinned tile's columns / warps /
stages. None of it may change a row's bits: every candidate's output is compared bitwise with
the default Launch()'s (`base`) on the same inputs at every n, and its row 0 with the same
candidate run on that row alone. The fastest bitwise-equal one by its sum at n <= 8 is `best`.

Timing: benchmarks/wide_sweep.py's graph_us, a CUDA graph of its LAUNCHES launches cycling
weight copies past the L2 (ROTATE_BYTES), replayed REPLAYS times, events, median us per launch
(the split-K figures include its reduce).
`plain` is the same weight without a prologue (kernels.linear_splitk's partials + reduce): the
kernel's floor in practice. Candidates are compiled first in --jobs worker processes (Triton's
disk cache); those not started by --deadline-s are skipped. `chain` / `profile` run
benchmarks/draft_chain.py / chain_profile.py with a given Launch: before / after on one machine.

    PYTHONPATH=$PWD python3 -m benchmarks.prologue_launch_sweep --out $OUT/launch_sweep.json
    PYTHONPATH=$PWD python3 -m benchmarks.prologue_launch_sweep chain old --configs 8b ...  # before
    PYTHONPATH=$PWD python3 -m benchmarks.prologue_launch_sweep profile old --configs 8b ...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Callable

if "--dry-run" in sys.argv:  # before triton is imported: its interpreter runs the kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from draft_circuit.kernels import linear_fused_splitk as lfs  # noqa: E402
from draft_circuit.kernels.linear_splitk import linear_splitk, splitk_workspace_shape  # noqa: E402

WIDTHS = (1, 8, 64)
ROTATE_BYTES = 160 << 20  # > 3x the H200's 50 MB L2
H, V = 4096, 128256
DEV = "cuda"
# name -> Launch(norm_groups, block_n, num_warps, num_stages). The 2026-12-06 H100 runs also
# timed the first weight tile loaded before the PDL wait (dropped: slower in every tile tried)
# and q/k/v's kernel with the same levers (none beat its default; not kept)
EH = {
    "base": lfs.Launch(),
    "bn128_w8_s3": lfs.Launch(0, 128, 8, 3), "bn128_w8_s3_g2": lfs.Launch(2, 128, 8, 3),
    "bn128_w8_s3_g1": lfs.Launch(1, 128, 8, 3), "bn128_w8_s2_g2": lfs.Launch(2, 128, 8, 2),
    "bn128_w8_s4": lfs.Launch(0, 128, 8, 4), "bn128_w4_s3": lfs.Launch(0, 128, 4, 3),
    "bn256_w8_s2": lfs.Launch(0, 256, 8, 2), "bn64_w8_s3": lfs.Launch(0, 64, 8, 3),
    "bn64_w4_s3": lfs.Launch(0, 64, 4, 3), "g2": lfs.Launch(2), "w8": lfs.Launch(0, 64, 8),
}


def graph_us(fn: Callable[[int], None]) -> float:
    """Median us per launch of fn(i) (i: the launch's index, picks a weight copy): wide_sweep's
    CUDA-graph timing (its LAUNCHES and REPLAYS); on CPU (--dry-run) the calls' wall time."""
    from benchmarks.wide_sweep import graph_us as timed

    return timed(fn, DEV != "cpu")


class Operands:
    """The 8B shapes' inputs at the widest n (a launch at n takes the first n rows)."""

    def __init__(self, n_max: int) -> None:
        dev, dt = torch.device(DEV), torch.bfloat16 if DEV == "cuda" else torch.float32
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt)  # noqa: E731
        copies = lambda rows, k: [r(rows, k) * k ** -0.5  # noqa: E731
                                  for _ in range(min(8, max(2, ROTATE_BYTES // (rows * k * 2))))]
        self.w_eh = copies(H, 2 * H)
        self.nw1, self.nw2 = 1 + 0.1 * r(H), 1 + 0.1 * r(H)
        self.table = r(V, H)
        self.ids = torch.randint(0, V, (n_max,), generator=g, device=dev, dtype=torch.int32)
        self.x = 2 * r(n_max, H)
        self.x_cat = r(n_max, 2 * H)


def eh_launch(o: Operands, n: int, launch: lfs.Launch | None) -> Callable[[int], torch.Tensor]:
    """fn(i): the eh_proj split-K prologue on weight copy i (`launch`; None: the plain split-K
    on the materialised width, no prologue), into a fresh-per-fn output it returns."""
    out = torch.empty(n, H, dtype=o.x.dtype, device=DEV)
    ws = torch.empty(splitk_workspace_shape(n, H, 2 * H), dtype=torch.float32, device=DEV)

    def fn(i: int) -> torch.Tensor:  # returns out (the bit checks read `fn.outs`)
        w = o.w_eh[i % len(o.w_eh)]
        if launch is None:
            linear_splitk(o.x_cat[:n], w, out, ws)
        else:
            lfs.LAUNCH = launch
            lfs.linear_prologue_splitk(o.table, w, out, ws, ids=o.ids[:n], norm1=o.nw1, eps1=1e-5,
                                       x2=o.x[:n], norm2=o.nw2, eps2=1e-5)
        return out
    fn.outs = [out]  # type: ignore[attr-defined]
    return fn


def candidates() -> list[tuple[str, str, Any]]:
    return [("eh_proj", k, v) for k, v in EH.items()] + [("eh_proj", "plain", None)]


def _precompile(index: int) -> str:
    """A worker: compile candidate `index` into the disk cache (one launch at each width)."""
    kernel, name, launch = candidates()[index]
    o = Operands(max(WIDTHS))
    try:
        for n in WIDTHS:
            eh_launch(o, n, launch)(0)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass
        return f"{kernel}/{name}: {type(e).__name__}: {str(e)[:200]}"


def chain(bench: str, launch: str, argv: list[str]) -> Any:
    """benchmarks/draft_chain.py's (bench "chain") or benchmarks/chain_profile.py's ("profile")
    main(argv) with the eh_proj kernel at `launch`: "old" (the default Launch(), as before issue
    15's change), "new" (the module's LAUNCH as committed) or "best:PATH" (a sweep JSON's pick):
    a before / after pair on one machine, without a second copy of the kernel."""
    from benchmarks import chain_profile, draft_chain
    if launch == "old":
        lfs.LAUNCH = lfs.Launch()
    elif launch.startswith("best:"):  # the fastest bitwise-equal candidates of a sweep's JSON
        with open(launch[5:]) as f:
            swept = json.load(f)
        best = swept.get("eh_proj_best")
        lfs.LAUNCH = lfs.Launch(**swept["eh_proj"][best]["launch"]) if best else lfs.Launch()
    print(f"{bench} with {launch}: {lfs.LAUNCH}", flush=True)
    return (draft_chain if bench == "chain" else chain_profile).main(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("chain", "profile"):  # chain|profile {old,new,best:PATH} [args...]
        return chain(argv[0], argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--precompile-only", action="store_true",
                   help="compile every candidate into the disk cache and stop (run it beside "
                        "another benchmark; the timing run then finds them compiled)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU interpreter, small shapes, a few candidates: the script's logic only")
    args = p.parse_args(argv)
    global WIDTHS, H, V, DEV
    if args.dry_run:
        WIDTHS, H, V, DEV = (1, 3), 256, 300, "cpu"
    t0 = time.perf_counter()
    cands = candidates()
    if args.dry_run:
        cands, errors = [c for c in cands if c[1] in ("base", "bn128_w8_s3_g2", "plain")], []
    else:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            errors = [e for e in pool.map(_precompile, range(len(cands))) if e]
    print(f"precompiled {len(cands)} candidates in {time.perf_counter() - t0:.1f} s; "
          f"errors: {errors}", flush=True)
    if args.precompile_only:
        return {"errors": errors}
    o = Operands(max(WIDTHS))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
                               "errors": errors,
                               "eh_proj": {}}
    want: dict[tuple[str, int], torch.Tensor] = {}
    for kernel, name, launch in cands:
        make = eh_launch
        row: dict[str, Any] = {"launch": dataclasses.asdict(launch) if launch else None}
        for n in WIDTHS:
            if time.perf_counter() - t0 > args.deadline_s:
                row[str(n)] = {"skipped": "deadline"}
                continue
            try:
                fn = make(o, n, launch)
                fn(0)
                out = torch.cat(fn.outs, 1)
                if launch is not None:  # bits: against base (same inputs), row 0 alone
                    if name == "base":
                        want[(kernel, n)] = out
                    same = torch.equal(out, want[(kernel, n)])
                    one = make(o, 1, launch)
                    one(0)
                    alone = torch.equal(torch.cat(one.outs, 1)[0], out[0])
                else:
                    same = alone = None
                us = graph_us(fn)
                row[str(n)] = {"us": us, "same_bits": same, "row_alone": alone}
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                row[str(n)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        results[kernel][name] = row
        cells = "  ".join(f"n={n}: {c['us']:6.1f}{'' if c.get('same_bits') in (True, None) else ' BITS'}"
                          if "us" in c else f"n={n}: {list(c.values())[0]}"[:40]
                          for n, c in ((n, row[str(n)]) for n in WIDTHS))
        print(f"{kernel:8s} {name:20s} {cells}", flush=True)
    lfs.LAUNCH = lfs.Launch()
    for kernel in ("eh_proj",):  # the fastest bitwise-equal candidate by the sum at n <= 8
        ok = {k: r for k, r in results[kernel].items() if k != "plain" and all(
            r.get(str(n), {}).get("same_bits") and r[str(n)].get("row_alone") for n in WIDTHS)}
        if ok:
            best = min(ok, key=lambda k: sum(ok[k][str(n)]["us"] for n in WIDTHS if n <= 8))
            results[kernel + "_best"] = best
            print(f"best {kernel}: {best} " + " ".join(
                f"n={n} {ok[best][str(n)]['us']:.1f} (base {results[kernel]['base'][str(n)]['us']:.1f})"
                for n in WIDTHS), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
