"""The draft side of a decode step in one host call (issue 14): `MtpProposer.step_batch`.

What it does is what `after_verify_batch`, `last_pair_keys`, `catchup_batch` (of the states
with rows to catch up) and `propose_batch_on_device` do in sequence on the same states, bit for
bit (drafts, confidences, rows, keys, block tables, drafter KV; tests/runners/
test_proposer_step.py), with the work each of those calls repeats done once for the step: one
ownership check and slot lookup, one settle, one distinctness check, and one pass of every
input check. Every check is made before anything changes (the separate calls trim before the
propose's inputs are looked at); a refused propose, as theirs, still leaves the trims and the
catch-up done.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.contract import Served
from draft_circuit.runners.proposer_batch import settle_held, width_refusal
from draft_circuit.runners.proposer_device import draft_on_device
from draft_circuit.runners.proposer_inputs import check_catchup_counts, check_propose
from draft_circuit.runners.proposer_rows import write_rows
from draft_circuit.runners.proposer_slots import SMALL_BATCH, SlotTable
from draft_circuit.runners.proposer_state import (MtpProposerState, ProposerError,
                                                  trim_after_verify_batch)

if TYPE_CHECKING:  # the proposer imports this module
    from draft_circuit.runners.proposer import MtpProposer


def next_row_positions(table: SlotTable, slots: np.ndarray) -> Sequence[int] | np.ndarray:
    """The RoPE position of each state's next drafter row, from its newest pair key: key + 2
    (the row after the one at key + 1), 1 for a state with no key (no rows): the catch-up's
    first positions a host of the reference finds from `last_pair_keys` after the trim."""
    if len(slots) <= SMALL_BATCH:  # Python ints: a few numpy calls cost more than the loop
        return [k + 2 if h else 1 for k, h in zip(table.pair_key[slots].tolist(),
                                                   table.has_key[slots].tolist())]
    first: np.ndarray = table.pair_key[slots] + 2
    first[table.has_key[slots] == 0] = 1
    return first


def step_all(p: "MtpProposer", num_accepted: Sequence[int],
             catchup_tokens: Sequence[Sequence[int]],
             catchup_hiddens: Sequence[torch.Tensor] | HiddenRows, last_tokens: Sequence[int],
             target_hiddens: torch.Tensor | HiddenRows, positions: Sequence[int],
             num_drafts: int, states: Sequence[object],
             catchup_first: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`MtpProposer.step_batch` (its docstring states the contract)."""
    t, n = p.slots, len(states)
    slots = t.slots_of(states, MtpProposerState)
    if slots is None:
        for s in states:
            p._own(s)  # names the first state that is not this proposer's (after_verify's error)
    assert slots is not None
    if t.num_pending:  # the verified drafts' counts, when no last_drafts read them
        settle_held(p, states, slots)
    if not t.distinct(slots) and len(set(map(id, states))) != n:
        raise ProposerError("step_batch: a state appears twice (it would be trimmed, caught up "
                            "and drafted twice for one verify)")
    mine = cast("list[MtpProposerState]", list(states))
    # every check before any change: the catch-up's, the propose's (when served: a refused
    # batch's inputs are never read, as propose_batch_on_device's are not), then the counts
    # the trim checks before it trims
    head = p.head
    config, width = head.config, head.hidden_in_size
    ids = check_catchup_counts(catchup_tokens, catchup_hiddens, catchup_first, states,
                               hidden_size=width, vocab=config.vocab_size, distinct=True,
                               what="step_batch", arg="catchup_hiddens")
    reason = width_refusal(p, n, num_drafts, False) if n else "an empty batch (width 0)"
    if reason is None:
        check_propose(last_tokens, target_hiddens, positions, num_drafts, mine, None,
                      num_drafts_max=p.num_drafts, config=config, device=p.device,
                      hidden_size=width, distinct=True, what="step_batch target_hiddens")
    trim_after_verify_batch(t, slots, num_accepted, mine, kv_exact=p.kv_exact, refeed=p.refeed)
    # a sequence with no rows to catch up writes none (as one left out of catchup_batch)
    if any(map(len, catchup_tokens)):
        first = next_row_positions(t, slots) if catchup_first is None else catchup_first
        write_rows(p._execute, t, p.chains.kv_only()[0].max_width, catchup_tokens,
                   catchup_hiddens, first, mine, slots, ids)
    if reason is not None:
        p.last_served = Served("refused", n, reason)
        return None
    return draft_on_device(p, last_tokens, target_hiddens, positions, num_drafts, mine, slots,
                           None)
