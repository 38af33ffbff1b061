"""`python -m examples.engine`: greedy speculative decoding on a Llama + MTP checkpoint (the
embedded byte-level default without --checkpoint), printing each request's continuation and a
summary. Every bad input is an error before anything is generated (exit status 2)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

import torch

from examples.engine.checkpoints import (EngineError, decode_bytes, default_prompts,
                                         encode_prompts, load_checkpoint, read_prompts)
from examples.engine.engine import Engine, EngineConfig
from examples.engine.report import ProgressBar, format_summary, summary
from examples.engine.sequence import Request


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(sorted({int(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--widths {text!r}: a comma-separated list of ints")
    if not widths or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"--widths {text!r}: widths must be >= 1")
    return widths


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m examples.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="HF-layout directory (default: the embedded tiny model)")
    ap.add_argument("--draft-checkpoint", type=Path,
                    help="directory holding the MTP layer exported at model.layers.0")
    ap.add_argument("--forward", choices=("eager", "circuit"), default="circuit",
                    help="drafter: compiled n-row programs, or the eager oracle")
    ap.add_argument("--num-drafts", type=int, default=4, metavar="K")
    ap.add_argument("--draft-confidence-stop", type=float, metavar="TAU",
                    help="stop a chain after the first draft whose top-1 probability is below "
                         "TAU (0 < TAU < 1)")
    ap.add_argument("--widths", type=_widths, default=(1, 2, 4, 8, 16, 32, 64),
                    help="draft program widths, e.g. 1,2,4,8")
    ap.add_argument("--prompts", type=Path,
                    help="JSON list of strings (byte-level models) or of token-id lists")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="blocks per KV pool (16 rows each)")
    ap.add_argument("--max-rows", type=int, default=1024,
                    help="rows per target pass (a longer prefill runs in chunks)")
    ap.add_argument("--target-forward", choices=("eager", "circuit"),
                    help="target: the eager runner, or compiled programs padded to power-of-two "
                         "row counts (default: circuit on CUDA, eager on CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the ops are small, threads only add waits)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-speculation", action="store_true", help="target-only greedy (the baseline)")
    ap.add_argument("--summary-json", type=Path, help="write the summary and every request's ids here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar and no per-request text")
    ap.add_argument("--progress", action="store_true",
                    help="draw the progress bar even when stderr is not a terminal")
    return ap


def run(args: argparse.Namespace) -> dict:
    checkpoint = load_checkpoint(args.checkpoint, draft_path=args.draft_checkpoint,
                                 with_mtp=not args.no_speculation)
    items = read_prompts(args.prompts) if args.prompts else default_prompts(checkpoint)
    prompts = encode_prompts(items, checkpoint)
    if args.max_new_tokens < 1:
        raise EngineError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.draft_confidence_stop is not None and not 0 < args.draft_confidence_stop < 1:  # NaN too
        raise EngineError(f"--draft-confidence-stop must be in (0, 1) exclusive, got "
                          f"{args.draft_confidence_stop}")
    if args.threads >= 1:
        torch.set_num_threads(args.threads)
    target_forward: Literal["eager", "circuit"] = args.target_forward or (
        "circuit" if args.device.startswith("cuda") else "eager")
    config = EngineConfig(speculate=not args.no_speculation, forward=args.forward,
                          target_forward=target_forward,
                          num_drafts=args.num_drafts, draft_confidence_stop=args.draft_confidence_stop,
                          widths=args.widths, max_batch=args.max_batch, kv_blocks=args.kv_blocks,
                          max_rows=args.max_rows,
                          dtype=getattr(torch, args.dtype), device=args.device)
    engine = Engine(checkpoint, config)
    requests = [Request(p, args.max_new_tokens) for p in prompts]
    show_bar = not args.quiet and (args.progress or sys.stderr.isatty())
    bar = ProgressBar(sum(r.max_new_tokens for r in requests)) if show_bar else None
    result = engine.generate(requests, on_step=bar.update if bar else None)
    if bar:
        bar.close(engine)
    info = summary(engine, result)
    if not args.quiet:
        for i, (req, out) in enumerate(zip(requests, result.outputs)):
            text = (repr(decode_bytes(req.prompt)[-40:]) + " -> " + repr(decode_bytes(out))
                    if checkpoint.byte_level else f"{len(req.prompt)} ids -> {out}")
            print(f"[{i}] {text}")
    print(format_summary(info))
    if args.summary_json:
        info["requests_ids"] = [{"prompt": r.prompt, "generated": o}
                                for r, o in zip(requests, result.outputs)]
        args.summary_json.write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
