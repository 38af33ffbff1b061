"""Per-sequence proposer state and the rules the proposer applies to it (the reference's, see
README "Departures from the reference" for the few kept safer ones): what a propose records, the
trim after verify, pair keys, the KV hand-over. Small functions over a plain state, kept apart
from the proposer so the rules read, and test, on their own.

Pair key: a drafter row written at RoPE position p pairs the token at p with the target hidden
at p - 1, and its pair key is p - 1; a state's `last_pair_key` is its newest row's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from draft_circuit.runners.kv_cache import BlockPool
from draft_circuit.runners.proposer_slots import (AWAITING, DRAFTED, FEW, KEY, ROWS,
                                                  SMALL_BATCH, SlotBlocks, SlotTable)


class ProposerError(ValueError):
    """A call the proposer refuses: a foreign state, a bad count, an unsettled order of calls."""


class MtpProposerState:
    """One sequence's drafter: a handle to its slot of the proposer's `SlotTable`
    (runners/proposer_slots.py), whose columns hold its drafter-KV rows and block table, the
    newest pair key, what the last propose drafted, and its pending deferred drafts. A deferred
    propose leaves its drafts on the device (`pending`) until something reads them;
    `awaiting_verify` is set by a propose and cleared by the after_verify that trims its rows.
    The attributes read and write the columns, so a single-state call and a batch call (array
    operations over many slots) see one state."""

    __slots__ = ("owner", "table", "slot", "blocks", "__weakref__")

    def __init__(self, owner: int, table: SlotTable, pool: BlockPool, block_size: int,
                 max_blocks: int) -> None:
        self.owner, self.table = owner, table
        self.slot = table.alloc(self)
        self.blocks = SlotBlocks(pool, block_size, max_blocks, table, self.slot)

    def __repr__(self) -> str:
        return (f"MtpProposerState(slot={self.slot}, rows={self.rows}, "
                f"last_pair_key={self.last_pair_key}, last_drafts={self.last_drafts})")

    @property
    def rows(self) -> int:
        return int(self.table.rows[self.slot])

    @property
    def last_pair_key(self) -> int | None:
        t, s = self.table, self.slot
        return int(t.pair_key[s]) if t.has_key[s] else None

    @last_pair_key.setter
    def last_pair_key(self, key: int | None) -> None:
        t, s = self.table, self.slot
        t.has_key[s] = key is not None
        t.pair_key[s] = 0 if key is None else key

    @property
    def last_num_drafted(self) -> int:
        return int(self.table.drafted[self.slot])

    @last_num_drafted.setter
    def last_num_drafted(self, count: int) -> None:
        self.table.drafted[self.slot] = count

    @property
    def last_drafts(self) -> list[int]:
        return self.table.last_drafts(self.slot)

    @last_drafts.setter
    def last_drafts(self, drafts: list[int]) -> None:
        t, s = self.table, self.slot
        t.drafts[s, :len(drafts)] = drafts
        t.kept[s] = len(drafts)

    @property
    def awaiting_verify(self) -> bool:
        return bool(self.table.awaiting[self.slot])

    @awaiting_verify.setter
    def awaiting_verify(self, flag: bool) -> None:
        self.table.awaiting[self.slot] = flag

    @property
    def pending(self) -> "tuple[torch.Tensor, int, int] | PendingBatch | None":
        """A deferred propose's drafts still on the device: (drafts [k], rows, position), or the
        device-resident batch this state drafted in (settled for all its states at once)."""
        return self.table.pending[self.slot]  # type: ignore[no-any-return]

    @pending.setter
    def pending(self, value: "tuple[torch.Tensor, int, int] | PendingBatch | None") -> None:
        t, s = self.table, self.slot
        old = t.pending[s]
        if isinstance(old, PendingBatch) and old is not value:
            old.dropped += 1  # freed or handed over before its batch settled: nothing to record
        t.num_pending += (value is not None) - (old is not None)
        t.pending[s] = value


def pair_key(rope_position: int) -> int:
    """The pair key of a row written at `rope_position`: the target hidden's position."""
    return rope_position - 1


