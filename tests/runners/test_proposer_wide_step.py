"""The array paths of a decode step past SMALL_BATCH sequences (issue 14's host-work cuts: the
catch-up's one-chunk run and its one gather and scatter of the columns; the trims; a table
grown one block at a time) against the same calls made sequence by sequence: rows, pair keys,
block tables and the drafter pools are the same."""
import numpy as np
import pytest
import torch

from draft_circuit.runners.proposer_slots import SMALL_BATCH
from tests.runners.test_proposer import K, hidden, make, prefilled

N = SMALL_BATCH + 4


def _pair(**kw):
    opts = dict(num_blocks=8 * N + 8, max_blocks_per_seq=8, max_width=32, widths=(1, 2, 4, 8, 32))
    opts.update(kw)
    a, b = make("circuit", **opts), make("circuit", **opts)
    return (a, [prefilled(a, 40 + i, length=6 + i % 5)[0] for i in range(N)],
            b, [prefilled(b, 40 + i, length=6 + i % 5)[0] for i in range(N)])


def _same(a, sa, b, sb):
    assert [s.rows for s in sa] == [s.rows for s in sb]
    assert a.last_pair_keys(sa) == b.last_pair_keys(sb)
    assert [s.blocks.blocks for s in sa] == [s.blocks.blocks for s in sb]
    assert np.array_equal(a.slots.tables[[s.slot for s in sa]], b.slots.tables[[s.slot for s in sb]])
    for name in ("k_cache", "v_cache"):
        assert torch.equal(a.states[name], b.states[name]), name


@pytest.mark.parametrize("with_empty", [False, True])
def test_a_wide_catch_up_is_the_per_sequence_catch_up(with_empty):
    """N sequences of 0..4 rows each (none empty, or some): one catchup_batch, and catchup_batch
    of one sequence at a time, write the same rows at the same keys; steps repeat, so tables
    grow across block boundaries on the way."""
    a, sa, b, sb = _pair()
    for step in range(6):
        counts = [(i + step) % 5 if with_empty else 1 + (i + step) % 4 for i in range(N)]
        tokens = [[(3 * i + j + step) % 50 + 1 for j in range(c)] for i, c in enumerate(counts)]
        hiddens = [hidden(100 * step + i, c) if c else hidden(1, 1)[:0]
                   for i, c in enumerate(counts)]
        first = [s.rows + 1 for s in sa]
        assert a.catchup_batch(tokens, hiddens, first, sa) == sum(counts)
        for t, h, f, s in zip(tokens, hiddens, first, sb):
            b.catchup_batch([t], [h], [f], [s])
        _same(a, sa, b, sb)


def test_a_wide_decode_step_is_the_per_sequence_step():
    """propose_batch, after_verify_batch and catchup_batch over N states against propose,
    after_verify and catchup_batch state by state, several steps: the same drafts and rows."""
    a, sa, b, sb = _pair()
    for step in range(5):
        pos = [s.rows + 1 for s in sa]
        hid = hidden(7 + step, N)
        got = a.propose_batch([3] * N, hid, pos, K, sa)
        want = [b.propose(3, hid[i], pos[i], K, s) for i, s in enumerate(sb)]
        assert got == want
        accepted = [(i + step) % (K + 1) for i in range(N)]
        a.after_verify_batch(accepted, sa)
        for n, s in zip(accepted, sb):
            b.after_verify(n, s)
        keep = [i for i, n in enumerate(accepted) if n]
        tokens = [[5] * accepted[i] for i in keep]
        hiddens = [hidden(60 + i, accepted[i]) for i in keep]
        first = [pos[i] + 1 for i in keep]
        a.catchup_batch(tokens, hiddens, first, [sa[i] for i in keep])
        for t, h, f, i in zip(tokens, hiddens, first, keep):
            b.catchup_batch([t], [h], [f], [sb[i]])
        _same(a, sa, b, sb)


def test_a_catch_up_of_other_dtypes_or_devices_writes_the_same_rows(monkeypatch):
    """The catch-up's hiddens go into the buffer with one cat, which converts dtypes as the
    copy a segment did (float64 segments into the float32 buffer: the same rows); where cat
    refuses its segments (one on another device: simulated here, cat raising as it does for
    them) each segment is copied in, and the rows are the same again."""
    calls = []
    real = torch.cat
    refuse = [False]

    def cat(*args, **kwargs):
        if "out" in kwargs:  # the staging's (the programs' own concats write no out=)
            calls.append(len(args[0]))
            if refuse[0]:
                raise RuntimeError("Expected all tensors to be on the same device")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "cat", cat)
    a, sa, b, sb = _pair()
    for step in range(2):
        counts = [1 + (i + step) % 3 for i in range(N)]
        tokens = [[(i + j) % 40 + 1 for j in range(c)] for i, c in enumerate(counts)]
        hiddens = [hidden(200 + i + step, c) for i, c in enumerate(counts)]
        first = [s.rows + 1 for s in sa]
        refuse[0] = False
        b.catchup_batch(tokens, hiddens, first, sb)
        calls.clear()
        refuse[0] = step == 1
        a.catchup_batch(tokens, [h.double() for h in hiddens], first, sa)
        assert calls == [N]  # one cat (converting; refused at step 1)
        _same(a, sa, b, sb)
