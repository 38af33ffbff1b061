"""Split-K skinny matmul out[n, N] = x[n, K] @ weight[N, K]^T, optionally fused with SwiGLU.

Fixed-size K splits (a split *size*, never a count from n): fp32 partials per split go to a
workspace, a second kernel sums them serially in split order and rounds once, so a row's bits
never depend on n. `linear_splitk(x, w, out, ws)`; `linear_silu_mul_splitk(x, gate_up, out, ws)`.

The partials' row tiles follow kernels.tiles' rule (kind SPLITK): BLOCK_M 16 at n <= 16 and under
the interpreter; at n > 16 on an H200 the M-tile loop (kernels.linear_wide: each weight tile
loaded once for up to 4 row tiles of 16, the pinned tl.dot per tile) or BLOCK_M 64. Only tiles
change, never BLOCK_N, BLOCK_K, the split size or the K order: not the bits. `tiles=` forces a mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels.linear import check_linear_operands
from draft_circuit.kernels._common import check, describe, fp32_workspace, launch_kwargs, pdl_args

BLOCK_M = 16  # the smallest tl.dot tile; a row's position in its tile is row % 16 at every n
# (kernels.tiles widens the program's row tile at n > 16 on an H200; the bits stay these)
# Enough programs at n = 1 to fill a 132-SM H200: about 4 resident per SM (48 KB of shared
# memory each at BLOCK_N = 32, 4 stages), so that enough weight bytes are in flight.
TARGET_PROGRAMS = 512  # the first rule's aim; kept for the tuning script's variants
SPLIT_FROM_K = 2048  # measured: narrower K gains nothing from splitting
MIN_SPLIT_K = 128  # one BLOCK_K step: smaller splits only add partials to write and sum
REDUCE_BLOCK, REDUCE_WARPS = 512, 4
LAUNCHES = 2  # every launcher here: the partials kernel, then the reduce kernel


@dataclass(frozen=True)
class SplitKConfig:
    """Pinned per weight shape; changing it changes a result's bits (never their width independence)."""

    block_n: int
    split_k: int  # K columns per split, a multiple of block_k
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def default_config(weight_rows: int, k: int) -> SplitKConfig:
    """From the weight's shape only (never n). The rule is the H200 measurement of
    benchmarks/tune_kernels.py (2026-12-01, bf16, the sum of times at n = 1, 8 and 64): below
    K = 2048 a split buys nothing over kernels.linear (one split: the binding falls back to it);
    up to K = 4096, BLOCK_N 32 with 512-column splits; from K = 4096, BLOCK_N 64 with 1024.
    weight_rows is N, or 2I for SwiGLU (not split: see ops/bindings.py)."""
    if k < SPLIT_FROM_K:
        return SplitKConfig(block_n=32, split_k=max(MIN_SPLIT_K, triton.next_power_of_2(k)))
    if k < 4096:
        return SplitKConfig(block_n=32, split_k=512)
    return SplitKConfig(block_n=64, split_k=1024)


def num_splits(weight_rows: int, k: int, config: SplitKConfig | None = None) -> int:
    """How many K splits a weight of this shape gets; 1 means split-K buys nothing over kernels.linear."""
    return triton.cdiv(k, (config or default_config(weight_rows, k)).split_k)


