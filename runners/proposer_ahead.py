"""The draft side of a decode step launched before the host reads its verify (issues 20, 14):
`MtpProposer.step_ahead`.

Until now a decode step on the device path went: verify -> the host reads the target's greedy
tokens (a sync) -> accept on the host -> `step_batch` (trims, catch-up, next propose) launched.
Everything between the read and the first draft launch was host time with the GPU idle (the
H100 timeline: ~600 us a step). `step_ahead` launches the draft side right behind the verify,
before anything is read, and leaves the one unknown, each row's accepted count, to the device:

- **Accept on the device.** a_i = the leading drafts equal to the target's argmax at the row
  before them (the engine's `speculate.accept` per row; a stopped row's -1 never matches),
  computed with the propose's shifts below, in one launch on a GPU (runners/accept_counts.py).
  The counts are copied to pinned host memory right after (an event after), so the
  proposer's host state settles from them later without a sync of its own.
- **A catch-up that does not depend on a.** Under the exact-KV trim rule (`kv_exact`, not
  `refeed`) the trim is d - 1 rows whatever a is, and the catch-up writes the rows of the
  accepted drafts at positions p + 1 .. p + a. This call writes the rows of every kept draft,
  p + 1 .. p + d (their tokens and target hiddens are known before the verify's read: the
  drafts, the verify's rows). The rows past p + a hold the rejected drafts' K/V: they lie past
  the state's rows once it settles (p + a), no attention reads a row at or past its own
  position, and the next propose (at p + a + 1) writes them again in order before anything
  could read them. The drafter's valid rows are bitwise what the read-first path writes.
- **A propose whose inputs come from the device.** Row i drafts from the target's token after
  its a_i-th draft (greedy[i, a_i]), the verify hidden at its row a_i, at position
  p_i + 1 + a_i with p_i + a_i rows before it: the staging stages the a = 0 values and then
  shifts them by the device counts (`Advance`, runners/staging.py) before the chain runs.
  Every table is grown for the worst case (a = d) before anything changes.

The batch settles as a device-resident batch does (`PendingBatch`): on the first call that
touches one of its states, which reads the drafts and the counts (pinned copies, long done by
then) and records rows p + a, key p + a - 1, then the propose's drafts from there.

It serves only what it can do exactly: the latest device-resident batch's states, in order (or,
before it settles, those of them still waiting on it when the others were freed: sequences that
finished, `kept_rows`; their drafts are moved to the front of the device buffer first), no
later propose on any of them, each with at least one kept draft and drafted from its position
- 1 rows, the exact-KV rule, a served width, tables and a pool with room for p + d + k rows.
Anything else is refused before any change but the drafts' read (`last_served` says why; the
host reads its verify and uses `step_batch`). Bad tensors and counts raise `ProposerError`
naming the argument. A verify row with no finite logit (greedy -1) is drafted from as token 0:
the host raises at its read (FAULTS 27), and the chain's own guard does not raise first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch

from draft_circuit.runners.accept_counts import Advance
from draft_circuit.runners.contract import Served
from draft_circuit.runners.hidden_rows import HiddenRows, check_hidden_rows
from draft_circuit.runners.kv_cache import PoolExhausted
from draft_circuit.runners.proposer_batch import last_drafts_of, served, width_refusal
from draft_circuit.runners.proposer_inputs import check_num_drafts
from draft_circuit.runners.proposer_chunks import ChainRows, consecutive, consecutive_runs
from draft_circuit.runners.proposer_rows import grow_all, write_rows
from draft_circuit.runners.proposer_state import (MtpProposerState, PendingBatch, ProposerError,
                                                  trim_after_verify_batch)

if TYPE_CHECKING:  # the proposer imports this module
    from draft_circuit.runners.proposer import MtpProposer
    from draft_circuit.runners.proposer_device import DeviceDrafts


#: placeholder tokens of an advanced propose (its staging gathers the real ones), read-only,
#: sliced per call and grown when a wider batch comes (no array made a step)
_NO_TOKENS = np.zeros(0, dtype=np.int64)


def _placeholder(n: int) -> np.ndarray:
    global _NO_TOKENS
    if len(_NO_TOKENS) < n:
        _NO_TOKENS = np.zeros(max(n, 2 * len(_NO_TOKENS)), dtype=np.int64)
        _NO_TOKENS.flags.writeable = False
    return _NO_TOKENS[:n]


def kept_rows(batch: PendingBatch, states: Sequence[object]) -> list[int] | None:
    """The rows of `batch` that `states` are, in its order: all of its states, or (a batch
    narrowed by finishes, not yet settled) every one still waiting on it, the others dropped
    since (freed or handed over: `PendingBatch.dropped`); None otherwise. (Once settled, a
    state left out could still await its verify with these drafts: not narrowed.)"""
    every = batch.states
    if len(every) == len(states) and all(a is b for a, b in zip(every, states)):
        return list(range(len(every)))
    if batch.done or not states or len(states) != len(every) - batch.dropped:
        return None
    keep, i, pending = [], 0, batch.table.pending
    for s in states:  # a subsequence of the batch's states, each still holding the batch
        while i < len(every) and every[i] is not s:
            i += 1
        if i == len(every) or pending[batch.slots[i]] is not batch:
            return None
        keep.append(i)
        i += 1
    return keep


def _refusal(p: "MtpProposer", n: int, k: int, states: Sequence[object]) -> str | None:
    """Why `step_ahead` cannot serve these states before anything is read (None: it may)."""
    if not p.kv_exact or p.refeed:
        return "the drafter's trim depends on the accepted count (kv_exact off or refeed on)"
    batch = p.device_drafts.batch
    if batch is None or kept_rows(batch, states) is None:
        return ("the states are not the latest device-resident batch's still waiting on it, in "
                "its order")
    if batch.drafts.shape[1] != k:
        return f"the batch drafted {batch.drafts.shape[1]} a row, not {k}"
    return width_refusal(p, n, k, False)


def _narrow_drafts(dev: DeviceDrafts, width: int, keep: list[int], k: int) -> None:
    """The kept rows of a width-`width` batch's device drafts moved to the front, as an
    `len(keep)`-row batch's (the view the accept counts' launch knows by identity): one cat
    of the kept runs of rows (a new tensor: the source and the front overlap), then one copy
    (nothing where only the last rows finished). Only after the batch
    settled: on CPU the drafts' host copy is this buffer."""
    runs = consecutive_runs(keep)
    if runs == [(0, len(keep))]:  # the last rows finished: the rest are in place
        return
    rows = dev.drafts(width, k)
    dev.drafts(len(keep), k).copy_(torch.cat([rows[a:b] for a, b in runs]))


