"""The reference's rules (issue 13, rules 1-8), one test each on both forwards, with expected
values written from the rule (literal tables, or the K a row must hold at the RoPE position the
rule names, from the ops' references), never read back from the code under test."""
import inspect
import math

import pytest
import torch

from draft_circuit.ops.attention import TokenError
from draft_circuit.runners.contract import DraftProposer
from draft_circuit.runners.kv_cache import TableTooLong
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.proposer_state import ProposerError, key_after_verify, rows_to_trim
from proposer_model import expected_k
from test_proposer import CFG, FORWARDS, hidden, make, prefilled, seq_kv

# rows trimmed for a = 0..K accepted (rule 1): exact KV d - 1; otherwise
# min(max(d - a, 0) + (max(a - 1, 0) if refeed else 0), d), d = max(last_num_drafted, 1)
TRIMS = {(3, True, False): [2, 2, 2, 2], (3, True, True): [2, 2, 2, 2],
         (3, False, False): [3, 2, 1, 0], (3, False, True): [3, 2, 2, 2],
         (4, True, False): [3, 3, 3, 3, 3], (4, False, False): [4, 3, 2, 1, 0],
         (4, False, True): [4, 3, 3, 3, 3]}
AFTER_ONE_DRAFT_STOP = {(True, False): [0, 0], (False, False): [1, 0], (False, True): [1, 0]}


def state_snapshot(p: MtpProposer, states) -> tuple:
    """Everything a refused call must leave as it was: pool, rows, keys, every KV byte."""
    return (p.pool.num_free, [(s.rows, s.last_pair_key, s.blocks.blocks) for s in states],
            p.states["k_cache"].clone(), p.states["v_cache"].clone())


def assert_unchanged(p, states, before) -> None:
    free, per, k, v = before
    assert p.pool.num_free == free
    assert [(s.rows, s.last_pair_key, s.blocks.blocks) for s in states] == per
    assert torch.equal(p.states["k_cache"], k) and torch.equal(p.states["v_cache"], v)


def test_rows_to_trim_is_the_rule():
    assert rows_to_trim(2, 0, kv_exact=False, refeed=False) == 2
    assert rows_to_trim(2, 1, kv_exact=False, refeed=False) == 1
    assert rows_to_trim(3, 3, kv_exact=False, refeed=True) == 2
    assert rows_to_trim(0, 0, kv_exact=False, refeed=False) == 1  # d = max(0, 1)
    assert rows_to_trim(0, 0, kv_exact=True, refeed=False) == 0
    for (k, exact, refeed), want in TRIMS.items():
        assert [rows_to_trim(k, a, kv_exact=exact, refeed=refeed) for a in range(k + 1)] == want


# ---- rule 1: the trim after verify, through the proposer ----
@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("k", [3, 4])
def test_after_verify_trims_by_the_rule(forward, k):
    p = make(forward, num_drafts=k)
    for (kk, exact, refeed), want in TRIMS.items():
        if kk != k:
            continue
        p.kv_exact, p.refeed = exact, refeed
        for accepted, trim in enumerate(want):
            s, _ = prefilled(p, 12)        # 10 rows at RoPE 1..10, key 9
            assert len(p.propose(3, hidden(13), 11, k, s)) == k
            p.after_verify(accepted, s)
            assert p.drafter_rows(s) == 10 + k - trim, (exact, refeed, accepted)
            assert p.last_pair_key(s) == 9 + k - trim
            # the key a host can find before the call that trims (step_batch's catch-up rows)
            assert key_after_verify(11, k, accepted, kv_exact=exact, refeed=refeed) == 9 + k - trim
            p.after_verify(0, s)           # kept departure: a second call trims nothing
            assert p.drafter_rows(s) == 10 + k - trim
            with pytest.raises(ProposerError, match=f"must be in 0..{k}"):
                p.after_verify(k + 1, s)   # kept departure: more accepted than drafted
            p.free_state(s)


