"""The engine's device-resident decode step (issue 14 items 3-4) and its acceptance accounting
(issue 20 item 3), on CPU.

The device path (verify launched from the proposer's device tensors, drafts read once after
the verify) is CUDA's default; `Engine.device_drafts = True` runs the same code on CPU, where
it must be token-exact with target-only greedy like the host path. Acceptance statistics count
only drafts the request could use: an oracle drafter that drafts the target's own continuation
(right past the token limit too) shows the over-count the old accounting gave."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from examples.engine.speculate import usable
from examples.engine.runner import NonFiniteLogitsError
from examples.engine import draft_side, engine as engine_module
from tests.examples.helpers import SMALL, generate, nan_at_first_verify, random_requests
from draft_circuit.runners.testing import cuda

REQUESTS = random_requests(SMALL.vocab_size, 7, seed=11)


@pytest.fixture(scope="module")
def greedy(small_checkpoint):
    return generate(small_checkpoint, REQUESTS, speculate=False, max_batch=3)[0]


def run(path, requests, *, device_drafts, **config):
    engine = Engine(load_checkpoint(path), EngineConfig(**config))
    engine.device_drafts = device_drafts
    return engine.generate(requests).outputs, engine


@pytest.mark.parametrize("forward,k,tau,widths,max_batch,max_rows,kinds", [
    ("circuit", 4, None, (1, 2, 4), 3, 1024, {"own", "pad"}),
    ("circuit", 3, 0.2, (1, 2), 4, 1024, {"own", "per_sequence"}),  # stops: -1 drafts padded
    ("eager", 4, 0.5, (1, 2, 4), 4, 12, {"eager"}),  # 3 x 5 rows > 12: host path for wide steps
])
def test_device_path_equals_greedy(small_checkpoint, greedy, forward, k, tau, widths, max_batch,
                                   max_rows, kinds):
    outputs, engine = run(small_checkpoint, REQUESTS, device_drafts=True, forward=forward,
                          num_drafts=k, draft_confidence_stop=tau, widths=widths,
                          max_batch=max_batch, max_rows=max_rows)
    assert outputs == greedy
    seen = {kind for per in engine.stats.draft_batches.table().values() for kind in per}
    assert kinds <= seen, seen
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0


def test_device_path_with_the_compiled_target_equals_greedy(small_checkpoint, greedy):
    """The verify pass on the compiled target (padded to a power-of-two row count) from the
    proposer's tensor; prefills longer than 16 rows run in chunks on the host path."""
    outputs, engine = run(small_checkpoint, REQUESTS, device_drafts=True, target_forward="circuit",
                          max_rows=16, num_drafts=3, widths=(1, 2, 4), max_batch=3)
    assert outputs == greedy


