"""The proposer contract on both forwards: propose, batch == per sequence bitwise, refusals,
the confidence stop, bitmasks, the deferred draft, catch-up, hand-over, bad input. The
reference's numbered rules (issue 13) have their own file, test_proposer_rules.py."""
import logging
import sys
import math

import pytest
import torch

from draft_circuit.ops.attention import TokenError
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.runners.kv_cache import ForeignBlock, PoolExhausted
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.proposer_state import ProposerError
from draft_circuit.runners.testing import random_mtp_weights
from tests.runners.tiny_chain import tiny_config

CFG = tiny_config(vocab_size=90)
K = 3
FORWARDS = ["eager", "circuit"]


def make(forward="eager", **kw) -> MtpProposer:
    head = MtpHead(CFG)
    opts = dict(num_drafts=K, num_blocks=40, block_size=8, max_blocks_per_seq=6, max_width=8,
                widths=(1, 2, 4, 8), forward=forward)
    opts.update(kw)
    return MtpProposer(head, head.bind(random_mtp_weights(CFG, seed=11)), **opts)


def hidden(seed, n=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, CFG.hidden_size) if n else (CFG.hidden_size,), generator=g)


def prefilled(p: MtpProposer, seed: int, length: int = 11):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, CFG.vocab_size, (length,), generator=g).tolist()
    s = p.alloc_state()
    assert p.prefill_drafter(prompt, hidden(seed, length), s) == length - 1
    return s, prompt


def seq_kv(p: MtpProposer, s) -> torch.Tensor:
    rows = [p.states["k_cache"][b, o] for b, o in (s.blocks.slot(r) for r in range(s.rows))]
    return torch.stack(rows)


@pytest.mark.parametrize("forward", FORWARDS)
def test_alloc_state_is_empty(forward):
    p = make(forward)
    s = p.alloc_state()
    assert p.drafter_rows(s) == 0 and p.last_pair_key(s) is None and s.last_drafts == []
    assert s.blocks.blocks == () and s.pending is None
    assert p.take_drafter_kv(s) is None


@pytest.mark.parametrize("forward", FORWARDS)
def test_propose_drafts_and_writes_one_row_per_draft(forward):
    p = make(forward)
    s, prompt = prefilled(p, 1)
    drafts = p.propose(5, hidden(2), 11, K, s)
    assert len(drafts) == K and all(0 <= d < CFG.vocab_size for d in drafts)
    # draft i wrote a row at RoPE 11 + i, whose pair key is 11 + i - 1
    assert p.drafter_rows(s) == 10 + K and p.last_pair_key(s) == 11 + K - 2


def test_both_forwards_agree_bitwise():
    outs = []
    for forward in FORWARDS:
        p = make(forward)
        s, _ = prefilled(p, 3)
        outs.append((p.propose(7, hidden(4), 11, K, s), seq_kv(p, s)))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("forward", FORWARDS)
def test_batch_equals_per_sequence_bitwise(forward):
    for width in (1, 3, 5, 8):
        p = make(forward)
        singles = [prefilled(p, 10 + i, 5 + 2 * i)[0] for i in range(width)]
        batch = [prefilled(p, 10 + i, 5 + 2 * i)[0] for i in range(width)]
        tokens = [(7 * i + 3) % CFG.vocab_size for i in range(width)]
        positions = [5 + 2 * i for i in range(width)]
        hid = hidden(99, width)
        want = [p.propose(t, hid[i], positions[i], K, s) for i, (t, s) in enumerate(zip(tokens, singles))]
        conf = []
        got = p.propose_batch(tokens, hid, positions, K, batch, out_conf=conf)
        assert got == want, width
        assert len(conf) == width and all(len(c) == K for c in conf)
        for a, b in zip(singles, batch):
            assert torch.equal(seq_kv(p, a), seq_kv(p, b))


