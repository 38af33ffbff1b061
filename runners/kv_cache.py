"""Paged KV bookkeeping: a pool of block ids and per-sequence block tables drawn from it.

Contract: every block is free, reserved, or held by exactly one owner (a caller or one table);
every call either succeeds or raises a `KVCacheError` having changed nothing. The KV tensors
themselves belong to callers.

One module on purpose (it runs past 400 lines): the pool and the tables move blocks between
states through a private protocol (`_take_free`, `_move`, `_extend`, the per-block state array)
that keeps the ownership invariant; `PaddedBlocks` and `ensure_rows_all` use the same protocol.
Split across modules, that protocol would become public surface any caller could break the
invariant through. About a third of the lines are the typed errors and their messages.
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Sequence

import numpy as np

# Per-block states. FREED is kept apart from UNUSED only so that freeing a block twice reads as a
# DoubleFree and freeing one never handed out reads as a ForeignBlock.
_UNUSED, _FREED, _LOOSE, _TABLED, _RESERVED = range(5)
_ALLOCATED = (_LOOSE, _TABLED)


class KVCacheError(Exception):
    """A refused KV-block operation; the message names the block ids, rows and sizes involved."""


class PoolExhausted(KVCacheError):
    """More blocks were asked for than are free; nothing was taken."""


class DoubleFree(KVCacheError):
    """A block already free (or named twice in one call) was freed."""


class ForeignBlock(KVCacheError):
    """A block this pool never handed out, or a reserved one, was freed or installed."""


class BlockOutOfRange(KVCacheError):
    """A block id outside [0, num_blocks), a sentinel such as -1, or not an integer at all."""


class TableTooLong(KVCacheError):
    """A block table would exceed its `max_blocks`."""


class BlockInUse(KVCacheError):
    """A block held by a sequence table was freed directly, or claimed by a second table."""


class RowOutOfRange(KVCacheError):
    """A row count or row index outside the storage a table has."""


class BlockId(int):
    """A block id that remembers the pool it came from (a host holding a drafter pool and a
    target pool cannot free one's blocks into the other). Compares, hashes and indexes as the
    plain int; plain ints are still accepted where a host keeps ids untagged."""

    pool: int  # the serial of the pool that handed it out

    def __new__(cls, value: int, pool: int) -> "BlockId":
        self = super().__new__(cls, value)
        self.pool = pool
        return self

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> tuple[type["BlockId"], tuple[int, int]]:  # pickles and deep-copies with its pool tag
        return (BlockId, (int(self), self.pool))


_POOL_SERIAL = 0
_POOL_NAMES: dict[int, str] = {}  # serial -> name, for the messages that name another pool


class BlockPool:
    """Block ids 0..num_blocks-1; the first `reserved` ids are never handed out nor freed.

    Reserved ids are for scratch (padded rows write there). `alloc` hands out the lowest free ids
    first, in ascending order, so a given history of calls always yields the same ids. Ids are
    `BlockId`s tagged with this pool: another pool's ids are refused as foreign.
    """

    def __init__(self, num_blocks: int, *, reserved: int = 0, name: str = "") -> None:
        if not _is_int(num_blocks) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if not _is_int(reserved) or not 0 <= reserved <= num_blocks:
            raise ValueError(f"reserved must be an int in [0, {num_blocks}], got {reserved!r}")
        global _POOL_SERIAL
        _POOL_SERIAL += 1
        self.serial, self.name = _POOL_SERIAL, name or f"pool#{_POOL_SERIAL}"
        _POOL_NAMES[self.serial] = self.name
        self._num_blocks, self._reserved = num_blocks, reserved
        self._state = bytearray([_RESERVED] * reserved + [_UNUSED] * (num_blocks - reserved))
        self._free_heap = list(range(reserved, num_blocks))  # ascending, hence already a heap
        # each block's tagged id, made the first time it is handed out and reused after (a
        # BlockId is immutable: one object an id serves every hand-out; making one costs more
        # than the rest of a block's allocation)
        self._ids: list[BlockId | None] = [None] * num_blocks

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_reserved(self) -> int:
        return self._reserved

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self._num_blocks - self._reserved - len(self._free_heap)

    def alloc(self, count: int) -> list[int]:
        """`count` blocks, lowest ids first, or PoolExhausted with nothing taken."""
        return self._take_free(count, _LOOSE)

    def free(self, blocks: Sequence[int]) -> None:
        """Return caller-held blocks; every id is checked before any is freed."""
        self._move(blocks, _LOOSE, _FREED, "free")

    def is_allocated(self, block: int) -> bool:
        """True for a block handed out and not yet freed; False for anything else, -1 included."""
        try:
            return self._state[self._block_id(block)] in _ALLOCATED
        except BlockOutOfRange:
            return False

    def __repr__(self) -> str:
        return (f"BlockPool({self.name!r}, num_blocks={self._num_blocks}, reserved={self._reserved}, "
                f"free={self.num_free}, used={self.num_used})")

    # The methods below are the protocol between the pool and SequenceBlocks, which must move
    # blocks in and out of the TABLED state; callers outside this module use alloc/free only.

    def _take_free(self, count: int, state: int) -> list[int]:
        if not _is_int(count) or count < 0:
            raise ValueError(f"block count must be an int >= 0, got {count!r}")
        if count > len(self._free_heap):
            raise PoolExhausted(
                f"requested {count} blocks but only {len(self._free_heap)} of {self._num_blocks} "
                f"are free ({self._reserved} reserved, {self.num_used} in use)")
        taken: list[int] = []
        heap, ids, states = self._free_heap, self._ids, self._state
        for _ in range(count):
            block = heapq.heappop(heap)
            states[block] = state
            tag = ids[block]
            taken.append(tag if tag is not None else self._tag(block))
        return taken

    def _tag(self, block: int) -> BlockId:
        """Block `block`'s id tagged with this pool (made once, then reused)."""
        tag = self._ids[block]
        if tag is None:
            tag = self._ids[block] = BlockId(block, self.serial)
        return tag

    def _move(self, blocks: Iterable[int], expected: int, to: int, action: str) -> list[int]:
        """Move every block from `expected` to `to` state, or raise having moved none."""
        ids = self._checked(blocks, expected, action)
        for block in ids:
            self._state[block] = to
            if to == _FREED:
                heapq.heappush(self._free_heap, block)
        return ids

    def _checked(self, blocks: Iterable[int], expected: int, action: str) -> list[int]:
        blocks = list(blocks)
        ids: list[int] = []
        seen: set[int] = set()
        for raw in blocks:
            block = self._block_id(raw)
            if block in seen:
                kind = DoubleFree if action == "free" else BlockInUse
                raise kind(f"{action}: block {block} appears twice in {blocks!r}")
            seen.add(block)
            if self._state[block] != expected:
                raise self._wrong_state(block, action)
            ids.append(self._tag(block))
        return ids

    def _wrong_state(self, block: int, action: str) -> KVCacheError:
        state = self._state[block]
        if state == _RESERVED:
            return ForeignBlock(f"{action}: block {block} is reserved (ids 0..{self._reserved - 1} "
                                f"are scratch), never handed out")
        if state == _UNUSED:
            return ForeignBlock(f"{action}: block {block} was never handed out by this pool")
        if state == _FREED:
            kind = DoubleFree if action == "free" else ForeignBlock
            return kind(f"{action}: block {block} is already free")
        if state == _TABLED:
            return BlockInUse(f"{action}: block {block} is held by a sequence's block table; "
                              f"release it through that table (free, release_unused or take)")
        return BlockInUse(f"{action}: block {block} is held by the caller, not by a table")

    def _block_id(self, raw: object) -> int:
        if isinstance(raw, bool):  # True would otherwise pass as block 1
            raise BlockOutOfRange(f"block id {raw!r} is a bool, not an integer id")
        try:
            block = operator.index(raw)  # type: ignore[arg-type]
        except TypeError:
            raise BlockOutOfRange(
                f"block id {raw!r} ({type(raw).__name__}) is not an integer") from None
        if not 0 <= block < self._num_blocks:
            raise BlockOutOfRange(f"block id {block} is outside [0, {self._num_blocks})")
        if isinstance(raw, BlockId) and raw.pool != self.serial:
            raise ForeignBlock(f"block {block} was handed out by pool "
                               f"{_POOL_NAMES.get(raw.pool, raw.pool)!r}, not by {self.name!r}")
        return block


class SequenceBlocks:
    """One sequence's block table: row r lives in block `blocks[r // block_size]`.

    `num_rows` counts live rows; storage (`capacity_rows`) may run ahead of it, since a writer
    calls `ensure_rows` before it writes and `set_rows` after. Trimming keeps storage until
    `release_unused`. An empty table has no blocks and no rows.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int) -> None:
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not _is_int(max_blocks) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self.pool, self.block_size, self.max_blocks = pool, block_size, max_blocks
        self._blocks: list[int] = []
        self._num_rows = 0

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def capacity_rows(self) -> int:
        return len(self._blocks) * self.block_size

    @property
    def is_empty(self) -> bool:
        return not self._blocks and self._num_rows == 0

    def ensure_rows(self, rows: int) -> None:
        """Grow the table so rows 0..rows-1 have storage; never shrinks, never changes num_rows."""
        self._check_rows(rows, self.max_blocks * self.block_size, "ensure_rows", TableTooLong)
        needed = -(-rows // self.block_size) - len(self._blocks)
        if needed > 0:
            self._extend(self.pool._take_free(needed, _TABLED))

    def _extend(self, blocks: list[int]) -> None:
        """Append freshly taken blocks to the table (the one way a table grows; a subclass that
        mirrors the table elsewhere follows here)."""
        self._blocks += blocks

    def set_rows(self, rows: int) -> None:
        """Set the live row count within existing storage; shrinking frees nothing."""
        self._check_rows(rows, self.capacity_rows, "set_rows", RowOutOfRange)
        self._num_rows = rows

    def release_unused(self) -> int:
        """Free the blocks wholly past `num_rows`; returns how many were freed."""
        keep = -(-self._num_rows // self.block_size)
        self.pool._move(self._blocks[keep:], _TABLED, _FREED, "release_unused")
        freed, self._blocks = len(self._blocks) - keep, self._blocks[:keep]
        return freed

    def take(self) -> tuple[list[int], int]:
        """Hand the blocks (now the caller's to free or install) and rows out; leaves it empty."""
        blocks, rows = self._blocks, self._num_rows
        self.pool._move(blocks, _TABLED, _LOOSE, "take")
        self._blocks, self._num_rows = [], 0
        return blocks, rows

    def install(self, blocks: Sequence[int], rows: int) -> bool:
        """Adopt caller-held blocks holding `rows` rows; False (nothing changed) unless empty."""
        if not self.is_empty:
            return False
        if len(blocks) > self.max_blocks:
            raise TableTooLong(f"install: {len(blocks)} blocks exceed max_blocks={self.max_blocks}")
        self._check_rows(rows, len(blocks) * self.block_size, "install", RowOutOfRange)
        self._blocks = self.pool._move(blocks, _LOOSE, _TABLED, "install")
        self._num_rows = rows
        return True

    def free(self) -> None:
        """Free every block; the table is empty after."""
        self.pool._move(self._blocks, _TABLED, _FREED, "free")
        self._blocks, self._num_rows = [], 0

    def slot(self, row: int) -> tuple[int, int]:
        """(block, offset in block) of a row that has storage (it may be past num_rows)."""
        if not _is_int(row) or not 0 <= row < self.capacity_rows:
            raise RowOutOfRange(f"slot: row {row!r} is outside the {self.capacity_rows} rows of "
                                f"storage ({len(self._blocks)} blocks of {self.block_size})")
        return self._blocks[row // self.block_size], row % self.block_size

    def table_row(self, pad_block: int) -> list[int]:
        """The table padded to max_blocks with `pad_block`, which must be a reserved scratch block.

        Requiring a reserved pad makes a sentinel (-1) or a live block of another sequence
        unreachable from a kernel that reads or writes past this sequence's blocks.
        """
        pad = _reserved_pad(self.pool, pad_block, "table_row")
        return self._blocks + [pad] * (self.max_blocks - len(self._blocks))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rows={self._num_rows}, blocks={self._blocks}, "
                f"block_size={self.block_size}, max_blocks={self.max_blocks})")

    def _check_rows(self, rows: int, limit: int, action: str, error: type[KVCacheError]) -> None:
        if not _is_int(rows) or rows < 0:
            raise RowOutOfRange(f"{action}: rows must be an int >= 0, got {rows!r}")
        if rows > limit:
            raise error(f"{action}: {rows} rows need {-(-rows // self.block_size)} blocks of "
                        f"{self.block_size}; limit is {limit} rows "
                        f"({len(self._blocks)} blocks held, max_blocks={self.max_blocks})")


class PaddedBlocks(SequenceBlocks):
    """A block table that keeps its padded row as an int32 numpy array, `row`: the blocks, then
    `pad_block` (a reserved scratch block, checked once here) up to max_blocks; `table_row`'s
    values, rewritten only when the blocks change (a growth writes only its new entries). A host
    stages a sequence's table with one array copy a step instead of `table_row`'s list and its
    conversion (~3.5 us a sequence). Every rule is `SequenceBlocks`'; `row` is a read-only view
    of the kept row (a write through it raises; it follows every change, a copied table's
    too)."""

    _list: list[int]

    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int, pad_block: int) -> None:
        self._pad = _reserved_pad(pool, pad_block, "PaddedBlocks")
        self._row = np.empty(0, dtype=np.int32)  # the setter's, until max_blocks is checked
        super().__init__(pool, block_size, max_blocks)  # checks the sizes, empties the table
        self._row = np.full(self.max_blocks, self._pad, dtype=np.int32)
        self._view = self._read_only()

    def _read_only(self) -> np.ndarray:
        view = self._row.view()
        view.flags.writeable = False
        return view

    @property
    def row(self) -> np.ndarray:
        """The padded table row (int32 [max_blocks]), read-only."""
        view = self._view
        if view.base is not self._row:  # a copied table (deepcopy, pickle): its own row's view
            view = self._view = self._read_only()
        return view

    @property
    def _blocks(self) -> list[int]:
        return self._list

    @_blocks.setter
    def _blocks(self, blocks: list[int]) -> None:
        # every change but a growth comes through here (release, take, install, free): the row
        # is rewritten whole
        self._list = blocks
        m = len(blocks)
        self._row[:m] = blocks
        self._row[m:] = self._pad

    def _extend(self, blocks: list[int]) -> None:
        have = self._list
        had = len(have)
        have += blocks
        self._row[had:len(have)] = blocks


def _reserved_pad(pool: BlockPool, pad_block: int, action: str) -> int:
    """`pad_block` as an id, refused unless it is one of `pool`'s reserved scratch blocks:
    requiring that makes a sentinel (-1) or another sequence's live block unreachable from a
    kernel that reads or writes past a table's blocks."""
    pad = pool._block_id(pad_block)
    if pool._state[pad] != _RESERVED:
        reserved = pool.num_reserved
        raise ForeignBlock(f"{action}: pad block {pad} is not a reserved scratch block "
                           f"(reserved ids: {f'0..{reserved - 1}' if reserved else 'none'})")
    return pad


def ensure_rows_all(tables: Sequence[SequenceBlocks], rows: Sequence[int]) -> None:
    """`tables[i].ensure_rows(rows[i])` for every i, all or nothing: when every table stays
    within its `max_blocks` and one pool holds all the blocks, they are taken in one draw (the
    ids sequential calls would get: lowest first, table after table); otherwise the calls run
    in order and the first refusal raises its own error once the tables grown before it have
    released what they took."""
    need: list[int] = []
    pool = tables[0].pool if tables else None
    for t, r in zip(tables, rows):  # per-step host work: a plain int takes this path (any
        bs = t.block_size           # other passes to the calls below, which judge it)
        if t.pool is not pool or type(r) is not int or not 0 <= r <= t.max_blocks * bs:
            break
        k = -(-r // bs) - len(t._blocks)
        need.append(k if k > 0 else 0)
    else:
        total = sum(need)
        if pool is not None and len(tables) == len(rows) and total <= len(pool._free_heap):
            taken, at = pool._take_free(total, _TABLED), 0
            for t, k in zip(tables, need):
                if k:
                    t._extend(taken[at:at + k])
                    at += k
            return
    grown: list[SequenceBlocks] = []
    try:
        for t, r in zip(tables, rows):
            t.ensure_rows(r)
            grown.append(t)
    except Exception:
        for t in grown:
            t.release_unused()
        raise


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
