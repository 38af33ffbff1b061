"""`step_ahead`, the draft side launched before the host reads its verify (issues 20, 14),
against the read-first path it stands for (read the verify, accept on the host, `step_batch`):
over several decode steps at exact, padded and split widths, n = 1 and past SMALL_BATCH, the
same next verify input, the same drafts and confidences, the same rows and keys once settled,
and the same drafter K/V at every row a state holds (rows past them may differ: the rejected
drafts' catch-up rows, never read). Its refusals change nothing; bad tensors are named."""
import numpy as np
import pytest
import torch

from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.accept_counts import accept_counts
from draft_circuit.runners.proposer_state import MtpProposerState, ProposerError
from draft_circuit.runners.testing import cuda
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled
from tests.runners.test_proposer_step import CASES, IDS


def _pair(n, opts, **kw):
    a, b = make("circuit", **opts, **kw), make("circuit", **opts, **kw)
    return (a, [prefilled(a, 40 + i, length=6 + i % 5)[0] for i in range(n)],
            b, [prefilled(b, 40 + i, length=6 + i % 5)[0] for i in range(n)])


def _kv(p, s, name):
    """A state's drafter cache rows [rows, ...] in row order, through its own table."""
    return torch.stack([p.states[name][b, o] for b, o in (s.blocks.slot(r) for r in range(s.rows))])


def _same_valid(a, sa, b, sb):
    """Rows, keys, drafts and the K/V of every row each state holds alike (block ids and the
    pool's use may differ: step_ahead grows for the worst case)."""
    assert [a.drafter_rows(s) for s in sa] == [b.drafter_rows(s) for s in sb]
    assert a.last_pair_keys(sa) == b.last_pair_keys(sb)
    assert a.last_drafts(sa) == b.last_drafts(sb)
    for x, y in zip(sa, sb):
        for name in ("k_cache", "v_cache"):
            assert torch.equal(_kv(a, x, name), _kv(b, y, name)), name


def _greedy(drafts, step, n):
    """A verify's greedy tokens [n * (K + 1)] accepting a spread of counts: row i's first a_i
    drafts, then a token that differs from its next draft (the bonus), then anything."""
    g = torch.Generator().manual_seed(500 + step)
    out = torch.randint(0, CFG.vocab_size, (n, K + 1), generator=g, dtype=torch.int32)
    accepted = []
    for i, d in enumerate(drafts):
        a = min((3 * i + step) % (K + 1), len(d))
        out[i, :a] = torch.tensor(d[:a], dtype=torch.int32)
        if a < len(d) and out[i, a] == d[a]:
            out[i, a] = (d[a] + 1) % CFG.vocab_size
        accepted.append(a)
    return out.view(-1), accepted


def read_first_step(a, sa, drafts, greedy, accepted, verify_hidden, pos):
    """The read-first path of one decode step on `a`: accept on the host (the verify's greedy
    tokens [n * (K + 1)] read), then one step_batch; returns the positions after it."""
    n, k1 = len(sa), K + 1
    starts = [i * k1 for i in range(n)]
    rows = np.array([r for i, c in enumerate(accepted) for r in range(starts[i], starts[i] + c)],
                    dtype=np.int64)
    greedy2 = greedy.view(n, k1).tolist()  # (the read-first path's read)
    last = [greedy2[i][c] for i, c in enumerate(accepted)]
    first = [p + 1 for p in pos]
    pos = [p + c + 1 for p, c in zip(pos, accepted)]
    assert a.step_batch(accepted, [d[:c] for d, c in zip(drafts, accepted)],
                        HiddenRows(verify_hidden, rows), last,
                        HiddenRows(verify_hidden, np.array([s + c for s, c in zip(starts, accepted)])),
                        pos, K, sa, catchup_first=first) is not None
    return pos


