"""A decode step's calls share one ownership and distinct-state check (issue 14): the proposer
remembers the batches `SlotTable.slots_of` found all its own and distinct, by their states'
ids, and a later call with the same states skips the passes. These tests warm that memory and
then hand in what the full checks catch (a foreign state, a state twice, a dead state's id
reused): each is still refused with the same typed error, before anything changes."""
import gc

import pytest
import torch

from draft_circuit.runners.proposer_state import ProposerError
from tests.runners.test_proposer import K, hidden, make, prefilled


def _step(p, states, accepted=1):
    """propose_batch, after_verify_batch, catchup_batch over `states`: the batch is then known."""
    keys = p.last_pair_keys(states)
    drafts = p.propose_batch([5] * len(states), hidden(3, len(states)), [k + 2 for k in keys], K,
                             states)
    assert drafts is not None
    p.after_verify_batch([accepted] * len(states), states)
    p.catchup_batch([[7] * accepted] * len(states),
                    [hidden(4 + i, accepted) for i in range(len(states))],
                    [k + 3 for k in keys], states)


def _snapshot(p, states):
    return [(s.rows, s.last_pair_key, s.blocks.blocks, s.last_num_drafted) for s in states]


@pytest.fixture
def warm():
    p, other = make("circuit"), make("circuit")
    states = [prefilled(p, 10 + i)[0] for i in range(3)]
    _step(p, states)
    _step(p, states)
    assert any(ids == tuple(map(id, states)) for ids in p.slots._known)  # the batch is known
    return p, other, states


def test_a_foreign_state_in_a_known_batch_is_still_refused(warm):
    p, other, states = warm
    foreign = prefilled(other, 20)[0]
    mixed = [states[0], foreign, states[2]]
    before = _snapshot(p, states)
    with pytest.raises(ProposerError, match="does not belong to this proposer"):
        p.after_verify_batch([0, 0, 0], mixed)
    assert p.propose_batch([5] * 3, hidden(3, 3), [30] * 3, K, mixed) is None
    assert p.last_served.reason == "a state of another proposer"
    assert p.catchup_batch([[7]] * 3, [hidden(1, 1)] * 3, [30] * 3, mixed) == 0
    assert _snapshot(p, states) == before
    _step(p, states)  # the known batch itself still runs


def test_a_state_twice_after_a_known_batch_is_still_refused(warm):
    p, _, states = warm
    twice = [states[0], states[1], states[0]]
    before = _snapshot(p, states)
    with pytest.raises(ProposerError, match="appears twice"):
        p.after_verify_batch([0, 0, 0], twice)
    with pytest.raises(ProposerError, match="distinct states"):
        p.propose_batch([5] * 3, hidden(3, 3), [30] * 3, K, twice)
    with pytest.raises(ProposerError, match="appears twice"):
        p.catchup_batch([[7]] * 3, [hidden(1, 1)] * 3, [30] * 3, twice)
    assert _snapshot(p, states) == before


def test_a_dead_state_forgets_every_known_batch():
    """A state that dies gives its slot back: from then on its id may be a new object's (another
    proposer's state, say), so no batch is known any more and the next batch is checked in
    full."""
    p, other = make("circuit"), make("circuit")
    keep = prefilled(p, 10)[0]
    dying = prefilled(p, 11)[0]
    _step(p, [keep, dying])
    assert p.slots._known
    del dying
    gc.collect()
    assert not p.slots._known
    foreign = other.alloc_state()  # whatever its id: checked in full, refused
    with pytest.raises(ProposerError, match="does not belong to this proposer"):
        p.after_verify_batch([0, 0], [keep, foreign])
    _step(p, [keep])


def test_a_known_batchs_slots_are_read_only(warm):
    """The array a known batch hands out is shared by every call that sees the batch."""
    p, _, states = warm
    slots = p.slots.slots_of(states, type(states[0]))
    assert p.slots.distinct(slots) and not slots.flags.writeable
    with pytest.raises(ValueError):
        slots[0] = 0
    fresh = p.slots.slots_of(list(reversed(states)), type(states[0]))  # another order: checked
    assert fresh.tolist() == slots.tolist()[::-1]


def test_a_fault_left_in_a_cpu_record_is_raised_at_the_read():
    """On CPU the read looks at each runner's fault record through a numpy view kept from the
    first read (the guard clears its record in place): a fault recorded after that (here one
    written into the catch-up runner's record by hand, as a run whose check had not come yet
    would leave it) raises that runner's RunnerInputError at the next propose_batch's read,
    naming row, input and value; the record is cleared and the next step runs."""
    from draft_circuit.runners.input_values import RunnerInputError
    p = make("circuit")
    states = [prefilled(p, 10 + i)[0] for i in range(2)]
    _step(p, states)
    _step(p, states)  # every view made
    record = p.chains.kv_only()[0].fault_record()
    assert record is not None and record.device.type == "cpu"
    record[:7] = torch.tensor([1, 1, 999, 0, 2, 1, 1], dtype=torch.int32)  # token 999, row 1
    keys = p.last_pair_keys(states)
    with pytest.raises(RunnerInputError, match="row 1: token 999") as e:
        p.propose_batch([5, 5], hidden(3, 2), [k + 2 for k in keys], K, states)
    assert (e.value.row, e.value.input, e.value.value) == (1, "tokens", 999)
    assert not record.any()
    for s in states:
        p.after_verify(0, s)
    _step(p, states)
