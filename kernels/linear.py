"""Skinny matmul out[n, N] = x[n, K] @ weight[N, K]^T (+ bias[N]) (fp32 accumulation), optionally
fused with SwiGLU.

Pinned BLOCK_N, BLOCK_K, stages and K order, no split-K, no autotuning: a row's bits never
depend on n (width independence). The row tile follows kernels.tiles' rule (kind LINEAR): BLOCK_M
16 at n <= 16 and under the interpreter, BLOCK_M 64 with 4 warps at n > 16 on an H200; that
choice changes only the tile around a row, never BLOCK_K or the K order, so not the bits
(kernels.tiles says where that was measured). `linear(x, weight, out, bias=None, tiles=None)`;
`linear_silu_mul(x, gate_up_weight, out, tiles=None)`; `tiles=` forces a kernels.tiles mode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)

# Pinned: changing BLOCK_N or BLOCK_K changes the bits of every result (but never makes them
# depend on n). BLOCK_M = 16 is the smallest tl.dot tile (the tile at n <= 16; kernels.tiles
# widens it at n > 16); BLOCK_N = 32 keeps >= 128 programs for N >= 4096.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 128
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    n_rows, N, K,
    stride_x, stride_w, stride_out, up_offset, pdl_release,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Row tiles vary fastest, so the programs sharing a weight tile run together and all but one
    # of them read it from L2: the weight streams from memory about once for all rows.
    pid = tl.program_id(0)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]  # [BN, BK]
    up_ptrs = w_ptrs + up_offset  # SwiGLU: the up rows follow the N gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        # ieee: fp32 inputs must not drop to tf32; 16-bit inputs ignore it.
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        if SILU_MUL:
            u = tl.load(up_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision="ieee")
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if HAS_BIAS:  # added to the fp32 sum, rounded once with it (nn.Linear's addmm does the same)
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def check_linear_operands(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                          silu_mul: bool) -> tuple[int, int, int, int]:
    """The checks every linear launcher makes; returns (n, K, weight rows, output columns)."""
    name = "gate_up_weight" if silu_mul else "weight"
    check(x.dim() == 2, lambda: f"{describe('x', x)}: expected [n, K]")
    check(weight.dim() == 2, lambda: f"{describe(name, weight)}: expected [N, K]")
    n, k = x.shape
    rows = weight.shape[0]
    check(not silu_mul or rows % 2 == 0, lambda: f"{describe(name, weight)}: expected [2*I, K]")
    n_out = rows // 2 if silu_mul else rows
    check_operand("x", x, (n, k), FLOAT_DTYPES, x.device)
    check_operand(name, weight, (rows, k), (x.dtype,), x.device)
    check_operand("out", out, (n, n_out), FLOAT_DTYPES, x.device)
    return n, k, rows, n_out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, silu_mul: bool,
            bias: torch.Tensor | None = None, mode: str | None = None) -> None:
    n, k, rows, n_out = check_linear_operands(x, weight, out, silu_mul)
    if bias is not None:
        check_operand("bias", bias, (n_out,), (x.dtype,), x.device)
    if n == 0 or n_out == 0:
        return
    pdl = launch_kwargs(x)
    t = tiling.choose(tiling.LINEAR, n, x, mode, programs=triton.cdiv(n_out, BLOCK_N))
    grid = (triton.cdiv(n, t.block_m) * triton.cdiv(n_out, BLOCK_N),)
    linear_kernel[grid](
        x, weight, out, bias if bias is not None else weight, n, n_out, k,
        x.stride(0), weight.stride(0), out.stride(0), n_out * weight.stride(0) if silu_mul else 0,
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, BLOCK_M=t.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        **pdl_args(pdl, n),
        num_warps=t.warps(NUM_WARPS), num_stages=NUM_STAGES,
        **pdl,
    )


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
           bias: torch.Tensor | None = None, tiles: str | None = None) -> None:
    """out[n, N] = x[n, K] @ weight[N, K]^T (+ bias[N]). x, weight and bias share a float dtype;
    out any float dtype. tiles: a kernels.tiles LINEAR mode to force (None: its rule)."""
    _launch(x, weight, out, silu_mul=False, bias=bias, mode=tiles)


def linear_silu_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, out: torch.Tensor,
                    tiles: str | None = None) -> None:
    """out[n, I] = silu(x @ Wg^T) * (x @ Wu^T), gate_up_weight = [Wg; Wu] of shape [2I, K].

    Both products and the activation stay in fp32 and round once; linear then silu_mul would
    round the [n, 2I] intermediate to its dtype first, so 16-bit results differ slightly.
    """
    _launch(x, gate_up_weight, out, silu_mul=True, mode=tiles)
