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
    real = p.staging.read
    monkeypatch.setattr(p.staging, "read", lambda d, c: reads.append(1) or real(d, c))
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
