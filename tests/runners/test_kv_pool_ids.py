"""Block ids are tied to their pool (issue 19 item 16): a host holding two pools (drafter and
target) cannot free, install or table one pool's blocks into the other; plain ints still work."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from draft_circuit.runners.kv_cache import BlockId, BlockPool, ForeignBlock, SequenceBlocks


def test_alloc_hands_out_tagged_ids_that_act_as_ints():
    pool = BlockPool(8, reserved=1, name="drafter")
    ids = pool.alloc(3)
    assert ids == [1, 2, 3] and all(isinstance(b, BlockId) and b.pool == pool.serial for b in ids)
    assert torch.tensor(ids).tolist() == [1, 2, 3] and hash(ids[0]) == hash(1) and repr(ids) == "[1, 2, 3]"
    assert pickle.loads(pickle.dumps(ids[0])).pool == pool.serial
    assert copy.deepcopy(ids)[1].pool == pool.serial


def test_another_pools_ids_are_foreign_and_change_nothing():
    drafter, target = BlockPool(8, reserved=1, name="drafter"), BlockPool(8, reserved=1, name="target")
    mine, theirs = drafter.alloc(2), target.alloc(2)  # same int values: 1, 2
    free_before = (drafter.num_free, target.num_free)
    with pytest.raises(ForeignBlock, match="pool 'target', not by 'drafter'"):
        drafter.free(theirs)
    table = SequenceBlocks(drafter, 4, 4)
    with pytest.raises(ForeignBlock):
        table.install(theirs, 5)
    assert table.is_empty and (drafter.num_free, target.num_free) == free_before
    drafter.free(mine)
    target.free([int(b) for b in theirs])  # untagged ints: the host's own responsibility
    assert drafter.num_free == target.num_free == 7


def test_take_and_install_keep_the_tag():
    pool, other = BlockPool(8, reserved=1), BlockPool(8, reserved=1)
    a = SequenceBlocks(pool, 4, 4)
    a.ensure_rows(6)
    a.set_rows(6)
    blocks, rows = a.take()
    assert all(isinstance(b, BlockId) and b.pool == pool.serial for b in blocks)
    b = SequenceBlocks(other, 4, 4)
    with pytest.raises(ForeignBlock):
        b.install(blocks, rows)
    c = SequenceBlocks(pool, 4, 4)
    assert c.install(blocks, rows) and c.num_rows == 6
    c.free()
    assert pool.num_free == 7
