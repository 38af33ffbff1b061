"""The rows of one chain run (`ChainRows`) and a catch-up's rows cut into runs of at most a
chain's width (`catchup_chunks`), from inputs the caller has checked (runners/proposer_inputs.py).
Per-step host work: array operations over all rows, O(chunks) Python; run by proposer_rows.py."""
from __future__ import annotations

from itertools import chain, repeat
from operator import methodcaller
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.proposer_slots import SMALL_BATCH
from draft_circuit.runners.proposer_state import MtpProposerState

if TYPE_CHECKING:  # (it imports this module)
    from draft_circuit.runners.accept_counts import Advance


class ChainRows(NamedTuple):  # immutable, and made in a third of a frozen dataclass's time
    """The rows of one chain run: row i is slot slots[i]'s (its block table), holds `live[i]`
    drafter rows before this run and writes its first row at RoPE position `positions[i]`.
    `states`: the states of the rows (one each for a propose; a catch-up's chunks leave it
    empty, their caller holds the states)."""

    tokens: Sequence[int] | np.ndarray
    # the rows' hiddens: segments [m, H] adding up to n rows, or n rows picked from one tensor
    hiddens: Sequence[torch.Tensor] | HiddenRows
    positions: Sequence[int] | np.ndarray
    slots: np.ndarray
    live: Sequence[int] | np.ndarray | None  # a propose's: None, run_chain reads it
    states: Sequence[MtpProposerState] = ()
    kv_only: bool = False   # catch-up rows: only their K/V is wanted (the KV-only chain)
    #: device counts that shift the staged rows before the run (a propose drafted ahead of
    #: its verify's read: runners/accept_counts.py `Advance`); None: the rows as given
    advance: "Advance | None" = None


_ROWS = methodcaller("size", 0)


def _small_chunk(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor] | HiddenRows,
                 first_pos: Sequence[int] | np.ndarray, slots: np.ndarray,
                 bases: np.ndarray | Sequence[int], width: int,
                 exact: bool) -> list[ChainRows] | None:
    """`catchup_chunks` of at most SMALL_BATCH sequences whose rows fit one run, as Python
    lists (None when they do not fit: the array path splits them)."""
    # one pick of every row in order (HiddenRows): no segment a sequence to collect
    picked = hiddens if isinstance(hiddens, HiddenRows) else None
    segments = repeat(None) if isinstance(hiddens, HiddenRows) else hiddens
    toks: list[int] = []
    pos: list[int] = []
    live: list[int] = []
    owners: list[int] = []
    segs: list[torch.Tensor] = []
    firsts = first_pos.tolist() if isinstance(first_pos, np.ndarray) else first_pos
    for ts, h, p, b, s in zip(tokens, segments, firsts,
                              bases.tolist() if isinstance(bases, np.ndarray) else bases,
                              slots.tolist()):
        m = len(ts)
        if m:
            toks += ts
            pos += range(p, p + m)
            live += range(b, b + m)
            owners += [s] * m
            if h is not None:
                segs.append(h if exact or h.shape[0] == m else h[:m])
    if len(toks) > width:
        return None
    if not toks:
        return []
    return [ChainRows(toks, segs if picked is None else picked, pos,
                      np.array(owners, dtype=np.intp), live, kv_only=True)]



def _arange(total: int) -> np.ndarray:
    """0..total-1 (int64, read-only): a slice of one array kept for every catch-up (grown
    when a wider one comes; each call slices the array it read, whatever another thread's
    proposer stores meanwhile)."""
    global _ARANGE
    kept = _ARANGE
    if len(kept) < total:
        kept = np.arange(max(total, 2 * len(kept)), dtype=np.int64)
        kept.flags.writeable = False
        _ARANGE = kept
    return kept[:total]


_ARANGE = np.zeros(0, dtype=np.int64)


def consecutive(bases: Sequence[int] | np.ndarray, counts: np.ndarray,
                starts: np.ndarray | None = None) -> np.ndarray:
    """bases[i], bases[i] + 1, ..., bases[i] + counts[i] - 1 for every i, concatenated (int64):
    each base less its first row's index (`starts`, the counts' exclusive running sum, when the
    caller has it), repeated over its rows, plus the row's index. A catch-up's positions and
    rows, and a target pass's positions (examples/engine/runner.py), are built so."""
    if starts is None:
        starts = np.add.accumulate(counts) - counts
    out: np.ndarray = np.subtract(bases, starts).repeat(counts)
    out += _arange(len(out))
    return out


