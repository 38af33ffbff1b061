"""linear_argmax_logprob with keep_if_active in its merge epilogue (active / kept_out): token and
logprob are the unfused kernel's bits, kept is keep_if_active of that token (CPU interpreter,
fp32 and fp16, with and without a bitmask, an all-masked row included)."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.argmax_logprob import linear_argmax_logprob


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,vocab,masked", [(1, 64, 300, False), (5, 40, 133, True), (9, 33, 257, True)])
def test_kept_is_keep_if_active_of_the_token(dtype, n, k, vocab, masked):
    g = torch.Generator().manual_seed(n + vocab)
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(vocab, k, generator=g) / k ** 0.5).to(dtype)
    mask = None
    if masked:
        mask = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), generator=g,
                             dtype=torch.int64).to(torch.int32)
        mask[0] = 0  # nothing allowed: token -1 whatever active says
    active = torch.tensor([i % 3 != 1 for i in range(n)], dtype=torch.int32)
    tok, lp = torch.empty(n, dtype=torch.int32), torch.empty(n)
    linear_argmax_logprob(x, w, tok, lp, mask)
    tok2, lp2, kept = torch.empty(n, dtype=torch.int32), torch.empty(n), torch.full((n,), 7, dtype=torch.int32)
    linear_argmax_logprob(x, w, tok2, lp2, mask, active=active, kept_out=kept)
    assert torch.equal(tok2, tok) and torch.equal(lp2, lp)
    assert torch.equal(kept, torch.where(active.bool(), tok, -1))


def test_active_needs_kept_out():
    x, w = torch.zeros(2, 4), torch.zeros(8, 4)
    tok, lp = torch.empty(2, dtype=torch.int32), torch.empty(2)
    with pytest.raises(KernelInputError, match="together"):
        linear_argmax_logprob(x, w, tok, lp, active=torch.ones(2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="kept_out"):
        linear_argmax_logprob(x, w, tok, lp, active=torch.ones(2, dtype=torch.int32),
                              kept_out=torch.empty(3, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,masked", [(1, False), (7, True)])
def test_last_and_gate_epilogues_are_keep_and_confidence_gate(dtype, n, masked):
    """fallback / last_out is keep_if_active(token, active, fallback), log_tau / active_out is
    confidence_gate(active, logprob, log_tau) (NaN never stops; an all-masked row's -inf does),
    token and logprob keep their bits."""
    from draft_circuit.ops.sampling import confidence_gate_ref

    g = torch.Generator().manual_seed(n * 17)
    k, vocab = 40, 133
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(vocab, k, generator=g) / k ** 0.5).to(dtype)
    mask = None
    if masked:
        mask = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), generator=g,
                             dtype=torch.int64).to(torch.int32)
        mask[0] = 0  # nothing allowed: token -1, logprob -inf, and the gate stops the row
    active = torch.tensor([i % 3 != 1 for i in range(n)], dtype=torch.int32)
    fallback = torch.randint(-1, vocab, (n,), generator=g, dtype=torch.int32)
    log_tau = torch.tensor([float("nan") if i % 2 else -4.0 for i in range(n)])
    tok, lp = torch.empty(n, dtype=torch.int32), torch.empty(n)
    linear_argmax_logprob(x, w, tok, lp, mask)
    tok2, lp2 = torch.empty(n, dtype=torch.int32), torch.empty(n)
    kept, last, nxt = (torch.full((n,), 7, dtype=torch.int32) for _ in range(3))
    linear_argmax_logprob(x, w, tok2, lp2, mask, active=active, kept_out=kept, fallback=fallback,
                          last_out=last, log_tau=log_tau, active_out=nxt)
    assert torch.equal(tok2, tok) and torch.equal(lp2, lp)
    assert torch.equal(kept, torch.where(active.bool(), tok, -1))
    assert torch.equal(last, torch.where(active.bool(), tok, fallback))
    assert torch.equal(nxt, confidence_gate_ref(active, lp, log_tau))


def test_fallback_and_log_tau_need_their_outputs_and_active():
    x, w = torch.zeros(2, 4), torch.zeros(8, 4)
    tok, lp = torch.empty(2, dtype=torch.int32), torch.empty(2)
    one = torch.ones(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="fallback and last_out"):
        linear_argmax_logprob(x, w, tok, lp, active=one, kept_out=one.clone(), fallback=one)
    with pytest.raises(KernelInputError, match="need active"):
        linear_argmax_logprob(x, w, tok, lp, log_tau=torch.zeros(2), active_out=one.clone())
    with pytest.raises(KernelInputError, match="log_tau must be float32"):
        linear_argmax_logprob(x, w, tok, lp, active=one, kept_out=one.clone(),
                              log_tau=torch.zeros(2, dtype=torch.float64), active_out=one.clone())