@pytest.mark.parametrize("forward", FORWARDS)
def test_propose_batch_returns_none_when_not_served(forward, caplog):
    p, other = make(forward), make(forward)
    states = [prefilled(p, i)[0] for i in range(2)]
    assert p.propose_batch([1, 2], hidden(1, 2), [11, 11], K, [states[0], other.alloc_state()]) is None
    nine = [p.alloc_state() for _ in range(9)]
    assert p.propose_batch([1] * 9, hidden(1, 9), [0] * 9, K, nine) is None  # beyond max width
    p.refusal = lambda n: "grouped MoE decode disabled"
    with caplog.at_level(logging.WARNING):
        assert p.propose_batch([1, 2], hidden(1, 2), [11, 11], K, states) is None
        assert p.propose_batch([1, 2], hidden(1, 2), [11, 11], K, states) is None
    assert sum("grouped MoE decode disabled" in r.message for r in caplog.records) <= 1
    assert [p.drafter_rows(s) for s in states] == [10, 10]  # nothing ran


@pytest.mark.parametrize("forward", FORWARDS)
def test_confidence_stop_keeps_the_low_draft_and_stops(forward):
    probe = make(forward)
    conf: list = []
    probe.propose_batch([3], hidden(6).view(1, -1), [11], K, [prefilled(probe, 5)[0]], out_conf=conf)
    first = math.exp(conf[0][0])  # the first draft's top-1 probability, below 1
    p = make(forward, draft_confidence_stop=(first + 1) / 2)  # above it: stop after it
    s, _ = prefilled(p, 5)
    drafts = p.propose(3, hidden(6), 11, K, s)
    assert len(drafts) == 1 and p.drafter_rows(s) == 11 and s.last_num_drafted == 1
    q = make(forward, draft_confidence_stop=1e-9)  # nothing is that unlikely
    t, _ = prefilled(q, 5)
    full = q.propose(3, hidden(6), 11, K, t)
    assert full[0] == drafts[0] and len(full) == K  # the same first draft; no stop at all
    assert t.last_drafts == full and t.last_num_drafted == K and q.drafter_rows(t) == 10 + K


@pytest.mark.parametrize("forward", FORWARDS)
def test_bitmask_is_obeyed_and_warned_once(forward, caplog):
    p = make(forward)
    s, _ = prefilled(p, 7)
    allowed = {4, 40, 77}
    mask = torch.zeros(math.ceil(CFG.vocab_size / 32), dtype=torch.int64)
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    mask = mask.to(torch.int32)
    with caplog.at_level(logging.WARNING):
        drafts = p.propose(3, hidden(8), 11, K, s, bitmask=mask)
    assert set(drafts) <= allowed and len(drafts) == K
    with pytest.raises(ProposerError, match=r"ceil\(90/32\) words"):
        p.propose(3, hidden(8), 14, K, s, bitmask=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ProposerError, match="int32"):
        p.propose(3, hidden(8), 14, K, s, bitmask=mask.long())


@pytest.mark.parametrize("forward", FORWARDS)
def test_deferred_draft_needs_no_host_copy(forward):
    p = make(forward)
    s, _ = prefilled(p, 9)
    target = torch.zeros(CFG.hidden_size)

    class NoHostCopy(torch.overrides.TorchFunctionMode):
        """Fails on a device-to-host read made by the proposer or the runners themselves. (CPU
        reference ops read lengths on the host; on CUDA their kernels do not: the cuda suite
        checks the whole path there.)"""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            caller = sys._getframe(1).f_code.co_filename
            if name in ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__") \
                    and caller.endswith(("runners/proposer.py", "runners/draft.py",
                                         "runners/program.py", "runners/cudagraph.py")):
                raise AssertionError(f"host copy via {name} in {caller} while proposing")
            return func(*args, **(kwargs or {}))
    with NoHostCopy():
        drafts = p.propose(3, hidden(10), 11, K, s, embed_target=target)
    assert isinstance(drafts, torch.Tensor)
    last = p.read_deferred_draft_token()
    assert last == drafts.tolist()[-1]
    weights = p.params["embed_tokens.weight"]
    assert torch.equal(target, weights[last])
    assert p.drafter_rows(s) == 10 + K  # settled when the state is next touched


