"""The proposer's device-resident batch path (issue 14 steps 3-4): drafts that stay on the device.

`DeviceDrafts` holds the persistent buffers of `MtpProposer.propose_batch_on_device` and its
latest batch, so a host can launch its verify pass from device tensors with no host sync:

- `flat` int32: the latest batch's drafts [n, k] (-1 after a row's stop), then its confidences'
  float32 bits [n, k], then up to two fault records (below): the drafts and confidences handed
  back are views of it, filled by ONE `cat` of the chain's outputs (a single launch).
- `verify` [max_width * (K + 1)] int32: row i's last token, then its drafts with each -1 as 0:
  a verify input of k + 1 rows a sequence, flattened row-major (`verify_tokens`). A host that
  verifies a stopped row's padding rows gets tokens it never accepts (acceptance ends at the
  first -1), and their KV rows lie past the accepted ones, dead like any rejected row's.
- On CUDA the input guards' fault records of the chain and of the catch-up chain (its runs
  enqueued before this batch) are part of the same `cat`, and `flat`'s filled span is copied
  to pinned host memory right behind the chain, in stream order (`non_blocking`: one copy),
  with an event recorded after. The states settle on the next call that touches one of them;
  that read waits on the event, which has long passed once the host has synced on its verify,
  so the drafts' read costs no sync of its own. Once the states are recorded, a record
  showing a fault raises `RunnerInputError` from that runner's `check_faults` (FAULTS 20, 25):
  a bad row surfaces at the step's read, not never, and costs no sync when there is none. On
  CPU a runner raised in its run; nothing is copied.

A batch costs two device operations besides the chain's replay on a GPU, whatever n: one
kernel packs the drafts, the confidences' bits and the records and writes the verify input
(kernels/pack_drafts.py; elsewhere the same as three torch ops, the cat, the token column's
copy and the clamp), then the host copy. On CPU, where the buffers are host memory, the three
are numpy copies between views of the same memory (the same bits; a torch op's dispatch costs
microseconds) and there is no host copy.

The buffers are reused by the next device-resident batch, which settles the previous one first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch

from draft_circuit.kernels._common import compiled_cuda_index
from draft_circuit.ops.bindings import kernel
from draft_circuit.ops.input_guard import FAULT_WORDS
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.accept_counts import AcceptCounts
from draft_circuit.runners.contract import Served
from draft_circuit.runners.device import HostCopy
from draft_circuit.runners.launch_graphs import LaunchGraphs
from draft_circuit.runners.input_guard import check_copied_faults, check_runner_faults
from draft_circuit.runners.proposer_batch import served
from draft_circuit.runners.proposer_inputs import check_propose
from draft_circuit.runners.proposer_state import MtpProposerState, PendingBatch
from draft_circuit.runners.proposer_readback import FlatViews, HostViews, WatchedRunners

if TYPE_CHECKING:  # the proposer imports this module
    from draft_circuit.runners.proposer import MtpProposer


# the fill's one-launch kernel, its unchecked launcher and its record limit, imported on first
# use (triton)
_pack_checked = kernel("pack_drafts", "pack_drafts")
_pack_launch = kernel("pack_drafts", "launch_pack_drafts")
_MAX_RECORDS = kernel("pack_drafts", "MAX_RECORDS")

#: the clamp's bound as a 0-d int32 array (a Python 0 costs the ufunc a scalar conversion)
_ZERO = np.zeros((), dtype=np.int32)
_ZERO.flags.writeable = False


class DeviceDrafts:
    """The device-resident path's buffers (see the module docstring) for widths up to
    `max_width` and up to `num_drafts` drafts a row."""

    def __init__(self, *, max_width: int, num_drafts: int, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        index: int | None = self.device.index
        if self.cuda and index is None:  # "cuda" resolves, as buffers' devices do
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.k = num_drafts
        w, k = max_width, max(num_drafts, 1)
        size = 2 * w * k + 2 * FAULT_WORDS
        self.flat = torch.full((size,), -1, dtype=torch.int32, device=self.device)
        self.verify = torch.zeros(w * (num_drafts + 1), dtype=torch.int32, device=self.device)
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=True) if self.cuda \
            else self.flat
        # (a meta-device proposer, shapes only, has no host view)
        self._host_np = self._host.numpy() if self._host.device.type == "cpu" else None
        self._copied = HostCopy(self.device) if self.cuda else None
        self._watched = WatchedRunners()  # the runners whose records the latest fill copied
        self._records = 0  # how many of them have a record (all: a fault check reads numpy)
        self._all_recorded = False
        self.batch: PendingBatch | None = None
        self.counts = AcceptCounts(max_width, self.device)  # step_ahead's accepted counts
        self._rows = (0, 0)  # (n, k) of the latest batch
        self._shapes: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._host_rows: dict[tuple[int, int], np.ndarray] = {}  # the host copy's [n, k], per shape
        self._flat = FlatViews()  # 1-D views of the chain outputs a fill concatenates
        # CPU: the fill's three copies as numpy copies between numpy views of the same memory
        # (a torch op is a dispatch, microseconds; numpy's copy a fraction of one; the same
        # bits land): the buffers' views per shape, the sources' kept by identity
        self._verify_np = self.verify.numpy() if self._host_np is not None and not self.cuda \
            else None
        self._np_shapes: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self._src = HostViews()
        #: the fill's cat, token column and clamp as one kernel where kernels run compiled
        #: (kernels/pack_drafts.py), with the operands it last checked, per shape
        self.fused = compiled_cuda_index(self.flat) is not None
        self._packed: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.graphs = LaunchGraphs(self.device)  # the checked pack and its copy, replayed
        self._spans: dict[int, torch.Tensor] = {}  # flat[:size], per size
        self._host_spans: dict[int, torch.Tensor] = {}  # its host copy's, per size
        for n in range(1, max_width + 1):  # made now, not on a width's first batch
            self._views(n, num_drafts)

    def _views(self, n: int, k: int) -> tuple[torch.Tensor, ...]:
        """(drafts, confidences, verify, its token column, its draft columns) of an (n, k)
        batch: views made once per shape (per-step host work)."""
        views = self._shapes.get((n, k))
        if views is None:
            rows = self.verify[:n * (k + 1)].view(n, k + 1)
            views = self._shapes[(n, k)] = (
                self.flat[:n * k].view(n, k),
                self.flat[n * k:2 * n * k].view(n, k).view(torch.float32),
                self.verify[:n * (k + 1)], rows[:, 0], rows[:, 1:])
        return views

    def outputs(self, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts, confidences) of an (n, k) batch: the views `drafts` and `confidences` give,
        in one lookup."""
        views = self._views(n, k)
        return views[0], views[1]

    def drafts(self, n: int, k: int) -> torch.Tensor:
        return self._views(n, k)[0]

    def confidences(self, n: int, k: int) -> torch.Tensor:
        return self._views(n, k)[1]

    def verify_tokens(self) -> torch.Tensor:
        """The latest batch's verify input: i32[n * (k + 1)], row i's last token then its k
        drafts (-1 as 0). Valid until the next device-resident batch."""
        return self._views(*self._rows)[2]

    def fill(self, out: dict[str, torch.Tensor], tokens: torch.Tensor, n: int, k: int,
             runners: Sequence[object] = ()) -> None:
        """Copy a chain's outputs into the buffers and, on CUDA, enqueue their copy to the host,
        with the fault records of `runners` (at most two: the chain's, the catch-up's)."""
        self._rows = (n, k)
        watched = self._watched(runners)
        if self._verify_np is not None and self._fill_host(out["drafts"], out["confidences"],
                                                           tokens, n, k):
            return
        _, _, _, first, rest = self._views(n, k)
        parts = [self._flat(out["drafts"]), self._flat(out["confidences"], True)]
        size = 2 * n * k
        if self.cuda:
            records = watched.records
            parts += records
            size += len(records) * FAULT_WORDS
            self._records = len(records)
            self._all_recorded = len(records) == len(watched.runners)
        span = self._spans.get(size)
        if span is None:
            span = self._spans[size] = self.flat[:size]
        host = None
        if self._copied is not None:
            host = self._host_spans.get(size)
            if host is None:
                host = self._host_spans[size] = self._host[:size]
        # one launch where the packing and the verify input are one kernel (kernels/pack_drafts.py),
        # it and the host copy one graph replay once they have come a few times
        if self.fused and self._pack(parts, tokens, n, k, span, host):
            return
        torch.cat(parts, out=span)  # one launch: drafts, confidences, records
        first.copy_(tokens)
        torch.clamp(out["drafts"], min=0, out=rest)
        if self._copied is not None:
            assert host is not None  # (made above on CUDA)
            self._copied.copy(host, span)

    def warm(self, width: int, k: int) -> None:
        """Launch, now, every kernel a batch of up to `width` rows and `k` drafts adds (the
        accepted counts' and, where the fill is one kernel, the pack's for zero, one and two
        fault records) on scratch buffers: on a GPU a kernel's first launch compiles or loads
        its module (milliseconds, in the first steps' window otherwise)."""
        self.counts.warm(width, k)
        if not self.fused or k < 1:
            return
        src = torch.zeros(2 * k + 1, dtype=torch.int32, device=self.device)
        flat = torch.zeros(2 * k + 2 * FAULT_WORDS, dtype=torch.int32, device=self.device)
        verify = torch.zeros(k + 1, dtype=torch.int32, device=self.device)
        records = [torch.zeros(FAULT_WORDS, dtype=torch.int32, device=self.device)] * 2
        for r in range(_MAX_RECORDS() + 1):
            _pack_checked()(src[:k], src[k:2 * k], src[2 * k:], records[:r], flat, verify, k=k)

    def _pack(self, parts: list[torch.Tensor], tokens: torch.Tensor, n: int, k: int,
              span: torch.Tensor, host: torch.Tensor | None) -> bool:
        """`fill`'s cat, token column and clamp as one kernel (kernels/pack_drafts.py), then
        the copy of `span` to `host` (CUDA); False, nothing written, where its operands do not
        fit it: the torch ops then. The operands are checked once per set (the same views a
        step: an identity test after); a checked set's kernel and copy are one graph replay
        once they have come a few times (runners/launch_graphs.py)."""
        drafts, bits, records = parts[0], parts[1], parts[2:]
        operands = (drafts, bits, tokens, span, *records)
        seen = self._packed.get((n, k))
        if seen is not None and len(seen) == len(operands) \
                and all(a is b for a, b in zip(seen, operands)):
            flat, verify = self.flat, self.verify

            def launch() -> None:
                _pack_launch()(drafts, bits, tokens, records, flat, verify, n=n, k=k)
                if host is not None:
                    host.copy_(span, non_blocking=True)

            self.graphs.run((n, k, len(records)), operands, launch)
            if self._copied is not None:
                self._copied.record()
            return True
        if len(records) > _MAX_RECORDS() or tokens.dtype is not torch.int32 \
                or not tokens.is_contiguous():
            return False
        _pack_checked()(drafts, bits, tokens, records, self.flat, self.verify, k=k)
        self._packed[(n, k)] = operands
        if self._copied is not None:
            assert host is not None  # (made by fill on CUDA)
            self._copied.copy(host, span)
        return True

    def _fill_host(self, drafts: torch.Tensor, confidences: torch.Tensor, tokens: torch.Tensor,
                   n: int, k: int) -> bool:
        """`fill`'s cat, token column and clamp on CPU, as numpy copies into numpy views of
        `flat` and `verify` (bit for bit what the torch ops write); False, with nothing to
        trust written, for outputs numpy cannot view as int32 and float32 (the torch path)."""
        if drafts.dtype is not torch.int32 or confidences.dtype is not torch.float32 \
                or tokens.dtype is not torch.int32:
            return False
        views = self._np_shapes.get((n, k))
        if views is None:
            assert self._host_np is not None and self._verify_np is not None
            rows = self._verify_np[:n * (k + 1)].reshape(n, k + 1)
            views = self._np_shapes[(n, k)] = (
                self._host_np[:n * k].reshape(n, k),
                self._host_np[n * k:2 * n * k].reshape(n, k), rows[:, 0], rows[:, 1:])
        to_drafts, to_bits, to_first, to_rest = views
        try:  # a CPU tensor numpy cannot view (one autograd tracks, say): the torch path
            d, c, t = self._src(drafts), self._src(confidences), self._src(tokens)
        except (RuntimeError, TypeError):
            return False
        # (item assignment: a third of np.copyto's call cost)
        to_drafts[...] = d
        to_bits[...] = c.view(np.int32)  # the float32 bits, as the cat's int32 view
        to_first[...] = t
        np.maximum(d, _ZERO, out=to_rest)  # torch.clamp(drafts, min=0)
        return True

    def check_faults(self) -> None:
        """After the latest batch's read: raise a bad row its runners' records showed (CUDA: the
        copies made behind the chain; CPU: a runner raised in its run already, nothing to read)."""
        if self.cuda:
            n, k = self._rows
            at = 2 * n * k
            assert self._host_np is not None
            words = self._host_np[at:at + self._records * FAULT_WORDS]
            if self._all_recorded and not np.count_nonzero(words[::FAULT_WORDS]):
                return  # every runner's record copied, none shows a fault: nothing to ask
            check_copied_faults(self._watched.runners,
                                self._host[at:at + len(words)].view(-1, FAULT_WORDS))
        else:
            for r in self._watched.unrecorded:
                check_runner_faults(r)

    def read(self, drafts: torch.Tensor) -> np.ndarray:
        """The latest batch's drafts as a host array [n, k] (`drafts` is its view of `flat`):
        on CUDA the pinned copy, waiting on its event (already passed once the host has synced)."""
        n, k = drafts.shape
        if self._copied is not None:  # after the host's verify sync it has passed: no wait
            self._copied.wait()
        if self._host_np is None:  # a meta-device proposer: no values to read
            return drafts.numpy()
        rows = self._host_rows.get((n, k))
        if rows is None:  # a view made once a shape
            rows = self._host_rows[(n, k)] = self._host_np[:n * k].reshape(n, k)
        return rows


