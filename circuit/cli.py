"""The `circuit` command: `circuit plan` compiles the MTP draft chain for a set of widths and
prints the per-width plan table (and writes the report JSON); `circuit viz` renders a report."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from draft_circuit.circuit import cli_args
from draft_circuit.circuit.planner import CompileOptions, CompiledDraft, compile_draft
from draft_circuit.circuit.report import PlanReport, ReportError


# the flags that shape a compile; `circuit viz --report` renders a saved report and takes none
CHAIN_DEFAULTS = {"widths": [1, 2, 4, 8], "num_drafts": 4, "dtype": "bfloat16", "block_size": 16,
                  "max_kv_rows": 1024, "kv_rows": 100, "bandwidth_gbps": 4800.0, "device": "cuda"}


def add_chain_args(p: argparse.ArgumentParser) -> None:
    """Defaults are filled in after parsing (`fill_chain_defaults`), so a flag given alongside
    `--report` can be told apart from a default and refused."""
    p.add_argument("--checkpoint", type=Path, help="HF-layout checkpoint dir (default: embedded)")
    p.add_argument("--widths", type=cli_args.widths, help="comma-separated, default 1,2,4,8")
    p.add_argument("--num-drafts", type=cli_args.int_in(1, cli_args.MAX_NUM_DRAFTS, "--num-drafts"),
                   help="default 4")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default bfloat16")
    p.add_argument("--block-size", type=cli_args.int_in(1, 4096, "--block-size"), help="default 16")
    p.add_argument("--max-kv-rows", type=cli_args.int_in(1, None, "--max-kv-rows"),
                   help="drafter-KV rows a sequence may hold (default 1024)")
    p.add_argument("--kv-rows", type=cli_args.int_in(0, None, "--kv-rows"),
                   help="live rows assumed by the cost model (default 100)")
    p.add_argument("--bandwidth-gbps", type=cli_args.positive_float("--bandwidth-gbps"),
                   help="for the floor time (default 4800, the H200's datasheet)")
    p.add_argument("--device", type=cli_args.device,
                   help="the device kernels are chosen for (default cuda: a plan needs no GPU)")
    p.add_argument("--draft-vocab", metavar="N|FILE",
                   help="draft over a reduced vocabulary: its N most frequent ids, or a token "
                        "list (.json, .pt, .npy; circuit/layers/draft_vocab.py)")


def fill_chain_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    given = [k for k in (*CHAIN_DEFAULTS, "draft_vocab") if getattr(args, k, None) is not None]
    if getattr(args, "report", None) is not None and (given or args.checkpoint is not None):
        flags = ", ".join("--" + k.replace("_", "-") for k in given + (["checkpoint"] if
                                                                       args.checkpoint else []))
        parser.error(f"--report renders a saved plan; {flags} only apply when compiling one")
    for k, v in CHAIN_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.num_drafts > args.max_kv_rows:
        parser.error(f"--num-drafts {args.num_drafts} writes more drafter rows than "
                     f"--max-kv-rows {args.max_kv_rows} holds")


def compile_chain(args: argparse.Namespace) -> CompiledDraft:
    """The MTP chain of the checkpoint (or the embedded default) compiled for the widths, through
    the head the checkpoint describes (dense, or MoE with its plan notes). The params are
    shape-only (meta) tensors of the chain's own param dtypes: a plan needs no values."""
    from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
    from draft_circuit.circuit.layers.heads import describe_head, head_for, load_head
    from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain

    # a checkpoint is loaded (and so validated, every refusal applied) to choose its head
    head = load_head(args.checkpoint, args.dtype)[0] if args.checkpoint else head_for(DEFAULT_CONFIG, args.dtype)
    blocks = math.ceil(args.max_kv_rows / args.block_size)
    max_width = max(args.widths)
    kv = KvLayout(num_blocks=max_width * blocks + 1, block_size=args.block_size,
                  max_blocks_per_seq=blocks)
    chain = emit_draft_chain(head, args.num_drafts, max_width=max_width, kv=kv,
                             draft_vocab=_draft_vocab_size(getattr(args, "draft_vocab", None),
                                                           head.config.vocab_size))
    params = {v.name: torch.empty([int(d) for d in v.shape], device="meta", dtype=getattr(torch, v.dtype))
              for v in chain.values if v.kind == "param"}
    options = CompileOptions(kv_rows=args.kv_rows, bandwidth_gbps=args.bandwidth_gbps)
    return compile_draft(chain, params, args.widths, device=args.device, options=options,
                         notes={"head": describe_head(head), **head.plan_notes()})


def _draft_vocab_size(text: str | None, vocab_size: int) -> int | None:
    """--draft-vocab: an id count, or a token list whose size is the count (a plan needs no ids)."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    from draft_circuit.circuit.layers.draft_vocab import load_draft_vocab
    return load_draft_vocab(Path(text), vocab_size).size


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
    print(f"head: {report.notes.get('head', 'unknown')}")
    print(format_table(report))
    if args.json:
        args.json.write_text(report.to_json())
        print(f"report written to {args.json}")
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from draft_circuit.circuit.viz import write_all
    report = PlanReport.read(args.report) if args.report else compile_chain(args).report()
    try:
        paths = write_all(report, args.out)
    except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        # schema-valid but self-inconsistent (a schedule naming a node the report lacks, say)
        raise ReportError(f"{args.report or 'the plan'}: inconsistent plan report, cannot render "
                          f"it ({type(e).__name__}: {e})") from None
    for path in paths:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="circuit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="compile the draft chain and print the per-width plan")
    add_chain_args(plan)
    plan.add_argument("--json", type=cli_args.writable_file, help="write the plan report here")
    plan.set_defaults(func=cmd_plan)
    viz = sub.add_parser("viz", help="write plan.html, circuit.dot and schedule.json")
    add_chain_args(viz)
    viz.add_argument("--report", type=Path, help="render this report JSON instead of compiling")
    viz.add_argument("--out", type=Path, required=True)
    viz.set_defaults(func=cmd_viz)
    args = parser.parse_args(argv)
    fill_chain_defaults(sub.choices[args.command], args)
    try:
        rc: int = args.func(args)
        return rc
    except (ValueError, OSError) as e:  # typed project errors are ValueErrors: one clear line
        print(f"circuit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
