"""A batched CPU x @ w^T whose every row has the bits it has alone: the references' linear.

A BLAS picks its kernel by the GEMM's shape, so `torch.mm` gives a row different bits at different
row counts (MKL's fp32 sgemm: at 1..15 rows against 16 and more). Run at one fixed shape instead,
the rows are independent: the input is padded with zero rows to a multiple of ROW_TILE and
multiplied one ROW_TILE-row tile at a time, so every GEMM call has the same shape whatever the
row count, and a row's result depends on neither the other rows, nor their count, nor its
position. That is measured, not argued: tests/ops/test_row_invariant.py checks a row alone
against the same row at every position of batches of 1..3 * ROW_TILE rows, bitwise, for the
engine's and the drafter's shapes and odd ones, fp32 / fp16 / bf16, at 1 and 2 threads.
Elsewhere (another device or dtype, where nothing was measured) it stays one row at a time,
each row copied first (gemv's path depends on the vector's address), and a row per weight read.

Its attention, `row_invariant_attention`, is batched the same way (fixed-shape tiles of query
rows and key chunks), measured the same way (tests/ops/test_attention_row_invariant.py); at a
decode's shapes its cost is per-op dispatch, so its index plan is built in numpy once per
(tables, lengths) and each call is a few dozen flat-indexed torch ops (issue 20).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from numpy.typing import NDArray

# rows per GEMM call; a verify of k + 1 rows (or a batch's decode rows) fits in a tile or two,
# so it reads each weight once or twice instead of once per row (issue 20)
ROW_TILE = 8
# where row invariance was measured (tests/ops/test_row_invariant.py)
TILED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def tiled(x: torch.Tensor) -> bool:
    """Whether `row_invariant_linear` runs x @ w^T in tiles (else one row at a time)."""
    return x.device.type == "cpu" and x.dtype in TILED_DTYPES


def row_invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w [N, K]^T -> [n, N] in x's dtype (x and w of one dtype and device), each row's
    bits those it gets alone, whatever the other rows are, how many, and where it sits."""
    if not tiled(x):
        out = x.new_empty(x.shape[0], w.shape[0])
        for i in range(x.shape[0]):
            # a fresh copy: MKL's float64 gemv takes another path (other bits) for a vector at an
            # address a row of a batch has and a row alone has not (measured: [97, 131])
            torch.mv(w, x[i].clone(), out=out[i])
        return out
    n, k = x.shape
    wt = w.t()  # a view: the GEMM reads w transposed, never a copy of it
    pad = -n % ROW_TILE
    x = torch.cat((x, x.new_zeros(pad, k))) if pad else x.contiguous()
    if x.shape[0] == ROW_TILE:
        return torch.mm(x, wt)[:n]
    out = x.new_empty(x.shape[0], w.shape[0])
    for start in range(0, x.shape[0], ROW_TILE):
        torch.mm(x[start:start + ROW_TILE], wt, out=out[start:start + ROW_TILE])
    return out[:n]


# ---- attention ----
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
_PLANS: list[tuple[tuple[object, ...], _TilePlan]] = []
_MAX_PLANS = 8


def _tile_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan | None:
    """The plan of (tables, lengths), from the cache when an earlier call had the same values
    (every layer of a pass asks for the same one): keyed by the values' bytes, so a hit is that
    plan (the engine writes the same tensors in place between calls), and a miss (the drafter's
    chain, its lengths one longer every step) costs a few byte compares, not a torch.equal per
    cached plan. None when a row has no keys."""
    lens = lengths.numpy()
    key = (block_size, kv_heads, group, QUERY_TILE, KEY_TILE, tables.dtype, tables.shape, lengths.dtype,
           lens.tobytes(), tables.numpy().tobytes())
    for i in range(len(_PLANS) - 1, -1, -1):
        if _PLANS[i][0] == key:
            _PLANS.append(_PLANS.pop(i))
            return _PLANS[-1][1]
    if int(lens.min()) <= 0:
        return None
    plan = _make_plan(tables, lengths, block_size, kv_heads, group)
    _PLANS.append((key, plan))
    del _PLANS[:-_MAX_PLANS]
    return plan


