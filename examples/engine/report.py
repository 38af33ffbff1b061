"""What the engine shows: a plain-stderr progress bar while it generates, and the summary
(as data for --summary-json, and as the text printed at the end)."""
from __future__ import annotations

import sys
from typing import TextIO

from examples.engine.compare import Baseline
from examples.engine.engine import Engine, Result
from examples.engine.speculate import DraftStats


class ProgressBar:
    """tqdm over generated tokens, with the scheduler's running / waiting counts and tok/s."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, desc: str = "generating") -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=max(total, 1), unit="tok", file=stream, mininterval=0.1,
                         dynamic_ncols=True, desc=desc)
        self._done = 0

    def update(self, engine: Engine, force: bool = False) -> None:
        done = min(engine.stats.generated, self._bar.total)
        sched = engine.scheduler
        self._bar.set_postfix(running=len(sched.running), waiting=len(sched.waiting),
                              refresh=force)
        self._bar.update(done - self._done)
        self._done = done

    def close(self, engine: Engine) -> None:
        self.update(engine, force=True)
        self._bar.close()

    def close_at(self, done: int) -> None:
        """Close at `done` tokens (the engine that generated them is gone)."""
        self._bar.update(min(done, self._bar.total) - self._done)
        self._bar.close()


def summary(engine: Engine, result: Result) -> dict:
    s, cfg = result.stats, engine.config
    return {
        "checkpoint": str(engine.checkpoint.path),
        "mode": f"speculative ({cfg.forward} drafting)" if cfg.speculate else "target only",
        "num_drafts": engine.k, "draft_confidence_stop": cfg.draft_confidence_stop,
        "requests": len(result.requests), "max_batch": cfg.max_batch,
        "generated_tokens": s.generated, "wall_s": round(s.wall_s, 3), "cpu_s": round(s.cpu_s, 3),
        "tokens_per_s": round(s.generated / s.wall_s, 1) if s.wall_s else None,
        "decode_steps": s.steps, "verifies": s.verifies,
        "mean_accepted_per_verify": round(s.accepted / s.verifies, 3) if s.verifies else None,
        "acceptance_rate": round(s.accepted / s.drafted, 3) if s.drafted else None,
        "draft_time_share": round(s.draft_s / s.wall_s, 3) if s.wall_s else None,
        "target_time_share": round(s.target_s / s.wall_s, 3) if s.wall_s else None,
        "batch_widths": {str(n): c for n, c in sorted(s.widths.items())},
        "draft_batches": {str(n): kinds for n, kinds in s.draft_batches.table().items()},
        # of them, drafted ahead (at a step's end, or before its verify was read) and unused:
        # a sequence finished or one was admitted after they were proposed
        "withdrawn_batches": {str(n): c for n, c in sorted(_per_width(s.draft_batches.withdrawn).items())},
        # and drafted ahead for sequences of which some finished: the rest's rows verified
        "narrowed_batches": {str(n): c for n, c in sorted(_narrowed(s.draft_batches).items())},
        "proposer_runs": ({kind: {str(n): c for n, c in sorted(per.items())}
                           for kind, per in engine.proposer.stats.items()}
                          if engine.proposer is not None else {}),
    }


def _narrowed(d: DraftStats) -> dict[int, int]:
    """Batches narrowed to their unfinished sequences, by the width they were drafted at."""
    out: dict[int, int] = {}
    for per in d.narrowed.values():
        for (n, _), c in per.items():
            out[n] = out.get(n, 0) + c
    return out


def _per_width(by_kind: dict[str, dict[int, int]]) -> dict[int, int]:
    """Counts by kind and width, summed over kinds."""
    out: dict[int, int] = {}
    for per in by_kind.values():
        for n, c in per.items():
            if c:
                out[n] = out.get(n, 0) + c
    return out


def baseline_fields(info: dict, base: Baseline) -> dict:
    """The summary's baseline: target-only greedy on the same requests in the same process
    (outputs checked identical before this is called), and speculation's speedup over it: in
    tokens/s (wall time), and in process CPU time (`cpu_speedup`: on a CPU shared with other
    work the steadier of the two; on a GPU it counts the host's work only)."""
    tps = round(base.tokens_per_s, 1) if base.tokens_per_s is not None else None
    spec, cpu = info.get("tokens_per_s"), info.get("cpu_s")
    return {"baseline": {"mode": "target only", "generated_tokens": base.generated_tokens,
                         "wall_s": round(base.wall_s, 3), "cpu_s": round(base.cpu_s, 3),
                         "tokens_per_s": tps},
            "speedup": round(spec / tps, 3) if spec and tps else None,
            "cpu_speedup": round(base.cpu_s / cpu, 3) if cpu and base.cpu_s else None,
            "outputs_identical": True}


def _fmt(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    """A rate or share as text; None (nothing drafted, no time measured) is "n/a", never a crash."""
    return "n/a" if value is None else format(scale * value, spec)


def format_summary(d: dict) -> str:
    """The summary as text. Every rate may be None (nothing drafted, every chain stopped early, a
    zero wall time): it prints as n/a."""
    lines = [f"{d['mode']}: {d['requests']} requests, {d['generated_tokens']} tokens in "
             f"{d['wall_s']:.2f} s = {_fmt(d['tokens_per_s'], '.1f')} tokens/s "
             f"(max batch {d['max_batch']})"]
    if d["verifies"]:
        lines.append(f"mean accepted drafts per verify: {_fmt(d['mean_accepted_per_verify'])} of "
                     f"k={d['num_drafts']} (acceptance rate {_fmt(d['acceptance_rate'])}, "
                     f"{d['verifies']} verifies in {d['decode_steps']} steps)")
        lines.append(f"draft time share: {_fmt(d['draft_time_share'], '.1f', 100)}%  "
                     f"(target {_fmt(d['target_time_share'], '.1f', 100)}%)")
        lines.append("drafting batches by width (own program / padded / split / per sequence):")
        withdrawn = d.get("withdrawn_batches", {})
        narrowed = d.get("narrowed_batches", {})
        for n, kinds in d["draft_batches"].items():
            cells = "  ".join(f"{k} {v}" for k, v in kinds.items())
            unused = f"  ({withdrawn[n]} withdrawn unused)" if withdrawn.get(n) else ""
            fewer = f"  ({narrowed[n]} verified for fewer sequences)" if narrowed.get(n) else ""
            lines.append(f"  n={n:>3}: {cells}{unused}{fewer}")
    else:
        lines.append(f"decode steps: {d['decode_steps']}")
    if "baseline" in d:
        b = d["baseline"]
        lines.append(f"target only (same prompts, same process): {b['generated_tokens']} tokens in "
                     f"{b['wall_s']:.2f} s = {_fmt(b['tokens_per_s'], '.1f')} tokens/s; outputs "
                     f"identical; speedup {_fmt(d['speedup'])}x (in CPU time "
                     f"{_fmt(d.get('cpu_speedup'))}x)")
    return "\n".join(lines)
