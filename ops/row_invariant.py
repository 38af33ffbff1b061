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
each row copied first (gemv's path depends on the vector's address), and a row per weight read.

Its attention, `row_invariant_attention`, is batched the same way (fixed-shape tiles of query
rows and key chunks), measured the same way (tests/ops/test_attention_row_invariant.py); at a
decode's shapes its cost is per-op dispatch, so its index plan is built in numpy once per
(tables, lengths) (ops/row_invariant_plan.py; a decode's miss builds its next steps' too) and
each call is a few dozen flat-indexed torch ops (issue 20).
"""
from __future__ import annotations

import torch

from draft_circuit.ops.row_invariant_plan import (  # noqa: F401 (the plan's names, re-exported for tests)
    _CHUNKS, _MAX_PLANS, _PLANS, AHEAD, KEY_TILE, QUERY_TILE, _index, _make_chunks, _make_plan, _make_plans,
    _shared_plan, _tile_plan)

# rows per GEMM call. At the CPU default (k = 3, batch 4) a verify is 16 rows: one tile, one call
# per linear, as a batch's decode is. 8 made it two calls, and at the embedded model's shapes a
# call's cost is dispatch, not arithmetic: 16 measured 1.53-1.70x target-only tokens/s in the
# quick start against 1.46-1.57x at 8 (interleaved, 3 runs each; target-only's tokens/s within
# noise, its 4-row decode pass a few percent slower for the padding), and 32 slowed both engines
# (each decode pads to 32 rows). benchmarks/RESULTS.md, 2026-12-08. Issue 20.
ROW_TILE = 16
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
            # a fresh copy: MKL's float64 gemv takes another path (other bits) for a vector at an
            # address a row of a batch has and a row alone has not (measured: [97, 131])
            torch.mv(w, x[i].clone(), out=out[i])
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


# ---- attention (its index plan: ops/row_invariant_plan.py) ----


def row_invariant_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Paged attention of each row of q [n, heads * head_dim] over the first lengths[i] >= 0 KV
    rows of its table (caches [num_blocks, block_size, kv_heads, head_dim]), in fp32, cast to
    q's dtype; each row's bits those it gets alone.

    A row at position p = lengths - 1 sits in slot p % QUERY_TILE of a tile: the consecutive
    rows with its table and its p // QUERY_TILE (a decode row alone, a verify's or a prefill's
    rows together), whose diagonal block starts at base = p - p % QUERY_TILE. The tile's keys
    0..base + QUERY_TILE - 1 are KEY_TILE-key chunks, each one fixed-shape GEMM per KV head for
    the whole tile, batched over every tile's chunks (bmm treats its batch entries alike, and a
    fixed-shape GEMM its rows: measured; an empty slot computes a copy of a row beside it, never
    read). Only the last chunk holds keys past a row: their scores are -inf, so exp gives
    exactly 0. The row's max is exact in any order; its sums run in an order fixed by its own
    length: the last chunk's, then the others' in order (index_add_), values from base on
    zeroed for the whole tile, then the diagonal block's, its values past the row zeroed row by
    row (a later row's non-finite value never meets this row's zero weight). Neither the other
    rows, nor their count, nor other tiles reach a row: tests/ops/test_attention_row_invariant.py.
    The calls are few (dispatch, not arithmetic, is the cost at a decode's shapes): every index
    comes from the plan, flat, and fp32 inputs skip their casts.
    """
    block_size, kv_heads, dim = kc.shape[1:]
    n, heads = q.shape[0], q.shape[1] // dim
    if n == 0:
        return q.new_empty(0, heads * dim)
    group, tq, kt = heads // kv_heads, QUERY_TILE, KEY_TILE
    p = _tile_plan(tables, lengths, block_size, kv_heads, group)
    if p is None:  # a row of no keys: the softmax over nothing, zero weights
        keep = lengths > 0
        out = torch.zeros_like(q)
        if bool(keep.any()):
            out[keep] = row_invariant_attention(q[keep], kc, vc, tables[keep], lengths[keep], scale)
        return out
    nt, m, gd, fp32 = p.num_tiles, tq * group, group * dim, torch.float32
    keys = kc.reshape(-1, dim).index_select(0, p.key_rows)
    vals = vc.reshape(-1, dim).index_select(0, p.value_rows)
    qs = q * scale if q.dtype == fp32 else q.float() * scale
    if keys.dtype != fp32:
        keys, vals = keys.float(), vals.float()
    qb = qs.view(-1, gd).index_select(0, p.q_rows).view(-1, m, dim)    # [P * kv_heads, m, dim]
    scores = torch.bmm(qb, keys.view(-1, kt, dim).transpose(1, 2))
    scores.view(-1).index_fill_(0, p.last_past, float("-inf"))
    scores = scores.view(-1, kv_heads * m, kt)                          # [P, kv_heads * m, kt]
    peak = scores.new_empty(nt, kv_heads * m, 1).scatter_reduce_(
        0, p.peak_index, scores.amax(-1, keepdim=True), "amax", include_self=False)
    weights = scores.sub_(peak.index_select(0, p.pair_tile)).exp_()
    # the chunks' values from the diagonal block on (it has its own GEMM), its values past each slot
    vals.index_fill_(0, p.value_zero, 0.0)
    split = p.key_rows.shape[0]
    pv = torch.bmm(weights.view(-1, m, kt), vals[:split].view(-1, kt, dim))
    pv_sum = pv.new_zeros(nt, kv_heads * m * dim).index_add_(0, p.pair_tile, pv.view(-1, kv_heads * m * dim))
    denom = pv.new_zeros(nt, kv_heads * m).index_add_(0, p.pair_tile, weights.sum(-1))
    dweights = weights.view(-1, tq).index_select(0, p.diag_weights)   # [nt * kv_heads * m, tq]
    dpv = torch.bmm(dweights.view(-1, group, tq), vals[split:].view(-1, tq, dim))
    o = pv_sum.add_(dpv.view(nt, -1)).view(nt, kv_heads * m, dim).div_(denom.unsqueeze(-1))
    out = o.view(-1, gd).index_select(0, p.out_rows).view(n, heads * dim)
    return out if q.dtype == fp32 else out.to(q.dtype)
