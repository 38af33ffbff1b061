"""The one width rule for the skinny linears' tiles (issue 15 item 3): which tile a launch uses at
width n, chosen so that a row's bits never depend on n.

What decides a row's bits is BLOCK_K, the K order and the split size of split-K; the tile
*shape* around the row did not, where measured: the H200 sweep
(benchmarks/wide_sweep.py, 2026-12-03, bf16, sm90) gave every row of every candidate tiling
(BLOCK_M 16/32/64, BLOCK_N 32..128, 2..8 warps, 3..4 stages, wgmma at BLOCK_M 64 with 4 warps)
bitwise the pinned kernel's row-alone bits. So the launchers may widen the tile with n while
BLOCK_N, BLOCK_K, stages, the split config and the K loop stay the pinned ones. The rule
(`choose(kind, n, t)`):

- the Triton interpreter, a tensor not on CUDA, a GPU other than sm90 (not measured), or
  n <= WIDE_FROM_N (16): PINNED, today's tiles (BLOCK_M 16, the launcher's pinned warps). Under
  the interpreter tl.dot is numpy's matmul, whose sums over a [64, K] block are not those over
  [16, K] ones: a wide tile there would make a row's bits depend on n.
- CUDA sm90, n > 16, kinds LINEAR (kernels.linear's linear / linear_silu_mul) and PROLOGUE
  (kernels.linear_fused's linear_prologue and rmsnorm_linear_qkv): BM64, BLOCK_M 64 and 4 warps
  (one warpgroup: wgmma). At the 8B shapes, n = 64: gate_up 122.9 -> 72.5 us, down 76.5 -> 42.3,
  q/k/v 31.5 -> 18.1, o 24.1 -> 14.1 (the plain kernel; benchmarks/wide_chain.py has the sweep
  measure the prologue ones, bits included).
  A prologue linear given kernels.prologue_norm's `normed` buffer (the widths its prenorm_pays
  names) runs its plain loop and takes the LINEAR rule (the split-K one: the SPLITK rule).
- CUDA sm90, n > 16, kind SPLITK (kernels.linear_splitk's partials, kernels.linear_fused_splitk's
  prologue partials): MLOOP by default: BLOCK_M 16 and min(4, cdiv(n, 16)) row tiles
  a program, each weight tile loaded once a K step for all of them and one pinned-shape tl.dot
  per row tile (bitwise by construction, the interpreter included); BM64 the alternative the
  sweep measures (o at n = 64: splitk 25.4 -> M-loop 14.7 us; eh_proj 45.6 -> 28.7).

Each kind's wide mode is WIDE[kind]: a GPU run that finds a kind's wide mode slower, or not
bitwise, sets it to PINNED (or SPLITK's to BM64) there and nowhere else. `mode=` forces a mode
(any device, any n): the sweep's candidates and the tests use it; the op bindings never pass
it. `describe(kind, n, t)` names the tile a launch gets, for reports.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from draft_circuit.kernels._common import check, compiled_cuda_index, interpreting

PINNED, BM64, MLOOP = "pinned", "bm64", "mloop"
LINEAR, PROLOGUE, SPLITK, PROLOGUE_SPLITK = "linear", "prologue", "splitk", "prologue_splitk"
MODES = {LINEAR: (PINNED, BM64), PROLOGUE: (PINNED, BM64), SPLITK: (PINNED, BM64, MLOOP),
         PROLOGUE_SPLITK: (PINNED, BM64, MLOOP)}
# the mode a kind takes at n > WIDE_FROM_N[kind] where wide tiles are allowed. The split-K
# prologue (the 8B eh_proj) keeps its pinned tiles: the H200 run of the rule (2026-12-03,
# benchmarks/wide_chain.py) measured its M-loop slower at n = 32 / 64 (66.2 / 130.0 us against
# 60.0 / 116.2) and BLOCK_M 64 slower below n = 64
WIDE = {LINEAR: BM64, PROLOGUE: BM64, SPLITK: MLOOP, PROLOGUE_SPLITK: PINNED}
# n above this takes the wide tile. The prologue kernels' BLOCK_M 64 costs about one 64-row tile
# whatever n is (gate_up with its norm: 111.8 us at n = 32, 119.3 at 64), the pinned one about
# 20-40 us a 16-row tile (85.2 at 32, 161.0 at 64): wide pays from three row tiles on
WIDE_FROM_N = {LINEAR: 16, PROLOGUE: 32, SPLITK: 16, PROLOGUE_SPLITK: 16}
# a wide tile has 1/4 of the pinned programs at n = 64: below this many programs along N (and
# splits) it would leave SMs idle (the H200 has 132), where the pinned grid filled them: the
# small head (N 1536-2816) measured slower with wide tiles at n = 64 (chain 452.7 -> 560.3 us)
MIN_WIDE_PROGRAMS = 128
PINNED_BLOCK_M = 16  # the smallest tl.dot tile (kernels.linear.BLOCK_M)
WIDE_BLOCK_M, WIDE_WARPS = 64, 4  # one warpgroup of 4 warps over 64 rows: Hopper's wgmma
MAX_M_TILES = 4  # MLOOP: 16-row tiles a program covers (64 rows, the chain's widest n)
MEASURED_ARCH = (9, 0)  # the bits were checked on sm90 only; other GPUs keep the pinned tiles


@dataclass(frozen=True)
class Tiles:
    """A launch's tiles. block_m: rows of the program's tile (BM64) or of each of its m_tiles
    row tiles (PINNED, MLOOP: 16); num_warps: None keeps the launcher's pinned warps."""

    mode: str
    block_m: int = PINNED_BLOCK_M
    num_warps: int | None = None
    m_tiles: int = 1

    @property
    def rows_per_program(self) -> int:
        return self.block_m * self.m_tiles

    def warps(self, pinned: int) -> int:
        return pinned if self.num_warps is None else self.num_warps


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> tuple[int, int] | None:
    try:
        return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
    except Exception:  # a CPU build or a broken driver: no wide tiles
        return None


