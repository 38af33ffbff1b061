"""Paged GQA decode attention: one query row per sequence over its L = live_rows + row_offset + 1 KV rows.

Contract: out[i, h] = softmax(scale * q[i, h] . K[i]^T) V[i] in fp32, cast to q's dtype; only the
blocks of live rows are read. Fixed-size KV splits merged serially, so a row never depends on n.
"""
from __future__ import annotations

import triton
import triton.language as tl
import torch

from draft_circuit.kernels._common import check, describe, fp32_workspace, launch_kwargs, pdl_args

# Pinned for every n and L (a split *size*, never a split count): bitwise width independence.
SPLIT_ROWS = 32  # KV rows per split program (H200: 2.5x faster than 256 at ~100 live rows, n<=8); a multiple of every step size below
# KV rows per step inside a split = this // (query heads a program serves, padded), so the
# [heads, rows, head_dim] product tiles stay within registers (checked on sm90 with Triton 3.6: no
# spills for G = 1..32 at head_dim 64, 80 and 128).
STEP_ROWS_X_HEADS = 32
# Split programs a launch aims at: the grid's split axis is cdiv(this, n * kv heads), at most the
# table's splits and at least 1 (a program then takes every grid_splits-th live split). At
# n * kv heads <= 64 that is every split (one program each, as before); at n = 64 with 8 kv heads,
# 4 (~100 live rows: one program a live split) where 32 programs a (row, head) were launched, 28
# of them past the live rows. Never changes a bit (see the kernel).
SPLIT_PROGRAMS = 2048
# The split kernel as tl.dot tiles (`_split_dot_kernel`): heads padded to >= DOT_MIN rows, up to
# DOT_BLOCK_N KV rows a step; the elementwise `_split_kernel` otherwise.
DOT_SPLIT = True
DOT_MIN, DOT_BLOCK_N, DOT_NUM_WARPS = 16, 32, 4
SPLIT_NUM_WARPS = 4  # doubled once a program serves 32 (padded) heads: no spills there either on sm90
MERGE_NUM_WARPS = 4
_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _program_rows(live_ptr, row_offset, capacity, pdl_release, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """A split program's (sequence, kv head, first split), its row's L = live_rows + row_offset
    + 1 KV rows (clamped: never past the block table, whose tail may be garbage, never below
    zero), and its query heads / head dims with their masks (the two split kernels')."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    first = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    L = tl.minimum(tl.maximum(tl.load(live_ptr + seq) + row_offset + 1, 0), capacity)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    return seq, kv_head, first, L, kv_head * GROUP + g, g < GROUP, d, d < HEAD_DIM


@triton.jit
def _kv_step(tables_ptr, seq, stride_table, start, hi, BLOCK_N: tl.constexpr,
             BLOCK_SIZE: tl.constexpr):
    """The step's KV rows start .. start + BLOCK_N: which are live (< hi), their blocks and
    slots (a dead row's table entry is neither read nor used: its address becomes block 0's)."""
    r = start + tl.arange(0, BLOCK_N)
    live = r < hi
    blk = tl.load(tables_ptr + seq * stride_table + r // BLOCK_SIZE, mask=live, other=0)
    return live, tl.where(live, blk, 0).to(tl.int64), (r % BLOCK_SIZE).to(tl.int64)


@triton.jit
def _store_split(ws_ptr, seq, heads, head_ok, d, d_ok, split, max_splits, acc, m, l,
                 NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A split's (acc, m, l) per head into the workspace [n, NUM_HEADS, max_splits, HEAD_DIM + 2]."""
    part = ws_ptr + ((seq * NUM_HEADS + heads) * max_splits + split) * (HEAD_DIM + 2)
    tl.store(part[:, None] + d[None, :], acc, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(part + HEAD_DIM, m, mask=head_ok)
    tl.store(part + HEAD_DIM + 1, l, mask=head_ok)


# the step offsets vary by draft step and the grid's splits by width: unspecialised, one compile
# serves every step and width (tests/runners/test_capture_precompile.py)
@triton.jit(do_not_specialize=["row_offset", "grid_splits", "pdl_release"])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, live_ptr, ws_ptr,
    row_offset, capacity, max_splits, grid_splits, qk_scale_log2,
    stride_q, stride_table, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    pdl_release,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # program = (sequence, kv head, first split); it serves the GROUP query heads that share the
    # kv head, and the live splits first, first + grid_splits, ... of its row (the grid's third
    # axis is as many as the width needs to fill the GPU, not every split the table could hold:
    # programs past a row's live rows cost a launch wave each and compute nothing). A split's
    # result never depends on which program computes it: the bits stay the one-program-a-split's.
    seq, kv_head, first, L, heads, head_ok, d, d_ok = _program_rows(
        live_ptr, row_offset, capacity, pdl_release, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, USE_PDL)
    q = tl.load(q_ptr + seq * stride_q + heads[:, None] * HEAD_DIM + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    for split in range(first, tl.cdiv(L, SPLIT), grid_splits):
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, L)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, log2 domain
        l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(s - m)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p V
        for start in range(lo, hi, BLOCK_N):
            live, blk, slot = _kv_step(tables_ptr, seq, stride_table, start, hi, BLOCK_N, BLOCK_SIZE)
            kv_ok = live[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                        + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, D]
            # V is read transposed, [D, BLOCK_N], so that p V below also reduces over the last axis
            vt = tl.load(v_ptr + blk[None, :] * stride_vb + slot[None, :] * stride_vs + kv_head * stride_vh
                         + d[:, None], mask=d_ok[:, None] & live[None, :], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale_log2  # [G, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            # every step holds a live row (start < hi), so m_new is finite
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # [G, D, BLOCK_N] summed over its last axis, never sum(p[:, :, None] * v[None, :, :], axis=1):
            # Triton's combine pass rewrites that form into a tt.dot once G >= 16 and D >= 16, without
            # looking at K = BLOCK_N (2 at G=16, 1 at G=32); Triton 3.6 then lowers it to a tf32 mma
            # (k = 8) with K < 8, which gives garbage. Both products here stay elementwise + tl.sum.
            acc = acc * alpha[:, None] + tl.sum(p[:, None, :] * vt[None, :, :], axis=2)
            m = m_new
        _store_split(ws_ptr, seq, heads, head_ok, d, d_ok, split, max_splits, acc, m, l,
                     NUM_HEADS, HEAD_DIM)


@triton.jit(do_not_specialize=["row_offset", "grid_splits", "pdl_release"])
def _split_dot_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, live_ptr, ws_ptr,
    row_offset, capacity, max_splits, grid_splits, qk_scale_log2,
    stride_q, stride_table, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    pdl_release,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # `_split_kernel`'s contract and grid, its two products as tl.dot tiles: the group's query
    # heads padded to GROUP_PAD >= 16 rows, BLOCK_N >= 16 KV rows a step (a whole 32-row split at
    # once), K and V loaded row-major [BLOCK_N, D] (coalesced; the elementwise kernel reads V
    # transposed). Scores in the input dtype with fp32 accumulation (exact products); p V in
    # fp32 ("ieee": no tf32). A head's row of each product depends only on that head's q row
    # and the sequence's K/V: bits never depend on n or on the other heads.
    seq, kv_head, first, L, heads, head_ok, d, d_ok = _program_rows(
        live_ptr, row_offset, capacity, pdl_release, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, USE_PDL)
    q = tl.load(q_ptr + seq * stride_q + heads[:, None] * HEAD_DIM + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D], the input dtype
    for split in range(first, tl.cdiv(L, SPLIT), grid_splits):
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, L)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            live, blk, slot = _kv_step(tables_ptr, seq, stride_table, start, hi, BLOCK_N, BLOCK_SIZE)
            rows_ok = live[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                        + d[None, :], mask=rows_ok, other=0.0)  # [BLOCK_N, D]
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2  # [G, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every step holds a live row
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                        + d[None, :], mask=rows_ok, other=0.0).to(tl.float32)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        _store_split(ws_ptr, seq, heads, head_ok, d, d_ok, split, max_splits, acc, m, l,
                     NUM_HEADS, HEAD_DIM)


@triton.jit(do_not_specialize=["row_offset", "pdl_release"])
def _merge_kernel(
    ws_ptr, live_ptr, out_ptr,
    row_offset, capacity, max_splits, stride_out, pdl_release,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # program = (sequence, query head); the live splits are folded serially in split order
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    L = tl.minimum(tl.maximum(tl.load(live_ptr + seq) + row_offset + 1, 0), capacity)
    num_splits = tl.cdiv(L, SPLIT)
    base = ws_ptr + (seq * NUM_HEADS + head) * max_splits * (HEAD_DIM + 2)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for split in range(0, num_splits):
        part = base + split * (HEAD_DIM + 2)
        acc_s = tl.load(part + d, mask=d_ok, other=0.0)
        m_s = tl.load(part + HEAD_DIM)
        l_s = tl.load(part + HEAD_DIM + 1)
        m_new = tl.maximum(m, m_s)  # finite: every live split holds a live row
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        acc = acc * alpha + acc_s * beta
        m = m_new
    # L == 0 (only a clamped, out-of-contract row) has no splits: it writes zeros, never NaN
    o = tl.where(l > 0.0, acc / tl.maximum(l, 1e-30), 0.0)
    tl.store(out_ptr + seq * stride_out + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def decode_attention_workspace_shape(n: int, num_heads: int, head_dim: int, max_rows: int,
                                     split_rows: int = SPLIT_ROWS) -> tuple[int, int, int, int]:
    """fp32 workspace: per (row, query head, split) the unnormalised acc [head_dim], max and sum.

    max_rows is the block table's capacity, block_tables.shape[1] * block_size.
    """
    return (n, num_heads, triton.cdiv(max_rows, split_rows), head_dim + 2)


def split_programs(n: int, num_kv_heads: int, max_splits: int) -> int:
    """The split axis of the split kernel's grid for n rows (see SPLIT_PROGRAMS)."""
    return max(1, min(max_splits, triton.cdiv(SPLIT_PROGRAMS, max(1, n * num_kv_heads))))


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  live_rows: torch.Tensor, out: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, row_offset: int) -> None:
    check(num_heads > 0 and num_kv_heads > 0 and num_heads % num_kv_heads == 0 and head_dim > 0,
          lambda: f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}, "
                  f"head_dim {head_dim} positive")
    check(q.dim() == 2 and q.dtype in _DTYPES and q.shape[1] == num_heads * head_dim and q.stride(1) == 1,
          lambda: f"q must be [n, {num_heads}*{head_dim}] fp32/fp16/bf16 with contiguous rows; got {describe('q', q)}")
    n, dev = q.shape[0], q.device
    check(row_offset >= 0, lambda: f"row_offset must be >= 0; got {row_offset}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(c.dim() == 4 and c.shape[2] == num_kv_heads and c.shape[3] == head_dim and c.stride(3) == 1
              and c.dtype == q.dtype and c.device == dev,
              lambda: f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}] {q.dtype} on {dev}, "
                      f"last dim contiguous; got {describe(name, c)}")
    check(k_cache.shape == v_cache.shape,
          lambda: f"v_cache must match k_cache {list(k_cache.shape)}; got {describe('v_cache', v_cache)}")
    block_size = k_cache.shape[1]
    check(block_size >= 8 and block_size & (block_size - 1) == 0,
          lambda: f"block_size must be a power of two >= 8; got {describe('k_cache', k_cache)}")
    check(block_tables.dim() == 2 and block_tables.shape[0] == n and block_tables.shape[1] > 0
          and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and block_tables.device == dev,
          lambda: f"block_tables must be int32 [{n}, max_blocks >= 1] with contiguous rows on {dev}; "
                  f"got {describe('block_tables', block_tables)}")
    check(live_rows.shape == (n,) and live_rows.dtype == torch.int32 and live_rows.is_contiguous()
          and live_rows.device == dev,
          lambda: f"live_rows must be int32 [{n}] contiguous on {dev}; got {describe('live_rows', live_rows)}")
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(1) == 1 and out.device == dev,
          lambda: f"out must be {q.dtype} {list(q.shape)} with contiguous rows on {dev}; got {describe('out', out)}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, live_rows: torch.Tensor, out: torch.Tensor, *,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float, row_offset: int,
                     workspace: torch.Tensor | None = None, split_rows: int = SPLIT_ROWS,
                     dot: bool | None = None) -> None:
    """q, out [n, num_heads*head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]; no host sync.
    dot: the split's products as tl.dot tiles (`_split_dot_kernel`) or elementwise (`_split_kernel`);
    None: DOT_SPLIT (the dot kernel needs split_rows a multiple of 16; otherwise elementwise)."""
    _check_inputs(q, k_cache, v_cache, block_tables, live_rows, out, num_heads, num_kv_heads, head_dim, row_offset)
    n, block_size = q.shape[0], k_cache.shape[1]
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_n = max(1, STEP_ROWS_X_HEADS // group_pad)
    check(split_rows >= block_n and split_rows % block_n == 0,
          lambda: f"split_rows must be a positive multiple of {block_n}; got {split_rows}")
    capacity = block_tables.shape[1] * block_size
    shape = decode_attention_workspace_shape(n, num_heads, head_dim, capacity, split_rows)
    workspace = fp32_workspace(workspace, shape, q.device)
    if n == 0:
        return
    kw = launch_kwargs(q)
    shared = dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
                  SPLIT=split_rows, **pdl_args(kw, n))
    grid_splits = split_programs(n, num_kv_heads, shape[2])
    args = (q, k_cache, v_cache, block_tables, live_rows, workspace,
            row_offset, capacity, shape[2], grid_splits, scale * _LOG2E,
            q.stride(0), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    group = num_heads // num_kv_heads
    if (DOT_SPLIT if dot is None else dot) and split_rows % DOT_MIN == 0:
        _split_dot_kernel[(n, num_kv_heads, grid_splits)](
            *args, GROUP=group, GROUP_PAD=max(DOT_MIN, group_pad), BLOCK_SIZE=block_size,
            BLOCK_N=min(split_rows, DOT_BLOCK_N), num_warps=DOT_NUM_WARPS,
            **{**shared, "D_PAD": max(DOT_MIN, shared["D_PAD"])}, **kw)
    else:
        _split_kernel[(n, num_kv_heads, grid_splits)](
            *args, GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
            num_warps=SPLIT_NUM_WARPS * (2 if group_pad >= 32 else 1), **shared, **kw)
    _merge_kernel[(n, num_heads)](
        workspace, live_rows, out, row_offset, capacity, shape[2], out.stride(0),
        num_warps=MERGE_NUM_WARPS, **shared, **kw,
    )
