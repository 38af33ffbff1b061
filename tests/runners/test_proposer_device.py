"""Device-resident batch drafts (issue 14 step 3): `propose_batch_on_device` returns the drafts
and confidences as device tensors (-1 after a row's stop) and leaves every state to settle on
the next call that touches it, one read for the whole batch."""
import pytest
import torch

from draft_circuit.runners.proposer_state import PendingBatch
from tests.runners.test_proposer import K, hidden, make, prefilled

FORWARDS = ["eager", "circuit"]


def batch(p, n=3, seed=30):
    states = [prefilled(p, seed + i, length=6 + i)[0] for i in range(n)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    return states, pos, [4 + i for i in range(n)], hidden(seed, n)


def kept(row):
    out = []
    for t in row:
        if t < 0:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("tau", [None, 0.2])
def test_device_drafts_equal_the_host_returned_drafts(forward, tau):
    host, dev = make(forward, draft_confidence_stop=tau), make(forward, draft_confidence_stop=tau)
    hs, pos, toks, h = batch(host)
    ds, _, _, _ = batch(dev)
    confs: list[list[float]] = []
    want = host.propose_batch(toks, h, pos, K, hs, out_conf=confs)
    drafts, conf = dev.propose_batch_on_device(toks, h, pos, K, ds)
    assert drafts.shape == (3, K) and drafts.dtype == torch.int32 and conf.dtype == torch.float32
    assert drafts.device == dev.states["k_cache"].device
    rows = drafts.tolist()
    assert [kept(r) for r in rows] == want
    for r, w in zip(rows, want):
        assert all(t == -1 for t in r[len(w):])  # -1 after a row's stop
    assert [c[:len(w)] for c, w in zip(conf.tolist(), want)] == confs
    assert dev.last_served == host.last_served
    # settled on first touch: the same rows, keys and drafts as the host path recorded
    assert [dev.drafter_rows(s) for s in ds] == [host.drafter_rows(s) for s in hs]
    assert [dev.last_pair_key(s) for s in ds] == [host.last_pair_key(s) for s in hs]
    assert [s.last_drafts for s in ds] == want
    for name in ("k_cache", "v_cache"):
        assert torch.equal(host.states[name], dev.states[name])


def touch_calls(p, s, others):
    """Each call that must settle a state first, as (name, fn(state) -> comparable)."""
    return {
        "drafter_rows": lambda: p.drafter_rows(s),
        "last_pair_key": lambda: p.last_pair_key(s),
        "after_verify": lambda: (p.after_verify(1, s), p.drafter_rows(s)),
        # fixed positions: reading s.rows here would see the unsettled count (as after a
        # deferred propose, a host asks the proposer, whose queries settle)
        "catchup_batch": lambda: p.catchup_batch([[7]], [hidden(8, 1)], [30], [s]),
        "propose": lambda: p.propose(3, hidden(9), 30, K, s),
        "propose_batch": lambda: p.propose_batch([3], hidden(9, 1), [30], K, [s]),
        "take_drafter_kv": lambda: p.take_drafter_kv(s),
    }


@pytest.mark.parametrize("call", ["drafter_rows", "last_pair_key", "after_verify",
                                  "catchup_batch", "propose", "propose_batch", "take_drafter_kv"])
def test_states_settle_whichever_call_touches_them_next(call):
    host, dev = make("circuit"), make("circuit")
    hs, pos, toks, h = batch(host)
    ds, _, _, _ = batch(dev)
    host.propose_batch(toks, h, pos, K, hs)
    dev.propose_batch_on_device(toks, h, pos, K, ds)
    assert all(isinstance(s.pending, PendingBatch) for s in ds)
    got = touch_calls(dev, ds[1], ds)[call]()
    want = touch_calls(host, hs[1], hs)[call]()
    assert got == want
    assert all(s.pending is None for s in ds)  # one touch settled the whole batch
    assert [s.rows for s in ds] == [s.rows for s in hs]
    assert [s.last_pair_key for s in ds] == [s.last_pair_key for s in hs]
    for name in ("k_cache", "v_cache"):
        assert torch.equal(host.states[name], dev.states[name])


def test_a_batch_settles_with_one_read(monkeypatch):
    p = make("circuit")
    states, pos, toks, h = batch(p)
    p.propose_batch_on_device(toks, h, pos, K, states)
    reads = []
    pending = states[0].pending
    real = pending.read
    monkeypatch.setattr(pending, "read", lambda d: reads.append(1) or real(d))
    for s in states:
        p.after_verify(0, s)
    assert len(reads) == 1


def test_the_next_device_batch_settles_the_previous_one_first():
    """Its buffers are reused: states of the first batch must not read the second's drafts."""
    host, dev = make("circuit"), make("circuit")
    a_h, pos_a, toks, h = batch(host, seed=30)
    b_h, pos_b, _, h2 = batch(host, seed=40)
    a_d, _, _, _ = batch(dev, seed=30)
    b_d, _, _, _ = batch(dev, seed=40)
    want_a = host.propose_batch(toks, h, pos_a, K, a_h)
    want_b = host.propose_batch(toks, h2, pos_b, K, b_h)
    dev.propose_batch_on_device(toks, h, pos_a, K, a_d)
    drafts_b, _ = dev.propose_batch_on_device(toks, h2, pos_b, K, b_d)
    assert [s.last_drafts for s in a_d] == want_a  # settled before the overwrite
    assert [kept(r) for r in drafts_b.tolist()] == want_b
    assert [dev.last_pair_key(s) for s in b_d] == [host.last_pair_key(s) for s in b_h]


def test_a_freed_state_is_not_recorded_by_its_batch():
    p = make("eager")
    states, pos, toks, h = batch(p)
    p.propose_batch_on_device(toks, h, pos, K, states)
    p.free_state(states[0])  # free settles first, then empties the state
    assert p.drafter_rows(states[0]) == 0 and states[0].last_drafts == []


def test_device_batch_refusals_match_propose_batch():
    p = make("eager")
    s, pos, toks, h = batch(p)
    assert p.propose_batch_on_device([], h[:0], [], K, []) is None
    assert p.last_served.kind == "refused"
    drafts, conf = p.propose_batch_on_device(toks, h, pos, 0, s)
    assert drafts.shape == (3, 0) and p.last_served.kind == "empty"
    assert all(st.last_num_drafted == 0 for st in s)


@pytest.mark.parametrize("tau", [None, 0.2])
def test_verify_tokens_are_each_rows_last_token_then_its_drafts(tau):
    p = make("circuit", draft_confidence_stop=tau)
    states, pos, toks, h = batch(p, n=4)
    drafts, _ = p.propose_batch_on_device(toks, h, pos, K, states)
    rows = drafts.tolist()
    verify = p.verify_tokens()
    assert verify.shape == (4 * (K + 1),) and verify.dtype == torch.int32
    want = [[t, *(max(d, 0) for d in r)] for t, r in zip(toks, rows)]  # a stop's -1 as 0
    assert verify.view(4, K + 1).tolist() == want
    if tau is not None:
        assert any(-1 in r for r in rows), "tau 0.2 should stop some row early here"
    assert p.last_drafts(states) == [kept(r) for r in rows]
    assert all(s.pending is None for s in states)  # last_drafts settled the batch


def test_last_drafts_of_a_foreign_state_is_empty():
    p, other = make("eager"), make("eager")
    states, pos, toks, h = batch(p, n=2)
    p.propose_batch(toks, h, pos, K, states)
    assert p.last_drafts([states[0], other.alloc_state()]) == [states[0].last_drafts, []]


def test_an_installed_kv_only_runner_serves_catch_up():
    """set_circuit_draft(kv_only=True): the host's KV-only runner writes catch-up rows (the
    host's one-step runner is not used for them), bitwise as the built one."""
    from draft_circuit.runners.chains import KV_ONLY_KEY, compile_chain
    mine, ref = make("circuit"), make("circuit")
    runner = compile_chain(mine.circuit_draft_kv_only(), mine.widths, device="cpu")
    mine.set_circuit_draft(runner, kv_only=True)
    assert mine.chains.kv_only() == (runner, True) and KV_ONLY_KEY in mine.chains.installed
    calls, real = [], runner.run
    runner.run = lambda n, inputs: calls.append(n) or real(n, inputs)
    a = [prefilled(mine, 50 + i, length=7)[0] for i in range(2)]
    b = [prefilled(ref, 50 + i, length=7)[0] for i in range(2)]
    assert calls == [6, 6]  # each prefill's 6 rows, on the installed runner
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], ref.states[name])
    assert [s.rows for s in a] == [s.rows for s in b]
    assert mine.chains.uninstall(KV_ONLY_KEY) is runner
    assert mine.chains.kv_only()[0] is not runner
