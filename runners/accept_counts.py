"""The accepted counts of a verify, computed on the device, and the shift they give the next
propose's staged rows (issue 20 / 14: `MtpProposer.step_ahead`, runners/proposer_ahead.py).

`AcceptCounts` owns the device counts [width] and their pinned host copy. `advance(drafts,
greedy)` returns an `Advance` and launches nothing: the propose's staging applies it
(`Advance.apply`) once its rows are copied, which

- computes a_i = the leading drafts[i] equal to greedy[i] at the row before them (a stopped
  row's -1 never matches: `speculate.accept` per row),
- moves row i's staged inputs: token greedy[i, a_i] (a -1, a verify row with no finite logit,
  as 0: its host raises at the read, FAULTS 27), position and live rows + a_i, hidden index
  + a_i (before the hidden gather),
- enqueues the counts' copy to pinned host memory, an event after, so the batch's settle reads
  them without a sync of its own (`read`).

On a GPU, where kernels run compiled, that is ONE launch (kernels/accept_advance.py) and the
copy; elsewhere (a CPU, the Triton interpreter) it is the same arithmetic as torch ops
(`accept_counts` and four shifts, ten launches on a GPU, ~15 us of host each on the H100's
host), bit for bit the kernel's. `fused` picks the path (None: the kernel where it compiles).
A propose that fails before its staging applied the advance leaves the counts to `settle`,
which computes them alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from draft_circuit.kernels._common import compiled_cuda_index
from draft_circuit.ops.bindings import kernel
from draft_circuit.runners.device import HostCopy
from draft_circuit.runners.launch_graphs import LaunchGraphs

# the one-launch kernel and its unchecked launcher, imported on first use (triton)
_checked_launch = kernel("accept_advance", "accept_advance")
_launch = kernel("accept_advance", "launch_accept_advance")


def accept_counts(drafts: torch.Tensor, greedy: torch.Tensor, out: torch.Tensor,
                  scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """out[i] = how many leading drafts[i] equal greedy[i] at the row before them (drafts
    [n, k], -1 after a stop, never accepted; greedy [n, k + 1]): `speculate.accept` per row, as
    device ops with no read. `scratch`: int64, bool and int64 buffers [n, k] for the
    intermediates (none allocated then: every op writes its out= buffer in its own dtype; a
    cumprod that converts bool to int64 allocates the converted copy, seen on the H100)."""
    k = drafts.shape[1]
    match, drafted, prefix = scratch or _scratch(drafts.shape, drafts.device)
    torch.eq(drafts, greedy[:, :k], out=match)  # 1 / 0
    torch.ge(drafts, 0, out=drafted)  # a stop's -1 is no draft, whatever the target's row holds
    match.mul_(drafted)
    torch.cumprod(match, 1, out=prefix)  # 1 while every draft so far matched
    return torch.sum(prefix, 1, out=out)


def _scratch(shape: Sequence[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_counts`' intermediates for drafts of `shape`: the match (int64), the drafted
    mask (bool) and the running product (int64)."""
    return (torch.empty(shape, dtype=torch.int64, device=device),
            torch.empty(shape, dtype=torch.bool, device=device),
            torch.empty(shape, dtype=torch.int64, device=device))


