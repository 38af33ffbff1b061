"""ops.row_invariant's decode plan (`_alone_plans`: every row alone in its tile, a decode or the
drafter's chain) against the general one (`_shared_plan`, which any pass may take): issue 20, the
chain's lengths grow by one a step, so every step missed the plan cache. The decode plan keeps
what only the tables and each row's last key chunk decide (`_Chunks`: the pairs, the query rows,
the key rows of the chunks before the last), builds only what the lengths move, and a miss
builds the next AHEAD steps' plans too (lengths + 1, + 2, ...: the chain's next steps and the
next decode pass find theirs). Every plan, built or built ahead, must hold the general plan's
indices, so the attention the same bits: checked field for field on chains across QUERY_TILE
block and KEY_TILE chunk boundaries (from length 1, from a table's last rows), decode rows of
random lengths, tables written in place between steps, and bitwise through the attention (fp32
/ fp16 / bf16, 1 and 2 threads) with NaN queries, non-finite keys and values past the rows,
table entries naming no block past them and rows of no keys; a row's bits are also those it
has alone (row invariance).
"""
import math

import numpy as np
import pytest
import torch

from draft_circuit.ops import row_invariant, row_invariant_plan
from draft_circuit.ops.row_invariant import KEY_TILE, QUERY_TILE, TILED_DTYPES, row_invariant_attention

# (heads, kv_heads, head_dim, block_size): the embedded default, a block smaller than a chunk, one
# that divides nothing, MHA, MQA with an odd head size, a block past a chunk
SHAPES = [(4, 2, 32, 16), (4, 2, 32, 8), (6, 2, 24, 5), (8, 8, 16, 16), (7, 1, 20, 3), (2, 1, 128, 64)]
MAX_LEN = 3 * KEY_TILE + 9
FIELDS = ("pair_tile", "peak_index", "q_rows", "key_rows", "value_rows", "value_zero", "last_past",
          "diag_weights", "out_rows")
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SENTINEL = 10 ** 6  # a table entry naming no block


def _general(tables, lengths, block, kv_heads, group):
    """The general plan of a pass of lone rows (every row its own tile)."""
    tab, length = tables.numpy(), lengths.numpy().astype(np.int64)
    last = length - 1
    blk = last // QUERY_TILE
    return row_invariant._shared_plan(tab, length, last, blk, last - blk * QUERY_TILE,
                                      np.ones(length.shape[0], dtype=bool), block, kv_heads, group)


def _same(got, want, what):
    assert got.num_tiles == want.num_tiles, what
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), f"{what}: {name}"


