"""The 8B draft chain's fused linears as benchmarks/wide_sweep.py sweeps them (issue 15 item 3):
each launched as the chain binds it, at the pinned tiles (`pinned`, the family ref: BLOCK_M 16 at
every n) and at kernels.tiles' rule (`rule`: the pinned tiles at n <= 16, at n > 16 BLOCK_M 64
with 4 warps for the one-launch kernels and the M-tile loop for the split-K partials); the
split-K ones also at a forced `mloop` and `bm64` (whichever the rule's SPLITK_WIDE should be).
The sweep checks every row of every width bitwise against the ref's row alone (n = 1): `=` under
`rule` at n = 32 / 64 is the claim that the wide tiles keep a row's bits.

  qkv_norm               rmsnorm_linear_qkv: rmsnorm, then q / k / v (4096 / 1024 / 1024 of 4096)
  gate_up_norm_silu      linear_prologue: rmsnorm, [Wg; Wu] 2 x 14336 of 4096, SwiGLU
  eh_proj_concat_splitk  linear_prologue_splitk: embedding rows (a table of TABLE_ROWS; one id -1),
                         rmsnorm of each half, concat, 4096 of 8192
  o_splitk_residual      linear_splitk + the residual add: 4096 of 4096
  down_splitk_residual   linear_splitk + the residual add: 4096 of 14336

`chain_candidates(...)` -> {candidate: (family, fn(x, w, out, ws))}, as wide_sweep.candidates.
A launch's row operands besides x (ids, the residual) are the rows of x's own rows: x is always a
row slice of the sweep's X, so its first row's index is read off its address.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from draft_circuit.kernels import linear_fused as lf
from draft_circuit.kernels import linear_fused_splitk as lfs
from draft_circuit.kernels import linear_splitk as sk
from draft_circuit.kernels import tiles

# (name, weight rows, K, SwiGLU), the 8B chain's shapes
CHAIN_SHAPES = [("qkv_norm", 6144, 4096, False), ("gate_up_norm_silu", 2 * 14336, 4096, True),
                ("eh_proj_concat_splitk", 4096, 8192, False),
                ("o_splitk_residual", 4096, 4096, False),
                ("down_splitk_residual", 4096, 14336, False)]
# the interpreter's: one N tile each, so that the smoke run stays short
DRY_CHAIN_SHAPES = [("qkv_norm", 48, 32, False), ("gate_up_norm_silu", 2 * 16, 32, True),
                    ("eh_proj_concat_splitk", 16, 256, False), ("o_splitk_residual", 16, 256, False)]
SPLIT_SHAPES = {"eh_proj_concat_splitk", "o_splitk_residual", "down_splitk_residual"}
NAMES = {s[0] for s in CHAIN_SHAPES}
TABLE_ROWS = 8192  # the embedding's gathered rows are what a launch reads; 128256 rows need not be
EPS = 1e-5


def _row0(x: torch.Tensor, X: torch.Tensor) -> int:
    """The index in X of x's first row (x is X[r0:r0 + n])."""
    return (x.data_ptr() - X.data_ptr()) // (X.stride(0) * X.element_size())


def chain_candidates(name: str, rows: int, k: int, X: torch.Tensor, split: sk.SplitKConfig,
                     dev: torch.device, dt: torch.dtype) -> dict[str, tuple[str, Callable]]:
    """candidate -> ("pinned", fn(x, w, out, ws) -> Triton handle or None) for a chain shape;
    x is a row slice of X [nmax, k], w a [rows, k] weight, ws the fp32 split-K workspace."""
    gen = torch.Generator(device=dev).manual_seed(1)

    def vec(m: int) -> torch.Tensor:  # a norm weight near 1
        return (1 + 0.1 * torch.randn(m, generator=gen, device=dev)).to(dt)

    nmax = X.shape[0]
    fn: Callable[..., Any]
    if name == "qkv_norm":
        nw, q = vec(k), rows * 2 // 3
        kv = (rows - q) // 2

        def fn(x, w, o, ws, mode):
            cuts = (slice(0, q), slice(q, q + kv), slice(q + kv, rows))
            lf.rmsnorm_linear_qkv(x, nw, EPS, [w[c] for c in cuts], [o[:, c] for c in cuts],
                                  tiles=mode)
    elif name == "gate_up_norm_silu":
        nw = vec(k)

        def fn(x, w, o, ws, mode):
            lf.linear_prologue(x, w, o, norm1=nw, eps1=EPS, silu_mul=True, tiles=mode)
    elif name == "eh_proj_concat_splitk":
        k1 = k // 2
        table_rows = min(TABLE_ROWS, 4 * nmax) if dev.type == "cpu" else TABLE_ROWS
        table = torch.randn(table_rows, k1, generator=gen, device=dev).to(dt)
        ids = (torch.arange(nmax, device=dev) * 7919) % table_rows
        ids[nmax // 3] = -1  # an all-masked draft: a zero row by policy
        nw1, nw2 = vec(k1), vec(k - k1)

        def fn(x, w, o, ws, mode):
            r0 = _row0(x, X)
            return lfs.linear_prologue_splitk(
                table, w, o, ws, ids=ids[r0:r0 + x.shape[0]], norm1=nw1, eps1=EPS,
                x2=x[:, k1:], norm2=nw2, eps2=EPS, config=split, tiles=mode)
    elif name in ("o_splitk_residual", "down_splitk_residual"):
        res = torch.randn(nmax, rows, generator=gen, device=dev).to(dt)

        def fn(x, w, o, ws, mode):
            r0 = _row0(x, X)
            sk.linear_splitk(x, w, o, ws, split, residual=res[r0:r0 + x.shape[0]], tiles=mode)
    else:
        raise KeyError(name)
    modes: dict[str, str | None] = {"pinned": tiles.PINNED, "rule": None}
    if name in SPLIT_SHAPES:
        modes.update(mloop=tiles.MLOOP, bm64=tiles.BM64)
    return {cand: ("pinned", functools.partial(fn, mode=m)) for cand, m in modes.items()}
