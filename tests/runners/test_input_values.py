"""FAULTS 25 (CPU half of issue 19 item 1): ProgramRunner.run on CPU refuses, by value and before
anything runs, a -1 or out-of-pool block id at a live row, live_rows negative or past the table's
end, and a token outside the vocabulary: RunnerInputError naming row and value; the KV pool is
untouched. Inert rows (active 0) may hold anything their neutral fill holds."""
import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch
from tests.runners.tiny_chain import tiny_chain, tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
K = 3


@pytest.fixture(scope="module")
def compiled():
    return tiny_chain(CFG, KV, K, [1, 2, 4], seed=3)


def _bad(batch, edit):
    inputs = {k: v.clone() for k, v in batch.inputs.items()}
    edit(inputs)
    return inputs


def _set(name, row, value, col=None):
    def edit(inputs):
        if col is None:
            inputs[name][row] = value
        else:
            inputs[name][row, col] = value
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set("tokens", 1, -7), "row 1: token -7 is outside the vocabulary [0, 150)"),
    (_set("tokens", 2, 150), "row 2: token 150 is outside the vocabulary"),
    (_set("live_rows", 0, -1), "row 0: live_rows -1 must be in 0..29"),
    (_set("live_rows", 3, 30), "row 3: live_rows 30 must be in 0..29"),
    (_set("block_tables", 1, -1, 0), "row 1: block id -1 at table entry 0"),
    (_set("block_tables", 2, 40, 0), "row 2: block id 40 at table entry 0 .* outside the pool"),
])
def test_bad_values_are_refused_before_anything_runs(compiled, edit, message):
    _, _, cd = compiled
    batch = random_draft_batch(CFG, KV, 4, seed=7, num_drafts=K)
    states = batch.clone_states()
    before = {k: v.clone() for k, v in states.items()}
    runner = ProgramRunner(cd, states)
    with pytest.raises(RunnerInputError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        runner.run(_bad(batch, edit))
    for k in states:
        assert torch.equal(states[k], before[k]), k


def test_inert_rows_and_unused_table_tails_pass(compiled):
    chain, params, cd = compiled
    batch = random_draft_batch(CFG, KV, 4, seed=8, num_drafts=K)
    inputs = {k: v.clone() for k, v in batch.inputs.items()}
    inputs["active"][1] = 0
    inputs["live_rows"][1] = 0       # an inert row's table is never followed
    inputs["block_tables"][1] = 0    # (the neutral fill: the scratch block)
    inputs["tokens"][1] = 0
    # random_draft_batch leaves -1 in the tails live rows never reach: those pass
    assert (batch.inputs["block_tables"] == -1).any()
    want_states = batch.clone_states()
    want = EagerRunner(chain, params, want_states).run(inputs)
    states = batch.clone_states()
    got = ProgramRunner(cd, states).run(inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    for k in states:
        assert torch.equal(states[k], want_states[k]), k
