"""Skinny linears with what their neighbours did folded into a prologue or an epilogue, so a draft
step launches fewer kernels (issue 15). Every kernel here keeps kernels.linear's pinned BLOCK_N,
BLOCK_K, stages and K order, so a row's bits never depend on n. The row tile follows
kernels.tiles' rule (kind PROLOGUE) like kernels.linear's: BLOCK_M 16 at n <= 16 and under the
interpreter, BLOCK_M 64 with 4 warps at n > 16 on an H200 (tiles only, never BLOCK_K or the K
order: not the bits; the launchers' `tiles=` forces a mode):

- prologue `norm`: x is rmsnorm(x, norm_weight) in HF order, computed per row tile: a first pass
  over the row sums squares in fp32 in fixed NORM_BLOCK_K chunks (one row's sum reads only that
  row), then every K tile is normalised as it is loaded, (x * inv_rms) rounded to x's dtype,
  times the weight, rounded again: the values the rmsnorm kernel stores, up to the order of its
  sum. The tile pieces live in kernels.prologue_tiles (the split-K, lm-head and q/k/v-rope
  kernels share them); x's next tile is loaded a K step ahead by hand.
- prologue `gather`: x1's rows are rows of a table picked by int ids (the embedding); a negative
  or out-of-table id reads a zero row (an all-masked draft, -1, embeds as zeros by policy).
- `linear_prologue(...)`: out = [p1(x1) | p2(x2)] @ W^T with the concat never stored (x2
  optional), optionally SwiGLU (W = [Wg; Wu]) and optionally + residual (the add after o_proj /
  down_proj, one rounding of the product first, as linear then add).
- `rmsnorm_linear_qkv(...)`: rmsnorm then q/k/v's three products in one launch (three weights as
  bound, no concatenated copy), like kernels.linear_multi.linear_qkv.

Every launcher issues exactly one kernel, or two when given a `normed` buffer: the prologue is
then a launch of its own (kernels.prologue_norm) and the kernel reads its output as plain x, at
the widths where that measured faster (the op bindings declare both counts).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels._common import (FLOAT_DTYPES, INDEX_DTYPES, check, check_operand,
                                           describe, launch_kwargs, pdl_args)
from draft_circuit.kernels.linear import BLOCK_K, BLOCK_N, NUM_STAGES, NUM_WARPS
from draft_circuit.kernels.linear_multi import linear_qkv
from draft_circuit.kernels.prologue_norm import prologue_norm
from draft_circuit.kernels.prologue_tiles import (NORM_BLOCK_K, _inv_rms, _mac, _norm_x,
                                                  _prologue_rows, _raw_x, _x_finish, _x_raw,
                                                  _x_tile)

LAUNCHES = 1  # kernels each launcher here issues (two with `normed`: see the module docstring)
assert NORM_BLOCK_K == BLOCK_K  # the norm's chunks are the K tiles (prologue_tiles defines them)


@triton.jit(do_not_specialize=["n_rows", "table_rows", "pdl_release"])
def linear_prologue_kernel(
    x1_ptr, ids_ptr, nw1_ptr, x2_ptr, nw2_ptr, w_ptr, res_ptr, out_ptr,
    n_rows, N, K, K1, table_rows, eps1, eps2,
    stride_x1, stride_x2, stride_w, stride_res, stride_out, up_offset, pdl_release,
    GATHER: tl.constexpr, NORM1: tl.constexpr, TWO_X: tl.constexpr, NORM2: tl.constexpr,
    SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m = pid % num_m  # row tiles fastest, as kernels.linear: a weight tile is read once
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    w0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    u0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
    if PREFETCH:
        # the first K tile of the weights never depends on an earlier launch: load it before
        # waiting on the predecessor, so its DRAM latency hides under the predecessor's tail
        k_ok0 = (offs_k < K)[None, :]
        w0 = tl.load(w_ptrs, mask=n_mask[:, None] & k_ok0, other=0.0)
        if SILU_MUL:
            u0 = tl.load(w_ptrs + up_offset, mask=n_mask[:, None] & k_ok0, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, ids and the residual may come from the previous launch
        if pdl_release != 0 and not PREFETCH:  # early release (_common.pdl_args, a runtime
            tl.extra.cuda.gdc_launch_dependents()  # int): the next launch may start now (PREFETCH:
            # after its first K step, below)
    off1, ok1, off2, inv1, inv2 = _prologue_rows(
        x1_ptr, ids_ptr, x2_ptr, offs_m, m_mask, stride_x1, stride_x2, table_rows, K, K1, eps1,
        eps2, GATHER, NORM1, NORM2, BLOCK_M, NORM_BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = 0
    if PREFETCH:  # the first K step on the prefetched tile: the same products in the same order
        x = _x_tile(x1_ptr, off1, ok1, K1, inv1, nw1_ptr, x2_ptr, off2, m_mask, inv2, nw2_ptr,
                    offs_k, K, TWO_X, NORM1, NORM2)
        acc = tl.dot(x, tl.trans(w0), acc, input_precision="ieee")
        if SILU_MUL:
            acc_up = tl.dot(x, tl.trans(u0), acc_up, input_precision="ieee")
        start = BLOCK_K
        if USE_PDL:  # the next launch may start its own prefetch now
            tl.extra.cuda.gdc_launch_dependents()
    if NORM1 or TWO_X:
        # a prologue: x's next tile is loaded a K step ahead, by hand (see _raw_x)
        a, na, b, nb = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask, nw2_ptr,
                              start + offs_k, K, TWO_X, NORM1, NORM2)
        for k0 in range(start, K, BLOCK_K):
            kk = k0 + offs_k
            a2, na2, b2, nb2 = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask,
                                      nw2_ptr, kk + BLOCK_K, K, TWO_X, NORM1, NORM2)
            x = _x_finish(a, na, b, nb, inv1, inv2, kk, K1, TWO_X, NORM1, NORM2)
            acc, acc_up = _mac(x, w_ptrs, k0, kk, K, n_mask, up_offset, acc, acc_up, SILU_MUL)
            a, na, b, nb = a2, na2, b2, nb2
    else:  # x feeds tl.dot as loaded: Triton's pipeliner stages it
        for k0 in range(start, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x1_ptr + off1 + kk[None, :], mask=ok1[:, None] & (kk < K)[None, :],
                        other=0.0)
            acc, acc_up = _mac(x, w_ptrs, k0, kk, K, n_mask, up_offset, acc, acc_up, SILU_MUL)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:
        # linear then add: the product rounds to out's dtype first, then the fp32 sum of two
        # values of that dtype rounds once (exactly torch's add for 16-bit operands)
        r = tl.load(res_ptr + offs_m[:, None].to(tl.int64) * stride_res + offs_n[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_tile(x_ptr, nw_ptr, inv, w_ptr, out_ptr, tile, num_m, n_rows, N, K, stride_x, stride_w,
              stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tile % num_m
    pid_n = tile // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    row_off = offs_m[:, None].to(tl.int64) * stride_x
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xr, nw = _raw_x(x_ptr, row_off, m_mask, offs_k, K, nw_ptr, True)
    for k0 in range(0, K, BLOCK_K):  # x's next tile a K step ahead, by hand (see _raw_x)
        kk = k0 + offs_k
        xr2, nw2 = _raw_x(x_ptr, row_off, m_mask, kk + BLOCK_K, K, nw_ptr, True)
        x = _norm_x(xr, nw, inv, True)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        xr, nw = xr2, nw2
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def rmsnorm_linear_qkv_kernel(x_ptr, nw_ptr, w0, w1, w2, o0, o1, o2, n_rows, N0, N1, N2, K, eps,
                              stride_x, sw0, sw1, sw2, so0, so1, so2, pdl_release,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              USE_PDL: tl.constexpr, NORM_BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    t0 = num_m * tl.cdiv(N0, BLOCK_N)
    t1 = num_m * tl.cdiv(N1, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    # the tile's rows are pid % num_m in every one of the three grids laid end to end
    tile = tl.where(pid < t0, pid, tl.where(pid < t0 + t1, pid - t0, pid - t0 - t1))
    offs_m = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_rows
    inv = _inv_rms(x_ptr, offs_m[:, None].to(tl.int64) * stride_x, m_mask, K, eps, BLOCK_M,
                   NORM_BLOCK_K)
    # three K loops, one per weight: one loop over selected pointers measured slower here (an
    # H100, one call: 32.0 against 25.9 us at n = 1), where kernels.linear_multi's plain kernel
    # gained from it at n = 64
    if pid < t0:
        _qkv_tile(x_ptr, nw_ptr, inv, w0, o0, tile, num_m, n_rows, N0, K, stride_x, sw0, so0,
                  BLOCK_M, BLOCK_N, BLOCK_K)
    elif pid < t0 + t1:
        _qkv_tile(x_ptr, nw_ptr, inv, w1, o1, tile, num_m, n_rows, N1, K, stride_x, sw1, so1,
                  BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _qkv_tile(x_ptr, nw_ptr, inv, w2, o2, tile, num_m, n_rows, N2, K, stride_x, sw2, so2,
                  BLOCK_M, BLOCK_N, BLOCK_K)


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.dim() == 2 and t.stride(1) == 1,
          lambda: f"{describe(name, t)}: expected [rows, cols] with unit column stride")


def _norm_weight(name: str, w: torch.Tensor | None, k: int, x: torch.Tensor) -> None:
    if w is not None:
        check_operand(name, w, (k,), (x.dtype,), x.device)
        check(w.is_contiguous(), lambda: f"{describe(name, w)}: expected contiguous")


def check_prologue_operands(x1: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                            ids: torch.Tensor | None, norm1: torch.Tensor | None,
                            x2: torch.Tensor | None, norm2: torch.Tensor | None, silu_mul: bool,
                            residual: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """A prologue linear's operands as `linear_prologue` takes them (kernels.linear_fused_splitk
    takes the same), checked; (n, K, K1, weight rows, output columns). Raises KernelInputError
    naming the operand."""
    for name, t in (("x1", x1), ("weight", weight), ("out", out)):
        _rows_contiguous(name, t)
    dtype, device = x1.dtype, x1.device
    check(dtype in FLOAT_DTYPES, lambda: f"{describe('x1', x1)}: expected a float dtype")
    if ids is not None:
        check(ids.dim() == 1 and ids.dtype in INDEX_DTYPES and ids.is_contiguous()
              and ids.device == device, lambda: f"{describe('ids', ids)}: expected int [n] contiguous")
        n = ids.shape[0]
    else:
        n = x1.shape[0]
    k1 = x1.shape[1]
    k = k1
    if x2 is not None:
        _rows_contiguous("x2", x2)
        check_operand("x2", x2, (n, x2.shape[1]), (dtype,), device)
        k += x2.shape[1]
    check(norm2 is None or x2 is not None, lambda: "norm2 needs x2")
    _norm_weight("norm1", norm1, k1, x1)
    _norm_weight("norm2", norm2, k - k1, x1)
    rows = weight.shape[0]
    check(not silu_mul or rows % 2 == 0, lambda: f"{describe('weight', weight)}: SwiGLU needs [2I, K]")
    n_out = rows // 2 if silu_mul else rows
    check_operand("weight", weight, (rows, k), (dtype,), device)
    check_operand("out", out, (n, n_out), FLOAT_DTYPES, device)
    if residual is not None:
        _rows_contiguous("residual", residual)
        check_operand("residual", residual, (n, n_out), (out.dtype,), device)
    return n, k, k1, rows, n_out


def linear_prologue(x1: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *,
                    ids: torch.Tensor | None = None, norm1: torch.Tensor | None = None,
                    eps1: float = 1e-6, x2: torch.Tensor | None = None,
                    norm2: torch.Tensor | None = None, eps2: float = 1e-6,
                    silu_mul: bool = False, residual: torch.Tensor | None = None,
                    prefetch: bool = False, tiles: str | None = None,
                    normed: torch.Tensor | None = None) -> None:
    """out[n, N] = [p1(x1) | p2(x2)] @ weight^T, one launch (two with `normed`).

    p1: with `ids` int [n], x1 is a table [V, K1] and row i reads x1[ids[i]] (zeros for an id
    outside [0, V)); then rmsnorm with `norm1` [K1] (eps1) if given. p2 likewise with `norm2` on
    x2 [n, K2] (x2 absent: K = K1). silu_mul: weight is [Wg; Wu] [2N, K] and out is
    silu(p @ Wg^T) * (p @ Wu^T), rounded once. residual [n, N]: out = round(p @ W^T) + residual,
    rounded again (linear then add). Floats share one dtype except out (any float).
    prefetch: the first weight tile is loaded before the PDL wait and dependents are released
    after the first K step (the same products in the same order: the same bits; a variant for
    the tuning pass to measure, GPU only in effect). tiles: a kernels.tiles PROLOGUE mode to
    force (None: its rule). normed [n, K] (x1's dtype): the prologue is a launch of its own
    (kernels.prologue_norm stores [p1(x1) | p2(x2)] there), then this kernel reads it as plain x;
    the same bits, for the widths where that pays (prologue_norm.prenorm_pays).
    """
    n, k, k1, rows, n_out = check_prologue_operands(x1, weight, out, ids, norm1, x2, norm2,
                                                    silu_mul, residual)
    if n == 0 or n_out == 0:
        return
    if normed is not None:
        prologue_norm(x1, normed, n=n, k=k, ids=ids, norm1=norm1, eps1=eps1, x2=x2, norm2=norm2,
                      eps2=eps2)
        x1, ids, norm1, x2, norm2, k1 = normed, None, None, None, None, k
    pdl = launch_kwargs(x1)
    # with the prologue done, the kernel is kernels.linear's loop: its tile rule (wide from n 16)
    kind = tiling.PROLOGUE if normed is None else tiling.LINEAR
    t = tiling.choose(kind, n, x1, tiles, programs=triton.cdiv(n_out, BLOCK_N))
    grid = (triton.cdiv(n, t.block_m) * triton.cdiv(n_out, BLOCK_N),)
    linear_prologue_kernel[grid](
        x1, ids if ids is not None else x1, norm1 if norm1 is not None else x1,
        x2 if x2 is not None else x1, norm2 if norm2 is not None else x1, weight,
        residual if residual is not None else out, out,
        n, n_out, k, k1, x1.shape[0], float(eps1), float(eps2),
        x1.stride(0), x2.stride(0) if x2 is not None else 0, weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        n_out * weight.stride(0) if silu_mul else 0,
        GATHER=ids is not None, NORM1=norm1 is not None, TWO_X=x2 is not None,
        NORM2=norm2 is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
        BLOCK_M=t.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_args(pdl, n),
        PREFETCH=prefetch, NORM_BLOCK_K=NORM_BLOCK_K, num_warps=t.warps(NUM_WARPS),
        num_stages=NUM_STAGES,
        **pdl)


def rmsnorm_linear_qkv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weights: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                       tiles: str | None = None, normed: torch.Tensor | None = None) -> None:
    """outs[i][n, N_i] = rmsnorm(x, norm_weight, eps) @ weights[i]^T for three weights, one
    launch; the normed row is never stored. tiles: a kernels.tiles PROLOGUE mode to force (with
    `normed`, a LINEAR one). normed [n, K] (x's dtype): the norm is a launch of its own into it
    (kernels.prologue_norm), then kernels.linear_multi.linear_qkv reads it; the same bits, two
    launches; the three outputs then share a dtype."""
    check(len(weights) == 3 and len(outs) == 3,
          lambda: f"rmsnorm_linear_qkv takes three weights and three outputs, got {len(weights)}, {len(outs)}")
    _rows_contiguous("x", x)
    n, k = x.shape
    check_operand("x", x, (n, k), FLOAT_DTYPES, x.device)
    _norm_weight("norm_weight", norm_weight, k, x)
    for i, (w, o) in enumerate(zip(weights, outs)):
        _rows_contiguous(f"weight{i}", w)
        _rows_contiguous(f"out{i}", o)
        check_operand(f"weight{i}", w, (w.shape[0], k), (x.dtype,), x.device)
        check_operand(f"out{i}", o, (n, w.shape[0]), FLOAT_DTYPES, x.device)
    if n == 0:
        return
    if normed is not None:
        prologue_norm(x, normed, n=n, k=k, norm1=norm_weight, eps1=eps)
        linear_qkv(normed, weights, outs, tiles=tiles)
        return
    t = tiling.choose(tiling.PROLOGUE, n, x, tiles,
                      programs=sum(triton.cdiv(w.shape[0], BLOCK_N) for w in weights))
    num_m = triton.cdiv(n, t.block_m)
    grid = (sum(num_m * triton.cdiv(w.shape[0], BLOCK_N) for w in weights),)
    pdl = launch_kwargs(x)
    rmsnorm_linear_qkv_kernel[grid](
        x, norm_weight, *weights, *outs, n, *(w.shape[0] for w in weights), k, float(eps),
        x.stride(0), *(w.stride(0) for w in weights), *(o.stride(0) for o in outs),
        BLOCK_M=t.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_args(pdl, n),
        NORM_BLOCK_K=NORM_BLOCK_K, num_warps=t.warps(NUM_WARPS), num_stages=NUM_STAGES, **pdl)