@pytest.mark.parametrize("forward", FORWARDS)
def test_after_a_one_draft_confidence_stop(forward):
    probe = make(forward)
    conf: list = []
    probe.propose_batch([3], hidden(13).view(1, -1), [11], 3, [prefilled(probe, 12)[0]], out_conf=conf)
    p = make(forward, draft_confidence_stop=(math.exp(conf[0][0]) + 1) / 2)
    for (exact, refeed), want in AFTER_ONE_DRAFT_STOP.items():
        p.kv_exact, p.refeed = exact, refeed
        for accepted, trim in enumerate(want):
            s, _ = prefilled(p, 12)
            assert len(p.propose(3, hidden(13), 11, 3, s)) == 1  # stopped after the first draft
            p.after_verify(accepted, s)
            assert (p.drafter_rows(s), p.last_pair_key(s)) == (11 - trim, 10 - trim)
            p.free_state(s)


# ---- rule 2: pair key = RoPE position - 1 ----
@pytest.mark.parametrize("forward", FORWARDS)
def test_pair_keys_follow_the_rope_positions_written(forward):
    p = make(forward, kv_exact=False)
    s, prompt = prefilled(p, 30, length=9)
    h = hidden(30, 9)
    assert p.last_pair_key(s) == 7 and p.drafter_rows(s) == 8  # rows at RoPE 1..8
    rows = seq_kv(p, s)
    for r in range(8):  # row r: prompt[r + 1] with h[r] at RoPE r + 1
        assert torch.equal(rows[r], expected_k(p, prompt[r + 1], h[r], r + 1)), r
    assert not torch.equal(rows[7], expected_k(p, prompt[8], h[7], 9))  # the check can fail
    t, th = 5, hidden(31)
    drafts = p.propose(t, th, 9, 3, s)  # rows at RoPE 9, 10, 11: key 10
    assert p.last_pair_key(s) == 9 + len(drafts) - 2 == 10
    assert torch.equal(seq_kv(p, s)[8], expected_k(p, t, th, 9))  # the first from the target hidden
    p.after_verify(0, s)  # without exact KV, 0 accepted: all 3 rows go, the key moves back 3
    assert (p.drafter_rows(s), p.last_pair_key(s)) == (8, 7)
    cat = hidden(32, 3)
    p.catchup_batch([[t, 40, 41]], [torch.cat([h[8:9], cat[:2]])], [9], [s])
    assert (p.drafter_rows(s), p.last_pair_key(s)) == (11, 9 + 3 - 2)
    for k, (tok, hid) in enumerate(zip([t, 40, 41], [h[8], cat[0], cat[1]])):
        assert torch.equal(seq_kv(p, s)[8 + k], expected_k(p, tok, hid, 9 + k)), k


# ---- rule 3: catchup_drafter's convention and row_base check ----
@pytest.mark.parametrize("forward", FORWARDS)
def test_catchup_drafter_pairs_the_next_token_and_checks_row_base(forward):
    p = make(forward)
    s, _ = prefilled(p, 33, length=6)  # 5 rows, key 4
    tokens, h = [7, 8, 9, 10], hidden(34, 4)
    for base in (4, 6, 0):  # not the row count: nothing is written
        before = state_snapshot(p, [s])
        assert p.catchup_drafter(tokens, h, base, 6, s) == 0
        assert_unchanged(p, [s], before)
    assert p.catchup_drafter(tokens, h, 5, 6, s) == 3  # len(tokens) - 1 rows
    assert (p.drafter_rows(s), p.last_pair_key(s)) == (8, 6 + 3 - 2)
    for r in range(3):  # row r: tokens[r + 1] with hiddens[r] at RoPE pos_base + r
        assert torch.equal(seq_kv(p, s)[5 + r], expected_k(p, tokens[r + 1], h[r], 6 + r)), r
    assert p.catchup_drafter([7, 8, 9], h[:2], 8, 9, s) == 2  # one hidden fewer is the same
    assert p.catchup_drafter([7], h[:1], 10, 11, s) == 0 and p.drafter_rows(s) == 10


