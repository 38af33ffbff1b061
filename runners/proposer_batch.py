"""The proposer's batch entry points over its states' slots (issue 14): the per-sequence work
of a decode step as array operations on the `SlotTable` columns (runners/proposer_slots.py).

`MtpProposer` keeps the contract (its methods' docstrings); this module does the work: the
batch refusal and its one ownership check, the host-returning `propose_batch`,
`after_verify_batch`'s trims, `catchup_batch`'s checks, `last_drafts` and `last_pair_keys`
read from the columns. Each checks that every state is the proposer's with one pass of C-level
maps over the states, not a call a state (a batch an earlier call found the proposer's and
distinct: one tuple of its ids, `SlotTable.slots_of`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.contract import Served, ServedKind
from draft_circuit.runners.proposer_inputs import (check_catchup_counts, check_drafter_pairs,
                                                   check_num_drafts, check_propose)
from draft_circuit.runners.proposer_rows import record_batch, write_rows
from draft_circuit.runners.proposer_state import (MtpProposerState, PendingBatch, ProposerError,
                                                  settle, trim_after_verify_batch)

if TYPE_CHECKING:  # the proposer imports this module
    from draft_circuit.runners.proposer import MtpProposer

_NONE = np.zeros(0, np.intp)
# the proposer's log (a host filters on the proposer's name); each message once per process
log = logging.getLogger("draft_circuit.runners.proposer")
_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def settled_slots(p: "MtpProposer", states: Sequence[object]) -> np.ndarray | None:
    """The slots of `states` when every one is `p`'s (None otherwise), each settled: the
    batch's one ownership check."""
    slots = p.slots.slots_of(states, MtpProposerState)
    if slots is not None:
        settle_held(p, states, slots)
    return slots


def _latest_batch(p: "MtpProposer", slots: np.ndarray) -> PendingBatch | None:
    """The latest device batch when `slots` is its states' array (`slots_of`'s for them: the
    same states in the same order) and every one of them still holds it; else None."""
    batch = p.device_drafts.batch
    if batch is not None and batch.slots is slots and not batch.dropped and not batch.done:
        return batch
    return None


def settle_held(p: "MtpProposer", states: Sequence[object], slots: np.ndarray) -> None:
    """Settle whatever deferred drafts `states` (`p`'s, at `slots`) hold."""
    t = p.slots
    if t.num_pending:  # else no slot holds deferred drafts: nothing to do
        batch = _latest_batch(p, slots)
        if batch is not None:
            # the latest device batch's own states, every one still holding it (a state holds
            # one pending at most): settling it settles them all
            batch.settle()
            return
        pending = t.pending[slots]
        held = pending[pending != None].tolist()  # noqa: E711  (elementwise)
        if held:  # a device batch's drafts (one read for all its states), or deferred ones
            if all(isinstance(x, PendingBatch) for x in set(held)):
                for batch in set(held):
                    batch.settle()
            else:
                for s in cast("Sequence[MtpProposerState]", states):
                    settle(s)


def batch_refusal(p: "MtpProposer", n: int, k: int, states: Sequence[object],
                  masked: bool) -> tuple[str | None, np.ndarray]:
    """Why n states cannot draft in one run (None: they can, and every state is `p`'s,
    settled: the caller may take them as its own without a second pass), and their slots."""
    slots = settled_slots(p, states) if n else None
    if n == 0:
        return "an empty batch (width 0)", _NONE
    if slots is None:
        return "a state of another proposer", _NONE  # the caller drafts each alone
    return width_refusal(p, n, k, masked), slots


def width_refusal(p: "MtpProposer", n: int, k: int, masked: bool) -> str | None:
    """Why a batch of n >= 1 rows cannot draft k drafts in one run of the chain (None: it
    can): a k outside 0..num_drafts raises, an unserved width or a path the head refuses is
    the reason (the latter logged once a process). Reads no state."""
    check_num_drafts(k, p.num_drafts)
    if k == 0:
        return None  # nothing runs: every row drafts nothing
    runner = p.chains.get(k, masked)
    if not runner.serves(n):
        return f"width {n} is not served (the {k}-step chain serves up to {runner.max_width})"
    reason = p.refusal(n)
    if reason is not None:
        warn_once(f"refuse:{reason}", f"propose_batch refused ({reason}); drafting each "
                                      "sequence alone")
    return reason


def served(p: "MtpProposer", kind: ServedKind, n: int) -> Served:
    """The `Served` record of a batch of n served as `kind`: immutable, so one a (kind, width)
    is kept and handed out again, not one made a call."""
    got = p._served.get((kind, n))
    return got if got is not None else p._served.setdefault((kind, n), Served(kind, n))


