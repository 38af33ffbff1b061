"""A hypothesis state machine over the proposer: random prefill / propose / propose_batch /
after_verify / catch-up (both conventions, right and wrong row bases, count mismatches) / take /
install / free across several states, in every trim mode. Every state's rows and pair key equal
a model of the reference's rules (proposer_model.ModelState), no block is leaked or owned twice,
and the pool drains back to full."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from draft_circuit.runners.kv_cache import KVCacheError
from draft_circuit.runners.proposer_state import ProposerError
from proposer_model import ModelState
from test_proposer import CFG, K, hidden, make

STATES = 3


class ProposerMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from([(True, False), (False, False), (False, True)]))
    def build(self, mode):
        self.kv_exact, self.refeed = mode
        self.p = make("eager", num_blocks=24, kv_exact=self.kv_exact, refeed=self.refeed)
        self.initial_free = self.p.pool.num_free
        self.states = [self.p.alloc_state() for _ in range(STATES)]
        self.model = [ModelState() for _ in range(STATES)]
        self.held: list[tuple[list[int], int, int | None]] = []  # taken, the test's until freed

    def unchanged_after(self, i, call) -> None:
        """A call that may run out of blocks or table: either it succeeds, or nothing changed."""
        rows, key = self.p.drafter_rows(self.states[i]), self.p.last_pair_key(self.states[i])
        try:
            return call()
        except KVCacheError:
            assert (self.p.drafter_rows(self.states[i]), self.p.last_pair_key(self.states[i])) == (rows, key)
            return None

    @rule(i=st.integers(0, STATES - 1), length=st.integers(1, 12), one_fewer=st.booleans())
    def prefill(self, i, length, one_fewer):
        prompt = [(3 * j + i) % CFG.vocab_size for j in range(length)]
        hiddens = hidden(length, length)[:length - 1 if one_fewer else length]  # [rows, H]
        m = self.model[i]
        want = length - 1 if m.rows == 0 else 0  # row_base 0 must be the row count
        got = self.unchanged_after(i, lambda: self.p.prefill_drafter(prompt, hiddens, self.states[i]))
        if got is not None:
            assert got == want
            m.appended(1, want)

    @rule(i=st.integers(0, STATES - 1), k=st.integers(0, K))
    def propose(self, i, k):
        m = self.model[i]
        position = m.next_position()
        drafts = self.unchanged_after(i, lambda: self.p.propose(5, hidden(i), position, k, self.states[i]))
        if drafts is not None:
            assert len(drafts) == k
            m.proposed(position, k)

    @rule(idx=st.lists(st.integers(0, STATES - 1), min_size=1, max_size=STATES, unique=True))
    def propose_batch(self, idx):
        states = [self.states[i] for i in idx]
        positions = [self.model[i].next_position() for i in idx]
        try:
            out = self.p.propose_batch([1] * len(idx), hidden(7, len(idx)).view(len(idx), -1),
                                       positions, K, states)
        except KVCacheError:
            return  # unchanged_after's check, for every state, is the invariant below
        assert out is not None and self.p.last_served.kind == "eager"
        for i, p, d in zip(idx, positions, out):
            assert len(d) == K
            self.model[i].proposed(p, K)

    @rule(i=st.integers(0, STATES - 1), data=st.data())
    def verify(self, i, data):
        m = self.model[i]
        accepted = data.draw(st.integers(0, m.drafted))
        self.p.after_verify(accepted, self.states[i])
        m.verified(accepted, self.kv_exact, self.refeed)
        with pytest.raises(ProposerError):
            self.p.after_verify(m.drafted + 1, self.states[i])

    @rule(i=st.integers(0, STATES - 1), count=st.integers(0, 5), offset=st.sampled_from([0, 0, -1, 1]))
    def catchup_drafter(self, i, count, offset):
        m = self.model[i]
        base, pos = m.rows + offset, m.next_position()
        tokens = [(11 * j + 2) % CFG.vocab_size for j in range(count)]
        hiddens = hidden(3, 8)[:max(count - 1, 0)]  # one fewer than the tokens
        want = count - 1 if offset == 0 and count >= 2 else 0
        got = self.unchanged_after(i, lambda: self.p.catchup_drafter(tokens, hiddens, base, pos,
                                                                     self.states[i]))
        if got is not None:
            assert got == want
            m.appended(pos, want)

    @rule(lens=st.lists(st.integers(0, 4), min_size=STATES, max_size=STATES),
          broken=st.sampled_from([None, "hiddens", "states"]))
    def catchup_batch(self, lens, broken):
        tokens = [[(7 * j + i) % CFG.vocab_size for j in range(n)] for i, n in enumerate(lens)]
        hiddens = [hidden(20 + i, 4)[:n] for i, n in enumerate(lens)]
        first = [m.next_position() for m in self.model]
        states = list(self.states)
        if broken == "hiddens":
            hiddens[1] = hidden(9, 5)[:lens[1] + 1]  # one hidden too many for sequence 1
        elif broken == "states":
            states = states[:-1]                     # a sequence without a state
        if broken is not None:
            with pytest.raises(ProposerError):
                self.p.catchup_batch(tokens, hiddens, first, states)
            return  # and nothing changed: the invariant compares every state with its model
        try:
            assert self.p.catchup_batch(tokens, hiddens, first, states) == sum(lens)
        except KVCacheError:
            return
        for m, p, n in zip(self.model, first, lens):
            m.appended(p, n)

    @rule(i=st.integers(0, STATES - 1))
    def take(self, i):
        m = self.model[i]
        got = self.p.take_drafter_kv(self.states[i])
        if got is None:
            assert m.rows == 0 or not self.states[i].blocks.blocks
            return
        assert got[1:] == (m.rows, m.key)
        self.held.append(got)
        m.emptied()

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, STATES - 1))
    def install(self, i):
        blocks, rows, key = self.held[-1]
        m, s = self.model[i], self.states[i]
        fits = m.rows == 0 and not s.blocks.blocks
        assert self.p.install_drafter_kv(s, blocks, rows, key) == fits
        if fits:
            self.held.pop()
            m.rows, m.key = rows, key

    @precondition(lambda self: self.held)
    @rule()
    def free_held(self):
        self.p.free_drafter_kv(self.held.pop()[0])

    @rule(i=st.integers(0, STATES - 1))
    def free(self, i):
        self.p.free_state(self.states[i])
        self.model[i].emptied()

    @invariant()
    def rows_and_keys_follow_the_rules(self):
        for s, m in zip(self.states, self.model):
            assert (self.p.drafter_rows(s), self.p.last_pair_key(s)) == (m.rows, m.key)
            assert s.last_num_drafted == m.drafted or m.rows == 0

    @invariant()
    def blocks_are_accounted_for(self):
        owned = [b for s in self.states for b in s.blocks.blocks] + [b for h in self.held for b in h[0]]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert self.p.pool.num_free + len(owned) == self.initial_free
        for s in self.states:
            assert s.rows <= s.blocks.capacity_rows

    def teardown(self):
        if not hasattr(self, "p"):
            return
        for s in self.states:
            self.p.free_state(s)
        for h in self.held:
            self.p.free_drafter_kv(h[0])
        assert self.p.pool.num_free == self.initial_free


ProposerMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                             suppress_health_check=list(HealthCheck))
TestProposerMachine = ProposerMachine.TestCase