def _check_tensors(p: "MtpProposer", greedy: object, hiddens: object, n: int, k: int) -> None:
    """Raise ProposerError naming the argument for a greedy or hiddens tensor of the wrong
    kind, shape or device (nothing read or changed)."""
    rows = n * (k + 1)
    if not isinstance(greedy, torch.Tensor) or greedy.dim() != 1 or greedy.numel() != rows \
            or greedy.dtype is not torch.int32 or not greedy.is_contiguous():
        got = f"{greedy.dtype} {list(greedy.shape)} stride {greedy.stride()}" \
            if isinstance(greedy, torch.Tensor) \
            else type(greedy).__name__
        raise ProposerError(f"step_ahead greedy: expected the verify's int32 greedy tokens "
                            f"[{rows}] ({n} rows x {k + 1}, contiguous), got {got}")
    if not isinstance(hiddens, torch.Tensor) or hiddens.dim() != 2 or hiddens.shape[0] < rows:
        got = f"{list(hiddens.shape)}" if isinstance(hiddens, torch.Tensor) \
            else type(hiddens).__name__
        raise ProposerError(f"step_ahead hiddens: expected the verify's hiddens [>= {rows}, H], "
                            f"got {got}")
    want = p.device_drafts.device  # (resolved: "cuda" is the current device's index)
    for name, t in (("greedy", greedy), ("hiddens", hiddens)):
        if t.device != want:
            raise ProposerError(f"step_ahead {name}: on {t.device}, the proposer's device is "
                                f"{p.device_drafts.device} (the counts and the gather run there)")
    if hiddens.dtype is not p.staging.hidden_dtype:
        raise ProposerError(f"step_ahead hiddens: {hiddens.dtype}, the chain's hidden buffer is "
                            f"{p.staging.hidden_dtype} (the device gather does not convert)")


