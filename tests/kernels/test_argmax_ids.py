"""linear_argmax_logprob with an id table (`ids`, issue 18: a reduced draft vocabulary's map_ids
in the merge): every token output is the unmapped kernel's token mapped through the table
(ops/vocab.py's map_ids_ref, -1 staying -1), the logprob keeps its bits, kept / last / the gate
follow the mapped token; at widths 1..8 each row's bits are its bits alone (width invariance);
ids outside the table are never written. CPU interpreter, fp32 and fp16, with the final norm in
the prologue and as a launch of its own."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.argmax_logprob import linear_argmax_logprob
from draft_circuit.ops.sampling import confidence_gate_ref
from draft_circuit.ops.vocab import map_ids_ref

K, V, TARGET = 40, 133, 1000  # V subset rows, each holding a target id below TARGET


def case(n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, K, generator=g).to(dtype)
    w = (torch.randn(V, K, generator=g) / K ** 0.5).to(dtype)
    mask = torch.randint(-2**31, 2**31 - 1, (n, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = 0  # nothing allowed: -1 stays -1 through the table
    ids = torch.randperm(TARGET, generator=g)[:V].sort().values.to(torch.int32)
    active = torch.tensor([i % 3 != 1 for i in range(n)], dtype=torch.int32)
    fallback = torch.randint(-1, TARGET, (n,), generator=g, dtype=torch.int32)
    log_tau = torch.tensor([float("nan") if i % 2 else -4.0 for i in range(n)])
    norm = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    return x, w, mask, ids, active, fallback, log_tau, norm


def run(x, w, mask, ids, active, fallback, log_tau, norm, *, prenorm: bool):
    n = x.shape[0]
    tok, lp = torch.full((n,), 7, dtype=torch.int32), torch.full((n,), 7.0)
    kept, last, nxt = (torch.full((n,), 7, dtype=torch.int32) for _ in range(3))
    normed = torch.empty_like(x) if prenorm else None
    linear_argmax_logprob(x, w, tok, lp, mask, active=active, kept_out=kept, fallback=fallback,
                          last_out=last, log_tau=log_tau, active_out=nxt, norm_weight=norm, eps=1e-5,
                          normed=normed, ids=ids)
    return tok, lp, kept, last, nxt


@pytest.mark.parametrize("prenorm", [False, True], ids=["prologue", "prenorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ids_in_the_merge_are_argmax_then_map_ids_at_every_width(dtype, prenorm):
    x, w, mask, ids, active, fallback, log_tau, norm = case(8, dtype, seed=3)
    # the unmapped kernel over all 8 rows, then map_ids: the reference composition
    base_tok, base_lp = torch.empty(8, dtype=torch.int32), torch.empty(8)
    linear_argmax_logprob(x, w, base_tok, base_lp, mask, norm_weight=norm, eps=1e-5,
                          normed=torch.empty_like(x) if prenorm else None)
    want = map_ids_ref(base_tok, ids)
    assert want[0] == -1 and bool((want[1:] >= 0).all())
    for n in range(1, 9):
        tok, lp, kept, last, nxt = run(x[:n], w, mask[:n], ids, active[:n], fallback[:n], log_tau[:n],
                                       norm, prenorm=prenorm)
        act = active[:n].bool()
        assert torch.equal(tok, want[:n]), n
        assert torch.equal(lp, base_lp[:n]), n  # the mapping never touches the logprob
        assert torch.equal(kept, torch.where(act, want[:n], -1)), n
        assert torch.equal(last, torch.where(act, want[:n], fallback[:n])), n
        assert torch.equal(nxt, confidence_gate_ref(active[:n], lp, log_tau[:n])), n
        assert set(tok.tolist()) <= set(ids.tolist()) | {-1}  # only the table's ids are drafted
    # width invariance: a row drafted alone has the bits it has in the 8-row batch
    full = run(x, w, mask, ids, active, fallback, log_tau, norm, prenorm=prenorm)
    for r in range(8):
        one = run(x[r:r + 1], w, mask[r:r + 1], ids, active[r:r + 1], fallback[r:r + 1],
                  log_tau[r:r + 1], norm, prenorm=prenorm)
        assert all(torch.equal(a, b[r:r + 1]) for a, b in zip(one, full)), r


def test_the_plain_merge_maps_too_and_a_bad_table_is_refused():
    x, w, mask, ids, *_ = case(3, torch.float32, seed=9)
    tok, lp = torch.empty(3, dtype=torch.int32), torch.empty(3)
    linear_argmax_logprob(x, w, tok, lp, mask)
    mapped, lp2 = torch.empty(3, dtype=torch.int32), torch.empty(3)
    linear_argmax_logprob(x, w, mapped, lp2, mask, ids=ids)
    assert torch.equal(mapped, map_ids_ref(tok, ids)) and torch.equal(lp2, lp)
    for bad, match in ((ids[:-1], "expected shape"), (ids.long(), "expected dtype")):
        with pytest.raises(KernelInputError, match=match):
            linear_argmax_logprob(x, w, tok, lp, mask, ids=bad)
