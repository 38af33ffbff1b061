"""What the proposer checks and builds before a chain runs: token ids, bitmasks, all-or-nothing
block-table growth, and the runner inputs of a set of rows. Nothing here runs a chain; every
check raises before anything changes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from draft_circuit.ops.attention import TokenError
from draft_circuit.ops.sampling import mask_words
from draft_circuit.runners.proposer_state import MtpProposerState, ProposerError

#: block 0 of the drafter pool: what inert rows and the unused tail of every table point at
SCRATCH_BLOCK = 0


def check_tokens(tokens: Sequence[int], vocab: int, where: str = "") -> None:
    """Every id an int in [0, vocab): a bad id is refused before the embedding gather."""
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise TokenError(f"token {t!r} at row {i}{where} is outside the vocabulary [0, {vocab})")


def check_bitmask(bitmask: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """An int32 [n, ceil(vocab/32)] mask (a 1-D mask for one row is viewed as [1, words])."""
    words = mask_words(vocab)
    if bitmask.dtype != torch.int32:
        raise ProposerError(f"bitmask must be int32, got {bitmask.dtype}")
    mask = bitmask.view(1, -1) if bitmask.dim() == 1 else bitmask
    if mask.shape != (n, words):
        raise ProposerError(f"bitmask must be [{n}, {words}] (ceil({vocab}/32) words a row), got "
                            f"{list(bitmask.shape)}")
    return mask


def grow_all(states: Sequence[MtpProposerState], rows: Sequence[int]) -> None:
    """Give every state storage for its rows, or none of them any more than before: a table that
    would overflow or a pool that runs dry raises with nothing half-allocated."""
    grown: list[MtpProposerState] = []
    try:
        for s, r in zip(states, rows):
            s.blocks.ensure_rows(r)
            grown.append(s)
    except Exception:
        for s in grown:
            s.blocks.release_unused()
        raise


@dataclass(frozen=True)
class ChainRows:
    """The rows of one chain run: row i belongs to states[i], holds `live[i]` drafter rows before
    this run and writes its first row at RoPE position `positions[i]`."""

    tokens: list[int]
    hiddens: torch.Tensor   # [n, H]
    positions: list[int]
    states: list[MtpProposerState]
    live: list[int]


def chain_inputs(rows: ChainRows, *, log_tau: float, dtype: torch.dtype,
                 device: str | torch.device) -> dict[str, torch.Tensor]:
    """The runner inputs of `rows` (every row active; the runner makes padded rows inert)."""
    n = len(rows.tokens)
    tables = [s.blocks.table_row(SCRATCH_BLOCK) for s in rows.states]
    return {"tokens": torch.tensor(rows.tokens, dtype=torch.int32, device=device),
            "hidden": rows.hiddens.to(device=device, dtype=dtype),
            "positions": torch.tensor(rows.positions, dtype=torch.int32, device=device),
            "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
            "live_rows": torch.tensor(rows.live, dtype=torch.int32, device=device),
            "active": torch.ones(n, dtype=torch.int32, device=device),
            "log_tau": torch.full((n,), log_tau, dtype=torch.float32, device=device)}


def catchup_chunks(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                   first_pos: Sequence[int], states: Sequence[MtpProposerState],
                   bases: Sequence[int], width: int) -> list[ChainRows]:
    """Catch-up rows of several sequences as one-step chain runs of at most `width` rows, in
    row order: sequence i's k-th row pairs tokens[i][k] with hiddens[i][k] at RoPE position
    first_pos[i] + k and is written at drafter row bases[i] + k, attending to the rows before
    it (earlier chunks, or earlier rows of the same kv_write launch)."""
    flat = [(s, t, h, p + k, b + k)
            for s, ts, hs, p, b in zip(states, tokens, hiddens, first_pos, bases)
            for k, (t, h) in enumerate(zip(ts, hs))]
    chunks = []
    for start in range(0, len(flat), width):
        part = flat[start:start + width]
        chunks.append(ChainRows(tokens=[t for _, t, _, _, _ in part],
                                hiddens=torch.stack([h for _, _, h, _, _ in part]),
                                positions=[p for _, _, _, p, _ in part],
                                states=[s for s, *_ in part], live=[r for *_, r in part]))
    return chunks
