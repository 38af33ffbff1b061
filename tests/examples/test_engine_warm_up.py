"""`Engine.warm_up` (issue 20): a few dummy requests generated and forgotten at construction, so
the first real request does not pay the process's one-time work. It must leave nothing behind
(no KV block, no drafter state, no statistics, sequence ids from 0) and change no output; it
covers an admission beside a running batch, every batch width down to one and a prompt longer
than the drafter's widest program; it is on by default on CUDA only."""
from __future__ import annotations

import pytest

from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from examples.engine.checkpoints import EngineError
from draft_circuit.runners.testing import cuda
from tests.examples.helpers import SMALL, generate, random_requests

REQUESTS = random_requests(SMALL.vocab_size, 5, seed=23)


@pytest.mark.parametrize("forward,device_drafts", [("circuit", False), ("circuit", True),
                                                   ("eager", False)])
def test_warm_up_leaves_nothing_and_changes_no_output(small_checkpoint, forward, device_drafts):
    config = dict(forward=forward, num_drafts=3, widths=(1, 2, 4), max_batch=3)
    ref = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    ref.device_drafts = device_drafts
    fresh = ref.generate(REQUESTS).outputs
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts = device_drafts
    engine.warm_up()
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
    assert engine.stats.generated == engine.stats.steps == engine.stats.verifies == 0
    assert not engine.stats.widths and not engine.stats.draft_batches.table()
    assert engine.scheduler.add(REQUESTS[0]).id == 0  # ids restart (then the queue is emptied)
    engine.scheduler.waiting.clear()
    out = engine.generate(REQUESTS)
    assert out.outputs == fresh == generate(small_checkpoint, REQUESTS, speculate=False)[0]
    assert (out.stats.generated, out.stats.accepted, out.stats.steps) == \
        (ref.stats.generated, ref.stats.accepted, ref.stats.steps)
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0


def test_warm_up_covers_admissions_every_width_and_a_split_catch_up(small_checkpoint, monkeypatch):
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(num_drafts=3, widths=(1, 2, 4), max_batch=3))
    seen = {}
    generate_once = Engine.generate

    def recording(self, requests, on_step=None):
        result = generate_once(self, requests, on_step)
        seen.update(requests=list(requests), widths=dict(self.stats.widths),
                    warming=self.warming_up)  # what the benchmarks' wrappers skip by
        return result

    monkeypatch.setattr(Engine, "generate", recording)
    engine.warm_up()
    requests = seen["requests"]
    assert len(requests) == 3 + 1  # one more than a batch: an admission beside a running batch
    assert len(requests[0].prompt) > engine.proposer.max_width  # its catch-up splits
    assert {1, 3} <= set(seen["widths"])  # the full batch, and the last sequence alone
    assert seen["warming"] is True and engine.warming_up is False


def test_default_is_on_cuda_only_and_warm_up_refuses_queued_work(small_checkpoint, monkeypatch):
    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self))
    Engine(load_checkpoint(small_checkpoint), EngineConfig())
    assert calls == []  # CPU: off unless asked
    Engine(load_checkpoint(small_checkpoint), EngineConfig(warm_up=True))
    assert len(calls) == 1
    monkeypatch.undo()
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig())
    engine.scheduler.add(Request([1, 2, 3], 2))
    with pytest.raises(EngineError, match="warm_up runs before any request"):
        engine.warm_up()
    with pytest.raises(RuntimeError, match="ids restart only"):
        engine.scheduler.restart_ids()


@cuda
def test_warm_up_runs_by_default_on_cuda_and_changes_no_output(small_checkpoint, monkeypatch):
    common = dict(device="cuda", target_forward="circuit", max_rows=64, num_drafts=3,
                  widths=(1, 2, 4), max_batch=3)
    cold, _ = generate(small_checkpoint, REQUESTS, warm_up=False, **common)
    calls = []
    warm_up = Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up", lambda self: (calls.append(1), warm_up(self)))
    warm, engine = generate(small_checkpoint, REQUESTS, **common)
    assert calls == [1] and warm == cold
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0


def test_a_failing_warm_up_is_named_as_the_warm_ups(small_checkpoint):
    """A target that gives no finite logit fails at construction, and the error says it was the
    warm-up's dummy requests, not a request of the caller's."""
    from examples.engine.runner import NonFiniteLogitsError
    from tests.examples.test_engine_nonfinite import _nan_checkpoint
    with pytest.raises(NonFiniteLogitsError, match=r"the engine's warm-up \(dummy requests .*"
                                                   r"--no-warm-up skips it\) failed: request 0: "
                                                   r"the target's logits .* non-finite"):
        Engine(_nan_checkpoint(small_checkpoint, speculate=True),
               EngineConfig(widths=(1, 2), max_batch=2, warm_up=True))


@pytest.mark.parametrize("kv_blocks,max_seq_len", [(4, None), (64, 6)])
def test_warm_up_fits_a_small_pool_or_length_limit(small_checkpoint, kv_blocks, max_seq_len,
                                                  monkeypatch):
    """The dummy requests shrink to what check_requests lets a batch of them hold (3 usable
    blocks of 16 rows for 3 sequences; or 6 tokens a sequence), and the caller's requests that
    fit still run as on a fresh engine."""
    config = dict(num_drafts=2, widths=(1, 2, 4), max_batch=3, kv_blocks=kv_blocks,
                  max_seq_len=max_seq_len)
    requests = [Request([1, 2], 3), Request([3], 2)]
    fresh = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config)).generate(requests)
    warmed, generate_once = [], Engine.generate
    monkeypatch.setattr(Engine, "generate",
                        lambda self, reqs, on_step=None: (warmed.append(len(reqs)),
                                                          generate_once(self, reqs, on_step))[1])
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(warm_up=True, **config))
    assert warmed == [3 + 1]  # it ran, every dummy request shrunk to fit
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
    assert engine.generate(requests).outputs == fresh.outputs
