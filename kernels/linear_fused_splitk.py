"""Split-K for kernels.linear_fused's prologue linear (issue 15): out = [p1(x1) | p2(x2)] @ W^T
with the prologue (gather, rmsnorm, concat) in the partials kernel and kernels.linear_splitk's
reduce after it, for the weights whose one-launch grid is too small to fill the GPU.

linear_prologue pins BLOCK_N = 32 and walks all of K in each program: at n = 1 the MTP eh_proj
(8B: W [4096, 8192]) is N / 32 = 128 programs reading 8192 columns each, ~55-60 us on the H200
where the split-K plain linear on the same weight, 512 programs, takes ~20 us (issue 15's
profile; this kernel's own time is the GPU's to show). Here a program is
(row tile, N tile) x K split, the split a fixed *size* from the weight's shape
(linear_splitk.default_config, never from n):

- each program computes its rows' 1 / rms over the FULL rows with prologue_tiles._inv_rms, in
  linear_fused.NORM_BLOCK_K chunks whatever the split config's block_k (the rows' norms are
  linear_prologue's, bit for bit), then walks only its split's K tiles in order, building each
  x tile with linear_fused's prologue helpers (x's next tile loaded a K step ahead by hand: see
  prologue_tiles._raw_x), and stores fp32 partials [num_splits, n, rows] like
  linear_splitk._partial_kernel (tiles past K masked: they add zeros);
- linear_splitk._reduce_kernel sums the splits in split order and applies SwiGLU / the residual.

How the 16-row kernel runs on Hopper (`LAUNCH`: its columns, warps and stages, and both rows'
norms in one pass) is measured, not the bits: BLOCK_K, the split size, the norm chunks and every
sum's order stay the config's, and a tile's columns do not change a row's bits on sm90 (see
kernels.tiles); the interpreter keeps the config's tile.

So the bits are those of materialising the prologue as linear_prologue computes it (its values
rounded to x's dtype), then linear_splitk with the same SplitKConfig: the same x tiles, the same
tl.dot per tile, the same split sums in the same order; and a row's bits never depend on n (a
row's norm reads only that row; its tiles and sums are the same at every n).
`linear_prologue_splitk(...)` launches two kernels (LAUNCHES; three with a `normed` buffer:
kernels.prologue_norm, then linear_splitk's plain partials and reduce); `splitk_pays(rows, k)`
is the rule the op binding applies, from the weight's shape only.

The partials' row tiles follow kernels.tiles' rule (kind SPLITK): BLOCK_M 16 at n <= 16 and under
the interpreter; at n > 16 on an H200 the M-tile loop (`_prologue_partial_mloop_kernel`: a
program covers up to 4 row tiles of 16, each with its own 1 / rms and x tiles exactly as the
16-row kernel builds them, and loads each weight tile once a K step for all of them, one
pinned-shape tl.dot per row tile) or BLOCK_M 64. Only tiles change, never BLOCK_K, the split
size, the norm chunks or the K order: not the bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from draft_circuit.kernels import tiles as tiling
from draft_circuit.kernels._common import check, fp32_workspace, launch_kwargs, pdl_args
from draft_circuit.kernels.linear_fused import (BLOCK_N as PROLOGUE_BLOCK_N, NORM_BLOCK_K,
                                                check_prologue_operands)
from draft_circuit.kernels.prologue_tiles import _mac, _prologue_rows, _x_finish, _x_raw
from draft_circuit.kernels.prologue_norm import prologue_norm
from draft_circuit.kernels.linear_splitk import (BLOCK_M, SplitKConfig, default_config,
                                                 launch_partials, num_splits, reduce_partials,
                                                 splitk_workspace_shape)

LAUNCHES = 2  # the partials kernel (prologue in it), then linear_splitk's reduce (+1 with normed)
SPLIT_FROM_K = 4096  # K below this: the one-launch kernel (small heads, K 2048) keeps its bits
# linear_prologue's own grid at n = 1, in its BLOCK_N = 32 tiles: from 256 programs (about two
# per SM of a 132-SM H200) it is taken to fill the GPU without a second launch and a workspace
# round trip (the rule as set for issue 15, not yet measured against this kernel at that width)
MAX_PROLOGUE_TILES = 256


@dataclass(frozen=True)
class Launch:
    """How the 16-row partials kernel runs, none of it the bits (BLOCK_K, the split size, the
    norm chunks and every sum's order stay the config's): norm_groups 0 sums the two rows'
    norms one after the other, 4 chunks in flight (prologue_tiles._inv_rms); 1 or 2 both
    together, 4 * norm_groups chunks of each in flight (_inv_rms_pair; where both x's are
    normed). On a compiled sm90 launch, block_n / num_warps / num_stages replace the split
    config's tile columns, warps and stages (None: the config's)."""

    norm_groups: int = 0
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


# Measured on an H100 (benchmarks/prologue_launch_sweep.py, 2026-12-06; partials + reduce at the
# 8B eh_proj, us at n = 1 / 8 / 64; every candidate bitwise the default's at each n): Launch()
# 36.7 / 38.7 / 119.5; this one 30.1 / 30.9 / 80.2 (without the paired norm pass 33.9 / 33.6 /
# 81.6); the plain split-K on the same weight without a prologue 27.3 / 28.0 / 34.2. Half the
# programs of the config's 64 columns, each paying the norm pass once. Slower: 4 warps at 128
# columns (38.3 at n = 1), 2 or 4 stages (34.3, 34.8), 256 columns (35.5), 64 columns at 3
# stages or 8 warps (35.1-48.2), the paired norm pass at the config's tile (42.2), and the first
# weight tile loaded before the PDL wait (41.3-51.9 at n = 1, in every tile tried: dropped).
LAUNCH = Launch(norm_groups=2, block_n=128, num_warps=8, num_stages=3)


def splitk_pays(weight_rows: int, k: int) -> bool:
    """Whether a prologue linear on a [weight_rows, k] weight takes the split-K kernels: K >= 4096,
    fewer than 256 output tiles of 32 columns and at least two K splits. From the weight's shape
    only (never n), so every width of a circuit binds the same kernel: the 8B (K 8192, N 4096)
    and DeepSeek-V3 (K 14336, N 7168) eh_proj take it; heads of K 2048 keep linear_prologue."""
    return (k >= SPLIT_FROM_K and triton.cdiv(weight_rows, PROLOGUE_BLOCK_N) < MAX_PROLOGUE_TILES
            and num_splits(weight_rows, k) >= 2)


@triton.jit(do_not_specialize=["n_rows", "table_rows", "pdl_release"])
def _prologue_partial_kernel(
    x1_ptr, ids_ptr, nw1_ptr, x2_ptr, nw2_ptr, w_ptr, ws_ptr,
    n_rows, N, K, K1, table_rows, eps1, eps2, stride_x1, stride_x2, stride_w, pdl_release,
    GATHER: tl.constexpr, NORM1: tl.constexpr, TWO_X: tl.constexpr, NORM2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM_BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, NORM_GROUPS: tl.constexpr = 0,
):
    # program = (row tile fastest, N tile) x split, as linear_splitk._partial_kernel
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(n_rows, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * SPLIT_K + tl.arange(0, BLOCK_K)  # the split's first K tile
    m_mask = offs_m < n_rows
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, ids come from the previous launch; ws may still be read by it
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    # the norms over the full rows (every split needs them), in linear_prologue's chunks
    off1, ok1, off2, inv1, inv2 = _prologue_rows(
        x1_ptr, ids_ptr, x2_ptr, offs_m, m_mask, stride_x1, stride_x2, table_rows, K, K1, eps1,
        eps2, GATHER, NORM1, NORM2, BLOCK_M, NORM_BLOCK_K, NORM_GROUPS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # a static trip count: the last split's tiles past K load nothing (masked) and add zeros
    if NORM1 or TWO_X:
        # a prologue: x's next tile is loaded a K step ahead, by hand (see prologue_tiles._raw_x);
        # the last step's look-ahead reads the next split's first tile (or nothing past K), unused
        a, na, b, nb = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask, nw2_ptr,
                              offs_k, K, TWO_X, NORM1, NORM2)
        for k0 in range(0, SPLIT_K, BLOCK_K):
            kk = offs_k + k0
            a2, na2, b2, nb2 = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask,
                                      nw2_ptr, kk + BLOCK_K, K, TWO_X, NORM1, NORM2)
            x = _x_finish(a, na, b, nb, inv1, inv2, kk, K1, TWO_X, NORM1, NORM2)
            acc, _ = _mac(x, w_ptrs, k0, kk, K, n_mask, 0, acc, acc, False)
            a, na, b, nb = a2, na2, b2, nb2
    else:  # x (or its gathered rows) feeds tl.dot as loaded: Triton's pipeliner stages it
        for k0 in range(0, SPLIT_K, BLOCK_K):
            kk = offs_k + k0
            x = tl.load(x1_ptr + off1 + kk[None, :], mask=ok1[:, None] & (kk < K)[None, :],
                        other=0.0)
            acc, _ = _mac(x, w_ptrs, k0, kk, K, n_mask, 0, acc, acc, False)
    # workspace [num_splits, n, N], linear_splitk's layout (its reduce reads it)
    ws_ptrs = ws_ptr + (split * n_rows + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _mt_rows(x1_ptr, ids_ptr, x2_ptr, row0, n_rows, stride_x1, stride_x2, table_rows, K, K1, eps1,
             eps2, nw1_ptr, nw2_ptr, kk, GATHER: tl.constexpr, NORM1: tl.constexpr,
             TWO_X: tl.constexpr, NORM2: tl.constexpr, BLOCK_M: tl.constexpr,
             NORM_BLOCK_K: tl.constexpr):
    """One 16-row tile of the M-loop: its rows' prologue state (as _prologue_partial_kernel's)
    and the loads of its first x tile kk."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_rows
    off1, ok1, off2, inv1, inv2 = _prologue_rows(
        x1_ptr, ids_ptr, x2_ptr, offs_m, m_mask, stride_x1, stride_x2, table_rows, K, K1, eps1,
        eps2, GATHER, NORM1, NORM2, BLOCK_M, NORM_BLOCK_K)
    a, na, b, nb = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask, nw2_ptr, kk, K,
                          TWO_X, NORM1, NORM2)
    return offs_m, m_mask, off1, ok1, off2, inv1, inv2, a, na, b, nb


