"""The index plan of ops.row_invariant's attention: where each row of a pass sits in the
fixed-shape tiles of query rows and key chunks, and what each GEMM reads, built in numpy on the
host (issue 20: at a decode's shapes a numpy op costs a microsecond or two, a torch op several)
and cached by the values it was built from. Its contract is `_tile_plan`'s: the plan of (block
tables, lengths), the same whichever way it was built: a pass of lone rows (a decode, the
drafter's chain, `_alone_plans`) and any other pass (`_shared_plan`) give the same indices
for the same rows (tests/ops/test_row_invariant_decode.py), so the attention the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch
from numpy.typing import NDArray

# query rows of one sequence per attention tile: the tile gathers its keys once, and every GEMM
# has QUERY_TILE * (heads per KV head) rows whatever the number of real rows in it (a decode row
# is alone in its tile, a verify's k + 1 rows share two or three, a prefill's share them by
# fours). Measured on the quick start's shapes: 4 against 2 / 8 / 16 (a decode pays for the
# empty slots, a prefill gathers its keys once per tile).
QUERY_TILE = 4
# keys per chunk (a multiple of QUERY_TILE): a tile's keys are whole chunks, one GEMM each
KEY_TILE = 32


@dataclass(frozen=True)
class _TilePlan:
    """Where each row sits and what each GEMM reads: the index work of one (tables, lengths),
    which every layer of a pass shares (the cache keeps those values' bytes beside it). nt tiles
    of QUERY_TILE slots; P (tile, chunk) pairs, the tiles' last chunks first (pair t: tile t's),
    then their other chunks, tile by tile. Every index is over a flat view, so a call's gathers
    and scatters are one index op each."""

    pair_tile: torch.Tensor    # [P]
    peak_index: torch.Tensor   # pair_tile expanded over [P, kv_heads * tq * group, 1] (scatter_reduce_'s)
    q_rows: torch.Tensor       # [P * kv_heads * tq] rows of q viewed [n * kv_heads, group * dim]
    key_rows: torch.Tensor     # [P * kv_heads * KEY_TILE] rows of the cache viewed [-1, head_dim]
    value_rows: torch.Tensor   # key_rows, then the diagonal blocks' rows, [nt, kv_heads, tq slots, tq keys]
    value_zero: torch.Tensor   # those zeroed: the last chunks' from the diagonal on, the diagonal's past the slot
    last_past: torch.Tensor    # the last chunks' scores past the slot's length, [nt, kv_heads, tq, group, kt] flat
    diag_weights: torch.Tensor  # [nt * kv_heads * tq * group] rows of the weights viewed [-1, tq]: the diagonal block's
    out_rows: torch.Tensor     # [n * kv_heads] rows of the output viewed [-1, group * dim]
    num_tiles: int


# the latest plans, newest last: a pass's layers share one, the drafter's steps want a few more
_PLANS: dict[tuple[object, ...], _TilePlan] = {}
_MAX_PLANS = 8
_V = TypeVar("_V")


def _recall(cache: dict[tuple[object, ...], _V], key: tuple[object, ...]) -> _V | None:
    """cache[key] made the newest entry, or None: the plan caches' lookup (_PLANS, _CHUNKS)."""
    value = cache.pop(key, None)
    if value is not None:
        cache[key] = value
    return value


def _remember(cache: dict[tuple[object, ...], _V], key: tuple[object, ...], value: _V) -> None:
    """cache[key] = value as the newest entry, the oldest dropped past _MAX_PLANS."""
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > _MAX_PLANS:
        del cache[next(iter(cache))]
# the steps a decode plan's miss builds ahead: the CPU chain's k = 3 steps find theirs, a decode
# pass's next three theirs while the tables stand (a step's plan costs ~20% of one built alone)
AHEAD = 3


