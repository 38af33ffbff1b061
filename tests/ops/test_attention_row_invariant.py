"""ops.row_invariant's attention: a row's bits never depend on the rows beside it.

This is what keeps speculation token-exact on CPU (a verify row must equal the decode row the
target alone computes, a prefill chunk's rows the rows decoded one by one), and it rests on
measured properties of the CPU kernels (a batched GEMM treats its batch entries alike, a
fixed-shape GEMM its rows, index_add_ sums in index order), so it is measured here: every row of
passes of 1..3 * KEY_TILE rows (one sequence's consecutive rows, several sequences' runs, a
shuffled mixture with repeats) against the same row alone, bitwise, for the embedded default's
attention shape and odd GQA / MQA / MHA ones and block sizes, in every tiled dtype (float64: the
row-by-row path) and at 1 and 2 threads (CI's count, and the engine's default).
"""
import math

import pytest
import torch

from draft_circuit.ops import row_invariant
from draft_circuit.ops.attention import _attention_row_by_row, decode_attention_ref
from draft_circuit.ops.row_invariant import KEY_TILE, QUERY_TILE, TILED_DTYPES, row_invariant_attention

# (heads, kv_heads, head_dim, block_size): the embedded default (4 q heads of 32 over 2 KV heads,
# blocks of 16), then a block smaller than a key chunk, a block that divides nothing, MHA, MQA
# with an odd head size, wide heads
SHAPES = [(4, 2, 32, 16), (4, 2, 32, 8), (6, 2, 24, 5), (8, 8, 16, 16), (7, 1, 20, 3), (2, 1, 128, 32)]
DTYPES = sorted(TILED_DTYPES, key=str) + [torch.float64]  # float64: the row-by-row path
THREADS = (1, 2)
MAX_LEN = 3 * KEY_TILE + 9  # several chunks, and a table filled to its last row


