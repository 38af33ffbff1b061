"""The proposer's per-step host shortcuts (issue 14 item 2) keep what they skip exact: a block
table grown in place writes only its new entries into the host table, and the staging rewrites
rows past n and active only when n differs from a mirror's latest fill. Each test holds the
state the shortcut relies on against the one a full rewrite gives."""
import random

import numpy as np
import pytest
import torch

from draft_circuit.runners.kv_cache import BlockPool, SequenceBlocks
from draft_circuit.runners.proposer_slots import SlotBlocks, SlotTable
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled

CFG_HIDDEN = CFG.hidden_size


class _Handle:
    pass


def _table_row_is_the_blocks(table, b):
    row = table.tables[b._slot]
    m = len(b.blocks)
    return row[:m].tolist() == list(b.blocks) and (row[m:] == table.scratch).all() \
        and table.capacity[b._slot] == m * b.block_size


def test_a_block_table_grown_in_place_mirrors_every_change():
    """ensure_rows (in place: only the new entries written), then release, take, install and
    free (new lists: the whole row), in a random order: the host row is the blocks, scratch past
    them, after every call."""
    rng = random.Random(3)
    table = SlotTable(max_blocks=6, max_drafts=K, scratch_block=0, slots=2)
    pool = BlockPool(200, reserved=1)
    handles = [_Handle() for _ in range(3)]
    blocks = [SlotBlocks(pool, 4, 6, table, table.alloc(h)) for h in handles]
    for _ in range(300):
        b = rng.choice(blocks)
        op = rng.randrange(5)
        if op <= 1:
            b.ensure_rows(rng.randint(0, 24))
        elif op == 2:
            b.set_rows(rng.randint(0, b.capacity_rows))
            b.release_unused()
        elif op == 3 and b.blocks:
            rows = b.num_rows
            taken, rows = b.take()
            assert _table_row_is_the_blocks(table, b)
            assert b.install(taken, rows)
        else:
            b.free()
        for other in blocks:
            assert _table_row_is_the_blocks(table, other)


def test_catch_up_rows_past_n_stay_neutral_as_n_grows_and_shrinks():
    """A catch-up's row count changes every step: the KV-only runner's buffers keep rows [:n]
    active and every row past n neutral through growing, shrinking and repeated widths (the
    staging skips what its latest fill left right), and the pools stay the oracle's."""
    mine, oracle = make("circuit", num_blocks=200, max_blocks_per_seq=12), \
        make("eager", num_blocks=200, max_blocks_per_seq=12)
    runner = mine.chains.kv_only()[0]
    pairs = [(prefilled(mine, 30 + i, length=9)[0], prefilled(oracle, 30 + i, length=9)[0])
             for i in range(4)]
    for step, counts in enumerate(([2, 1, 0, 3], [1, 0, 0, 0], [1, 0, 0, 0], [3, 3, 2, 1],
                                   [0, 2, 0, 0], [2, 2, 2, 2])):
        for p, states in ((mine, [a for a, _ in pairs]), (oracle, [b for _, b in pairs])):
            keys = p.last_pair_keys(states)
            p.catchup_batch([[7 + step] * c for c in counts],
                            [hidden(50 + step + i, c) if c else hidden(1, 1)[:0]
                             for i, c in enumerate(counts)],
                            [k + 2 for k in keys], states)
        n = sum(counts)
        static = runner.backend.static_inputs
        assert (static["active"][:n] == 1).all() and (static["active"][n:] == 0).all()
        assert (static["block_tables"][n:] == 0).all()
        for name in ("tokens", "positions", "live_rows"):
            assert (static[name][n:] == 0).all(), name
        assert (static["hidden"][n:runner.plan(n).parts[0][0]] == 0).all()
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], oracle.states[name])
    assert [mine.drafter_rows(a) for a, _ in pairs] == [oracle.drafter_rows(b) for _, b in pairs]
    assert np.array_equal(mine.slots.rows[[a.slot for a, _ in pairs]],
                          [oracle.drafter_rows(b) for _, b in pairs])


def _pool_and_tables(n, num_blocks=40):
    pool = BlockPool(num_blocks, reserved=1)
    tables = [SequenceBlocks(pool, 4, 5) for _ in range(n)]
    for i, t in enumerate(tables):  # some blocks held already, interleaved
        t.ensure_rows(4 * (i % 3))
        t.set_rows(4 * (i % 3))  # full: a rollback (release_unused) frees only what it grew
    return pool, tables


