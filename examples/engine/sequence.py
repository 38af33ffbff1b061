"""A request and the sequence the engine decodes for it: tokens, target KV table, drafter state.

Invariant between steps: the target's KV holds rows for every token but the last
(`num_cached == len(tokens) - 1`); the last token waits to be verified, and `hidden` is the
target's final-norm hidden that produced it (what the MTP head drafts from).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from draft_circuit.runners.kv_cache import SequenceBlocks


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass(eq=False)  # identity: a sequence is one running request, never equal to another
class Sequence:
    id: int
    request: Request
    blocks: SequenceBlocks                 # the target's KV rows of this sequence
    tokens: list[int] = field(default_factory=list)
    draft_state: Any = None                # the proposer's state (None without speculation)
    hidden: torch.Tensor | None = None     # [H]: the hidden that produced tokens[-1]
    finished: bool = False

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt)

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt)

    @property
    def num_cached(self) -> int:
        return self.blocks.num_rows

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def position(self) -> int:
        """The 0-based position of the last token."""
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_generated(self) -> int:
        """len(generated), without copying the tokens."""
        return len(self.tokens) - len(self.request.prompt)

    def append(self, new: list[int], eos: int | None) -> list[int]:
        """Append what a step produced, cut at max_new_tokens or after an EOS; returns the kept
        tokens (a speculative step may produce more than the request still wants)."""
        room = self.request.max_new_tokens - self.num_generated
        kept = new[:room]
        if eos is not None and eos in kept:
            kept = kept[:kept.index(eos) + 1]
            self.finished = True
        self.tokens += kept
        self.finished |= len(kept) >= room
        return kept
