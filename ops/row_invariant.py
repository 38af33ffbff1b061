"""A batched CPU x @ w^T whose every row has the bits it has alone: the references' linear.

A BLAS picks its kernel by the GEMM's shape, so `torch.mm` gives a row different bits at different
row counts (MKL's fp32 sgemm: at 1..15 rows against 16 and more). Run at one fixed shape instead,
the rows are independent: the input is padded with zero rows to a multiple of ROW_TILE and
multiplied one ROW_TILE-row tile at a time, so every GEMM call has the same shape whatever the
row count, and a row's result depends on neither the other rows, nor their count, nor its
position. That is measured, not argued: tests/ops/test_row_invariant.py checks a row alone
against the same row at every position of batches of 1..3 * ROW_TILE rows, bitwise, for the
engine's and the drafter's shapes and odd ones, fp32 / fp16 / bf16, at 1 and 2 threads.
Elsewhere (another device or dtype, where nothing was measured) it stays one row at a time,
which is row-invariant by construction and a row per weight read.
"""
from __future__ import annotations

import torch

# rows per GEMM call; a verify of k + 1 rows (or a batch's decode rows) fits in a tile or two,
# so it reads each weight once or twice instead of once per row (issue 20)
ROW_TILE = 8
# where row invariance was measured (tests/ops/test_row_invariant.py)
TILED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def tiled(x: torch.Tensor) -> bool:
    """Whether `row_invariant_linear` runs x @ w^T in tiles (else one row at a time)."""
    return x.device.type == "cpu" and x.dtype in TILED_DTYPES


def row_invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w [N, K]^T -> [n, N] in x's dtype (x and w of one dtype and device), each row's
    bits those it gets alone, whatever the other rows are, how many, and where it sits."""
    if not tiled(x):
        out = x.new_empty(x.shape[0], w.shape[0])
        for i in range(x.shape[0]):
            torch.mv(w, x[i], out=out[i])
        return out
    n, k = x.shape
    wt = w.t()  # a view: the GEMM reads w transposed, never a copy of it
    pad = -n % ROW_TILE
    x = torch.cat((x, x.new_zeros(pad, k))) if pad else x.contiguous()
    if x.shape[0] == ROW_TILE:
        return torch.mm(x, wt)[:n]
    out = x.new_empty(x.shape[0], w.shape[0])
    for start in range(0, x.shape[0], ROW_TILE):
        torch.mm(x[start:start + ROW_TILE], wt, out=out[start:start + ROW_TILE])
    return out[:n]