def _loop(n, opts, steps=5, fused=None, **kw):
    """`a` reads each verify and steps with step_batch; `b` steps ahead (`fused`: its accept and
    shifts in the one kernel, True, or as torch ops, False; None: as its device picks). Yields
    after each step."""
    a, sa, b, sb = _pair(n, opts, **kw)
    if fused is not None:
        b.device_drafts.counts.fused = fused
    dev = opts.get("device", "cpu")
    pos = [a.last_pair_key(s) + 2 for s in sa]
    last = [(5 + i) % CFG.vocab_size for i in range(n)]
    a.propose_batch_on_device(last, hidden(7, n).to(dev), pos, K, sa)
    b.propose_batch_on_device(last, hidden(7, n).to(dev), pos, K, sb)
    k1 = K + 1
    for step in range(steps):
        assert torch.equal(a.verify_tokens(), b.verify_tokens())
        verify_hidden = hidden(300 + step, n * k1).to(dev)
        # the target's verify of the drafts, synthesized: greedy and hiddens on the device
        drafts = a.last_drafts(sa)
        greedy, accepted = _greedy(drafts, step, n)
        greedy = greedy.to(dev)
        got = b.step_ahead(greedy, verify_hidden, K, sb)
        assert got is not None, b.last_served
        assert got[0] == drafts and got[1] is b.verify_tokens()
        pos = read_first_step(a, sa, drafts, greedy, accepted, verify_hidden, pos)
        assert a.last_served == b.last_served
        # before either reads: the next verify input alike (tokens from the device counts)
        assert torch.equal(a.verify_tokens(), b.verify_tokens())
        assert torch.equal(a.device_drafts.drafts(n, K), b.device_drafts.drafts(n, K))
        assert torch.equal(a.device_drafts.confidences(n, K), b.device_drafts.confidences(n, K))
        yield a, sa, b, sb
        _same_valid(a, sa, b, sb)


@pytest.mark.parametrize("n,opts", CASES, ids=IDS)
def test_ahead_is_the_read_first_step(n, opts):
    for _ in _loop(n, opts):
        pass


@pytest.mark.parametrize("n", [1, 5])
def test_the_one_kernel_advance_is_the_read_first_step(n):
    """The GPU's path (kernels/accept_advance.py: counts, token, position, live rows and hidden
    index in one launch) run here under the Triton interpreter: the read-first path's bits,
    with a spread of accepted counts and a confidence stop."""
    for _ in _loop(n, {}, steps=3, fused=True, draft_confidence_stop=0.02):
        pass


def test_ahead_with_a_confidence_stop():
    """Rows that stop early (fewer kept drafts; -1 after the stop is never accepted, whatever
    the verify's row holds): still the read-first path's rows, keys and K/V."""
    for _ in _loop(5, {}, draft_confidence_stop=0.02):
        pass


def test_a_state_settles_from_the_counts_whichever_call_touches_it():
    """After a step ahead, a single-state call (last_pair_key) settles the whole batch from the
    device counts, as a batch read would; a freed state drops out of it."""
    for a, sa, b, sb in _loop(4, {}, steps=2):
        b.free_state(sb[3])
        a.free_state(sa[3])
        del sa[3], sb[3]
        assert b.last_pair_key(sb[0]) == a.last_pair_key(sa[0])
        break
    _same_valid(a, sa, b, sb)


@cuda
def test_ahead_is_the_read_first_step_on_cuda():
    """On the GPU the counts, the shifted inputs and the gather run in stream order behind the
    verify's tensors (a wrong order would draft from stale rows): the read-first path's bits."""
    for _ in _loop(5, {"device": "cuda", "num_blocks": 200, "max_blocks_per_seq": 20}):
        pass


@cuda
def test_a_cuda_step_ahead_runs_the_one_kernel_and_the_torch_ops_alike():
    """On the GPU the proposer picks the one-launch kernel; forced to the torch ops it drafts
    the same bits (both against the read-first path)."""
    opts = {"device": "cuda", "num_blocks": 200, "max_blocks_per_seq": 20}
    for fused in (None, False):
        for a, sa, b, sb in _loop(3, opts, steps=3, fused=fused):
            assert b.device_drafts.counts.fused is (fused is None)


@cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["launched", "replayed"])
def test_a_cuda_step_ahead_allocates_nothing_and_makes_no_host_sync(graphs):
    """Warm steps allocate no device memory, then run under torch's sync debug mode "error"
    (the previous batch read first: step_ahead itself enqueues everything and reads nothing);
    `replayed`: with the per-step launches captured at their second use and replayed after
    (runners/launch_graphs.py)."""
    from draft_circuit.runners.launch_graphs import LaunchGraphs
    from draft_circuit.runners.testing import assert_no_allocation
    from tests.runners.test_proposer_device_cuda import _sync_mode
    n = 4
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    dev = p.device_drafts
    # launched: never captured here (the default captures at a key's 9th use, which would fall
    # inside the measured steps); replayed: captured at the second use
    dev.graphs = LaunchGraphs(dev.device, after=1 if graphs else 10**9)
    dev.counts.graphs = LaunchGraphs(dev.device, after=1 if graphs else 10**9)
    states = [prefilled(p, 40 + i, length=7)[0] for i in range(n)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    assert p.propose_batch_on_device([3] * n, hidden(7, n).cuda(), pos, K, states) is not None
    verify_hidden = hidden(9, n * (K + 1)).cuda()
    greedy = torch.zeros(n * (K + 1), dtype=torch.int32, device="cuda")

    def step(no_sync=False):
        p.last_drafts(states)  # the previous batch's read (the step's one sync)
        with _sync_mode(no_sync):
            assert p.step_ahead(greedy, verify_hidden, K, states) is not None
    for _ in range(3):  # warm: views and scratch made once a shape (graphs: seen, captured)
        step()
    assert (dev.graphs.captured, dev.counts.graphs.captured) == ((1, 1) if graphs else (0, 0))
    assert_no_allocation(step, repeats=4)
    torch.cuda.synchronize()
    for _ in range(3):
        step(no_sync=True)


def test_accept_counts_is_the_host_rule():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    greedy = torch.tensor([[1, 2, 3, 9], [1, 5, 3, 9], [4, -1, 0, 0], [-1, 0, 0, 0]],
                          dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int64)
    assert accept_counts(drafts, greedy, out).tolist() == [3, 1, 1, 0]


def _ready(n=3, **kw):
    """A proposer with a device-resident batch of n states awaiting its verify."""
    p = make("circuit", **kw)
    states = [prefilled(p, 40 + i, length=7)[0] for i in range(n)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    p.propose_batch_on_device([3] * n, hidden(7, n), pos, K, states)
    return p, states


def _snapshot(p, states):
    return ([p.drafter_rows(s) for s in states], p.last_pair_keys(states),
            [list(s.blocks.blocks) for s in states], p.pool.num_used,
            p.states["k_cache"].clone())


@pytest.mark.parametrize("case,reason", [
    ("not_the_batch", "not the latest"), ("reordered", "not the latest"),
    ("kv_inexact", "kv_exact off"), ("other_k", "drafted 3 a row"),
    # a host-path propose after the device batch: its drafts, not the batch's, await the verify
    ("replaced", "a later propose replaced"),
    # a batch proposed at a position past its rows + 1 (the shifts assume rows = position - 1)
    ("lagging", "other rows than its position - 1"),
    # one usable block: the worst case (every draft accepted) needs another
    ("pool", "pool lacks"),
])
def test_refusals_change_nothing(case, reason):
    kw = {"kv_exact": False} if case == "kv_inexact" else {}
    if case == "pool":
        kw = {"num_blocks": 2, "block_size": 8}
    n = 1 if case == "pool" else 3
    p = make("circuit", **kw)
    states = [prefilled(p, 40 + i, length=4 if case == "pool" else 7)[0] for i in range(n)]
    pos = [p.last_pair_key(s) + (3 if case == "lagging" else 2) for s in states]
    p.propose_batch_on_device([3] * n, hidden(7, n), pos, K, states)
    if case == "replaced":
        p.after_verify_batch([0] * n, states)
        p.propose_batch([4] * n, hidden(8, n), [q + 1 for q in pos], K, states)
    before = _snapshot(p, states)
    greedy = torch.zeros(n * (K + 1), dtype=torch.int32)
    hid = hidden(9, n * (K + 1))
    if case == "not_the_batch":
        got = p.step_ahead(greedy[:2 * (K + 1)], hid, K, states[:2])
    elif case == "reordered":
        got = p.step_ahead(greedy, hid, K, states[::-1])
    elif case == "other_k":
        got = p.step_ahead(greedy[:n * K], hid, K - 1, states)
    else:
        got = p.step_ahead(greedy, hid, K, states)
    assert got is None and p.last_served.kind == "refused"
    assert reason in p.last_served.reason
    after = _snapshot(p, states)
    assert after[:4] == before[:4] and torch.equal(after[4], before[4])


@pytest.mark.parametrize("where", ["run", "staging"])
def test_a_propose_that_raises_leaves_the_read_first_state(where):
    """The k-step chain raising after the trims and the catch-up (in its run, or in its staging,
    before the advance computed the counts: then they are computed alone): the states settle
    to the rows the target accepted (the device counts, read at once), release the worst
    case's blocks past them, and hold nothing pending: what a read-first step whose propose
    raised leaves."""
    def boom(p):
        owner = p.chain_runner() if where == "run" else p.staging
        name = "run" if where == "run" else "inputs"
        real = getattr(owner, name)

        def fail(*args, **kw):
            if where == "staging" and args[6] is not p.chain_runner():
                return real(*args, **kw)  # (the catch-up's staging: not the propose's)
            setattr(owner, name, real)
            raise RuntimeError("chain down")
        setattr(owner, name, fail)

    def ready():
        p = make("circuit")
        s = prefilled(p, 40, length=7)[0]
        pos = p.last_pair_key(s) + 2
        p.propose_batch_on_device([5], hidden(7, 1), [pos], K, [s])
        return p, s, pos
    vh = hidden(300, K + 1)
    got = []
    for ahead in (True, False):
        p, s, pos = ready()
        d = p.last_drafts([s])[0]
        greedy = torch.tensor([d[0], (d[1] + 1) % CFG.vocab_size, 0, 0], dtype=torch.int32)  # a = 1
        boom(p)
        with pytest.raises(RuntimeError, match="chain down"):
            if ahead:
                p.step_ahead(greedy, vh, K, [s])
            else:
                p.step_batch([1], [[d[0]]], HiddenRows(vh, np.array([0])), [int(greedy[1])],
                             HiddenRows(vh, np.array([1])), [pos + 2], K, [s],
                             catchup_first=[pos + 1])
        got.append((p.drafter_rows(s), p.last_pair_key(s), s.awaiting_verify, s.pending,
                    list(s.blocks.blocks), int(p.slots.capacity[s.slot]), _kv(p, s, "k_cache")))
    (*a, ka), (*b, kb) = got
    assert a == b and torch.equal(ka, kb)


def test_a_handover_before_the_settle_settles_first():
    """take_drafter_kv between step_ahead and its settle: the batch settles from the counts
    first, so the rows handed out (and back in) are the target's."""
    for a, sa, b, sb in _loop(3, {}, steps=2):
        for p, states in ((a, sa), (b, sb)):
            blocks, rows, key = p.take_drafter_kv(states[1])
            assert p.install_drafter_kv(states[1], blocks, rows, key)
        break
    _same_valid(a, sa, b, sb)


@pytest.mark.parametrize("bad,match", [
    (lambda g, h: (g.long(), h), "step_ahead greedy: expected the verify's int32"),
    (lambda g, h: (g[:-1], h), r"step_ahead greedy: .*\[16\]"),
    (lambda g, h: (g, h[:3]), r"step_ahead hiddens: expected the verify's hiddens"),
    (lambda g, h: (g, h.double()), "step_ahead hiddens: torch.float64"),
    (lambda g, h: (g, h[:, :5]), "head reads"),
    (lambda g, h: (g.view(4, -1), h), r"got torch.int32 \[4, 4\]"),
])
def test_bad_tensors_are_named_and_change_nothing(bad, match):
    """(A bad draft count too: test_a_bad_count_is_named.)"""
    p, states = _ready(n=4)
    before = _snapshot(p, states)
    greedy, hid = bad(torch.zeros(16, dtype=torch.int32), hidden(9, 16))
    with pytest.raises(ProposerError, match=match):
        p.step_ahead(greedy, hid, K, states)
    after = _snapshot(p, states)
    assert after[:4] == before[:4] and torch.equal(after[4], before[4])


@pytest.mark.parametrize("k", ["3", None, True, 9, -1])
def test_a_bad_count_is_named(k):
    p, states = _ready(n=2)
    before = _snapshot(p, states)
    with pytest.raises(ProposerError, match="num_drafts"):
        p.step_ahead(torch.zeros(8, dtype=torch.int32), hidden(9, 8), k, states)
    after = _snapshot(p, states)
    assert after[:4] == before[:4] and torch.equal(after[4], before[4])


def test_the_warm_up_runs_every_op_and_leaves_the_scratch():
    """`AcceptCounts.warm` (the proposer calls it on a GPU, where a kernel's first launch loads
    its module) runs on any device and leaves a scratch a width, so a step allocates none."""
    from draft_circuit.runners.accept_counts import AcceptCounts
    counts = AcceptCounts(4, torch.device("cpu"))
    counts.warm(4, K)
    assert set(counts._scratch) == {(n, K) for n in range(1, 5)}
    assert counts.read(4).tolist() == [0, 0, 0, 0]


def test_the_warm_up_leaves_a_pending_batchs_counts():
    """`AcceptCounts.warm` runs on a scratch instance: counts an advance computed and a batch
    has not settled from yet are what the warm-up found (a host may warm a proposer again)."""
    from draft_circuit.runners.accept_counts import AcceptCounts
    counts = AcceptCounts(3, torch.device("cpu"))
    drafts = torch.tensor([[4, 5, 6], [7, -1, -1], [1, 2, 3]], dtype=torch.int32)
    greedy = torch.tensor([[4, 5, 0, 0], [7, 9, 9, 9], [1, 2, 3, 8]], dtype=torch.int32)
    rows = torch.zeros((3, 3), dtype=torch.int32)
    counts.advance(drafts, greedy).apply(rows[0], rows[1], rows[2], torch.zeros(3, dtype=torch.int64))
    counts.warm(3, 3)
    assert counts.read(3).tolist() == [2, 1, 3]



NARROWED = [(3, (1,), {}), (3, (0,), {}), (3, (2,), {}), (4, (0, 2), {}),
            (20, (3, 11, 19), {"num_blocks": 8 * 20 + 8, "max_blocks_per_seq": 8,
                               "max_width": 32, "widths": (1, 2, 4, 8, 32)})]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n,freed,opts", NARROWED,
                         ids=[f"n{n}-free{'_'.join(map(str, f))}" for n, f, _ in NARROWED])
def test_a_batch_narrowed_by_finishes_steps_ahead(n, freed, opts, fused):
    """A device batch drafted for n states, some of them then freed (sequences that finished):
    freeing settles nothing (the batch stays pending for the rest, `PendingBatch.dropped`), and
    step_ahead serves the rest, in order, against their rows of the verify: the read-first
    path's next verify input, drafts and confidences, and afterwards the same rows, keys and
    K/V, over the steps after it. (`fused`: the GPU's one-kernel advance, interpreted.)"""
    a, sa, b, sb = _pair(n, opts)
    b.device_drafts.counts.fused = fused
    pos = [a.last_pair_key(s) + 2 for s in sa]
    last = [(5 + i) % CFG.vocab_size for i in range(n)]
    a.propose_batch_on_device(last, hidden(7, n), pos, K, sa)
    b.propose_batch_on_device(last, hidden(7, n), pos, K, sb)
    for i in freed:
        a.free_state(sa[i])
        b.free_state(sb[i])
    batch = b.device_drafts.batch
    assert batch is not None and not batch.done and batch.dropped == len(freed)
    keep = [i for i in range(n) if i not in freed]
    sa, sb, pos = [sa[i] for i in keep], [sb[i] for i in keep], [pos[i] for i in keep]
    m, k1 = len(keep), K + 1
    for step in range(3):
        verify_hidden = hidden(300 + step, m * k1)
        drafts = a.last_drafts(sa)
        greedy, accepted = _greedy(drafts, step, m)
        got = b.step_ahead(greedy, verify_hidden, K, sb)
        assert got is not None, b.last_served
        assert got[0] == drafts and got[1] is b.verify_tokens()
        # the new batch keeps the slots array the states' lookup gives (`slots_of`'s), so its
        # settle takes the fast path (`_latest_batch` finds it by identity)
        assert b.device_drafts.batch.slots is b.slots.slots_of(sb, MtpProposerState)
        pos = read_first_step(a, sa, drafts, greedy, accepted, verify_hidden, pos)
        assert torch.equal(a.verify_tokens(), b.verify_tokens())
        assert torch.equal(a.device_drafts.drafts(m, K), b.device_drafts.drafts(m, K))
        assert torch.equal(a.device_drafts.confidences(m, K), b.device_drafts.confidences(m, K))
        _same_valid(a, sa, b, sb)


def test_a_subset_of_a_batch_still_pending_is_refused():
    """Leaving out a state that still waits on the batch (not freed) is not a narrowed batch:
    refused before anything is read, the batch still pending for all."""
    p, states = _ready(3)
    greedy = torch.zeros(2 * (K + 1), dtype=torch.int32)
    got = p.step_ahead(greedy, hidden(9, 2 * (K + 1)), K, states[:2])
    assert got is None and "not the latest" in p.last_served.reason
    batch = p.device_drafts.batch
    assert batch is not None and not batch.done and p.slots.num_pending == 3
    p.free_state(states[1])  # freed, not the one left out: still not the batch's rest
    assert p.step_ahead(greedy, hidden(9, 2 * (K + 1)), K, states[:2]) is None
    assert not batch.done


def test_freeing_settles_a_batch_only_with_its_last_state():
    """free_state leaves a device batch pending while any of its states still waits on it (the
    rest's drafts stay for their verify; no wait on its chain) and settles it with the last one
    (nothing to record: its input guards' records are read then, FAULTS 25)."""
    p, states = _ready(3)
    batch = p.device_drafts.batch
    assert batch is not None
    for i, s in enumerate(states):
        p.free_state(s)
        assert batch.dropped == i + 1 and batch.done == (i == 2)
        assert p.slots.num_pending == 2 - i
