"""Persistent staging of the proposer's chain inputs and outputs (issue 14 step 2): a steady-state
propose or catch-up builds no tensor and allocates no memory of its own, and writes its inputs
straight into the buffers the chain's program reads.

- A compiled runner (`CircuitDraftRunner`) hands out its own static input buffers
  (`staged_inputs(n)`); its int32 inputs (tokens, positions, block tables, live rows, active)
  are views of one contiguous device region (runners/program.py). The staging keeps a host
  mirror of that region laid out like it (pinned on CUDA, written through numpy views: no tensor
  is built from a Python list) and keeps it whole, every row past n at its neutral value (those
  rows and active are rewritten only when n differs from the mirror's latest fill, or after a
  run the staging did not fill), so one `non_blocking` host-to-device copy stages every integer
  input of a run, padding included.
  On CPU the mirror is the region itself and nothing is copied. The runner is then given its own
  mapping back and runs with no check, copy or padding of its own (identity, O(1)).
- A runner without such buffers (the eager oracle, a split plan, a masked chain, a runner of
  another layout) gets views of the staging's own region laid out the same way, and checks and
  copies them in as any caller's inputs.
- Block tables are kept on the host, one row per state (its slot of the proposer's
  `SlotTable`, runners/proposer_slots.py), rewritten only when its sequence gained, lost or
  handed over a block; a run gathers its rows' tables into the mirror with one `np.take` of
  its rows' slot array and they travel in the same copy (no per-row work of any kind).
- Hiddens are copied into the region's hidden buffer (one `cat` for a catch-up's segments, or
  one `index_select` for rows picked from one tensor, `HiddenRows`, their indices staged
  through a pinned mirror like the ints: a second small copy on CUDA); rows past n are zeroed
  only when n shrank; `log_tau` is refilled only when its value or n changes.
- A propose drafted before its verify is read (`MtpProposer.step_ahead`) is staged for no
  accepted draft and then moved by the device counts (`Advance`): each row's token gathered
  from the verify's greedy tokens, its position, live rows and hidden index added to, with the
  counts computed in the same launch on a GPU (runners/accept_counts.py), after the copies and
  before the gather (runners/staging_region.py).
- Drafts and confidences come back in ONE device-to-host copy into pinned memory, with one sync
  per call (runners/proposer_readback.py): one `cat` (one launch) packs the drafts, the
  confidences' float32 bits and the runners' fault records side by side first.

Each region has two host mirrors on CUDA, used in turn: before writing one, a run waits for the
event recorded after the copy that last read it, two runs back, so a copy never reads a
half-written mirror and a run enqueued right behind another (a propose behind the catch-up just
enqueued) never waits for the GPU.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.int_region import INTS
from draft_circuit.runners.proposer_readback import ReadBack
from draft_circuit.runners.staging_region import Region, runner_region

if TYPE_CHECKING:
    from draft_circuit.runners.accept_counts import Advance


class ChainStaging:
    """The staging of one proposer's chains (widths up to `max_width`: the widest of its chains,
    the KV-only chain's reach included)."""

    def __init__(self, *, max_width: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 max_drafts: int, scratch_block: int, device: str | torch.device) -> None:
        self.device = torch.device(device)
        index: int | None = self.device.index
        if self.device.type == "cuda" and index is None:  # "cuda" resolves, as buffers' devices do
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        #: gathers (runs; a chunked catch-up counts a chunk each) of HiddenRows whose source
        #: could not be gathered straight into the buffer (`_gather`; logged once a process)
        self.gather_fallbacks = 0
        self.width, self.max_blocks, self.scratch, self.max_drafts = \
            max_width, max_blocks, scratch_block, max(max_drafts, 1)
        w, m = max_width, max_blocks
        # the staging's own region, for runners that hand out no buffers of this layout
        sizes = {"tokens": w, "positions": w, "block_tables": w * m, "live_rows": w, "active": w}
        offsets, at = {}, 0
        for k in INTS:
            offsets[k], at = at, at + sizes[k]
        own = torch.zeros(at, dtype=torch.int32, device=self.device)
        neutral: dict[str, int | float] = {"tokens": 0, "positions": 0, "live_rows": 0,
                                           "active": 0, "block_tables": scratch_block,
                                           "hidden": 0, "log_tau": float("-inf")}
        self._own = Region(own, offsets,
                            torch.zeros(w, hidden_size, dtype=dtype, device=self.device),
                            torch.full((w,), float("-inf"), dtype=torch.float32,
                                       device=self.device),
                            neutral, w=w, m=m, cuda=self.cuda, runner=None)
        self._regions: weakref.WeakKeyDictionary[object, Region | None] = \
            weakref.WeakKeyDictionary()
        # the same by the runner's id, checked by a weak reference (a WeakKeyDictionary lookup
        # makes a weakref every call, a microsecond; two runners alternate every step)
        self._by_id: dict[int, tuple[weakref.ref[object], Region]] = {}
        self._last: Mapping[str, torch.Tensor] | None = None
        # the read-back of drafts, confidences and fault records (runners/proposer_readback.py)
        self.readback = ReadBack(width=w, max_drafts=self.max_drafts, device=self.device)

    def _region(self, runner: object | None) -> Region:
        if runner is None:
            return self._own
        hot = self._by_id.get(id(runner))
        if hot is not None and hot[0]() is runner:  # the same live object: its region
            return hot[1]
        try:
            region = self._regions[runner]
        except KeyError:
            region = self._regions[runner] = runner_region(
                runner, max_w=self.width, m=self.max_blocks, device=self.device, scratch=self.scratch)
        except TypeError:  # an object that cannot be weakly referenced: stage in our own
            return self._own
        region = self._own if region is None else region
        if len(self._by_id) >= 8:  # runners replaced since (their entries are dead)
            self._by_id.clear()
        self._by_id[id(runner)] = (weakref.ref(runner), region)
        return region

    def warm(self, runners: Sequence[object]) -> None:
        """Make now, at construction, the views a run of each of `runners` would make the
        first time it meets a width (the runner's staged buffers, the hidden rows, the zeros):
        a catch-up's row count changes every step, so without this an engine's first few
        hundred steps each pay tens of microseconds for a width they meet first."""
        for runner in runners:
            region = self._region(runner)
            if region is self._own:
                continue
            widths = getattr(runner, "widths", ())
            for n in widths:
                if n <= region.width:
                    runner.staged_inputs(n)  # type: ignore[attr-defined]
            for n in range(1, region.width + 1):
                region.hidden_rows.setdefault(n, region.hidden[:n])
                region.index_rows.setdefault(n, region.index[:n])
                if region.zeros is not None:
                    region.zero_rows.setdefault(n, region.zeros[:n])

    # ---- inputs ----
    def inputs(self, tokens: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
               live: Sequence[int] | np.ndarray, slots: np.ndarray,
               hiddens: Sequence[torch.Tensor] | HiddenRows, log_tau: float | None,
               runner: object | None = None, *, tables: np.ndarray,
               advance: Advance | None = None) -> Mapping[str, torch.Tensor]:
        """The runner inputs of n rows: row i's block table is `tables[slots[i]]` (the states'
        host tables, runners/proposer_slots.py), hiddens are the rows' segments in order (their
        rows add up to n) or the n rows picked from one tensor (`HiddenRows`). With `runner` a
        `CircuitDraftRunner` whose plan for n is one program, its own `staged_inputs(n)`,
        filled in place (give it back to that runner's
        `run` unchanged); otherwise read-only views of the staging's own buffers. Valid until
        the next call. log_tau None: a chain without the confidence stop. Array writes only:
        nothing here runs once a row. `advance` (a propose drafted ahead of its verify's read,
        runners/proposer_ahead.py; `hiddens` then a HiddenRows): once staged, row i's token
        becomes greedy[i, a_i] and its position, live rows and hidden row move a_i further,
        a_i the accepted count the advance computes, all on the device."""
        n = len(tokens)
        region = self._region(runner)
        staged: Mapping[str, torch.Tensor] | None = None
        if region is not self._own:
            staged = runner.staged_inputs(n)  # type: ignore[union-attr]
            if staged is None or (log_tau is None) != (region.log_tau is None):
                region = self._own  # a split plan: its parts read rows 0.. of every buffer
        turn = region.turn
        if region.cuda:
            region.turn = (turn + 1) % 2
            # the copy two runs back must have read this mirror (steady state: long done)
            if not region.copied[turn].query():  # type: ignore[no-untyped-call]
                region.copied[turn].synchronize()
        if region.runner is not None:
            seen = getattr(region.runner, "unstaged_runs", 0)
            if seen != region.unstaged:  # a run the staging did not fill wrote its buffers
                region.unstaged, region.hidden_dirty, region.tau = seen, region.width, None
                for m in region.mirrors:
                    m.filled = None
        region.mirrors[turn].fill(n, (tokens, positions, live), tables, slots, region.neutral)
        if region.copies:
            region.flat.copy_(region.hosts[turn], non_blocking=True)
        try:
            if advance is not None:
                if not isinstance(hiddens, HiddenRows):
                    raise TypeError("an advanced run picks its hiddens (HiddenRows)")
                self._gather(region, hiddens, n, turn, advance)
                self._neutral_past(region, n, region.hidden_dirty if region.runner is not None else 0)
            else:
                self._stage_hiddens(region, hiddens, n, turn)
        finally:  # after every copy that read this turn's mirrors (a raise included: a copy
            # enqueued before it still reads them, and the turn after next waits on this)
            if region.stream is not None:
                region.stream.record(region.copied[turn])
        if staged is not None:
            self._fill_tau(region, log_tau, n)
            out = staged
        else:
            if log_tau is not None:
                self._fill_tau(region, log_tau, region.width)
            out = region.own_views(n, log_tau is not None)
        self._last = out
        return out

    def _fill_tau(self, region: Region, log_tau: float | None, n: int) -> None:
        """log_tau's rows [:n] at its value, the rest neutral: refilled only when they change
        (or when the runner's buffers were written by an unstaged run)."""
        if log_tau is None or region.log_tau is None or region.tau == (log_tau, n):
            return
        region.log_tau[:n].fill_(log_tau)
        region.log_tau[n:].fill_(region.neutral.get("log_tau", float("-inf")))
        region.tau = (log_tau, n)

    def _stage_hiddens(self, region: Region, hiddens: Sequence[torch.Tensor] | HiddenRows,
                       n: int, turn: int) -> None:
        """The rows' hiddens into the region's buffer: one `cat` into it (a catch-up of many
        sequences is one launch, not one a sequence; it converts dtypes as a copy does), or,
        when a segment lies on another device, one copy a segment; rows picked from one tensor
        (`HiddenRows`) in one `index_select` (`_gather`). A runner's own buffer keeps its
        rows past n neutral (a padded program reads them): zeroed when n shrank, or when an
        unstaged run wrote them. Where a numpy view cannot zero them (CUDA, bfloat16), the zeros
        travel in the rows' own `cat`: one launch whatever the segments. Hiddens autograd
        tracks are read detached (the buffer never joins their graph)."""
        hidden = region.hidden
        dirty = region.hidden_dirty if region.runner is not None else 0
        if isinstance(hiddens, HiddenRows):
            hiddens = self._gather(region, hiddens, n, turn)
            if not hiddens:  # gathered into the buffer's rows
                self._neutral_past(region, n, dirty)
                return
        if dirty > n and region.zeros is not None:
            # the rows and the zeros past them up to the rows a wider run left: one launch
            span = region.hidden_rows.get(dirty)
            if span is None:
                span = region.hidden_rows[dirty] = hidden[:dirty]
            zeros = region.zero_rows.get(dirty - n)
            if zeros is None:
                zeros = region.zero_rows[dirty - n] = region.zeros[:dirty - n]
            try:  # cat converts dtypes as a copy does; it checks devices before it writes
                torch.cat([*hiddens, zeros], out=span)
                region.hidden_dirty = n
                return
            except RuntimeError:  # a segment on another device (or one autograd tracks)
                pass
        rows = region.hidden_rows.get(n)
        if rows is None:  # a view made once a width (a slice is a torch op, microseconds)
            rows = region.hidden_rows[n] = hidden[:n]
        if len(hiddens) == 1:
            # (a copy from a tensor autograd tracks would make the buffer one: the drafter
            # needs the values only)
            one = hiddens[0]
            rows.copy_(one.detach() if one.requires_grad else one, non_blocking=True)
        else:
            try:  # cat converts dtypes as a copy does; it checks devices before it writes
                torch.cat(list(hiddens), out=rows)  # the buffer's device is resolved
            except RuntimeError:  # a segment on another device (or one autograd tracks)
                start = 0
                for h in hiddens:
                    hidden[start:start + h.shape[0]].copy_(h.detach(), non_blocking=True)
                    start += h.shape[0]
        self._neutral_past(region, n, dirty)

    @staticmethod
    def _neutral_past(region: Region, n: int, dirty: int) -> None:
        """A runner's own hidden buffer's rows [n, dirty) back to neutral (a padded program
        reads them), and n recorded as the rows that may hold values."""
        if region.runner is not None:
            if dirty > n:
                if region.hidden_np is not None:
                    region.hidden_np[n:dirty] = region.neutral["hidden"]
                else:
                    region.hidden[n:dirty].fill_(region.neutral["hidden"])
            region.hidden_dirty = n

    def _gather(self, region: Region, picked: HiddenRows, n: int,
                turn: int, advance: Advance | None = None) -> list[torch.Tensor]:
        """`picked`'s n rows into the buffer's rows [:n] in one `index_select`, the indices
        through this turn's host mirror (one small non_blocking copy on CUDA; on CPU written in
        place): returns [] when done. A source of another dtype than the buffer is gathered on
        the device by the staged indices and converted in a copy; one on another device (a host
        that keeps its hiddens elsewhere) is gathered there and returned as the one segment to
        copy in. Both are counted (`gather_fallbacks`) and logged once. A source autograd
        tracks is read detached: the drafter needs its values only. `advance` moves the staged
        indices (and the region's rows, `Region.advance`) by the device counts, then gathers by
        them (an advanced run, whose source is the buffer's dtype and device: `step_ahead`
        checks it; anything else raises here)."""
        source = picked.source
        if source.requires_grad:
            source = source.detach()
        region.index_np[turn][:n] = picked.rows
        if region.copies:  # the whole mirror: one copy, no slice of it to make
            region.index.copy_(region.index_hosts[turn], non_blocking=True)
        index = region.index_rows.get(n)
        if index is None:  # views made once a width (a slice is a torch op, microseconds)
            index = region.index_rows[n] = region.index[:n]
        rows = region.hidden_rows.get(n)
        if rows is None:
            rows = region.hidden_rows[n] = region.hidden[:n]
        if advance is not None:  # the shift, then the gather by the shifted index
            region.advance(n, advance, index, (source, rows))
            return []
        if source.dtype is region.hidden.dtype:  # (dtypes are singletons: an identity test)
            try:  # it checks devices (and overlap) before it writes: no device compare a call
                torch.index_select(source, 0, index, out=rows)
                return []
            except RuntimeError:  # any refusal: another device, a source overlapping the buffer
                pass
        self.gather_fallbacks += 1
        from draft_circuit.runners.proposer_batch import warn_once  # (imports this module)
        warn_once("gather", f"HiddenRows: a source of {source.dtype} on {source.device} is "
                            f"gathered apart and copied into the chain's {region.hidden.dtype} "
                            f"buffer on {region.hidden.device} (an extra copy a call; give the "
                            "buffer's dtype and device to skip it)")
        if source.device == index.device:  # the staged indices, then a (converting) copy
            rows.copy_(source.index_select(0, index))
            return []
        picks = torch.from_numpy(np.ascontiguousarray(picked.rows, dtype=np.int64))
        return [source.index_select(0, picks.to(source.device))]

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the chains' hidden buffers (a gather into them does not convert)."""
        return self._own.hidden.dtype

    def tokens(self, n: int) -> torch.Tensor:
        """The device tokens of the latest run's n rows (valid until the next run): what a
        device-resident propose puts before each row's drafts in a verify input."""
        assert self._last is not None and self._last["tokens"].shape[0] == n
        return self._last["tokens"]

    # ---- outputs ----
    def read(self, drafts: torch.Tensor, confidences: torch.Tensor,
             runners: Sequence[object] = ()) -> tuple[np.ndarray, np.ndarray]:
        """`ReadBack.read`: drafts and confidences as host arrays, one copy and one sync."""
        return self.readback.read(drafts, confidences, runners)