class Advance:
    """One propose's pending accept-and-shift (`AcceptCounts.advance`): the drafts the verify
    checked [n, k], its greedy tokens [n, k + 1] (int32, on the counts' device). Applied once,
    by the staging (`apply`) or, when the propose failed before it, by `AcceptCounts.settle`."""

    __slots__ = ("drafts", "greedy", "n", "applied", "_owner")

    def __init__(self, owner: "AcceptCounts", drafts: torch.Tensor, greedy: torch.Tensor) -> None:
        self.drafts, self.greedy, self.n = drafts, greedy, drafts.shape[0]
        self.applied = False
        self._owner = owner

    def apply(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
              index: torch.Tensor, gather: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Compute the counts and move the staged rows [n] (tokens, positions, live: int32;
        index: int64, the hidden gather's) by them, then copy the counts to the host; after the
        rows' copy to the device, before the chain (stream order). `gather` (source, rows): the
        hidden gather by the moved index, `index_select(source, 0, index, out=rows)`, enqueued
        right after (part of the same replayed graph on a GPU: runners/launch_graphs.py)."""
        if self.applied:
            raise RuntimeError("an Advance is applied once (the staged rows would move twice)")
        self._owner._apply(self, tokens, positions, live, index, gather)


class AcceptCounts:
    """The device counts of the latest `step_ahead` and their pinned host copy (widths up to
    `width`); see the module docstring."""

    def __init__(self, width: int, device: torch.device, *, fused: bool | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.dev = torch.zeros(width, dtype=torch.int64, device=device)
        #: the one-launch kernel (kernels/accept_advance.py) or the torch ops
        self.fused = compiled_cuda_index(self.dev) is not None if fused is None else fused
        self.host = torch.zeros(width, dtype=torch.int64, pin_memory=True) if self.cuda \
            else self.dev
        self.host_np = self.host.numpy() if self.host.device.type == "cpu" else None
        self._copied = HostCopy(device) if self.cuda else None
        #: the checked kernel, the counts' copy and the gather as a replayed graph (CUDA)
        self.graphs = LaunchGraphs(device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # the operands the kernel's launcher checked, per n (the same cached views a step: an
        # identity test instead of seven operand checks)
        self._checked: dict[int, tuple[torch.Tensor, ...]] = {}

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts [n], counts as [n, 1], their host copy [n]): views made once a width."""
        views = self._views.get(n)
        if views is None:
            dev = self.dev[:n]
            views = self._views[n] = (dev, dev.view(n, 1), self.host[:n])
        return views

    def advance(self, drafts: torch.Tensor, greedy: torch.Tensor) -> Advance:
        """The pending accept of drafts [n, k] against greedy [n, k + 1]: nothing launched."""
        return Advance(self, drafts, greedy)

    def _apply(self, adv: Advance, tokens: torch.Tensor, positions: torch.Tensor,
               live: torch.Tensor, index: torch.Tensor,
               gather: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        n = adv.n
        counts, column, host = self.views(n)
        if self.fused:
            operands = (adv.drafts, counts, tokens, positions, live, index)
            seen = self._checked.get(n)
            if seen is not None and all(a is b for a, b in zip(seen, operands)):
                self._replayed(adv, operands, host, gather)
                return
            _checked_launch()(adv.drafts, adv.greedy, counts, tokens, positions, live, index)
            self._checked[n] = operands
        else:
            self._counts(adv)
            index.add_(counts)
            torch.gather(adv.greedy, 1, column, out=tokens.view(n, 1))
            tokens.clamp_(min=0)
            positions.add_(counts)
            live.add_(counts)
        self._copy(adv)
        if gather is not None:
            torch.index_select(gather[0], 0, index, out=gather[1])

    def _replayed(self, adv: Advance, operands: tuple[torch.Tensor, ...], host: torch.Tensor,
                  gather: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The checked operands' kernel, the counts' copy and the gather, as one graph replay
        once they have come a few times (runners/launch_graphs.py). The per-call views, the
        verify's greedy tokens and the gather's source (the verify's hiddens), go in the key by
        address and layout (step_ahead checked the greedy: contiguous int32 [n * (k + 1)]); the
        persistent views by identity."""
        drafts, counts, tokens, positions, live, index = operands
        greedy = adv.greedy
        copied = self._copied is not None
        if gather is None:
            key: tuple[object, ...] = (adv.n, greedy.data_ptr())
        else:
            src = gather[0]
            key = (adv.n, greedy.data_ptr(), src.data_ptr(), src.dtype, *src.shape, *src.stride())
            operands = (*operands, gather[1])

        def launch() -> None:
            _launch()(drafts, greedy, counts, tokens, positions, live, index)
            if copied:
                host.copy_(counts, non_blocking=True)
            if gather is not None:
                torch.index_select(gather[0], 0, index, out=gather[1])

        self.graphs.run(key, operands, launch)
        # (after the run, not before: a launch that raised leaves the counts to `settle`, which
        # recomputes them; the eager path's gather raising after its copy leaves them applied)
        adv.applied = True
        if self._copied is not None:
            self._copied.record()

    def _counts(self, adv: Advance) -> None:
        """The counts alone, as torch ops (scratch made once a shape: no allocation a step)."""
        shape = (adv.n, adv.drafts.shape[1])
        scratch = self._scratch.get(shape)
        if scratch is None:
            scratch = self._scratch[shape] = _scratch(shape, self.dev.device)
        accept_counts(adv.drafts, adv.greedy, self.views(adv.n)[0], scratch)

    def _copy(self, adv: Advance) -> None:
        adv.applied = True
        if self._copied is not None:
            counts, _, host = self.views(adv.n)
            self._copied.copy(host, counts)

    def settle(self, adv: Advance) -> None:
        """The counts of an advance its propose never applied (it failed first), computed now;
        nothing for one applied."""
        if not adv.applied:
            self._counts(adv)
            self._copy(adv)

    def warm(self, width: int, k: int) -> None:
        """Run, now, what an advance launches at every width up to `width` (the kernel, or the
        torch ops) on a scratch instance's buffers, so this one's counts stay a pending
        batch's, and make this one's views and scratch a width: on a GPU a kernel's first
        launch loads its module (milliseconds each, in the first steps' window otherwise)."""
        if k < 1:
            return
        dev = self.dev.device
        spare = AcceptCounts(width, dev, fused=self.fused)
        rows = torch.zeros((3, width), dtype=torch.int32, device=dev)
        index = torch.zeros(width, dtype=torch.int64, device=dev)
        for n in range(width, 0, -1):
            drafts = torch.full((n, k), -1, dtype=torch.int32, device=dev)
            greedy = torch.zeros((n, k + 1), dtype=torch.int32, device=dev)
            spare.advance(drafts, greedy).apply(rows[0, :n], rows[1, :n], rows[2, :n], index[:n])
            spare.settle(spare.advance(drafts, greedy))  # the failure path's torch ops
            self.views(n)
            self._scratch.setdefault((n, k), _scratch((n, k), dev))
        spare.read(1)

    def read(self, n: int) -> np.ndarray:
        """The latest counts as a fresh host array [n] (waits on their copy if it has not landed)."""
        if self._copied is not None:
            self._copied.wait()
        if self.host_np is None:  # a meta-device proposer: no values
            return np.zeros(n, dtype=np.int64)
        return self.host_np[:n].copy()
