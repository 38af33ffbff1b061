"""`python -m examples.engine`: greedy speculative decoding on a Llama + MTP checkpoint (the
embedded byte-level default without --checkpoint), printing each request's continuation and a
summary. A speculative run is followed by the baseline (target-only greedy on the same prompts,
in this process; `--no-compare` skips it): the summary gives both tokens/s and the speedup, and
outputs that differ are one `error:` line, exit status 1 (`OutputsDifferError`). Every bad input
is one `error:` line before anything is loaded or generated (exit status 2): flags by their
argparse types (circuit/cli_args.py) and the checks in `check_args`, checkpoints and prompts by
`EngineError`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

import torch

from draft_circuit.circuit.cli_args import (DEFAULT_WIDTHS, MAX_NUM_DRAFTS, device, int_in,
                                             require_usable_device, widths, writable_file)
from draft_circuit.circuit.layers.draft_vocab import DraftVocab
from examples.engine.checkpoints import (Checkpoint, EngineError, decode_bytes, default_prompts, draft_vocab_for,
                                         encode_prompts, load_checkpoint, read_prompts)
from examples.engine.compare import OutputsDifferError, check_identical, release_device_memory, run_baseline
from examples.engine.engine import Engine, EngineConfig
from examples.engine.runner import NonFiniteLogitsError
from examples.engine.report import ProgressBar, baseline_fields, format_summary, summary
from examples.engine.sequence import Request
from examples.engine.tp import start as start_tp


# the engine drafts at most --max-batch sequences at once, and every width is a compiled program
# (a CUDA graph on a GPU): a width past max(--max-batch, the largest default) never runs
ENGINE_MAX_WIDTH = max(DEFAULT_WIDTHS)

# --num-drafts when not given, by device (issue 20). On a GPU the verify's k + 1 rows share one
# pass over the weights, so k = 4 (the drafter's chain is the cost). On CPU a row costs: the
# references' linears run in 8-row tiles and attention in 4-row query tiles (ops/row_invariant.py),
# and each draft step is ~1.15 ms of a ~14 ms target decode pass. Measured on the embedded
# default (the quick start, 2-core CPU, interleaved in one process): at batch 4 k = 3 verifies 16
# rows (2 linear tiles, no padding) for 2.00 accepted drafts, k = 4 verifies 20 (3 tiles, padded)
# for 2.36; benchmarks/quickstart_cpu.py --versus "--num-drafts 4", 8 repeats: median 1.51x
# target-only tokens/s at k = 3 against 1.43x at k = 4. A sweep of k = 2..8 (wall, one process):
# 1.29, 1.42, 1.36, 1.25, 1.25, 1.23, 1.19x. A confidence stop saves verify rows, not chain
# steps, and did not pay (k = 3 or 4 with tau 0.3-0.5). tests/examples/test_engine_defaults.py.
DEFAULT_NUM_DRAFTS = {"cpu": 3, "cuda": 4}


def default_num_drafts(device: str) -> int:
    """--num-drafts for `device` ("cpu", "cuda", "cuda:N") when the flag is not given."""
    return DEFAULT_NUM_DRAFTS["cpu" if device == "cpu" else "cuda"]


def _num_drafts(text: str) -> int:
    """1..MAX_NUM_DRAFTS: the chain unrolls one step per draft, so its compile time, arena and
    drafter-KV rows per sequence grow with k."""
    value = int_in(1, None, "--num-drafts")(text)
    if value > MAX_NUM_DRAFTS:
        raise argparse.ArgumentTypeError(
            f"--num-drafts must be <= {MAX_NUM_DRAFTS}, got {value}: the draft chain unrolls one "
            f"step per draft, so compile time and the plan's arena grow with it")
    return value


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks that need more than one flag or the machine; `ap.error` (exit 2) before any work."""
    try:
        require_usable_device(args.device)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    bound = max(ENGINE_MAX_WIDTH, args.max_batch)
    if max(args.widths) > bound:
        ap.error(f"--widths: width {max(args.widths)} is past {bound}: the engine drafts at most "
                 f"--max-batch {args.max_batch} sequences at once (and {ENGINE_MAX_WIDTH} is the "
                 f"largest default width), and every width is a compiled program, so it would "
                 f"never run; give widths <= {bound} or raise --max-batch")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m examples.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path,
                    help="HF-layout directory (default: the embedded byte-level model, "
                         "examples/data/pystdlib_12l)")
    ap.add_argument("--draft-checkpoint", type=Path,
                    help="drafter directory: an MTP layer exported at model.layers.0, or an EAGLE-3 "
                         "drafter (config.json: LlamaForCausalLMEagle3), told apart by its config")
    ap.add_argument("--draft-vocab", metavar="FILE|N",
                    help="draft over a subset of the vocabulary: a token list (.json, .pt, .npy; most "
                         "frequent first), or N, the N most frequent ids of --draft-vocab-corpus "
                         "(the byte-level default: its training text)")
    ap.add_argument("--draft-vocab-corpus", type=Path, metavar="FILE",
                    help="token ids (.json, .pt, .npy) that --draft-vocab N counts")
    ap.add_argument("--forward", choices=("eager", "circuit"), default="circuit",
                    help="drafter: compiled n-row programs, or the eager oracle")
    ap.add_argument("--num-drafts", type=_num_drafts, metavar="K",
                    help=f"drafts per chain, 1..{MAX_NUM_DRAFTS} (default: "
                         f"{DEFAULT_NUM_DRAFTS['cpu']} on CPU, {DEFAULT_NUM_DRAFTS['cuda']} on "
                         "CUDA, where the verify's rows cost little)")
    ap.add_argument("--draft-confidence-stop", type=float, metavar="TAU",
                    help="stop a chain after the first draft whose top-1 probability is below "
                         "TAU (0 < TAU < 1)")
    ap.add_argument("--widths", type=widths, default=DEFAULT_WIDTHS,
                    help=f"draft program widths, e.g. 1,2,4,8 (each <= max({ENGINE_MAX_WIDTH}, "
                         "--max-batch))")
    ap.add_argument("--prompts", type=Path,
                    help="JSON list of strings (byte-level models) or of token-id lists")
    ap.add_argument("--max-new-tokens", type=int_in(1, None, "--max-new-tokens"), default=64)
    ap.add_argument("--max-batch", type=int_in(1, None, "--max-batch"), default=4)
    ap.add_argument("--kv-blocks", type=int_in(2, None, "--kv-blocks"), default=1024,
                    help="blocks per KV pool (16 rows each; block 0 is the scratch block, so >= 2)")
    ap.add_argument("--max-rows", type=int_in(1, None, "--max-rows"), default=1024,
                    help="rows per target pass (a longer prefill runs in chunks)")
    ap.add_argument("--target-forward", choices=("eager", "circuit"),
                    help="target: the eager runner, or compiled programs padded to power-of-two "
                         "row counts (default: circuit on CUDA, eager on CPU)")
    ap.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int_in(1, None, "--threads"), default=1,
                    help="torch CPU threads (default 1: the ops are small, threads only add waits)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-speculation", action="store_true", help="target-only greedy (the baseline)")
    ap.add_argument("--draft-before-read", action=argparse.BooleanOptionalAction, default=None,
                    help="on the device path (CUDA), launch each step's draft side behind its "
                         "verify before reading it (accepted counts on the device; "
                         "MtpProposer.step_ahead); default on, --no-draft-before-read reads "
                         "each verify first")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                    help="before the first request, generate for a few dummy ones and forget "
                         "them, so the first request does not pay the process's one-time work "
                         "(default: on CUDA only; Engine.warm_up)")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="after a speculative run, run target-only greedy on the same prompts in "
                         "this process, check the outputs are identical (exit 1 if not) and report "
                         "both tokens/s and the speedup (default: on; --no-compare skips it)")
    ap.add_argument("--tp", type=int_in(1, None, "--tp"), default=1,
                    help="tensor-parallel ranks: run under torchrun --nproc-per-node N (rank 0 prints)")
    ap.add_argument("--summary-json", type=writable_file, help="write the summary and every request's ids here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar and no per-request text")
    ap.add_argument("--progress", action="store_true",
                    help="draw the progress bar even when stderr is not a terminal")
    return ap