def splitk_workspace_shape(n: int, weight_rows: int, k: int,
                           config: SplitKConfig | None = None) -> tuple[int, int, int]:
    """fp32 partial products [num_splits, n, weight_rows]; weight_rows is N, or 2I for SwiGLU."""
    return (num_splits(weight_rows, k, config), n, weight_rows)


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def _partial_kernel(
    x_ptr, w_ptr, ws_ptr,
    n_rows, N, K, stride_x, stride_w, pdl_release,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # program = (row tile fastest, N tile) x split: programs sharing a weight tile run together,
    # so at n > 16 the weight streams from memory about once for all row tiles.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * SPLIT_K + tl.arange(0, BLOCK_K)
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch; ws may still be read by it
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    # a static trip count: the last split's steps past K load nothing (masked) and add zeros
    for k0 in range(0, SPLIT_K, BLOCK_K):
        k_mask = (offs_k + k0) < K
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        # ieee: fp32 inputs must not drop to tf32; 16-bit inputs ignore it.
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    # workspace [num_splits, n, N]
    ws_ptrs = (ws_ptr + (split * n_rows + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :])
    tl.store(ws_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def _reduce_kernel(
    ws_ptr, out_ptr, res_ptr,
    n_rows, N_out, ws_cols, stride_out, stride_res, pdl_release,
    NUM_SPLITS: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # program = (row, column block); the splits are summed in split order, unrolled so that
    # every split's load is in flight before the first add waits.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N_out
    split_stride = n_rows.to(tl.int64) * ws_cols
    gate_ptrs = ws_ptr + row * ws_cols + cols
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.load(gate_ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        acc += tl.load(gate_ptrs + s * split_stride, mask=mask, other=0.0)
    if SILU_MUL:  # the up columns follow the N_out gate columns
        up = tl.load(gate_ptrs + N_out, mask=mask, other=0.0)
        for s in tl.static_range(1, NUM_SPLITS):
            up += tl.load(gate_ptrs + N_out + s * split_stride, mask=mask, other=0.0)
        acc = acc * tl.sigmoid(acc) * up
    if RESIDUAL:  # linear then add: the product rounds first, then the sum rounds once
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + r
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_partials(workspace: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, n: int,
                    n_out: int, rows: int, silu_mul: bool, pdl: dict[str, Any]) -> None:
    """The second launch of a split-K product (here and in kernels.linear_fused_splitk): out =
    the fp32 partials [splits, n, rows] summed in split order, SwiGLU'd or + residual, rounded."""
    _reduce_kernel[(n, triton.cdiv(n_out, REDUCE_BLOCK))](
        workspace, out, residual if residual is not None else out, n, n_out, rows, out.stride(0),
        residual.stride(0) if residual is not None else 0,
        NUM_SPLITS=workspace.shape[0], SILU_MUL=silu_mul, RESIDUAL=residual is not None,
        BLOCK=REDUCE_BLOCK, **pdl_args(pdl, n), num_warps=REDUCE_WARPS, **pdl)


def launch_partials(x: torch.Tensor, weight: torch.Tensor, workspace: torch.Tensor, cfg: SplitKConfig,
                    pdl: dict[str, Any], mode: str | None = None) -> Any:
    """The first launch: the fp32 partials [splits, n, rows] of x @ weight^T into workspace, at
    the row tiles kernels.tiles picks for n (kind SPLITK; `mode` forces one). Returns Triton's
    handle of the launch (the sweep reads its PTX)."""
    n, k = x.shape
    rows = weight.shape[0]
    t = tiling.choose(tiling.SPLITK, n, x, mode,
                      programs=triton.cdiv(rows, cfg.block_n) * workspace.shape[0])
    if t.mode == tiling.MLOOP:  # imported here: kernels.linear_wide imports this module
        from draft_circuit.kernels.linear_wide import splitk_partials
        return splitk_partials(x, weight, workspace, cfg, t.m_tiles, pdl)
    grid = (triton.cdiv(n, t.block_m) * triton.cdiv(rows, cfg.block_n), workspace.shape[0])
    return _partial_kernel[grid](
        x, weight, workspace, n, rows, k, x.stride(0), weight.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        **pdl_args(pdl, n), num_warps=t.warps(cfg.num_warps), num_stages=cfg.num_stages,
        **pdl)


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None,
            config: SplitKConfig | None, silu_mul: bool, residual: torch.Tensor | None = None,
            mode: str | None = None) -> None:
    n, k, rows, n_out = check_linear_operands(x, weight, out, silu_mul)
    if residual is not None:
        check(tuple(residual.shape) == (n, n_out) and residual.dtype == out.dtype
              and residual.stride(1) == 1 and residual.device == x.device,
              lambda: f"{describe('residual', residual)}: expected {out.dtype} [{n}, {n_out}] rows")
    cfg = config or default_config(rows, k)
    pow2 = all(b >= 16 and b & (b - 1) == 0 for b in (cfg.block_n, cfg.block_k))
    check(pow2 and cfg.split_k > 0 and cfg.split_k % cfg.block_k == 0,
          lambda: f"{cfg}: block_n, block_k powers of two >= 16 and split_k a multiple of block_k")
    shape = splitk_workspace_shape(n, rows, k, cfg)
    workspace = fp32_workspace(workspace, shape, x.device)
    if n == 0 or n_out == 0 or k == 0:
        if n * n_out:  # K = 0: the empty sum (plus the residual, which out may alias)
            out.copy_(residual) if residual is not None else out.zero_()
        return
    pdl = launch_kwargs(x)
    launch_partials(x, weight, workspace, cfg, pdl, mode)
    reduce_partials(workspace, out, residual, n, n_out, rows, silu_mul, pdl)


def linear_splitk(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  workspace: torch.Tensor | None = None, config: SplitKConfig | None = None,
                  residual: torch.Tensor | None = None, tiles: str | None = None) -> None:
    """out[n, N] = x[n, K] @ weight[N, K]^T (+ residual [n, N], added in the reduce kernel's
    epilogue after the product rounds: linear then add). x and weight share a float dtype; out
    any float dtype (the residual out's; out may alias it). Two launches: partials, then reduce.

    workspace: float32 `splitk_workspace_shape(n, N, K, config)`, allocated here if None.
    tiles: a kernels.tiles SPLITK mode for the partials (None: its rule).
    """
    _launch(x, weight, out, workspace, config, silu_mul=False, residual=residual, mode=tiles)


def linear_silu_mul_splitk(x: torch.Tensor, gate_up_weight: torch.Tensor, out: torch.Tensor,
                           workspace: torch.Tensor | None = None,
                           config: SplitKConfig | None = None, tiles: str | None = None) -> None:
    """out[n, I] = silu(x @ Wg^T) * (x @ Wu^T), gate_up_weight = [Wg; Wu] of shape [2I, K].

    Products, sums and activation in fp32, one rounding; workspace `splitk_workspace_shape(n, 2I, K)`.
    tiles: a kernels.tiles SPLITK mode for the partials (None: its rule).
    """
    _launch(x, gate_up_weight, out, workspace, config, silu_mul=True, mode=tiles)
