"""Skinny matmul with fp8 e4m3 weights and per-row block scales: out[n, N] = x[n, K] @ (W * s)^T,
W [N, K] fp8 e4m3, s [N, ceil(K / 128)] f32 (row r's scale for columns 128 k .. 128 k + 127: a
DeepSeek-V3 128x128 `weight_scale_inv` expanded to rows, so the rows may be split or permuted).

Each 128-column K tile is one tl.dot of x with the exactly converted fp8 tile (fp32 accumulation),
scaled per output column and added in K order; one pinned tiling: a row's bits never depend on n.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)

SCALE_BLOCK = 128
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, SCALE_BLOCK  # a K tile is one scale block
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def linear_fp8_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, n_rows, N, K, stride_x, stride_w, stride_s, stride_out, pdl_release,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m  # row tiles fastest: programs sharing a weight tile run together
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < n_rows, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(x.dtype)  # exact
        scale = tl.load(s_ptrs + kb, mask=n_mask, other=0.0)
        part = tl.dot(x, tl.trans(w), input_precision="ieee")  # fp32 operands never drop to tf32
        acc += part * scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor, out: torch.Tensor) -> None:
    """x [n, K] fp32/fp16/bf16; weight [N, K] float8_e4m3fn; row_scale [N, ceil(K / 128)] float32;
    out [n, N] any float dtype. No host sync."""
    check(x.dim() == 2 and weight.dim() == 2, lambda: f"{describe('x', x)}, {describe('weight', weight)}: "
          "expected [n, K] and [N, K]")
    (n, k), rows = x.shape, weight.shape[0]
    check_operand("x", x, (n, k), FLOAT_DTYPES, x.device)
    check_operand("weight", weight, (rows, k), (torch.float8_e4m3fn,), x.device)
    check_operand("row_scale", row_scale, (rows, triton.cdiv(k, SCALE_BLOCK)), (torch.float32,), x.device)
    check_operand("out", out, (n, rows), FLOAT_DTYPES, x.device)
    if n == 0 or rows == 0:
        return
    pdl = launch_kwargs(x)
    grid = (triton.cdiv(n, BLOCK_M) * triton.cdiv(rows, BLOCK_N),)
    linear_fp8_kernel[grid](
        x, weight, row_scale, out, n, rows, k, x.stride(0), weight.stride(0), row_scale.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_args(pdl, n),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl,
    )
