"""The batch entry points over the per-slot state columns (issue 14, runners/proposer_slots.py):
after_verify_batch and last_pair_keys equal their per-state calls, refuse what they refuse with
the same errors (all or nothing), settle a device batch first; and the steady-state decode step
(propose_batch, after_verify_batch, catchup_batch) runs the same number of Python lines in the
proposer's own modules at every width: its per-sequence work is array operations."""
import random
import sys
from pathlib import Path

import numpy as np
import pytest

import draft_circuit.runners as runners_pkg
from draft_circuit.runners.proposer_state import ProposerError, rows_to_trim
from tests.runners.test_proposer import K, hidden, make, prefilled


def snapshot(p, states):
    return [(p.drafter_rows(s), p.last_pair_key(s), s.last_num_drafted, s.awaiting_verify,
             s.blocks.blocks) for s in states]


@pytest.mark.parametrize("n", [3, 20])  # the bounded loop (<= SMALL_BATCH) and the array path
@pytest.mark.parametrize("kv_exact,refeed", [(True, False), (False, False), (False, True)])
def test_after_verify_batch_equals_after_verify_state_by_state(kv_exact, refeed, n):
    rng = random.Random(int(kv_exact) * 2 + int(refeed))
    opts = dict(num_blocks=300, kv_exact=kv_exact, refeed=refeed, draft_confidence_stop=0.2)
    pa, pb = make("eager", **opts), make("eager", **opts)  # stops: rows of fewer drafts
    sa = [prefilled(pa, 10 + i, length=6 + i)[0] for i in range(n)]
    sb = [prefilled(pb, 10 + i, length=6 + i)[0] for i in range(n)]
    for step in range(4):
        k = rng.randint(0, K)  # zero drafts too: d = max(drafted, 1)
        pos = [pa.last_pair_key(s) + 2 for s in sa]
        assert pa.propose_batch([3] * n, hidden(step, n), pos, k, sa) == \
            pb.propose_batch([3] * n, hidden(step, n), pos, k, sb)
        accepted = [rng.randint(0, s.last_num_drafted) for s in sa]
        pa.after_verify_batch(accepted, sa)
        for a, s in zip(accepted, sb):
            pb.after_verify(a, s)
        assert snapshot(pa, sa) == snapshot(pb, sb)
        pa.after_verify_batch(accepted, sa)  # a second one trims nothing, as after_verify's
        assert snapshot(pa, sa) == snapshot(pb, sb)


def test_the_trim_rule_in_arrays_is_rows_to_trim():
    """trim_after_verify_batch's array formula against the reference's scalar rule, every
    (drafted, accepted) pair, both KV modes."""
    from draft_circuit.runners.proposer_slots import SlotTable
    from draft_circuit.runners.proposer_state import trim_after_verify_batch
    pairs = [(d, a) for d in range(6) for a in range(d + 1)]
    for kv_exact, refeed in [(True, False), (False, False), (False, True)]:
        t = SlotTable(max_blocks=2, max_drafts=5, scratch_block=0, slots=len(pairs))
        slots = np.arange(len(pairs))
        t.drafted[slots] = [d for d, _ in pairs]
        t.rows[slots], t.pair_key[slots], t.awaiting[slots] = 100, 50, True
        trims = trim_after_verify_batch(t, slots, [a for _, a in pairs], [None] * len(pairs),
                                        kv_exact=kv_exact, refeed=refeed)
        want = [rows_to_trim(d, a, kv_exact=kv_exact, refeed=refeed) for d, a in pairs]
        assert trims.tolist() == want
        assert t.rows[slots].tolist() == [100 - w for w in want]
        assert t.pair_key[slots].tolist() == [50 - w if w else 50 for w in want]
        assert not t.awaiting[slots].any()


