"""A prologue linear's x as a launch of its own (issue 15, the 8B chain at wide n):
`prologue_norm(x1, out, ...)` stores out[n, K] = [p1(x1) | p2(x2)], the tiles kernels.linear_fused's
prologue builds in registers (an embedding gather, an rmsnorm of each part in HF order, the
concat), bit for bit; the linear after it then reads `out` as plain x.

Why a launch of its own pays at wide n. A prologue linear's every program re-derives its rows'
1 / rms (a full pass over the rows) and normalises each x tile again: at n = 64 the 8B gate_up
(448 programs of 32 columns) reads x twice per program, twice the weight's own bytes, from L2,
and its K loop cannot let Triton pipeline x. Here the norm runs once per row; the linear after
it streams x as kernels.linear does. Measured on an H100 (2026-12-07, two calls,
benchmarks/results/2026-12-07-s8-nvidia-h100-prenorm-ab.json: us a launch pair, a CUDA graph over rotated weights, bf16; one prologue launch -> the
norm, then the plain kernel; the norm alone 3.4 us, 5.1 for the MTP input's two halves; q/k/v's
plain kernel was since made one K loop: 20.6 us alone at n = 64, benchmarks/RESULTS.md):

  n       gate_up + norm + SwiGLU   q/k/v + norm     eh_proj (gather, 2 norms, split-K)
  1       83.5 -> 88.0              26.1 -> 23.8     29.3 -> 33.1
  16      87.3 -> 90.0              31.4 -> 24.2     33.3 -> 34.4
  17      99.7 -> 88.8              29.5 -> 24.6     41.5 -> 35.8
  32      100.2 -> 90.3             32.1 -> 24.7     44.6 -> 37.6
  64      125.4 -> 91.0             51.6 -> 39.0     80.4 -> 40.0

`prenorm_pays(n, parts, qkv)` is the rule (K >= 4096 in parts of a multiple of 16 columns, and
n > 16; q/k/v at every n) the op bindings apply by handing the launchers of kernels.linear_fused and kernels.linear_fused_splitk the
`normed` buffer (ops/prologue_linear.py's workspace rules); gate_up and eh_proj keep one launch
at n <= 16, where it is the faster.

Bits: a program owns one row and loads it as [SLAB, NORM_BLOCK_K] slabs, SLAB of the prologue
kernels' norm chunks at once (one memory round trip where `_inv_rms` waits one per four
chunks). Each chunk's sum of squares is a row of `_sum_sq` over [*, NORM_BLOCK_K]: on a GPU
that sum's tree is the load's layout along K, which is the prologue kernels' [16, NORM_BLOCK_K]
chunks' where rows start ALIGN-element aligned (a review read the sm90 layouts: with a stride
off 16 the prologue's loads lose their vector width and sum across warps; so the rule asks for
aligned parts and the launcher refuses unaligned rows on a GPU). The chunk sums are added to
the fp32 total one at a time in K order from zero, exactly `_inv_rms`'s sequence of adds (a
chunk is taken out of the slab's vector by a masked sum, the chunk plus zeros: exact). The
normalisation is `_norm_x`'s arithmetic on each element. So the linear after it sees the values
the prologue kernel multiplied, and with the same BLOCK_K and K order its products are the
prologue kernel's (the tile around a row may differ: kernels.tiles measured that it does not move
a row's bits on sm90): a row's bits do not depend on n, nor on which of the two paths a width
takes (tests/kernels/test_prologue_norm.py checks both, the interpreter and the GPU).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (check, check_operand, compiled_cuda_index, describe,
                                           launch_kwargs, pdl_args)
from draft_circuit.kernels.linear import NUM_WARPS
from draft_circuit.kernels.prologue_tiles import NORM_BLOCK_K, _sum_sq

LAUNCHES = 1
# n above this, K from that: the prologue linears take the norm as a launch of its own. Measured
# on an H100 at the 8B shapes (K 4096 and 8192; the A/B in the module docstring): from n = 17
# all three gain, at n = 16 gate_up and eh_proj lose 1-3 us; narrower K re-reads little per
# program and was not measured: it keeps one launch
PRENORM_FROM_N, PRENORM_FROM_K = 16, 4096
# q/k/v's own threshold: at every n. Its norm as a launch of its own measured faster at every n
# (23.3 against 25.9 us at n = 1), and the 8B chain with it, one more launch a step at n <= 16,
# 2239.5 -> 2218.6 us at n = 1, 2292.4 -> 2259.8 at n = 8 (H100, one call; RESULTS.md)
QKV_PRENORM_FROM_N = 0
SLAB = 32  # NORM_BLOCK_K chunks of a row loaded at once: 4096 columns, 32 values a thread
# a part's columns (and so a contiguous row's stride) a multiple of this: on a GPU the loads of
# both paths then take the same layout, so the chunk sums add in the same tree (with a stride
# off it, the prologue kernels' chunk loads lose their vector width and sum across warps)
ALIGN = 16


def prenorm_pays(n: int, parts: Sequence[int], qkv: bool = False) -> bool:
    """Whether a prologue linear of n rows whose x is the concat of parts of these widths (one
    part, or the MTP input's two; q/k/v's: `qkv`) runs its prologue as a launch of its own."""
    return (n > (QKV_PRENORM_FROM_N if qkv else PRENORM_FROM_N) and sum(parts) >= PRENORM_FROM_K
            and all(p % ALIGN == 0 for p in parts))


@triton.jit
def _slab(x_ptr, row_off, ok, s0, K, SLAB: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[row, s0 : s0 + SLAB * BLOCK_K] as [SLAB, BLOCK_K] (zeros past K or where not ok), and
    its column indices."""
    cols = s0 + tl.arange(0, SLAB)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    # ok folded into the bound (the interpreter turns a block & a scalar bool into ints)
    return tl.load(x_ptr + row_off + cols, mask=cols < tl.where(ok, K, 0), other=0.0), cols