def _tile_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan | None:
    """The plan of (tables, lengths), from the cache when an earlier call had the same values
    (every layer of a pass asks for the same one): keyed by the values' bytes, so a hit is that
    plan (the engine writes the same tensors in place between calls), and a miss costs a few
    byte compares, not a torch.equal per cached plan. A miss of a pass of lone rows (a decode,
    the drafter's chain) also caches the plans of the next AHEAD steps (every length + 1 a
    step, the same tables): the chain's next steps and the next decode pass find theirs. None
    when a row has no keys."""
    lens = lengths.numpy()
    head = (block_size, kv_heads, group, QUERY_TILE, KEY_TILE, tables.dtype, tables.shape, lengths.dtype)
    tab = tables.numpy().tobytes()
    key = (*head, lens.tobytes(), tab)
    hit = _recall(_PLANS, key)
    if hit is not None:
        return hit
    if int(lens.min()) <= 0:
        return None
    plans = _make_plans(tables, lengths, block_size, kv_heads, group, 1 + AHEAD)
    for step in range(len(plans) - 1, 0, -1):  # the step's own plan newest
        _remember(_PLANS, (*head, (lens + step).tobytes(), tab), plans[step])
    _remember(_PLANS, key, plans[0])
    return plans[0]


def _make_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan:
    """The plan of (tables, lengths): `_make_plans`' first."""
    return _make_plans(tables, lengths, block_size, kv_heads, group, 1)[0]


def _make_plans(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
                group: int, steps: int) -> list[_TilePlan]:
    """Built in numpy on the host (small integer arithmetic, where a numpy op costs a
    microsecond or two and a torch op several: the drafter's chain builds one every step, its
    lengths growing by one), each finished index made an int64 tensor once. A pass whose rows
    are each alone in their tile (a decode, the drafter's chain) is `_alone_plans`': the plans
    of lengths, lengths + 1, ... (up to `steps`, fewer where a row would leave its tables or its
    last key chunk), at once; any other pass `_shared_plan`'s, one plan (it gives a pass of lone
    rows the same values: the tests check it)."""
    tab, length = tables.numpy(), lengths.numpy().astype(np.int64, copy=False)
    n = length.shape[0]
    last = length - 1                                   # the row's own position
    block = last // QUERY_TILE
    new = np.empty(n, dtype=bool)  # a tile: consecutive rows of one table and one block, positions rising
    new[0] = True
    if n > 1:
        new[1:] = (tab[1:] != tab[:-1]).any(1) | (block[1:] != block[:-1]) | (last[1:] <= last[:-1])
        if not new.all():
            return [_shared_plan(tab, length, last, block, last - block * QUERY_TILE, new, block_size, kv_heads, group)]
    return _alone_plans(tab, length, block_size, kv_heads, group, steps)


