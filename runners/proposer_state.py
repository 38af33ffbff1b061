"""Per-sequence proposer state and the pure rules the proposer applies to it (trim after
verify, pair keys). Kept apart from the proposer so the rules read, and test, on their own."""
from __future__ import annotations

from dataclasses import dataclass, field

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
