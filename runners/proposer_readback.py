"""The read-back of a host-returning propose (issue 14): drafts, confidences and the input
guards' fault records in ONE device-to-host copy and one sync.

`ReadBack.read` packs a chain's drafts, its confidences' float32 bits and up to two runners'
fault records side by side with one `cat` (one launch), copies that span to pinned memory and
syncs once; the arrays it hands back are numpy views of the pinned buffer. A fault record
showing a fault raises `RunnerInputError` through its runner's `check_faults` (FAULTS 20, 25)
once the drafts are read; with every record clear nothing else is asked. On CPU nothing is
copied: the outputs' numpy views are handed back (a CPU runner raised in its run).

`FlatViews` keeps 1-D int32 views of tensors a caller gets back run after run, for the cats
here and in runners/proposer_device.py; `HostViews` their numpy views on CPU.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from draft_circuit.ops.input_guard import FAULT_WORDS
from draft_circuit.runners.device import HostCopy
from draft_circuit.runners.input_guard import check_copied_faults, check_runner_faults, fault_record


class FlatViews:
    """1-D int32 views of tensors a caller gets back run after run (a staged runner's outputs
    are the same tensors every run), made once and kept by the tensor's id, checked by
    identity (held here, so the id stays its own): a view is a dispatch, microseconds on CUDA.
    A tensor that is not contiguous gets a fresh copy each call (never kept)."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor, bits: bool = False) -> torch.Tensor:
        """`t` 1-D (`bits`: a float32 tensor's bits as int32)."""
        hot = self._views.get(id(t))
        if hot is not None and hot[0] is t:
            return hot[1]
        x = t.view(torch.int32) if bits else t
        if not x.is_contiguous():
            return x.reshape(-1)  # a copy: not kept
        x = x.view(-1)
        if len(self._views) >= 16:  # a runner that hands back new tensors (the oracle)
            self._views.clear()
        self._views[id(t)] = (t, x)
        return x


class HostViews:
    """`t.numpy()` of CPU tensors a caller gets back run after run (a staged runner's outputs,
    the staging's token rows: the same tensors every run), kept by the tensor's id and checked
    by identity (held here, so the id stays its own): `.numpy()` costs a microsecond a call.
    A runner that hands back new tensors each run (the oracle) gets fresh views, the kept
    ones dropped past 8."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, np.ndarray]] = {}

    def __call__(self, t: torch.Tensor) -> np.ndarray:
        hot = self._views.get(id(t))
        if hot is not None and hot[0] is t:
            return hot[1]
        if len(self._views) >= 8:
            self._views.clear()
        view = t.numpy()
        self._views[id(t)] = (t, view)
        return view


class WatchedRunners:
    """The runners whose fault records a read copies: the distinct ones among the first two
    given (`runners`), their records (`records`, in order) and those that keep none
    (`unrecorded`: asked directly). Found again only when the runners given differ from the
    latest call's, compared by identity (held here, so an identity stays its object's): every
    read of a step gets the same two, and a runner's record is its guard's one tensor, cleared
    in place, never replaced."""

    def __init__(self) -> None:
        self._given: tuple[object, ...] = ()
        self.runners: list[object] = []
        self.records: list[torch.Tensor] = []
        self.unrecorded: list[object] = []

    def __call__(self, runners: Sequence[object]) -> "WatchedRunners":
        given = tuple(runners[:2])
        if len(given) != len(self._given) or any(a is not b for a, b in zip(given, self._given)):
            self.runners = [r for i, r in enumerate(given) if not any(r is q for q in given[:i])]
            found = [(r, fault_record(r)) for r in self.runners]
            self.records = [rec for _, rec in found if rec is not None]
            self.unrecorded = [r for r, rec in found if rec is None]
            self._given = given
        return self


class ReadBack:
    """The pinned buffers and event of one proposer's host-returning reads (widths up to
    `width`, up to `max_drafts` drafts a row)."""

    def __init__(self, *, width: int, max_drafts: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        w = width
        # CPU: numpy views of the output tensors a run hands back (a staged runner's are its
        # own buffers, the same tensors every run)
        self._host_view = HostViews()
        self._records: dict[int, tuple[weakref.ref[object], np.ndarray | None]] = {}
        k2 = 2 * max(max_drafts, 1)
        # drafts and confidences, then up to two runners' fault records (chain and catch-up)
        self._out_dev = torch.zeros(w * k2 + 2 * FAULT_WORDS, dtype=torch.int32,
                                    device=device)
        self._out_host = torch.zeros(w * k2 + 2 * FAULT_WORDS, dtype=torch.int32,
                                     pin_memory=self.cuda) if self.cuda else self._out_dev
        # (a meta-device proposer, shapes only, has no host view)
        self._out_np = self._out_host.numpy() if self._out_host.device.type == "cpu" else None
        self._flat = FlatViews()
        self._spans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by the read's size
        self._read = HostCopy(device) if self.cuda else None
        self._watched = WatchedRunners()

    def _fault_word(self, runner: object) -> np.ndarray | None:
        """A numpy view of a CPU runner's fault record (word 0 nonzero: a fault), None for a
        runner without one; kept by the runner's id, checked by a weak reference (the record
        is the guard's one tensor, cleared in place)."""
        hot = self._records.get(id(runner))
        if hot is not None and hot[0]() is runner:
            return hot[1]
        record = fault_record(runner)
        view = record.numpy() if record is not None and record.device.type == "cpu" else None
        try:
            ref = weakref.ref(runner)
        except TypeError:
            return view
        if len(self._records) >= 8:
            self._records.clear()
        self._records[id(runner)] = (ref, view)
        return view

    def read(self, drafts: torch.Tensor, confidences: torch.Tensor,
             runners: Sequence[object] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [n, k] and confidences [n, k] as host arrays (views valid until the next read;
        the caller records and converts them at once): one device-to-host copy, one sync.
        `runners` (at most two: the chain's, the catch-up's) have their input-guard records
        read in the same copy, and a fault raises `RunnerInputError` (FAULTS 20, 25) once the
        drafts are read: a bad row surfaces at this sync, with no read of its own."""
        if not self.cuda:
            rows = self._host_view(drafts), self._host_view(confidences)
            for r in runners:  # a CPU runner raised in its run; nothing pending, no sync
                word = self._fault_word(r)
                if word is None or word[0]:  # a fault recorded (or no record): its own check
                    check_runner_faults(r)   # reads, clears and raises it, as on CUDA
            return rows
        n, k = drafts.shape
        end = n * 2 * k
        watched = self._watched(runners)
        runners, records = watched.runners, watched.records
        size = end + len(records) * FAULT_WORDS
        span = self._spans.get(size)
        if span is None:
            span = self._spans[size] = (self._out_dev[:size], self._out_host[:size])
        # one launch: drafts, confidences (their float32 bits) and the records, then one copy
        torch.cat([self._flat(drafts), self._flat(confidences, True), *records], out=span[0])
        assert self._read is not None
        self._read.copy(span[1], span[0])
        self._read.wait()  # the one sync of the call
        host = self._out_np
        assert host is not None  # CUDA: pinned host memory
        out = host[:n * k].reshape(n, k), host[n * k:end].view(np.float32).reshape(n, k)
        words = host[end:size]
        if len(records) != len(runners) or np.count_nonzero(words[::FAULT_WORDS]):  # else: no fault
            check_copied_faults(runners, span[1][end:].view(-1, FAULT_WORDS))
        return out
