"""Target hiddens as rows of one tensor picked by index (`HiddenRows`, runners/hidden_rows.py):
step_batch, catchup_batch and both batch proposes leave bitwise what the same rows given as
per-sequence tensors leave (drafts, confidences, rows, keys, tables, drafter KV) at exact,
padded and split widths and past SMALL_BATCH; the staging gathers them in one index_select
(no cat, no stack, no tensor built in the proposer's frames); a bad pick is refused by type
with words that name it and nothing changed."""
import numpy as np
import pytest
import torch

from draft_circuit.runners.hidden_rows import HiddenRows, check_hidden_rows, hidden_rows
from draft_circuit.runners.proposer_inputs import HiddenWidthError
from draft_circuit.runners.proposer_state import ProposerError
from draft_circuit.runners.testing import cuda
from tests.runners.test_proposer import CFG, K, hidden, make
from tests.runners.test_proposer_staging import ConstructorTrace
from tests.runners.test_proposer_step import (CASES, IDS, StepLoop, _accepted, _pair, _same,
                                              _snapshot, _unchanged, loops_agree, read_alike,
                                              steady_cuda_steps)


def _packed(parts: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Every part's rows in one tensor, in a shuffled order with spare rows between (a verify
    pass's hiddens hold rows nobody drafts from), and each part's row indices in it."""
    total = sum(p.shape[0] for p in parts)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(total + 5, generator=g)[:total].numpy()
    source = torch.randn(total + 5, CFG.hidden_size, generator=g)
    picks, at = [], 0
    for p in parts:
        idx = order[at:at + p.shape[0]].astype(np.int64)
        source[torch.from_numpy(idx)] = p
        picks.append(idx)
        at += p.shape[0]
    return source, picks


@pytest.mark.parametrize("n,opts", CASES, ids=IDS)
def test_step_batch_with_picked_rows_is_step_batch_with_tensors(n, opts):
    """Five decode steps: `a` hands step_batch per-sequence tensors, `b` the same values as
    HiddenRows of one tensor (the catch-up's rows and the targets' from one source, as an
    engine's verify pass gives them), every output and state bitwise alike after each step."""
    a, sa, b, sb = _pair(n, opts)
    pos = [a.last_pair_key(s) + 2 for s in sa]
    last = [(5 + i) % CFG.vocab_size for i in range(n)]
    source, (pick,) = _packed([hidden(7, n)], 1)
    got_a = a.propose_batch_on_device(last, hidden(7, n), pos, K, sa)
    got_b = b.propose_batch_on_device(last, HiddenRows(source, pick), pos, K, sb)
    for step in range(5):
        accepted, tokens, hiddens = read_alike(a, sa, got_a, b, sb, got_b, step)
        last = [(7 * i + step) % CFG.vocab_size for i in range(n)]
        hid = hidden(200 + step, n)
        pos = [p + c + 1 for p, c in zip(pos, accepted)]
        source, picks = _packed([*hiddens, hid], 10 + step)
        caught = hidden_rows(source, np.concatenate(picks[:n]))
        got_a = a.step_batch(accepted, tokens, hiddens, last, hid, pos, K, sa)
        got_b = b.step_batch(accepted, tokens, caught, last, HiddenRows(source, picks[n]), pos,
                             K, sb)
        assert got_a is not None and got_b is not None
        _same(a, sa, b, sb)


def test_catchup_batch_and_the_host_propose_take_picked_rows():
    """The separate calls too: catchup_batch (some sequences with no rows) and propose_batch,
    picked rows against tensors, bitwise."""
    n = 5
    a, sa, b, sb = _pair(n, {})
    tokens = [[1 + i] * (i % 3) for i in range(n)]
    hiddens = [hidden(30 + i, len(t)) if t else hidden(1, 1)[:0] for i, t in enumerate(tokens)]
    source, picks = _packed(hiddens, 3)
    first = [a.last_pair_key(s) + 2 for s in sa]
    assert a.catchup_batch(tokens, hiddens, first, sa) == \
        b.catchup_batch(tokens, hidden_rows(source, np.concatenate(picks)), first, sb)
    pos = [a.last_pair_key(s) + 2 for s in sa]
    source, (pick,) = _packed([hidden(8, n)], 4)
    conf_a: list = []
    conf_b: list = []
    assert a.propose_batch([3] * n, hidden(8, n), pos, K, sa, out_conf=conf_a) == \
        b.propose_batch([3] * n, HiddenRows(source, pick), pos, K, sb, out_conf=conf_b)
    assert conf_a == conf_b
    _same(a, sa, b, sb)


def test_a_picked_step_gathers_once_and_builds_no_tensor(monkeypatch):
    """Steady state with picked rows: no cat or stack of segments, no tensor built in the
    proposer's frames (the indices go through the staging's own mirror), one index_select
    a run whatever n."""
    n = 6
    p, states, _, _ = _pair(n, {})
    pos = [p.last_pair_key(s) + 2 for s in states]
    p.propose_batch_on_device([3] * n, hidden(7, n), pos, K, states)
    source = hidden(9, 4 * n)

    def step(i):
        nonlocal pos
        accepted = _accepted(p.last_drafts(states), i)
        drafts = p.last_drafts(states)
        tokens = [list(d[:c]) for d, c in zip(drafts, accepted)]
        rows = np.concatenate([np.arange(4 * j, 4 * j + c) for j, c in enumerate(accepted)])
        pos = [q + c + 1 for q, c in zip(pos, accepted)]
        return p.step_batch(accepted, tokens, HiddenRows(source, rows.astype(np.int64)),
                            [3] * n, HiddenRows(source, np.arange(0, 4 * n, 4)), pos, K, states)
    for i in range(2):  # warm
        step(i)
    trace = ConstructorTrace(monkeypatch)
    gathers = []
    real = torch.index_select

    def counted(*args, **kwargs):
        got = real(*args, **kwargs)  # counted once it has written (a refused one raises)
        gathers.append(kwargs.get("out") is not None)
        return got
    monkeypatch.setattr(torch, "index_select", counted)
    for i in range(2, 5):
        assert step(i) is not None
    assert trace.calls == []
    assert gathers and all(gathers)  # every gather wrote into the staging's buffer
    assert len(gathers) <= 2 * 3  # one a run: at most a catch-up and a propose a step
    assert p.staging.gather_fallbacks == 0


def test_a_source_on_another_dtype_is_gathered_then_copied():
    """A source whose dtype differs from the chain's hidden buffer (a host keeping fp64
    hiddens, say) still drafts what the tensors draft: gathered apart, converted in a copy,
    counted as a fallback."""
    n = 3
    a, sa, b, sb = _pair(n, {})
    pos = [a.last_pair_key(s) + 2 for s in sa]
    source, (pick,) = _packed([hidden(7, n)], 2)
    got_a = a.propose_batch_on_device([3] * n, hidden(7, n), pos, K, sa)
    got_b = b.propose_batch_on_device([3] * n, HiddenRows(source.double(), pick), pos, K, sb)
    assert torch.equal(got_a[0], got_b[0]) and torch.equal(got_a[1], got_b[1])
    assert b.staging.gather_fallbacks == 1 and a.staging.gather_fallbacks == 0


@pytest.mark.parametrize("picked", [False, True], ids=["tensors", "picked"])
def test_hiddens_autograd_tracks_are_read_detached(picked):
    """Hiddens that require grad (a host that forgot no_grad) draft what plain ones draft, and
    the chain's buffer never joins their graph: the next call, a plain one, still runs (before,
    the copy made the buffer require grad and every later call died in the read-back)."""
    n = 3
    a, sa, b, sb = _pair(n, {})
    pos = [a.last_pair_key(s) + 2 for s in sa]
    source, (pick,) = _packed([hidden(7, n)], 2)
    tracked = source.clone().requires_grad_(True)
    plain = a.propose_batch([3] * n, source[torch.from_numpy(pick)], pos, K, sa)
    grad_in = HiddenRows(tracked, pick) if picked else tracked[torch.from_numpy(pick)]
    assert b.propose_batch([3] * n, grad_in, pos, K, sb) == plain
    for p, states in ((a, sa), (b, sb)):
        for s in states:
            p.after_verify(0, s)
    pos = [q + 1 for q in pos]
    assert b.propose_batch([4] * n, hidden(8, n), pos, K, sb) == \
        a.propose_batch([4] * n, hidden(8, n), pos, K, sa)
    assert not b.chain_runner(K).backend.static_inputs["hidden"].requires_grad


BAD = {  # what is wrong -> (which argument, the bad value, the error type, words it names)
    "a row outside the source": ("catch", lambda s: HiddenRows(s, np.array([4], np.int64)),
                                 ProposerError, "row 0 picks source row 4, outside the source's 4"),
    "a negative row": ("catch", lambda s: HiddenRows(s, np.array([-1], np.int64)),
                       ProposerError, "picks source row -1"),
    "a row too many": ("catch", lambda s: HiddenRows(s, np.array([0, 1], np.int64)),
                       ProposerError, "picks 2 rows, the call has 1"),
    "float rows": ("catch", lambda s: HiddenRows(s, np.array([0.0])), ProposerError,
                   "step_batch catchup_hiddens: HiddenRows' rows must be a 1-D integer numpy "
                   "array"),
    "rows as a list": ("catch", lambda s: HiddenRows(s, [0]),  # type: ignore[arg-type]
                       ProposerError, "1-D integer numpy array, got list"),
    "a 1-D source": ("catch", lambda s: HiddenRows(s[0], np.array([0], np.int64)), ProposerError,
                     r"source must be a 2-D tensor \[rows, 32\], got a 1-D tensor \[32\]"),
    "a source of another width": ("catch", lambda s: HiddenRows(torch.zeros(4, CFG.hidden_size + 2),
                                                                np.array([0], np.int64)),
                                  HiddenWidthError, "hidden_in_size"),
    "propose rows a row short": ("hid", lambda s: HiddenRows(s, np.array([0, 1], np.int64)),
                                 ProposerError, "picks 2 rows, the call has 3"),
    "propose row outside": ("hid", lambda s: HiddenRows(s, np.array([0, 1, 9], np.int64)),
                            ProposerError, "^step_batch target_hiddens: HiddenRows' row 2 picks "
                            "source row 9"),
    "propose hiddens of another type": ("hid", lambda s: (s, np.arange(3)), ProposerError,
                                        "^step_batch target_hiddens: hiddens must be a tensor .* "
                                        "or HiddenRows, got tuple"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_pick_is_refused_with_nothing_changed(what):
    p, states, _, _ = _pair(3, {})
    pos = [p.last_pair_key(s) + 2 for s in states]
    p.propose_batch_on_device([3] * 3, hidden(7, 3), pos, K, states)
    drafts = p.last_drafts(states)
    source = hidden(9, 4)
    args = {"catch": HiddenRows(source, np.array([1], np.int64)),
            "hid": HiddenRows(source, np.array([0, 2, 3], np.int64))}
    where, bad, error, words = BAD[what]
    args[where] = bad(source)
    before = _snapshot(p, states)
    with pytest.raises(error, match=words):
        p.step_batch([1, 0, 0], [[drafts[0][0]], [], []], args["catch"], [3] * 3, args["hid"],
                     [q + 1 for q in pos], K, states)
    _unchanged(before, _snapshot(p, states))


def test_check_hidden_rows_names_the_call_and_admits_a_good_pick():
    with pytest.raises(ProposerError, match="rows must be integers, got a float64 array"):
        hidden_rows(hidden(1, 3), [0.7, 2.9])  # never truncated to rows 0 and 2
    with pytest.raises(ProposerError, match="rows must be a 1-D sequence of row indices, got 0-D"):
        hidden_rows(hidden(1, 3), 2)  # type: ignore[arg-type]
    h = hidden_rows(hidden(1, 3), [2, 0])
    assert check_hidden_rows(h, 2, CFG.hidden_size, "x") is h
    assert "source=[3, " in repr(h) and h.part(1, 2).rows.tolist() == [0]
    with pytest.raises(ProposerError, match="^my call: expected HiddenRows"):
        check_hidden_rows([hidden(1, 2)], 2, CFG.hidden_size, "my call")


class PickedStepLoop(StepLoop):
    """StepLoop whose step_batch takes both hiddens as HiddenRows of one source made once (the
    catch-up rows, then the targets), as the engine's device path gives them."""

    source = None

    def hiddens(self, accepted):
        n = len(self.states)
        if self.source is None:
            self.source = torch.cat([*self.catch, self.hid])
        rows = np.concatenate([np.arange(K * i, K * i + a, dtype=np.int64)
                               for i, a in enumerate(accepted)])
        return (HiddenRows(self.source, rows),
                HiddenRows(self.source, np.arange(K * n, K * n + n, dtype=np.int64)))


def test_the_picked_step_loop_is_the_host_loop():
    loops_agree("cpu", PickedStepLoop)


@cuda
def test_the_picked_step_loop_is_the_host_loop_on_cuda():
    """On the GPU the indices travel through the pinned mirror in a non_blocking copy: the
    gather reads them in stream order (a wrong order would draft from stale rows)."""
    loops_agree("cuda", PickedStepLoop)


@cuda
def test_a_picked_cuda_step_allocates_nothing_and_makes_no_host_sync():
    steady_cuda_steps(PickedStepLoop)


@cuda
def test_a_host_source_for_a_cuda_chain_drafts_what_the_tensors_draft():
    """HiddenRows of a CPU tensor for a CUDA proposer: index_select refuses the devices, the
    rows are gathered on the host and copied in (counted); the drafts are the tensors'."""
    n = 3
    opts = {"device": "cuda"}
    a, sa, b, sb = _pair(n, opts)
    pos = [a.last_pair_key(s) + 2 for s in sa]
    source, (pick,) = _packed([hidden(7, n)], 2)
    got_a = a.propose_batch_on_device([3] * n, hidden(7, n).cuda(), pos, K, sa)
    got_b = b.propose_batch_on_device([3] * n, HiddenRows(source, pick), pos, K, sb)
    assert torch.equal(got_a[0], got_b[0]) and torch.equal(got_a[1], got_b[1])
    assert b.staging.gather_fallbacks == 1