@pytest.fixture(params=THREADS, ids=lambda t: f"threads{t}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


class Pool:
    """KV caches of three sequences whose tables just hold MAX_LEN rows (a last key chunk runs
    past a table's end) and a probe query for every (sequence, length) pair; `rows` builds a
    pass from such pairs."""

    def __init__(self, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        cols = -(-MAX_LEN // block)
        num_blocks = 3 * cols + 2
        self.kc = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
        self.vc = torch.randn(num_blocks, block, kv_heads, dim, generator=g).to(dtype)
        self.tables = torch.randperm(num_blocks, generator=g)[:3 * cols].view(3, cols).int()
        self.q = (torch.randn(3, MAX_LEN + 1, heads * dim, generator=g) * 3).to(dtype)
        self.g = g

    def rows(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, length >= 1) pairs -> q, block tables, live rows of that pass."""
        seq = torch.tensor([s for s, _ in pairs])
        length = torch.tensor([n for _, n in pairs])
        return self.q[seq, length], self.tables[seq], (length - 1).int()

    def attend(self, pairs: list[tuple[int, int]], row_offset: int = 0) -> torch.Tensor:
        q, tables, live = self.rows(pairs)
        return decode_attention_ref(q, self.kc, self.vc, tables, live - row_offset, None, row_offset)


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    return [i for i in range(want.shape[0]) if not torch.equal(got[i], want[i])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_a_row_has_its_bits_alone_in_every_pass(shape, dtype, threads):
    pool = Pool(*shape, dtype, seed=sum(shape))
    pairs = [(s, n) for s in range(3) for n in range(1, MAX_LEN + 1)]
    alone = {pair: pool.attend([pair])[0] for pair in pairs}

    def check(batch: list[tuple[int, int]], what: str, row_offset: int = 0) -> None:
        got = pool.attend(batch, row_offset)
        bad = _mismatches(got, torch.stack([alone[pair] for pair in batch]))
        assert not bad, (f"{dtype} {shape} at {threads} threads: rows {bad} of {what} "
                         f"({len(batch)} rows) differ from the same rows alone")

    for n in range(1, 3 * KEY_TILE + 1):
        start = int(torch.randint(1, MAX_LEN - n + 2, (1,), generator=pool.g))
        check([(n % 3, start + j) for j in range(n)], "one sequence's consecutive rows")
        runs = [(s, int(torch.randint(1, MAX_LEN - n // 3, (1,), generator=pool.g))) for s in torch.randperm(3, generator=pool.g).tolist()]
        check([(s, first + j) for s, first in runs for j in range(max(1, n // 3))], "three sequences' runs")
        picks = torch.randint(0, len(pairs), (n,), generator=pool.g).tolist()
        if n > 2:
            picks[1] = picks[0]  # the same row twice in a row: one tile cannot hold both
        check([pairs[i] for i in picks], "a shuffled mixture", row_offset=n % 3)


@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
def test_a_prefill_chunk_of_the_default_shape_has_the_decode_rows_bits(dtype, threads):
    """The engine's prefill: three prompts' rows 1..MAX_LEN in one pass, as decode rows."""
    pool = Pool(4, 2, 32, 16, dtype, seed=7)
    batch = [(s, n) for s in range(3) for n in range(1, MAX_LEN + 1)]
    got = pool.attend(batch)
    alone = torch.stack([pool.attend([pair])[0] for pair in batch])
    assert not _mismatches(got, alone)


@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
def test_non_finite_values_past_a_row_never_reach_it(dtype, threads):
    """A later row's key and value (written by the same pass, in the row's own tile) and stale
    rows past every row's length, all NaN or Inf: a row reads only its own rows."""
    pool = Pool(4, 2, 32, 16, dtype, seed=3)
    verify = [(0, n) for n in range(2 * KEY_TILE - 3, 2 * KEY_TILE + 6)]  # rows across a chunk boundary
    alone_before = torch.stack([pool.attend([pair])[0] for pair in verify])
    bad_row = 2 * KEY_TILE + 1  # the row at this position and later ones read it
    for kind in (float("nan"), float("inf"), -float("inf")):
        kc, vc = pool.kc.clone(), pool.vc.clone()
        for pos in (bad_row, bad_row + 2, MAX_LEN - 1):
            block, off = pool.tables[0, pos // kc.shape[1]], pos % kc.shape[1]
            pool.kc[block, off], pool.vc[block, off] = kind, kind
        got = pool.attend(verify)
        alone = torch.stack([pool.attend([pair])[0] for pair in verify])
        pool.kc, pool.vc = kc, vc
        clean = [i for i, (_, n) in enumerate(verify) if n <= bad_row]
        assert not _mismatches(got[clean], alone_before[clean]), f"{kind} past the row changed it"
        assert torch.isfinite(got[clean].float()).all()
        torch.testing.assert_close(got, alone, rtol=0, atol=0, equal_nan=True)  # the rows that read it too
        assert not torch.isfinite(got[len(clean):].float()).all(), "a row that reads the bad row must see it"


@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
def test_non_finite_and_huge_queries_do_not_reach_their_tile_mates(dtype, threads):
    pool = Pool(4, 2, 32, 16, dtype, seed=5)
    batch = [(1, n) for n in range(KEY_TILE, KEY_TILE + 3 * QUERY_TILE)]
    q, tables, live = pool.rows(batch)
    want = torch.stack([pool.attend([pair])[0] for pair in batch])
    odd = {1: float("nan"), 2: float("inf"), QUERY_TILE + 2: 1e4, 2 * QUERY_TILE + 1: -float("inf")}
    for i, value in odd.items():
        q[i] = value
    got = decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0)
    keep = [i for i in range(len(batch)) if i not in odd]
    assert not _mismatches(got[keep], want[keep]), "a NaN / Inf / huge query changed its neighbours"


def test_rows_of_no_keys_are_zero_and_an_empty_pass_is_empty():
    pool = Pool(4, 2, 32, 16, torch.float32, seed=9)
    q, tables, live = pool.rows([(0, 1), (0, 40), (1, 1), (2, 7)])
    out = decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, -1)  # lengths 0, 39, 0, 6
    assert torch.equal(out[[0, 2]], torch.zeros(2, q.shape[1]))
    for i in (1, 3):  # the others: their bits alone, at length live
        alone = decode_attention_ref(q[i:i + 1], pool.kc, pool.vc, tables[i:i + 1], live[i:i + 1] - 1, None, 0)
        assert torch.equal(out[i], alone[0])
    empty = decode_attention_ref(q[:0], pool.kc, pool.vc, tables[:0], live[:0], None, 0)
    assert empty.shape == (0, q.shape[1])


def test_the_plan_cache_follows_the_values_not_the_tensors():
    """The index plan is reused across a pass's layers; a call whose tables or lengths differ in
    value (the same tensor object written in place, or another of the same shape) gets its own."""
    pool = Pool(4, 2, 32, 16, torch.float32, seed=11)
    q, tables, live = pool.rows([(0, 30), (0, 31), (1, 64), (2, 90)])
    first = decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0)
    tables[0] = pool.tables[2]  # in place: row 0 now reads sequence 2
    live += 3
    second = decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0)
    fresh = _attention_row_by_row(q, pool.kc, pool.vc, tables.clone(), (live + 1).tolist(), 1 / math.sqrt(32))
    torch.testing.assert_close(second, fresh, rtol=1e-5, atol=1e-6)
    assert not torch.equal(first, second)
    for shift in range(2 * row_invariant._MAX_PLANS):  # more plans than the cache holds
        decode_attention_ref(q, pool.kc, pool.vc, tables, live - shift - 1, None, 0)
    assert torch.equal(decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0), second)
    assert len(row_invariant._PLANS) <= row_invariant._MAX_PLANS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}b{s[3]}")
