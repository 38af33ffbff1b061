"""The baseline beside a speculative run: target-only greedy decoding of the same requests, in
the same process, on the same target (same dtype, device, target forward, batch and KV
settings), its outputs checked token for token against the speculative ones.

Speculative greedy decoding must reproduce target-only greedy decoding exactly; a difference
is never a tolerance question but a drafting, acceptance, trimming or catch-up bug, so it is
an `OutputsDifferError` naming the first request and token that differ.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from examples.engine.checkpoints import Checkpoint
from examples.engine.engine import Engine, EngineConfig
from examples.engine.sequence import Request


class OutputsDifferError(RuntimeError):
    """Speculative decoding's output differs from target-only greedy decoding's."""


@dataclass(frozen=True)
class Baseline:
    outputs: list[list[int]]        # generated ids, request order
    generated_tokens: int
    wall_s: float                   # Engine.generate's wall time (what tokens_per_s divides by)
    cpu_s: float = 0.0              # and its process CPU time

    @property
    def tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.wall_s if self.wall_s else None


def run_baseline(checkpoint: Checkpoint, config: EngineConfig, requests: Seq[Request],
                 on_step: Callable[[Engine], None] | None = None) -> Baseline:
    """Target-only greedy over `requests` with `config`'s target settings (speculation off).
    The engine is dropped before returning, and on CUDA its graphs' memory released, so a
    caller can run the next thing in the same process."""
    engine = Engine(checkpoint, dataclasses.replace(config, speculate=False))
    result = engine.generate(requests, on_step=on_step)
    base = Baseline(result.outputs, result.stats.generated, result.stats.wall_s, result.stats.cpu_s)
    del engine, result
    release_device_memory()
    return base


def release_device_memory() -> None:
    """Free what a dropped engine held (its KV pools, arenas, CUDA graphs) before the next one
    allocates: two engines of an 8B-class target at once may not fit."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def check_identical(outputs: Seq[Seq[int]], baseline: Seq[Seq[int]]) -> None:
    """Raise `OutputsDifferError` at the first request whose speculative output is not the
    target-only output, naming the generated token where they part (or the lengths)."""
    if len(outputs) != len(baseline):
        raise OutputsDifferError(f"speculative decoding returned {len(outputs)} outputs, target-only "
                                 f"greedy {len(baseline)}")
    for i, (ours, theirs) in enumerate(zip(outputs, baseline)):
        if list(ours) == list(theirs):
            continue
        j = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        got = ours[j] if j < len(ours) else "the end"
        want = theirs[j] if j < len(theirs) else "the end"
        raise OutputsDifferError(
            f"request {i}: speculative decoding differs from target-only greedy decoding at "
            f"generated token {j}: {got} where the target alone gives {want} ({len(ours)} vs "
            f"{len(theirs)} tokens); speculation must reproduce the target's greedy output "
            f"exactly, so drafting, acceptance, trimming or catch-up is wrong")
