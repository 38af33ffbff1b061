"""On the GPU (`pytest -m cuda`): the engine's default CUDA decode step is the device path
(issue 14 items 3-4: verify launched from the proposer's device tensor, or from it and the
prompts admitted beside the batch, drafts read once after it, catch-up on the KV-only chain when
installed) and stays token-exact with target-only
greedy, on both drafter forwards and both target forwards, batches narrowed by finishes
included; the host path (device_drafts False) is exact there too."""
from __future__ import annotations

import pytest

from examples.engine import Engine, EngineConfig, load_checkpoint
from draft_circuit.runners.testing import cuda
from tests.examples.helpers import SMALL, generate, random_requests

REQUESTS = random_requests(SMALL.vocab_size, 6, seed=13)
_GREEDY: dict[str, list[list[int]]] = {}  # target forward -> target-only greedy outputs


def greedy_for(path, target_forward: str) -> list[list[int]]:
    if target_forward not in _GREEDY:
        _GREEDY[target_forward] = generate(path, REQUESTS, speculate=False, max_batch=3,
                                           device="cuda", target_forward=target_forward,
                                           max_rows=64)[0]
    return _GREEDY[target_forward]


@cuda
@pytest.mark.parametrize("target_forward", ["eager", "circuit"])
@pytest.mark.parametrize("forward,tau", [("circuit", None), ("circuit", 0.3), ("eager", None)])
@pytest.mark.parametrize("before_read", [False, True])
def test_device_path_equals_greedy_on_gpu(small_checkpoint, target_forward, forward, tau,
                                          before_read):
    common = dict(device="cuda", target_forward=target_forward, max_rows=64)
    greedy = greedy_for(small_checkpoint, target_forward)
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward=forward, num_drafts=3, widths=(1, 2, 4), max_batch=3,
                                 draft_confidence_stop=tau, **common))
    assert engine.device_drafts is None and engine._on_device(3)  # CUDA's default
    engine.draft_before_read = before_read
    p, target = engine.proposer, engine.target
    verifies, real = [], target.launch_verify

    # marked by the verify's launch, not by its tokens' address: a batch narrowed by a finish
    # is verified from a cat of the kept rows (draft_side.narrowed), at no fixed address
    def launch_spy(seqs, tokens, num_drafts, prefill=()):
        assert tokens.is_cuda and tokens.shape[0] == len(seqs) * (num_drafts + 1)
        verifies.append(len(seqs))
        return real(seqs, tokens, num_drafts, prefill)
    target.launch_verify = launch_spy
    assert engine.generate(REQUESTS).outputs == greedy
    assert len(verifies) == engine.stats.steps  # every decode step verified from the device
    assert engine.pool.num_used == 0 and p.pool.num_used == 0
    # drafted ahead, finishes narrow batches that are then verified on the device (3 -> 2 and
    # 2 -> 1 here on CPU's device path; draft_side.narrowed)
    assert bool(engine.stats.draft_batches.narrowed) == before_read


@cuda
def test_host_path_equals_greedy_on_gpu(small_checkpoint):
    common = dict(device="cuda", target_forward="circuit", max_rows=64)
    greedy = greedy_for(small_checkpoint, "circuit")
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(num_drafts=3, widths=(1, 2, 4), max_batch=3, **common))
    engine.device_drafts = False
    assert engine.generate(REQUESTS).outputs == greedy
