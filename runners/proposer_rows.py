"""The proposer's chain runs over rows it has checked: propose's one k-step run and catch-up's
one-step runs. Both grow every table first, all or nothing, and give back what they grew if a
run fails, so a refused or failed call leaves every state's rows, key and blocks as they were.
The bookkeeping after a run is array operations over the states' slots (proposer_slots.py)."""
from __future__ import annotations

from operator import add
from typing import Callable, Sequence

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.proposer_chunks import ChainRows, catchup_chunks
from draft_circuit.runners.kv_cache import ensure_rows_all
from draft_circuit.runners.proposer_slots import FEW, KEY, ROWS, SMALL_BATCH, SlotTable
from draft_circuit.runners.proposer_state import MtpProposerState

#: run the k-step chain over rows (with an optional bitmask); returns the runner's outputs
Execute = Callable[[int, ChainRows, "torch.Tensor | None"], dict[str, torch.Tensor]]


def _release(states: Sequence[MtpProposerState]) -> None:
    for s in states:
        s.blocks.release_unused()


def grow_all(table: SlotTable, slots: np.ndarray, states: Sequence[MtpProposerState],
             rows: np.ndarray) -> None:
    """Give every state (states[i] at slots[i]) storage for rows[i] rows, or none of them any
    more than before: a table that would overflow or a pool that runs dry raises with nothing
    half-allocated. Steady state: one array comparison, no table lacks room."""
    if len(slots) <= SMALL_BATCH:
        short = [i for i, (r, c) in enumerate(zip(rows.tolist(), table.capacity[slots].tolist()))
                 if r > c]
    else:
        short = (rows > table.capacity[slots]).nonzero()[0].tolist()
    if short:  # one pool draw for them all (kv_cache.ensure_rows_all: the same ids and errors)
        ensure_rows_all([states[i].blocks for i in short], rows[short].tolist())


def run_chain(execute: Execute, table: SlotTable, rows: ChainRows, k: int,
              bitmask: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], Sequence[int] | np.ndarray]:
    """Room for k more rows in every table, then one run; returns (outputs, rows before).
    The rows before are read here with the capacities (a few rows: Python ints from their two
    columns) and the run's rows carry them (`rows.live` comes in None)."""
    if len(rows.slots) <= SMALL_BATCH:
        live: Sequence[int] | np.ndarray = table.rows[rows.slots].tolist()
        short = [i for i, (r, c) in enumerate(zip(live, table.capacity[rows.slots].tolist()))
                 if r + k > c]
        if short:  # one pool draw for them all (ensure_rows_all: the same ids and errors)
            ensure_rows_all([rows.states[i].blocks for i in short], [live[i] + k for i in short])
    else:
        before = table.rows[rows.slots]  # a copy (fancy indexing)
        grow_all(table, rows.slots, rows.states, before + k)
        live = before
    try:
        return execute(k, rows._replace(live=live), bitmask), live
    except Exception:
        _release(rows.states)
        raise


def write_rows(execute: Execute, table: SlotTable, width: int, tokens: Sequence[Sequence[int]],
               hiddens: Sequence[torch.Tensor] | HiddenRows,
               first_pos: Sequence[int] | np.ndarray,
               states: Sequence[MtpProposerState], slots: np.ndarray,
               ids: list[int] | None = None) -> int:
    """Append sequence i's rows (states[i], at slots[i]), tokens[i][k] with hiddens[i][k] at
    RoPE first_pos[i] + k, as one-step runs of at most `width` rows in row order (a row attends
    to the rows before it); the newest key is then first_pos[i] + len - 2 for every sequence
    that wrote a row. hiddens[i] has exactly len(tokens[i]) rows, or `hiddens` is one
    HiddenRows picking every sequence's rows in row order, as many as all the tokens (the
    callers' checks make sure); `ids`: the token ids flattened, when the caller's check made
    them. Returns the rows written."""
    if len(slots) <= SMALL_BATCH:
        return _write_few(execute, table, width, tokens, hiddens, first_pos, states, slots)
    bases = table.rows[slots]  # a copy (fancy indexing): the rows before
    lens = list(map(len, tokens))
    counts = np.array(lens, dtype=np.int64)
    after = bases + counts  # each sequence's rows once written
    grow_all(table, slots, states, after)
    first = np.asarray(first_pos, dtype=np.int64)
    every = 0 not in lens  # every sequence writes rows (the common case)
    try:
        for chunk in catchup_chunks(tokens, hiddens, first, slots, bases, width,
                                    counts=counts, ids=ids, exact=True, every=every):
            execute(1, chunk, None)
    except Exception:
        _release(states)
        raise
    # the three columns that change (rows, key, has-key), each through its 1-D view (numpy's
    # fast path for one index array); capacity and the rest are left as the growth made them
    table.rows[slots] = after
    keys = first + counts
    keys -= 2
    if every:  # every sequence wrote rows (the common case): each has its key now
        table.pair_key[slots] = keys
        table.has_key[slots] = 1
    else:
        some = counts > 0
        table.pair_key[slots] = np.where(some, keys, table.pair_key[slots])
        table.has_key[slots] = table.has_key[slots] | some
    return sum(lens)


def _write_few(execute: Execute, table: SlotTable, width: int, tokens: Sequence[Sequence[int]],
               hiddens: Sequence[torch.Tensor] | HiddenRows,
               first_pos: Sequence[int] | np.ndarray,
               states: Sequence[MtpProposerState], slots: np.ndarray) -> int:
    """`write_rows` of at most SMALL_BATCH sequences: the same rule on their rows and
    capacities as Python ints (two column reads before, the changed columns written after; a
    table that lacks room grows all or nothing first, kv_cache.ensure_rows_all)."""
    bases: list[int] = table.rows[slots].tolist()
    counts = list(map(len, tokens))
    short = [i for i, (b, c, m) in enumerate(zip(bases, table.capacity[slots].tolist(), counts))
             if b + m > c]
    if short:
        ensure_rows_all([states[i].blocks for i in short], [bases[i] + counts[i] for i in short])
    try:
        for chunk in catchup_chunks(tokens, hiddens, first_pos, slots, bases, width,
                                    exact=True):
            execute(1, chunk, None)
    except Exception:
        _release(states)
        raise
    if len(slots) > FEW and all(counts):  # every sequence wrote rows: three column writes
        table.put(slots, ROWS, list(map(add, bases, counts)))
        table.put(slots, KEY, [p + m - 2 for p, m in zip(first_pos, counts)])
        table.has_key[slots] = 1
    else:  # a slot at a time, each that wrote rows
        rows, key, has = table.rows, table.pair_key, table.has_key
        for slot, b, m, p in zip(slots.tolist(), bases, counts, first_pos):
            if m:
                rows[slot], key[slot], has[slot] = b + m, p + m - 2, 1
    return sum(counts)


def record_batch(table: SlotTable, slots: np.ndarray, drafts: np.ndarray,
                 rows: Sequence[int] | np.ndarray,
                 positions: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """What a batch propose leaves (`SlotTable.record`) and each row's kept drafts as lists
    (the drafts before its first -1): (kept drafts, their counts)."""
    kept = table.record(slots, drafts, rows, positions)
    return kept, list(map(len, kept))
