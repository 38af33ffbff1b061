"""The draft runner: the width policy, and padded / split widths equal to the eager oracle with
padded rows inert (no KV write anywhere, stale rows from an earlier call harmless)."""
import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.circuit.binding import WidthError
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy, plan_widths
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch
from tests.runners.tiny_chain import tiny_chain, tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=80, block_size=8, max_blocks_per_seq=4)
K = 3


def test_plan_widths_picks_own_pad_or_split_by_cost():
    costs = {1: 10.0, 2: 11.0, 4: 12.0, 8: 30.0}
    plans = plan_widths(costs, 8, WidthPolicy(replay_overhead_us=5.0))
    assert plans[4].kind == "own"
    assert plans[3].kind == "pad" and plans[3].parts == ((4, 3),)
    assert plans[7].kind == "pad" and plans[7].parts == ((8, 7),)  # 35 < 4+2+1 = 48
    cheap_big = plan_widths({1: 1.0, 8: 100.0}, 8, WidthPolicy(replay_overhead_us=1.0))
    assert cheap_big[5].kind == "split" and cheap_big[5].parts == ((1, 1),) * 5
    assert set(plan_widths(costs, 8, WidthPolicy(False, False))) == {1, 2, 4, 8}
    assert 9 not in plans and 0 not in plans


@pytest.fixture(scope="module")
def compiled():
    return tiny_chain(CFG, KV, K, [1, 2, 4, 8], seed=5, embed_target=True)


def _states(batch, width):
    return {**batch.clone_states(), "embed_target": torch.full((8, CFG.hidden_size), 7.0)}


@pytest.mark.parametrize("policy", [WidthPolicy(allow_split=False), WidthPolicy(allow_padding=False)])
def test_every_width_matches_eager(compiled, policy):
    chain, params, cd = compiled
    for n in range(1, 9):
        batch = random_draft_batch(CFG, KV, n, seed=n, num_drafts=K)
        want_states, got_states = _states(batch, n), _states(batch, n)
        want = EagerRunner(chain, params, want_states).run(batch.inputs)
        runner = CircuitDraftRunner(cd, got_states, scratch_block=0, policy=policy)
        plan = runner.plan(n)
        got = runner.run(n, batch.inputs)
        for k in want:
            assert torch.equal(got[k], want[k]), (n, plan, k)
        for k in want_states:  # KV: the live rows' writes and nothing else, padded rows inert
            assert torch.equal(got_states[k], want_states[k]), (n, plan, k)


def test_stale_rows_from_a_wider_call_are_inert(compiled):
    chain, params, cd = compiled
    wide = random_draft_batch(CFG, KV, 8, seed=40, num_drafts=K)
    states = _states(wide, 8)
    runner = CircuitDraftRunner(cd, states, scratch_block=0, policy=WidthPolicy(allow_split=False))
    runner.run(8, wide.inputs)  # rows 5..7 of the static buffers now hold real sequences
    narrow = random_draft_batch(CFG, KV, 5, seed=41, num_drafts=K)
    for name in ("k_cache", "v_cache"):
        states[name].copy_(narrow.states()[name])
    before = {k: v.clone() for k, v in states.items()}
    want_states = {k: v.clone() for k, v in before.items()}
    want = EagerRunner(chain, params, want_states).run(narrow.inputs)
    assert runner.plan(5).kind == "pad"
    got = runner.run(5, narrow.inputs)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k in ("k_cache", "v_cache"):
        assert torch.equal(states[k], want_states[k]), k
    assert torch.equal(states["embed_target"][:5], want_states["embed_target"][:5])


def test_unserved_widths(compiled):
    _, _, cd = compiled
    batch = random_draft_batch(CFG, KV, 1, num_drafts=K)
    runner = CircuitDraftRunner(cd, _states(batch, 1), policy=WidthPolicy(False, False))
    assert runner.widths == (1, 2, 4, 8) and runner.max_width == 8
    assert not runner.serves(3) and not runner.serves(0) and not runner.serves(9)
    with pytest.raises(WidthError, match="width 3 is not served"):
        runner.run(3, random_draft_batch(CFG, KV, 3, num_drafts=K).inputs)
    with pytest.raises(WidthError, match="another width"):
        runner.run(2, random_draft_batch(CFG, KV, 4, num_drafts=K).inputs)
