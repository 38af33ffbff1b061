"""Neox-style rotary embedding of q and k plus the paged KV-cache write, in one launch.

q_out = rope(q) (with rotary_dim R < head_dim: rotate-half inside each head's first R dims, the
rest copied, HF's partial rotary); k_cache/v_cache[block_tables[i, r // bs], r % bs] = rope(k)[i], v[i] with
r = live_rows[i] + row_offset; rows with active[i] == 0 leave the caches untouched. Grid (n, H + Hkv).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, INDEX_DTYPES, check, check_operand, describe, interpreting, launch_kwargs,
    pdl_args,
)


@triton.jit
def rope_inv_freq(j, rotary_dim, theta, log2_theta_hi, log2_theta_lo, LIBDEVICE: tl.constexpr):
    """inv_freq[j] = 1 / theta ** (2j / R), rounded as the fp32 reference rounds it: the power,
    then the reciprocal (div_rn: Triton's `/` is approximate on the GPU)."""
    e = tl.div_rn((2 * j).to(tl.float32), tl.zeros(j.shape, tl.float32) + rotary_dim)
    if LIBDEVICE:
        power = tl.extra.cuda.libdevice.pow(theta, e)  # __nv_powf, as torch's CUDA pow
    else:
        # No libdevice in the interpreter. exp2(e * log2(theta)) would lose ~|arg| ulps to the
        # rounding of the product, so it is kept as hi + lo (an fma and a split log2(theta)).
        prod_hi = e * log2_theta_hi
        prod_lo = tl.fma(e, log2_theta_hi, -prod_hi) + e * log2_theta_lo
        base = tl.exp2(prod_hi)
        power = tl.fma(base, prod_lo * 0.6931471805599453, base)
    return tl.div_rn(tl.zeros(j.shape, tl.float32) + 1.0, power)


@triton.jit
def rope_cos_sin(angle, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        # libdevice sinf/cosf reduce any argument fully (positions reach 1e5), whatever a given
        # Triton version lowers tl.sin to.
        return tl.extra.cuda.libdevice.cos(angle), tl.extra.cuda.libdevice.sin(angle)
    return tl.cos(angle), tl.sin(angle)


def theta_parts(theta: float) -> tuple[float, float, float]:
    """(theta, log2(theta) rounded to fp32, the remainder): the kernels' rope arguments."""
    theta = float(theta)  # an int would reach the kernel as i32
    log2_theta = math.log2(theta)
    hi = float(np.float32(log2_theta))  # exact in fp32; the remainder goes in _lo
    return theta, hi, log2_theta - hi


# the step offsets vary by draft step: unspecialised, one compile serves every step
# (tests/runners/test_capture_precompile.py::test_draft_steps_share_their_compiles)
@triton.jit(do_not_specialize=["pos_offset", "row_offset", "pdl_release"])
def rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, live_ptr, tables_ptr, active_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr,
    stride_q, stride_k, stride_v, stride_q_out, stride_tables,
    stride_cache_blk, stride_cache_slot, stride_cache_head,
    stride_vcache_blk, stride_vcache_slot, stride_vcache_head,
    pos_offset, row_offset, block_size,
    theta, log2_theta_hi, log2_theta_lo, pdl_release,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # [0, NUM_HEADS) are q heads, [NUM_HEADS, NUM_HEADS + Hkv) are kv heads
    half: tl.constexpr = ROTARY_DIM // 2  # rotate-half pairs (j, half + j) of the rotated part
    j = tl.arange(0, BLOCK_HALF)
    mask = j < half
    p = ROTARY_DIM + tl.arange(0, BLOCK_PASS)  # the dims that pass through unrotated
    p_mask = p < HEAD_DIM

    inv_freq = rope_inv_freq(j, ROTARY_DIM, theta, log2_theta_hi, log2_theta_lo, LIBDEVICE)

    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q, k, v, positions and the tables come from earlier launches
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    pos = (tl.load(pos_ptr + row) + pos_offset).to(tl.float32)
    cos, sin = rope_cos_sin(pos * inv_freq, LIBDEVICE)

    if head < NUM_HEADS:
        src = q_ptr + row * stride_q + head * HEAD_DIM
        x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
        dst = q_out_ptr + row * stride_q_out + head * HEAD_DIM
        tl.store(dst + j, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + j, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
        if ROTARY_DIM < HEAD_DIM:
            tl.store(dst + p, tl.load(src + p, mask=p_mask).to(q_out_ptr.dtype.element_ty), mask=p_mask)
    else:
        kv_head = head - NUM_HEADS
        write = True
        if HAS_ACTIVE:
            write = tl.load(active_ptr + row) != 0
        if write:
            r = tl.load(live_ptr + row) + row_offset
            blk = tl.load(tables_ptr + row * stride_tables + r // block_size).to(tl.int64)
            slot = r % block_size
            src = k_ptr + row * stride_k + kv_head * HEAD_DIM
            x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
            dst = k_cache_ptr + blk * stride_cache_blk + slot * stride_cache_slot \
                + kv_head * stride_cache_head
            tl.store(dst + j, (x1 * cos - x2 * sin).to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half + j, (x2 * cos + x1 * sin).to(k_cache_ptr.dtype.element_ty),
                     mask=mask)
            if ROTARY_DIM < HEAD_DIM:
                tl.store(dst + p, tl.load(src + p, mask=p_mask).to(k_cache_ptr.dtype.element_ty),
                         mask=p_mask)
            v_src = v_ptr + row * stride_v + kv_head * HEAD_DIM
            v_dst = v_cache_ptr + blk * stride_vcache_blk + slot * stride_vcache_slot \
                + kv_head * stride_vcache_head
            v_half: tl.constexpr = HEAD_DIM // 2  # BLOCK_HALF covers half a head
            v_mask = j < v_half
            for part in tl.static_range(2):
                v = tl.load(v_src + part * v_half + j, mask=v_mask, other=0.0)
                tl.store(v_dst + part * v_half + j, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    live_rows: torch.Tensor,
    block_tables: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_out: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    theta: float,
    pos_offset: int,
    row_offset: int,
    active: torch.Tensor | None = None,
    rotary_dim: int | None = None,
) -> None:
    """q_out = rope(q) and the paged write of rope(k), v; one launch, grid (n, num_heads + num_kv_heads).

    q, q_out [n, H*D]; k, v [n, Hkv*D]; positions [n] int32/int64; live_rows, active [n] int32;
    block_tables [n, max_blocks] int32; caches [num_blocks, block_size, Hkv, D] with unit last
    stride. rotary_dim (even, <= head_dim; None: head_dim) is the rotated part of each head.
    q_out may alias q. Indices are not bounds-checked on the device: padded rows must be
    inactive (or point at a scratch block).
    """
    n = q.shape[0]
    dev = q.device
    check(head_dim % 2 == 0 and head_dim > 0, lambda: f"head_dim {head_dim} must be even")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    check(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
          lambda: f"rotary_dim {rotary_dim} must be even and in (0, head_dim = {head_dim}]")
    check_operand("q", q, (n, num_heads * head_dim), FLOAT_DTYPES, dev)
    check_operand("q_out", q_out, (n, num_heads * head_dim), FLOAT_DTYPES, dev)
    check_operand("k", k, (n, num_kv_heads * head_dim), FLOAT_DTYPES, dev)
    check_operand("v", v, (n, num_kv_heads * head_dim), FLOAT_DTYPES, dev)
    check_operand("positions", positions, (n,), INDEX_DTYPES, dev)
    check_operand("live_rows", live_rows, (n,), (torch.int32,), dev)
    check(block_tables.dim() == 2,
          lambda: f"{describe('block_tables', block_tables)}: expected [n, max_blocks]")
    check_operand("block_tables", block_tables, (n, block_tables.shape[1]), (torch.int32,), dev)
    check(k_cache.dim() == 4,
          lambda: f"{describe('k_cache', k_cache)}: expected [num_blocks, block_size, Hkv, D]")
    num_blocks, block_size = k_cache.shape[:2]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    check_operand("k_cache", k_cache, cache_shape, FLOAT_DTYPES, dev)
    check_operand("v_cache", v_cache, cache_shape, FLOAT_DTYPES, dev)
    if active is not None:
        check_operand("active", active, (n,), (torch.int32,), dev)
    if n == 0:
        return
    theta, log2_theta_hi, log2_theta_lo = theta_parts(theta)
    pdl = launch_kwargs(q)
    rope_kv_write_kernel[(n, num_heads + num_kv_heads)](
        q, k, v, positions, live_rows, block_tables, active if active is not None else live_rows,
        k_cache, v_cache, q_out,
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        int(pos_offset), int(row_offset), block_size,
        theta, log2_theta_hi, log2_theta_lo,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        HAS_ACTIVE=active is not None, LIBDEVICE=not interpreting(), **pdl_args(pdl, n),
        num_warps=1 if head_dim <= 128 else 2,
        **pdl,
    )