def engine_config(args: argparse.Namespace, draft_vocab: DraftVocab | None = None) -> EngineConfig:
    """The engine's settings from the command line (`parser`'s arguments, checked)."""
    target_forward: Literal["eager", "circuit"] = args.target_forward or (
        "circuit" if args.device.startswith("cuda") else "eager")
    return EngineConfig(speculate=not args.no_speculation, forward=args.forward,
                        target_forward=target_forward,
                        num_drafts=args.num_drafts if args.num_drafts is not None
                        else default_num_drafts(args.device),
                        draft_confidence_stop=args.draft_confidence_stop,
                        widths=args.widths, max_batch=args.max_batch, kv_blocks=args.kv_blocks,
                        max_rows=args.max_rows,
                        dtype=getattr(torch, args.dtype), device=args.device,
                        draft_vocab=draft_vocab, tp=args.tp, warm_up=args.warm_up)


def prompts_for(args: argparse.Namespace, checkpoint: Checkpoint) -> list[list[int]]:
    """The run's prompts as checked token ids: --prompts, else the checkpoint's defaults."""
    items = read_prompts(args.prompts) if args.prompts else default_prompts(checkpoint)
    return encode_prompts(items, checkpoint)


def run(args: argparse.Namespace) -> dict:
    silent = args.tp > 1 and start_tp(args.tp, args.device) != 0  # under torchrun rank 0 reports
    if silent:
        args.quiet, args.summary_json, args.progress = True, None, False
    checkpoint = load_checkpoint(args.checkpoint, draft_path=args.draft_checkpoint,
                                 with_mtp=not args.no_speculation, tp=args.tp)  # --tp: its slices alone
    prompts = prompts_for(args, checkpoint)
    if args.max_new_tokens < 1:
        raise EngineError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.draft_confidence_stop is not None and not 0 < args.draft_confidence_stop < 1:  # NaN too
        raise EngineError(f"--draft-confidence-stop must be in (0, 1) exclusive, got "
                          f"{args.draft_confidence_stop}")
    vocab = draft_vocab_for(args.draft_vocab, checkpoint, args.draft_vocab_corpus) \
        if args.draft_vocab is not None and not args.no_speculation else None
    torch.set_num_threads(args.threads)
    config = engine_config(args, vocab)
    engine = Engine(checkpoint, config)
    if args.draft_before_read is not None:
        engine.draft_before_read = args.draft_before_read
    requests = [Request(p, args.max_new_tokens) for p in prompts]
    show_bar = not args.quiet and (args.progress or sys.stderr.isatty())
    bar = ProgressBar(sum(r.max_new_tokens for r in requests)) if show_bar else None
    result = engine.generate(requests, on_step=bar.update if bar else None)
    if bar:
        bar.close(engine)
    info = summary(engine, result)
    if config.speculate and args.compare:
        del engine  # its pools and graphs go before the baseline's are allocated
        release_device_memory()
        bar = ProgressBar(sum(r.max_new_tokens for r in requests), desc="baseline") if show_bar else None
        base = run_baseline(checkpoint, config, requests, on_step=bar.update if bar else None)
        if bar:
            bar.close_at(base.generated_tokens)
        check_identical(result.outputs, base.outputs)
        info.update(baseline_fields(info, base))
    if not args.quiet:
        for i, (req, out) in enumerate(zip(requests, result.outputs)):
            text = (repr(decode_bytes(req.prompt)[-40:]) + " -> " + repr(decode_bytes(out))
                    if checkpoint.byte_level else f"{len(req.prompt)} ids -> {out}")
            print(f"[{i}] {text}")
    if args.summary_json:  # first: the results are kept even if printing fails
        saved = {**info, "requests_ids": [{"prompt": r.prompt, "generated": o}
                                          for r, o in zip(requests, result.outputs)]}
        args.summary_json.write_text(json.dumps(saved, indent=1) + "\n")
    if not silent:
        print(format_summary(info))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLogitsError, OutputsDifferError) as e:  # found while generating: nothing
        print(f"error: {e}", file=sys.stderr)                 # is printed or saved
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
