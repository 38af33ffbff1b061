"""The tile-level pieces of the prologue linears (kernels.linear_fused, linear_fused_splitk, the
lm-head partials of kernels.argmax_logprob and kernels.qkv_rope): a row tile's 1 / rms, its x
tiles as loaded (`_raw_x`, `_x_raw`) and as normalised (`_norm_x`, `_x_finish`), the gathered
rows of an embedding, and one K step of a product (`_mac`). Loads and arithmetic are separate
functions so that a K loop can issue the next tile's loads a step ahead (`_raw_x` says why).
Every piece reads only its own rows: nothing here depends on n.
"""
from __future__ import annotations

import triton
import triton.language as tl

# chunk width of a norm prologue's pass over the row (`_inv_rms`), for every kernel that normalises
# in a prologue and for kernels.prologue_norm: only the order of that fp32 sum depends on it (never
# on n), so it is defined once
NORM_BLOCK_K = 128


@triton.jit
def _inv_rms(x_ptr, row_off, row_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row of the tile, the sum of squares in fp32 over BLOCK_K chunks in order.

    Four chunks are loaded before the first is summed: a load waits only where its value is
    used, so four are in flight at once (one at a time, each chunk waited a full memory latency,
    and an 8192-wide row is 64 chunks). The sums still run chunk by chunk in order and a chunk
    past K adds +0.0, so the bits are the one-chunk loop's."""
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, 4 * BLOCK_K):
        x0, x1, x2, x3 = _ld4(x_ptr, row_off, row_ok, k0, K, BLOCK_K)
        ss = _ss4(ss, x0, x1, x2, x3)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _ld4(x_ptr, row_off, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """The four norm chunks at k0, k0 + BLOCK_K, ...: loads only."""
    offs_k = tl.arange(0, BLOCK_K)
    return (_chunk(x_ptr, row_off, row_ok, k0 + offs_k, K),
            _chunk(x_ptr, row_off, row_ok, k0 + BLOCK_K + offs_k, K),
            _chunk(x_ptr, row_off, row_ok, k0 + 2 * BLOCK_K + offs_k, K),
            _chunk(x_ptr, row_off, row_ok, k0 + 3 * BLOCK_K + offs_k, K))


@triton.jit
def _ss4(ss, c0, c1, c2, c3):
    """ss plus four chunks' sums of squares, one chunk at a time, in order."""
    ss += _sum_sq(c0)
    ss += _sum_sq(c1)
    ss += _sum_sq(c2)
    ss += _sum_sq(c3)
    return ss


@triton.jit
def _ld8(x_ptr, row_off, row_ok, k0, K, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """4 * GROUPS norm chunks from k0 (GROUPS 1 or 2; at 1 the second four repeat the first,
    unused): loads only."""
    c0, c1, c2, c3 = _ld4(x_ptr, row_off, row_ok, k0, K, BLOCK_K)
    c4, c5, c6, c7 = c0, c1, c2, c3
    if GROUPS > 1:
        c4, c5, c6, c7 = _ld4(x_ptr, row_off, row_ok, k0 + 4 * BLOCK_K, K, BLOCK_K)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _ss8(ss, c0, c1, c2, c3, c4, c5, c6, c7, GROUPS: tl.constexpr):
    """ss plus the chunks of `_ld8`, one at a time, in order."""
    ss = _ss4(ss, c0, c1, c2, c3)
    if GROUPS > 1:
        ss = _ss4(ss, c4, c5, c6, c7)
    return ss


@triton.jit
def _inv_rms_pair(x1_ptr, off1, ok1, K1, eps1, x2_ptr, off2, ok2, K2, eps2,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    """(1 / rms of x1's rows, of x2's rows), each as `_inv_rms` computes it, bit for bit (the
    same BLOCK_K chunks summed one at a time in K order; a chunk past the shorter row adds
    +0.0), with both rows' loads in one pass: a step issues 4 * GROUPS chunks (GROUPS 1 or 2)
    of each before summing any, where `_inv_rms` one after the other waits a memory latency
    per 4 chunks of one row. The 8B eh_proj's split-K prologue at its Hopper tile: 33.9 ->
    30.1 us at n = 1 with GROUPS 2 (H100; kernels.linear_fused_splitk.LAUNCH)."""
    ss1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    ss2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, tl.maximum(K1, K2), 4 * GROUPS * BLOCK_K):
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(x1_ptr, off1, ok1, k0, K1, GROUPS, BLOCK_K)
        b0, b1, b2, b3, b4, b5, b6, b7 = _ld8(x2_ptr, off2, ok2, k0, K2, GROUPS, BLOCK_K)
        ss1 = _ss8(ss1, a0, a1, a2, a3, a4, a5, a6, a7, GROUPS)
        ss2 = _ss8(ss2, b0, b1, b2, b3, b4, b5, b6, b7, GROUPS)
    return tl.rsqrt(ss1 / K1 + eps1), tl.rsqrt(ss2 / K2 + eps2)


@triton.jit
def _chunk(x_ptr, row_off, row_ok, kk, K):
    return tl.load(x_ptr + row_off + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _sum_sq(x):
    x = x.to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _raw_x(x_ptr, row_off, row_ok, kk, K, nw_ptr, NORM: tl.constexpr):
    """The tile x[rows, kk] as stored (zeros outside 0 <= kk < K) and, when NORM, the norm
    weight's kk entries: loads only, nothing here waits on them. The fused kernels issue them a
    K step ahead by hand: Triton's pipeliner stages only loads that feed tl.dot directly, and a
    normalised tile passes through arithmetic first. Unstaged, every K step waited a full memory
    latency on its x tile (on the H200 the fused linears ran at 0.7-2.3 TB/s where
    kernels.linear, the same tiles without a prologue, ran at 3.5)."""
    k_ok = (kk >= 0) & (kk < K)
    x = tl.load(x_ptr + row_off + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    nw = kk  # unused without NORM: any value of a fixed type, so that a loop can carry it
    if NORM:
        nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0)
    return x, nw


@triton.jit
def _norm_x(x, nw, inv, NORM: tl.constexpr):
    """A tile from `_raw_x`, normalised when NORM."""
    if NORM:
        # HF order: normalise in fp32, round to x's dtype, scale by the weight, round; a product
        # of two 16-bit floats is exact in fp32, so rounding it once is the 16-bit multiply
        y = (x.to(tl.float32) * inv[:, None]).to(x.dtype).to(tl.float32)
        x = (y * nw.to(tl.float32)[None, :]).to(x.dtype)
    return x


@triton.jit
def _load_x(x_ptr, row_off, row_ok, kk, K, inv, nw_ptr, NORM: tl.constexpr):
    """The tile x[rows, kk] (zeros outside 0 <= kk < K), normalised when NORM, loaded and used
    at once (a first K step, or a kernel not yet prefetching)."""
    x, nw = _raw_x(x_ptr, row_off, row_ok, kk, K, nw_ptr, NORM)
    return _norm_x(x, nw, inv, NORM)


@triton.jit
def _rows(x_ptr, ids_ptr, offs_m, m_mask, stride_x, table_rows, GATHER: tl.constexpr):
    """(row offsets [BM, 1] int64, rows to read [BM]): the tile's own rows, or the table rows its
    ids pick (an id outside [0, table_rows) reads nothing: a zero row)."""
    rows = offs_m.to(tl.int64)
    ok = m_mask
    if GATHER:
        ids = tl.load(ids_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        ok = m_mask & (ids >= 0) & (ids < table_rows)
        rows = tl.where(ok, ids, 0)
    return rows[:, None] * stride_x, ok


@triton.jit
def _prologue_rows(x1_ptr, ids_ptr, x2_ptr, offs_m, m_mask, stride_x1, stride_x2, table_rows, K,
                   K1, eps1, eps2, GATHER: tl.constexpr, NORM1: tl.constexpr, NORM2: tl.constexpr,
                   BLOCK_M: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
                   NORM_GROUPS: tl.constexpr = 0):
    """A row tile's x1 offsets and rows to read (gathered by ids when GATHER), x2's offsets, and
    the 1 / rms of each over its full row (zeros where not normed). NORM_GROUPS 0: each
    by `_inv_rms`; 1 or 2 with both normed: together by `_inv_rms_pair` (the same bits)."""
    off1, ok1 = _rows(x1_ptr, ids_ptr, offs_m, m_mask, stride_x1, table_rows, GATHER)
    off2 = offs_m[:, None].to(tl.int64) * stride_x2
    inv1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    inv2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM_GROUPS > 0 and NORM1 and NORM2:  # one pass, more loads in flight: the same bits
        inv1, inv2 = _inv_rms_pair(x1_ptr, off1, ok1, K1, eps1, x2_ptr, off2, m_mask, K - K1,
                                   eps2, BLOCK_M, NORM_BLOCK_K, NORM_GROUPS)
    else:
        if NORM1:
            inv1 = _inv_rms(x1_ptr, off1, ok1, K1, eps1, BLOCK_M, NORM_BLOCK_K)
        if NORM2:
            inv2 = _inv_rms(x2_ptr, off2, m_mask, K - K1, eps2, BLOCK_M, NORM_BLOCK_K)
    return off1, ok1, off2, inv1, inv2


@triton.jit
def _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, ok2, nw2_ptr, kk, K,
           TWO_X: tl.constexpr, NORM1: tl.constexpr, NORM2: tl.constexpr):
    """The loads of the K tile kk of [p1(x1) | p2(x2)] (p1(x1) alone: K1 == K), for `_x_finish`."""
    a, na = _raw_x(x1_ptr, off1, ok1, kk, K1, nw1_ptr, NORM1)
    b, nb = a, na
    if TWO_X:
        b, nb = _raw_x(x2_ptr, off2, ok2, kk - K1, K - K1, nw2_ptr, NORM2)
    return a, na, b, nb


@triton.jit
def _x_finish(a, na, b, nb, inv1, inv2, kk, K1, TWO_X: tl.constexpr, NORM1: tl.constexpr,
              NORM2: tl.constexpr):
    x = _norm_x(a, na, inv1, NORM1)
    if TWO_X:  # a select: the concatenated row's values
        x = tl.where((kk < K1)[None, :], x, _norm_x(b, nb, inv2, NORM2))
    return x


@triton.jit
def _x_tile(x1_ptr, off1, ok1, K1, inv1, nw1_ptr, x2_ptr, off2, ok2, inv2, nw2_ptr, kk, K,
            TWO_X: tl.constexpr, NORM1: tl.constexpr, NORM2: tl.constexpr):
    """The K tile kk of [p1(x1) | p2(x2)] (or p1(x1) alone), loaded and used at once."""
    a, na, b, nb = _x_raw(x1_ptr, off1, ok1, K1, nw1_ptr, x2_ptr, off2, ok2, nw2_ptr, kk, K,
                          TWO_X, NORM1, NORM2)
    return _x_finish(a, na, b, nb, inv1, inv2, kk, K1, TWO_X, NORM1, NORM2)


@triton.jit
def _mac(x, w_ptrs, k0, kk, K, n_mask, up_offset, acc, acc_up, SILU_MUL: tl.constexpr):
    """One K step: acc += x @ W[:, kk]^T (and acc_up with SwiGLU's up rows)."""
    k_ok = (kk < K)[None, :]
    w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_ok, other=0.0)
    acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if SILU_MUL:
        u = tl.load(w_ptrs + up_offset + k0, mask=n_mask[:, None] & k_ok, other=0.0)
        acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision="ieee")
    return acc, acc_up
