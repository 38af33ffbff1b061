"""Top-1 token and its log-probability per row, optionally under an int32 token bitmask.

Contract: token = lowest id of the largest allowed finite logit, logprob = max - logsumexp over the
allowed finite logits (fp32); a row with nothing allowed gets token -1 and logprob -inf.
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch

from draft_circuit.kernels._common import (KernelInputError, check, check_operand, describe,
                                           fp32_workspace, launch_kwargs, pdl_args)
from draft_circuit.kernels.prologue_tiles import _inv_rms, _norm_x, _raw_x
from draft_circuit.kernels.rmsnorm import rmsnorm

# Pinned for every n and V: a row's result depends only on that row (bitwise width independence).
CHUNK = 2048  # vocab entries per step of the per-row loop in argmax_logprob
CHUNK_NUM_WARPS = 8
LINEAR_BLOCK_M = 64  # rows per tile of the fused lm head; n <= 64 streams the weight exactly once
LINEAR_BLOCK_V = 128  # vocab entries per chunk of the fused lm head = one partial per (row, chunk)
LINEAR_BLOCK_K = 64
# chunk width of the final norm's pass over a row (kernels.prologue_tiles._inv_rms); only the order
# of that sum depends on it, never on n
LINEAR_NORM_BLOCK_K = 64
# From this many weight elements (V * K) the final norm runs as its own launch before the
# partials (`normed`): in the prologue every x tile passes through registers for its
# normalisation instead of the pipeliner's staged copies, which cost the 8B lm-head (128256 x
# 4096) 308.5 us against 251.4 without a norm at n = 1 (336.7 / 252.4 at n = 8, 368.1 / 258.0 at
# n = 64; H200, benchmarks/prologue_sweep.py, 2026-12-02), whatever the norm pass's chunk width;
# a launch of kernels.rmsnorm costs a few us. Below it (small heads, ~16 us of weight) the launch
# would cost what the prologue does. From the weight's shape only, never n.
PRENORM_FROM = 1 << 25
LINEAR_NUM_WARPS = 8  # 4 spills the [64, 128] fp32 tile on sm90
LINEAR_NUM_STAGES = 4
MERGE_BLOCK = 1024  # chunk partials merged per step of the merge kernel's serial loop
MERGE_NUM_WARPS = 4
LAUNCHES = 2  # linear_argmax_logprob: the partials kernel, then the merge
_MAX_VOCAB = 1 << 24  # token ids travel through the fp32 workspace; exact below 2**24
_NO_TOKEN = tl.constexpr(2147483647)  # above every real id, so min() over candidates ignores it
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _top1_reduce(val, tok, weight, ok, AXIS: tl.constexpr):
    """(max val, lowest tok at that max, sum weight * exp(val - max)) over the ok lanes along AXIS.

    With no ok lane: (-inf, _NO_TOKEN, 0). Logits enter with weight 1; chunk partials with their sum.
    """
    v = tl.where(ok, val, float("-inf"))
    m = tl.max(v, axis=AXIS)
    m_b = tl.expand_dims(m, AXIS)
    best = tl.min(tl.where(ok & (v == m_b), tok, _NO_TOKEN), axis=AXIS)
    # where() before the sum: for an all-masked lane set, v - m_b is NaN and must not leak
    s = tl.sum(tl.where(ok, weight * tl.exp(v - m_b), 0.0), axis=AXIS)
    return m, best, s


@triton.jit
def _top1_merge(m_run, tok_run, s_run, m, tok, s):
    """Fold the next (later, higher-id) partial into the running one; ties keep the earlier id."""
    m_new = tl.maximum(m_run, m)
    empty = m_new == float("-inf")  # both empty: exp(-inf - -inf) would be NaN
    s_new = tl.where(empty, 0.0, s_run * tl.exp(m_run - m_new) + s * tl.exp(m - m_new))
    tok_new = tl.where(m > m_run, tok, tok_run)
    return m_new, tok_new, s_new


@triton.jit
def _top1_finish(m, tok, s, token_ptr, logprob_ptr, row):
    empty = m == float("-inf")
    # max - logsumexp = max - (max + log s) = -log s; s >= 1 because the max term is exp(0)
    tl.store(token_ptr + row, tl.where(empty, -1, tok))
    tl.store(logprob_ptr + row, tl.where(empty, float("-inf"), -tl.log(s)))


@triton.jit
def _final_token(m, tok, ids_ptr, HAS_IDS: tl.constexpr):
    """The row's draft: -1 for an empty row, else the winning index, or with an id table (a
    reduced draft vocabulary) the target id it holds: ids[tok], one load a row (map_ids)."""
    empty = m == float("-inf")
    if HAS_IDS:
        tok = tl.load(ids_ptr + tl.where(empty, 0, tok))  # an empty row's index is no index
    return tl.where(empty, -1, tok)


@triton.jit
def _allowed(x, idx, in_vocab, mask_row_ptr, HAS_MASK: tl.constexpr):
    """in the vocab, finite (NaN and +-Inf never win) and, with a mask, its bit set."""
    ok = in_vocab & (tl.abs(x) < float("inf"))
    if HAS_MASK:
        word = tl.load(mask_row_ptr + (idx >> 5), mask=in_vocab, other=0)
        # arithmetic >> sign-extends bit 31, but & 1 keeps only the shifted-down bit itself
        ok = ok & (((word >> (idx & 31)) & 1) != 0)
    return ok


@triton.jit(do_not_specialize=["pdl_release"])
def _argmax_logprob_kernel(
    logits_ptr, mask_ptr, token_ptr, logprob_ptr,
    V, stride_logits, stride_mask, pdl_release,
    HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # one program per row, chunks folded serially in vocab order
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    m_run = tl.full([], float("-inf"), tl.float32)
    tok_run = tl.full([], _NO_TOKEN, tl.int32)
    s_run = tl.zeros([], tl.float32)
    for start in range(0, V, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        in_vocab = idx < V
        x = tl.load(logits_ptr + row * stride_logits + idx, mask=in_vocab, other=0.0).to(tl.float32)
        ok = _allowed(x, idx, in_vocab, mask_ptr + row * stride_mask, HAS_MASK)
        m, tok, s = _top1_reduce(x, idx, 1.0, ok, 0)
        m_run, tok_run, s_run = _top1_merge(m_run, tok_run, s_run, m, tok, s)
    _top1_finish(m_run, tok_run, s_run, token_ptr, logprob_ptr, row)


@triton.jit(do_not_specialize=["n", "pdl_release"])
def _linear_partials_kernel(
    x_ptr, w_ptr, mask_ptr, ws_ptr, nw_ptr, eps,
    n, V, K, stride_x, stride_w, stride_mask, pdl_release,
    HAS_MASK: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # axis 0 (fastest scheduled) walks row tiles, so the tiles of one weight chunk run together
    # and share it through L2; with n <= BLOCK_M the weight is read from memory once.
    pid_m = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n
    col_ok = cols < V
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)  # logits tile [rows, vocab], fp32
    row_off = rows.to(tl.int64)[:, None] * stride_x
    inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:  # the final norm in the prologue (kernels.linear_fused): a pass over the row first
        inv = _inv_rms(x_ptr, row_off, row_ok, K, eps, BLOCK_M, NORM_BLOCK_K)
    if NORM:  # x's next tile a K step ahead, by hand (kernels.prologue_tiles._raw_x says why)
        xr, nw = _raw_x(x_ptr, row_off, row_ok, ks, K, nw_ptr, True)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            xr2, nw2 = _raw_x(x_ptr, row_off, row_ok, kk + BLOCK_K, K, nw_ptr, True)
            xt = _norm_x(xr, nw, inv, True)
            wt = tl.load(w_cols + kk[:, None], mask=col_ok[None, :] & (kk < K)[:, None], other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
            xr, nw = xr2, nw2
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            xt = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
            wt = tl.load(w_cols + kk[:, None], mask=col_ok[None, :] & (kk < K)[:, None], other=0.0)
            # ieee: fp32 inputs must not be rounded to tf32; no effect on fp16 / bf16 inputs
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
    idx = tl.broadcast_to(cols[None, :], [BLOCK_M, BLOCK_V])
    # rows past n must not read the bitmask either: its tensor has only n rows
    mask_rows = mask_ptr + rows.to(tl.int64)[:, None] * stride_mask
    ok = _allowed(acc, idx, row_ok[:, None] & col_ok[None, :], mask_rows, HAS_MASK)
    m, tok, s = _top1_reduce(acc, idx, 1.0, ok, 1)
    tok = tl.where(m == float("-inf"), -1, tok)  # keep _NO_TOKEN out of the fp32 workspace
    # workspace [n, num_chunks, 3] fp32: (max, token as an exact float, sum exp(logit - max))
    part = ws_ptr + (rows.to(tl.int64) * num_chunks + chunk) * 3
    tl.store(part, m, mask=row_ok)
    tl.store(part + 1, tok.to(tl.float32), mask=row_ok)
    tl.store(part + 2, s, mask=row_ok)


@triton.jit(do_not_specialize=["pdl_release"])
def _merge_partials_kernel(
    ws_ptr, token_ptr, logprob_ptr, num_chunks, active_ptr, kept_ptr,
    fallback_ptr, last_ptr, log_tau_ptr, active_out_ptr, ids_ptr, pdl_release,
    MERGE_BLOCK: tl.constexpr, KEEP: tl.constexpr, LAST: tl.constexpr, GATE: tl.constexpr,
    HAS_IDS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # one program per row; blocks of chunk partials folded serially in chunk order
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    m_run = tl.full([], float("-inf"), tl.float32)
    tok_run = tl.full([], _NO_TOKEN, tl.int32)
    s_run = tl.zeros([], tl.float32)
    for c0 in range(0, num_chunks, MERGE_BLOCK):
        c = c0 + tl.arange(0, MERGE_BLOCK)
        valid = c < num_chunks
        part = ws_ptr + (row * num_chunks + c) * 3
        m = tl.load(part, mask=valid, other=float("-inf"))
        tok = tl.load(part + 1, mask=valid, other=-1.0).to(tl.int32)
        s = tl.load(part + 2, mask=valid, other=0.0)
        # chunks hold ascending id ranges, so the lowest token among the max chunks is the answer
        m, tok, s = _top1_reduce(m, tok, s, valid & (m > float("-inf")), 0)
        m_run, tok_run, s_run = _top1_merge(m_run, tok_run, s_run, m, tok, s)
    # the token (mapped through the id table where there is one) and everything derived from it
    token = _final_token(m_run, tok_run, ids_ptr, HAS_IDS)
    # max - logsumexp = -log s, as _top1_finish
    logprob = tl.where(m_run == float("-inf"), float("-inf"), -tl.log(s_run))
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, logprob)
    if KEEP:  # keep_if_active folded in: an inactive row's draft is -1
        active = tl.load(active_ptr + row) != 0
        tl.store(kept_ptr + row, tl.where(active, token, -1))
        if LAST:  # keep_if_active(token, active, fallback): the last kept draft so far
            tl.store(last_ptr + row, tl.where(active, token, tl.load(fallback_ptr + row)))
        if GATE:  # confidence_gate(active, logprob, log_tau) on the logprob just stored
            # not (logprob < log_tau): a NaN threshold never stops a row, as the reference
            stop = logprob < tl.load(log_tau_ptr + row)
            tl.store(active_out_ptr + row, (active & (stop == 0)).to(tl.int32))


def _check_outputs(n: int, device: torch.device, token_out: torch.Tensor, logprob_out: torch.Tensor) -> None:
    for name, t, dtype in (("token_out", token_out, torch.int32), ("logprob_out", logprob_out, torch.float32)):
        check(t.shape == (n,) and t.dtype == dtype and t.is_contiguous() and t.device == device,
              lambda: f"{name} must be {dtype} [{n}] contiguous on {device}; got {describe(name, t)}")


def _check_bitmask(bitmask: torch.Tensor | None, n: int, V: int, device: torch.device) -> None:
    if bitmask is None:
        return
    words = triton.cdiv(V, 32)
    got = describe("bitmask", bitmask)
    check(bitmask.dtype == torch.int32, lambda: f"bitmask must be int32; got {got}")
    check(bitmask.dim() == 2 and bitmask.shape[0] == n, lambda: f"bitmask must be [{n}, {words}]; got {got}")
    check(bitmask.shape[1] == words,
          lambda: f"bitmask must have ceil({V}/32) = {words} words a row, got {bitmask.shape[1]}: {got}")
    check(bitmask.stride(1) == 1 and bitmask.device == device,
          lambda: f"bitmask rows must be contiguous on {device}; got {got}")


def argmax_logprob(logits: torch.Tensor, token_out: torch.Tensor, logprob_out: torch.Tensor,
                   bitmask: torch.Tensor | None = None) -> None:
    """logits [n, V] fp32/fp16/bf16 with contiguous rows; writes token_out int32 [n], logprob_out fp32 [n]."""
    check(logits.dim() == 2 and logits.dtype in _DTYPES and logits.stride(1) == 1,
          lambda: f"logits must be [n, V] fp32/fp16/bf16 with contiguous rows; got {describe('logits', logits)}")
    n, V = logits.shape
    _check_outputs(n, logits.device, token_out, logprob_out)
    _check_bitmask(bitmask, n, V, logits.device)
    if n == 0:
        return
    kw = launch_kwargs(logits)
    _argmax_logprob_kernel[(n,)](
        logits, bitmask if bitmask is not None else token_out, token_out, logprob_out,
        V, logits.stride(0), bitmask.stride(0) if bitmask is not None else 0,
        HAS_MASK=bitmask is not None, CHUNK=CHUNK, **pdl_args(kw, n),
        num_warps=CHUNK_NUM_WARPS, **kw,
    )


def linear_argmax_workspace_shape(n: int, V: int) -> tuple[int, int, int]:
    """Shape of the fp32 workspace of linear_argmax_logprob: one (max, token, sumexp) per (row, chunk)."""
    return (n, triton.cdiv(V, LINEAR_BLOCK_V), 3)


def prenorm_pays(V: int, K: int) -> bool:
    """Whether the final norm of an lm-head over a [V, K] weight runs as its own launch."""
    return V * K >= PRENORM_FROM


def linear_argmax_logprob(x: torch.Tensor, weight: torch.Tensor, token_out: torch.Tensor,
                          logprob_out: torch.Tensor, bitmask: torch.Tensor | None = None,
                          workspace: torch.Tensor | None = None, active: torch.Tensor | None = None,
                          kept_out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-6, fallback: torch.Tensor | None = None,
                          last_out: torch.Tensor | None = None, log_tau: torch.Tensor | None = None,
                          active_out: torch.Tensor | None = None,
                          normed: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> None:
    """argmax_logprob(x @ weight.T), logits fp32 and never written out; x [n, K], weight [V, K] same dtype.
    With `active` int32 [n] and `kept_out` int32 [n]: also kept_out = token where active != 0, else -1
    (keep_if_active in the merge's epilogue, no launch of its own). With `norm_weight` [K]: x is
    rmsnorm(x, norm_weight, eps) first, normalised in the partials kernel's prologue
    (kernels.linear_fused), never stored. With `fallback` int32 [n] and `last_out` (needs active):
    last_out = token where active else fallback. With `log_tau` fp32 [n] and `active_out` int32 [n]
    (needs active): active_out = active and not (logprob < log_tau), the confidence gate. Two
    launches: the partials, then their merge (whose epilogue writes kept, last and active).
    With `normed` [n, K] (x's dtype, needs norm_weight): the norm is a launch of its own
    (kernels.rmsnorm into normed, which the partials then read; three launches), where
    `prenorm_pays` says the prologue costs more. With `ids` int32 [V] (a reduced draft
    vocabulary's id table): the token is ids[top-1 index], -1 staying -1, and kept / last carry
    that id (argmax then map_ids, read in the merge: no launch of its own)."""
    check(x.dim() == 2 and x.dtype in _DTYPES and x.stride(1) == 1,
          lambda: f"x must be [n, K] fp32/fp16/bf16 with contiguous rows; got {describe('x', x)}")
    n, K = x.shape
    check(weight.dim() == 2 and weight.shape[1] == K and weight.dtype == x.dtype and weight.stride(1) == 1
          and weight.device == x.device,
          lambda: f"weight must be [V, {K}] {x.dtype} with contiguous rows on {x.device}; "
                  f"got {describe('weight', weight)}")
    V = weight.shape[0]
    if V >= _MAX_VOCAB:
        raise KernelInputError(f"weight: vocab {V} must be below {_MAX_VOCAB} (token ids pass through fp32)")
    _check_outputs(n, x.device, token_out, logprob_out)
    _check_bitmask(bitmask, n, V, x.device)
    check((active is None) == (kept_out is None), lambda: "active and kept_out come together")
    check((fallback is None) == (last_out is None), lambda: "fallback and last_out come together")
    check((log_tau is None) == (active_out is None), lambda: "log_tau and active_out come together")
    check(active is not None or (fallback is None and log_tau is None),
          lambda: "fallback / log_tau need active (they fold keep_if_active / confidence_gate)")
    if active is not None and kept_out is not None:
        for name, t in (("active", active), ("kept_out", kept_out), ("fallback", fallback),
                        ("last_out", last_out), ("active_out", active_out)):
            if t is None:
                continue
            check(t.shape == (n,) and t.dtype == torch.int32 and t.is_contiguous() and t.device == x.device,
                  lambda: f"{name} must be int32 [{n}] contiguous on {x.device}; got {describe(name, t)}")
    if norm_weight is not None:
        check_operand("norm_weight", norm_weight, (K,), (x.dtype,), x.device)
    if normed is not None:
        check(norm_weight is not None, lambda: "normed needs norm_weight (it holds the normed x)")
        check_operand("normed", normed, (n, K), (x.dtype,), x.device)
        check(normed.is_contiguous(), lambda: f"{describe('normed', normed)}: expected contiguous")
    if ids is not None:
        check_operand("ids", ids, (V,), (torch.int32,), x.device)
    shape = linear_argmax_workspace_shape(n, V)
    workspace = fp32_workspace(workspace, shape, x.device)
    if n == 0:
        return
    kw = launch_kwargs(x)
    if normed is not None and norm_weight is not None:
        rmsnorm(x, norm_weight, normed, eps)
        x, norm_weight = normed, None
    if shape[1] > 0:  # V == 0 has no chunks: the merge alone reports every row empty
        _linear_partials_kernel[(triton.cdiv(n, LINEAR_BLOCK_M), shape[1])](
            x, weight, bitmask if bitmask is not None else token_out, workspace,
            norm_weight if norm_weight is not None else x, float(eps),
            n, V, K, x.stride(0), weight.stride(0), bitmask.stride(0) if bitmask is not None else 0,
            HAS_MASK=bitmask is not None, NORM=norm_weight is not None, BLOCK_M=LINEAR_BLOCK_M, BLOCK_V=LINEAR_BLOCK_V,
            BLOCK_K=LINEAR_BLOCK_K, NORM_BLOCK_K=LINEAR_NORM_BLOCK_K, **pdl_args(kw, n),
            num_warps=LINEAR_NUM_WARPS, num_stages=LINEAR_NUM_STAGES, **kw,
        )
    if log_tau is not None:
        check(log_tau.shape == (n,) and log_tau.dtype == torch.float32 and log_tau.is_contiguous()
              and log_tau.device == x.device,
              lambda: f"log_tau must be float32 [{n}] contiguous on {x.device}; got {describe('log_tau', log_tau)}")
    keep = active is not None
    _merge_partials_kernel[(n,)](
        workspace, token_out, logprob_out, shape[1],
        active if keep else token_out, kept_out if keep else token_out,
        fallback if fallback is not None else token_out, last_out if last_out is not None else token_out,
        log_tau if log_tau is not None else logprob_out,
        active_out if active_out is not None else token_out, ids if ids is not None else token_out,
        MERGE_BLOCK=MERGE_BLOCK, KEEP=keep, LAST=fallback is not None, GATE=log_tau is not None,
        HAS_IDS=ids is not None, **pdl_args(kw, n), num_warps=MERGE_NUM_WARPS, **kw,
    )
