"""A sequence admitted while others run is prefilled in that step's target pass, its prompt rows
after the running batch's verify (or plain decode) rows (issue 20: one target pass fewer per
admission; row-wise ops give every row the bits it has alone). Checked: the outputs are
target-only greedy's, speculating with either drafter and without, merged or not; the merge
happens (fewer passes, a pass holding a prompt beside verify rows); the device-resident draft
path, whose verify input is the proposer's tensor, keeps its prefills apart."""
from __future__ import annotations

import pytest

from examples.engine import Engine, EngineConfig, load_checkpoint
from tests.examples.helpers import SMALL, random_requests

# more requests than batch slots and varied lengths: sequences finish at different steps, so
# most admissions happen beside a running batch
REQUESTS = random_requests(SMALL.vocab_size, 8, seed=5)


def run(path, *, merge: bool, device_drafts: bool | None = None, **config):
    """(outputs, engine, each target pass's sequences as prefill (True: no KV rows yet, its
    prompt) or not (its decode or verify rows))."""
    engine = Engine(load_checkpoint(path, with_mtp=config.get("speculate", True)),
                    EngineConfig(max_batch=3, widths=(1, 2, 4), **config))
    engine.merge_prefill = merge
    engine.device_drafts = device_drafts
    passes: list[list[bool]] = []
    target_run = engine.target.run_pass  # every host-built pass: `run` and the verify's own

    def recorded(seqs, new_tokens):
        passes.append([s.num_cached == 0 for s in seqs])
        return target_run(seqs, new_tokens)
    engine.target.run_pass = recorded
    return engine.generate(REQUESTS).outputs, engine, passes


def mixed(passes: list[list[bool]]) -> int:
    """Passes that hold a prompt beside at least one other sequence's decode or verify rows."""
    return sum(1 for p in passes if any(p) and not all(p))


@pytest.fixture(scope="module")
def greedy(small_checkpoint):
    return run(small_checkpoint, merge=False, speculate=False)[0]


def test_plain_decode_merged_equals_separate(small_checkpoint, greedy):
    outputs, engine, passes = run(small_checkpoint, merge=True, speculate=False)
    assert outputs == greedy
    assert mixed(passes) >= 1
    _, _, separate = run(small_checkpoint, merge=False, speculate=False)
    assert mixed(separate) == 0 and len(passes) < len(separate)
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("forward,k", [("circuit", 3), ("eager", 4), ("circuit", 1)])
def test_speculative_with_merged_prefill_equals_greedy(small_checkpoint, greedy, forward, k):
    outputs, engine, passes = run(small_checkpoint, merge=True, forward=forward, num_drafts=k)
    assert outputs == greedy
    assert mixed(passes) >= 1
    _, unmerged, separate = run(small_checkpoint, merge=False, forward=forward, num_drafts=k)
    assert mixed(separate) == 0 and len(passes) < len(separate)
    # the same drafts either way: the merged prompts' drafter rows (one catch-up call with the
    # step's) are the rows a separate prefill writes
    assert engine.stats.accepted == unmerged.stats.accepted
    assert engine.stats.verifies == unmerged.stats.verifies
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0


def test_device_draft_path_keeps_prefill_apart(small_checkpoint, greedy):
    outputs, engine, passes = run(small_checkpoint, merge=True, device_drafts=True, num_drafts=3)
    assert outputs == greedy
    assert mixed(passes) == 0  # its verify is launched from the proposer's tensor, not run()
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