def _tables(block, seqs, g, sentinel_past=None):
    """Tables of `seqs` sequences holding MAX_LEN rows each; with sentinel_past, the entries past
    each sequence's first sentinel_past rows name no block."""
    cols = -(-MAX_LEN // block)
    tables = torch.randperm(seqs * cols + 3, generator=g)[:seqs * cols].view(seqs, cols).int()
    if sentinel_past is not None:
        tables[:, -(-sentinel_past // block):] = SENTINEL
    return tables


def _chains(block, g):
    """(tables, lengths, what): the drafter's chains (every length + 1 a step) of widths 1..5,
    and decode rows of random lengths."""
    tables = _tables(block, 5, g)
    for width in (1, 2, 3, 4, 5):
        seqs = torch.randperm(5, generator=g)[:width]
        for start in ([1] * width, [MAX_LEN - 6] * width, torch.randint(1, MAX_LEN - 6, (width,), generator=g).tolist(),
                      [KEY_TILE - 3 + i for i in range(width)], [2 * KEY_TILE - 1 - 2 * i for i in range(width)],
                      [QUERY_TILE * (i + 1) - 1 for i in range(width)]):
            lengths = torch.tensor(start)
            for step in range(7):
                yield tables[seqs], lengths + step, f"chain width {width} from {start} step {step}"
    for _ in range(30):
        n = int(torch.randint(1, 9, (1,), generator=g))
        yield tables[torch.randperm(5, generator=g)[:min(n, 5)]], torch.randint(1, MAX_LEN + 1, (min(n, 5),), generator=g), "decode"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_the_decode_plan_has_the_general_plans_indices(shape):
    """Through the cache, as the attention asks: a chain's steps get plans built ahead."""
    heads, kv_heads, _, block = shape
    group = heads // kv_heads
    g = torch.Generator().manual_seed(sum(shape))
    row_invariant._CHUNKS.clear()
    row_invariant._PLANS.clear()
    count = 0
    for tables, lengths, what in _chains(block, g):
        for lens in (lengths, lengths.int()):  # the engine's int64, and int32
            _same(row_invariant._make_plan(tables, lens, block, kv_heads, group),
                  _general(tables, lens, block, kv_heads, group), what)
            _same(row_invariant._tile_plan(tables, lens, block, kv_heads, group),
                  _general(tables, lens, block, kv_heads, group), what + " (cached)")
        count += 1
    assert count > 200
    assert len(row_invariant._CHUNKS) <= row_invariant._MAX_PLANS
    assert len(row_invariant._PLANS) <= row_invariant._MAX_PLANS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_plans_are_built_ahead_only_inside_the_tables_and_the_last_chunk(shape):
    heads, kv_heads, _, block = shape
    group = heads // kv_heads
    g = torch.Generator().manual_seed(sum(shape) + 2)
    tables = _tables(block, 3, g)
    end = tables.shape[1] * block  # the tables' capacity: the last row a table holds
    for lengths, want in (([1, 2, 3], 4), ([KEY_TILE, 5, 9], 1), ([KEY_TILE - 1, 5, 9], 2),
                          ([2 * KEY_TILE - 3, 5, 9], 4), ([end, 5, 9], 1), ([end - 1, 5, 9], 2)):
        lens = torch.tensor(lengths)
        plans = row_invariant._make_plans(tables, lens, block, kv_heads, group, 4)
        assert len(plans) == want, lengths
        for step, plan in enumerate(plans):
            _same(plan, _general(tables, lens + step, block, kv_heads, group), f"{lengths} + {step}")
    # a pass that shares a tile (a verify) gets its one plan
    assert len(row_invariant._make_plans(tables[[0, 0]], torch.tensor([9, 10]), block, kv_heads, group, 4)) == 1


def test_the_chunks_are_kept_along_a_chain_and_follow_the_tables(monkeypatch):
    """A chain's steps share their _Chunks until a row's last chunk moves (one step in
    KEY_TILE) and find the plans built ahead; tables written in place (a block allocated, a row
    moved) get chunks and plans of their new values, and every plan stays the general one's."""
    built, misses = [], []
    make, plans = row_invariant_plan._make_chunks, row_invariant_plan._make_plans
    monkeypatch.setattr(row_invariant_plan, "_make_chunks", lambda *a: built.append(a[1].copy()) or make(*a))
    monkeypatch.setattr(row_invariant_plan, "_make_plans", lambda *a: misses.append(a[1].clone()) or plans(*a))
    g = torch.Generator().manual_seed(3)
    tables, lengths = _tables(16, 4, g), torch.tensor([1, 20, 33, 41])
    row_invariant._CHUNKS.clear()
    row_invariant._PLANS.clear()
    steps = 2 * KEY_TILE
    for step in range(steps):
        lens = lengths + step
        _same(row_invariant._tile_plan(tables, lens, 16, 2, 2), _general(tables, lens, 16, 2, 2), f"step {step}")
    # one chunk build per distinct (last chunk of every row) along the chain
    distinct = {tuple(((lengths + s - 1) // QUERY_TILE * QUERY_TILE // KEY_TILE).tolist()) for s in range(steps)}
    assert len(built) == len(distinct)
    # a miss every 1 + AHEAD steps, or where a row's last chunk moves
    assert steps // (1 + row_invariant.AHEAD) <= len(misses) <= steps // (1 + row_invariant.AHEAD) + len(distinct)
    before, lens = len(built), lengths + 40
    row_invariant._make_plan(tables, lens, 16, 2, 2)
    assert len(built) == before  # found again by value
    tables[2, 1] = tables[3, 3]  # in place: a block read by a chunk before row 2's last
    _same(row_invariant._tile_plan(tables, lens, 16, 2, 2), _general(tables, lens, 16, 2, 2), "table written in place")
    _same(row_invariant._tile_plan(tables, lens + 1, 16, 2, 2), _general(tables, lens + 1, 16, 2, 2), "the next step")
    assert len(built) == before + 1
    assert len(row_invariant._CHUNKS) <= row_invariant._MAX_PLANS


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_the_decode_attention_has_the_general_plans_bits(shape, dtype, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        heads, kv_heads, dim, block = shape
        group = heads // kv_heads
        g = torch.Generator().manual_seed(sum(shape) + 5)
        tables = _tables(block, 5, g)
        blocks = 5 * tables.shape[1] + 3
        kc = torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype)
        vc = torch.randn(blocks, block, kv_heads, dim, generator=g).to(dtype)
        general = lambda tabs, lens, bs, kvh, grp: (_general(tabs, lens, bs, kvh, grp) if bool((lens > 0).all()) else None)
        for i, (tabs, lengths, what) in enumerate(_chains(block, g)):
            if i % 3 != 0 and "decode" not in what:
                continue
            n = lengths.numel()
            q = (torch.randn(n, heads * dim, generator=g) * 3).to(dtype)
            k, v = kc, vc
            if i % 2 == 0:  # non-finite keys and values past every row: its last chunk, its diagonal block
                k, v = kc.clone(), vc.clone()
                for s in range(n):
                    for pos in {int(lengths[s]), int(lengths[s]) + 1, (int(lengths[s]) // QUERY_TILE + 1) * QUERY_TILE - 1}:
                        if pos < MAX_LEN:
                            b = int(tabs[s, pos // block])
                            k[b, pos % block], v[b, pos % block] = float("nan"), float("inf") * (-1) ** pos
            if i % 4 == 1:  # table entries past the rows name no block
                tabs = tabs.clone()
                for s in range(n):
                    tabs[s, -(-int(lengths[s]) // block):] = SENTINEL
            if i % 5 == 0:
                q[0] = float("nan")
            if i % 7 == 3:  # a row of no keys (the softmax over nothing)
                lengths = lengths.clone()
                lengths[-1] = 0
            scale = 0.3 if i % 2 else 1 / math.sqrt(dim)
            row_invariant._PLANS.clear()
            got = row_invariant_attention(q, k, v, tabs, lengths, scale)
            assert torch.equal(row_invariant_attention(q, k, v, tabs, lengths, scale).view(BITS[dtype]),
                               got.view(BITS[dtype])), f"{what}: cached plan"
            with monkeypatch.context() as m:
                m.setattr(row_invariant, "_tile_plan", general)
                want = row_invariant_attention(q, k, v, tabs, lengths, scale)
            assert got.dtype == dtype and torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype])), what
            for s in range(n):  # each row's bits those it has alone
                alone = row_invariant_attention(q[s:s + 1], k, v, tabs[s:s + 1], lengths[s:s + 1], scale)
                assert torch.equal(alone.view(BITS[dtype]), got[s:s + 1].view(BITS[dtype])), f"{what}: row {s}"
    finally:
        torch.set_num_threads(before)
