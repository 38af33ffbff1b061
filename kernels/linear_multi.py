"""Skinny matmuls that save a launch over kernels.linear, with its pinned tiles and K order, so each
output has kernels.linear's bits for the same operands:

- `linear_qkv(x, (w0, w1, w2), (out0, out1, out2))`: three products of one input in one launch
  (the q/k/v projections); the grid is the three linears' grids laid end to end, each program
  reading its own weight, so no concatenated weight is ever stored.
- `linear_concat(x1, x2, weight, out)`: out = [x1, x2] @ weight^T without materialising the concat
  (the MTP eh_proj over [enorm(emb), hnorm(hidden)]): a K tile selects its elements from x1 below
  K1 and from x2 above, the values the concatenated row holds.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)
from draft_circuit.kernels.linear import BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS


@triton.jit
def _tile(x_ptr, x2_ptr, w_ptr, out_ptr, tile, n_rows, N, K, K1, stride_x, stride_x2, stride_w,
          stride_out, TWO_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """kernels.linear's tile `tile` of out = x @ w^T (x = [x, x2] split at K1 when TWO_X)."""
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m = tile % num_m  # row tiles fastest, as kernels.linear: a weight tile is read once
    pid_n = tile // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    rows = offs_m[:, None].to(tl.int64)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if TWO_X:
            lo = (kk < K1)[None, :]
            hi = ((kk >= K1) & (kk < K))[None, :]
            a = tl.load(x_ptr + rows * stride_x + kk[None, :], mask=m_mask[:, None] & lo, other=0.0)
            b = tl.load(x2_ptr + rows * stride_x2 + (kk - K1)[None, :], mask=m_mask[:, None] & hi,
                        other=0.0)
            x = tl.where(lo, a, b)  # a select, never a sum: the concatenated row's exact values
        else:
            x = tl.load(x_ptr + rows * stride_x + kk[None, :],
                        mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    out_ptrs = out_ptr + rows * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _pick3(pid, t0, t1, a, b, c):
    """a for the first grid's programs, b for the second's, c for the third's: a select, so the
    kernel has one K loop (three inlined loops, one per weight, each kept its own pipeline
    buffers: at BLOCK_M 64 they did not fit two programs an SM)."""
    return tl.where(pid < t0, a, tl.where(pid < t0 + t1, b, c))


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def linear_qkv_kernel(x_ptr, w0, w1, w2, o0, o1, o2, n_rows, N0, N1, N2, K, stride_x,
                      sw0, sw1, sw2, so0, so1, so2, pdl_release,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    t0 = num_m * tl.cdiv(N0, BLOCK_N)
    t1 = num_m * tl.cdiv(N1, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    tile = _pick3(pid, t0, t1, pid, pid - t0, pid - t0 - t1)
    _tile(x_ptr, x_ptr, _pick3(pid, t0, t1, w0, w1, w2), _pick3(pid, t0, t1, o0, o1, o2), tile,
          n_rows, _pick3(pid, t0, t1, N0, N1, N2), K, K, stride_x, stride_x,
          _pick3(pid, t0, t1, sw0, sw1, sw2), _pick3(pid, t0, t1, so0, so1, so2),
          False, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def linear_concat_kernel(x1_ptr, x2_ptr, w_ptr, out_ptr, n_rows, N, K, K1, stride_x1, stride_x2,
                         stride_w, stride_out, pdl_release, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    _tile(x1_ptr, x2_ptr, w_ptr, out_ptr, tl.program_id(0), n_rows, N, K, K1, stride_x1, stride_x2,
          stride_w, stride_out, True, BLOCK_M, BLOCK_N, BLOCK_K)


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.dim() == 2 and t.stride(1) == 1, lambda: f"{describe(name, t)}: expected [rows, cols] "
                                                     "with unit column stride")


def linear_qkv(x: torch.Tensor, weights: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
               tiles: str | None = None) -> None:
    """outs[i][n, N_i] = x[n, K] @ weights[i][N_i, K]^T for the three weights, one launch; the
    outputs any float dtype, one for the three (the kernel selects among their pointers). Its
    row tiles follow kernels.tiles' LINEAR rule (tiles: a mode to force), as kernels.linear's."""
    check(len(weights) == 3 and len(outs) == 3,
          lambda: f"linear_qkv takes three weights and three outputs, got {len(weights)}, {len(outs)}")
    _rows_contiguous("x", x)
    n, k = x.shape
    check_operand("x", x, (n, k), FLOAT_DTYPES, x.device)
    for i, (w, o) in enumerate(zip(weights, outs)):
        _rows_contiguous(f"weight{i}", w)
        _rows_contiguous(f"out{i}", o)
        check_operand(f"weight{i}", w, (w.shape[0], k), (x.dtype,), x.device)
        check_operand(f"out{i}", o, (n, w.shape[0]), FLOAT_DTYPES, x.device)
        check(o.dtype == outs[0].dtype,
              lambda: f"{describe(f'out{i}', o)}: expected out0's dtype {outs[0].dtype} (one "
                      "kernel selects among the three outputs)")
    if n == 0:
        return
    t = tiling.choose(tiling.LINEAR, n, x, tiles,
                      programs=sum(triton.cdiv(w.shape[0], BLOCK_N) for w in weights))
    num_m = triton.cdiv(n, t.block_m)
    grid = (sum(num_m * triton.cdiv(w.shape[0], BLOCK_N) for w in weights),)
    pdl = launch_kwargs(x)
    linear_qkv_kernel[grid](
        x, *weights, *outs, n, *(w.shape[0] for w in weights), k, x.stride(0),
        *(w.stride(0) for w in weights), *(o.stride(0) for o in outs),
        BLOCK_M=t.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_args(pdl, n),
        num_warps=t.warps(NUM_WARPS), num_stages=NUM_STAGES, **pdl)


def linear_concat(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, N] = [x1 | x2][n, K1 + K2] @ weight[N, K1 + K2]^T, the concat never stored."""
    for name, t in (("x1", x1), ("x2", x2), ("weight", weight), ("out", out)):
        _rows_contiguous(name, t)
    n, k1 = x1.shape
    k = k1 + x2.shape[1]
    check_operand("x1", x1, (n, k1), FLOAT_DTYPES, x1.device)
    check_operand("x2", x2, (n, k - k1), (x1.dtype,), x1.device)
    check_operand("weight", weight, (weight.shape[0], k), (x1.dtype,), x1.device)
    check_operand("out", out, (n, weight.shape[0]), FLOAT_DTYPES, x1.device)
    if n == 0 or weight.shape[0] == 0:
        return
    pdl = launch_kwargs(x1)
    grid = (triton.cdiv(n, BLOCK_M) * triton.cdiv(weight.shape[0], BLOCK_N),)
    linear_concat_kernel[grid](
        x1, x2, weight, out, n, weight.shape[0], k, k1, x1.stride(0), x2.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        **pdl_args(pdl, n), num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl)