def _shared_plan(tab: NDArray[np.integer], length: NDArray[np.int64], last: NDArray[np.int64],
                 block: NDArray[np.int64], slot: NDArray[np.int64], new: NDArray[np.bool_], block_size: int,
                 kv_heads: int, group: int) -> _TilePlan:
    """_make_plan of any pass: `new` marks each tile's first row."""
    n, tq, kt, m = length.shape[0], QUERY_TILE, KEY_TILE, QUERY_TILE * group
    firsts = np.flatnonzero(new)                        # the tiles' first rows
    nt = firsts.shape[0]
    tile, at = np.cumsum(new) - 1, np.arange(nt)
    base = block[firsts] * tq                           # [nt] the diagonal block's first key
    slot_len = np.repeat(base[:, None] + 1, tq, 1)      # an empty slot sees 0..base (finite)
    slot_len[tile, slot] = length
    slot_row = np.repeat(firsts[:, None], tq, 1)        # an empty slot's query: its tile's first row
    slot_row[tile, slot] = np.arange(n)
    longest = slot_len.max(1) - 1                       # the tile's longest row's last key
    last_chunk = base // kt                             # the chunk holding base, the tile's last
    part = (base - last_chunk * kt) // tq               # the block's QUERY_TILE-key part of it
    full = int(last_chunk.sum())
    if full:  # the chunks before the last, tile by tile
        full_tile = np.repeat(at, last_chunk)
        full_chunk = np.arange(full) - np.repeat(np.cumsum(last_chunk) - last_chunk, last_chunk)
        pair_tile, pair_chunk = np.concatenate((at, full_tile)), np.concatenate((last_chunk, full_chunk))
    else:
        pair_tile, pair_chunk = at, last_chunk
    heads = _arange(kv_heads)[:, None]
    keys = pair_chunk[:, None] * kt + _arange(kt)       # [P, kt]
    # a key past the tile's longest row reads that row's last key instead (masked or zeroed all
    # the same): table entries past a sequence's rows may name no block (padding, a sentinel)
    pos = np.minimum(keys, longest[pair_tile, None])
    blk = pos // block_size
    rows = (tab[firsts[pair_tile, None], blk].astype(np.int64) * block_size + (pos - blk * block_size)) * kv_heads
    split = rows.size * kv_heads
    # the values' rows: the chunks' (key_rows), then the diagonal block's (tile, head, slot, key),
    # the last chunk's rows, zeroed past the slot
    value_rows = np.empty(split + nt * kv_heads * tq * tq, dtype=np.int64)
    key_rows = value_rows[:split].reshape(-1, kv_heads, kt)
    np.add(rows[:, None], heads, out=key_rows)          # [P, kv_heads, kt]: rows of the cache view
    diag = rows[:nt].reshape(nt, kt // tq, tq)[at, part]                    # [nt, tq keys]
    value_rows[split:].reshape(nt, kv_heads, tq, tq)[...] = (diag[:, None] + heads)[:, :, None]
    # the masks written whole by their comparisons (no broadcast copies); their flat indices are
    # what index_fill_ takes
    first = keys[:nt, None, None, None]                 # [nt, 1, 1, 1, kt] the last chunks' keys
    past = np.empty((nt, kv_heads, tq, group, kt), dtype=bool)  # the scores past a slot's length
    np.greater_equal(first, slot_len[:, None, :, None, None], out=past)
    # the values zeroed: the last chunks' from base on, then (after the other chunks', none
    # zeroed) the diagonal block's past each slot, so one flatnonzero gives the index
    zero = np.zeros(value_rows.shape[0], dtype=bool)
    np.greater_equal(first[:, :, 0, 0], base[:, None, None], out=zero[:nt * kv_heads * kt].reshape(nt, kv_heads, kt))
    np.greater_equal((base[:, None] + _arange(tq))[:, None, None], slot_len[:, None, :, None],
                     out=zero[split:].reshape(nt, kv_heads, tq, tq))
    q_rows = slot_row[pair_tile][:, None] * kv_heads + heads
    pair = torch.from_numpy(pair_tile)
    return _TilePlan(
        pair_tile=pair,
        peak_index=pair.view(-1, 1, 1).expand(-1, kv_heads * m, 1),
        q_rows=_index(q_rows), key_rows=torch.from_numpy(value_rows[:split]), value_rows=torch.from_numpy(value_rows),
        value_zero=torch.from_numpy(np.flatnonzero(zero)),
        last_past=torch.from_numpy(np.flatnonzero(past)),
        diag_weights=_index((at[:, None] * (kv_heads * m) + _arange(kv_heads * m)) * (kt // tq) + part[:, None]),
        out_rows=_index((tile[:, None] * kv_heads + heads[:, 0]) * tq + slot[:, None]), num_tiles=nt)


@dataclass(frozen=True)
class _Chunks:
    """What of a decode pass's plan (every row alone in its tile, tile i row i) its tables and
    each row's last chunk decide, and its lengths do not: the (tile, chunk) pairs, the query
    slots' rows, and the key rows of every chunk before a row's last (all below its diagonal
    block, so no clamp to its length reaches them). The drafter's chain (lengths + 1 a step)
    keeps one until a row's diagonal block enters its next chunk: one step in KEY_TILE a row."""

    pair_tile: torch.Tensor      # [P] as _TilePlan's
    peak_index: torch.Tensor
    q_rows: torch.Tensor
    last_keys: NDArray[np.int64]  # [n, KEY_TILE] the last chunks' key positions
    full_rows: NDArray[np.int64] | None  # [P - n, kv_heads, KEY_TILE] key_rows past the first n pairs


# the latest decode passes' chunks, newest last (keyed like _PLANS, by values' bytes)
_CHUNKS: dict[tuple[object, ...], _Chunks] = {}


def _chunks(tab: NDArray[np.integer], last_chunk: NDArray[np.int64], block_size: int, kv_heads: int,
            group: int) -> _Chunks:
    """The _Chunks of (tables, last chunks), from the cache when a recent pass had those values."""
    key = (block_size, kv_heads, group, tab.dtype, tab.shape, last_chunk.tobytes(), tab.tobytes())
    c = _recall(_CHUNKS, key)
    if c is None:
        c = _make_chunks(tab, last_chunk, block_size, kv_heads, group)
        _remember(_CHUNKS, key, c)
    return c


def _make_chunks(tab: NDArray[np.integer], last_chunk: NDArray[np.int64], block_size: int, kv_heads: int,
                 group: int) -> _Chunks:
    """_make_plan's pairs, query rows and key rows of the chunks before the last, for a pass of
    lone rows (the same values: tests/ops/test_row_invariant_plan_builder.py)."""
    n, tq, kt = last_chunk.shape[0], QUERY_TILE, KEY_TILE
    at = np.arange(n)
    heads = _arange(kv_heads)[:, None]
    full = int(last_chunk.sum())
    full_rows = None
    if full:  # the chunks before the last, tile by tile
        full_tile = np.repeat(at, last_chunk)
        full_chunk = np.arange(full) - np.repeat(np.cumsum(last_chunk) - last_chunk, last_chunk)
        pair_tile = np.concatenate((at, full_tile))
        pos = full_chunk[:, None] * kt + _arange(kt)   # below the row's diagonal block: no clamp
        blk = pos // block_size
        rows = (tab[full_tile[:, None], blk].astype(np.int64) * block_size + (pos - blk * block_size)) * kv_heads
        full_rows = rows[:, None] + heads
    else:
        pair_tile = at
    pair = torch.from_numpy(pair_tile)
    return _Chunks(
        pair_tile=pair, peak_index=pair.view(-1, 1, 1).expand(-1, kv_heads * tq * group, 1),
        q_rows=_index(np.repeat(((pair_tile * kv_heads)[:, None] + heads[:, 0]).reshape(-1), tq)),
        last_keys=last_chunk[:, None] * kt + _arange(kt), full_rows=full_rows)


def _alone_plans(tab: NDArray[np.integer], length: NDArray[np.int64], block_size: int, kv_heads: int,
                 group: int, steps: int) -> list[_TilePlan]:
    """_make_plan of a pass whose rows are each alone in their tile (tile i is row i, every slot
    of it that row's query, its longest row itself), for lengths + 0, 1, ... up to `steps` (fewer
    where a row's next position leaves its tables or its last key chunk moves), all steps in one
    set of numpy calls (their cost is per call, not per element): the same values as one built
    alone. The length-free part (_Chunks) comes from its cache; the rest is what the lengths
    move: the last chunks' rows (clamped to the row's length), the diagonal blocks, the masks,
    the slots."""
    n, tq, kt, m = length.shape[0], QUERY_TILE, KEY_TILE, QUERY_TILE * group
    at, heads = _arange(n), _arange(kv_heads)[:, None]
    length = length + _arange(steps)[:, None]           # [S, n]
    last = length - 1                                   # the row's own position
    block = last // tq
    slot = last - block * tq
    base = block * tq                                   # the diagonal block's first key
    last_chunk = base // kt                             # the chunk holding base, the row's last
    # the steps that keep step 0's chunks and stay inside the tables
    keep = (last_chunk == last_chunk[0]).all(1) & (last // block_size < tab.shape[1]).all(1)
    steps = 1 + int(keep[1:].cumprod().sum())
    length, last, slot, base = length[:steps], last[:steps], slot[:steps], base[:steps]
    part = (base - last_chunk[0] * kt) // tq            # the block's QUERY_TILE-key part of it
    c = _chunks(tab, last_chunk[0], block_size, kv_heads, group)
    keys = c.last_keys                                  # [n, kt]
    # a key past the row reads the row's last key instead (masked or zeroed all the same): table
    # entries past a sequence's rows may name no block (padding, a sentinel)
    pos = np.minimum(keys, last[:, :, None])            # [S, n, kt]
    blk = pos // block_size
    rows = (tab[at[:, None], blk].astype(np.int64) * block_size + (pos - blk * block_size)) * kv_heads
    split = c.pair_tile.shape[0] * kv_heads * kt
    width = split + n * kv_heads * tq * tq
    value_rows = np.empty((steps, width), dtype=np.int64)
    key_rows = value_rows[:, :split].reshape(steps, -1, kv_heads, kt)
    np.add(rows[:, :, None], heads, out=key_rows[:, :n])  # the last chunks first, as _make_plan's pairs
    if c.full_rows is not None:
        key_rows[:, n:] = c.full_rows
    diag = rows.reshape(steps, n, kt // tq, tq)[_arange(steps)[:, None], at, part]  # [S, n, tq keys]
    value_rows[:, split:].reshape(steps, n, kv_heads, tq, tq)[...] = (diag[:, :, None] + heads)[:, :, :, None]
    # an empty slot sees 0..base (finite), the row's slot its length
    slot_len = np.where(_arange(tq) == slot[:, :, None], length[:, :, None], base[:, :, None] + 1)
    first = keys[:, None, None, None]                   # [n, 1, 1, 1, kt]
    past = np.empty((steps, n, kv_heads, tq, group, kt), dtype=bool)
    np.greater_equal(first, slot_len[:, :, None, :, None, None], out=past)
    zero = np.zeros((steps, width), dtype=bool)
    np.greater_equal(first[:, :, 0, 0], base[:, :, None, None],
                     out=zero[:, :n * kv_heads * kt].reshape(steps, n, kv_heads, kt))
    np.greater_equal((base[:, :, None] + _arange(tq))[:, :, None, None], slot_len[:, :, None, :, None],
                     out=zero[:, split:].reshape(steps, n, kv_heads, tq, tq))
    diag_weights = (at[:, None] * (kv_heads * m) + _arange(kv_heads * m)) * (kt // tq) + part[:, :, None]
    out_rows = (at[:, None] * kv_heads + heads[:, 0]) * tq + slot[:, :, None]
    return [_TilePlan(
        pair_tile=c.pair_tile, peak_index=c.peak_index, q_rows=c.q_rows,
        key_rows=torch.from_numpy(value_rows[i, :split]), value_rows=torch.from_numpy(value_rows[i]),
        value_zero=torch.from_numpy(zero[i].nonzero()[0]), last_past=torch.from_numpy(past[i].reshape(-1).nonzero()[0]),
        diag_weights=torch.from_numpy(diag_weights[i].reshape(-1)), out_rows=torch.from_numpy(out_rows[i].reshape(-1)),
        num_tiles=n) for i in range(steps)]


@lru_cache(maxsize=16)
def _arange(n: int) -> NDArray[np.int64]:
    """np.arange(n), made once per n (read only: every use makes a new array from it)."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


def _index(a: NDArray[np.int64]) -> torch.Tensor:
    """An index array as the int64 tensor torch's index ops take (flat, contiguous)."""
    return torch.from_numpy(np.ascontiguousarray(a.reshape(-1), dtype=np.int64))
