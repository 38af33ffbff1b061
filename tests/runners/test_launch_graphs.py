"""runners/launch_graphs.py: per-step launches replayed as small CUDA graphs (issues 14, 20).

CPU: the policy with a recorder standing in for the capture (a replay calls the recorded
launch again, which reads the same memory a graph would: the recorded closure keeps its
tensors alive, so an equal key means the same storage): eager until a key and its operands
have come `after` times, captured once, replayed after; other operands or a capture that
fails stay eager; the switch turns it off. The two users, the accepted counts' advance (kernel,
copy, gather) and the drafts' pack (kernel, copy), under the Triton interpreter: a replayed
step_ahead loop is the read-first path's. cuda: the same with real graphs, no allocation and
no sync once captured (tests/runners/test_proposer_ahead.py's allocation and sync test, with
the graphs made at their second use).
"""
from __future__ import annotations

import logging
import types

import pytest
import torch

from draft_circuit.runners.launch_graphs import LaunchGraphs
from draft_circuit.runners.testing import cuda
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled


class Recorder:
    """A capture that records the launch; its 'graph' replays by calling it again."""

    def __init__(self, fail: bool = False) -> None:
        self.made: list[object] = []
        self.fail = fail

    def __call__(self, launch):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.made.append(launch)
        return types.SimpleNamespace(replay=launch)


def _counter():
    calls = []
    return calls, (lambda: calls.append(1))


def test_eager_until_after_then_one_capture_then_replays():
    rec = Recorder()
    g = LaunchGraphs(torch.device("cpu"), after=3, capture=rec)
    ops = (torch.zeros(2), torch.ones(2))
    calls, launch = _counter()
    for _ in range(4):  # the first sighting, then three more: captured at the third use after
        g.run(("k", 1), ops, launch)
    assert len(calls) == 4 and g.captured == 1 and len(rec.made) == 1 and g.replays == 0
    for _ in range(5):
        g.run(("k", 1), ops, launch)
    assert g.replays == 5 and len(calls) == 9  # (the recorder's replay is the launch itself)
    assert g.captured == 1


def test_other_operands_or_keys_are_entries_of_their_own():
    """A key's graph replays only for the operands it was captured with; other operands under
    the same key (two alternating sets of views) and other keys start eager and get their own
    graph, without dropping the first."""
    rec = Recorder()
    g = LaunchGraphs(torch.device("cpu"), after=1, capture=rec)
    a, b = (torch.zeros(2),), (torch.zeros(2),)
    calls, launch = _counter()
    g.run(1, a, launch)
    g.run(1, a, launch)  # captured here (the second use at after = 1)
    assert g.captured == 1
    g.run(1, b, launch)  # the same key with other operands: eager
    g.run(2, a, launch)  # another key: eager
    assert g.replays == 0 and len(calls) == 4
    g.run(1, b, launch)  # b's second use: captured
    g.run(1, b, launch)
    g.run(1, a, launch)  # a's graph is still there
    assert g.captured == 2 and g.replays == 2


def test_turned_off_a_made_graph_is_not_replayed(monkeypatch):
    calls, launch = _counter()
    g = LaunchGraphs(torch.device("cpu"), after=1, capture=Recorder())
    ops = (torch.zeros(1),)
    for _ in range(3):
        g.run(0, ops, launch)
    assert g.captured == 1 and g.replays == 1
    monkeypatch.setattr(LaunchGraphs, "enabled", False)
    for _ in range(3):
        g.run(0, ops, launch)
    assert g.replays == 1 and len(calls) == 6  # eager launches (the recorder's replay is one too)


def test_a_capture_that_fails_stays_eager(caplog):
    g = LaunchGraphs(torch.device("cpu"), after=1, capture=Recorder(fail=True))
    calls, launch = _counter()
    ops = (torch.zeros(1),)
    with caplog.at_level(logging.WARNING, logger="draft_circuit.runners.launch_graphs"):
        for _ in range(5):
            g.run("key", ops, launch)
    assert len(calls) == 5 and g.captured == 0 and g.replays == 0
    assert sum("capture failed" in r.message for r in caplog.records) == 1  # once, not a step


def test_off_and_cpu_without_a_recorder_never_capture(monkeypatch):
    calls, launch = _counter()
    plain = LaunchGraphs(torch.device("cpu"), after=1)  # CPU: no graphs to make
    monkeypatch.setattr(LaunchGraphs, "enabled", False)
    off = LaunchGraphs(torch.device("cpu"), after=1, capture=Recorder())
    ops = (torch.zeros(1),)
    for _ in range(4):
        plain.run(0, ops, launch)
        off.run(0, ops, launch)
    assert len(calls) == 8 and plain.captured == off.captured == 0


# ---- the users: step_ahead's advance (kernel, copy, gather) and the fill's pack (kernel, copy)


