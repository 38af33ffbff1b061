"""What the engine shows: a plain-stderr progress bar while it generates, and the summary
(as data for --summary-json, and as the text printed at the end)."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from examples.engine.engine import Engine, Result


class ProgressBar:
    """`[#####.....] 120/512 tokens  4 running  3 waiting  250 tok/s`, redrawn at most 10x a second."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total, self.stream, self.width = max(total, 1), stream, width
        self.start = self.last = time.perf_counter()

    def update(self, engine: Engine, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        done = engine.stats.generated
        filled = self.width * min(done, self.total) // self.total
        rate = done / max(now - self.start, 1e-9)
        sched = engine.scheduler
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                          f"tokens  {len(sched.running)} running  {len(sched.waiting)} waiting  "
                          f"{rate:.0f} tok/s ")
        self.stream.flush()

    def close(self, engine: Engine) -> None:
        self.update(engine, force=True)
        self.stream.write("\n")
        self.stream.flush()


def summary(engine: Engine, result: Result) -> dict:
    s, cfg = result.stats, engine.config
    return {
        "checkpoint": str(engine.checkpoint.path),
        "mode": f"speculative ({cfg.forward} drafting)" if cfg.speculate else "target only",
        "num_drafts": engine.k, "draft_confidence_stop": cfg.draft_confidence_stop,
        "requests": len(result.requests), "max_batch": cfg.max_batch,
        "generated_tokens": s.generated, "wall_s": round(s.wall_s, 3),
        "tokens_per_s": round(s.generated / s.wall_s, 1) if s.wall_s else None,
        "decode_steps": s.steps, "verifies": s.verifies,
        "mean_accepted_per_verify": round(s.accepted / s.verifies, 3) if s.verifies else None,
        "acceptance_rate": round(s.accepted / s.drafted, 3) if s.drafted else None,
        "draft_time_share": round(s.draft_s / s.wall_s, 3) if s.wall_s else None,
        "target_time_share": round(s.target_s / s.wall_s, 3) if s.wall_s else None,
        "batch_widths": {str(n): c for n, c in sorted(s.widths.items())},
        "draft_batches": {str(n): kinds for n, kinds in s.draft_batches.table().items()},
        "proposer_runs": ({kind: {str(n): c for n, c in sorted(per.items())}
                           for kind, per in engine.proposer.stats.items()}
                          if engine.proposer is not None else {}),
    }


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
        for n, kinds in d["draft_batches"].items():
            cells = "  ".join(f"{k} {v}" for k, v in kinds.items())
            lines.append(f"  n={n:>3}: {cells}")
    else:
        lines.append(f"decode steps: {d['decode_steps']}")
    return "\n".join(lines)
