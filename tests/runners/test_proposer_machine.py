"""A hypothesis state machine over the proposer: random prefill / propose / propose_batch /
after_verify / catch-up / take / install / free across several states. No block is leaked or
owned twice, rows and pair keys follow the rules, and the pool drains back to full."""
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from draft_circuit.runners.kv_cache import KVCacheError
from test_proposer import CFG, K, hidden, make


class ProposerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.p = make("eager", num_blocks=24)
        self.initial_free = self.p.pool.num_free
        self.states = [self.p.alloc_state() for _ in range(3)]
        self.positions = [0, 0, 0]
        self.held: list[list[int]] = []  # taken blocks, owned by the test until freed/installed

    @rule(i=st.integers(0, 2), length=st.integers(2, 12))
    def prefill(self, i, length):
        s = self.states[i]
        if self.p.drafter_rows(s):
            return
        prompt = [(3 * j + i) % CFG.vocab_size for j in range(length)]
        try:
            self.p.prefill_drafter(prompt, hidden(length, length), s)
            self.positions[i] = length
        except KVCacheError:
            pass

    @rule(i=st.integers(0, 2), k=st.integers(1, K))
    def propose(self, i, k):
        s, rows = self.states[i], self.p.drafter_rows(self.states[i])
        try:
            drafts = self.p.propose(5, hidden(i), self.positions[i], k, s)
        except KVCacheError:
            assert self.p.drafter_rows(s) == rows
            return
        assert self.p.drafter_rows(s) == rows + len(drafts)
        assert self.p.last_pair_key(s) == self.positions[i] + len(drafts) - 1

    @rule(idx=st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
    def propose_batch(self, idx):
        states = [self.states[i] for i in idx]
        before = [self.p.drafter_rows(s) for s in states]
        try:
            out = self.p.propose_batch([1] * len(idx), hidden(7, len(idx)),
                                       [self.positions[i] for i in idx], K, states)
        except KVCacheError:
            assert [self.p.drafter_rows(s) for s in states] == before
            return
        assert out is not None
        for s, b, d in zip(states, before, out):
            assert self.p.drafter_rows(s) == b + len(d)

    @rule(i=st.integers(0, 2), data=st.data())
    def verify(self, i, data):
        s = self.states[i]
        drafted = s.last_num_drafted
        accepted = data.draw(st.integers(0, drafted))
        rows = self.p.drafter_rows(s)
        self.p.after_verify(accepted, s)
        trimmed = rows - self.p.drafter_rows(s)
        assert 0 <= trimmed <= max(drafted, 1)
        if accepted:
            try:
                base = self.p.drafter_rows(s)
                self.p.catchup_drafter([2] * accepted, hidden(3, accepted), base,
                                       self.positions[i] + 1, s)
            except KVCacheError:
                pass
        self.positions[i] += accepted + 1

    @rule(i=st.integers(0, 2))
    def take(self, i):
        got = self.p.take_drafter_kv(self.states[i])
        if got is not None:
            self.held.append(got[0])
            assert self.p.drafter_rows(self.states[i]) == 0

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2))
    def install(self, i):
        s = self.states[i]
        blocks = self.held[-1]
        if self.p.install_drafter_kv(s, blocks, len(blocks) * 8 - 1, None):
            self.held.pop()

    @precondition(lambda self: self.held)
    @rule()
    def free_held(self):
        self.p.free_drafter_kv(self.held.pop())

    @rule(i=st.integers(0, 2))
    def free(self, i):
        self.p.free_state(self.states[i])
        assert self.p.drafter_rows(self.states[i]) == 0

    @invariant()
    def blocks_are_accounted_for(self):
        owned = [b for s in self.states for b in s.blocks.blocks] + [b for h in self.held for b in h]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert self.p.pool.num_free + len(owned) == self.initial_free
        for s in self.states:
            assert s.rows <= s.blocks.capacity_rows

    def teardown(self):
        for s in self.states:
            self.p.free_state(s)
        for h in self.held:
            self.p.free_drafter_kv(h)
        assert self.p.pool.num_free == self.initial_free


ProposerMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                                             suppress_health_check=list(HealthCheck))
TestProposerMachine = ProposerMachine.TestCase