def consecutive_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Increasing `indices` as runs [a, b) of consecutive ones, in order: what a batch keeps
    of its rows when some finish (one finish leaves at most two runs)."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def catchup_chunks(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor] | HiddenRows,
                   first_pos: Sequence[int] | np.ndarray, slots: np.ndarray,
                   bases: np.ndarray | Sequence[int], width: int, *,
                   counts: np.ndarray | None = None, ids: list[int] | None = None,
                   exact: bool = False, every: bool | None = None) -> list[ChainRows]:
    """Catch-up rows of several sequences as one-step chain runs of at most `width` rows, in
    row order: sequence i's k-th row pairs tokens[i][k] with hiddens[i][k] at RoPE position
    first_pos[i] + k and is written at drafter row bases[i] + k of slot slots[i], attending to
    the rows before it (earlier chunks, or earlier rows of the same kv_write launch). Built as
    array operations over all rows (np.repeat of each sequence's values less its first row's
    index, plus one shared arange), the hiddens as whole-sequence segments sliced only where a
    chunk boundary cuts one: this is per-step host work, O(chunks) Python. `counts`: each
    sequence's token count when the caller has it; `ids`: the token ids flattened in row order
    when it has them (check_catchup_counts made them); `exact`: every hiddens[i] has exactly
    that many rows (the caller checked: no spare row to cut, and no row count read a
    sequence); `every`: whether every count is nonzero, when the caller knows. `hiddens` may
    be one HiddenRows picking every row in row order (checked to hold exactly the rows): each
    chunk then takes its span of the pick."""
    if len(tokens) <= SMALL_BATCH:
        small = _small_chunk(tokens, hiddens, first_pos, slots, bases, width, exact)
        if small is not None:
            return small
    if counts is None:
        counts = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    # ufunc and array methods, not np.cumsum / np.repeat (their Python wrappers cost about
    # a microsecond each, as much as the work at these sizes)
    ends = np.add.accumulate(counts)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return []
    starts = ends - counts
    # from a flat list when the check made one (half a chain's time)
    toks = np.fromiter(chain.from_iterable(tokens) if ids is None else ids, dtype=np.int64,
                       count=total)
    pos = consecutive(first_pos, counts, starts)
    live = consecutive(bases, counts, starts)
    owners = np.asarray(slots).repeat(counts)
    if isinstance(hiddens, HiddenRows):  # one pick, row order: a chunk is its span [lo, hi)
        return [ChainRows(toks[lo:lo + width], hiddens.part(lo, lo + width), pos[lo:lo + width],
                          owners[lo:lo + width], live[lo:lo + width], kv_only=True)
                for lo in range(0, total, width)]
    segs = list(hiddens)
    if not exact:
        rows = np.fromiter(map(_ROWS, segs), dtype=np.int64, count=len(segs))
        for i in np.flatnonzero(rows != counts).tolist():  # a spare row
            segs[i] = segs[i][:int(counts[i])]
    if every is None:
        every = np.count_nonzero(counts) == len(counts)
    if total <= width:  # one run (the common case): every sequence with rows, whole
        part = segs if every else [h for h, c in zip(segs, counts.tolist()) if c]
        return [ChainRows(toks, part, pos, owners, live, kv_only=True)]
    chunks = []
    for lo in range(0, total, width):
        hi = min(lo + width, total)
        # the sequences holding rows lo and hi - 1 (both have rows); empty ones between skipped
        i0 = int(np.searchsorted(ends, lo, side="right"))
        i1 = int(np.searchsorted(ends, hi - 1, side="right"))
        part = segs[i0:i1 + 1]
        if (counts[i0:i1 + 1] == 0).any():
            part = [segs[i] for i in range(i0, i1 + 1) if counts[i]]
        if starts[i0] < lo:  # the chunk starts inside a sequence
            part[0] = part[0][lo - int(starts[i0]):]
        if ends[i1] > hi:  # and ends inside one (maybe the same)
            cut = hi - max(int(starts[i1]), lo)
            part[-1] = part[-1][:cut]
        chunks.append(ChainRows(toks[lo:hi], part, pos[lo:hi], owners[lo:hi], live[lo:hi],
                                kv_only=True))
    return chunks
