"""Skinny matmul for wide n (issue 15 item 3): each weight tile is loaded once for up to M_TILES
row tiles of 16, and every row keeps the bits kernels.linear / kernels.linear_splitk give it.

`linear_wide(x, w, out, silu_mul=False, m_tiles=None, config=None)`: out[n, N] = x @ W^T
(SwiGLU with silu_mul, W = [Wg; Wu]). `linear_wide_splitk(x, w, out, workspace, config,
silu_mul=False, m_tiles=None)`: the same split into fixed K splits, the partials summed by
kernels.linear_splitk's reduce kernel; `splitk_partials(...)` is its partials launch alone,
which kernels.linear_splitk launches at n > 16 on an H200 (kernels.tiles' SPLITK rule: the M-tile
loop; tiles only, so not the bits). `linear_tiles(...)`: kernels.linear's own kernel at other
tiles / warps / stages (the sweep's candidates (a), (c), (d); bits not promised).

Why bits hold by construction: a program owns BLOCK_N output columns and M_TILES consecutive
16-row tiles. Every K step loads the weight tile once and runs one tl.dot per row tile, of
exactly the pinned kernel's shape ([16, BLOCK_K] x [BLOCK_K, BLOCK_N], the same BLOCK_K and K
order) on that tile's own fp32 accumulator, with the same epilogue. A row's position in its
tile is row % 16 at every n and M_TILES, so the launcher may pick M_TILES from n without making
a row's bits depend on n (checked bitwise on the H200 by benchmarks/wide_sweep.py, in the
interpreter by tests/kernels/test_linear_wide.py). Rows past n load zeros and store nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import linear_splitk as sk
from draft_circuit.kernels._common import check, fp32_workspace, launch_kwargs, pdl_args
from draft_circuit.kernels.linear import (BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS,
                                          check_linear_operands, linear_kernel)

MAX_M_TILES = 4  # 64 rows a program: the chain's widest n; wider n adds programs along M


@dataclass(frozen=True)
class WideConfig:
    """The single-pass kernel's knobs; block_n and block_k change a row's bits (never their
    width independence), num_warps / num_stages are expected not to (the sweep measures it)."""

    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def default_m_tiles(n: int) -> int:
    """Row tiles a program covers at width n: every row of n <= 64 in one program."""
    return max(1, min(MAX_M_TILES, triton.cdiv(n, BLOCK_M)))


@triton.jit
def _tile_dot(x_ptr, row0, n_rows, stride_x, kk, K, wt, ut, acc, acc_up,
              SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc (+ acc_up) += x[row0:row0+16, kk] @ the K step's weight tile: the pinned kernel's dot."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + kk[None, :],
                mask=(offs_m < n_rows)[:, None] & (kk < K)[None, :], other=0.0)
    # ieee: fp32 inputs must not drop to tf32; 16-bit inputs ignore it.
    acc = tl.dot(x, wt, acc, input_precision="ieee")
    if SILU_MUL:
        acc_up = tl.dot(x, ut, acc_up, input_precision="ieee")
    return acc, acc_up


@triton.jit
def _tile_store(out_ptr, row0, n_rows, stride_out, offs_n, n_mask, acc, acc_up,
                SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr):
    if SILU_MUL:  # kernels.linear's epilogue, expression for expression
        acc = acc * tl.sigmoid(acc) * acc_up
    offs_m = row0 + tl.arange(0, BLOCK_M)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < n_rows)[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["n_rows", "pdl_release"])
def linear_wide_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, N, K, stride_x, stride_w, stride_out, up_offset, pdl_release,
    SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, M_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # grid (row blocks fastest, N tiles) x splits, as kernels.linear / linear_splitk lay theirs
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(n_rows, BLOCK_M * M_TILES)
    row0 = (pid % num_m) * (BLOCK_M * M_TILES)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = split * SPLIT_K + tl.arange(0, BLOCK_K)  # SPLIT_K = 0: one pass over all of K
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    a0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a1, a2, a3, u0, u1, u2, u3 = a0, a0, a0, a0, a0, a0, a0
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch; ws may still be read by it
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    k_end = K
    if SPLIT_K > 0:  # a static trip count, as linear_splitk's partials (steps past K add zeros)
        k_end = SPLIT_K
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        w_mask = n_mask[:, None] & (kk < K)[None, :]
        wt = tl.trans(tl.load(w_ptrs + k0, mask=w_mask, other=0.0))  # once for every row tile
        ut = wt
        if SILU_MUL:
            ut = tl.trans(tl.load(w_ptrs + up_offset + k0, mask=w_mask, other=0.0))
        a0, u0 = _tile_dot(x_ptr, row0, n_rows, stride_x, kk, K, wt, ut, a0, u0, SILU_MUL, BLOCK_M)
        if M_TILES > 1:
            a1, u1 = _tile_dot(x_ptr, row0 + BLOCK_M, n_rows, stride_x, kk, K, wt, ut, a1, u1,
                               SILU_MUL, BLOCK_M)
        if M_TILES > 2:
            a2, u2 = _tile_dot(x_ptr, row0 + 2 * BLOCK_M, n_rows, stride_x, kk, K, wt, ut, a2,
                               u2, SILU_MUL, BLOCK_M)
        if M_TILES > 3:
            a3, u3 = _tile_dot(x_ptr, row0 + 3 * BLOCK_M, n_rows, stride_x, kk, K, wt, ut, a3,
                               u3, SILU_MUL, BLOCK_M)
    # split-K: out is the fp32 workspace [splits, n, N], this split's slab
    out_ptr += split.to(tl.int64) * n_rows * N
    _tile_store(out_ptr, row0, n_rows, stride_out, offs_n, n_mask, a0, u0, SILU_MUL, BLOCK_M)
    if M_TILES > 1:
        _tile_store(out_ptr, row0 + BLOCK_M, n_rows, stride_out, offs_n, n_mask, a1, u1,
                    SILU_MUL, BLOCK_M)
    if M_TILES > 2:
        _tile_store(out_ptr, row0 + 2 * BLOCK_M, n_rows, stride_out, offs_n, n_mask, a2, u2,
                    SILU_MUL, BLOCK_M)
    if M_TILES > 3:
        _tile_store(out_ptr, row0 + 3 * BLOCK_M, n_rows, stride_out, offs_n, n_mask, a3, u3,
                    SILU_MUL, BLOCK_M)


def _m_tiles(n: int, m_tiles: int | None) -> int:
    t = default_m_tiles(n) if m_tiles is None else m_tiles
    check(1 <= t <= MAX_M_TILES, lambda: f"m_tiles must be in 1..{MAX_M_TILES}, got {t}")
    return t


def _pow2(*blocks: int) -> bool:
    return all(b >= 16 and b & (b - 1) == 0 for b in blocks)


def linear_wide(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, silu_mul: bool = False,
                m_tiles: int | None = None, config: WideConfig | None = None) -> Any:
    """out[n, N] = x[n, K] @ weight[N, K]^T, or with silu_mul silu(x @ Wg^T) * (x @ Wu^T) for
    weight = [Wg; Wu] [2I, K] (out [n, I]); operands as kernels.linear takes them. m_tiles:
    16-row tiles a program covers (default `default_m_tiles(n)`); any value gives every row the
    bits kernels.linear gives it at config's block_n / block_k (the pinned ones by default).
    One launch; returns Triton's handle of it (the compiled kernel on a GPU; the sweep reads its
    PTX), or None."""
    cfg = config or WideConfig()
    check(_pow2(cfg.block_n, cfg.block_k), lambda: f"{cfg}: block_n, block_k powers of two >= 16")
    n, k, rows, n_out = check_linear_operands(x, weight, out, silu_mul)
    tiles = _m_tiles(n, m_tiles)
    if n == 0 or n_out == 0:
        return None
    pdl = launch_kwargs(x)
    grid = (triton.cdiv(n, BLOCK_M * tiles) * triton.cdiv(n_out, cfg.block_n), 1)
    return linear_wide_kernel[grid](
        x, weight, out, n, n_out, k, x.stride(0), weight.stride(0), out.stride(0),
        n_out * weight.stride(0) if silu_mul else 0,
        SILU_MUL=silu_mul, SPLIT_K=0, M_TILES=tiles, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, **pdl_args(pdl, n), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl)


def linear_wide_splitk(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                       workspace: torch.Tensor | None = None, config: sk.SplitKConfig | None = None,
                       silu_mul: bool = False, m_tiles: int | None = None) -> Any:
    """kernels.linear_splitk's product (silu_mul: linear_silu_mul_splitk's) with its partials
    computed M_TILES row tiles a program; the same partials, summed by the same reduce kernel,
    so the same bits at every m_tiles. workspace: fp32 `splitk_workspace_shape(n, rows, K,
    config)`. Two launches; returns the partials launch's handle (or None)."""
    n, k, rows, n_out = check_linear_operands(x, weight, out, silu_mul)
    cfg = config or sk.default_config(rows, k)
    check(_pow2(cfg.block_n, cfg.block_k) and cfg.split_k > 0 and cfg.split_k % cfg.block_k == 0,
          lambda: f"{cfg}: block_n, block_k powers of two >= 16 and split_k a multiple of block_k")
    tiles = _m_tiles(n, m_tiles)
    shape = sk.splitk_workspace_shape(n, rows, k, cfg)
    workspace = fp32_workspace(workspace, shape, x.device)
    check(k > 0, lambda: "linear_wide_splitk needs K > 0")
    if n == 0 or n_out == 0:
        return None
    pdl = launch_kwargs(x)
    handle = splitk_partials(x, weight, workspace, cfg, tiles, pdl)
    sk.reduce_partials(workspace, out, None, n, n_out, rows, silu_mul, pdl)
    return handle


