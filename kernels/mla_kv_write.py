"""The paged write of one latent row per sequence: at slot (block_tables[i, r // bs], r % bs) with
r = live_rows[i] + row_offset, pe_cache gets k_pe[i] and latent_cache gets latent[i]; a row with
active[i] == 0 writes nothing.

Grid (n,): a row touches only its own slot. Indices are not bounds-checked on the device: padded
rows must be inactive or point at a scratch block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)


# the step offsets vary by draft step: unspecialised, one compile serves every step
# (tests/runners/test_capture_precompile.py::test_draft_steps_share_their_compiles)
@triton.jit(do_not_specialize=["row_offset", "pdl_release"])
def mla_kv_write_kernel(
    pe_cache_ptr, latent_cache_ptr, latent_ptr, pe_ptr, tables_ptr, live_ptr, active_ptr,
    stride_pb, stride_ps, stride_lb, stride_ls, stride_latent, stride_pe, stride_tables, row_offset, block_size,
    pdl_release,
    R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
    HAS_ACTIVE: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the latent, k_pe and the tables come from earlier launches
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    write = True
    if HAS_ACTIVE:
        write = tl.load(active_ptr + row) != 0
    if write:
        r = tl.load(live_ptr + row) + row_offset
        blk = tl.load(tables_ptr + row * stride_tables + r // block_size).to(tl.int64)
        slot = (r % block_size).to(tl.int64)
        j = tl.arange(0, R_PAD)
        c = tl.load(latent_ptr + row * stride_latent + j, mask=j < R)
        tl.store(latent_cache_ptr + blk * stride_lb + slot * stride_ls + j,
                 c.to(latent_cache_ptr.dtype.element_ty), mask=j < R)
        p = tl.arange(0, P_PAD)
        k = tl.load(pe_ptr + row * stride_pe + p, mask=p < P)
        tl.store(pe_cache_ptr + blk * stride_pb + slot * stride_ps + p, k.to(pe_cache_ptr.dtype.element_ty),
                 mask=p < P)


def mla_kv_write(pe_cache: torch.Tensor, latent_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 block_tables: torch.Tensor, live_rows: torch.Tensor, *, row_offset: int = 0,
                 active: torch.Tensor | None = None) -> None:
    """pe_cache [num_blocks, block_size, 1, P], latent_cache [num_blocks, block_size, 1, R] (unit
    inner strides); latent [n, R]; k_pe [n, P]; block_tables [n, max_blocks] int32; live_rows,
    active [n] int32. No host sync."""
    dev = latent.device
    check(latent.dim() == 2 and k_pe.dim() == 2, lambda: f"{describe('latent', latent)}, "
          f"{describe('k_pe', k_pe)}: expected [n, R] and [n, P]")
    (n, r), p = latent.shape, k_pe.shape[1]
    check(pe_cache.dim() == 4, lambda: f"{describe('pe_cache', pe_cache)}: expected [num_blocks, block_size, 1, P]")
    blocks = tuple(pe_cache.shape[:2])
    check_operand("pe_cache", pe_cache, (*blocks, 1, p), FLOAT_DTYPES, dev)
    check_operand("latent_cache", latent_cache, (*blocks, 1, r), FLOAT_DTYPES, dev)
    check_operand("latent", latent, (n, r), FLOAT_DTYPES, dev)
    check_operand("k_pe", k_pe, (n, p), FLOAT_DTYPES, dev)
    check_operand("live_rows", live_rows, (n,), (torch.int32,), dev)
    check(block_tables.dim() == 2, lambda: f"{describe('block_tables', block_tables)}: expected [n, max_blocks]")
    check_operand("block_tables", block_tables, (n, block_tables.shape[1]), (torch.int32,), dev)
    if active is not None:
        check_operand("active", active, (n,), (torch.int32,), dev)
    if n == 0:
        return
    pdl = launch_kwargs(latent)
    mla_kv_write_kernel[(n,)](
        pe_cache, latent_cache, latent, k_pe, block_tables, live_rows, active if active is not None else live_rows,
        pe_cache.stride(0), pe_cache.stride(1), latent_cache.stride(0), latent_cache.stride(1),
        latent.stride(0), k_pe.stride(0), block_tables.stride(0), int(row_offset), pe_cache.shape[1],
        R=r, P=p, R_PAD=triton.next_power_of_2(r), P_PAD=triton.next_power_of_2(p),
        HAS_ACTIVE=active is not None,
        **pdl_args(pdl, n), num_warps=4 if r >= 256 else 1, **pdl,
    )
