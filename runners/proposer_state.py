"""Per-sequence proposer state and the rules the proposer applies to it (the reference's, see
README "Departures from the reference" for the few kept safer ones): what a propose records, the
trim after verify, pair keys, the KV hand-over. Small functions over a plain state, kept apart
from the proposer so the rules read, and test, on their own.

Pair key: a drafter row written at RoPE position p pairs the token at p with the target hidden
at p - 1, and its pair key is p - 1; a state's `last_pair_key` is its newest row's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from draft_circuit.runners.kv_cache import SequenceBlocks


class ProposerError(ValueError):
    """A call the proposer refuses: a foreign state, a bad count, an unsettled order of calls."""


@dataclass
class MtpProposerState:
    """One sequence's drafter: its drafter-KV block table and rows, the newest pair key, and what
    the last propose drafted. A deferred propose leaves its drafts on the device (`pending`)
    until something reads them; `awaiting_verify` is set by a propose and cleared by the
    after_verify that trims its rows."""

    owner: int
    blocks: SequenceBlocks
    last_num_drafted: int = 0
    last_pair_key: int | None = None
    last_drafts: list[int] = field(default_factory=list)
    # a deferred propose's drafts still on the device: (drafts [k], rows, position), or the
    # device-resident batch this state drafted in (settled for all its states at once)
    pending: "tuple[torch.Tensor, int, int] | PendingBatch | None" = None
    awaiting_verify: bool = False
    # (staging, row) of this state's block table on the device (runners/staging.py)
    slot: tuple[object, int] | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return self.blocks.num_rows


def pair_key(rope_position: int) -> int:
    """The pair key of a row written at `rope_position`: the target hidden's position."""
    return rope_position - 1


def kept_drafts(row: list[int]) -> list[int]:
    """The drafts a row kept: everything before the first -1 (a stop, or an all-masked row)."""
    out = []
    for t in row:
        if t < 0:
            break
        out.append(int(t))
    return out


def record_drafts(state: MtpProposerState, drafts: list[int], rows: int, position: int) -> None:
    """What a propose at `position` from `rows` drafter rows leaves: draft i wrote a row at RoPE
    position + i (a stopped row wrote no further row), so the newest key is position + d - 2."""
    state.blocks.set_rows(rows + len(drafts))
    state.last_num_drafted, state.last_drafts = len(drafts), drafts
    if drafts:
        state.last_pair_key = pair_key(position + len(drafts) - 1)
    state.awaiting_verify = True


@dataclass(eq=False)
class PendingBatch:
    """A device-resident propose_batch not yet read: its drafts [n, k] on the device, each row's
    rows before the run and position. The first call that touches any of its states settles all
    of them with one read (`read`: device drafts -> host rows; one copy, one sync)."""

    drafts: torch.Tensor
    rows: list[int]
    positions: list[int]
    states: list[MtpProposerState]
    read: Callable[[torch.Tensor], list[list[int]]]
    done: bool = False
    #: called once the states are recorded: raises a bad input row the read brought back
    #: (the input guards' records, copied beside the drafts)
    check: Callable[[], None] | None = None

    def settle(self) -> None:
        if self.done:
            return
        self.done = True
        for s, row, r, p in zip(self.states, self.read(self.drafts), self.rows, self.positions):
            if s.pending is self:  # a state freed or handed over since has nothing to record
                s.pending = None
                record_drafts(s, kept_drafts(row), r, p)
        if self.check is not None:
            self.check()


def settle(state: MtpProposerState) -> None:
    """Read a deferred propose's drafts (the one host sync it postponed) into the state."""
    if isinstance(state.pending, PendingBatch):
        state.pending.settle()
    elif state.pending is not None:
        drafts, rows, position = state.pending
        state.pending = None
        record_drafts(state, kept_drafts(drafts.tolist()), rows, position)


def rows_to_trim(num_drafted: int, num_accepted: int, *, kv_exact: bool, refeed: bool) -> int:
    """Drafter rows to drop after verify, with d = max(num_drafted, 1) and a accepted.

    Exact KV: d - 1 (the row built from the target hidden stays; catch-up rebuilds the accepted
    ones from target hiddens). Otherwise min(max(d - a, 0) + (max(a - 1, 0) if refeed else 0), d):
    the rejected drafts' rows go, and with refeed the accepted ones too, never more than d.
    """
    d = max(num_drafted, 1)
    if kv_exact:
        return d - 1
    return min(max(d - num_accepted, 0) + (max(num_accepted - 1, 0) if refeed else 0), d)


def trim_after_verify(state: MtpProposerState, num_accepted: int, *, kv_exact: bool,
                      refeed: bool) -> int:
    """Trim the rows `rows_to_trim` names; the newest pair key moves back by the same count
    (both saturate at 0, as the reference's unsigned counts do). Only the first after_verify
    after a propose trims (a second one, or one with no propose before it, trims nothing).
    Returns the count trimmed."""
    if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) \
            or not 0 <= num_accepted <= state.last_num_drafted:
        raise ProposerError(f"num_accepted {num_accepted!r} must be in 0..{state.last_num_drafted}, "
                            "the drafts of the last propose")
    if not state.awaiting_verify:
        return 0
    state.awaiting_verify = False
    trim = rows_to_trim(state.last_num_drafted, num_accepted, kv_exact=kv_exact, refeed=refeed)
    if trim:
        state.blocks.set_rows(max(state.rows - trim, 0))
        if state.last_pair_key is not None:
            state.last_pair_key = max(state.last_pair_key - trim, 0)
    return trim


def take_kv(state: MtpProposerState) -> tuple[list[int], int, int | None] | None:
    """Hand the blocks, rows and pair key out (None when there are no blocks or no rows); the
    state keeps no blocks, no rows and no pair key."""
    if not state.blocks.blocks or state.rows == 0:
        return None
    key = state.last_pair_key
    blocks, rows = state.blocks.take()
    state.last_pair_key, state.last_num_drafted, state.awaiting_verify = None, 0, False
    return blocks, rows, key


def install_kv(state: MtpProposerState, blocks: Sequence[int], rows: int,
               last_pair_key: int | None) -> bool:
    """Adopt handed-over blocks into a state with no blocks and no rows (a pair key alone does
    not block it); False, with nothing changed, otherwise."""
    if not state.blocks.install(blocks, rows):
        return False
    state.last_pair_key = last_pair_key
    return True


def free_all(state: MtpProposerState) -> None:
    """Free every block; the state is empty after (no rows, no pair key, no drafts)."""
    state.blocks.free()
    state.last_pair_key, state.last_num_drafted, state.last_drafts = None, 0, []
    state.pending, state.awaiting_verify = None, False