def kept_drafts(row: list[int]) -> list[int]:
    """The drafts a row kept: everything before the first -1 (a stop, or an all-masked row)."""
    out = []
    for t in row:
        if t < 0:
            break
        out.append(int(t))
    return out


def record_drafts(state: MtpProposerState, drafts: list[int], rows: int, position: int) -> None:
    """What a propose at `position` from `rows` drafter rows leaves: draft i wrote a row at RoPE
    position + i (a stopped row wrote no further row), so the newest key is position + d - 2.
    (One state; a batch records with `SlotTable.record`, the same rule as array operations.)"""
    state.blocks.set_rows(rows + len(drafts))
    state.table.stamp(state.slot)
    state.last_num_drafted, state.last_drafts = len(drafts), drafts
    if drafts:
        state.last_pair_key = pair_key(position + len(drafts) - 1)
    state.awaiting_verify = True


@dataclass(eq=False, slots=True)
class PendingBatch:
    """A device-resident propose_batch not yet read: its drafts [n, k] on the device, each row's
    slot, rows before the run and position. The first call that touches any of its states
    settles all of them with one read (`read`: device drafts -> host array [n, k]; one copy,
    one sync) and one `SlotTable.record`."""

    drafts: torch.Tensor
    rows: Sequence[int] | np.ndarray  # a few rows: the run's list as it came (no array made)
    positions: Sequence[int] | np.ndarray
    states: list[MtpProposerState]  # kept alive (their slots stay theirs) until settled
    slots: np.ndarray
    table: SlotTable
    read: Callable[[torch.Tensor], np.ndarray]
    done: bool = False
    #: called once the states are recorded: raises a bad input row the read brought back
    #: (the input guards' records, copied beside the drafts)
    check: Callable[[], None] | None = None
    #: states whose pending was cleared (freed, handed over) before this batch settled
    dropped: int = 0
    #: a batch drafted ahead of its verify's read (runners/proposer_ahead.py): each row's
    #: accepted count a, read at settle; `rows` and `positions` then hold each row's position
    #: before the verify, p, and the run had p + a rows before it at position p + a + 1
    counts: Callable[[], np.ndarray] | None = None
    #: the table's serial its record stamped on its states (`SlotTable.stamp`; 0 before)
    serial: int = 0

    def settle(self) -> list[list[int]] | None:
        """Record every state still waiting on this batch (nothing when done already). Returns
        each row's kept drafts (fresh lists, `SlotTable.record`'s) when this call recorded the
        whole batch, None otherwise (done before, or a state dropped since)."""
        if self.done:
            return None
        self.done = True
        t, drafts = self.table, self.read(self.drafts)
        rows, positions, ahead = self.rows, self.positions, self.counts is not None
        if self.counts is not None:  # drafted ahead: from p + a rows, at p + a + 1 (kept as
            # the batch's own from now on: what a later step_ahead reads back)
            rows = np.add(rows, self.counts())
            positions = rows + 1
            self.rows, self.positions, self.counts = rows, positions, None
        if self.dropped == 0:  # the common case: every state still waits on this batch
            slots = self.slots
        else:  # a state freed or handed over since has nothing to record
            mine = np.asarray(t.pending[self.slots] == self, dtype=np.bool_)  # identity
            slots, drafts, rows = self.slots[mine], drafts[mine], np.asarray(rows)[mine]
            positions = np.asarray(positions)[mine]
        if ahead:  # the catch-up's rows that are the target's
            t.set_caught_up(slots, np.asarray(rows))
        t.set_pending(slots, None)
        t.num_pending -= len(slots)
        kept = t.record(slots, drafts, rows, positions)
        self.serial = t.serial
        if self.check is not None:
            self.check()
        return kept if slots is self.slots else None


def settle(state: MtpProposerState) -> None:
    """Read a deferred propose's drafts (the one host sync it postponed) into the state."""
    if isinstance(state.pending, PendingBatch):
        state.pending.settle()
    elif state.pending is not None:
        drafts, rows, position = state.pending
        state.pending = None
        record_drafts(state, kept_drafts(drafts.tolist()), rows, position)


