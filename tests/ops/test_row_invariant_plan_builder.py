"""ops.row_invariant's attention plan builder against the one it replaced (cc8bfde), field for
field: the rewrite (issue 20: a pass whose rows are each alone in their tile, a decode or the
drafter's chain, skips the slot bookkeeping; the values' rows are written in place, fewer copies)
must give every index the same values, so every output keeps its bits. Cases: the drafter's
chain (every row's length growing by one, k steps, across QUERY_TILE block and KEY_TILE chunk
boundaries, from lengths 1 and from a table's last rows), decode rows of random lengths (one
sequence twice in a row too: one tile), verify runs of k + 1 rows, prefill chunks, shuffled rows,
for several (block size, KV heads, group) shapes; and the plan cache still hands a chain's
later step the plan of its values.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from draft_circuit.ops import row_invariant
from draft_circuit.ops.row_invariant import KEY_TILE, QUERY_TILE

# (block_size, kv_heads, group): the embedded default (blocks of 16, 2 KV heads of 2 q heads),
# a block smaller than a chunk, one that divides nothing, MHA, MQA, a block past a chunk
SHAPES = [(16, 2, 2), (8, 2, 2), (5, 2, 3), (16, 8, 1), (3, 1, 7), (64, 1, 2)]
MAX_LEN = 4 * KEY_TILE + 11
FIELDS = ("pair_tile", "peak_index", "q_rows", "key_rows", "value_rows", "value_zero", "last_past",
          "diag_weights", "out_rows")


def _previous_plan(tables, lengths, block_size, kv_heads, group):
    """ops.row_invariant._make_plan at cc8bfde, verbatim but for its names and its return (a
    namespace: the plan no longer holds its tables and lengths, the cache keeps their bytes)."""
    tables, lengths = tables.clone(), lengths.clone()
    tab, length = tables.numpy(), lengths.numpy().astype(np.int64, copy=False)
    n, tq, kt, m = length.shape[0], QUERY_TILE, KEY_TILE, QUERY_TILE * group
    last = length - 1                                   # the row's own position
    block, slot = last // tq, last % tq
    new = np.ones(n, dtype=bool)
    if n > 1:  # a tile: consecutive rows of one table and one block, positions rising
        new[1:] = (tab[1:] != tab[:-1]).any(1) | (block[1:] != block[:-1]) | (last[1:] <= last[:-1])
    tile = np.cumsum(new) - 1
    firsts = np.flatnonzero(new)
    nt = firsts.shape[0]
    base = block[firsts] * tq                           # [nt] the diagonal block's first key
    last_chunk = base // kt                             # the chunk holding it, the tile's last
    part = (base % kt) // tq                            # the block's QUERY_TILE-key part of it
    slot_len = np.repeat(base[:, None] + 1, tq, 1)      # an empty slot sees 0..base: finite
    slot_len[tile, slot] = length
    slot_row = np.repeat(firsts[:, None], tq, 1)        # an empty slot's query: its tile's first row
    slot_row[tile, slot] = np.arange(n)
    at = np.arange(nt)
    full_tile = np.repeat(at, last_chunk)               # the chunks before the last, tile by tile
    full_chunk = np.arange(full_tile.shape[0]) - np.repeat(np.cumsum(last_chunk) - last_chunk, last_chunk)
    pair_tile, pair_chunk = np.concatenate((at, full_tile)), np.concatenate((last_chunk, full_chunk))
    heads = np.arange(kv_heads)[:, None]
    keys = pair_chunk[:, None] * kt + np.arange(kt)     # [P, kt]
    # a key past the tile's longest row reads that row's last key instead (masked or zeroed all
    # the same): table entries past a sequence's rows may name no block (padding, a sentinel)
    pos = np.minimum(keys, slot_len.max(1)[pair_tile, None] - 1)
    rows = (tab[firsts[pair_tile, None], pos // block_size].astype(np.int64) * block_size + pos % block_size) * kv_heads
    key_rows = (rows[:, None] + heads).reshape(-1)      # [P, kv_heads, kt]: rows of the cache view
    # the diagonal block's value (tile, head, slot, key): the last chunk's row, zeroed past the slot
    diag = rows[at[:, None], part[:, None] * tq + np.arange(tq)]           # [nt, tq keys]
    diag_rows = np.broadcast_to((diag[:, None] + heads)[:, :, None], (nt, kv_heads, tq, tq))
    past = keys[:nt, None, None, None] >= slot_len[:, None, :, None, None]  # [nt, 1, tq, 1, kt]
    shared = (keys[:nt] >= base[:, None])[:, None]                          # [nt, 1, kt]
    dpast = (base[:, None] + np.arange(tq))[:, None, None] >= slot_len[:, None, :, None]  # [nt, 1, tq, tq]
    value_zero = np.concatenate((np.flatnonzero(np.broadcast_to(shared, (nt, kv_heads, kt))),
                                 key_rows.shape[0] + np.flatnonzero(np.broadcast_to(dpast, (nt, kv_heads, tq, tq)))))
    pair = torch.from_numpy(pair_tile)
    return SimpleNamespace(
        pair_tile=pair, peak_index=pair.view(-1, 1, 1).expand(-1, kv_heads * m, 1),
        q_rows=row_invariant._index(slot_row[pair_tile][:, None] * kv_heads + heads),
        key_rows=torch.from_numpy(key_rows), value_rows=row_invariant._index(np.concatenate((key_rows, diag_rows.reshape(-1)))),
        value_zero=row_invariant._index(value_zero),
        last_past=row_invariant._index(np.flatnonzero(np.broadcast_to(past, (nt, kv_heads, tq, group, kt)))),
        diag_weights=row_invariant._index((at[:, None] * (kv_heads * m) + np.arange(kv_heads * m)) * (kt // tq) + part[:, None]),
        out_rows=row_invariant._index((tile[:, None] * kv_heads + heads[:, 0]) * tq + slot[:, None]), num_tiles=nt)


def _same(got, want, what):
    assert got.num_tiles == want.num_tiles, what
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), f"{what}: {name}"


def _tables(block, seqs, g):
    cols = -(-MAX_LEN // block)
    return torch.randperm(seqs * cols + 3, generator=g)[:seqs * cols].view(seqs, cols).int()


def _cases(block, g):
    """(tables, lengths, what) of chains, decode rows, verify runs, prefills and shuffled rows."""
    tables = _tables(block, 5, g)
    for width in (1, 2, 3, 4, 5):
        seqs = torch.randperm(5, generator=g)[:width]
        for start in ([1] * width, [MAX_LEN - 4] * width, torch.randint(1, MAX_LEN - 4, (width,), generator=g).tolist(),
                      [KEY_TILE - 2 + i for i in range(width)], [QUERY_TILE * (i + 1) for i in range(width)]):
            lengths = torch.tensor(start)
            for step in range(5):  # the chain: every length + 1 a step
                yield tables[seqs], lengths + step, f"chain width {width} from {start} step {step}"
    for trial in range(40):
        n = int(torch.randint(1, 9, (1,), generator=g))
        seqs = torch.randint(0, 5, (n,), generator=g)
        lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=g)
        if trial % 4 == 0 and n > 1:  # one sequence twice in a row, a position on: one tile, or two
            seqs[1], lengths[1] = seqs[0], min(int(lengths[0]) + 1, MAX_LEN)
        yield tables[seqs], lengths, f"decode {lengths.tolist()}"
        k1 = int(torch.randint(1, 9, (1,), generator=g))  # a verify: k + 1 rows of each sequence
        starts = torch.randint(1, MAX_LEN - k1 + 2, (n,), generator=g)
        lengths = (starts[:, None] + torch.arange(k1)).reshape(-1)
        yield tables[seqs.repeat_interleave(k1)], lengths, f"verify {k1} rows x {n}"
        order = torch.randperm(lengths.numel(), generator=g)  # shuffled, repeats beside each other
        yield tables[seqs.repeat_interleave(k1)][order], lengths[order], f"shuffled {lengths[order].tolist()}"
    for s in range(3):  # prefills: a sequence's rows from 1, or a chunk from a later row
        first = 1 + s * 37
        lengths = torch.arange(first, MAX_LEN + 1)
        yield tables[s].expand(lengths.numel(), -1), lengths, f"prefill from {first}"
    lengths = torch.cat([torch.arange(1, 1 + m) for m in (41, 7, MAX_LEN)])
    yield tables[torch.tensor([0] * 41 + [3] * 7 + [1] * MAX_LEN)], lengths, "prefill of three"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}kv{s[1]}g{s[2]}")
def test_the_plan_has_the_previous_builders_indices(shape):
    block, kv_heads, group = shape
    g = torch.Generator().manual_seed(sum(shape))
    count = 0
    for tables, lengths, what in _cases(block, g):
        for lens in (lengths, lengths.int()):  # the engine's int64, and int32
            _same(row_invariant._make_plan(tables, lens, block, kv_heads, group),
                  _previous_plan(tables, lens, block, kv_heads, group), what)
        count += 1
    assert count > 200


def test_the_cache_follows_the_values_a_chains_steps_each_their_plan():
    """Keyed by the values' bytes: tensors written in place between calls (as the engine does)
    get the plan of their new values, a chain's steps (lengths + 1 each) are each their own
    plan, found again by value, and a row of no keys has none."""
    g = torch.Generator().manual_seed(7)
    tables, lengths = _tables(16, 4, g), torch.tensor([30, 31, 64, 90])
    row_invariant._PLANS.clear()
    plans = [row_invariant._tile_plan(tables, lengths + j, 16, 2, 2) for j in range(4)]
    for j in range(4):
        _same(plans[j], _previous_plan(tables, lengths + j, 16, 2, 2), f"step {j}")
        assert row_invariant._tile_plan(tables, lengths + j, 16, 2, 2) is plans[j]
    saved = tables[0].clone()
    tables[0] = tables[1]  # in place: another table, the same lengths
    other = row_invariant._tile_plan(tables, lengths, 16, 2, 2)
    _same(other, _previous_plan(tables, lengths, 16, 2, 2), "tables written in place")
    tables[0] = saved
    assert row_invariant._tile_plan(tables, lengths, 16, 2, 2) is plans[0]
    assert row_invariant._tile_plan(tables, lengths.int(), 16, 2, 2) is not plans[0]  # another dtype's bytes
    lengths[2] = 0
    assert row_invariant._tile_plan(tables, lengths, 16, 2, 2) is None
    assert len(row_invariant._PLANS) <= row_invariant._MAX_PLANS
