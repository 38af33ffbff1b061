"""The proposer contract a host engine types against (DESIGN.md, "The proposer contract"; the
reference's `DraftProposer`): `DraftProposer`, and `Served`, the record of how the latest
`propose_batch` was served (so a host never diffs a proposer's counters).

Positions are RoPE positions. A drafter row written at position p pairs the token at p with the
target's hidden at p - 1; its pair key is p - 1, and `last_pair_key` is the newest row's. A host
finds the rows it must still write from that key: the next row is at key + 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

import torch

from draft_circuit.runners.chains import DraftBinding
from draft_circuit.runners.protocol import DraftRunner

#: own / pad / split: the compiled runner's plan for the width; eager: the oracle ran it;
#: empty: zero drafts were asked for, nothing ran; refused: `propose_batch` returned None (the
#: host drafts each sequence alone), `reason` says why
ServedKind = Literal["own", "pad", "split", "eager", "empty", "refused"]


@dataclass(frozen=True)
class Served:
    """How one `propose_batch` call of `width` rows was served."""

    kind: ServedKind
    width: int
    reason: str | None = None

    @property
    def ran(self) -> bool:
        """Whether the batch was served here (False: refused, draft each alone)."""
        return self.kind != "refused"


@runtime_checkable
class DraftProposer(Protocol):
    """What a host calls. States come from `alloc_state`; a query on a state of another proposer
    answers as for an empty one (0 rows, no key, nothing taken, installed or written), while
    `propose`, `after_verify` and `free_state` refuse it with a typed error."""

    last_served: Served | None

    def circuit_draft(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftBinding | None:
        """The draft chain and its weight binding, for the host to compile (None: no circuit)."""
        ...

    def set_circuit_draft(self, runner: DraftRunner | None, *, num_drafts: int | None = None,
                          bitmask: bool = False) -> None:
        """Install the host-compiled runner of a chain (`--forward circuit`), or with None remove
        every installed runner: drafting is then eager."""
        ...

    def alloc_state(self) -> Any:
        """An empty state: no blocks, no rows, no pair key, no drafts, no pending catch-up."""
        ...

    def propose(self, last_token: int, target_hidden: torch.Tensor, position: int,
                num_drafts: int, state: Any, *, embed_target: torch.Tensor | None = None,
                bitmask: torch.Tensor | None = None) -> list[int] | torch.Tensor:
        """Draft one sequence: `last_token` at `position`, `target_hidden` the target's hidden at
        position - 1. Draft i writes a drafter row at position + i; later drafts read the
        drafter's own hidden. Zero drafts return [] and set last_num_drafted 0. With
        `embed_target` only the last kept draft's embedding is written there and the drafts stay
        on the device. A confidence stop keeps the low draft and stops; a masked chain never
        stops on confidence (its confidence is not measured in the reference)."""
        ...

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: torch.Tensor,
                      positions: Sequence[int], num_drafts: int, states: Sequence[Any], *,
                      bitmask: torch.Tensor | None = None,
                      out_conf: list[list[float]] | None = None) -> list[list[int]] | None:
        """Draft n sequences in one n-row run, or return None before anything runs ("not served
        here: propose each alone"): width 0, a width nothing serves, a state of another
        proposer, or a path the head refuses (logged once). `last_served` records which.
        `out_conf` receives each kept draft's confidence (top-1 log-probability)."""
        ...

    def propose_batch_max(self) -> int:
        """The widest batch `propose_batch` can take."""
        ...

    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: torch.Tensor, state: Any) -> int:
        """The prompt's rows: `catchup_drafter(prompt, hiddens, 0, 1, state)`. A prompt of P
        tokens writes rows at positions 1..P-1 (key P - 2); returns the rows written."""
        ...

    def drafter_rows(self, state: Any) -> int:
        """The rows the state holds (0 for a state of another proposer)."""
        ...

    def last_pair_key(self, state: Any) -> int | None:
        """The newest row's pair key (None when it has none, or the state is another's)."""
        ...

    def take_drafter_kv(self, state: Any) -> tuple[list[int], int, int | None] | None:
        """Hand (blocks, rows, pair key) over, leaving no blocks, rows or key (None when empty)."""
        ...

    def install_drafter_kv(self, state: Any, blocks: Sequence[int], rows: int,
                           last_pair_key: int | None) -> bool:
        """Adopt handed-over KV, only into a state with no blocks and no rows; False otherwise."""
        ...

    def free_drafter_kv(self, blocks: Sequence[int]) -> None:
        """Free blocks the host holds (taken and never installed)."""
        ...

    def catchup_drafter(self, tokens: Sequence[int], hiddens: torch.Tensor, row_base: int,
                        pos_base: int, state: Any) -> int:
        """Row r pairs tokens[r + 1] with hiddens[r] at position pos_base + r: len(tokens) - 1
        rows, written only when row_base is the state's row count (else 0, nothing written)."""
        ...

    def read_deferred_draft_token(self) -> int:
        """The last kept draft of the latest deferred propose (where the host syncs)."""
        ...

    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                      first_pos: Sequence[int], states: Sequence[Any]) -> int:
        """tokens[i][k] with hiddens[i][k] at position first_pos[i] + k, appended at each state's
        row count (key first_pos[i] + len - 2). Every count is checked before anything runs: a
        mismatch is a typed error naming the sequence and changes nothing."""
        ...

    def after_verify(self, num_accepted: int, state: Any) -> None:
        """Trim with d = max(last_num_drafted, 1): d - 1 rows with exact KV, else
        min(max(d - a, 0) + (max(a - 1, 0) if refeed else 0), d); the key moves back as much."""
        ...

    def free_state(self, state: Any) -> None:
        """Free every block; the state is empty after."""
        ...