def proposed(p, n=3):
    states = [prefilled(p, 30 + i, length=7)[0] for i in range(n)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    p.propose_batch([4] * n, hidden(31, n), pos, K, states)
    return states


def test_after_verify_batch_refuses_all_or_nothing_with_after_verifys_errors():
    p = make("eager", num_blocks=80)
    states = proposed(p)
    before = snapshot(p, states)
    with pytest.raises(ProposerError, match=rf"num_accepted {K + 1} must be in 0..{K}"):
        p.after_verify_batch([1, K + 1, 0], states)
    with pytest.raises(ProposerError, match=r"num_accepted True must be in"):
        p.after_verify_batch([1, True, 0], states)
    with pytest.raises(ProposerError, match=r"num_accepted -1 must be in"):
        p.after_verify_batch([-1, 0, 0], states)
    with pytest.raises(ProposerError, match="2 accepted counts for 3 states"):
        p.after_verify_batch([1, 1], states)
    with pytest.raises(ProposerError, match="appears twice"):
        p.after_verify_batch([1, 1, 1], [states[0], states[1], states[0]])
    other = make("eager").alloc_state()
    with pytest.raises(ProposerError, match="does not belong to this proposer"):
        p.after_verify_batch([1, 1, 1], [states[0], other, states[2]])
    with pytest.raises(ProposerError, match="does not belong to this proposer"):
        p.after_verify_batch([1], [object()])
    assert snapshot(p, states) == before  # nothing trimmed by any refused call
    p.after_verify_batch([1, 2, 0], states)
    assert [p.drafter_rows(s) for s in states] == [6 + 1] * 3  # exact KV: d - 1 trimmed


def test_batch_calls_settle_a_device_batch_first():
    p, q = make("eager", num_blocks=80), make("eager", num_blocks=80)
    mine = [prefilled(p, 40 + i, length=7)[0] for i in range(3)]
    theirs = [prefilled(q, 40 + i, length=7)[0] for i in range(3)]
    pos = [p.last_pair_key(s) + 2 for s in mine]
    assert p.propose_batch_on_device([4] * 3, hidden(41, 3), pos, K, mine) is not None
    drafts = q.propose_batch([4] * 3, hidden(41, 3), pos, K, theirs)
    assert all(s.pending is not None for s in mine)
    p.after_verify_batch([1, 0, 2], mine)  # settles (records the drafts), then trims
    for a, s in zip([1, 0, 2], theirs):
        q.after_verify(a, s)
    assert all(s.pending is None for s in mine)
    assert snapshot(p, mine) == snapshot(q, theirs)
    assert [s.last_drafts for s in mine] == drafts
    assert p.last_pair_keys(mine) == [q.last_pair_key(s) for s in theirs]


def test_last_pair_keys_is_last_pair_key_of_each():
    p = make("eager", num_blocks=80)
    states = [prefilled(p, 50, length=6)[0], p.alloc_state(), prefilled(p, 51, length=2)[0]]
    assert p.last_pair_keys(states) == [p.last_pair_key(s) for s in states] == [4, None, 0]
    assert p.last_pair_keys([states[0], object()]) == [4, None]  # a foreign one: None
    assert p.last_pair_keys([]) == []


OWN = {str(Path(runners_pkg.__file__).parent / f) for f in (
    "proposer.py", "proposer_inputs.py", "proposer_rows.py", "proposer_state.py",
    "proposer_slots.py", "proposer_device.py", "staging.py")}


def lines_of_a_step(n):
    """Python lines executed in the proposer's own modules by one steady-state decode step of n
    sequences (propose_batch, after_verify_batch of 1..2 accepted, catchup_batch of a row each)."""
    p = make("eager", num_blocks=600, max_blocks_per_seq=12, max_width=64,
             widths=(1, 2, 4, 8, 16, 32, 64))
    states = [prefilled(p, 60 + i, length=9)[0] for i in range(n)]
    hid, catch = hidden(61, n), [hidden(62 + i, 2) for i in range(n)]
    count = [0]

    def step(record):
        pos = p.last_pair_keys(states)
        pos = [k + 2 for k in pos]
        p.propose_batch([5] * n, hid, pos, K, states)
        p.after_verify_batch([1 + i % 2 for i in range(n)], states)
        p.catchup_batch([[7]] * n, [c[:1] for c in catch], [q + 1 for q in pos], states)

    def trace(frame, event, arg):
        if frame.f_code.co_filename not in OWN:
            return None
        if event == "line":
            count[0] += 1
        return trace
    step(False)  # warm: every table has room for the next step
    sys.settrace(trace)
    try:
        step(True)
    finally:
        sys.settrace(None)
    return count[0]


def test_a_decode_steps_python_does_not_grow_with_n():
    """The per-sequence host work is array operations: one step at n = 20, 32 and 48 runs the
    same lines of the proposer's modules (a loop or a generator over the states would add
    lines per sequence). Each catch-up fits one 64-row run here: a run more costs its lines;
    up to SMALL_BATCH states a bounded loop is cheaper and runs instead."""
    counts = {n: lines_of_a_step(n) for n in (20, 32, 48)}
    assert len(set(counts.values())) == 1, counts


def test_the_line_count_sees_a_per_sequence_loop(monkeypatch):
    """The witness works: an after_verify_batch that checked each state in a Python loop is
    counted once a sequence."""
    from draft_circuit.runners import proposer as proposer_mod
    real = proposer_mod.MtpProposer.after_verify_batch

    def looping(self, num_accepted, states):
        for s in states:
            self._mine(s)
        return real(self, num_accepted, states)
    monkeypatch.setattr(proposer_mod.MtpProposer, "after_verify_batch", looping)
    assert lines_of_a_step(32) - lines_of_a_step(20) >= 12


def test_the_pending_count_follows_every_writer():
    """SlotTable.num_pending (0 lets a batch call skip its settle check) counts the slots that
    hold deferred drafts through a device batch, a free before it settles, its settle, a
    deferred propose and a dropped state."""
    import gc
    import torch
    p = make("eager", num_blocks=80)
    states = [prefilled(p, 70 + i, length=7)[0] for i in range(3)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    assert p.slots.num_pending == 0
    p.propose_batch_on_device([4] * 3, hidden(71, 3), pos, K, states)
    assert p.slots.num_pending == 3
    p.slots.pending[states[2].slot].settle()  # settled through any of them: all recorded
    assert p.slots.num_pending == 0
    p.propose_batch_on_device([4] * 3, hidden(72, 3), [q + K for q in pos], K, states)
    states[0].pending = None  # as free_all does: that state has nothing to record
    assert p.slots.num_pending == 2
    assert len(p.last_drafts(states[1:])[0]) == K and p.slots.num_pending == 0
    s = p.alloc_state()
    p.prefill_drafter([1, 2, 3, 4], hidden(73, 4), s)
    p.propose(5, hidden(74), 4, K, s, embed_target=torch.zeros(1, 32))
    assert p.slots.num_pending == 1
    del s
    gc.collect()
    assert p.slots.num_pending == 0