def test_ensure_rows_all_takes_the_ids_sequential_calls_take_and_refuses_the_same():
    """One pool draw for many tables gives each the ids a call a table gives (lowest first, in
    order); a table past its max_blocks or a pool too small raises the error the sequential
    calls raise at the first refusal, with every table and the pool as they were."""
    from draft_circuit.runners.kv_cache import PoolExhausted, TableTooLong, ensure_rows_all
    rows = [5, 0, 13, 9, 20, 3]
    pool_a, a = _pool_and_tables(6)
    pool_b, b = _pool_and_tables(6)
    ensure_rows_all(a, rows)
    for t, r in zip(b, rows):
        t.ensure_rows(r)
    assert [t.blocks for t in a] == [t.blocks for t in b] and pool_a.num_free == pool_b.num_free
    for bad, error in (([5, 0, 21, 9], TableTooLong), ([20, 20, 20, 20, 20, 20], PoolExhausted)):
        pool, tables = _pool_and_tables(6, num_blocks=20)
        before, free = [t.blocks for t in tables], pool.num_free
        seq_pool, seq = _pool_and_tables(6, num_blocks=20)
        with pytest.raises(error) as want:
            for t, r in zip(seq, bad):
                t.ensure_rows(r)
        with pytest.raises(error) as got:
            ensure_rows_all(tables, bad)
        assert str(got.value) == str(want.value)
        assert [t.blocks for t in tables] == before and pool.num_free == free


@pytest.mark.parametrize("stops", [False, True])
def test_a_large_batchs_record_is_the_small_batchs_rule(stops):
    """SlotTable.record past SMALL_BATCH (its no-stop shortcut, and the array rule when a row
    stopped) leaves the columns and drafts the per-row rule leaves (rows recorded a few at a
    time, the small path), with keys and flags set as they were before."""
    from draft_circuit.runners.proposer_slots import SMALL_BATCH
    rng = np.random.default_rng(7)
    n, k = SMALL_BATCH + 9, 4
    big, small = (SlotTable(max_blocks=4, max_drafts=k, scratch_block=0, slots=n) for _ in "ab")
    handles = [_Handle() for _ in range(2 * n)]
    slots = np.array([big.alloc(h) for h in handles[:n]], dtype=np.intp)
    assert [small.alloc(h) for h in handles[n:]] == slots.tolist()
    big.cols[slots] = rng.integers(0, 9, (n, big.cols.shape[1]))
    big.has_key[slots], big.awaiting[slots] = rng.integers(0, 2, n), rng.integers(0, 2, n)  # flags
    small.cols[slots] = big.cols[slots]
    drafts = rng.integers(0, 90, (n, k))
    if stops:
        drafts[::3, rng.integers(0, k)] = -1
    before, positions = rng.integers(0, 30, n), rng.integers(1, 50, n).tolist()
    kept = big.record(slots, drafts, before, positions)
    want = []
    for lo in range(0, n, 4):
        want += small.record(slots[lo:lo + 4], drafts[lo:lo + 4], before[lo:lo + 4],
                             positions[lo:lo + 4])
    assert kept == want
    assert np.array_equal(big.cols, small.cols) and np.array_equal(big.drafts, small.drafts)


