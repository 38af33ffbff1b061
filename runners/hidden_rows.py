"""Target hiddens given as rows of one tensor, picked by index (issue 20's host window).

A host's verify pass leaves one hidden tensor [rows, H] for the whole batch; the draft side of
the step wants some of its rows: each sequence's hidden behind its last token (the propose) and
the rows of its accepted tokens (the catch-up). Handing the proposer one view a sequence and a
`stack`/`cat` of them costs a torch op a sequence on the host (several microseconds each on
CUDA; ~480 us a step at 64 sequences on this CPU, measured 2026-12-06). `HiddenRows(source, rows)`
says the same with one tensor and one index array: the staging gathers the rows into the
chain's hidden buffer with one `index_select` (runners/staging.py), whatever the count.

`check_hidden_rows` is every check the proposer makes of one before anything changes: a 2-D
tensor as wide as the head reads, a 1-D integer index array of exactly the rows expected, each
index inside the tensor. Each error names the call and what was wrong.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from draft_circuit.runners.proposer_state import ProposerError


class HiddenRows:
    """Row r of a run takes `source[rows[r]]`: source [R, H] (any device and dtype the hidden
    buffer's copy accepts), rows an integer numpy array of indices in [0, R). Not a tuple or a
    sequence on purpose: nothing that walks a list of per-sequence segments can take it for one."""

    __slots__ = ("source", "rows")

    def __init__(self, source: torch.Tensor, rows: np.ndarray) -> None:
        self.source, self.rows = source, rows

    def part(self, lo: int, hi: int) -> HiddenRows:
        """Rows [lo, hi) of this pick (a catch-up chunk's)."""
        return HiddenRows(self.source, self.rows[lo:hi])

    def __repr__(self) -> str:
        return f"HiddenRows(source={list(self.source.shape)}, rows={self.rows.tolist()})"


def hidden_rows(source: torch.Tensor, rows: Sequence[int] | np.ndarray) -> HiddenRows:
    """A `HiddenRows` from any integer sequence (made an int64 array once, here; a float or
    other non-integer sequence is refused, never truncated to rows)."""
    picks = np.asarray(rows)
    if picks.ndim != 1:
        raise ProposerError(f"hidden_rows: rows must be a 1-D sequence of row indices, got "
                            f"{picks.ndim}-D {type(rows).__name__}")
    if len(picks) and picks.dtype.kind not in "iu":
        raise ProposerError(f"hidden_rows: rows must be integers, got a {picks.dtype} array")
    return HiddenRows(source, picks.astype(np.int64, copy=False))


def check_hidden_rows(h: object, expect: int, hidden_size: int, what: str) -> HiddenRows:
    """`h` as a HiddenRows of exactly `expect` rows of a [R, hidden_size] tensor, each index in
    [0, R); raises ProposerError naming `what` and the fault otherwise (HiddenWidthError for a
    source of another width). Nothing is copied or changed."""
    if not isinstance(h, HiddenRows):
        raise ProposerError(f"{what}: expected HiddenRows(source, rows), got {type(h).__name__}")
    source, rows = h.source, h.rows
    if not isinstance(source, torch.Tensor) or source.dim() != 2:
        got = f"a {source.dim()}-D tensor {list(source.shape)}" \
            if isinstance(source, torch.Tensor) else type(source).__name__
        raise ProposerError(f"{what}: HiddenRows' source must be a 2-D tensor [rows, "
                            f"{hidden_size}], got {got}")
    if source.shape[1] != hidden_size:
        from draft_circuit.runners.proposer_inputs import HiddenWidthError  # imports this module
        raise HiddenWidthError(f"{what}: HiddenRows' source is {list(source.shape)}: target "
                               f"hiddens {source.shape[1]} wide, the head reads {hidden_size} "
                               "(its hidden_in_size)")
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        desc = f"{rows.dtype} array of rank {rows.ndim}" if isinstance(rows, np.ndarray) \
            else type(rows).__name__
        raise ProposerError(f"{what}: HiddenRows' rows must be a 1-D integer numpy array, got "
                            f"{desc}")
    if len(rows) != expect:
        raise ProposerError(f"{what}: HiddenRows picks {len(rows)} rows, the call has {expect} "
                            "(one a drafter row)")
    if len(rows):
        # per-step host work: a few rows read as a list and scanned in C cost a fifth of two
        # numpy reductions
        if len(rows) <= 256:
            values = rows.tolist()
            lo, hi = min(values), max(values)
        else:
            lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= source.shape[0]:
            bad = int(np.flatnonzero((rows < 0) | (rows >= source.shape[0]))[0])
            raise ProposerError(f"{what}: HiddenRows' row {bad} picks source row {int(rows[bad])}, "
                                f"outside the source's {source.shape[0]} rows")
    return h
