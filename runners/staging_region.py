"""Where one chain runner's inputs are staged (runners/staging.py's `ChainStaging` keeps one a
runner): `Region`, its int32 region on the device, the host mirror(s) of it, its hidden and
log_tau buffers, the views made once a width, and what is known of their rows past the latest
run's n; `runner_region` finds a runner's own (or says it has none of the layout)."""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import numpy as np
import torch

from draft_circuit.runners.device import CurrentStream
from draft_circuit.runners.int_region import ROWS, IntMirror, int_region

if TYPE_CHECKING:
    from draft_circuit.runners.accept_counts import Advance


class Region:
    """Where one runner's inputs are staged: its int32 region (device), the host mirror(s) of it,
    its hidden and log_tau buffers, and what is known of their rows past the latest run's n."""

    def __init__(self, flat: torch.Tensor, offsets: Mapping[str, int], hidden: torch.Tensor,
                 log_tau: torch.Tensor | None, neutral: Mapping[str, int | float], *, w: int,
                 m: int, cuda: bool, runner: object | None) -> None:
        self.flat, self.hidden, self.log_tau, self.cuda = flat, hidden, log_tau, cuda
        self.neutral = dict(neutral)
        self.width = w
        self.runner = runner  # the runner whose buffers these are (None: the staging's own)
        # on CPU the mirror is the region; elsewhere host copies of it (pinned, two on CUDA)
        self.copies = flat.device.type != "cpu"
        self.hosts = [torch.zeros(flat.numel(), dtype=torch.int32, pin_memory=cuda)
                      for _ in range(2 if cuda else 1)] if self.copies else [flat]
        self.mirrors = [IntMirror(h.numpy(), offsets, w, m) for h in self.hosts]
        self.copied = [torch.cuda.Event() for _ in self.hosts] if cuda else []  # type: ignore[no-untyped-call]
        self.stream = CurrentStream(flat.device) if cuda else None
        self.turn = 0
        devs = {k: flat[offsets[k]:offsets[k] + w] for k in ROWS}
        self.tokens = devs["tokens"]
        # rows [0:hidden_dirty) of hidden may hold values; log_tau's (value, n) as filled
        self.hidden_dirty = w
        # on CPU a numpy view of the hidden buffer zeroes rows past n in a third of a torch
        # slice-and-fill's time (dtypes numpy has; bfloat16 keeps the torch fill)
        self.hidden_np = hidden.numpy() if hidden.device.type == "cpu" and not hidden.requires_grad \
            and hidden.dtype in (torch.float16, torch.float32, torch.float64) else None
        self.hidden_rows: dict[int, torch.Tensor] = {}  # hidden[:n], per n
        # rows past n zeroed in the same launch as the rows' copy (one cat: the segments, then
        # zeros up to the rows a wider run left), where a numpy view does not zero them
        self.zeros = torch.zeros_like(hidden) if runner is not None and self.hidden_np is None \
            and self.neutral.get("hidden", 0) == 0 else None
        self.zero_rows: dict[int, torch.Tensor] = {}  # zeros[:m], per m
        # HiddenRows' indices: a device buffer and its host mirror(s) (pinned, two on CUDA, used
        # in the same turns as the ints'; on CPU the buffer itself), written through numpy
        self.index = torch.zeros(w, dtype=torch.int64, device=flat.device)
        index_hosts = [torch.zeros(w, dtype=torch.int64, pin_memory=cuda) for _ in self.hosts] \
            if self.copies else [self.index]
        self.index_np = [h.numpy() for h in index_hosts]
        self.index_hosts = index_hosts
        self.index_rows: dict[int, torch.Tensor] = {}  # index[:m], per m
        self.tau: tuple[float, int] | None = None
        self.unstaged = -1  # the runner's unstaged_runs when the above was last known true
        # the staging's own region: views handed out per (n, with log_tau), made once
        self.views: dict[tuple[int, bool], Mapping[str, torch.Tensor]] = {}
        # an advanced run's device views, per n: (tokens, positions, live rows)
        self.shifted: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._devs = {**devs, "block_tables": flat[offsets["block_tables"]:
                                                   offsets["block_tables"] + w * m].view(w, m)}

    def advance(self, n: int, advance: Advance, index: torch.Tensor,
                gather: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rows [:n] as staged for no accepted draft, moved by each row's count on the device:
        token greedy[i, a_i], position and live rows + a_i, and the hidden gather's `index`
        [n] + a_i, the counts computed in the same launch on a GPU (`Advance.apply`,
        runners/accept_counts.py); after the rows' copy. `gather` (source, rows): the hidden
        gather by the moved index, enqueued by the advance right after it."""
        views = self.shifted.get(n)
        if views is None:
            views = self.shifted[n] = (self.tokens[:n], self._devs["positions"][:n],
                                       self._devs["live_rows"][:n])
        advance.apply(*views, index, gather)

    def own_views(self, n: int, tau: bool) -> Mapping[str, torch.Tensor]:
        key = (n, tau)
        if key not in self.views:
            made = {"tokens": self._devs["tokens"][:n], "hidden": self.hidden[:n],
                    "positions": self._devs["positions"][:n],
                    "block_tables": self._devs["block_tables"][:n],
                    "live_rows": self._devs["live_rows"][:n], "active": self._devs["active"][:n]}
            if tau:
                assert self.log_tau is not None
                made["log_tau"] = self.log_tau[:n]
            self.views[key] = MappingProxyType(made)
        return self.views[key]


def runner_region(runner: object, *, max_w: int, m: int, device: torch.device,
                   scratch: int) -> Region | None:
    """The region of a runner's own static inputs (as many rows as its widest program, at most
    `max_w`: the k-step chain's and the wider KV-only chain's differ), or None when it has none
    of this layout (the staging's own region serves it then)."""
    found = int_region(runner, max_w=max_w, m=m, device=device, scratch=scratch,
                       extra=("hidden",), optional=("log_tau",))
    if found is None:
        return None
    static = runner.backend.static_inputs  # type: ignore[attr-defined]
    return Region(found.flat, found.offsets, static["hidden"], static.get("log_tau"),
                   found.neutral, w=found.width, m=m, cuda=device.type == "cuda", runner=runner)
