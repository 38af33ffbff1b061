"""The steady-state host path (issue 14 step 2): propose_batch and catchup_batch build no tensor
of their own once warm (CPU: a trace of torch's tensor constructors on the proposer's frames;
GPU: no device allocation), block tables are rewritten on the device only when a sequence's
blocks change, and the staged runs draft and write exactly what the oracle does."""
import random
import sys
from pathlib import Path

import pytest
import torch

import draft_circuit.runners as runners_pkg
from draft_circuit.runners.staging import ChainStaging
from draft_circuit.runners.testing import assert_no_allocation
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled

CONSTRUCTORS = ("tensor", "as_tensor", "ones", "zeros", "full", "empty", "arange", "stack",
                "cat", "ones_like", "zeros_like", "full_like", "empty_like", "empty_strided")
RUNNERS = Path(runners_pkg.__file__).parent
OWN = {RUNNERS / f for f in ("proposer.py", "proposer_inputs.py", "proposer_rows.py",
                             "proposer_state.py", "proposer_device.py", "staging.py", "chains.py",
                             "draft.py")}


class ConstructorTrace:
    """Patch torch's tensor constructors; record each call made from one of `frames`' files."""

    def __init__(self, monkeypatch, frames=OWN):
        self.calls: list[str] = []
        files = {str(f) for f in frames}
        for name in CONSTRUCTORS:
            real = getattr(torch, name)

            def traced(*args, _real=real, _name=name, **kwargs):
                caller = sys._getframe(1)
                # a call given out= writes into a tensor that exists: it builds none
                if caller.f_code.co_filename in files and kwargs.get("out") is None:
                    self.calls.append(f"torch.{_name} at {Path(caller.f_code.co_filename).name}:"
                                      f"{caller.f_lineno} in {caller.f_code.co_name}")
                return _real(*args, **kwargs)
            monkeypatch.setattr(torch, name, traced)


class DecodeLoop:
    """n sequences drafting k, verified with random acceptance, caught up on the accepted."""

    def __init__(self, p, n, device="cpu", seed=0):
        self.p, self.rng = p, random.Random(seed)
        self.states = [prefilled(p, 20 + i, length=9 + i)[0] for i in range(n)]
        self.hid = hidden(3, n).to(device)
        self.catch = [hidden(40 + i, K).to(device) for i in range(n)]
        self.drafts: list[list[list[int]]] = []

    def step(self):
        p, states = self.p, self.states
        pos = [p.last_pair_key(s) + 2 for s in states]
        drafts = p.propose_batch([5] * len(states), self.hid, pos, K, states)
        self.drafts.append(drafts)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        for s, a in zip(states, accepted):
            p.after_verify(a, s)
        p.catchup_batch([d[:a] for d, a in zip(drafts, accepted)],
                        [h[:a] for h, a in zip(self.catch, accepted)],
                        [q + 1 for q in pos], states)


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_steady_state_builds_no_tensor_in_the_proposers_frames(forward, monkeypatch):
    p = make(forward, num_blocks=80, max_blocks_per_seq=12)
    loop = DecodeLoop(p, n=3)
    for _ in range(2):  # warm: slots assigned, tables staged
        loop.step()
    trace = ConstructorTrace(monkeypatch)
    for _ in range(4):
        loop.step()
    assert trace.calls == []


def test_the_trace_sees_a_constructor_in_an_own_frame(monkeypatch):
    """The witness works: building a staging (which allocates its buffers) is recorded."""
    trace = ConstructorTrace(monkeypatch)
    ChainStaging(max_width=4, max_blocks=3, hidden_size=8, dtype=torch.float32, max_drafts=2,
                 scratch_block=0, device="cpu")
    assert any("staging.py" in c for c in trace.calls)


def test_staged_decode_loop_equals_the_oracle_bitwise():
    mine, oracle = make("circuit", num_blocks=80, max_blocks_per_seq=12), \
        make("eager", num_blocks=80, max_blocks_per_seq=12)
    a, b = DecodeLoop(mine, n=4, seed=5), DecodeLoop(oracle, n=4, seed=5)
    for _ in range(6):
        a.step(), b.step()
    assert a.drafts == b.drafts
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], oracle.states[name])


def test_device_tables_are_rewritten_only_when_blocks_change():
    p = make("eager", num_blocks=80, max_blocks_per_seq=12)
    s, _ = prefilled(p, 1, length=5)  # 4 rows: one block of 8
    staging = p.staging
    before = staging._slot_tables.clone()
    slot = s.slot[1]
    assert staging._slot_tables[slot, 0].item() == s.blocks.blocks[0]
    p.catchup_batch([[1, 2]], [hidden(2, 2)], [5], [s])  # rows 4, 5: same block
    assert torch.equal(staging._slot_tables, before)
    p.catchup_batch([[1, 2, 3]], [hidden(3, 3)], [7], [s])  # rows 6..8: a second block
    assert staging._slot_tables[slot, :2].tolist() == list(s.blocks.blocks)
    handed = p.take_drafter_kv(s)  # hand the blocks to another state: its row follows them
    t = p.alloc_state()
    assert p.install_drafter_kv(t, *handed)
    p.propose(4, hidden(4), p.last_pair_key(t) + 2, K, t)
    assert staging._slot_tables[t.slot[1], :len(t.blocks.blocks)].tolist() == list(t.blocks.blocks)


def test_a_state_dropped_gives_its_slot_back():
    import gc
    p = make("eager")
    s, _ = prefilled(p, 1)
    slot = s.slot[1]
    free = len(p.staging._free)
    del s
    gc.collect()
    assert len(p.staging._free) == free + 1 and slot in p.staging._free


def test_more_states_than_slots_grow_the_table():
    p = make("eager", num_blocks=200)
    p.staging.__init__(max_width=8, max_blocks=6, hidden_size=CFG.hidden_size,
                       dtype=torch.float32, max_drafts=K, scratch_block=0, device="cpu", slots=2)
    states = [prefilled(p, i, length=4)[0] for i in range(5)]
    oracle = make("eager", num_blocks=200)
    theirs = [prefilled(oracle, i, length=4)[0] for i in range(5)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    assert p.propose_batch([1] * 5, hidden(9, 5), pos, K, states) == \
        oracle.propose_batch([1] * 5, hidden(9, 5), pos, K, theirs)
    assert p.staging._slot_tables.shape[0] >= 5


@pytest.mark.cuda
def test_steady_state_allocates_no_device_memory_on_cuda():
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    loop = DecodeLoop(p, n=4, device="cuda")
    for _ in range(2):
        loop.step()
    assert_no_allocation(loop.step, repeats=4)


def cat_calls(monkeypatch):
    """Record every torch.cat the staging makes into its buffer (out=)."""
    calls, real = [], torch.cat

    def cat(tensors, *args, **kwargs):
        if kwargs.get("out") is not None:
            calls.append(len(tensors))
        return real(tensors, *args, **kwargs)
    monkeypatch.setattr(torch, "cat", cat)
    return calls


def test_a_catch_up_of_several_sequences_stages_its_hiddens_in_one_cat(monkeypatch):
    p = make("eager", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 60 + i, length=5)[0] for i in range(3)]
    calls = cat_calls(monkeypatch)
    p.catchup_batch([[1, 2], [3], [4, 5, 6]], [hidden(1, 2), hidden(2, 1), hidden(3, 3)],
                    [5, 5, 5], states)
    assert calls == [3]  # three segments, one launch
