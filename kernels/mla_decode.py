"""Absorbed MLA decode over a paged latent cache: every query head of a row attends over the row's
L = live_rows + row_offset + 1 latent rows (c [R] in latent_cache, k_pe [P] in pe_cache, one cached
head shared by all query heads).

Contract: out[i, h] = softmax(scale * (q_lat[i, h] . c_t + q_pe[i, h] . k_pe_t)) @ c in fp32 (the
probabilities meet c in c's dtype, as flash attention does), cast to q_lat's dtype. Programs
(row, block of HEAD_BLOCK heads, split of SPLIT_ROWS rows) write partial (acc, max, sum) to a
workspace that kernels.decode_attention's merge kernel folds in split order: a row never depends
on n, nor on the other rows' lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (FLOAT_DTYPES, check, check_operand, describe,
                                           fp32_workspace, launch_kwargs, pdl_args)
from draft_circuit.kernels.decode_attention import _merge_kernel  # the same (acc, m, l) layout

# Pinned for every n and L (a split size, never a split count): bitwise width independence.
# HEAD_BLOCK and BLOCK_N are tl.dot's smallest tiles; the [HEAD_BLOCK, R] fp32 accumulator is the
# register budget (R = 512: 32 floats a thread at 8 warps). Not tuned on the H200 yet.
SPLIT_ROWS = 128
HEAD_BLOCK, BLOCK_N = 16, 16
MERGE_NUM_WARPS = 4
_LOG2E = 1.4426950408889634


# the step offsets vary by draft step: unspecialised, one compile serves every step
# (tests/runners/test_capture_precompile.py::test_draft_steps_share_their_compiles)
@triton.jit(do_not_specialize=["row_offset", "pdl_release"])
def _split_kernel(
    q_lat_ptr, q_pe_ptr, pe_ptr, latent_ptr, tables_ptr, live_ptr, ws_ptr,
    row_offset, capacity, max_splits, block_size, qk_scale_log2,
    stride_ql, stride_qp, stride_table, stride_pb, stride_ps, stride_lb, stride_ls, pdl_release,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    # clamp: never past the block table (its tail may be garbage), never below zero rows
    L = tl.minimum(tl.maximum(tl.load(live_ptr + seq) + row_offset + 1, 0), capacity)
    lo = split * SPLIT
    if lo < L:
        hi = tl.minimum(lo + SPLIT, L)
        heads = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        head_ok = heads < NUM_HEADS
        d = tl.arange(0, R_PAD)
        e = tl.arange(0, P_PAD)
        d_ok, e_ok = d < R, e < P
        q_lat = tl.load(q_lat_ptr + seq * stride_ql + heads[:, None] * R + d[None, :],
                        mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # [HB, R]
        q_pe = tl.load(q_pe_ptr + seq * stride_qp + heads[:, None] * P + e[None, :],
                       mask=head_ok[:, None] & e_ok[None, :], other=0.0)  # [HB, P]
        m = tl.full([HEAD_BLOCK], float("-inf"), tl.float32)  # running max, log2 domain
        l = tl.zeros([HEAD_BLOCK], tl.float32)  # running sum of exp2(s - m)
        acc = tl.zeros([HEAD_BLOCK, R_PAD], tl.float32)  # running sum of p c
        for start in range(lo, hi, BLOCK_N):
            r = start + tl.arange(0, BLOCK_N)
            live = r < hi
            # a dead row's table entry is neither read nor used: its address becomes block 0's
            blk = tl.load(tables_ptr + seq * stride_table + r // block_size, mask=live, other=0)
            blk = tl.where(live, blk, 0).to(tl.int64)
            slot = (r % block_size).to(tl.int64)
            c = tl.load(latent_ptr + (blk * stride_lb + slot * stride_ls)[:, None] + d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, R]
            k_pe = tl.load(pe_ptr + (blk * stride_pb + slot * stride_ps)[:, None] + e[None, :],
                           mask=live[:, None] & e_ok[None, :], other=0.0)  # [BLOCK_N, P]
            # ieee: fp32 operands never drop to tf32; 16-bit ones ignore it
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee") * qk_scale_log2  # [HB, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every step holds a live row
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision="ieee")
            m = m_new
        # workspace [n, NUM_HEADS, max_splits, R + 2]: (acc[0:R], m, l) per split
        part = ws_ptr + ((seq * NUM_HEADS + heads) * max_splits + split) * (R + 2)
        tl.store(part[:, None] + d[None, :], acc, mask=head_ok[:, None] & d_ok[None, :])
        tl.store(part + R, m, mask=head_ok)
        tl.store(part + R + 1, l, mask=head_ok)


def mla_decode_workspace_shape(n: int, num_heads: int, kv_lora_rank: int, max_rows: int,
                               split_rows: int = SPLIT_ROWS) -> tuple[int, int, int, int]:
    """fp32 workspace: per (row, head, split) the unnormalised latent acc [R], max and sum.
    max_rows is the block table's capacity, block_tables.shape[1] * block_size."""
    return (n, num_heads, triton.cdiv(max_rows, split_rows), kv_lora_rank + 2)


