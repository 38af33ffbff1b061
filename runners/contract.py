"""What a host engine sees of a proposer besides its methods: `Served`, the record of how the
latest `propose_batch` was served (so the host never diffs the proposer's counters)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: own / pad / split: the compiled runner's plan for the width; eager: the oracle ran it;
#: refused: `propose_batch` returned None (the host drafts each sequence alone), `reason` says why
ServedKind = Literal["own", "pad", "split", "eager", "refused"]


@dataclass(frozen=True)
class Served:
    """How one `propose_batch` call of `width` rows was served."""

    kind: ServedKind
    width: int
    reason: str | None = None

    @property
    def ran(self) -> bool:
        """Whether the batch ran as one n-row run (False: refused, draft each alone)."""
        return self.kind != "refused"
