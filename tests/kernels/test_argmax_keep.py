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
