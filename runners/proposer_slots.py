"""Per-slot state columns (issue 14: the decode step's host work as array ops, not per sequence).

Every `MtpProposerState` is a handle to one slot of its proposer's `SlotTable`: the state's
drafter rows, storage (capacity), newest pair key, drafts of its last propose, whether it awaits
a verify, its block table (padded with the scratch block) and its pending deferred drafts all
live in numpy columns indexed by the slot. A batch call turns its states into one slot array
(`SlotTable.slots_of`: ownership checked once, with C-level passes over the states, and a
batch of distinct states seen by an earlier call of the step known again by its ids) and does
its bookkeeping, the trims after verify and the catch-up's row counts, as array operations:
O(1) Python calls and O(n) numpy, not O(n) Python statements.

`SlotBlocks` is the state's `SequenceBlocks` with its row count and block list mirrored into the
columns, so every block-pool rule (all-or-nothing growth, release, hand-over, double frees) is
kept as it was, and the host block table the staging gathers is rewritten only when a sequence
gains, loses or hands over a block.

Slots are handed out at `alloc_state` and given back when the handle is dropped (a weakref
finalizer): a freed state (`free_state`) stays usable, as it always was. The columns grow by
doubling when more states are alive than slots (a host allocation only then).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from operator import add, attrgetter
from typing import TYPE_CHECKING, Sequence

import numpy as np

from draft_circuit.runners.kv_cache import BlockPool, SequenceBlocks

if TYPE_CHECKING:  # proposer_state imports this module
    from draft_circuit.runners.proposer_state import MtpProposerState

_TABLE, _SLOT = attrgetter("table"), attrgetter("slot")
#: the int columns of `SlotTable.cols`, in order
COLUMNS = ("rows", "capacity", "pair_key", "has_key", "drafted", "kept", "awaiting")
ROWS, CAPACITY, KEY, HAS_KEY, DRAFTED, KEPT, AWAITING = range(len(COLUMNS))

#: up to this many sequences the batch bookkeeping (checks, catch-up rows, records, trims)
#: runs as a bounded loop over the states, O(1) all the same: the array path's fixed cost
#: (about half a microsecond to a microsecond a numpy call, some tens of calls a step) is more
#: than the per-sequence Python it replaces below about this width (benchmarks/
#: proposer_host.py on CPU: the two cross between n = 8 and n = 32). Both paths apply the same
#: rules; tests compare them at widths on either side.
SMALL_BATCH = 16
#: batches of distinct states `SlotTable.slots_of` keeps (a step's full batch and its
#: catch-up's subset)
KNOWN = 2
#: up to this many slots the small-batch bookkeeping reads and writes a slot at a time (numpy
#: scalar reads and writes, a tenth of a microsecond each); past it a column at a time through
#: the column's 1-D view (`put`: numpy's fast path for one index array, under a microsecond),
#: never a nested list's 2-D fancy scatter (~2 us at one row, ~7 us at eight)
FEW = 4


def _before_stop(row: list[int]) -> list[int]:
    """The drafts of a row that stopped: those before its first -1."""
    return row[:next(i for i, t in enumerate(row) if t < 0)]


def _none_negative(a: np.ndarray) -> bool:
    """No entry of a non-empty int array below 0: its least entry read through `argmin`
    (a fraction of `a.min()`'s time: no ufunc reduction's Python layers)."""
    return bool(a.reshape(-1)[a.argmin()] >= 0)


class SlotTable:
    """The columns of one proposer's states (see the module docstring). `drafts` holds up to
    `max_drafts` drafts a slot; `tables` [slots, max_blocks] int32 is the host block table."""

    def __init__(self, *, max_blocks: int, max_drafts: int, scratch_block: int,
                 slots: int = 64) -> None:
        self.max_blocks, self.max_drafts = max_blocks, max(max_drafts, 1)
        self.scratch = scratch_block
        self.size = 0
        self._free: list[int] = []
        self.cols = np.zeros((0, len(COLUMNS)), dtype=np.int64)
        self.drafts = np.zeros((0, self.max_drafts), dtype=np.int64)
        self.tables = np.zeros((0, max_blocks), dtype=np.int32)
        self.pending = np.empty(0, dtype=object)  # a deferred propose's tuple or a PendingBatch
        #: the serial of each slot's latest recorded propose (`stamp`): tells a device batch
        #: whether a later propose replaced its drafts (runners/proposer_ahead.py)
        self.proposed = np.zeros(0, dtype=np.int64)
        self.serial = 0
        #: how many slots hold one (kept by every writer of `pending`): 0 lets a batch call
        #: skip its settle check altogether (the host path's steady state)
        self.num_pending = 0
        #: the latest batches `slots_of` found all this table's and distinct, by their states'
        #: ids (see `slots_of`); emptied whenever a slot is given back
        self._known: OrderedDict[tuple[int, ...], tuple[type, np.ndarray]] = OrderedDict()
        self._resize(max(slots, 1))

    def _resize(self, size: int) -> None:
        old = self.size
        cols = np.zeros((size, len(COLUMNS)), dtype=np.int64)
        drafts = np.zeros((size, self.max_drafts), dtype=np.int64)
        tables = np.full((size, self.max_blocks), self.scratch, dtype=np.int32)
        pending = np.empty(size, dtype=object)
        proposed = np.zeros(size, dtype=np.int64)
        cols[:old], drafts[:old], tables[:old], pending[:old], proposed[:old] = \
            self.cols, self.drafts, self.tables, self.pending, self.proposed
        self.cols, self.drafts, self.tables, self.pending = cols, drafts, tables, pending
        self.proposed = proposed
        # the int columns are views of one [slots, 7] array (one gather reads them all);
        # 0/1 for the two flags
        self.columns = tuple(cols[:, i] for i in range(len(COLUMNS)))
        (self.rows, self.capacity, self.pair_key, self.has_key, self.drafted, self.kept,
         self.awaiting) = self.columns
        self._free += list(range(size - 1, old - 1, -1))
        self.size = size

    # ---- slots ----
    def alloc(self, state: "MtpProposerState") -> int:
        """A fresh slot for `state` (columns at an empty state's values), given back when the
        state is dropped."""
        if not self._free:
            self._resize(2 * self.size)
        slot = self._free.pop()
        self.cols[slot] = 0
        self.tables[slot] = self.scratch
        self.pending[slot] = None
        self.proposed[slot] = 0
        weakref.finalize(state, self._release, slot)
        return slot

    def _release(self, slot: int) -> None:
        self._known.clear()  # a dead state's id may be a new object's from here on
        if self.pending[slot] is not None:
            self.num_pending -= 1
        self.pending[slot] = None  # a dropped state keeps no device batch alive
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slots_of(self, states: Sequence[object], state_type: type) -> np.ndarray | None:
        """The slots of `states` as one int array when every one is a `state_type` of this
        table (one pass of C-level maps: types, tables, slots), else None.

        A decode step passes the same states to several calls (propose, after_verify, the next
        step's propose): the last `KNOWN` batches found this table's and distinct are kept by
        their states' ids, and the same ids in the same order are that batch again, checked by
        one tuple of ids. That is exact while no slot has been given back since: every state
        of a known batch is then alive (a state gives its slot back only when it dies), ids
        are unique among live objects, and a slot and its table never change, so an object
        with a known state's id is that state (`_release` forgets every batch). Such a
        batch's array is read-only and shared; `distinct` knows it."""
        if not states:
            return np.zeros(0, dtype=np.intp)
        ids = tuple(map(id, states))
        known = self._known.get(ids)
        if known is not None and known[0] is state_type:
            self._known.move_to_end(ids)
            return known[1]
        if set(map(type, states)) != {state_type} or set(map(_TABLE, states)) != {self}:
            return None
        slots = np.fromiter(map(_SLOT, states), dtype=np.intp, count=len(states))
        if len(set(ids)) == len(ids):
            slots.flags.writeable = False
            self._known[ids] = (state_type, slots)
            if len(self._known) > KNOWN:
                self._known.popitem(last=False)
        return slots

    def distinct(self, slots: np.ndarray) -> bool:
        """True when `slots` is the array `slots_of` gave for a batch of distinct states (a
        known batch: no state twice); False says nothing (the caller checks itself)."""
        for _, known in self._known.values():  # at most KNOWN (a loop: no generator made)
            if known is slots:
                return True
        return False

    def set_pending(self, slots: np.ndarray, value: object) -> None:
        """`pending[slots] = value` (a batch, or None when it settles); one slot as a scalar
        write, a fraction of a fancy assignment's cost (the n = 1 decode step's)."""
        if len(slots) == 1:
            self.pending[slots[0]] = value
        else:
            self.pending[slots] = value

    def stamp(self, slots: np.ndarray | int) -> int:
        """Mark `slots` (or one slot) as holding the latest propose, a new serial (returned)."""
        self.serial += 1
        self.proposed[slots] = self.serial
        return self.serial

    def set_caught_up(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Each slot's rows are `rows` (int64 [n]), its newest key the row before: the rows a
        catch-up drafted ahead of its verify's read keeps once the accepted counts are known
        (runners/proposer_ahead.py; with none accepted, the row the last propose kept)."""
        self.rows[slots] = rows
        self.pair_key[slots] = rows - 1
        self.has_key[slots] = 1

    def pending_at(self, slots: np.ndarray) -> np.ndarray:
        """Which of `slots` hold deferred drafts (bool per slot)."""
        held: np.ndarray = self.pending[slots] != None  # noqa: E711  (elementwise, object array)
        return held

    def gather(self, slots: np.ndarray) -> list[list[int]]:
        """`self.cols[slots].tolist()`, a slot at a time for a few, else one `take` (half a
        2-D fancy gather's time)."""
        if len(slots) <= FEW:
            table = self.cols
            return [table[slot].tolist() for slot in slots.tolist()]
        return self.cols.take(slots, axis=0).tolist()  # type: ignore[no-any-return]

    def scatter(self, slots: np.ndarray, cols: list[list[int]]) -> None:
        """`self.cols[slots] = cols` (distinct slots), a slot at a time for a few."""
        if len(cols) <= FEW:
            table = self.cols
            for slot, row in zip(slots.tolist(), cols):
                table[slot] = row
        else:
            self.cols[slots] = cols

    def put(self, slots: np.ndarray, column: int, values: list[int]) -> None:
        """`self.cols[slots, column] = values` (distinct slots) through the column's 1-D view
        (numpy's fast path for one index array: a fraction of a 2-D fancy write's time), a
        slot at a time for a few."""
        col = self.columns[column]
        if len(values) <= FEW:
            for slot, v in zip(slots.tolist(), values):
                col[slot] = v
        else:
            col[slots] = values

    # ---- what a propose leaves (the reference's record_drafts, for a batch) ----
    def record(self, slots: np.ndarray, drafts: np.ndarray,
               rows_before: Sequence[int] | np.ndarray,
               positions: Sequence[int] | np.ndarray) -> list[list[int]]:
        """Rows `drafts` [n, k] (-1 after a stop) drafted from `rows_before` rows at `positions`:
        row i kept its drafts before its first -1 (c of them) and wrote a row for each, so its
        rows become rows_before + c and, when c > 0, its newest key position + c - 2 (the rule
        of proposer_state.record_drafts); every row awaits its verify. Returns each row's kept
        drafts. The caller grew every table to rows_before + k. Up to SMALL_BATCH rows the
        rule runs on Python ints and writes the columns it sets (nothing is gathered: no new
        value depends on an old one but a key left as it was)."""
        n, k = drafts.shape
        rows = drafts.tolist()
        if n <= SMALL_BATCH:
            before = rows_before.tolist() if isinstance(rows_before, np.ndarray) else rows_before
            kept_rows = [row if not row or min(row) >= 0 else _before_stop(row) for row in rows]
            kept = list(map(len, kept_rows))
            if n > FEW and 0 not in kept:  # every row kept a draft: a write a column
                self.put(slots, ROWS, list(map(add, before, kept)))
                self.put(slots, DRAFTED, kept)
                self.put(slots, KEPT, kept)
                self.put(slots, KEY, [p + d - 2 for p, d in zip(positions, kept)])
                self.has_key[slots] = self.awaiting[slots] = 1
            else:  # a slot at a time (a row that kept none keeps its key)
                rows_c, _, key_c, has_c, drafted_c, kept_c, awaiting_c = self.columns
                for slot, r, p, d in zip(slots.tolist(), before, positions, kept):
                    rows_c[slot], drafted_c[slot], kept_c[slot], awaiting_c[slot] = r + d, d, d, 1
                    if d:
                        key_c[slot], has_c[slot] = p + d - 2, 1
        elif k and _none_negative(drafts):  # no row stopped (the common case): each kept k,
            # the rule below with every count k; every write a 1-D column's (numpy's fast path
            # for one index array), capacity untouched
            self.rows[slots] = np.add(rows_before, k)
            self.pair_key[slots] = np.add(positions, k - 2)
            self.drafted[slots] = self.kept[slots] = k
            self.has_key[slots] = self.awaiting[slots] = 1
            kept_rows = rows
        else:
            stop = drafts < 0
            counts = np.where(stop.any(axis=1), stop.argmax(axis=1), k) if k \
                else np.zeros(n, np.int64)
            self.rows[slots] = np.add(rows_before, counts)
            self.drafted[slots] = self.kept[slots] = counts
            some = counts > 0
            self.pair_key[slots] = np.where(some, np.add(positions, counts - 2),
                                            self.pair_key[slots])
            self.has_key[slots] = self.has_key[slots] | some
            self.awaiting[slots] = 1
            kept_rows = rows
            if k and not (counts == k).all():  # a stop: cut those rows
                kept_rows = [row[:c] for row, c in zip(rows, counts.tolist())]
        if k and n <= FEW:  # a slot at a time (see FEW)
            for slot, row in zip(slots.tolist(), rows):
                self.drafts[slot, :k] = row
        elif k:
            self.drafts[slots, :k] = drafts
        self.stamp(slots[0] if n == 1 else slots)
        return kept_rows

    def last_drafts(self, slot: int) -> list[int]:
        return self.drafts[slot, :self.kept[slot]].tolist()  # type: ignore[no-any-return]


class SlotBlocks(SequenceBlocks):
    """A state's block table whose row count and blocks are mirrored into its slot's columns
    (`rows`, `capacity`, `tables`); every rule is `SequenceBlocks`'."""

    _list: list[int]
    _mirrored: int  # entries of the list in the slot's table row (the row past them: scratch)

    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int, table: SlotTable,
                 slot: int) -> None:
        self._table, self._slot = table, slot
        super().__init__(pool, block_size, max_blocks)

    @property
    def _num_rows(self) -> int:
        return int(self._table.rows[self._slot])

    @_num_rows.setter
    def _num_rows(self, rows: int) -> None:
        self._table.rows[self._slot] = rows

    @property
    def _blocks(self) -> list[int]:
        return self._list

    @_blocks.setter
    def _blocks(self, blocks: list[int]) -> None:
        # every other change of the list goes through here (`+=` included): the host table follows
        t, s, m = self._table, self._slot, len(blocks)
        had = self._mirrored if blocks is getattr(self, "_list", None) else -1
        self._list = blocks
        t.capacity[s] = m * self.block_size
        if 0 <= had < m:  # the same list grown in place (`+=`: ensure_rows): only its new
            # entries (the row past them is scratch already); a whole row of BlockIds is a
            # conversion per entry, microseconds a growth, and a batch grows several a step
            t.tables[s, had:m] = blocks[had:]
        else:  # a new list (release, take, install, free): the whole row
            t.tables[s, :m] = blocks
            t.tables[s, m:] = t.scratch
        self._mirrored = m

    def _extend(self, blocks: list[int]) -> None:
        # a growth (ensure_rows, ensure_rows_all): only the new entries into the host row, one
        # numpy scalar write for the common single block (a slice write converts a list, ~0.5 us)
        have = self._list
        had = len(have)
        have += blocks
        t, s, m = self._table, self._slot, len(have)
        t.capacity[s] = m * self.block_size
        if m == had + 1:
            t.tables[s, had] = have[had]
        else:
            t.tables[s, had:m] = blocks
        self._mirrored = m
