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
which is row-invariant by construction and a row per weight read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
            torch.mv(w, x[i], out=out[i])
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
    """Where each row sits and what each chunk reads: the index work of one (tables, lengths),
    which every layer of a pass shares. nt tiles of QUERY_TILE slots; P (tile, chunk) pairs, the
    tiles' last chunks first (pair t: tile t's), then their other chunks, tile by tile."""

    tables: torch.Tensor       # the call's values, to know the next call of the same pass
    lengths: torch.Tensor
    tile: torch.Tensor         # [n] the row's tile
    slot: torch.Tensor         # [n] its slot: its position % QUERY_TILE
    rows: torch.Tensor         # [n] tile * QUERY_TILE + slot
    pair_tile: torch.Tensor    # [P]
    key_rows: torch.Tensor     # [P * kv_heads * KEY_TILE] rows of the cache viewed [-1, head_dim]
    last_past: torch.Tensor    # the last chunks' scores past the slot's length, [nt, kv_heads, tq, group, kt] flat
    last_shared: torch.Tensor  # the last chunks' value rows from the diagonal block on, [nt, kv_heads, kt] flat
    diag_rows: torch.Tensor    # [nt * kv_heads * tq] the diagonal block's rows of the cache view
    diag_vals: torch.Tensor    # [nt * kv_heads * tq slots * tq keys] those rows, a zero row past the slot
    diag_part: torch.Tensor    # [nt] the block's QUERY_TILE-key part of the last chunk
    tiles: torch.Tensor        # [nt] 0..nt - 1
    num_tiles: int


# the latest plans, newest last: a pass's layers share one, the drafter's steps want a few more
_PLANS: list[tuple[tuple[object, ...], _TilePlan]] = []
_MAX_PLANS = 8


def _tile_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan:
    """The plan of (tables, lengths), from the cache when an earlier call had the same values
    (every layer of a pass asks for the same one): values compared, so a hit is that plan."""
    geometry = (block_size, kv_heads, group, QUERY_TILE, KEY_TILE, tables.dtype, tables.shape, lengths.shape)
    for i in range(len(_PLANS) - 1, -1, -1):
        key, plan = _PLANS[i]
        if key == geometry and torch.equal(plan.lengths, lengths) and torch.equal(plan.tables, tables):
            _PLANS.append(_PLANS.pop(i))
            return plan
    plan = _make_plan(tables.clone(), lengths.clone(), block_size, kv_heads, group)
    _PLANS.append((geometry, plan))
    del _PLANS[:-_MAX_PLANS]
    return plan


