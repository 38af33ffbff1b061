"""ops.row_invariant's attention plan, built in numpy (issue 20: a torch op costs several
microseconds at a decode's shapes, and the drafter's chain builds a plan every step), and its
fewer, flat-indexed torch calls: the same index values, and the same output bits, as the torch
formulation they replaced, kept here as the reference. Cases: decode rows (one per sequence,
some of no keys), verify and prefill runs, several sequences' runs, shuffled rows with repeats,
tiles with empty slots, NaN queries, non-finite keys and values past the rows and table
entries naming no block past them; fp32 / fp16 / bf16, 1 and 2 threads.
"""
import math

import pytest
import torch

from draft_circuit.ops import row_invariant
from draft_circuit.ops.row_invariant import KEY_TILE, QUERY_TILE, TILED_DTYPES, row_invariant_attention

SHAPES = [(4, 2, 32, 16), (4, 2, 32, 8), (6, 2, 24, 5), (8, 8, 16, 16), (7, 1, 20, 3), (2, 1, 128, 32)]
MAX_LEN = 3 * KEY_TILE + 9
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _reference_plan(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, kv_heads: int,
                    group: int) -> dict[str, torch.Tensor]:
    """The torch formulation the numpy plan replaced (commit 3d2e2d0), field for field."""
    n, tq, kt = lengths.shape[0], QUERY_TILE, KEY_TILE
    last = lengths - 1
    block, slot = last // tq, last % tq
    new = torch.ones(n, dtype=torch.bool)
    if n > 1:
        new[1:] = (tables[1:] != tables[:-1]).any(1) | (block[1:] != block[:-1]) | (slot[1:] <= slot[:-1])
    tile = new.cumsum(0) - 1
    firsts = new.nonzero().squeeze(1)
    nt = firsts.numel()
    base = block[firsts] * tq
    last_chunk = base // kt
    slot_len = (base + 1).unsqueeze(1).expand(nt, tq).clone()
    slot_len[tile, slot] = lengths
    at = torch.arange(nt)
    full_tile = at.repeat_interleave(last_chunk)
    starts = last_chunk.cumsum(0) - last_chunk
    full_chunk = torch.arange(full_tile.numel()) - starts.repeat_interleave(last_chunk)
    pair_tile, pair_chunk = torch.cat((at, full_tile)), torch.cat((last_chunk, full_chunk))
    table = tables[firsts].long()
    heads = torch.arange(kv_heads)
    read_max = slot_len.amax(1) - 1

    def cache_rows(tiles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = torch.minimum(positions, read_max[tiles].unsqueeze(1))
        blocks = table[tiles.unsqueeze(1), positions // block_size]
        return ((blocks * block_size + positions % block_size) * kv_heads).unsqueeze(1) + heads.view(1, -1, 1)

    keys = pair_chunk.unsqueeze(1) * kt + torch.arange(kt)
    dpos = base.unsqueeze(1) + torch.arange(tq)
    past = (keys[:nt].view(nt, 1, 1, 1, kt) >= slot_len.view(nt, 1, tq, 1, 1)).expand(nt, kv_heads, tq, group, kt)
    shared = (keys[:nt] >= base.view(nt, 1)).view(nt, 1, kt).expand(nt, kv_heads, kt)
    dpast = (dpos.view(nt, 1, 1, tq) >= slot_len.view(nt, 1, tq, 1)).expand(nt, kv_heads, tq, tq)
    drow = (at.view(nt, 1, 1, 1) * kv_heads + heads.view(1, -1, 1, 1)) * tq + torch.arange(tq).view(1, 1, 1, tq)
    return dict(
        tile=tile, slot=slot, rows=tile * tq + slot, pair_tile=pair_tile,
        key_rows=cache_rows(pair_tile, keys).reshape(-1),
        last_past=past.reshape(-1).nonzero().squeeze(1), last_shared=shared.reshape(-1).nonzero().squeeze(1),
        diag_rows=cache_rows(at, dpos).reshape(-1),
        diag_vals=torch.where(dpast, nt * kv_heads * tq, drow.expand(nt, kv_heads, tq, tq)).reshape(-1),
        diag_part=(base % kt) // tq, tiles=at, num_tiles=torch.tensor(nt))


def _reference_attention(q, kc, vc, tables, lengths, scale):
    """The torch formulation of the attention the flat-indexed one replaced (commit 3d2e2d0)."""
    block_size, kv_heads, dim = kc.shape[1:]
    n, heads = q.shape[0], q.shape[1] // dim
    group, tq, kt = heads // kv_heads, QUERY_TILE, KEY_TILE
    keep = lengths > 0
    if not bool(keep.all()):
        out = torch.zeros_like(q)
        if bool(keep.any()):
            out[keep] = _reference_attention(q[keep], kc, vc, tables[keep], lengths[keep], scale)
        return out
    p = _reference_plan(tables, lengths, block_size, kv_heads, group)
    nt, m = int(p["num_tiles"]), tq * group
    kflat, vflat = kc.reshape(-1, dim), vc.reshape(-1, dim)
    keys = kflat.index_select(0, p["key_rows"]).float().view(-1, kt, dim)
    vals = vflat.index_select(0, p["key_rows"]).float().view(-1, kv_heads, kt, dim)
    qt = q.new_zeros(nt * tq, heads * dim, dtype=torch.float32).index_copy_(0, p["rows"], q.float() * scale)
    qt = qt.view(nt, tq, kv_heads, group * dim).transpose(1, 2).reshape(nt, kv_heads * m * dim)
    qb = qt.index_select(0, p["pair_tile"]).view(-1, m, dim)
    scores = torch.bmm(qb, keys.transpose(1, 2)).view(-1, kv_heads, tq, group, kt)
    scores[:nt].view(-1).index_fill_(0, p["last_past"], float("-inf"))
    peak = scores.new_empty(nt, kv_heads, tq, group).scatter_reduce_(
        0, p["pair_tile"].view(-1, 1, 1, 1).expand(-1, kv_heads, tq, group), scores.amax(-1), "amax",
        include_self=False)
    weights = scores.sub_(peak.index_select(0, p["pair_tile"]).unsqueeze(-1)).exp_()
    vals[:nt].view(-1, dim).index_fill_(0, p["last_shared"], 0.0)
    pv = torch.bmm(weights.view(-1, m, kt), vals.view(-1, kt, dim)).view(-1, kv_heads, m, dim)
    pv_sum = pv.new_zeros(nt, kv_heads, m, dim).index_add_(0, p["pair_tile"], pv)
    denom = pv.new_zeros(nt, kv_heads, tq, group).index_add_(0, p["pair_tile"], weights.sum(-1))
    dvals = torch.cat((vflat.index_select(0, p["diag_rows"]).float(), vflat.new_zeros(1, dim, dtype=torch.float32)))
    dvals = dvals.index_select(0, p["diag_vals"])
    dweights = weights[:nt].view(nt, kv_heads * m, kt // tq, tq)[p["tiles"], :, p["diag_part"]]
    dpv = torch.bmm(dweights.reshape(-1, group, tq), dvals.view(-1, tq, dim))
    o = (pv_sum + dpv.view(nt, kv_heads, m, dim)).view(nt, kv_heads, tq, group, dim) / denom.unsqueeze(-1)
    return o.view(nt, kv_heads, tq, group * dim)[p["tile"], :, p["slot"]].reshape(n, heads * dim).to(q.dtype)


def _passes(g: torch.Generator, tables: torch.Tensor, trials: int):
    """(block tables, lengths) of decode, verify, prefill, mixed and shuffled passes."""
    for trial in range(trials):
        n = int(torch.randint(1, 3 * KEY_TILE + 1, (1,), generator=g))
        kind = trial % 4
        if kind == 0:  # one sequence's run: a verify, a prefill chunk
            start = int(torch.randint(1, MAX_LEN - n + 2, (1,), generator=g))
            pairs = [(n % 3, start + j) for j in range(n)]
        elif kind == 1:  # several sequences' runs
            pairs = []
            for s in torch.randperm(3, generator=g).tolist():
                first = int(torch.randint(1, MAX_LEN - n // 3, (1,), generator=g))
                pairs += [(s, first + j) for j in range(max(1, n // 3))]
        elif kind == 2:  # shuffled, the same row twice in a row
            pairs = [(int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(1, MAX_LEN + 1, (1,), generator=g)))
                     for _ in range(n)]
            if n > 2:
                pairs[1] = pairs[0]
        else:  # decode rows, one per sequence (a length 0: a row of no keys)
            pairs = [(s, int(torch.randint(0, MAX_LEN + 1, (1,), generator=g))) for s in range(3)]
        yield tables[torch.tensor([s for s, _ in pairs])], torch.tensor([n for _, n in pairs])
    yield tables[torch.arange(3).repeat_interleave(MAX_LEN)], torch.arange(1, MAX_LEN + 1).repeat(3)  # a prefill


def _tables(shape, g):
    block = shape[3]
    cols = -(-MAX_LEN // block)
    return cols, torch.randperm(3 * cols + 2, generator=g)[:3 * cols].view(3, cols).int()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_the_numpy_plan_has_the_torch_formulations_indices(shape):
    heads, kv_heads, dim, block = shape
    group, tq, kt = heads // kv_heads, QUERY_TILE, KEY_TILE
    g = torch.Generator().manual_seed(sum(shape))
    cols, tables = _tables(shape, g)
    for tabs, lengths in _passes(g, tables, 48):
        if not bool((lengths > 0).all()):
            assert row_invariant._tile_plan(tabs, lengths, block, kv_heads, group) is None
            lengths = lengths.clamp(min=1)
        ref = _reference_plan(tabs, lengths, block, kv_heads, group)
        got = row_invariant._make_plan(tabs, lengths, block, kv_heads, group)
        nt, split = int(ref["num_tiles"]), ref["key_rows"].numel()
        assert got.num_tiles == nt
        for name in ("pair_tile", "key_rows", "last_past"):
            assert torch.equal(getattr(got, name), ref[name]), name
        assert torch.equal(got.peak_index, ref["pair_tile"].view(-1, 1, 1).expand(-1, kv_heads * tq * group, 1))
        # the values: the chunks' rows, then the diagonal's (per slot) where the reference reads them
        assert torch.equal(got.value_rows[:split], ref["key_rows"])
        diag = ref["diag_rows"].view(nt, kv_heads, 1, tq).expand(nt, kv_heads, tq, tq).reshape(-1)
        zero_row = ref["diag_vals"] == nt * kv_heads * tq
        assert torch.equal(got.value_rows[split:][~zero_row], diag[~zero_row])
        assert torch.equal(got.value_zero, torch.cat((ref["last_shared"], split + zero_row.nonzero().squeeze(1))))
        m = tq * group
        weight_rows = (torch.arange(nt).view(-1, 1) * kv_heads * m + torch.arange(kv_heads * m)) * (kt // tq)
        assert torch.equal(got.diag_weights, (weight_rows + ref["diag_part"].view(-1, 1)).reshape(-1))
        h = torch.arange(kv_heads)
        assert torch.equal(got.out_rows, ((ref["tile"].view(-1, 1) * kv_heads + h) * tq + ref["slot"].view(-1, 1)).reshape(-1))
        # a query slot holds its row (the reference's rows), an empty one a row of its own tile
        q_rows = got.q_rows.view(-1, kv_heads, tq)
        assert torch.equal(q_rows % kv_heads, h.view(1, -1, 1).expand_as(q_rows))
        slot_row = torch.full((nt * tq,), -1).index_copy_(0, ref["rows"], torch.arange(lengths.numel()))
        want = slot_row.view(nt, tq)[ref["pair_tile"]]
        real = want >= 0
        assert torch.equal((q_rows[:, 0] // kv_heads)[real], want[real])
        assert torch.equal(ref["tile"][(q_rows[:, 0] // kv_heads)[~real]], ref["pair_tile"].view(-1, 1).expand_as(want)[~real])


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_the_attention_has_the_torch_formulations_bits(shape, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        heads, kv_heads, dim, block = shape
        g = torch.Generator().manual_seed(sum(shape) + 1)
        cols, tables = _tables(shape, g)
        kc = torch.randn(3 * cols + 2, block, kv_heads, dim, generator=g).to(dtype)
        vc = torch.randn(3 * cols + 2, block, kv_heads, dim, generator=g).to(dtype)
        bad_kc, bad_vc = kc.clone(), vc.clone()
        for pos, value in ((2 * KEY_TILE + 1, float("nan")), (2 * KEY_TILE + 3, float("inf")), (MAX_LEN - 1, -float("inf"))):
            bad_kc[tables[0, pos // block], pos % block] = value
            bad_vc[tables[0, pos // block], pos % block] = value
        for i, (tabs, lengths) in enumerate(_passes(g, tables, 20)):
            q = (torch.randn(lengths.numel(), heads * dim, generator=g) * 3).to(dtype)
            if i % 5 == 0:
                q[0] = float("nan")
            k, v = (bad_kc, bad_vc) if i % 3 == 0 else (kc, vc)
            if i % 3 == 1:  # table entries past the rows name no block
                tabs = tabs.clone()
                tabs[:, -(-int(lengths.max()) // block):] = 10 ** 6
            scale = 0.3 if i % 2 else 1 / math.sqrt(dim)
            want = _reference_attention(q, k, v, tabs, lengths, scale)
            row_invariant._PLANS.clear()
            for call in ("plan built", "plan cached"):
                got = row_invariant_attention(q, k, v, tabs, lengths, scale)
                assert got.dtype == dtype and got.shape == want.shape
                assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype])), f"pass {i}, {call}"
    finally:
        torch.set_num_threads(before)
