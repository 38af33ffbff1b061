"""The speculative step's two rules: how drafts are asked for, and which of them are accepted.

Greedy acceptance: verifying [t, d_1..d_k] gives the target's argmax g_0..g_k after each row;
d_i is accepted while d_1..d_i all equal g_0..g_{i-1}; the step then also takes g_a, the
target's own token after the last accepted draft (the bonus), so every step emits a + 1 tokens,
each exactly what target-only greedy decoding would have emitted.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from examples.engine.sequence import Sequence


def accept(drafts: list[int], target_tokens: list[int]) -> int:
    """How many leading drafts equal the target's argmax at the row before them."""
    a = 0
    while a < len(drafts) and drafts[a] == target_tokens[a]:
        a += 1
    return a


class DraftStats:
    """Per width: how the drafting batches were served (the proposer's plan kind, or
    per_sequence when propose_batch declined)."""

    def __init__(self) -> None:
        self.batches: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def table(self) -> dict[int, dict[str, int]]:
        widths = sorted({n for per in self.batches.values() for n in per})
        return {n: {kind: per[n] for kind, per in sorted(self.batches.items()) if per.get(n)}
                for n in widths}


def draft(proposer, seqs: list[Sequence], num_drafts: int, stats: DraftStats) -> list[list[int]]:
    """Drafts for every running sequence: one n-row run when the proposer serves the width,
    else each sequence alone on the one-row program. How the batch was served is the
    proposer's own record of that call (`last_served`)."""
    n = len(seqs)
    hiddens = torch.stack([s.hidden for s in seqs if s.hidden is not None])  # [n, H]: behind each last token
    drafts = proposer.propose_batch([s.last_token for s in seqs], hiddens,
                                    [s.position for s in seqs], num_drafts,
                                    [s.draft_state for s in seqs])
    if drafts is None:
        stats.batches["per_sequence"][n] += 1
        return [proposer.propose(s.last_token, s.hidden, s.position, num_drafts, s.draft_state)
                for s in seqs]
    stats.batches[proposer.last_served.kind][n] += 1
    return drafts