def test_it_is_attention(shape):
    """Close to the float64 softmax formula and to the row-by-row path (not bitwise: another order)."""
    heads, kv_heads, dim, block = shape
    pool = Pool(*shape, torch.float32, seed=13)
    batch = [(s, n) for s in range(3) for n in (1, 2, QUERY_TILE, KEY_TILE + 1, MAX_LEN)]
    q, tables, live = pool.rows(batch)
    got = decode_attention_ref(q, pool.kc, pool.vc, tables, live, 0.3, 0)
    for i, (s, n) in enumerate(batch):
        rows = torch.arange(n)
        blocks = pool.tables[s, rows // block].long()
        k = pool.kc[blocks, rows % block].double().repeat_interleave(heads // kv_heads, 1)  # [n, heads, dim]
        v = pool.vc[blocks, rows % block].double().repeat_interleave(heads // kv_heads, 1)
        w = (torch.einsum("hd,nhd->hn", q[i].double().view(heads, dim), k) * 0.3).softmax(-1)
        torch.testing.assert_close(got[i].double(), torch.einsum("hn,nhd->hd", w, v).reshape(-1), rtol=1e-5, atol=1e-5)
    by_row = _attention_row_by_row(q, pool.kc, pool.vc, tables, (live + 1).tolist(), 0.3)
    torch.testing.assert_close(got, by_row, rtol=1e-5, atol=1e-5)


def test_a_pass_is_three_gemm_calls_whatever_its_rows(monkeypatch):
    """The point of the tiles (issue 20): a verify or a prefill is not one GEMM per row."""
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(row_invariant.torch, "bmm", lambda *a, **kw: calls.append(a[0].shape) or bmm(*a, **kw))
    pool = Pool(4, 2, 32, 16, torch.float32, seed=17)
    for batch in ([(0, 50)], [(0, n) for n in range(50, 55)], [(s, n) for s in range(3) for n in range(1, MAX_LEN + 1)]):
        calls.clear()
        pool.attend(batch)
        assert len(calls) == 3, f"{len(batch)} rows: {len(calls)} GEMM calls"
        assert calls[0][1:] == (QUERY_TILE * 2, 32) and calls[1][1:] == (QUERY_TILE * 2, KEY_TILE), calls


def test_a_negative_length_is_still_refused():
    pool = Pool(4, 2, 32, 16, torch.float32, seed=19)
    q, tables, live = pool.rows([(0, 5), (1, 1)])
    with pytest.raises(ValueError, match="row 1: live_rows 0 \\+ row_offset -2"):
        decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, -2)


def test_table_entries_past_a_sequences_rows_are_never_read():
    """Regression (tests/runners/test_draft.py): a key chunk runs past a row's length, and the
    table's columns there may name no block at all (padding, a sentinel); they are not read."""
    pool = Pool(4, 2, 32, 16, torch.float32, seed=23)
    q, tables, live = pool.rows([(0, 20), (0, 21), (1, 3)])
    want = decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0)
    tables[:, 2:] = 10 ** 6  # past rows 0..31: beyond the pool
    assert torch.equal(decode_attention_ref(q, pool.kc, pool.vc, tables, live, None, 0), want)
