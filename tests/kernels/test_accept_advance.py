"""accept_advance (issues 20 / 14): the accepted counts and the next propose's shifts in one
launch, against runners/accept_counts.py's torch ops (the same arithmetic, ten launches).

CPU: under the Triton interpreter, widths 1, 2, 5, 64 and 65 (two programs), k = 1, 3, 4, 8,
rows that accept none, some or all of their drafts, rows stopped early (-1 never accepted,
whatever the target's row holds), a verify row with no finite logit (-1, drafted as 0), the
drafts as a strided view of a wider buffer; every operand checked by name. cuda: the same bits
on the GPU, one profiled kernel a call.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.accept_advance import LAUNCHES, accept_advance
from draft_circuit.runners.accept_counts import AcceptCounts
from draft_circuit.runners.testing import cuda


def case(n, k, seed, device="cpu"):
    """Drafts [n, k] with -1 after random stops, greedy [n, k + 1] agreeing with a random
    prefix of each row (and now and then with a stopped row's -1 column, or -1 itself), and
    staged rows (tokens, positions, live, index) of arbitrary values."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, 50, (n, k), generator=g, dtype=torch.int32)
    stop = torch.randint(0, k + 1, (n,), generator=g)
    for i in range(n):
        if i % 3 == 1:
            drafts[i, stop[i]:] = -1
    greedy = torch.randint(0, 50, (n, k + 1), generator=g, dtype=torch.int32)
    agree = torch.randint(0, k + 1, (n,), generator=g)
    for i in range(n):
        greedy[i, :agree[i]] = drafts[i, :agree[i]]
        if i % 5 == 2:  # a stopped row whose target "matches" its -1: never accepted
            greedy[i, :] = drafts[i, 0] if drafts[i, 0] >= 0 else -1
            drafts[i, 1:] = -1
        if i % 7 == 3:  # a row with no finite logit: -1 where the next token is picked
            greedy[i, :] = -1
    rows = torch.randint(0, 1000, (3, n), generator=g, dtype=torch.int32)
    index = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int64)
    return [t.to(device) for t in (drafts, greedy, rows[0], rows[1], rows[2], index)]


def torch_ops(drafts, greedy, tokens, positions, live, index):
    """runners/accept_counts.py's torch path on copies: (counts, tokens, positions, live, index)."""
    n, k = drafts.shape
    acc = AcceptCounts(n, drafts.device, fused=False)
    out = [t.clone() for t in (tokens, positions, live, index)]
    acc.advance(drafts, greedy).apply(*out)
    return [acc.dev[:n].clone(), *out]


def kernel(drafts, greedy, tokens, positions, live, index):
    n = drafts.shape[0]
    counts = torch.full((n,), -7, dtype=torch.int64, device=drafts.device)
    out = [t.clone() for t in (tokens, positions, live, index)]
    accept_advance(drafts, greedy, counts, *out)
    return [counts, *out]


def host_rule(drafts, greedy):
    """`speculate.accept` per row, on the host: the leading drafts equal to the target's row."""
    counts = []
    for d, g in zip(drafts.tolist(), greedy.tolist()):
        a = 0
        while a < len(d) and d[a] >= 0 and d[a] == g[a]:
            a += 1
        counts.append(a)
    return counts


@pytest.mark.parametrize("k", [1, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 5, 64, 65])
def test_the_kernel_is_the_torch_ops_bit_for_bit(n, k):
    args = case(n, k, seed=n * 10 + k)
    got, want = kernel(*args), torch_ops(*args)
    for name, x, y in zip(("counts", "tokens", "positions", "live", "index"), got, want):
        assert torch.equal(x, y), name
    assert got[0].tolist() == host_rule(args[0], args[1])
    a = got[0]
    assert torch.equal(got[1], args[1].gather(1, a.view(-1, 1)).view(-1).clamp(min=0))
    assert torch.equal(got[2], (args[3] + a).int()) and torch.equal(got[4], args[5] + a)


def test_strided_drafts_and_greedy_rows():
    """Drafts as the [n, k] head of a wider buffer's rows (and greedy likewise): each row read
    through its stride."""
    n, k = 6, 4
    drafts, greedy, *rest = case(n, k, seed=3)
    wide_d = torch.full((n, k + 3), 9, dtype=torch.int32)
    wide_d[:, :k] = drafts
    wide_g = torch.full((n, k + 5), 9, dtype=torch.int32)
    wide_g[:, :k + 1] = greedy
    got = kernel(wide_d[:, :k], wide_g[:, :k + 1], *rest)
    want = torch_ops(drafts, greedy, *rest)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bad,match", [
    ("drafts_dtype", "drafts"), ("greedy_width", "greedy"), ("counts_dtype", "counts"),
    ("tokens_len", "tokens"), ("index_dtype", "index"), ("live_dtype", "live")])
def test_a_bad_operand_is_named(bad, match):
    drafts, greedy, tokens, positions, live, index = case(4, 3, seed=1)
    counts = torch.zeros(4, dtype=torch.int64)
    if bad == "drafts_dtype":
        drafts = drafts.long()
    elif bad == "greedy_width":
        greedy = greedy[:, :3]
    elif bad == "counts_dtype":
        counts = counts.int()
    elif bad == "tokens_len":
        tokens = tokens[:3]
    elif bad == "index_dtype":
        index = index.int()
    elif bad == "live_dtype":
        live = live.long()
    with pytest.raises(KernelInputError, match=match):
        accept_advance(drafts, greedy, counts, tokens, positions, live, index)


@cuda
@pytest.mark.parametrize("n", [1, 4, 64, 65])
def test_the_kernel_on_the_gpu(n):
    """The same bits on the GPU, one kernel a call (profiled)."""
    args = case(n, 4, seed=n, device="cuda")
    got, want = kernel(*args), torch_ops(*args)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    counts = torch.zeros(n, dtype=torch.int64, device="cuda")
    out = [t.clone() for t in args[2:]]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        accept_advance(args[0], args[1], counts, *out)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == LAUNCHES, [e.name for e in kernels]