def _check_inputs(q_lat: torch.Tensor, q_pe: torch.Tensor, pe_cache: torch.Tensor, latent_cache: torch.Tensor,
                  block_tables: torch.Tensor, live_rows: torch.Tensor, out: torch.Tensor,
                  row_offset: int) -> tuple[int, int, int]:
    """(heads, R, P) after every operand is checked."""
    dev = q_lat.device
    check(q_lat.dim() == 2 and q_pe.dim() == 2 and pe_cache.dim() == 4 and latent_cache.dim() == 4
          and pe_cache.shape[2] == 1 and pe_cache.shape[:3] == latent_cache.shape[:3],
          lambda: f"expected q_lat [n, H*R], q_pe [n, H*P], pe_cache [num_blocks, block_size, 1, P], "
                  f"latent_cache [num_blocks, block_size, 1, R]; got {describe('q_lat', q_lat)}, "
                  f"{describe('q_pe', q_pe)}, {describe('pe_cache', pe_cache)}, "
                  f"{describe('latent_cache', latent_cache)}")
    n, r, p = q_lat.shape[0], latent_cache.shape[3], pe_cache.shape[3]
    heads = q_lat.shape[1] // r
    check(heads > 0 and heads * r == q_lat.shape[1] and heads * p == q_pe.shape[1],
          lambda: f"q_lat {list(q_lat.shape)} and q_pe {list(q_pe.shape)} do not split into the same heads "
                  f"of R = {r} and P = {p}")
    check_operand("q_lat", q_lat, (n, heads * r), FLOAT_DTYPES, dev)
    check_operand("q_pe", q_pe, (n, heads * p), (q_lat.dtype,), dev)
    check_operand("pe_cache", pe_cache, tuple(pe_cache.shape), (q_lat.dtype,), dev)
    check_operand("latent_cache", latent_cache, tuple(latent_cache.shape), (q_lat.dtype,), dev)
    check(row_offset >= 0, lambda: f"row_offset must be >= 0; got {row_offset}")
    check(block_tables.dim() == 2 and block_tables.shape[1] > 0,
          lambda: f"{describe('block_tables', block_tables)}: expected [n, max_blocks >= 1]")
    check_operand("block_tables", block_tables, (n, block_tables.shape[1]), (torch.int32,), dev)
    check_operand("live_rows", live_rows, (n,), (torch.int32,), dev)
    check_operand("out", out, (n, heads * r), (q_lat.dtype,), dev)
    return heads, r, p


def mla_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, pe_cache: torch.Tensor,
                         latent_cache: torch.Tensor, block_tables: torch.Tensor, live_rows: torch.Tensor,
                         out: torch.Tensor, *, scale: float, row_offset: int = 0,
                         workspace: torch.Tensor | None = None, split_rows: int = SPLIT_ROWS) -> None:
    """q_lat, out [n, H*R]; q_pe [n, H*P]; pe_cache [num_blocks, block_size, 1, P]; latent_cache
    [num_blocks, block_size, 1, R]; no host sync."""
    heads, r, p = _check_inputs(q_lat, q_pe, pe_cache, latent_cache, block_tables, live_rows, out, row_offset)
    check(split_rows >= BLOCK_N and split_rows % BLOCK_N == 0,
          lambda: f"split_rows must be a positive multiple of {BLOCK_N}; got {split_rows}")
    n, block_size = q_lat.shape[0], pe_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    shape = mla_decode_workspace_shape(n, heads, r, capacity, split_rows)
    workspace = fp32_workspace(workspace, shape, q_lat.device)
    if n == 0:
        return
    kw = launch_kwargs(q_lat)
    r_pad = max(16, triton.next_power_of_2(r))
    _split_kernel[(n, triton.cdiv(heads, HEAD_BLOCK), shape[2])](
        q_lat, q_pe, pe_cache, latent_cache, block_tables, live_rows, workspace,
        row_offset, capacity, shape[2], block_size, scale * _LOG2E,
        q_lat.stride(0), q_pe.stride(0), block_tables.stride(0), pe_cache.stride(0), pe_cache.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        NUM_HEADS=heads, R=r, P=p, R_PAD=r_pad, P_PAD=max(16, triton.next_power_of_2(p)),
        HEAD_BLOCK=HEAD_BLOCK, BLOCK_N=BLOCK_N, SPLIT=split_rows, **pdl_args(kw, n),
        num_warps=8 if r_pad >= 256 else 4, **kw,
    )
    _merge_kernel[(n, heads)](
        workspace, live_rows, out, row_offset, capacity, shape[2], out.stride(0),
        NUM_HEADS=heads, HEAD_DIM=r, D_PAD=triton.next_power_of_2(r), SPLIT=split_rows,
        **pdl_args(kw, n),
        num_warps=MERGE_NUM_WARPS, **kw,
    )