def wide_allowed(t: torch.Tensor) -> bool:
    """Whether the rule may widen tiles for tensors like t: compiled (not interpreted) on a CUDA
    GPU of the measured architecture."""
    index = compiled_cuda_index(t)
    return index is not None and _arch(index) == MEASURED_ARCH


def _tiles(mode: str, n: int) -> Tiles:
    if mode == BM64:
        return Tiles(BM64, WIDE_BLOCK_M, WIDE_WARPS)
    if mode == MLOOP:
        return Tiles(MLOOP, PINNED_BLOCK_M, None, max(1, min(MAX_M_TILES, triton.cdiv(n, 16))))
    return Tiles(PINNED)


def choose(kind: str, n: int, t: torch.Tensor, mode: str | None = None, *,
           programs: int | None = None) -> Tiles:
    """The tiles a `kind` (LINEAR, PROLOGUE, SPLITK or PROLOGUE_SPLITK) launch of n rows on
    tensors like t uses: the module docstring's rule, or `mode` where given (checked against the
    kind). `programs`: the launch's programs along N (times its splits) at one row tile; fewer
    than MIN_WIDE_PROGRAMS keep the pinned tiles (None: not checked)."""
    check(kind in MODES, lambda: f"tile kind must be one of {sorted(MODES)}, got {kind!r}")
    if mode is not None:
        check(mode in MODES[kind], lambda: f"{kind} tiles: mode must be one of {MODES[kind]}, got {mode!r}")
        return _tiles(mode, n)
    if n <= WIDE_FROM_N[kind] or not wide_allowed(t) or (
            programs is not None and programs < MIN_WIDE_PROGRAMS):
        return _tiles(PINNED, n)
    return _tiles(WIDE[kind], n)


def describe(kind: str, n: int, t: torch.Tensor, mode: str | None = None, *,
             programs: int | None = None) -> str:
    """'bm64 (BLOCK_M 64, 4 warps)', 'mloop (4 x 16 rows)' or 'pinned (BLOCK_M 16)': the tile a
    launch at width n gets, as a plan report or a benchmark would print it."""
    c = choose(kind, n, t, mode, programs=programs)
    if c.mode == BM64:
        return f"bm64 (BLOCK_M {c.block_m}, {c.num_warps} warps)"
    if c.mode == MLOOP:
        return f"mloop ({c.m_tiles} x {c.block_m} rows)"
    return f"pinned (BLOCK_M {c.block_m})"