def splitk_partials(x: torch.Tensor, weight: torch.Tensor, workspace: torch.Tensor,
                    cfg: sk.SplitKConfig, m_tiles: int, pdl: dict[str, Any]) -> Any:
    """kernels.linear_splitk's partials launch (fp32 [splits, n, rows] into workspace, operands
    checked by the caller) with m_tiles row tiles of 16 a program: the M-loop mode of
    kernels.tiles' SPLITK rule. Returns Triton's handle."""
    n, k = x.shape
    rows = weight.shape[0]
    grid = (triton.cdiv(n, BLOCK_M * m_tiles) * triton.cdiv(rows, cfg.block_n), workspace.shape[0])
    return linear_wide_kernel[grid](
        x, weight, workspace, n, rows, k, x.stride(0), weight.stride(0), rows, 0,
        SILU_MUL=False, SPLIT_K=cfg.split_k, M_TILES=m_tiles, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **pdl_args(pdl, n), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl)


def linear_tiles(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, silu_mul: bool,
                 block_m: int, block_n: int, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES, block_k: int = BLOCK_K) -> Any:
    """kernels.linear's kernel (no bias) launched at other tiles, warps or stages, as
    kernels.linear launches it at its pinned ones: the sweep's candidates whose bits against
    the pinned tiles are the question, not a promise. Returns Triton's handle (or None)."""
    check(_pow2(block_m, block_n, block_k), lambda: "block_m, block_n, block_k powers of two >= 16")
    n, k, rows, n_out = check_linear_operands(x, weight, out, silu_mul)
    if n == 0 or n_out == 0:
        return None
    pdl = launch_kwargs(x)
    grid = (triton.cdiv(n, block_m) * triton.cdiv(n_out, block_n),)
    return linear_kernel[grid](
        x, weight, out, weight, n, n_out, k, x.stride(0), weight.stride(0), out.stride(0),
        n_out * weight.stride(0) if silu_mul else 0,
        SILU_MUL=silu_mul, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **pdl_args(pdl, n), num_warps=num_warps, num_stages=num_stages, **pdl)