def _make_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
               group: int) -> _TilePlan:
    n, tq, kt = lengths.shape[0], QUERY_TILE, KEY_TILE
    last = lengths - 1                                  # the row's own position
    block, slot = last // tq, last % tq
    new = torch.ones(n, dtype=torch.bool)
    if n > 1:  # a tile: consecutive rows of one table and one block, slots rising
        new[1:] = (tables[1:] != tables[:-1]).any(1) | (block[1:] != block[:-1]) | (slot[1:] <= slot[:-1])
    tile = new.cumsum(0) - 1
    firsts = new.nonzero().squeeze(1)
    nt = firsts.numel()
    base = block[firsts] * tq                           # [nt] the diagonal block's first key
    last_chunk = base // kt                             # the chunk holding it, the tile's last
    slot_len = (base + 1).unsqueeze(1).expand(nt, tq).clone()  # an empty slot sees 0..base: finite
    slot_len[tile, slot] = lengths
    at = torch.arange(nt)
    full_tile = at.repeat_interleave(last_chunk)        # the chunks before the last, tile by tile
    starts = last_chunk.cumsum(0) - last_chunk
    full_chunk = torch.arange(full_tile.numel()) - starts.repeat_interleave(last_chunk)
    pair_tile, pair_chunk = torch.cat((at, full_tile)), torch.cat((last_chunk, full_chunk))
    table = tables[firsts].long()
    heads = torch.arange(kv_heads)
    # a key past the tile's longest row reads that row's last key instead (masked or zeroed all
    # the same): table entries past a sequence's rows may name no block (padding, a sentinel)
    read_max = slot_len.amax(1) - 1                     # [nt]

    def cache_rows(tiles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[m] tiles, [m, k] their positions -> [m, kv_heads, k] rows of the cache view."""
        positions = torch.minimum(positions, read_max[tiles].unsqueeze(1))
        blocks = table[tiles.unsqueeze(1), positions // block_size]
        return ((blocks * block_size + positions % block_size) * kv_heads).unsqueeze(1) + heads.view(1, -1, 1)

    keys = pair_chunk.unsqueeze(1) * kt + torch.arange(kt)   # [P, kt]
    dpos = base.unsqueeze(1) + torch.arange(tq)              # [nt, tq]
    past = (keys[:nt].view(nt, 1, 1, 1, kt) >= slot_len.view(nt, 1, tq, 1, 1)).expand(nt, kv_heads, tq, group, kt)
    shared = (keys[:nt] >= base.view(nt, 1)).view(nt, 1, kt).expand(nt, kv_heads, kt)
    # diagonal value row (tile, head, slot, key): the gathered block's row, or the zero row after it
    dpast = (dpos.view(nt, 1, 1, tq) >= slot_len.view(nt, 1, tq, 1)).expand(nt, kv_heads, tq, tq)
    drow = (at.view(nt, 1, 1, 1) * kv_heads + heads.view(1, -1, 1, 1)) * tq + torch.arange(tq).view(1, 1, 1, tq)
    return _TilePlan(
        tables=tables, lengths=lengths, tile=tile, slot=slot, rows=tile * tq + slot,
        pair_tile=pair_tile, key_rows=cache_rows(pair_tile, keys).reshape(-1),
        last_past=past.reshape(-1).nonzero().squeeze(1), last_shared=shared.reshape(-1).nonzero().squeeze(1),
        diag_rows=cache_rows(at, dpos).reshape(-1),
        diag_vals=torch.where(dpast, nt * kv_heads * tq, drow.expand(nt, kv_heads, tq, tq)).reshape(-1),
        diag_part=(base % kt) // tq, tiles=at, num_tiles=nt)


def row_invariant_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention of each row of q [n, heads * head_dim] over the first lengths[i] >= 0 KV
    rows of its table (caches [num_blocks, block_size, kv_heads, head_dim]), in fp32, cast to
    q's dtype; each row's bits those it gets alone.

    A row at position p = lengths - 1 sits in slot p % QUERY_TILE of a tile: the consecutive
    rows with its table and its p // QUERY_TILE (a decode row alone, a verify's or a prefill's
    rows together), whose diagonal block starts at base = p - p % QUERY_TILE. The tile's keys
    0..base + QUERY_TILE - 1 are KEY_TILE-key chunks, each one fixed-shape GEMM per KV head for
    the whole tile, batched over every tile's chunks (bmm treats its batch entries alike:
    measured). Only the last chunk holds keys past a row: their scores are -inf, so exp gives
    exactly 0. The row's max is exact in any order; its sums run in an order fixed by its own
    length: the last chunk's, then the others' in order (index_add_), values from base on
    zeroed for the whole tile, then the diagonal block's, its values past the row zeroed row by
    row (a later row's non-finite value never meets this row's zero weight). Neither the other
    rows, nor their count, nor other tiles reach a row: tests/ops/test_attention_row_invariant.py.
    """
    block_size, kv_heads, dim = kc.shape[1:]
    n, heads = q.shape[0], q.shape[1] // dim
    group, tq, kt = heads // kv_heads, QUERY_TILE, KEY_TILE
    keep = lengths > 0
    if not bool(keep.all()):  # a row of no keys: the softmax over nothing, zero weights
        out = torch.zeros_like(q)
        if bool(keep.any()):
            out[keep] = row_invariant_attention(q[keep], kc, vc, tables[keep], lengths[keep], scale)
        return out
    p = _tile_plan(tables, lengths, block_size, kv_heads, group)
    nt, m = p.num_tiles, tq * group
    kflat, vflat = kc.reshape(-1, dim), vc.reshape(-1, dim)
    keys = kflat.index_select(0, p.key_rows).float().view(-1, kt, dim)  # [P * kv_heads, kt, dim]
    vals = vflat.index_select(0, p.key_rows).float().view(-1, kv_heads, kt, dim)
    qt = q.new_zeros(nt * tq, heads * dim, dtype=torch.float32).index_copy_(0, p.rows, q.float() * scale)
    qt = qt.view(nt, tq, kv_heads, group * dim).transpose(1, 2).reshape(nt, kv_heads * m * dim)
    qb = qt.index_select(0, p.pair_tile).view(-1, m, dim)              # [P * kv_heads, m, dim]
    scores = torch.bmm(qb, keys.transpose(1, 2)).view(-1, kv_heads, tq, group, kt)
    scores[:nt].view(-1).index_fill_(0, p.last_past, float("-inf"))
    peak = scores.new_empty(nt, kv_heads, tq, group).scatter_reduce_(
        0, p.pair_tile.view(-1, 1, 1, 1).expand(-1, kv_heads, tq, group), scores.amax(-1), "amax",
        include_self=False)
    weights = scores.sub_(peak.index_select(0, p.pair_tile).unsqueeze(-1)).exp_()
    vals[:nt].view(-1, dim).index_fill_(0, p.last_shared, 0.0)  # the diagonal block's: its own below
    pv = torch.bmm(weights.view(-1, m, kt), vals.view(-1, kt, dim)).view(-1, kv_heads, m, dim)
    pv_sum = pv.new_zeros(nt, kv_heads, m, dim).index_add_(0, p.pair_tile, pv)
    denom = pv.new_zeros(nt, kv_heads, tq, group).index_add_(0, p.pair_tile, weights.sum(-1))
    dvals = torch.cat((vflat.index_select(0, p.diag_rows).float(), vflat.new_zeros(1, dim, dtype=torch.float32)))
    dvals = dvals.index_select(0, p.diag_vals)         # [nt * kv_heads * tq slots * tq keys, dim]
    dweights = weights[:nt].view(nt, kv_heads * m, kt // tq, tq)[p.tiles, :, p.diag_part]
    dpv = torch.bmm(dweights.reshape(-1, group, tq), dvals.view(-1, tq, dim))
    o = (pv_sum + dpv.view(nt, kv_heads, m, dim)).view(nt, kv_heads, tq, group, dim) / denom.unsqueeze(-1)
    return o.view(nt, kv_heads, tq, group * dim)[p.tile, :, p.slot].reshape(n, heads * dim).to(q.dtype)