def rows_to_trim(num_drafted: int, num_accepted: int, *, kv_exact: bool, refeed: bool) -> int:
    """Drafter rows to drop after verify, with d = max(num_drafted, 1) and a accepted.

    Exact KV: d - 1 (the row built from the target hidden stays; catch-up rebuilds the accepted
    ones from target hiddens). Otherwise min(max(d - a, 0) + (max(a - 1, 0) if refeed else 0), d):
    the rejected drafts' rows go, and with refeed the accepted ones too, never more than d.
    """
    d = max(num_drafted, 1)
    if kv_exact:
        return d - 1
    return min(max(d - num_accepted, 0) + (max(num_accepted - 1, 0) if refeed else 0), d)


def key_after_verify(position: int, num_drafted: int, num_accepted: int, *, kv_exact: bool,
                     refeed: bool) -> int:
    """The pair key a state holds after the verify of a propose at `position` that kept
    `num_drafted` >= 1 drafts: `record_drafts`' newest key (position + d - 2), moved back by
    `rows_to_trim` and saturating at 0, as the trim does. A host that hands `step_batch` its
    catch-up positions (key + 2) finds them here, before the call that trims."""
    trim = rows_to_trim(num_drafted, num_accepted, kv_exact=kv_exact, refeed=refeed)
    return max(pair_key(position + num_drafted - 1) - trim, 0)


def trim_after_verify(state: MtpProposerState, num_accepted: int, *, kv_exact: bool,
                      refeed: bool) -> int:
    """Trim the rows `rows_to_trim` names; the newest pair key moves back by the same count
    (both saturate at 0, as the reference's unsigned counts do). Only the first after_verify
    after a propose trims (a second one, or one with no propose before it, trims nothing).
    Returns the count trimmed."""
    if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) \
            or not 0 <= num_accepted <= state.last_num_drafted:
        raise ProposerError(f"num_accepted {num_accepted!r} must be in 0..{state.last_num_drafted}, "
                            "the drafts of the last propose")
    if not state.awaiting_verify:
        return 0
    state.awaiting_verify = False
    trim = rows_to_trim(state.last_num_drafted, num_accepted, kv_exact=kv_exact, refeed=refeed)
    if trim:
        state.blocks.set_rows(max(state.rows - trim, 0))
        if state.last_pair_key is not None:
            state.last_pair_key = max(state.last_pair_key - trim, 0)
    return trim