def test_device_path_verifies_from_the_proposers_tensor(small_checkpoint, greedy, monkeypatch):
    """The verify input is the proposer's device buffer itself (no host list of drafts), or
    after a finish the rows of it the unfinished sequences keep (`draft_side.narrowed`: a
    device tensor made from it), and the drafts are read after the verify is launched, once
    per step (by `last_drafts`, or by `step_ahead`, which reads them before it enqueues the
    draft side; one it declines reads nothing)."""
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3))
    engine.device_drafts = engine.draft_before_read = True
    p, target = engine.proposer, engine.target
    order: list[str] = []
    real_verify, real_last, real_ahead = target.launch_verify, p.last_drafts, p.step_ahead
    kept: list[torch.Tensor] = []  # the narrowed verify inputs
    real_narrowed = draft_side.narrowed

    def narrowed(ahead):
        got = real_narrowed(ahead)
        if got is not None and got is not ahead:
            kept.append(got.tokens)
        return got

    def launch_verify(seqs, tokens, num_drafts, prefill=()):
        assert tokens.data_ptr() == p.verify_tokens().data_ptr() \
            or any(tokens is t for t in kept)
        order.append("verify")
        return real_verify(seqs, tokens, num_drafts, prefill)

    withdrawing = []

    def last_drafts(states):
        if not withdrawing:  # a withdrawal's read (a sequence finished) is not the step's
            order.append("read")
        return real_last(states)

    def step_ahead(*args):
        got = real_ahead(*args)
        if got is not None:  # (declined: nothing read, the step reads first)
            order.append("read")
        return got

    def withdraw(proposer, ahead, stats=None):
        withdrawing.append(1)
        try:
            return real_withdraw(proposer, ahead, stats)
        finally:
            withdrawing.pop()
    real_withdraw = engine_module.withdraw
    monkeypatch.setattr(engine_module, "withdraw", withdraw)  # the engine's call and end_step's
    monkeypatch.setattr(draft_side, "withdraw", withdraw)
    monkeypatch.setattr(draft_side, "narrowed", narrowed)
    monkeypatch.setattr(target, "launch_verify", launch_verify)
    monkeypatch.setattr(p, "last_drafts", last_drafts)
    monkeypatch.setattr(p, "step_ahead", step_ahead)
    assert engine.generate(REQUESTS).outputs == greedy
    assert engine.stats.draft_batches.batches  # some steps drafted ahead of their read
    assert kept  # some finished while others ran on
    assert order and order[::2] == ["verify"] * (len(order) // 2)
    assert order[1::2] == ["read"] * (len(order) // 2)
    assert len(order) // 2 == engine.stats.steps  # every decode step took the device path


def _passes(engine, monkeypatch) -> list[tuple[int, bool]]:
    """Record each target pass: (rows, whether its tokens are a merged verify + prefill's)."""
    model, seen = engine.target.model, []
    real = model.launch

    def launch(rows):
        merged = engine.target.__dict__.get("_merge_buffers")
        seen.append((rows.tokens.shape[0],
                     merged is not None and rows.tokens.data_ptr() == merged[0].data_ptr()))
        return real(rows)
    monkeypatch.setattr(model, "launch", launch)
    return seen


@pytest.mark.parametrize("target_forward", ["eager", "circuit"])
def test_device_path_merges_admissions_into_the_verify(small_checkpoint, greedy, monkeypatch,
                                                       target_forward):
    """An admission beside a running batch rides in the verify pass on the device path too (the
    proposer's verify rows, then the prompts): one target pass fewer per such step, the same
    tokens; with the merge off, each admission is a pass of its own."""
    passes = {}
    for merge in (True, False):
        engine = Engine(load_checkpoint(small_checkpoint),
                        EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3,
                                     target_forward=target_forward, max_rows=64))
        engine.device_drafts, engine.merge_prefill = True, merge
        seen = _passes(engine, monkeypatch)
        assert engine.generate(REQUESTS).outputs == greedy
        assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
        passes[merge] = seen
        monkeypatch.undo()
    merged = [rows for rows, is_merged in passes[True] if is_merged]
    assert merged and not any(m for _, m in passes[False])
    # fewer passes (a merged admission decodes from the next step, so the steps differ too)
    assert len(passes[True]) < len(passes[False])


def test_device_path_prefills_alone_what_would_not_fit(small_checkpoint, greedy):
    """A merged pass must fit max_rows (the device path never splits a verify): past it the
    admission prefills in a pass of its own."""
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3,
                                 max_rows=16))
    engine.device_drafts = True
    running = [engine.scheduler.add(r) for r in REQUESTS[:2]]
    fits = engine.scheduler.add(Request([1] * 8, 2))
    too_long = engine.scheduler.add(Request([1] * 9, 2))
    assert engine._merges(running, [fits]) and not engine._merges(running, [too_long])
    engine.scheduler.waiting.clear()
    assert engine.generate(REQUESTS).outputs == greedy


def test_a_non_finite_merged_prompt_row_names_its_request_and_prefill(small_checkpoint,
                                                                      monkeypatch):
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=2))
    engine.device_drafts = True
    model = engine.target.model
    real = model.launch

    def launch(rows):
        tokens, hidden = real(rows)
        merged = engine.target.__dict__.get("_merge_buffers")
        if merged is not None and rows.tokens.data_ptr() == merged[0].data_ptr():
            tokens = tokens.clone()
            tokens[-2] = -1  # the admitted prompt's next-to-last row: no finite logit
        return tokens, hidden
    monkeypatch.setattr(model, "launch", launch)
    # the first finishes first, so the third is admitted beside the second: a merged pass
    requests = [Request([1, 2, 3], 3), Request([4, 5], 12), Request([6, 7, 8, 9], 4)]
    with pytest.raises(NonFiniteLogitsError, match=r"request 2: the target's logits at position "
                                                   r"2, prefill, are all non-finite"):
        engine.generate(requests)


# ---- issue 20 item 3: acceptance counts only usable drafts ----
@pytest.mark.parametrize("drafted,accepted,room,kept,eos,want", [
    (4, 4, 10, [1, 2, 3, 4, 5], None, (4, 4)),     # all usable
    (100, 100, 7, [1] * 7, None, (7, 7)),          # cut at max_new_tokens
    (4, 2, 3, [1, 2, 9], None, (3, 2)),            # the 4th draft lies past the limit
    (4, 3, 10, [1, 8], 8, (2, 2)),                 # an accepted EOS ends the request
    (4, 1, 10, [1, 8], 8, (2, 1)),                 # the bonus is the EOS: drafts past it
    (4, 0, 10, [5], None, (4, 0)),
])
def test_usable_counts(drafted, accepted, room, kept, eos, want):
    assert usable(drafted, accepted, room, kept, eos) == want


def oracle_drafts(engine, continuations, monkeypatch):
    """Make the engine's drafter draft the target's own greedy continuation (as long as asked,
    past the request's limit too): the proposer runs as usual (its rows and keys stay right:
    exact-KV trims every draft row and catch-up rebuilds the accepted ones from the target),
    only the drafts handed to the engine are replaced."""
    p = engine.proposer
    real = p.propose_batch

    def propose_batch(last_tokens, hiddens, positions, num_drafts, states, **kw):
        got = real(last_tokens, hiddens, positions, num_drafts, states, **kw)
        if got is None:
            return None
        seqs = {id(s.draft_state): s for s in engine.scheduler.running}
        out = []
        for state, pos, d in zip(states, positions, got):
            full = continuations[tuple(seqs[id(state)].request.prompt)]
            out.append(full[pos + 1:pos + 1 + len(d)])
        return out
    monkeypatch.setattr(p, "propose_batch", propose_batch)