def test_rows_past_n_are_zeroed_in_the_hiddens_own_copy_where_numpy_cannot():
    """bfloat16 hiddens (no numpy view): the staging zeroes the rows a wider catch-up left in
    the same cat as the rows' copy (issue 14: one launch, not a copy and a fill). The KV-only
    runner's hidden buffer holds exactly the rows given, cast, and zeros past them up to the
    padded width, through growing and shrinking counts (one segment and several); the KV
    rows are the full one-step chain's at the same dtype (the eager oracle)."""
    from draft_circuit.circuit.layers.mtp import MtpHead
    from draft_circuit.runners.proposer import MtpProposer
    from draft_circuit.runners.testing import random_mtp_weights
    from tests.runners.test_proposer import CFG

    def bf16(forward):
        head = MtpHead(CFG, "bfloat16")
        return MtpProposer(head, head.bind(random_mtp_weights(CFG, seed=11, dtype=torch.bfloat16)),
                           num_drafts=K, num_blocks=200, block_size=8, max_blocks_per_seq=12,
                           max_width=8, widths=(1, 2, 4, 8), forward=forward)
    mine, oracle = bf16("circuit"), bf16("eager")
    runner = mine.chains.kv_only()[0]
    region = mine.staging._region(runner)
    assert region.runner is runner and region.zeros is not None  # the cat path is the one run
    pairs = [(mine.alloc_state(), oracle.alloc_state()) for _ in range(4)]
    for step, counts in enumerate(([3, 3, 2, 1], [1, 0, 0, 0], [2, 1, 0, 3], [0, 2, 0, 0],
                                   [4, 4, 4, 4], [0, 0, 1, 0])):
        given = [hidden(70 + step + i, c) if c else hidden(1, 1)[:0] for i, c in enumerate(counts)]
        for p, states in ((mine, [a for a, _ in pairs]), (oracle, [b for _, b in pairs])):
            keys = [k if k is not None else -1 for k in p.last_pair_keys(states)]
            p.catchup_batch([[7 + step] * c for c in counts], given, [k + 2 for k in keys],
                            states)
        n = sum(counts)
        buf = runner.backend.static_inputs["hidden"]
        want = torch.cat(given).to(torch.bfloat16)
        assert torch.equal(buf[:n], want)
        assert (buf[n:runner.plan(n).parts[0][0]] == 0).all()
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], oracle.states[name])


def test_every_widths_views_are_made_at_construction():
    """A catch-up's row count changes every step: the staged buffers, hidden rows and device
    batch views of every width are made when the proposer is built (staging.warm), so no
    step makes one (a first-met width cost tens of microseconds for the first hundreds of
    steps)."""
    p = make("circuit", num_blocks=200, max_blocks_per_seq=12)
    chain, kv = p.chain_runner(), p.chains.kv_only()[0]
    made = {id(r): (set(r._staged), set(p.staging._region(r).hidden_rows)) for r in (chain, kv)}
    for r in (chain, kv):
        region = p.staging._region(r)
        assert set(r._staged) == {n for n in r.widths if n <= region.width}
        assert set(region.hidden_rows) == set(range(1, region.width + 1))
    views = len(p.device_drafts._shapes)
    states = [prefilled(p, 40 + i, length=9)[0] for i in range(4)]
    for step, counts in enumerate(([3, 1, 0, 2], [4, 4, 4, 4], [1, 0, 0, 0])):
        keys = p.last_pair_keys(states)
        p.propose_batch_on_device([5] * 4, hidden(9, 4), [k + 2 for k in keys], K, states)
        p.last_drafts(states)
        p.after_verify_batch([0] * 4, states)
        keys = p.last_pair_keys(states)
        p.catchup_batch([[7] * c for c in counts],
                        [hidden(60 + i, c) if c else hidden(1, 1)[:0] for i, c in enumerate(counts)],
                        [k + 2 for k in keys], states)
    for r in (chain, kv):
        assert (set(r._staged), set(p.staging._region(r).hidden_rows)) == made[id(r)]
    assert len(p.device_drafts._shapes) == views


def test_a_batch_read_settles_a_deferred_propose_made_after_its_state_left_the_batch():
    """settle_held's shortcut (the latest device batch's own states settle with it, when every
    one still holds it) next to a state that left the batch: handed over and back (which
    settles the batch), then proposed alone with its drafts deferred, the batch's states read
    together give that state its deferred drafts, and nothing stays pending."""
    p = make("circuit", num_blocks=200, max_blocks_per_seq=12)
    states = [prefilled(p, 80 + i, length=9)[0] for i in range(3)]
    keys = p.last_pair_keys(states)
    assert p.propose_batch_on_device([5] * 3, hidden(3, 3), [k + 2 for k in keys], K, states)
    s = states[1]
    blocks, rows, key = p.take_drafter_kv(s)
    assert p.install_drafter_kv(s, blocks, rows, key)
    embed = torch.zeros(CFG_HIDDEN)
    deferred = p.propose(6, hidden(4), key + 2, K, s, embed_target=embed)
    want = [int(t) for t in deferred.tolist() if t >= 0]
    want = want[:next((i for i, t in enumerate(deferred.tolist()) if t < 0), len(want))]
    got = p.last_drafts(states)
    assert p.slots.num_pending == 0
    assert got[1] == want and s.last_drafts == want
