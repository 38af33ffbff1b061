"""The engine's output is target-only greedy decoding's, token for token, whatever the forward,
k, tau, widths and batch composition (continuous batching changes the width step to step)."""
from __future__ import annotations

import pytest

from examples.engine.speculate import accept
from tests.examples.helpers import SMALL, generate, random_requests

REQUESTS = random_requests(SMALL.vocab_size, 7, seed=11)


@pytest.fixture(scope="module")
def greedy(small_checkpoint):
    outputs, _ = generate(small_checkpoint, REQUESTS, speculate=False, max_batch=3)
    return outputs


def test_plain_greedy_is_batch_independent(small_checkpoint, greedy):
    alone, _ = generate(small_checkpoint, REQUESTS, speculate=False, max_batch=1)
    assert alone == greedy
    assert [len(o) for o in greedy] == [r.max_new_tokens for r in REQUESTS]


@pytest.mark.parametrize("forward,k,tau,widths,max_batch,kinds", [
    ("circuit", 4, None, (1, 2, 4), 3, {"own", "pad"}),        # 3 pads to 4
    ("circuit", 3, 0.2, (1, 2), 4, {"own", "per_sequence"}),   # 3 and 4: no program
    ("eager", 4, 0.5, (1, 2, 4, 8), 4, {"eager"}),
    ("eager", 1, None, (1,), 2, {"eager"}),
])
def test_speculative_equals_greedy(small_checkpoint, greedy, forward, k, tau, widths, max_batch,
                                   kinds):
    outputs, engine = generate(small_checkpoint, REQUESTS, forward=forward, num_drafts=k,
                               draft_confidence_stop=tau, widths=widths, max_batch=max_batch)
    assert outputs == greedy
    stats = engine.stats
    assert len(stats.widths) > 1, "the batch width should change from step to step"
    seen = {kind for per in stats.draft_batches.table().values() for kind in per}
    assert kinds <= seen, seen
    assert stats.verifies and stats.drafted >= stats.verifies
    # --forward circuit drafts on the runners the engine compiled and installed
    want = "eager" if forward == "eager" else "own"
    proposer = engine.proposer
    assert proposer.chain_runner(k).plan(1).kind == proposer.chain_runner(1).plan(1).kind == want
    # (0, False): the KV-only catch-up chain (KV_ONLY_KEY)
    assert set(proposer.chains.installed) == (set() if forward == "eager"
                                              else {(k, False), (1, False), (0, False)})
    # every block is back in both pools once everything finished
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0


@pytest.mark.parametrize("forward", ["eager", "circuit"])
@pytest.mark.parametrize("kv_exact,refeed", [(False, False), (False, True)])
def test_every_trim_mode_stays_exact(small_checkpoint, greedy, forward, kv_exact, refeed):
    # without exact KV the drafter keeps (or refeeds) rows and the engine finds the rows it
    # lacks through last_pair_key; the output is still target-only greedy's
    outputs, engine = generate(small_checkpoint, REQUESTS, forward=forward, num_drafts=3,
                               widths=(1, 2, 4), max_batch=3, kv_exact=kv_exact, refeed=refeed)
    assert outputs == greedy
    assert engine.proposer.pool.num_used == 0


def test_compiled_target_equals_eager_target(small_checkpoint, greedy):
    outputs, _ = generate(small_checkpoint, REQUESTS, target_forward="circuit", max_rows=16,
                          widths=(1, 2, 4), max_batch=3)  # prefills longer than 16 run in chunks
    assert outputs == greedy


@pytest.mark.parametrize("drafts,target,want", [
    ([], [5], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 9, 3, 4], 1),
    ([7], [1, 2], 0),
])
def test_accept_rule(drafts, target, want):
    assert accept(drafts, target) == want
