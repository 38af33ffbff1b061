"""The vocabulary-parallel argmax's two kernels (issue 21): a rank's partial over its vocabulary
rows, and the combine of every rank's partial after the gather.

`vocab_partial`: one program per row folds its logits chunk by chunk in vocabulary order into
(lowest global id of the largest allowed logit, that logit, log-sum-exp of the allowed logits),
stored in an int32 [n, 3] buffer (the two floats as their bits, so a gather copies them exactly).
Allowed: finite, and with a mask its bit set at the *global* id (rows [offset, offset + V_r) of
the whole vocabulary's mask). Nothing allowed: (-1, -inf, -inf).
`vocab_combine`: one program per row folds the w partials in rank order: the highest logit, the
lowest id among the ranks that hold it, the log-sum-exp of the ranks' log-sum-exps; token -1 and
logprob -inf when nothing was allowed anywhere. Both loops have fixed trip orders, so a row's bits
never depend on the batch (width independence) and every rank computes the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import check, describe

CHUNK = 2048  # vocabulary entries per step of the per-row loop (pinned: width independence)
NUM_WARPS = 8
_NO_ID = tl.constexpr(2147483647)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _vocab_partial_kernel(logits_ptr, mask_ptr, ids_ptr, vals_ptr, V, offset, stride_logits, stride_mask,
                          HAS_MASK: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m_run = tl.full([], float("-inf"), tl.float32)
    id_run = tl.full([], _NO_ID, tl.int32)
    s_run = tl.zeros([], tl.float32)
    for start in range(0, V, CHUNK):
        local = start + tl.arange(0, CHUNK)
        in_vocab = local < V
        gid = local + offset
        x = tl.load(logits_ptr + row * stride_logits + local, mask=in_vocab, other=0.0).to(tl.float32)
        ok = in_vocab & (tl.abs(x) < float("inf"))  # NaN and +-Inf are never drafts
        if HAS_MASK:
            word = tl.load(mask_ptr + row * stride_mask + (gid >> 5), mask=in_vocab, other=0)
            ok = ok & (((word >> (gid & 31)) & 1) != 0)  # & 1: the sign extension never leaks
        v = tl.where(ok, x, float("-inf"))
        m = tl.max(v, axis=0)
        best = tl.min(tl.where(ok & (v == m), gid, _NO_ID), axis=0)
        s = tl.sum(tl.where(ok, tl.exp(v - m), 0.0), axis=0)  # where first: no NaN from -inf - -inf
        m_new = tl.maximum(m_run, m)
        empty = m_new == float("-inf")
        s_run = tl.where(empty, 0.0, s_run * tl.exp(m_run - m_new) + s * tl.exp(m - m_new))
        id_run = tl.where(m > m_run, best, id_run)  # a later chunk's tie keeps the earlier (lower) id
        m_run = m_new
    empty = m_run == float("-inf")
    tl.store(ids_ptr + row * 3, tl.where(empty, -1, id_run))
    tl.store(vals_ptr + row * 3 + 1, m_run)
    tl.store(vals_ptr + row * 3 + 2, tl.where(empty, float("-inf"), m_run + tl.log(s_run)))


@triton.jit
def _vocab_combine_kernel(ids_ptr, vals_ptr, token_ptr, logprob_ptr, n, W):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    tok = tl.full([], _NO_ID, tl.int32)
    lse = tl.full([], float("-inf"), tl.float32)
    for r in range(0, W):
        base = (r * n + row) * 3
        i = tl.load(ids_ptr + base)
        m = tl.load(vals_ptr + base + 1)
        ll = tl.load(vals_ptr + base + 2)
        tok = tl.where((i >= 0) & ((m > best) | ((m == best) & (i < tok))), i, tok)
        best = tl.maximum(best, m)
        hi = tl.maximum(lse, ll)
        lse = tl.where(hi == float("-inf"), hi, hi + tl.log(tl.exp(lse - hi) + tl.exp(ll - hi)))
    empty = tok == _NO_ID
    tl.store(token_ptr + row, tl.where(empty, -1, tok))
    tl.store(logprob_ptr + row, tl.where(empty, float("-inf"), best - lse))


def vocab_partial(logits: torch.Tensor, bitmask: torch.Tensor | None, offset: int, out: torch.Tensor) -> None:
    """logits [n, V_r] (rows [offset, offset + V_r) of the vocabulary, contiguous rows), bitmask
    int32 [n, ceil(V/32)] of the whole vocabulary or None -> out int32 [n, 3] (contiguous)."""
    check(logits.dim() == 2 and logits.dtype in _DTYPES and logits.stride(1) == 1,
          lambda: f"logits must be [n, V_r] fp32/fp16/bf16 with contiguous rows; got {describe('logits', logits)}")
    n, v = logits.shape
    check(out.dtype == torch.int32 and out.shape == (n, 3) and out.is_contiguous(),
          lambda: f"out must be a contiguous int32 [{n}, 3]; got {describe('out', out)}")
    if bitmask is not None:
        check(bitmask.dtype == torch.int32 and bitmask.shape[0] == n and bitmask.stride(1) == 1
              and bitmask.shape[1] * 32 >= offset + v,
              lambda: f"bitmask must be int32 [{n}, >= {-(-(offset + v) // 32)}] with contiguous rows; "
                      f"got {describe('bitmask', bitmask)}")
    if n == 0:
        return
    _vocab_partial_kernel[(n,)](logits, bitmask if bitmask is not None else out, out, out.view(torch.float32),
                                v, offset, logits.stride(0), bitmask.stride(0) if bitmask is not None else 0,
                                HAS_MASK=bitmask is not None, CHUNK=CHUNK, num_warps=NUM_WARPS)


def vocab_combine(parts: torch.Tensor, token_out: torch.Tensor, logprob_out: torch.Tensor) -> None:
    """parts int32 [w, n, 3] (rank-major partials, contiguous) -> token_out int32 [n],
    logprob_out float32 [n]."""
    check(parts.dtype == torch.int32 and parts.dim() == 3 and parts.shape[2] == 3 and parts.is_contiguous(),
          lambda: f"parts must be a contiguous int32 [w, n, 3]; got {describe('parts', parts)}")
    w, n, _ = parts.shape
    check(token_out.dtype == torch.int32 and token_out.shape == (n,) and logprob_out.dtype == torch.float32
          and logprob_out.shape == (n,),
          lambda: f"outputs must be int32 [{n}] and float32 [{n}]; got {describe('token_out', token_out)}, "
                  f"{describe('logprob_out', logprob_out)}")
    if n == 0:
        return
    _vocab_combine_kernel[(n,)](parts, parts.view(torch.float32), token_out, logprob_out, n, w, num_warps=1)
