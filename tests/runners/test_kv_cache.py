"""The KV block pool and block tables: conservation and no double ownership under random use
(a hypothesis state machine), every refusal leaves everything unchanged, one test per fault
(FAULTS.md 17-20)."""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from draft_circuit.runners.kv_cache import (
    BlockInUse, BlockOutOfRange, BlockPool, DoubleFree, ForeignBlock, KVCacheError, PaddedBlocks,
    PoolExhausted, RowOutOfRange, SequenceBlocks, TableTooLong, ensure_rows_all,
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PoolMachine(RuleBasedStateMachine):
    """A model of who owns what: `loose` groups are caller-held, `seqs` hold their own tables.

    Every rule predicts success or the exact error from the model alone, and on an error checks
    that pool and tables are exactly as before.
    """

    @initialize(num_blocks=st.integers(1, 20), reserved=st.integers(0, 2),
                block_size=st.integers(1, 4), max_blocks=st.integers(1, 6),
                num_seqs=st.integers(1, 3), padded=st.booleans())
    def setup(self, num_blocks: int, reserved: int, block_size: int, max_blocks: int,
              num_seqs: int, padded: bool) -> None:
        reserved = min(reserved, num_blocks)
        self.pool = BlockPool(num_blocks, reserved=reserved)
        # PaddedBlocks (a reserved pad needed) keep their row through every rule: the invariant
        # below holds it equal to table_row after each
        self.seqs = [PaddedBlocks(self.pool, block_size, max_blocks, 0) if padded and reserved
                     else SequenceBlocks(self.pool, block_size, max_blocks)
                     for _ in range(num_seqs)]
        self.loose: list[list[int]] = []
        self.freed_once: set[int] = set()  # handed out at some point and free now
        self.initial_free = self.pool.num_free
        assert self.initial_free == num_blocks - reserved

    # --- helpers ---------------------------------------------------------------------------

    def owned(self) -> list[int]:
        return [b for g in self.loose for b in g] + [b for s in self.seqs for b in s.blocks]

    def snapshot(self) -> tuple:
        n = self.pool.num_blocks
        return (self.pool.num_free, tuple(self.pool.is_allocated(b) for b in range(n)),
                tuple((s.blocks, s.num_rows) for s in self.seqs))

    def expect_error(self, error: type[KVCacheError], call, *args) -> None:
        before = self.snapshot()
        with pytest.raises(error):
            call(*args)
        assert self.snapshot() == before

    def note_freed(self, blocks) -> None:
        self.freed_once.update(blocks)

    # --- caller-held blocks ----------------------------------------------------------------

    @rule(count=st.integers(0, 12))
    def alloc(self, count: int) -> None:
        if count > self.pool.num_free:
            self.expect_error(PoolExhausted, self.pool.alloc, count)
            return
        got = self.pool.alloc(count)
        assert len(got) == count and got == sorted(got)
        assert not set(got) & set(self.owned())
        self.freed_once -= set(got)
        self.loose.append(got)

    @rule(data=st.data())
    def free_loose(self, data) -> None:
        if not self.loose:
            return
        group = self.loose.pop(data.draw(st.integers(0, len(self.loose) - 1)))
        keep = data.draw(st.lists(st.sampled_from(group), unique=True)) if group else []
        self.pool.free([b for b in group if b not in keep])
        self.note_freed(b for b in group if b not in keep)
        if keep:
            self.loose.append(keep)

    @rule(data=st.data())
    def free_with_one_bad_id(self, data) -> None:
        """A valid batch spoiled by one bad id frees nothing, and the error names the fault."""
        good = data.draw(st.sampled_from(self.loose)) if self.loose else []
        n = self.pool.num_blocks
        bad = data.draw(st.integers(-2, n + 1) | st.sampled_from(good or [-1]))
        if bad in good:
            error = DoubleFree  # named twice in one call
        elif not 0 <= bad < n:
            error = BlockOutOfRange
        elif bad < self.pool.num_reserved:
            error = ForeignBlock
        elif any(bad in s.blocks for s in self.seqs):
            error = BlockInUse
        elif bad in self.owned():
            return  # another caller-held group: freeing it would be legitimate
        elif bad in self.freed_once:
            error = DoubleFree
        else:
            error = ForeignBlock
        batch = list(good) + [bad]
        data.draw(st.randoms()).shuffle(batch)
        self.expect_error(error, self.pool.free, batch)

    # --- block tables ----------------------------------------------------------------------

    @rule(i=st.integers(0, 2), rows=st.integers(0, 26))
    def ensure_rows(self, i: int, rows: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        grow = _ceil_div(rows, seq.block_size) - len(seq.blocks)
        if _ceil_div(rows, seq.block_size) > seq.max_blocks:
            self.expect_error(TableTooLong, seq.ensure_rows, rows)
        elif grow > self.pool.num_free:
            self.expect_error(PoolExhausted, seq.ensure_rows, rows)
        else:
            before = seq.blocks
            seq.ensure_rows(rows)
            assert seq.blocks[:len(before)] == before and seq.capacity_rows >= rows
            self.freed_once -= set(seq.blocks)

    @rule(i=st.integers(0, 2), rows=st.integers(0, 26))
    def set_rows(self, i: int, rows: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        if rows > seq.capacity_rows:
            self.expect_error(RowOutOfRange, seq.set_rows, rows)
        else:
            blocks = seq.blocks
            seq.set_rows(rows)
            assert seq.num_rows == rows and seq.blocks == blocks  # shrinking keeps storage

    @rule(i=st.integers(0, 2))
    def release_unused(self, i: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        keep = _ceil_div(seq.num_rows, seq.block_size)
        gone = seq.blocks[keep:]
        assert seq.release_unused() == len(gone)
        assert len(seq.blocks) == keep
        self.note_freed(gone)

    @rule(i=st.integers(0, 2))
    def take(self, i: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        expected = (list(seq.blocks), seq.num_rows)
        assert seq.take() == expected
        assert seq.is_empty and seq.blocks == () and seq.num_rows == 0
        if expected[0]:
            self.loose.append(expected[0])

    @rule(i=st.integers(0, 2), data=st.data())
    def install(self, i: int, data) -> None:
        seq = self.seqs[i % len(self.seqs)]
        if not self.loose:
            return
        g = data.draw(st.integers(0, len(self.loose) - 1))
        blocks = self.loose[g]
        rows = data.draw(st.integers(0, len(blocks) * seq.block_size + 2))
        if not seq.is_empty:
            before = self.snapshot()
            assert seq.install(blocks, rows) is False
            assert self.snapshot() == before
        elif len(blocks) > seq.max_blocks:
            self.expect_error(TableTooLong, seq.install, blocks, rows)
        elif rows > len(blocks) * seq.block_size:
            self.expect_error(RowOutOfRange, seq.install, blocks, rows)
        else:
            assert seq.install(blocks, rows) is True
            assert list(seq.blocks) == blocks and seq.num_rows == rows
            self.loose.pop(g)

    @rule(i=st.integers(0, 2), data=st.data())
    def install_not_callers(self, i: int, data) -> None:
        """Blocks held by a table, freed, reserved or out of range are never adopted."""
        seq = self.seqs[i % len(self.seqs)]
        tabled = [b for s in self.seqs for b in s.blocks]
        n = self.pool.num_blocks
        bad = data.draw(st.integers(-2, n + 1) | st.sampled_from(tabled or [-1]))
        if not seq.is_empty or any(bad in g for g in self.loose):
            return  # a refusal (False) or a legitimate install: covered by `install`
        if not 0 <= bad < n:
            error = BlockOutOfRange
        elif bad in tabled:
            error = BlockInUse
        else:
            error = ForeignBlock  # reserved, freed or never handed out
        good = data.draw(st.sampled_from(self.loose)) if self.loose else []
        self.expect_error(error, seq.install, [*good[:seq.max_blocks - 1], bad], 0)

    @rule(i=st.integers(0, 2))
    def free_table(self, i: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        gone = seq.blocks
        seq.free()
        assert seq.is_empty
        self.note_freed(gone)

    @rule()
    def free_everything(self) -> None:
        self.note_freed(self.owned())
        for group in self.loose:
            self.pool.free(group)
        for seq in self.seqs:
            seq.free()
        self.loose = []
        assert self.pool.num_free == self.initial_free and self.pool.num_used == 0

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def blocks_are_conserved(self) -> None:
        owned = self.owned()
        assert len(owned) == len(set(owned)), f"a block is owned twice: {sorted(owned)}"
        assert self.pool.num_free == self.pool.num_blocks - self.pool.num_reserved - len(owned)
        assert self.pool.num_used == len(owned)
        allocated = {b for b in range(self.pool.num_blocks) if self.pool.is_allocated(b)}
        assert allocated == set(owned)
        assert all(b >= self.pool.num_reserved for b in owned)

    @invariant()
    def tables_point_only_at_real_blocks(self) -> None:
        for seq in self.seqs:
            assert seq.num_rows <= seq.capacity_rows
            assert len(seq.blocks) <= seq.max_blocks
            if self.pool.num_reserved:
                row = seq.table_row(0)
                assert len(row) == seq.max_blocks
                assert all(0 <= b < self.pool.num_blocks for b in row)
                assert row[len(seq.blocks):] == [0] * (seq.max_blocks - len(seq.blocks))
                if isinstance(seq, PaddedBlocks):
                    assert seq.row.tolist() == row, (seq.row, row)

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.free_everything()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# --- one test per fault ----------------------------------------------------------------------


def test_alloc_hands_out_lowest_free_ids_first() -> None:
    pool = BlockPool(6, reserved=1)
    assert pool.alloc(3) == [1, 2, 3]
    pool.free([2])
    assert pool.alloc(2) == [2, 4]
    assert (pool.num_free, pool.num_used) == (1, 4)


def test_double_free_is_refused_and_named() -> None:
    pool = BlockPool(4)
    a, b = pool.alloc(2)
    pool.free([a])
    with pytest.raises(DoubleFree, match=rf"block {a} is already free"):
        pool.free([b, a])
    assert pool.is_allocated(b) and pool.num_free == 3


def test_same_block_twice_in_one_free_frees_nothing() -> None:
    pool = BlockPool(4)
    a, _ = pool.alloc(2)
    with pytest.raises(DoubleFree, match=rf"block {a} appears twice"):
        pool.free([a, a])
    assert pool.is_allocated(a) and pool.num_free == 2


def test_freeing_a_block_never_handed_out_is_foreign() -> None:
    pool = BlockPool(8)
    pool.alloc(2)
    with pytest.raises(ForeignBlock, match=r"block 5 was never handed out"):
        pool.free([5])
    assert pool.num_free == 6


def test_reserved_block_cannot_be_freed_or_allocated() -> None:
    pool = BlockPool(3, reserved=1)
    assert 0 not in pool.alloc(2)
    with pytest.raises(ForeignBlock, match=r"block 0 is reserved"):
        pool.free([0])
    with pytest.raises(PoolExhausted):
        pool.alloc(1)


@pytest.mark.parametrize("bad", [-1, -2, 8, 100, 1.5, "3", None, True])
def test_out_of_range_or_non_integer_ids_are_refused(bad) -> None:
    pool = BlockPool(8)
    held = pool.alloc(3)
    with pytest.raises(BlockOutOfRange, match=r"block id"):
        pool.free(held + [bad])
    assert all(pool.is_allocated(b) for b in held) and pool.num_free == 5
    assert pool.is_allocated(bad) is False


def test_exhausted_pool_takes_nothing() -> None:
    pool = BlockPool(5, reserved=1)
    pool.alloc(3)
    with pytest.raises(PoolExhausted, match=r"requested 2 blocks but only 1 of 5 are free"):
        pool.alloc(2)
    assert pool.num_free == 1 and pool.alloc(1) == [4]


def test_exhausted_pool_leaves_a_growing_table_unchanged() -> None:
    pool = BlockPool(4)
    seq = SequenceBlocks(pool, block_size=2, max_blocks=8)
    seq.ensure_rows(3)  # 2 blocks
    before = (seq.blocks, pool.num_free)
    with pytest.raises(PoolExhausted, match=r"requested 3 blocks but only 2"):
        seq.ensure_rows(10)
    assert (seq.blocks, pool.num_free) == before


def test_install_into_non_empty_table_is_refused() -> None:
    pool = BlockPool(8)
    seq = SequenceBlocks(pool, block_size=4, max_blocks=4)
    seq.ensure_rows(1)
    mine = pool.alloc(2)
    assert seq.install(mine, 5) is False
    assert len(seq.blocks) == 1 and seq.num_rows == 0
    pool.free(mine)  # still the caller's: nothing leaked into the table
    seq.set_rows(1)
    seq.release_unused()
    assert seq.install(pool.alloc(1), 0) is False  # rows alone make a table non-empty


def test_table_longer_than_max_is_refused() -> None:
    pool = BlockPool(16)
    seq = SequenceBlocks(pool, block_size=4, max_blocks=3)
    with pytest.raises(TableTooLong, match=r"4 blocks exceed max_blocks=3"):
        seq.install(pool.alloc(4), 13)
    with pytest.raises(TableTooLong, match=r"13 rows need 4 blocks of 4.*max_blocks=3"):
        seq.ensure_rows(13)
    assert seq.is_empty and pool.num_free == 12
    seq.ensure_rows(12)
    assert len(seq.blocks) == 3


def test_install_validates_blocks_and_rows() -> None:
    pool = BlockPool(8, reserved=1)
    a, b = SequenceBlocks(pool, 2, 4), SequenceBlocks(pool, 2, 4)
    a.ensure_rows(2)
    with pytest.raises(BlockInUse, match=rf"block {a.blocks[0]} is held by a sequence"):
        b.install([a.blocks[0]], 1)
    with pytest.raises(ForeignBlock, match=r"block 0 is reserved"):
        b.install([0], 0)
    with pytest.raises(ForeignBlock, match=r"block 6 was never handed out"):
        b.install([6], 0)
    with pytest.raises(BlockOutOfRange, match=r"block id -1"):
        b.install([-1], 0)
    mine = pool.alloc(2)
    with pytest.raises(RowOutOfRange, match=r"install: 5 rows"):
        b.install(mine, 5)
    with pytest.raises(BlockInUse, match=r"appears twice"):
        b.install([mine[0], mine[0]], 0)
    assert b.is_empty and b.install(mine, 4) and b.num_rows == 4


def test_a_tabled_block_cannot_be_freed_behind_the_tables_back() -> None:
    pool = BlockPool(4)
    seq = SequenceBlocks(pool, 2, 2)
    seq.ensure_rows(2)
    with pytest.raises(BlockInUse):
        pool.free(list(seq.blocks))
    assert pool.is_allocated(seq.blocks[0])


def test_take_then_install_moves_a_sequence_without_leaking() -> None:
    pool = BlockPool(8)
    src, dst = SequenceBlocks(pool, 4, 4), SequenceBlocks(pool, 4, 4)
    src.ensure_rows(7)
    src.set_rows(7)
    blocks, rows = src.take()
    assert (len(blocks), rows) == (2, 7) and src.is_empty
    assert src.take() == ([], 0)
    assert dst.install(blocks, rows) and dst.slot(6) == (blocks[1], 2)
    dst.free()
    assert dst.is_empty and pool.num_free == 8


def test_tables_never_alias_the_callers_lists() -> None:
    pool = BlockPool(8)
    seq = SequenceBlocks(pool, 2, 4)
    mine = pool.alloc(2)
    assert seq.install(mine, 3)
    mine.append(7)  # the caller's list, not the table
    mine[0] = 6
    assert len(seq.blocks) == 2 and seq.blocks[0] != 6
    taken, _ = seq.take()
    taken.append(5)
    assert seq.blocks == () and seq.install(taken[:2], 0)


def test_set_rows_keeps_storage_until_release_unused() -> None:
    pool = BlockPool(8)
    seq = SequenceBlocks(pool, block_size=4, max_blocks=4)
    seq.ensure_rows(10)
    seq.set_rows(10)
    seq.set_rows(5)
    assert len(seq.blocks) == 3 and seq.slot(11)[1] == 3
    assert seq.release_unused() == 1 and len(seq.blocks) == 2 and pool.num_free == 6
    with pytest.raises(RowOutOfRange, match=r"set_rows: 9 rows"):
        seq.set_rows(9)
    with pytest.raises(RowOutOfRange, match=r"row 8 is outside the 8 rows"):
        seq.slot(8)
    with pytest.raises(RowOutOfRange):
        seq.slot(-1)


def test_padded_blocks_pad_only_with_a_reserved_block() -> None:
    pool = BlockPool(6, reserved=1)
    with pytest.raises(ForeignBlock, match="PaddedBlocks: pad block 3 is not a reserved"):
        PaddedBlocks(pool, 2, 4, 3)
    with pytest.raises(ValueError, match="max_blocks must be an int >= 1"):
        PaddedBlocks(pool, 2, -1, 0)
    t = PaddedBlocks(pool, 2, 4, 0)
    t.ensure_rows(3)
    assert t.row.dtype.name == "int32" and t.row.tolist() == t.table_row(0) == [1, 2, 0, 0]
    with pytest.raises(ValueError, match="read-only"):
        t.row[0] = 5  # a caller cannot make it disagree with the table
    other = PaddedBlocks(pool, 2, 4, 0)  # ensure_rows_all's one draw extends each table
    ensure_rows_all([t, other], [7, 2])
    assert t.row.tolist() == t.table_row(0) == [1, 2, 3, 4] and other.row.tolist() == [5, 0, 0, 0]
    assert repr(t).startswith("PaddedBlocks(")
    twin = copy.deepcopy(t)  # a copied table's row follows the copy, read-only still
    twin.release_unused()
    assert twin.row.tolist() == twin.table_row(0) == [0, 0, 0, 0] and t.row.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="read-only"):
        twin.row[0] = 5


def test_table_row_pads_only_with_a_reserved_block() -> None:
    pool = BlockPool(6, reserved=1)
    seq = SequenceBlocks(pool, block_size=2, max_blocks=4)
    seq.ensure_rows(3)
    assert seq.table_row(0) == [*seq.blocks, 0, 0]
    with pytest.raises(BlockOutOfRange, match=r"block id -1"):
        seq.table_row(-1)  # the sentinel that stale padded rows once read
    with pytest.raises(ForeignBlock, match=r"pad block 3 is not a reserved"):
        seq.table_row(3)
    with pytest.raises(ForeignBlock, match=r"reserved ids: none"):
        SequenceBlocks(BlockPool(2), 1, 2).table_row(1)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=-1), dict(num_blocks=4, reserved=5),
                                    dict(num_blocks=2.0)])
def test_bad_pool_config_is_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        BlockPool(**kwargs)
