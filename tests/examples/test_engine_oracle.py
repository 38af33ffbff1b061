"""The engine's verify / accept / trim / catch-up bookkeeping under high acceptance: a test
double of the proposer drafts the target's true continuation, corrupted at random, and checks
every catch-up row the engine asks for is the true token at its position. Random-weight MTP
heads accept almost nothing, so this is where the accepted-draft paths get exercised."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch

from examples.engine import Engine, EngineConfig, load_checkpoint
from draft_circuit.runners.contract import Served
from draft_circuit.runners.proposer_state import rows_to_trim
from tests.examples.helpers import SMALL, generate, random_requests

REQUESTS = random_requests(SMALL.vocab_size, 6, seed=5, min_prompt=2, max_new=(10, 30))


@dataclass
class OracleState:
    truth: list[int] | None = None   # prompt + target-greedy continuation
    rows: int = 0
    last_drafted: int = 0
    log: list = field(default_factory=list)


class OracleProposer:
    """Drafts truth[position+1 : position+1+k], each draft wrong with probability `p_wrong`;
    propose_batch serves even batch widths only (the engine must fall back on odd ones). Rows
    are at RoPE 1..rows (pair key rows - 1), trimmed by the reference's rule in the given mode,
    so the engine must find every catch-up row through `last_pair_key`."""

    def __init__(self, truths: list[list[int]], p_wrong: float, seed: int, *,
                 kv_exact: bool = True, refeed: bool = False) -> None:
        self.truths, self.p_wrong = truths, p_wrong
        self.kv_exact, self.refeed = kv_exact, refeed
        self.gen = torch.Generator().manual_seed(seed)
        self.stats = defaultdict(lambda: defaultdict(int))  # the summary reads it
        self.last_served: Served | None = None

    def alloc_state(self) -> OracleState:
        return OracleState()

    def _drafts(self, position: int, k: int, state: OracleState) -> list[int]:
        truth = state.truth
        assert truth is not None and position < len(truth)
        drafts = truth[position + 1:position + 1 + k]
        drafts += [0] * (k - len(drafts))  # past the end of the known truth: any token
        wrong = torch.rand(k, generator=self.gen) < self.p_wrong
        drafts = [(d + 1) % SMALL.vocab_size if w else d for d, w in zip(drafts, wrong.tolist())]
        assert state.rows == position - 1, "the drafter holds every row before the propose's"
        state.rows, state.last_drafted = state.rows + k, k  # draft i's row at position + i
        return drafts

    def _one(self, last_token, hidden, position, k, state) -> list[int]:
        assert state.truth[position] == last_token and hidden.shape == (SMALL.hidden_size,)
        return self._drafts(position, k, state)

    def propose(self, last_token, hidden, position, k, state):
        return self._one(last_token, hidden, position, k, state)

    def propose_batch(self, last_tokens, hiddens, positions, k, states, **_):
        if len(states) % 2:
            self.last_served = Served("refused", len(states), "odd width")
            return None
        self.last_served = Served("own", len(states))
        return [self._one(*args, k, s) for *args, s in zip(last_tokens, hiddens, positions, states)]

    def after_verify(self, a: int, state: OracleState) -> None:
        assert 0 <= a <= state.last_drafted
        state.rows -= rows_to_trim(state.last_drafted, a, kv_exact=self.kv_exact, refeed=self.refeed)
        state.last_drafted = 0

    # the engine's batch entry points (runners.proposer_batch): the per-state rules, in order
    def after_verify_batch(self, accepted, states) -> None:
        for a, state in zip(accepted, states):
            self.after_verify(a, state)

    def last_pair_keys(self, states) -> list[int | None]:
        return [self.last_pair_key(s) for s in states]

    def last_pair_key(self, state: OracleState) -> int | None:
        return state.rows - 1 if state.rows else None

    def catchup_batch(self, tokens, hiddens, first_pos, states) -> int:
        for ts, hs, p, s in zip(tokens, hiddens, first_pos, states):
            if s.truth is None:  # the prefill: pairs (prompt[i+1], h_i) at positions 1..
                s.truth = next(t for t in self.truths if t[1:len(ts) + 1] == ts)
            assert p == s.rows + 1, "catch-up rows continue the drafter's rows"
            assert ts == s.truth[p:p + len(ts)], "catch-up tokens are the tokens at their positions"
            assert hs.shape == (len(ts), SMALL.hidden_size)
            s.rows += len(ts)
        return sum(map(len, tokens))

    def free_state(self, state: OracleState) -> None:
        state.truth = None


@pytest.mark.parametrize("kv_exact,refeed", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("p_wrong,k,max_batch", [(0.0, 4, 4), (0.15, 3, 3), (0.5, 2, 4)])
def test_oracle_drafts_keep_output_exact(small_checkpoint, p_wrong, k, max_batch, kv_exact, refeed):
    greedy, _ = generate(small_checkpoint, REQUESTS, speculate=False, max_batch=2)
    truths = [r.prompt + g for r, g in zip(REQUESTS, greedy)]
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(num_drafts=k, max_batch=max_batch,
                                                                    forward="eager"))
    engine.proposer = OracleProposer(truths, p_wrong, seed=1, kv_exact=kv_exact, refeed=refeed)
    result = engine.generate(REQUESTS)
    assert result.outputs == greedy
    mean_accepted = result.stats.accepted / result.stats.verifies
    # the oracle's only misses past p_wrong: drafts beyond a request's end (no truth there)
    assert mean_accepted > k - 1 if p_wrong == 0 else 0 < mean_accepted < k
    assert {"per_sequence", "own"} <= set(result.stats.draft_batches.batches)
    assert engine.pool.num_used == 0
