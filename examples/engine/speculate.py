"""The speculative step's two rules: how drafts are asked for, and which of them are accepted.

Greedy acceptance: verifying [t, d_1..d_k] gives the target's argmax g_0..g_k after each row;
d_i is accepted while d_1..d_i all equal g_0..g_{i-1}; the step then also takes g_a, the
target's own token after the last accepted draft (the bonus), so every step emits a + 1 tokens,
each exactly what target-only greedy decoding would have emitted.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from examples.engine.sequence import Sequence


def accept(drafts: list[int], target_tokens: list[int]) -> int:
    """How many leading drafts equal the target's argmax at the row before them."""
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]:
        a += 1
    return a


class DraftStats:
    """Per width: how the drafting batches were served (the proposer's plan kind, or
    per_sequence when propose_batch declined), and of them the batches drafted ahead and then
    withdrawn unused (a sequence finished or one was admitted after they were proposed), and
    those drafted ahead whose finished sequences' rows were dropped and the rest verified
    (`narrowed`, by kind: (the width drafted, the width verified) -> batches)."""

    def __init__(self) -> None:
        self.batches: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.withdrawn: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.narrowed: dict[str, dict[tuple[int, int], int]] = \
            defaultdict(lambda: defaultdict(int))

    def table(self) -> dict[int, dict[str, int]]:
        widths = sorted({n for per in self.batches.values() for n in per})
        return {n: {kind: per[n] for kind, per in sorted(self.batches.items()) if per.get(n)}
                for n in widths}


def draft(proposer, seqs: list[Sequence], num_drafts: int, stats: DraftStats) -> list[list[int]]:
    """Drafts for every running sequence: one n-row run when the proposer serves the width,
    else each sequence alone on the one-row program. How the batch was served is the
    proposer's own record of that call (`last_served`)."""
    drafts = proposer.propose_batch([s.last_token for s in seqs], _hiddens(seqs),
                                    [s.position for s in seqs], num_drafts,
                                    [s.draft_state for s in seqs])
    if drafts is None:
        return draft_each(proposer, seqs, num_drafts, stats)
    stats.batches[proposer.last_served.kind][len(seqs)] += 1
    return drafts


def draft_on_device(proposer, seqs: list[Sequence], num_drafts: int,
                    stats: DraftStats) -> torch.Tensor | None:
    """Drafts that stay on the device (`propose_batch_on_device`): the verify input of every
    sequence, i32[n * (k + 1)] (its last token, then its k drafts, a draft after a stop as 0),
    with nothing read back; the drafts reach the host when the proposer is next asked about a
    state (`last_drafts`). None when the proposer declined the batch (nothing ran): draft each
    sequence alone (`draft_each`)."""
    got = proposer.propose_batch_on_device([s.last_token for s in seqs], _picked(seqs),
                                           [s.position for s in seqs], num_drafts,
                                           [s.draft_state for s in seqs])
    if got is None:
        return None
    stats.batches[proposer.last_served.kind][len(seqs)] += 1
    return proposer.verify_tokens()


def draft_each(proposer, seqs: list[Sequence], num_drafts: int,
               stats: DraftStats) -> list[list[int]]:
    """Each sequence alone on the one-row program (a batch the proposer declined)."""
    stats.batches["per_sequence"][len(seqs)] += 1
    return [proposer.propose(s.last_token, s.hidden, s.position, num_drafts, s.draft_state)
            for s in seqs]


def _hiddens(seqs: list[Sequence]) -> torch.Tensor:
    """[n, H]: the hidden behind each last token (the contract's `propose_batch` takes a
    tensor)."""
    return torch.stack([h for s in seqs if (h := s.hidden) is not None])  # one view each


def _picked(seqs: list[Sequence]) -> torch.Tensor | HiddenRows:
    """`_hiddens` for `MtpProposer.propose_batch_on_device` (the device path's own call, which
    takes picked rows): when every hidden is a row of one pass's hiddens (a decode step's
    verify), those rows by index, one gather on the device, no view or stack a sequence."""
    source = seqs[0].hidden_src if seqs else None
    if source is not None and source.dim() == 2 and all(s.hidden_src is source and s.hidden_row >= 0
                                                        for s in seqs):
        return HiddenRows(source, np.fromiter((s.hidden_row for s in seqs), dtype=np.int64,
                                              count=len(seqs)))
    return _hiddens(seqs)


def usable(num_drafted: int, num_accepted: int, room: int, kept: list[int],
           eos: int | None) -> tuple[int, int]:
    """(drafted, accepted) as a step's statistics count them: only drafts at positions the
    request could still use. Draft i stands at the step's i-th new position; the request takes
    at most `room` more tokens and none after an EOS (`kept`: the tokens it took, ending with
    the EOS if one ended it), so a draft counts when i < len(kept) after an EOS, else i < room.
    A draft past max_new_tokens or past an EOS is neither drafted nor accepted."""
    horizon = len(kept) if eos is not None and kept and kept[-1] == eos else room
    return min(num_drafted, horizon), min(num_accepted, horizon)
