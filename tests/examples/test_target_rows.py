"""`TargetRunner._rows`: each pass row's RoPE position and block table, from each sequence's
`PaddedBlocks.row` and one array expression (issue 20's host window), equal to the rule written
plainly (a sequence's `table_row` and `range(num_cached, num_cached + count)`) for mixed counts,
tables of several lengths and a count of 0; a sequence whose rows would pass its storage is
refused by id."""
import numpy as np
import pytest

from draft_circuit.runners.kv_cache import BlockPool, PaddedBlocks
from examples.engine.runner import SCRATCH_BLOCK, TargetRunner
from examples.engine.sequence import Request, Sequence


class _Model:  # what _rows reads of the target model: its KV layout's table width
    class kv:
        max_blocks_per_seq = 6


def _seqs(pool, cached):
    seqs = []
    for i, (rows, room) in enumerate(cached):
        blocks = PaddedBlocks(pool, 4, 6, SCRATCH_BLOCK)
        blocks.ensure_rows(room)
        blocks.set_rows(rows)
        seqs.append(Sequence(i, Request([1], 8), blocks))
    return seqs


def test_rows_are_the_plain_rule():
    pool = BlockPool(40, reserved=1)
    pool.alloc(3)  # tables that do not start at block 1
    seqs = _seqs(pool, [(5, 9), (0, 4), (13, 24), (2, 3)])
    counts = [4, 3, 0, 1]
    positions, tables = TargetRunner(_Model())._rows(seqs, counts)  # type: ignore[arg-type]
    want_pos = [p for s, c in zip(seqs, counts) for p in range(s.num_cached, s.num_cached + c)]
    want_tab = [s.blocks.table_row(SCRATCH_BLOCK) for s, c in zip(seqs, counts) for _ in range(c)]
    assert positions.dtype == np.int32 and positions.tolist() == want_pos
    assert tables.dtype == np.int32 and tables.tolist() == want_tab


def test_rows_past_a_sequences_storage_are_refused_by_id():
    pool = BlockPool(40, reserved=1)
    seqs = _seqs(pool, [(5, 8), (6, 8)])
    with pytest.raises(RuntimeError, match="sequence 1: 9 rows exceed the 8 reserved for it"):
        TargetRunner(_Model())._rows(seqs, [1, 3])  # type: ignore[arg-type]
