"""FAULTS 28: a width served by a split leaves an inactive row's row-dim state (embed_target) as
the eager oracle and a padded plan do, and hands each part its own rows' state (a part runs at
rows 0..w-1; before the fix an inactive row at a later part got the value of the row at its
index in the first part)."""
import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch
from tests.runners.tiny_chain import tiny_chain, tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=80, block_size=8, max_blocks_per_seq=4)
K = 3


@pytest.fixture(scope="module")
def compiled():
    return tiny_chain(CFG, KV, K, [1, 2, 4, 8], seed=5, embed_target=True)


def _states(batch):
    # every row's embed_target distinct, so a row given another row's value shows
    target = torch.arange(8, dtype=torch.float32)[:, None] * 100 + torch.randn(8, CFG.hidden_size)
    return {**batch.clone_states(), "embed_target": target}


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_split_leaves_inactive_rows_state_as_eager_and_pad_do(compiled, n):
    chain, params, cd = compiled
    batch = random_draft_batch(CFG, KV, n, seed=10 + n, num_drafts=K)
    inputs = dict(batch.inputs)
    active = torch.ones(n, dtype=torch.int32)
    active[1::2] = 0
    active[-1] = 0  # inactive rows in every part of the split, the last part's included
    inputs["active"] = active
    start = _states(batch)
    want_states = {k: v.clone() for k, v in start.items()}
    want = EagerRunner(chain, params, want_states).run(inputs)
    results = {}
    for kind, policy in (("split", WidthPolicy(allow_padding=False)),
                         ("pad", WidthPolicy(allow_split=False))):
        states = {k: v.clone() for k, v in start.items()}
        runner = CircuitDraftRunner(cd, states, scratch_block=0, policy=policy)
        assert runner.plan(n).kind == kind
        out = {k: v.clone() for k, v in runner.run(n, inputs).items()}
        results[kind] = (out, states)
    for kind, (out, states) in results.items():
        for k in want:
            assert torch.equal(out[k], want[k]), (kind, k)
        for k in ("k_cache", "v_cache"):
            assert torch.equal(states[k], want_states[k]), (kind, k)
        got, ref = states["embed_target"][:n], want_states["embed_target"][:n]
        assert torch.equal(got, ref), (kind, (got != ref).any(-1).nonzero().flatten().tolist())
        inactive = (active == 0).nonzero().flatten()
        assert torch.equal(got[inactive], start["embed_target"][inactive]), kind  # left alone
    split, pad = results["split"][1]["embed_target"], results["pad"][1]["embed_target"]
    assert torch.equal(split[:n], pad[:n])
    assert torch.equal(split[n:], start["embed_target"][n:])  # rows past n untouched by a split
