"""The attention's input in one launch (issue 15): rmsnorm(x) -> q/k/v products -> rope of q and k
-> the paged write of k and v, i.e. kernels.linear_fused.rmsnorm_linear_qkv followed by
kernels.rope_kv_write, with q, k and v never stored unroped.

`rmsnorm_qkv_rope_kv_write(x, norm_weight, eps, (w_q, w_k, w_v), positions, live_rows,
block_tables, k_cache, v_cache, q_out, ...)`. One grid, three segments, row tiles fastest:
- q and k: a program owns BLOCK_M rows and BLOCK_HALF columns of one head's first half plus the
  matching columns of its second half (two accumulators), so the rotate-half pairs (d, D/2 + d)
  meet in its epilogue; each product is rounded to x's dtype first (what the unfused linear
  stores), then rotated in fp32 with kernels.rope_kv_write's inv_freq, cos and sin;
- v: kernels.linear's tiles, written straight to the cache slots.
Rows with active == 0 write no cache slot (q is still written). Full rotary only (the fusion
row's guard). The rms prologue and the K order are kernels.linear_fused's; the tiles are pinned,
so a row's bits never depend on n. One launch.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (FLOAT_DTYPES, INDEX_DTYPES, check, check_operand,
                                           interpreting, launch_kwargs, pdl_args)
from draft_circuit.kernels.linear import BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS
from draft_circuit.kernels.prologue_tiles import _inv_rms, _load_x
from draft_circuit.kernels.rope_kv_write import rope_cos_sin, rope_inv_freq, theta_parts

LAUNCHES = 1


def half_block(head_dim: int) -> int:
    """Columns of a head's half a rope program owns: >= 16 (the smallest tl.dot tile), <= 32."""
    return max(16, min(BLOCK_N, triton.next_power_of_2(head_dim // 2)))


@triton.jit
def _slots(offs_m, m_mask, live_ptr, tables_ptr, active_ptr, stride_tables, row_offset,
           block_size, HAS_ACTIVE: tl.constexpr):
    """(cache block, slot, whether to write) of each row: row live_rows + row_offset."""
    r = tl.load(live_ptr + offs_m, mask=m_mask, other=0) + row_offset
    blk = tl.load(tables_ptr + offs_m.to(tl.int64) * stride_tables + r // block_size, mask=m_mask,
                  other=0).to(tl.int64)
    write = m_mask
    if HAS_ACTIVE:
        write = write & (tl.load(active_ptr + offs_m, mask=m_mask, other=0) != 0)
    return blk, (r % block_size).to(tl.int64), write


@triton.jit
def _rope_pair(x_ptr, row_off, m_mask, K, inv, nw_ptr, w_ptr, stride_w, col, offs_m, pos_ptr,
               pos_offset, theta, log2_theta_hi, log2_theta_lo, HEAD_DIM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    """Pair chunk `col` (head col // CHUNKS): the products of the head's columns d and D/2 + d,
    each rounded to x's dtype (what the unfused linear stores), rotated in fp32 as
    kernels.rope_kv_write rotates: (head, d, d in range, rotated first half, second half)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = (HALF + BLOCK_HALF - 1) // BLOCK_HALF
    head = col // CHUNKS
    d = (col % CHUNKS) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    offs_k = tl.arange(0, BLOCK_K)
    w_lo = w_ptr + (head * HEAD_DIM + d).to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    w_hi = w_lo + HALF * stride_w
    acc_lo = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        xt = _load_x(x_ptr, row_off, m_mask, kk, K, inv, nw_ptr, True)
        wm = d_mask[:, None] & (kk < K)[None, :]
        acc_lo = tl.dot(xt, tl.trans(tl.load(w_lo + k0, mask=wm, other=0.0)), acc_lo,
                        input_precision="ieee")
        acc_hi = tl.dot(xt, tl.trans(tl.load(w_hi + k0, mask=wm, other=0.0)), acc_hi,
                        input_precision="ieee")
    x1 = acc_lo.to(x_ptr.dtype.element_ty).to(tl.float32)
    x2 = acc_hi.to(x_ptr.dtype.element_ty).to(tl.float32)
    inv_freq = rope_inv_freq(d, HEAD_DIM, theta, log2_theta_hi, log2_theta_lo, LIBDEVICE)
    pos = (tl.load(pos_ptr + offs_m, mask=m_mask, other=0) + pos_offset).to(tl.float32)
    cos, sin = rope_cos_sin(pos[:, None] * inv_freq[None, :], LIBDEVICE)
    return head, d, d_mask, x1 * cos - x2 * sin, x2 * cos + x1 * sin


# the step offsets vary by draft step: unspecialised, one compile serves every step
# (tests/runners/test_capture_precompile.py::test_draft_steps_share_their_compiles)
@triton.jit(do_not_specialize=["pos_offset", "row_offset", "n_rows", "pdl_release"])
def qkv_rope_kernel(
    x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, pos_ptr, live_ptr, tables_ptr, active_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr,
    n_rows, K, eps, stride_x, stride_wq, stride_wk, stride_wv, stride_q_out, stride_tables,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_vc_blk, stride_vc_slot, stride_vc_head,
    pos_offset, row_offset, block_size, theta, log2_theta_hi, log2_theta_lo, pdl_release,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ACTIVE: tl.constexpr, LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = (HALF + BLOCK_HALF - 1) // BLOCK_HALF  # programs a head's pairs take
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    t_q = num_m * NUM_HEADS * CHUNKS
    t_k = num_m * NUM_KV_HEADS * CHUNKS
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, positions and the tables may come from earlier launches
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    tile = tl.where(pid < t_q, pid, tl.where(pid < t_q + t_k, pid - t_q, pid - t_q - t_k))
    offs_m = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_rows
    row_off = offs_m[:, None].to(tl.int64) * stride_x
    inv = _inv_rms(x_ptr, row_off, m_mask, K, eps, BLOCK_M, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    if pid < t_q:  # a rope program: one head's pair chunk of q, to q_out
        head, d, d_mask, lo, hi = _rope_pair(
            x_ptr, row_off, m_mask, K, inv, nw_ptr, wq_ptr, stride_wq, tile // num_m, offs_m,
            pos_ptr, pos_offset, theta, log2_theta_hi, log2_theta_lo, HEAD_DIM, BLOCK_M,
            BLOCK_HALF, BLOCK_K, LIBDEVICE)
        # one name per branch for each pointer: Triton merges a name assigned in every branch,
        # and q_out and the caches may differ in dtype
        q_dst = q_out_ptr + offs_m[:, None].to(tl.int64) * stride_q_out + (head * HEAD_DIM + d)[None, :]
        mask = m_mask[:, None] & d_mask[None, :]
        tl.store(q_dst, lo.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_dst + HALF, hi.to(q_out_ptr.dtype.element_ty), mask=mask)
    elif pid < t_q + t_k:  # of k, to each active row's cache slot
        head, d, d_mask, lo, hi = _rope_pair(
            x_ptr, row_off, m_mask, K, inv, nw_ptr, wk_ptr, stride_wk, tile // num_m, offs_m,
            pos_ptr, pos_offset, theta, log2_theta_hi, log2_theta_lo, HEAD_DIM, BLOCK_M,
            BLOCK_HALF, BLOCK_K, LIBDEVICE)
        blk, slot, write = _slots(offs_m, m_mask, live_ptr, tables_ptr, active_ptr,
                                  stride_tables, row_offset, block_size, HAS_ACTIVE)
        k_dst = (k_cache_ptr + (blk * stride_kc_blk + slot * stride_kc_slot)[:, None]
                 + head * stride_kc_head + d[None, :])
        kmask = write[:, None] & d_mask[None, :]
        tl.store(k_dst, lo.to(k_cache_ptr.dtype.element_ty), mask=kmask)
        tl.store(k_dst + HALF, hi.to(k_cache_ptr.dtype.element_ty), mask=kmask)
    else:  # a v program: kernels.linear's tile, its rows written to their cache slots
        n_v = NUM_KV_HEADS * HEAD_DIM
        cols = (tile // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < n_v
        w_ptrs = wv_ptr + cols[:, None].to(tl.int64) * stride_wv + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xt = _load_x(x_ptr, row_off, m_mask, kk, K, inv, nw_ptr, True)
            wt = tl.load(w_ptrs + k0, mask=c_mask[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        blk, slot, write = _slots(offs_m, m_mask, live_ptr, tables_ptr, active_ptr, stride_tables,
                                  row_offset, block_size, HAS_ACTIVE)
        v_dst = (v_cache_ptr + (blk * stride_vc_blk + slot * stride_vc_slot)[:, None]
                 + (cols // HEAD_DIM)[None, :] * stride_vc_head + (cols % HEAD_DIM)[None, :])
        v = acc.to(x_ptr.dtype.element_ty)  # the linear's rounding, then the cache's dtype
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=write[:, None] & c_mask[None, :])


def rmsnorm_qkv_rope_kv_write(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weights: Sequence[torch.Tensor],
    positions: torch.Tensor, live_rows: torch.Tensor, block_tables: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor, *, head_dim: int,
    theta: float, pos_offset: int, row_offset: int, active: torch.Tensor | None = None,
) -> None:
    """q_out = rope(rmsnorm(x) @ w_q^T); the caches' slot of each (active) row = rope(... @ w_k^T),
    ... @ w_v^T; x [n, K], weights [H*D, K], [Hkv*D, K], [Hkv*D, K]; caches
    [num_blocks, block_size, Hkv, D]. As rmsnorm_linear_qkv then rope_kv_write, one launch."""
    check(len(weights) == 3, lambda: f"three weights (q, k, v), got {len(weights)}")
    n, k = x.shape
    dev = x.device
    check(head_dim % 2 == 0 and head_dim > 0, lambda: f"head_dim {head_dim} must be even")
    wq, wk, wv = weights
    heads, kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    check_operand("x", x, (n, k), FLOAT_DTYPES, dev)
    check_operand("norm_weight", norm_weight, (k,), (x.dtype,), dev)
    for name, w, rows in (("q_weight", wq, heads * head_dim), ("k_weight", wk, kv_heads * head_dim),
                          ("v_weight", wv, kv_heads * head_dim)):
        check_operand(name, w, (rows, k), (x.dtype,), dev)
    check(heads * head_dim == wq.shape[0] and heads >= 1 and kv_heads >= 1,
          lambda: f"q/k weight rows {wq.shape[0]}, {wk.shape[0]} must be whole heads of {head_dim}")
    check_operand("q_out", q_out, (n, heads * head_dim), FLOAT_DTYPES, dev)
    check_operand("positions", positions, (n,), INDEX_DTYPES, dev)
    check_operand("live_rows", live_rows, (n,), (torch.int32,), dev)
    check(block_tables.dim() == 2, lambda: "block_tables must be [n, max_blocks]")
    check_operand("block_tables", block_tables, (n, block_tables.shape[1]), (torch.int32,), dev)
    check(k_cache.dim() == 4, lambda: "k_cache must be [num_blocks, block_size, Hkv, D]")
    cache = (k_cache.shape[0], k_cache.shape[1], kv_heads, head_dim)
    check_operand("k_cache", k_cache, cache, FLOAT_DTYPES, dev)
    check_operand("v_cache", v_cache, cache, FLOAT_DTYPES, dev)
    if active is not None:
        check_operand("active", active, (n,), (torch.int32,), dev)
    if n == 0:
        return
    block_half = half_block(head_dim)
    chunks = triton.cdiv(head_dim // 2, block_half)
    num_m = triton.cdiv(n, BLOCK_M)
    grid = (num_m * (heads + kv_heads) * chunks + num_m * triton.cdiv(kv_heads * head_dim, BLOCK_N),)
    th, hi, lo = theta_parts(theta)
    pdl = launch_kwargs(x)
    qkv_rope_kernel[grid](
        x, norm_weight, wq, wk, wv, positions, live_rows, block_tables,
        active if active is not None else live_rows, k_cache, v_cache, q_out,
        n, k, float(eps), x.stride(0), wq.stride(0), wk.stride(0), wv.stride(0), q_out.stride(0),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        int(pos_offset), int(row_offset), k_cache.shape[1], th, hi, lo,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
        BLOCK_HALF=block_half, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_ACTIVE=active is not None,
        LIBDEVICE=not interpreting(), **pdl_args(pdl, n), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, **pdl)
