"""A request and the sequence the engine decodes for it: tokens, target KV table, drafter state.

Invariant between steps: the target's KV holds rows for every token but the last
(`num_cached == len(tokens) - 1`); the last token waits to be verified, and `hidden` is the
target's final-norm hidden that produced it (what the MTP head drafts from).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from draft_circuit.runners.kv_cache import PaddedBlocks


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass(eq=False)  # identity: a sequence is one running request, never equal to another
class Sequence:
    id: int
    request: Request
    blocks: PaddedBlocks                   # the target's KV rows of this sequence
    tokens: list[int] = field(default_factory=list)
    draft_state: Any = None                # the proposer's state (None without speculation)
    finished: bool = False
    # the hidden that produced tokens[-1] ([H], `hidden`): row `hidden_row` of `hidden_src`, a
    # pass's hiddens [rows, H], kept as the tensor and the row (a view a sequence a step is
    # host work on CUDA; the draft side picks the rows in one gather), or hidden_src itself
    # when hidden_row is -1
    hidden_src: torch.Tensor | None = None
    hidden_row: int = -1

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt)

    @property
    def hidden(self) -> torch.Tensor | None:
        """[H]: the target hidden that produced tokens[-1] (None before the prefill)."""
        src = self.hidden_src
        return src if src is None or self.hidden_row < 0 else src[self.hidden_row]

    @hidden.setter
    def hidden(self, value: torch.Tensor | None) -> None:
        self.hidden_src, self.hidden_row = value, -1

    def hidden_at(self, source: torch.Tensor, row: int) -> None:
        """The hidden is row `row` of `source` [rows, H] (no view made)."""
        self.hidden_src, self.hidden_row = source, row

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