def _static_loop(n, device, steps, graphs_after=None, buffers=1, **opts):
    """step_ahead (b) against the read-first path (a) with the verify's greedy tokens and
    hiddens written into `buffers` sets of buffers, step i into set i % buffers (a target
    runner's outputs are its buffers, one set a bucket; the engine's hiddens are a few
    allocations that come back); `b`'s per-step launches go through recorder graphs (after
    `graphs_after` uses) when given. Both launch through the kernels (fused) where `device`
    runs them compiled, or when forced. With two sets, a graph keyed too coarsely (without
    the buffers' addresses) replays on the other set's tensors: wrong bits, caught here."""
    from tests.runners.test_proposer_ahead import _greedy, _same_valid, read_first_step
    kw = dict(device=device, **opts)
    a, b = make("circuit", **kw), make("circuit", **kw)
    sa = [prefilled(a, 40 + i, length=6 + i % 5)[0] for i in range(n)]
    sb = [prefilled(b, 40 + i, length=6 + i % 5)[0] for i in range(n)]
    dev = b.device_drafts
    if device == "cpu":  # the kernels under the interpreter
        dev.counts.fused = dev.fused = True
        dev._verify_np = None  # (the CPU's numpy fill stands aside: the device path's ops run)
    recs = []
    if graphs_after is not None:
        for owner in (dev.counts, dev):
            rec = Recorder() if device == "cpu" else None
            recs.append(rec)
            owner.graphs = LaunchGraphs(torch.device(device), after=graphs_after, capture=rec)
    k1 = K + 1
    sets = [(torch.zeros(n * k1, dtype=torch.int32, device=device),
             torch.zeros(n * k1, CFG.hidden_size, dtype=hidden(0, 1).dtype, device=device))
            for _ in range(buffers)]
    pos = [a.last_pair_key(s) + 2 for s in sa]
    last = [(5 + i) % CFG.vocab_size for i in range(n)]
    a.propose_batch_on_device(last, hidden(7, n).to(device), pos, K, sa)
    b.propose_batch_on_device(last, hidden(7, n).to(device), pos, K, sb)
    for step in range(steps):
        drafts = a.last_drafts(sa)
        greedy, accepted = _greedy(drafts, step, n)
        greedy_buf, hidden_buf = sets[step % buffers]
        greedy_buf.copy_(greedy)
        hidden_buf.copy_(hidden(300 + step, n * k1))
        assert b.step_ahead(greedy_buf, hidden_buf, K, sb) is not None, b.last_served
        pos = read_first_step(a, sa, drafts, greedy, accepted, hidden_buf, pos)
        assert torch.equal(a.verify_tokens(), b.verify_tokens())
        assert torch.equal(a.device_drafts.drafts(n, K), b.device_drafts.drafts(n, K))
        assert torch.equal(a.device_drafts.confidences(n, K), b.device_drafts.confidences(n, K))
        _same_valid(a, sa, b, sb)
    return b, recs


@pytest.mark.parametrize("n", [1, 3])
def test_a_replayed_step_ahead_is_the_read_first_step(n):
    """Under the interpreter, the advance's kernel + gather and the pack's kernel, recorded
    once each and replayed after (the advance from step 4, the pack from step 3): every step
    the read-first path's bits."""
    b, recs = _static_loop(n, "cpu", steps=6, graphs_after=1)
    counts, dev = b.device_drafts.counts.graphs, b.device_drafts.graphs
    assert counts.captured == dev.captured == 1, (counts.captured, dev.captured)
    # (the advance: checked at step 1, seen at 2, captured at 3; the pack one step earlier:
    # its checked launch was the first propose's)
    assert counts.replays == 3 and dev.replays == 4
    assert all(len(r.made) == 1 for r in recs)


def test_replays_follow_the_verify_buffers_they_were_captured_on():
    """Greedy tokens and hiddens alternating between two sets of buffers: the advance's graph
    (kernel, copy, gather) is keyed by their addresses, one graph a set, and each step is the
    read-first path's bits (a key without the addresses replays on the other set's tensors)."""
    b, recs = _static_loop(3, "cpu", steps=8, graphs_after=1, buffers=2)
    counts = b.device_drafts.counts.graphs
    assert counts.captured == 2 and counts.replays >= 3 and len(recs[0].made) == 2


@cuda
@pytest.mark.parametrize("n", [1, 4])
def test_cuda_replayed_step_ahead_is_the_read_first_step(n):
    """Real graphs (captured at their second use): the read-first path's bits every step."""
    b, _ = _static_loop(n, "cuda", steps=6, graphs_after=1, num_blocks=200, max_blocks_per_seq=20)
    counts, dev = b.device_drafts.counts.graphs, b.device_drafts.graphs
    assert counts.captured == dev.captured == 1 and counts.replays == 3 and dev.replays == 4
