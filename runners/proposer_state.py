"""Per-sequence proposer state and the rules the proposer applies to it: what a propose records,
the trim after verify, pair keys, the KV hand-over. Small functions over a plain state, kept
apart from the proposer so the rules read, and test, on their own."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from draft_circuit.runners.kv_cache import SequenceBlocks


class ProposerError(ValueError):
    """A call the proposer refuses: a foreign state, a bad count, an unsettled order of calls."""


@dataclass
class MtpProposerState:
    """One sequence's drafter: its drafter-KV block table and rows, the newest pair key (the
    position of the newest row's token), and what the last propose drafted. A deferred propose
    leaves its drafts on the device (`pending`) until something reads them."""

    owner: int
    blocks: SequenceBlocks
    last_num_drafted: int = 0
    last_pair_key: int | None = None
    last_drafts: list[int] = field(default_factory=list)
    pending: tuple[torch.Tensor, int, int] | None = None  # (drafts [k] on device, rows, position)

    @property
    def rows(self) -> int:
        return self.blocks.num_rows

    def is_empty(self) -> bool:
        return self.rows == 0 and not self.blocks.blocks and self.last_pair_key is None


def kept_drafts(row: list[int]) -> list[int]:
    """The drafts a row kept: everything before the first -1 (a stop, or an all-masked row)."""
    out = []
    for t in row:
        if t < 0:
            break
        out.append(int(t))
    return out


def record_drafts(state: MtpProposerState, drafts: list[int], rows: int, position: int) -> None:
    """What a propose from `rows` drafter rows at `position` leaves: one row per kept draft (a
    stopped row wrote no further row), the drafts, and the newest row's pair key."""
    state.blocks.set_rows(rows + len(drafts))
    state.last_num_drafted, state.last_drafts = len(drafts), drafts
    state.last_pair_key = position + len(drafts) - 1 if drafts else state.last_pair_key


def settle(state: MtpProposerState) -> None:
    """Read a deferred propose's drafts (the one host sync it postponed) into the state."""
    if state.pending is not None:
        drafts, rows, position = state.pending
        state.pending = None
        record_drafts(state, kept_drafts(drafts.tolist()), rows, position)


def rows_to_trim(num_drafted: int, num_accepted: int, *, kv_exact: bool, refeed: bool) -> int:
    """Drafter rows to drop after verify, never more than max(num_drafted, 1).

    The chain wrote one row from the target hidden (kept) and num_drafted - 1 from drafter
    hiddens. Exact KV drops all of those (catch-up rebuilds the accepted ones from target
    hiddens); so does re-feeding accepted drafts; otherwise only rejected drafts' rows go.
    """
    drafter_rows = max(num_drafted, 1) - 1
    if kv_exact or refeed:
        return drafter_rows
    return drafter_rows - min(num_accepted, drafter_rows)


def trim_after_verify(state: MtpProposerState, num_accepted: int, *, kv_exact: bool,
                      refeed: bool) -> int:
    """Trim the rows the verify rejected (`rows_to_trim`); the newest pair key moves back by the
    same count. Returns the rows trimmed."""
    if not 0 <= num_accepted <= max(state.last_num_drafted, 0):
        raise ProposerError(f"num_accepted {num_accepted} exceeds the {state.last_num_drafted} "
                            "drafts of the last propose")
    trim = min(rows_to_trim(state.last_num_drafted, num_accepted, kv_exact=kv_exact,
                            refeed=refeed), state.rows)
    if trim:
        state.blocks.set_rows(state.rows - trim)
        if state.last_pair_key is not None:
            state.last_pair_key -= trim
    state.last_num_drafted = 0  # a second call trims nothing more
    return trim


def take_kv(state: MtpProposerState) -> tuple[list[int], int, int | None] | None:
    """Hand the blocks, rows and pair key out (None when there are no blocks or no rows); the
    state keeps no blocks, no rows and no pair key."""
    if not state.blocks.blocks or state.rows == 0:
        return None
    key = state.last_pair_key
    blocks, rows = state.blocks.take()
    state.last_pair_key, state.last_num_drafted = None, 0
    return blocks, rows, key


def install_kv(state: MtpProposerState, blocks: Sequence[int], rows: int,
               last_pair_key: int | None) -> bool:
    """Adopt handed-over blocks; False (nothing changed) unless the state is empty."""
    if not state.is_empty() or not state.blocks.install(blocks, rows):
        return False
    state.last_pair_key = last_pair_key
    return True


def free_all(state: MtpProposerState) -> None:
    """Free every block; the state is empty after."""
    state.blocks.free()
    state.last_pair_key, state.last_num_drafted, state.last_drafts = None, 0, []
