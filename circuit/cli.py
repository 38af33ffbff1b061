"""The `circuit` command: `circuit plan` compiles the MTP draft chain for a set of widths and
prints the per-width plan table (and writes the report JSON); `circuit viz` renders a report."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from draft_circuit.circuit.planner import CompileOptions, CompiledDraft, compile_draft
from draft_circuit.circuit.report import PlanReport


def parse_widths(text: str) -> list[int]:
    try:
        widths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"widths must be comma-separated ints, got {text!r}")
    if not widths or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return widths


def add_chain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, help="HF-layout checkpoint dir (default: embedded)")
    p.add_argument("--widths", type=parse_widths, default=[1, 2, 4, 8])
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-kv-rows", type=int, default=1024, help="drafter-KV rows a sequence may hold")
    p.add_argument("--kv-rows", type=int, default=100, help="live rows assumed by the cost model")
    p.add_argument("--bandwidth-gbps", type=float, default=4800.0, help="for the floor time")
    p.add_argument("--device", default="cuda", help="the device kernels are chosen for")


def compile_chain(args: argparse.Namespace) -> CompiledDraft:
    """The MTP chain of the checkpoint (or the embedded default) compiled for the widths.
    Without a checkpoint the params are shape-only (meta) tensors: a plan needs no values."""
    from draft_circuit.circuit.layers.checkpoint import load_mtp_weights
    from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain

    # a checkpoint is loaded (and so validated) for its config; the plan needs only shapes
    config = load_mtp_weights(args.checkpoint)[0] if args.checkpoint else DEFAULT_CONFIG
    head = MtpHead(config, args.dtype)
    blocks = math.ceil(args.max_kv_rows / args.block_size)
    max_width = max(args.widths)
    kv = KvLayout(num_blocks=max_width * blocks + 1, block_size=args.block_size,
                  max_blocks_per_seq=blocks)
    chain = emit_draft_chain(head, args.num_drafts, max_width=max_width, kv=kv)
    params = {k: torch.empty(s, device="meta", dtype=getattr(torch, args.dtype))
              for k, s in head.param_shapes().items()}
    options = CompileOptions(kv_rows=args.kv_rows, bandwidth_gbps=args.bandwidth_gbps)
    return compile_draft(chain, params, args.widths, device=args.device, options=options)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 2**10:.1f}"


def format_table(report: PlanReport) -> str:
    rows = [("width", "launches", "per step", "arena KiB", "lower KiB", "naive KiB",
             "arena/lower", "moved KiB", "floor us")]
    for w in report.widths:
        rows.append((str(w.width), str(w.launches), f"{w.launches_per_step:g}",
                     _kib(w.arena_bytes), _kib(w.lower_bound_bytes), _kib(w.naive_bytes),
                     f"{w.arena_bytes / max(w.lower_bound_bytes, 1):.3f}", _kib(w.bytes_moved),
                     f"{w.floor_us:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
    head = (f"{report.circuit}: {report.num_nodes_before} nodes -> {report.num_nodes_after} after "
            f"{', '.join(report.pipeline)}; shared arena {_kib(report.arena_bytes)} KiB")
    return "\n".join([head, *lines])


def cmd_plan(args: argparse.Namespace) -> int:
    report = compile_chain(args).report()
    print(format_table(report))
    if args.json:
        args.json.write_text(report.to_json())
        print(f"report written to {args.json}")
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from draft_circuit.circuit.viz import write_all
    report = PlanReport.from_json(args.report.read_text()) if args.report else \
        compile_chain(args).report()
    for path in write_all(report, args.out):
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="circuit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compile the draft chain and print the per-width plan")
    add_chain_args(plan)
    plan.add_argument("--json", type=Path, help="write the plan report here")
    plan.set_defaults(func=cmd_plan)
    viz = sub.add_parser("viz", help="write plan.html, circuit.dot and schedule.json")
    add_chain_args(viz)
    viz.add_argument("--report", type=Path, help="render this report JSON instead of compiling")
    viz.add_argument("--out", type=Path, required=True)
    viz.set_defaults(func=cmd_viz)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # typed project errors are ValueErrors: one clear line
        print(f"circuit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
