"""Per-head skinny matmul out[i, h*N:(h+1)*N] = weight[h] @ x[i, h*K:(h+1)*K] (fp32 accumulation),
what MLA's absorbed decode applies twice: W_UK^T into the query, W_UV out of the latent.

One pinned tiling, no split-K, no autotuning: a row's bits never depend on n. `head_linear(x,
weight, out)`; weight [H, N, K] in x's dtype, out any float dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)

# Pinned, as kernels.linear's: BLOCK_M = 16 is the smallest tl.dot tile.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def head_linear_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, N, K, stride_x, stride_wh, stride_wn, stride_out, pdl_release,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # row tiles vary fastest, so the programs sharing a weight tile run together (L2 reuse)
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < n_rows, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + head * K + offs_k[None, :]
    w_ptrs = w_ptr + head * stride_wh + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # fp32 stays fp32 (no tf32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + head * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def head_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """x [n, H*K], weight [H, N, K] (x's dtype, unit inner stride), out [n, H*N]. No host sync."""
    check(weight.dim() == 3, lambda: f"{describe('weight', weight)}: expected [heads, N, K]")
    heads, rows, k = weight.shape
    n = x.shape[0] if x.dim() == 2 else -1
    check_operand("x", x, (n, heads * k), FLOAT_DTYPES, x.device)
    check_operand("weight", weight, (heads, rows, k), (x.dtype,), x.device)
    check_operand("out", out, (n, heads * rows), FLOAT_DTYPES, x.device)
    if n == 0 or rows == 0:
        return
    pdl = launch_kwargs(x)
    grid = (triton.cdiv(n, BLOCK_M) * triton.cdiv(rows, BLOCK_N), heads)
    head_linear_kernel[grid](
        x, weight, out, n, rows, k, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **pdl_args(pdl, n),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl,
    )
