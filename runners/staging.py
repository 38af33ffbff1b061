"""Persistent staging of the proposer's chain inputs and outputs (issue 14 step 2): a steady-state
propose or catch-up builds no tensor and allocates no memory of its own.

- Every integer input of a run (tokens, positions, live rows, each row's table slot) and the
  block-table rows that changed since the last run travel in ONE host-to-device copy of one
  int32 staging buffer (pinned on CUDA, written through its numpy view: no tensor is built from a
  Python list). On CPU the host buffer is the device buffer and nothing is copied.
- Block tables live on the device, one row per state (its slot), and a row is rewritten only
  when its sequence gained, lost or handed over a block (the table differs from the row's cached
  copy); each run gathers its rows' tables with one `index_select` into a persistent buffer.
- `active` and `log_tau` are constant buffers (log_tau refilled only when its value changes);
  hiddens are copied into a persistent buffer, a catch-up's segments one copy each.
- Drafts and confidences come back in ONE device-to-host copy (confidences packed beside the
  drafts as int32 bits) into pinned memory, with one sync per call.

There are two host buffers, used in turn: before writing one, a run waits for the event recorded
after the copy that last read it, two runs back, so a copy never reads a half-written buffer and
a run enqueued right behind another (a propose behind the catch-up just enqueued) never waits
for the GPU. Slot tables and slots grow by doubling when more states appear: an allocation only
then.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from draft_circuit.runners.proposer_state import MtpProposerState

_ROWS = 4  # int rows per run: tokens, positions, live rows, slots; then dirty slots and tables
_TABLES = _ROWS + 2  # dirty slots are int64 (index_copy_'s index): two int32 words each


class _HostViews:
    """numpy views of one host staging buffer: the int rows, the dirty slots (int64) and the
    dirty table rows."""

    def __init__(self, ints: np.ndarray, w: int, m: int) -> None:
        self.ints = ints
        self.dirty = ints[_ROWS * w:_TABLES * w].view(np.int64)
        self.rows = ints[_TABLES * w:].reshape(w, m)


class ChainStaging:
    """The staging buffers of one proposer's chains (widths up to `max_width`)."""

    def __init__(self, *, max_width: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 max_drafts: int, scratch_block: int, device: str | torch.device,
                 slots: int = 64) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.width, self.max_blocks, self.scratch, self.max_drafts = \
            max_width, max_blocks, scratch_block, max(max_drafts, 1)
        w, m = max_width, max_blocks
        size = _TABLES * w + w * m  # + dirty slots [w] as int64 + dirty table rows [w, m]
        # two host buffers in turn on CUDA (a copy may still be reading the other); on CPU the
        # one host buffer is the device buffer
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda)
                       for _ in range(2 if self.cuda else 1)]
        self._dev = torch.zeros(size, dtype=torch.int32, device=self.device) if self.cuda \
            else self._hosts[0]
        self._views = [_HostViews(h.numpy(), w, m) for h in self._hosts]
        self._turn = 0
        self._ints = [self._dev[i * w:(i + 1) * w] for i in range(_ROWS)]
        self._dirty_slots = self._dev[_ROWS * w:_TABLES * w].view(torch.int64)
        self._dirty_rows = self._dev[_TABLES * w:].view(w, m)
        self._hidden = torch.zeros(w, hidden_size, dtype=dtype, device=self.device)
        self._active = torch.ones(w, dtype=torch.int32, device=self.device)
        self._log_tau = torch.full((w,), float("-inf"), dtype=torch.float32, device=self.device)
        self._tau = float("-inf")
        self._tables = torch.full((w, m), scratch_block, dtype=torch.int32, device=self.device)
        self._slot_tables = torch.full((slots, m), scratch_block, dtype=torch.int32,
                                       device=self.device)
        self._cached: list[tuple[int, ...] | None] = [None] * slots
        self._free: list[int] = list(range(slots - 1, -1, -1))
        k2 = 2 * self.max_drafts
        self._out_dev = torch.zeros(w * k2, dtype=torch.int32, device=self.device)
        self._out_host = torch.zeros(w * k2, dtype=torch.int32, pin_memory=self.cuda) \
            if self.cuda else self._out_dev
        # per host buffer: the event recorded after the copy that read it last
        self._copied = [torch.cuda.Event() for _ in self._hosts] if self.cuda else []  # type: ignore[no-untyped-call]
        self._read = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]

    # ---- slots: one device table row per state ----
    def _slot(self, state: MtpProposerState) -> int:
        if state.slot is not None and state.slot[0] is self:
            return state.slot[1]
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._cached[slot] = None
        state.slot = (self, slot)
        weakref.finalize(state, self._free.append, slot)  # a dropped state gives its row back
        return slot

    def _grow(self) -> None:
        old = self._slot_tables.shape[0]
        grown = torch.full((2 * old, self.max_blocks), self.scratch, dtype=torch.int32,
                           device=self.device)
        grown[:old].copy_(self._slot_tables)
        self._slot_tables = grown
        self._cached += [None] * old
        self._free += list(range(2 * old - 1, old - 1, -1))

    # ---- inputs ----
    def inputs(self, tokens: Sequence[int], positions: Sequence[int], live: Sequence[int],
               states: Sequence[MtpProposerState], hiddens: Sequence[torch.Tensor],
               log_tau: float | None) -> dict[str, torch.Tensor]:
        """The runner inputs of n rows: row i is states[i]'s, hiddens are the rows' segments in
        order (their rows add up to n). Views of the persistent buffers: valid until the next
        call. log_tau None: a chain without the confidence stop."""
        n, w = len(tokens), self.width
        turn = self._turn
        self._turn = (turn + 1) % len(self._hosts)
        # the copy two runs back must have read this buffer (steady state: long done, no wait)
        if self.cuda and not self._copied[turn].query():  # type: ignore[no-untyped-call]
            self._copied[turn].synchronize()
        v = self._views[turn]
        np_ = v.ints
        np_[0:n], np_[w:w + n], np_[2 * w:2 * w + n] = tokens, positions, live
        dirty, slots = 0, []
        prev: MtpProposerState | None = None
        slot = -1
        for s in states:  # a catch-up's rows of one sequence are consecutive: one check a run
            if s is not prev:
                prev, slot = s, self._slot(s)
                blocks = s.blocks.blocks
                if self._cached[slot] != blocks:  # gained, lost or handed over a block
                    self._cached[slot] = blocks
                    v.dirty[dirty] = slot
                    row = v.rows[dirty]
                    row[:len(blocks)] = blocks
                    row[len(blocks):] = self.scratch
                    dirty += 1
            slots.append(slot)
        np_[3 * w:3 * w + n] = slots
        if self.cuda:
            end = _TABLES * w + dirty * self.max_blocks
            self._dev[:end].copy_(self._hosts[turn][:end], non_blocking=True)
            self._copied[turn].record()
        if dirty:
            self._slot_tables.index_copy_(0, self._dirty_slots[:dirty], self._dirty_rows[:dirty])
        torch.index_select(self._slot_tables, 0, self._ints[3][:n], out=self._tables[:n])
        self._stage_hiddens(hiddens, n)
        out = {"tokens": self._ints[0][:n], "hidden": self._hidden[:n],
               "positions": self._ints[1][:n], "block_tables": self._tables[:n],
               "live_rows": self._ints[2][:n], "active": self._active[:n]}
        if log_tau is not None:
            if log_tau != self._tau and not (log_tau != log_tau and self._tau != self._tau):
                self._log_tau.fill_(log_tau)
                self._tau = log_tau
            out["log_tau"] = self._log_tau[:n]
        return out

    def _stage_hiddens(self, hiddens: Sequence[torch.Tensor], n: int) -> None:
        """The rows' hiddens into the persistent buffer: one `cat` into it when every segment
        already has its dtype and device (a catch-up of many sequences is one launch, not one a
        sequence), else one copy a segment (which converts)."""
        if len(hiddens) == 1:
            self._hidden[:n].copy_(hiddens[0], non_blocking=True)
        elif all(h.dtype == self._hidden.dtype and h.device == self._hidden.device
                 for h in hiddens):  # the buffer's device is resolved ("cuda" is "cuda:0")
            torch.cat(list(hiddens), out=self._hidden[:n])
        else:
            start = 0
            for h in hiddens:
                self._hidden[start:start + h.shape[0]].copy_(h, non_blocking=True)
                start += h.shape[0]

    def tokens(self, n: int) -> torch.Tensor:
        """The device tokens of the latest run's n rows (valid until the next run): what a
        device-resident propose puts before each row's drafts in a verify input."""
        return self._ints[0][:n]

    # ---- outputs ----
    def read(self, drafts: torch.Tensor, confidences: torch.Tensor) -> tuple[list[list[int]],
                                                                             list[list[float]]]:
        """Drafts [n, k] and confidences [n, k] as lists: one device-to-host copy, one sync."""
        if not self.cuda:
            return drafts.tolist(), confidences.tolist()
        n, k = drafts.shape
        packed = self._out_dev[:n * 2 * k].view(n, 2 * k)
        packed[:, :k].copy_(drafts)
        packed[:, k:].copy_(confidences.view(torch.int32))
        host = self._out_host[:n * 2 * k]
        host.copy_(self._out_dev[:n * 2 * k], non_blocking=True)
        assert self._read is not None
        self._read.record()
        self._read.synchronize()  # the one sync of the call
        both = host.view(n, 2 * k)
        return both[:, :k].tolist(), both[:, k:].view(torch.float32).tolist()