def trim_after_verify_batch(table: SlotTable, slots: np.ndarray, num_accepted: Sequence[int],
                            states: Sequence[MtpProposerState], *, kv_exact: bool,
                            refeed: bool) -> list[int] | np.ndarray:
    """`trim_after_verify` for many states at once (their `slots`), as array operations: every
    count is checked first (the first bad one raises the same error, nothing trimmed), then
    each awaiting state trims `rows_to_trim` rows and moves its key back as far (both saturate
    at 0); a state not awaiting its verify trims nothing. Returns the counts trimmed (a list
    up to SMALL_BATCH states, else an array)."""
    n = len(slots)
    if n <= SMALL_BATCH and len(num_accepted) == n:  # a few states: the scalar rule, each
        rows = table.gather(slots)  # one gather; Python ints from here on
        for a, c in zip(num_accepted, rows):  # every count checked before any trim
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= c[DRAFTED]:
                raise ProposerError(f"num_accepted {a!r} must be in 0..{c[DRAFTED]}, "
                                    "the drafts of the last propose")
        trims = []
        for a, c in zip(num_accepted, rows):
            if not c[AWAITING]:
                trim = 0
            elif kv_exact:  # rows_to_trim's exact-KV rule, without a call a row
                trim = max(c[DRAFTED], 1) - 1
            else:
                trim = rows_to_trim(c[DRAFTED], a, kv_exact=False, refeed=refeed)
            trims.append(trim)
        if n <= FEW:  # the three changed columns of a slot as numpy scalar writes (a tenth of
            # a microsecond each; a whole row's write converts a list, several times that)
            rows_c, key_c, awaiting_c = table.rows, table.pair_key, table.awaiting
            for slot, c, trim in zip(slots.tolist(), rows, trims):
                if trim:
                    rows_c[slot] = max(c[ROWS] - trim, 0)
                    key_c[slot] = max(c[KEY] - trim, 0)
                awaiting_c[slot] = 0
        else:  # the columns a trim changes, a write each
            table.put(slots, ROWS, [max(c[ROWS] - t, 0) for c, t in zip(rows, trims)])
            table.put(slots, KEY, [max(c[KEY] - t, 0) if t else c[KEY]
                                   for c, t in zip(rows, trims)])
            table.awaiting[slots] = 0
        return trims
    # every column read and written through its 1-D view (numpy's fast path for one index
    # array; a 2-D fancy gather or scatter costs several times as much)
    drafted = table.drafted[slots]
    ok = len(num_accepted) == n and set(map(type, num_accepted)) <= {int}
    accepted = np.fromiter(num_accepted, dtype=np.int64, count=n) if ok else None
    if accepted is None or min(num_accepted) < 0 or np.count_nonzero(accepted > drafted):
        if len(num_accepted) != n:
            raise ProposerError(f"after_verify_batch: {len(num_accepted)} accepted counts for "
                                f"{n} states: one a state")
        for a, s in zip(num_accepted, states):  # only to name the first bad count
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= s.last_num_drafted:
                raise ProposerError(f"num_accepted {a!r} must be in 0..{s.last_num_drafted}, "
                                    "the drafts of the last propose")
    assert accepted is not None
    if kv_exact:
        trim = drafted - 1
        np.maximum(trim, 0, out=trim)  # max(d, 1) - 1
    else:
        d = np.maximum(drafted, 1)
        trim = np.maximum(d - accepted, 0)
        if refeed:
            trim += np.maximum(accepted - 1, 0)
        np.minimum(trim, d, out=trim)
    trim *= table.awaiting[slots]  # a state not awaiting its verify trims nothing
    # x - min(trim, x) is max(x - trim, 0) for x >= 0 (rows always; keys but for a host's
    # installed negative key, which a trim takes to 0 as before); a key not trimmed is kept
    rows, keys = table.rows[slots], table.pair_key[slots]
    np.subtract(rows, np.minimum(trim, rows), out=rows)
    np.subtract(keys, np.minimum(trim, keys), out=keys, where=trim > 0)
    table.rows[slots], table.pair_key[slots] = rows, keys
    table.awaiting[slots] = 0
    return trim  # type: ignore[no-any-return]


def take_kv(state: MtpProposerState) -> tuple[list[int], int, int | None] | None:
    """Hand the blocks, rows and pair key out (None when there are no blocks or no rows); the
    state keeps no blocks, no rows and no pair key."""
    if not state.blocks.blocks or state.rows == 0:
        return None
    key = state.last_pair_key
    blocks, rows = state.blocks.take()
    state.last_pair_key, state.last_num_drafted, state.awaiting_verify = None, 0, False
    return blocks, rows, key


def install_kv(state: MtpProposerState, blocks: Sequence[int], rows: int,
               last_pair_key: int | None) -> bool:
    """Adopt handed-over blocks into a state with no blocks and no rows (a pair key alone does
    not block it); False, with nothing changed, otherwise."""
    if not state.blocks.install(blocks, rows):
        return False
    state.last_pair_key = last_pair_key
    return True


def free_all(state: MtpProposerState) -> None:
    """Free every block; the state is empty after (no rows, no pair key, no drafts). What it
    holds is not settled: a device batch it drafted in drops its row (`PendingBatch.dropped`)
    and settles for the rest on their next touch, so a finish does not wait for a chain still
    running and the rest's drafts stay pending for their verify. The blocks go back now; a
    chain still writing them runs before anything enqueued after it on its stream. The last of
    a batch's states to go settles it (nothing left to record): its input guards' records are
    read then (FAULTS 25), not at some later batch or never."""
    batch = state.pending
    state.blocks.free()
    state.last_pair_key, state.last_num_drafted, state.last_drafts = None, 0, []
    state.pending, state.awaiting_verify = None, False
    if isinstance(batch, PendingBatch) and not batch.done and batch.dropped == len(batch.states):
        batch.settle()