def _make_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan:
    """Built in numpy on the host (small integer arithmetic, where a numpy op costs a
    microsecond or two and a torch op several: the drafter's chain builds one every step, its
    lengths growing by one), each finished index made an int64 tensor once. A pass whose rows
    are each alone in their tile (a decode, the drafter's chain) is `_alone_plan`'s, any other
    `_shared_plan`'s (which gives a pass of lone rows the same values: the tests check it)."""
    tab, length = tables.numpy(), lengths.numpy().astype(np.int64, copy=False)
    n = length.shape[0]
    last = length - 1                                   # the row's own position
    block = last // QUERY_TILE
    slot = last - block * QUERY_TILE
    new = np.empty(n, dtype=bool)  # a tile: consecutive rows of one table and one block, positions rising
    new[0] = True
    if n > 1:
        new[1:] = (tab[1:] != tab[:-1]).any(1) | (block[1:] != block[:-1]) | (last[1:] <= last[:-1])
        if not new.all():
            return _shared_plan(tab, length, last, block, slot, new, block_size, kv_heads, group)
    return _alone_plan(tab, length, last, block, slot, block_size, kv_heads, group)


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
    c = _CHUNKS.pop(key, None)
    if c is None:
        c = _make_chunks(tab, last_chunk, block_size, kv_heads, group)
    _CHUNKS[key] = c
    if len(_CHUNKS) > _MAX_PLANS:
        del _CHUNKS[next(iter(_CHUNKS))]
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