def propose_on_device(p: "MtpProposer", last_tokens: Sequence[int],
                      target_hiddens: torch.Tensor | HiddenRows,
                      positions: Sequence[int], num_drafts: int, states: Sequence[object],
                      bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`MtpProposer.propose_batch_on_device` (its docstring states the contract)."""
    n = len(last_tokens)
    reason, slots = p._batch_refusal(n, num_drafts, states, bitmask is not None)
    if reason is not None:
        p.last_served = Served("refused", n, reason)
        return None
    mine = cast("list[MtpProposerState]", list(states))  # _batch_refusal found (and settled) each
    mask = check_propose(last_tokens, target_hiddens, positions, num_drafts, mine, bitmask,
                         num_drafts_max=p.num_drafts, config=p.head.config, device=p.device,
                         hidden_size=p.head.hidden_in_size, distinct=p.slots.distinct(slots),
                         what="propose_batch_on_device target_hiddens")
    return draft_on_device(p, last_tokens, target_hiddens, positions, num_drafts, mine, slots,
                           mask)


def draft_on_device(p: "MtpProposer", last_tokens: Sequence[int],
                    target_hiddens: torch.Tensor | HiddenRows,
                    positions: Sequence[int], num_drafts: int, mine: list[MtpProposerState],
                    slots: np.ndarray, mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The run of a device-resident batch the caller has refused or admitted and checked
    (`mine`: `p`'s states, settled and distinct, at `slots`; the inputs `check_propose`'s,
    `mask` the bitmask it returned): the chain, the buffers' fill and the pending batch."""
    n, dev = len(last_tokens), p.device_drafts
    drafts, confs = dev.outputs(n, num_drafts)
    if num_drafts == 0:  # every row drafts nothing
        p.slots.record(slots, np.zeros((n, 0), np.int64), p.slots.rows[slots],
                       np.fromiter(positions, dtype=np.int64, count=n))
        p.last_served = Served("empty", n)
        return drafts, confs
    if dev.batch is not None:
        dev.batch.settle()  # its drafts live in the buffers this batch overwrites
    out, rows = p._run_chain(last_tokens, target_hiddens, positions, num_drafts, mine, mask, slots)
    chain = p.chains.get(num_drafts, mask is not None)
    dev.fill(out, p.staging.tokens(n), n, num_drafts, (chain, p.chains.kv_only()[0]))
    batch = PendingBatch(drafts, rows, list(positions), mine, slots, p.slots, read=dev.read,
                         check=dev.check_faults)
    # every state settles with the batch (each held none before: the caller settled them)
    p.slots.set_pending(slots, batch)
    p.slots.num_pending += n
    dev.batch = batch
    p.last_served = served(p, chain.plan(n).kind, n)
    return drafts, confs
