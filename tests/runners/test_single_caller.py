"""FAULTS 29: runners and proposers are single-caller. A second thread entering one while another
thread is inside raises ConcurrentCallError at once (no waiting, no interleaved drafts); the same
thread may nest calls, and calls one after another from different threads work."""
import threading

import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead
from draft_circuit.runners.draft import CircuitDraftRunner
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.single_caller import ConcurrentCallError, single_caller
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights
from tests.runners.tiny_chain import tiny_chain, tiny_config

CFG = tiny_config(vocab_size=90)
KV = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
K = 2


def _inside_other_thread(enter, block):
    """Start `enter()` in a second thread and return once it is blocked inside (block() waits on
    the returned release event); the caller then calls in from this thread."""
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold():
        inside.set()
        release.wait(10)

    block(hold)

    def target():
        try:
            enter()
        except Exception as e:  # noqa: BLE001 - reported to the test thread
            errors.append(e)
    t = threading.Thread(target=target, name="first-caller")
    t.start()
    assert inside.wait(10), "the first caller never got inside"
    return t, release, errors


def _blocking_launch(runner: ProgramRunner, width: int):
    def block(hold):
        first = runner._bound[width][0]
        fn = first.fn

        def slow(*args):
            hold()
            fn(*args)
        runner._bound[width][0] = type(first)(**{**first.__dict__, "fn": slow})
    return block


@pytest.fixture(scope="module")
def compiled():
    return tiny_chain(CFG, KV, K, [1, 2, 4], seed=3)


@pytest.mark.parametrize("wrap", ["program", "draft"])
def test_second_thread_on_one_runner_raises(compiled, wrap):
    chain, params, cd = compiled
    batch = random_draft_batch(CFG, KV, 4, seed=1, num_drafts=K)
    want = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)
    program = ProgramRunner(cd, batch.clone_states())
    runner = CircuitDraftRunner(cd, program.states, backend=program) if wrap == "draft" else program
    call = (lambda: runner.run(4, batch.inputs)) if wrap == "draft" else \
        (lambda: runner.run(batch.inputs))
    t, release, errors = _inside_other_thread(call, _blocking_launch(program, 4))
    try:
        with pytest.raises(ConcurrentCallError, match=f"{type(runner).__name__}.run .*single-caller"):
            call()
        if wrap == "program":
            with pytest.raises(ConcurrentCallError, match="ProgramRunner.execute"):
                program.execute(1)
    finally:
        release.set()
        t.join(10)
    assert not errors, errors
    # the first caller's run was not disturbed, and the runner is free again afterwards
    assert torch.equal(program.output_buffers(4)["drafts"], want["drafts"])
    got = call()
    assert torch.equal(got["drafts"], want["drafts"])


def test_sequential_calls_from_two_threads_work(compiled):
    _, _, cd = compiled
    batch = random_draft_batch(CFG, KV, 2, seed=2, num_drafts=K)
    runner = ProgramRunner(cd, batch.clone_states())
    results = []
    for i in range(2):
        t = threading.Thread(target=lambda: results.append(runner.run(batch.inputs)["drafts"].clone()))
        t.start()
        t.join(10)
    assert len(results) == 2 and torch.equal(results[0], results[1])


def test_same_thread_may_nest():
    @single_caller("outer", "inner")
    class Nested:
        def __init__(self):
            self.calls = 0

        def outer(self):
            return self.inner() + 1

        def inner(self):
            self.calls += 1
            return self.calls
    assert Nested().outer() == 2


def test_second_thread_on_one_proposer_raises():
    head = MtpHead(CFG)
    p = MtpProposer(head, head.bind(random_mtp_weights(CFG, seed=11)), num_drafts=K,
                    num_blocks=40, block_size=8, max_blocks_per_seq=6, max_width=4,
                    widths=(1, 2, 4), forward="eager")
    state = p.alloc_state()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, CFG.vocab_size, (9,), generator=g).tolist()
    hiddens = torch.randn(9, CFG.hidden_size, generator=g)
    p.prefill_drafter(prompt, hiddens, state)
    runner = p.chain_runner()

    def block(hold):
        run = runner.run

        def slow(*args, **kwargs):
            hold()
            return run(*args, **kwargs)
        runner.run = slow

    h = torch.randn(CFG.hidden_size, generator=g)
    first = lambda: p.propose(prompt[-1], h, len(prompt) - 1, K, state)  # noqa: E731
    t, release, errors = _inside_other_thread(first, block)
    try:
        other = p.alloc_state.__wrapped__(p)  # a state made without the guard: only the call races
        with pytest.raises(ConcurrentCallError, match="MtpProposer.propose_batch"):
            p.propose_batch([1], h.view(1, -1), [3], K, [other])
        with pytest.raises(ConcurrentCallError, match="MtpProposer.after_verify"):
            p.after_verify(0, state)
    finally:
        release.set()
        t.join(10)
    assert not errors, errors
    p.after_verify(0, state)  # free again once the first caller left
