"""On the GPU (`pytest -m cuda`): the engine's output is still target-only greedy decoding's,
with the drafter on CUDA graphs (--forward circuit) or the eager oracle, and the target either
eager or compiled (Triton kernels, graphs per power-of-two row count)."""
from __future__ import annotations

import pytest

from examples.engine.checkpoints import EMBEDDED
from draft_circuit.runners.testing import cuda
from tests.examples.helpers import SMALL, generate, random_requests

REQUESTS = random_requests(SMALL.vocab_size, 6, seed=13)


@cuda
@pytest.mark.parametrize("target_forward", ["eager", "circuit"])
def test_speculative_equals_greedy_on_gpu(small_checkpoint, target_forward):
    common = dict(device="cuda", target_forward=target_forward, max_rows=64)
    greedy, _ = generate(small_checkpoint, REQUESTS, speculate=False, max_batch=3, **common)
    for forward in ("circuit", "eager"):
        outputs, engine = generate(small_checkpoint, REQUESTS, forward=forward, num_drafts=3,
                                   widths=(1, 2, 4), max_batch=3, **common)
        assert outputs == greedy, forward
        assert engine.pool.num_used == 0


@cuda
def test_embedded_model_on_gpu():
    requests = random_requests(256, 6, seed=2, min_prompt=8, max_new=(16, 32))
    common = dict(device="cuda", target_forward="circuit", max_rows=64, max_batch=4)
    greedy, _ = generate(EMBEDDED, requests, speculate=False, **common)
    outputs, engine = generate(EMBEDDED, requests, forward="circuit", num_drafts=4, **common)
    assert outputs == greedy
    assert engine.stats.accepted / engine.stats.verifies > 1.0