def _alone_plan(tab: NDArray[np.integer], length: NDArray[np.int64], last: NDArray[np.int64],
                block: NDArray[np.int64], slot: NDArray[np.int64], block_size: int, kv_heads: int,
                group: int) -> _TilePlan:
    """_make_plan of a pass whose rows are each alone in their tile (tile i is row i, every slot
    of it that row's query, its longest row itself): the same values, the length-free part
    (_Chunks) from its cache, so a chain's step builds only what its lengths move: the last
    chunks' rows (clamped to the row's length), the diagonal blocks, the masks, the slots."""
    n, tq, kt, m = length.shape[0], QUERY_TILE, KEY_TILE, QUERY_TILE * group
    base = block * tq                                   # [n] the diagonal block's first key
    last_chunk = base // kt                             # the chunk holding base, the row's last
    part = (base - last_chunk * kt) // tq               # the block's QUERY_TILE-key part of it
    c = _chunks(tab, last_chunk, block_size, kv_heads, group)
    at, heads = _arange(n), _arange(kv_heads)[:, None]
    keys = c.last_keys                                  # [n, kt]
    # a key past the row reads the row's last key instead (masked or zeroed all the same): table
    # entries past a sequence's rows may name no block (padding, a sentinel)
    pos = np.minimum(keys, last[:, None])
    blk = pos // block_size
    rows = (tab[at[:, None], blk].astype(np.int64) * block_size + (pos - blk * block_size)) * kv_heads
    split = c.pair_tile.shape[0] * kv_heads * kt
    value_rows = np.empty(split + n * kv_heads * tq * tq, dtype=np.int64)
    key_rows = value_rows[:split].reshape(-1, kv_heads, kt)
    np.add(rows[:, None], heads, out=key_rows[:n])      # the last chunks first, as _make_plan's pairs
    if c.full_rows is not None:
        key_rows[n:] = c.full_rows
    diag = rows.reshape(n, kt // tq, tq)[at, part]      # [n, tq keys]
    value_rows[split:].reshape(n, kv_heads, tq, tq)[...] = (diag[:, None] + heads)[:, :, None]
    # an empty slot sees 0..base (finite), the row's slot its length
    slot_len = np.where(_arange(tq) == slot[:, None], length[:, None], base[:, None] + 1)
    first = keys[:, None, None, None]                   # [n, 1, 1, 1, kt]
    past = np.empty((n, kv_heads, tq, group, kt), dtype=bool)
    np.greater_equal(first, slot_len[:, None, :, None, None], out=past)
    zero = np.zeros(value_rows.shape[0], dtype=bool)
    np.greater_equal(first[:, :, 0, 0], base[:, None, None], out=zero[:n * kv_heads * kt].reshape(n, kv_heads, kt))
    np.greater_equal((base[:, None] + _arange(tq))[:, None, None], slot_len[:, None, :, None],
                     out=zero[split:].reshape(n, kv_heads, tq, tq))
    return _TilePlan(
        pair_tile=c.pair_tile, peak_index=c.peak_index, q_rows=c.q_rows,
        key_rows=torch.from_numpy(value_rows[:split]), value_rows=torch.from_numpy(value_rows),
        value_zero=torch.from_numpy(zero.nonzero()[0]), last_past=torch.from_numpy(past.reshape(-1).nonzero()[0]),
        diag_weights=_index((at[:, None] * (kv_heads * m) + _arange(kv_heads * m)) * (kt // tq) + part[:, None]),
        out_rows=_index((at[:, None] * kv_heads + heads[:, 0]) * tq + slot[:, None]), num_tiles=n)


@lru_cache(maxsize=16)
def _arange(n: int) -> NDArray[np.int64]:
    """np.arange(n), made once per n (read only: every use makes a new array from it)."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


def _index(a: NDArray[np.int64]) -> torch.Tensor:
    """An index array as the int64 tensor torch's index ops take (flat, contiguous)."""
    return torch.from_numpy(np.ascontiguousarray(a.reshape(-1), dtype=np.int64))


def row_invariant_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention of each row of q [n, heads * head_dim] over the first lengths[i] >= 0 KV
    rows of its table (caches [num_blocks, block_size, kv_heads, head_dim]), in fp32, cast to
    q's dtype; each row's bits those it gets alone.

    A row at position p = lengths - 1 sits in slot p % QUERY_TILE of a tile: the consecutive
    rows with its table and its p // QUERY_TILE (a decode row alone, a verify's or a prefill's
    rows together), whose diagonal block starts at base = p - p % QUERY_TILE. The tile's keys
    0..base + QUERY_TILE - 1 are KEY_TILE-key chunks, each one fixed-shape GEMM per KV head for
    the whole tile, batched over every tile's chunks (bmm treats its batch entries alike, and a
    fixed-shape GEMM its rows: measured; an empty slot computes a copy of a row beside it, never
    read). Only the last chunk holds keys past a row: their scores are -inf, so exp gives
    exactly 0. The row's max is exact in any order; its sums run in an order fixed by its own
    length: the last chunk's, then the others' in order (index_add_), values from base on
    zeroed for the whole tile, then the diagonal block's, its values past the row zeroed row by
    row (a later row's non-finite value never meets this row's zero weight). Neither the other
    rows, nor their count, nor other tiles reach a row: tests/ops/test_attention_row_invariant.py.
    The calls are few (dispatch, not arithmetic, is the cost at a decode's shapes): every index
    comes from the plan, flat, and fp32 inputs skip their casts.
    """
    block_size, kv_heads, dim = kc.shape[1:]
    n, heads = q.shape[0], q.shape[1] // dim
    if n == 0:
        return q.new_empty(0, heads * dim)
    group, tq, kt = heads // kv_heads, QUERY_TILE, KEY_TILE
    p = _tile_plan(tables, lengths, block_size, kv_heads, group)
    if p is None:  # a row of no keys: the softmax over nothing, zero weights
        keep = lengths > 0
        out = torch.zeros_like(q)
        if bool(keep.any()):
            out[keep] = row_invariant_attention(q[keep], kc, vc, tables[keep], lengths[keep], scale)
        return out
    nt, m, gd, fp32 = p.num_tiles, tq * group, group * dim, torch.float32
    keys = kc.reshape(-1, dim).index_select(0, p.key_rows)
    vals = vc.reshape(-1, dim).index_select(0, p.value_rows)
    qs = q * scale if q.dtype == fp32 else q.float() * scale
    if keys.dtype != fp32:
        keys, vals = keys.float(), vals.float()
    qb = qs.view(-1, gd).index_select(0, p.q_rows).view(-1, m, dim)    # [P * kv_heads, m, dim]
    scores = torch.bmm(qb, keys.view(-1, kt, dim).transpose(1, 2))
    scores.view(-1).index_fill_(0, p.last_past, float("-inf"))
    scores = scores.view(-1, kv_heads * m, kt)                          # [P, kv_heads * m, kt]
    peak = scores.new_empty(nt, kv_heads * m, 1).scatter_reduce_(
        0, p.peak_index, scores.amax(-1, keepdim=True), "amax", include_self=False)
    weights = scores.sub_(peak.index_select(0, p.pair_tile)).exp_()
    # the chunks' values from the diagonal block on (it has its own GEMM), its values past each slot
    vals.index_fill_(0, p.value_zero, 0.0)
    split = p.key_rows.shape[0]
    pv = torch.bmm(weights.view(-1, m, kt), vals[:split].view(-1, kt, dim))
    pv_sum = pv.new_zeros(nt, kv_heads * m * dim).index_add_(0, p.pair_tile, pv.view(-1, kv_heads * m * dim))
    denom = pv.new_zeros(nt, kv_heads * m).index_add_(0, p.pair_tile, weights.sum(-1))
    dweights = weights.view(-1, tq).index_select(0, p.diag_weights)   # [nt * kv_heads * m, tq]
    dpv = torch.bmm(dweights.view(-1, group, tq), vals[split:].view(-1, tq, dim))
    o = pv_sum.add_(dpv.view(nt, -1)).view(nt, kv_heads * m, dim).div_(denom.unsqueeze(-1))
    out = o.view(-1, gd).index_select(0, p.out_rows).view(n, heads * dim)
    return out if q.dtype == fp32 else out.to(q.dtype)