# ---- rule 4: catchup_batch's convention, every count checked before anything runs ----
@pytest.mark.parametrize("forward", FORWARDS)
def test_catchup_batch_convention_and_count_checks(forward):
    p = make(forward)
    a, b = prefilled(p, 35, length=4)[0], prefilled(p, 36, length=7)[0]  # 3 and 6 rows
    h = hidden(37, 5)
    bad = [
        (([[1, 2, 3]], [h[:2]], [4], [a]), r"sequence 0: 3 tokens but 2 hiddens"),
        (([[1], [2]], [h[:1], h[1:2]], [4, 7], [a]), r"2 token lists, 2 hidden lists, 2 first positions and 1 states"),
        (([[1], [2]], [h[:1]], [4, 7], [a, b]), r"2 token lists, 1 hidden lists"),
        (([[1], [2]], [h[:1], h[1:2]], [4], [a, b]), r"1 first positions"),
        (([[1], [2, 3]], [h[:1], h[1:2]], [4, 7], [a, b]), r"sequence 1: 2 tokens but 1 hiddens"),
        (([[1], [2]], [h[:1], h[1:2, :5]], [4, 7], [a, b]), r"sequence 1: hiddens must be \[rows, 32\]"),
        (([[1], [2]], [h[:1], h[1:2]], [4, 0], [a, b]), r"sequence 1: first position 0 must be"),
        (([[1], [2]], [h[:1], h[1:2]], [4, 7], [a, a]), r"a state appears twice"),
    ]
    for args, message in bad:
        before = state_snapshot(p, [a, b])
        with pytest.raises(ProposerError, match=message):
            p.catchup_batch(*args)
        assert_unchanged(p, [a, b], before)
    before = state_snapshot(p, [a, b])
    with pytest.raises(TokenError, match="row 1 of sequence 1"):
        p.catchup_batch([[1], [2, CFG.vocab_size]], [h[:1], h[1:3]], [4, 7], [a, b])
    assert_unchanged(p, [a, b], before)
    with pytest.raises(ProposerError, match="11 tokens but 3 hiddens"):
        p.prefill_drafter(list(range(11)), h[:3], p.alloc_state())
    assert p.catchup_batch([[1, 2], [3]], [h[:2], h[2:3]], [4, 7], [a, b]) == 3
    assert (a.rows, a.last_pair_key, b.rows, b.last_pair_key) == (5, 4 + 2 - 2, 7, 7 + 1 - 2)
    for row, (tok, hid, pos) in ((3, (1, h[0], 4)), (4, (2, h[1], 5))):
        assert torch.equal(seq_kv(p, a)[row], expected_k(p, tok, hid, pos))
    assert torch.equal(seq_kv(p, b)[6], expected_k(p, 3, h[2], 7))


# ---- rule 5: prefill and catch-up of any length on --forward circuit ----
@pytest.mark.parametrize("length", [20, 100])
def test_circuit_proposer_with_widths_up_to_8_prefills_any_length_like_eager(length):
    kw = dict(num_blocks=40, block_size=8, max_blocks_per_seq=16, max_width=64, widths=(1, 2, 4, 8))
    outs = []
    for forward in FORWARDS:
        p = make(forward, **kw)
        s, _ = prefilled(p, 40, length=length)
        batch = [prefilled(p, 41 + i, length=3)[0] for i in range(3)]
        h = hidden(44, 21)
        assert p.catchup_batch([list(range(7))] * 3, [h[:7], h[7:14], h[14:]], [3] * 3, batch) == 21
        outs.append((seq_kv(p, s), p.last_pair_key(s), [seq_kv(p, b) for b in batch]))
        if forward == "circuit":
            # chunked to the KV-only chain's widest program, (K + 1) x 8 rows
            assert max(n for per in p.stats.values() for n in per) <= p.kv_widths[-1] == 32
    (ke, key_e, be), (kc, key_c, bc) = outs
    assert ke.shape[0] == length - 1 and key_e == key_c == length - 2
    assert torch.equal(ke, kc) and all(torch.equal(x, y) for x, y in zip(be, bc))