@pytest.mark.parametrize("forward", FORWARDS)
def test_catchup_rebuilds_rows_like_the_chain(forward):
    p = make(forward)
    s, _ = prefilled(p, 14)
    h = hidden(15)
    p.propose(6, h, 11, K, s)
    chain_row = seq_kv(p, s)[10].clone()  # the row built from the target hidden
    t, prompt = prefilled(p, 14)
    # row 0 pairs tokens[1] = 6 with hiddens[0] = h at RoPE 11: the chain's first row
    assert p.catchup_drafter([prompt[-1], 6], h.view(1, -1), 10, 11, t) == 1
    assert torch.equal(seq_kv(p, t)[10], chain_row) and p.last_pair_key(t) == 10
    u, _ = prefilled(p, 14)
    assert p.catchup_batch([[6]], [h.view(1, -1)], [11], [u]) == 1  # tokens[k] with hiddens[k]
    assert torch.equal(seq_kv(p, u)[10], chain_row) and p.last_pair_key(u) == 10


@pytest.mark.parametrize("forward", FORWARDS)
def test_take_install_free(forward):
    p = make(forward)
    free0 = p.pool.num_free
    s, _ = prefilled(p, 16)
    blocks, rows, key = p.take_drafter_kv(s)
    assert rows == 10 and key == 9 and p.drafter_rows(s) == 0 and p.last_pair_key(s) is None
    assert s.blocks.blocks == () and p.take_drafter_kv(s) is None
    full, _ = prefilled(p, 17)
    assert not p.install_drafter_kv(full, blocks, rows, key)  # never into a non-empty state
    empty = p.alloc_state()
    assert p.install_drafter_kv(empty, blocks, rows, key) and p.drafter_rows(empty) == 10
    other = p.alloc_state()
    with pytest.raises(ForeignBlock):
        p.install_drafter_kv(other, [39], 1, None)  # a block this pool never handed out
    for st in (s, full, empty, other):
        p.free_state(st)
    assert p.pool.num_free == free0


@pytest.mark.parametrize("forward", FORWARDS)
def test_bad_input_changes_nothing(forward):
    p = make(forward, num_blocks=5)
    s, _ = prefilled(p, 18, length=9)   # 8 rows: one block of 8
    free = p.pool.num_free
    with pytest.raises(TokenError, match="token 90 at row 0"):
        p.propose(90, hidden(1), 9, K, s)
    with pytest.raises(TokenError):
        p.propose(-1, hidden(1), 9, K, s)
    assert p.pool.num_free == free and p.drafter_rows(s) == 8
    hogs = [prefilled(p, 30 + i, length=9)[0] for i in range(free)]
    with pytest.raises(PoolExhausted):
        p.propose(3, hidden(1), 9, K, s)  # needs a second block; none is free
    assert p.pool.num_free == 0 and len(s.blocks.blocks) == 1 and p.drafter_rows(s) == 8
    with pytest.raises(ProposerError, match="does not belong"):
        make(forward).propose(3, hidden(1), 9, K, s)
    with pytest.raises(ProposerError, match="num_drafts 4 must be in 0..3"):
        p.propose(3, hidden(1), 9, K + 1, hogs[0])


def test_params_follow_the_proposers_device():
    # regression: a host that loads weights on CPU and drafts on a GPU got "param on cpu, the
    # draft compiles for cuda" (H200 engine run); the proposer now places params itself
    head = MtpHead(CFG)
    params = {k: v.to(torch.float64) for k, v in head.bind(random_mtp_weights(CFG)).items()}
    p = MtpProposer(head, {k: v.float() for k, v in params.items()}, num_drafts=K, num_blocks=8,
                    block_size=8, max_blocks_per_seq=2, max_width=2, widths=(1, 2), device="meta")
    assert all(t.device.type == "meta" for t in p.params.values())