def step_all_ahead(p: "MtpProposer", greedy: torch.Tensor, hiddens: torch.Tensor,
                   num_drafts: int, states: Sequence[object]
                   ) -> tuple[list[list[int]], torch.Tensor] | None:
    """`MtpProposer.step_ahead` (its docstring states the contract)."""
    n, k = len(states), num_drafts
    check_num_drafts(k, p.num_drafts)  # a typed error for a count that is no draft count
    if k < 1 or n < 1:
        p.last_served = Served("refused", n, "nothing to draft ahead (no row or no draft)")
        return None
    reason = _refusal(p, n, k, states)
    if reason is not None:
        p.last_served = Served("refused", n, reason)
        return None
    _check_tensors(p, greedy, hiddens, n, k)
    t, dev = p.slots, p.device_drafts
    batch = dev.batch
    assert batch is not None
    keep = kept_rows(batch, states)
    assert keep is not None  # (_refusal)
    whole = len(keep) == len(batch.states)
    # narrowed: the slots array `slots_of` keeps for these states (the values of
    # batch.slots[keep]), so the batch drafted below is found by identity next time
    # (`_latest_batch`) and settles on the fast path
    slots = batch.slots if whole else t.slots_of(states, MtpProposerState)
    assert slots is not None
    drafts = last_drafts_of(p, states)  # the batch's one read (its copy landed behind the chain)
    # read after the settle (a batch drafted ahead knows them then): each row's position
    # before the verify, p, and the rows it drafted from, which must be p - 1 (the rows
    # every propose of a decode step drafts from; the shifts below assume it)
    base = np.asarray(batch.positions, dtype=np.int64)
    drafted_from = np.asarray(batch.rows)
    if not whole:
        base, drafted_from = base[keep], drafted_from[keep]
    mine = cast("list[MtpProposerState]", list(states))
    counts = np.fromiter(map(len, drafts), dtype=np.int64, count=n)
    limit = p.kv.max_blocks_per_seq * p.kv.block_size
    why = None
    if (t.proposed[slots] != batch.serial).any():
        why = "a later propose replaced the batch's drafts"
    elif not counts.all() or not t.awaiting[slots].all():
        why = "a row kept no draft or was verified already"
    elif (drafted_from != base - 1).any():
        why = "a row drafted from other rows than its position - 1"
    elif int((base + counts).max()) + k > limit:
        why = "a table lacks room for the worst case (every draft accepted)"
    if why is not None:
        p.last_served = Served("refused", n, why)
        return None
    k1 = k + 1
    starts = np.arange(0, n * k1, k1, dtype=np.int64)
    picked = check_hidden_rows(HiddenRows(hiddens, consecutive(starts, counts)), int(counts.sum()),
                               p.head.hidden_in_size, "step_ahead hiddens")
    # room for the worst case (every draft accepted) in every table first, all or nothing:
    # the catch-up's p + d rows, then the propose's k more
    try:
        grow_all(t, slots, mine, base + counts + k)
    except PoolExhausted:  # nothing was taken: the read-first path needs fewer blocks
        p.last_served = Served("refused", n, "the drafter pool lacks the worst case's blocks")
        return None
    if not whole:  # some finished: the rest's drafts as an n-row batch's
        _narrow_drafts(dev, len(batch.states), keep, k)
    # the accepted counts of the drafts the verify checked (still in the device buffers: this
    # batch's fill comes after), computed with the propose's shifts once its rows are staged
    # (runners/accept_counts.py: one launch on a GPU)
    advance: Advance = dev.counts.advance(dev.drafts(n, k), greedy.view(n, k1))
    d_list = counts.tolist()
    # the exact-KV trim (d - 1 rows) does not read the count: the kept drafts stand in for it
    trim_after_verify_batch(t, slots, d_list, mine, kv_exact=True, refeed=False)
    write_rows(p._execute, t, p.chains.kv_only()[0].max_width, drafts, picked, base + 1, mine,
               slots)
    rows = ChainRows(_placeholder(n), HiddenRows(hiddens, starts), base + 1, slots,
                     base, mine, advance=advance)
    try:
        out = p._execute(k, rows, None)
    except BaseException:  # the catch-up stands; its rows past each count are not the target's
        try:  # (a read that fails, after a device error, leaves the original error to raise)
            dev.counts.settle(advance)  # (a propose that failed before its staging applied it)
            t.set_caught_up(slots, base + dev.counts.read(n))
            for s in mine:  # the worst case's blocks past the rows, as a failed propose's
                s.blocks.release_unused()
        except Exception:
            pass
        raise
    chain = p.chains.get(k, False)
    drafts_dev = dev.outputs(n, k)[0]
    dev.fill(out, p.staging.tokens(n), n, k, (chain, p.chains.kv_only()[0]))
    pending = PendingBatch(drafts_dev, base, base, mine, slots, t, read=dev.read,
                           check=dev.check_faults, counts=lambda: dev.counts.read(n))
    t.set_pending(slots, pending)
    t.num_pending += n
    dev.batch = pending
    p.last_served = served(p, chain.plan(n).kind, n)
    return drafts, dev.verify_tokens()