@triton.jit
def _row_inv_rms(x_ptr, row_off, ok, K, eps, SLAB: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of one row with `_inv_rms`'s bits: BLOCK_K chunk sums added in K order."""
    ss = tl.zeros((), dtype=tl.float32)
    which = tl.arange(0, SLAB)
    for s0 in range(0, K, SLAB * BLOCK_K):
        x, _ = _slab(x_ptr, row_off, ok, s0, K, SLAB, BLOCK_K)
        sums = _sum_sq(x)  # [SLAB]: each chunk's sum, as a row of _inv_rms's chunk
        for j in tl.static_range(SLAB):  # one chunk at a time, in order
            ss += tl.sum(tl.where(which == j, sums, 0.0))
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _store_part(x_ptr, row_off, ok, K, nw_ptr, inv, out_ptr, NORM: tl.constexpr,
                SLAB: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[0:K] = the row normalised as `_norm_x` does (as loaded without NORM)."""
    for s0 in range(0, K, SLAB * BLOCK_K):
        x, cols = _slab(x_ptr, row_off, ok, s0, K, SLAB, BLOCK_K)
        if NORM:
            nw = tl.load(nw_ptr + cols, mask=cols < K, other=0.0)
            y = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
            x = (y * nw.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + cols, x, mask=cols < K)


@triton.jit(do_not_specialize=["n_rows", "table_rows", "pdl_release"])
def prologue_norm_kernel(
    x1_ptr, ids_ptr, nw1_ptr, x2_ptr, nw2_ptr, out_ptr,
    n_rows, K, K1, table_rows, eps1, eps2, stride_x1, stride_x2, stride_out, pdl_release,
    GATHER: tl.constexpr, NORM1: tl.constexpr, TWO_X: tl.constexpr, NORM2: tl.constexpr,
    SLAB: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x1, x2 and ids may come from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    ok1 = row < n_rows
    row1 = row
    if GATHER:  # prologue_tiles._rows: an id outside the table reads a zero row
        i = tl.load(ids_ptr + row).to(tl.int64)
        ok1 = (i >= 0) & (i < table_rows)
        row1 = tl.where(ok1, i, 0)
    off1 = row1 * stride_x1
    off2 = row * stride_x2
    out_row = out_ptr + row * stride_out
    inv1 = tl.zeros((), dtype=tl.float32)
    if NORM1:
        inv1 = _row_inv_rms(x1_ptr, off1, ok1, K1, eps1, SLAB, BLOCK_K)
    _store_part(x1_ptr, off1, ok1, K1, nw1_ptr, inv1, out_row, NORM1, SLAB, BLOCK_K)
    if TWO_X:
        inv2 = tl.zeros((), dtype=tl.float32)
        if NORM2:
            inv2 = _row_inv_rms(x2_ptr, off2, True, K - K1, eps2, SLAB, BLOCK_K)
        _store_part(x2_ptr, off2, True, K - K1, nw2_ptr, inv2, out_row + K1, NORM2, SLAB, BLOCK_K)


def _aligned(t: torch.Tensor) -> bool:
    """Every row of t starts ALIGN-element aligned (a one-row tensor's stride is never used)."""
    rows_ok = t.shape[0] == 1 or t.stride(0) % ALIGN == 0
    return rows_ok and t.data_ptr() % (ALIGN * t.element_size()) == 0


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a's and b's byte ranges in one storage overlap (a conservative check)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def prologue_norm(x1: torch.Tensor, out: torch.Tensor, *, n: int, k: int,
                  ids: torch.Tensor | None = None, norm1: torch.Tensor | None = None,
                  eps1: float = 1e-6, x2: torch.Tensor | None = None,
                  norm2: torch.Tensor | None = None, eps2: float = 1e-6) -> None:
    """out[n, k] = [p1(x1) | p2(x2)] in x1's dtype, one launch: the operands as
    kernels.linear_fused.linear_prologue takes them (its launchers check them first with
    check_prologue_operands; n rows, k = K1 + K2 columns). Checked here: `out` ("normed"), the
    parts' shapes, that `out` shares no memory with x1 or x2, and on a GPU that x1's and x2's
    rows start ALIGN-element aligned (where the bits of the two paths were shown equal).
    Raises KernelInputError naming the operand."""
    k1 = x1.shape[1]
    check_operand("normed", out, (n, k), (x1.dtype,), x1.device)
    check(n < 2 or out.stride(0) >= k, lambda: f"normed: rows overlap (stride {out.stride(0)} < {k})")
    check((x2 is None and k == k1) or (x2 is not None and tuple(x2.shape) == (n, k - k1)),
          lambda: f"normed: [n, {k}] is not [p1(x1) | p2(x2)] of x1 {list(x1.shape)}"
                  f"{'' if x2 is None else f' and x2 {list(x2.shape)}'}")
    check(ids is not None or x1.shape[0] == n, lambda: f"{describe('x1', x1)}: expected {n} rows")
    check(ids is None or tuple(ids.shape) == (n,), lambda: f"{describe('ids', ids)}: expected [{n}]")
    for name, w, cols in (("norm1", norm1, k1), ("norm2", norm2, k - k1)):
        check(w is None or tuple(w.shape) == (cols,), lambda: f"{describe(name, w)}: expected [{cols}]")
    for name, t in (("x1", x1), ("x2", x2)):
        check(t is None or not _shares_memory(out, t),
              lambda: f"normed: shares memory with {describe(name, t)}")
        check(t is None or compiled_cuda_index(t) is None or _aligned(t),
              lambda: f"{describe(name, t)}: the prologue's own launch needs rows starting "
                      f"{ALIGN}-element aligned on a GPU (stride {t.stride(0)})")
    if n == 0 or k == 0:
        return
    pdl = launch_kwargs(x1)
    prologue_norm_kernel[(n,)](
        x1, ids if ids is not None else x1, norm1 if norm1 is not None else x1,
        x2 if x2 is not None else x1, norm2 if norm2 is not None else x1, out,
        n, k, x1.shape[1], x1.shape[0], float(eps1), float(eps2),
        x1.stride(0), x2.stride(0) if x2 is not None else 0, out.stride(0),
        GATHER=ids is not None, NORM1=norm1 is not None, TWO_X=x2 is not None,
        NORM2=norm2 is not None, SLAB=SLAB, BLOCK_K=NORM_BLOCK_K, **pdl_args(pdl, n),
        num_warps=NUM_WARPS, **pdl)