@triton.jit
def _mt_step(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask, nw2_ptr, inv1, inv2,
             a, na, b, nb, kk, K, wt, acc, TWO_X: tl.constexpr, NORM1: tl.constexpr,
             NORM2: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of one row tile on the step's weight tile wt (loaded once for all row tiles):
    the next x tile's loads issued, this one finished and multiplied: the 16-row kernel's dot."""
    a2, na2, b2, nb2 = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, m_mask, nw2_ptr,
                              kk + BLOCK_K, K, TWO_X, NORM1, NORM2)
    x = _x_finish(a, na, b, nb, inv1, inv2, kk, K1, TWO_X, NORM1, NORM2)
    acc = tl.dot(x, wt, acc, input_precision="ieee")
    return acc, a2, na2, b2, nb2


@triton.jit
def _mt_store(ws_ptr, split, n_rows, N, offs_m, m_mask, offs_n, n_mask, acc):
    ws_ptrs = ws_ptr + (split * n_rows + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(ws_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["n_rows", "table_rows", "pdl_release"])
def _prologue_partial_mloop_kernel(
    x1_ptr, ids_ptr, nw1_ptr, x2_ptr, nw2_ptr, w_ptr, ws_ptr,
    n_rows, N, K, K1, table_rows, eps1, eps2, stride_x1, stride_x2, stride_w, pdl_release,
    GATHER: tl.constexpr, NORM1: tl.constexpr, TWO_X: tl.constexpr, NORM2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM_BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, M_TILES: tl.constexpr,
):
    # program = (row block of M_TILES tiles of 16 fastest, N tile) x split; the tiles past the
    # first are unrolled by hand (tensors cannot be listed), unused ones left as tile 0's copies
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(n_rows, BLOCK_M * M_TILES)
    row0 = (pid % num_m) * (BLOCK_M * M_TILES)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * SPLIT_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, ids come from the previous launch; ws may still be read by it
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    m0, mm0, o10, k10, o20, i10, i20, a0, na0, b0, nb0 = _mt_rows(
        x1_ptr, ids_ptr, x2_ptr, row0, n_rows, stride_x1, stride_x2, table_rows, K, K1, eps1,
        eps2, nw1_ptr, nw2_ptr, offs_k, GATHER, NORM1, TWO_X, NORM2, BLOCK_M, NORM_BLOCK_K)
    m1, mm1, o11, k11, o21, i11, i21, a1, na1, b1, nb1 = m0, mm0, o10, k10, o20, i10, i20, a0, na0, b0, nb0
    m2, mm2, o12, k12, o22, i12, i22, a2, na2, b2, nb2 = m0, mm0, o10, k10, o20, i10, i20, a0, na0, b0, nb0
    m3, mm3, o13, k13, o23, i13, i23, a3, na3, b3, nb3 = m0, mm0, o10, k10, o20, i10, i20, a0, na0, b0, nb0
    if M_TILES > 1:
        m1, mm1, o11, k11, o21, i11, i21, a1, na1, b1, nb1 = _mt_rows(
            x1_ptr, ids_ptr, x2_ptr, row0 + BLOCK_M, n_rows, stride_x1, stride_x2, table_rows, K,
            K1, eps1, eps2, nw1_ptr, nw2_ptr, offs_k, GATHER, NORM1, TWO_X, NORM2, BLOCK_M,
            NORM_BLOCK_K)
    if M_TILES > 2:
        m2, mm2, o12, k12, o22, i12, i22, a2, na2, b2, nb2 = _mt_rows(
            x1_ptr, ids_ptr, x2_ptr, row0 + 2 * BLOCK_M, n_rows, stride_x1, stride_x2, table_rows,
            K, K1, eps1, eps2, nw1_ptr, nw2_ptr, offs_k, GATHER, NORM1, TWO_X, NORM2, BLOCK_M,
            NORM_BLOCK_K)
    if M_TILES > 3:
        m3, mm3, o13, k13, o23, i13, i23, a3, na3, b3, nb3 = _mt_rows(
            x1_ptr, ids_ptr, x2_ptr, row0 + 3 * BLOCK_M, n_rows, stride_x1, stride_x2, table_rows,
            K, K1, eps1, eps2, nw1_ptr, nw2_ptr, offs_k, GATHER, NORM1, TWO_X, NORM2, BLOCK_M,
            NORM_BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    # a static trip count, as _prologue_partial_kernel (tiles past K load nothing, add zeros)
    for k0 in range(0, SPLIT_K, BLOCK_K):
        kk = offs_k + k0
        wt = tl.trans(tl.load(w_ptrs + k0, mask=n_mask[:, None] & (kk < K)[None, :], other=0.0))
        acc0, a0, na0, b0, nb0 = _mt_step(x1_ptr, o10, k10, K1, nw1_ptr, x2_ptr, o20, mm0, nw2_ptr,
                                          i10, i20, a0, na0, b0, nb0, kk, K, wt, acc0, TWO_X,
                                          NORM1, NORM2, BLOCK_K)
        if M_TILES > 1:
            acc1, a1, na1, b1, nb1 = _mt_step(x1_ptr, o11, k11, K1, nw1_ptr, x2_ptr, o21, mm1,
                                              nw2_ptr, i11, i21, a1, na1, b1, nb1, kk, K, wt,
                                              acc1, TWO_X, NORM1, NORM2, BLOCK_K)
        if M_TILES > 2:
            acc2, a2, na2, b2, nb2 = _mt_step(x1_ptr, o12, k12, K1, nw1_ptr, x2_ptr, o22, mm2,
                                              nw2_ptr, i12, i22, a2, na2, b2, nb2, kk, K, wt,
                                              acc2, TWO_X, NORM1, NORM2, BLOCK_K)
        if M_TILES > 3:
            acc3, a3, na3, b3, nb3 = _mt_step(x1_ptr, o13, k13, K1, nw1_ptr, x2_ptr, o23, mm3,
                                              nw2_ptr, i13, i23, a3, na3, b3, nb3, kk, K, wt,
                                              acc3, TWO_X, NORM1, NORM2, BLOCK_K)
    _mt_store(ws_ptr, split, n_rows, N, m0, mm0, offs_n, n_mask, acc0)
    if M_TILES > 1:
        _mt_store(ws_ptr, split, n_rows, N, m1, mm1, offs_n, n_mask, acc1)
    if M_TILES > 2:
        _mt_store(ws_ptr, split, n_rows, N, m2, mm2, offs_n, n_mask, acc2)
    if M_TILES > 3:
        _mt_store(ws_ptr, split, n_rows, N, m3, mm3, offs_n, n_mask, acc3)


def _check_config(cfg: SplitKConfig) -> None:
    pow2 = all(b >= 16 and b & (b - 1) == 0 for b in (cfg.block_n, cfg.block_k))
    check(pow2 and cfg.split_k > 0 and cfg.split_k % cfg.block_k == 0,
          lambda: f"{cfg}: block_n, block_k powers of two >= 16 and split_k a multiple of block_k")


def linear_prologue_splitk(x1: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                           workspace: torch.Tensor | None = None, *,
                           ids: torch.Tensor | None = None, norm1: torch.Tensor | None = None,
                           eps1: float = 1e-6, x2: torch.Tensor | None = None,
                           norm2: torch.Tensor | None = None, eps2: float = 1e-6,
                           silu_mul: bool = False, residual: torch.Tensor | None = None,
                           config: SplitKConfig | None = None,
                           tiles: str | None = None, normed: torch.Tensor | None = None) -> Any:
    """out[n, N] = [p1(x1) | p2(x2)] @ weight^T in two launches: partials with the prologue in
    them, then linear_splitk's reduce (SwiGLU and the residual in its epilogue).

    Operands exactly as kernels.linear_fused.linear_prologue (ids gather x1's rows, an id outside
    the table a zero row; norm1 / norm2 rmsnorm p1 / p2; x2 optional; silu_mul: weight [Wg; Wu];
    residual [n, N]: linear then add, out may alias it). config: linear_splitk's SplitKConfig,
    `default_config(weight rows, K)` if None. workspace: float32
    `linear_splitk.splitk_workspace_shape(n, weight rows, K, config)`, allocated here if None.

    Bits: those of materialising the prologue as linear_prologue computes it, then linear_splitk
    (or linear_silu_mul_splitk) with the same config; independent of n (the module docstring
    says why). Not linear_prologue's bits: the split sums add K in another order.
    tiles: a kernels.tiles SPLITK mode for the partials (None: its rule). Returns Triton's handle
    of the partials launch (the sweep reads its PTX), or None. normed [n, K] (x1's dtype): the
    prologue is a launch of its own into it (kernels.prologue_norm), then linear_splitk's plain
    partials read it: the bits stated above (the partials' tiles are kernels.tiles' SPLITK
    rule's, measured not to move a row's bits on sm90); three launches.
    """
    n, k, k1, rows, n_out = check_prologue_operands(x1, weight, out, ids, norm1, x2, norm2,
                                                    silu_mul, residual)
    device = x1.device
    cfg = config or default_config(rows, k)
    _check_config(cfg)
    shape = splitk_workspace_shape(n, rows, k, cfg)
    workspace = fp32_workspace(workspace, shape, device)
    if n == 0 or n_out == 0 or k == 0:
        if n * n_out:  # K = 0: the empty sum (plus the residual, which out may alias)
            out.copy_(residual) if residual is not None else out.zero_()
        return None
    if normed is not None:
        prologue_norm(x1, normed, n=n, k=k, ids=ids, norm1=norm1, eps1=eps1, x2=x2, norm2=norm2,
                      eps2=eps2)
        pdl = launch_kwargs(x1)
        handle = launch_partials(normed, weight, workspace, cfg, pdl, tiles)
        reduce_partials(workspace, out, residual, n, n_out, rows, silu_mul, pdl)
        return handle
    pdl = launch_kwargs(x1)
    t = tiling.choose(tiling.PROLOGUE_SPLITK, n, x1, tiles,
                      programs=triton.cdiv(rows, cfg.block_n) * shape[0])
    run = LAUNCH
    block_n, warps, stages = cfg.block_n, t.warps(cfg.num_warps), cfg.num_stages
    if t.mode == tiling.PINNED and tiling.wide_allowed(x1):  # tiles only, never the bits
        block_n = run.block_n or block_n
        warps = run.num_warps or warps
        stages = run.num_stages or stages
    args = (x1, ids if ids is not None else x1, norm1 if norm1 is not None else x1,
            x2 if x2 is not None else x1, norm2 if norm2 is not None else x1, weight, workspace,
            n, rows, k, k1, x1.shape[0], float(eps1), float(eps2),
            x1.stride(0), x2.stride(0) if x2 is not None else 0, weight.stride(0))
    consts = dict(GATHER=ids is not None, NORM1=norm1 is not None, TWO_X=x2 is not None,
                  NORM2=norm2 is not None, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
                  SPLIT_K=cfg.split_k, NORM_BLOCK_K=NORM_BLOCK_K, **pdl_args(pdl, n),
                  num_warps=warps, num_stages=stages, **pdl)
    grid = (triton.cdiv(n, t.rows_per_program) * triton.cdiv(rows, block_n), shape[0])
    if t.mode == tiling.MLOOP:
        handle = _prologue_partial_mloop_kernel[grid](*args, BLOCK_M=BLOCK_M, M_TILES=t.m_tiles,
                                                      **consts)
    else:
        handle = _prologue_partial_kernel[grid](*args, BLOCK_M=t.block_m,
                                                NORM_GROUPS=run.norm_groups, **consts)
    reduce_partials(workspace, out, residual, n, n_out, rows, silu_mul, pdl)
    return handle