def propose_all(p: "MtpProposer", last_tokens: Sequence[int],
                target_hiddens: torch.Tensor | HiddenRows,
                positions: Sequence[int], num_drafts: int, states: Sequence[object],
                bitmask: torch.Tensor | None,
                out_conf: list[list[float]] | None) -> list[list[int]] | None:
    """`MtpProposer.propose_batch` (its docstring states the contract)."""
    n = len(last_tokens)
    reason, slots = p._batch_refusal(n, num_drafts, states, bitmask is not None)
    if reason is not None:
        p.last_served = Served("refused", n, reason)
        return None
    mine = cast("list[MtpProposerState]", states)  # _batch_refusal found (and settled) each
    mask = check_propose(last_tokens, target_hiddens, positions, num_drafts, mine, bitmask,
                         num_drafts_max=p.num_drafts, config=p.head.config, device=p.device,
                         hidden_size=p.head.hidden_in_size, distinct=p.slots.distinct(slots))
    kind: ServedKind = "empty"
    if num_drafts:
        out, rows = p._run_chain(last_tokens, target_hiddens, positions, num_drafts, mine, mask,
                                 slots)
        # one read: drafts, confidences and the input-guard records of this chain and the
        # catch-up chain (RunnerInputError for a bad row; our own inputs never make one)
        chain = p.chains.get(num_drafts, mask is not None)
        drafts, confs = p.staging.read(out["drafts"], out["confidences"],
                                       (chain, p.chains.kv_only()[0]))
        kind = chain.plan(n).kind
    else:  # zero drafts: nothing runs, every row drafts nothing
        rows = p.slots.rows[slots]
        drafts, confs = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
    p.last_served = served(p, kind, n)
    result, counts = record_batch(p.slots, slots, drafts, rows, positions)
    if out_conf is not None:
        out_conf[:] = [c[:d] for c, d in zip(confs.tolist(), counts)]
    return result


def after_verify_all(p: "MtpProposer", num_accepted: Sequence[int],
                     states: Sequence[object]) -> None:
    """`MtpProposer.after_verify_batch` (its docstring states the contract)."""
    slots = settled_slots(p, states)
    if slots is None:
        for s in states:
            p._own(s)  # names the first state that is not this proposer's
    assert slots is not None
    if not p.slots.distinct(slots) and len(set(map(id, states))) != len(states):
        raise ProposerError("after_verify_batch: a state appears twice (it would be trimmed "
                            "twice for one verify)")
    trim_after_verify_batch(p.slots, slots, num_accepted,
                            cast("Sequence[MtpProposerState]", states),
                            kv_exact=p.kv_exact, refeed=p.refeed)


def catchup_one(p: "MtpProposer", tokens: Sequence[int], hiddens: torch.Tensor, row_base: int,
                pos_base: int, state: object) -> int:
    """`MtpProposer.catchup_drafter` (its docstring states the contract)."""
    mine = p._mine(state)
    if mine is None:
        return 0
    check_drafter_pairs(tokens, hiddens, pos_base, hidden_size=p.head.hidden_in_size,
                        vocab=p.head.config.vocab_size, what="catchup_drafter")
    if row_base != mine.rows or len(tokens) < 2:
        return 0
    return write_rows(p._execute, p.slots, p.chains.kv_only()[0].max_width, [list(tokens[1:])],
                      [hiddens[:len(tokens) - 1]], [pos_base], [mine],
                      np.array([mine.slot], dtype=np.intp))


def catchup_all(p: "MtpProposer", tokens: Sequence[Sequence[int]],
                hiddens: Sequence[torch.Tensor] | HiddenRows, first_pos: Sequence[int],
                states: Sequence[object]) -> int:
    """`MtpProposer.catchup_batch` (its docstring states the contract)."""
    t = p.slots
    slots = t.slots_of(states, MtpProposerState)  # changes no state: the checks come first
    ids = check_catchup_counts(tokens, hiddens, first_pos, states,
                               hidden_size=p.head.hidden_in_size, vocab=p.head.config.vocab_size,
                               distinct=slots is not None and t.distinct(slots))
    if slots is None:  # a state of another proposer among them
        return 0
    settle_held(p, states, slots)
    return write_rows(p._execute, t, p.chains.kv_only()[0].max_width, tokens, hiddens, first_pos,
                      cast("Sequence[MtpProposerState]", states), slots, ids)


def last_drafts_of(p: "MtpProposer", states: Sequence[object]) -> list[list[int]]:
    """`MtpProposer.last_drafts`: the drafts its settle recorded when `states` are the latest
    device batch's, as its read left them (the engine's step: no second read of the columns);
    otherwise one gather of the drafts column for the whole batch."""
    slots = p.slots.slots_of(states, MtpProposerState)
    if slots is None:  # a state of another proposer among them
        return [m.last_drafts if (m := p._mine(s)) is not None else [] for s in states]
    if not len(slots):
        return []
    t = p.slots
    if t.num_pending:
        batch = _latest_batch(p, slots)
        kept = batch.settle() if batch is not None else None
        if kept is not None:
            return kept
        settle_held(p, states, slots)
    counts: list[int] = t.kept[slots].tolist()
    widest = max(counts)
    rows: list[list[int]] = t.drafts.take(slots, axis=0)[:, :widest].tolist()
    if min(counts) != widest:  # rows that stopped early: cut each to its kept drafts
        rows = [r[:c] for r, c in zip(rows, counts)]
    return rows


def last_pair_keys_of(p: "MtpProposer", states: Sequence[object]) -> list[int | None]:
    """`MtpProposer.last_pair_keys`: one gather of the key columns."""
    slots = settled_slots(p, states)
    if slots is None:
        return [p.last_pair_key(s) for s in states]
    t = p.slots
    # two 1-D gathers read as lists: a numpy reduction (has.all()) costs several microseconds
    # on a cold call, a C-level scan of the list a fraction of one
    keys: list[int | None] = t.pair_key[slots].tolist()
    has: list[int] = t.has_key[slots].tolist()
    if 0 in has:  # a state without rows (else the steady state: every key as it is)
        return [k if h else None for k, h in zip(keys, has)]
    return keys