# ---- rule 6: edge cases ----
@pytest.mark.parametrize("forward", FORWARDS)
def test_zero_drafts_and_width_zero(forward):
    p = make(forward, kv_exact=False)
    s, _ = prefilled(p, 50)
    runs = {kind: dict(per) for kind, per in p.stats.items()}
    assert p.propose(3, hidden(51), 11, 0, s) == []
    assert s.last_num_drafted == 0 and (p.drafter_rows(s), p.last_pair_key(s)) == (10, 9)
    assert {kind: dict(per) for kind, per in p.stats.items()} == runs  # nothing ran
    p.after_verify(0, s)  # d = max(0, 1) = 1 without exact KV: one row goes
    assert (p.drafter_rows(s), p.last_pair_key(s)) == (9, 8)
    assert p.propose_batch([], hidden(52, 0), [], 3, []) is None
    assert p.last_served.kind == "refused" and "width 0" in p.last_served.reason


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("tau", [1.0, 0, 0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_confidence_stop_tau_is_exclusive(forward, tau):
    with pytest.raises(ProposerError, match=r"\(0, 1\) exclusive"):
        make(forward, draft_confidence_stop=tau)


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_masked_chain_never_stops_on_confidence(forward):
    p = make(forward, draft_confidence_stop=0.999999)
    s, _ = prefilled(p, 53)
    assert len(p.propose(3, hidden(54), 11, 3, s)) == 1  # unmasked: the first draft is below tau
    everything = torch.full((math.ceil(CFG.vocab_size / 32),), -1, dtype=torch.int32)
    t, _ = prefilled(p, 53)
    assert len(p.propose(3, hidden(54), 11, 3, t, bitmask=everything)) == 3


@pytest.mark.parametrize("forward", FORWARDS)
def test_queries_on_a_foreign_state_answer_like_the_reference(forward):
    p, other = make(forward), make(forward)
    theirs, _ = prefilled(other, 55)
    mine, _ = prefilled(p, 56)
    taken = p.take_drafter_kv(mine)
    for foreign in (object(), theirs):
        before = state_snapshot(p, [mine])
        assert p.drafter_rows(foreign) == 0 and p.last_pair_key(foreign) is None
        assert p.take_drafter_kv(foreign) is None
        assert p.install_drafter_kv(foreign, taken[0], taken[1], taken[2]) is False
        assert p.catchup_drafter([1, 2], hidden(57, 2), 10, 11, foreign) == 0
        assert p.prefill_drafter([1, 2, 3], hidden(57, 3), foreign) == 0
        assert p.catchup_batch([[1]], [hidden(57, 1)], [11], [foreign]) == 0
        for call in (lambda: p.propose(1, hidden(58), 11, 3, foreign),
                     lambda: p.after_verify(0, foreign), lambda: p.free_state(foreign)):
            with pytest.raises(ProposerError, match="does not belong"):
                call()
        assert_unchanged(p, [mine], before)
    assert other.drafter_rows(theirs) == 10  # the other proposer's state is untouched
    p.free_drafter_kv(taken[0])


@pytest.mark.parametrize("forward", FORWARDS)
def test_install_needs_only_no_blocks_and_no_rows(forward):
    p = make(forward)
    s, _ = prefilled(p, 60)
    blocks, rows, key = p.take_drafter_kv(s)
    keyed = p.alloc_state()
    assert p.install_drafter_kv(keyed, [], 0, 5) and p.last_pair_key(keyed) == 5  # a key alone
    assert p.take_drafter_kv(keyed) is None  # no blocks, no rows
    assert p.install_drafter_kv(keyed, blocks, rows, key)
    assert (p.drafter_rows(keyed), p.last_pair_key(keyed)) == (10, 9)
    assert not p.install_drafter_kv(keyed, [], 0, None)  # now it holds rows


# ---- rule 7: the kept, safer departures (README "Departures from the reference") ----
@pytest.mark.parametrize("forward", FORWARDS)
def test_kept_departures_refuse_before_anything_changes(forward):
    p = make(forward)
    s, _ = prefilled(p, 61)
    before = state_snapshot(p, [s])
    with pytest.raises(TokenError):
        p.catchup_drafter([1, -1], hidden(62, 2), 10, 11, s)
    with pytest.raises(TableTooLong):  # 10 rows + 39 > the 48 rows a table holds
        p.catchup_batch([[1] * 39], [hidden(62, 39)], [11], [s])
    with pytest.raises(ProposerError, match="position 0 must be an int >= 1"):
        p.propose(1, hidden(62), 0, 3, s)
    assert_unchanged(p, [s], before)


# ---- rule 8: the DraftProposer protocol ----
def test_mtp_proposer_implements_the_draft_proposer_protocol():
    p = make("eager")
    assert isinstance(p, DraftProposer)
    names = [n for n, v in vars(DraftProposer).items() if callable(v) and not n.startswith("_")]
    assert len(names) >= 16
    for name in names:
        want = inspect.signature(getattr(DraftProposer, name))
        got = inspect.signature(getattr(MtpProposer, name))
        assert list(want.parameters)[:len(want.parameters)] == \
            [q for q in got.parameters][:len(want.parameters)], name
        assert getattr(DraftProposer, name).__doc__, f"{name} has no contract docstring"