@pytest.mark.parametrize("eos_at", [None, 3])
def test_acceptance_never_counts_drafts_past_the_limit_or_an_eos(small_checkpoint, monkeypatch,
                                                                 eos_at):
    """--num-drafts 100 --max-new-tokens 8 with a perfect drafter: at most 7 drafts a request
    can be accepted (the prefill made the first token); with an EOS at generated token
    eos_at + 1, at most eos_at."""
    k, limit = 100, 8
    prompts = [r.prompt for r in random_requests(SMALL.vocab_size, 3, seed=4, max_prompt=12)]
    long, _ = generate(small_checkpoint, [Request(q, limit + k + 1) for q in prompts],
                       speculate=False, max_batch=3)
    continuations = {tuple(q): q + out for q, out in zip(prompts, long)}
    checkpoint = load_checkpoint(small_checkpoint)
    if eos_at is not None:
        checkpoint = dataclasses.replace(checkpoint, eos_token_id=long[0][eos_at])
    engine = Engine(checkpoint, EngineConfig(forward="eager", num_drafts=k, max_batch=3))
    oracle_drafts(engine, continuations, monkeypatch)
    result = engine.generate([Request(q, limit) for q in prompts])
    want = [out[:limit] for out in long]
    if eos_at is not None:
        eos = long[0][eos_at]
        want = [o[:o.index(eos) + 1] if eos in o else o for o in want]
    assert result.outputs == want
    stats = result.stats
    usable_tokens = sum(len(o) - 1 for o in want)  # the prefill's token is no draft
    assert stats.accepted == usable_tokens  # the oracle is always right: every usable one
    assert stats.drafted == stats.accepted
    assert stats.accepted / stats.verifies <= limit


@pytest.mark.parametrize("device_drafts", [False, True])
def test_the_engines_kv_only_catch_up_stays_exact(small_checkpoint, greedy, device_drafts):
    """`Engine._proposer` for --forward circuit installs the k-step chain, the one-step chain and
    the KV-only catch-up runner (`set_circuit_draft(..., kv_only=True)`): every catch-up and
    prefill row runs on the KV-only runner, none on the full one-step chain, and the output is
    still target-only greedy's."""
    from draft_circuit.runners.draft import CircuitDraftRunner
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=4, widths=(1, 2, 4), max_batch=3))
    engine.device_drafts = device_drafts
    p = engine.proposer
    kv, is_kv_only = p.chains.kv_only()
    assert is_kv_only and isinstance(kv, CircuitDraftRunner)
    assert kv is p.chains.installed[(0, False)]  # the engine's own install, not the default build
    rows, full, real, one_step = [], [], kv.run, p.chain_runner(1)
    real_full = one_step.run
    kv.run = lambda n, inputs: rows.append(n) or real(n, inputs)
    one_step.run = lambda n, inputs: full.append(n) or real_full(n, inputs)
    assert engine.generate(REQUESTS).outputs == greedy
    assert rows and not full  # every catch-up and prefill row ran on the KV-only runner


@pytest.mark.parametrize("row", [-1, 0])
def test_device_path_names_a_non_finite_verify_row(small_checkpoint, monkeypatch, row):
    """FAULTS 27 on the device path: a verify row with no finite logit raises
    NonFiniteLogitsError naming the request and decode step, as the host path does. Row 0 is
    the one a draft-before-read propose takes its token from when nothing is accepted: the -1
    reaches the drafter as 0 (review regression: the chain's guard raised its own error first)."""
    from examples.engine.runner import NonFiniteLogitsError
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(widths=(1,), max_batch=1))
    engine.device_drafts = engine.draft_before_read = True
    calls = nan_at_first_verify(engine, monkeypatch, row)
    with pytest.raises(NonFiniteLogitsError, match=r"request 0: .* position \d+, decode step \d+ "):
        engine.generate([Request([1, 2, 3], 12)])
    assert calls[1] == engine.k + 1  # the verify ran on the device path: k + 1 rows


@cuda
def test_a_second_launch_before_the_read_is_refused():
    """The launched verify's greedy tokens land in one pinned buffer (and the target staging's
    mirror is rewritten by the next pass): a second launch before the read raises by name."""
    from examples.engine.runner import TokensToHost
    out = TokensToHost(8, torch.device("cuda"))
    read = out.enqueue(torch.arange(4, dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="launched before the last one was read"):
        out.enqueue(torch.arange(4, dtype=torch.int32, device="cuda"))
    assert read() == [0, 1, 2, 3]
    assert out.enqueue(torch.ones(2, dtype=torch.int32, device="cuda"))() == [1, 1]
