"""The proposer's chain runs over rows it has checked: propose's one k-step run and catch-up's
one-step runs. Both grow every table first, all or nothing, and give back what they grew if a
run fails, so a refused or failed call leaves every state's rows, key and blocks as they were."""
from __future__ import annotations

from typing import Callable

import torch

from draft_circuit.runners.proposer_inputs import ChainRows, catchup_chunks, grow_all
from draft_circuit.runners.proposer_state import MtpProposerState, pair_key

#: run the k-step chain over rows (with an optional bitmask); returns the runner's outputs
Execute = Callable[[int, ChainRows, "torch.Tensor | None"], dict[str, torch.Tensor]]


def _release(states: list[MtpProposerState]) -> None:
    for s in states:
        s.blocks.release_unused()


def run_chain(execute: Execute, rows: ChainRows, k: int,
              bitmask: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Room for k more rows in every table, then one run; returns (outputs, rows before)."""
    grow_all(rows.states, [r + k for r in rows.live])
    try:
        return execute(k, rows, bitmask), rows.live
    except Exception:
        _release(rows.states)
        raise


def write_rows(execute: Execute, width: int, tokens: list[list[int]], hiddens: list[torch.Tensor],
               first_pos: list[int], states: list[MtpProposerState]) -> int:
    """Append sequence i's rows, tokens[i][k] with hiddens[i][k] at RoPE first_pos[i] + k, as
    one-step runs of at most `width` rows in row order (a row attends to the rows before it);
    the newest key is then first_pos[i] + len - 2. Returns the rows written."""
    bases = [s.rows for s in states]
    grow_all(states, [b + len(t) for b, t in zip(bases, tokens)])
    try:
        for chunk in catchup_chunks(tokens, hiddens, first_pos, states, bases, width):
            execute(1, chunk, None)
    except Exception:
        _release(states)
        raise
    for s, b, t, p in zip(states, bases, tokens, first_pos):
        if t:
            s.blocks.set_rows(b + len(t))
            s.last_pair_key = pair_key(p + len(t) - 1)
    return sum(len(t) for t in tokens)
