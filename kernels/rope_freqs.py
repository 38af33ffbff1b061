"""Rotate-half RoPE from a frequency table: out[i, h] = rope(x[i, h]) at angle (positions[i] +
pos_offset) * inv_freq, cos and sin times attention_factor (YaRN's mscale), in fp32, cast once.

One program per (row, head): a row's bits never depend on n. `rope_freqs(x, positions, inv_freq,
out, head_dim=, attention_factor=, pos_offset=)`; out may alias x.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (FLOAT_DTYPES, INDEX_DTYPES, check, check_operand,
                                           interpreting, launch_kwargs, pdl_args)


# the step offsets vary by draft step: unspecialised, one compile serves every step
# (tests/runners/test_capture_precompile.py::test_draft_steps_share_their_compiles)
@triton.jit(do_not_specialize=["pos_offset", "pdl_release"])
def rope_freqs_kernel(
    x_ptr, pos_ptr, freq_ptr, out_ptr, stride_x, stride_out, pos_offset, attention_factor, pdl_release,
    HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, BLOCK_HALF)
    mask = j < half
    inv_freq = tl.load(freq_ptr + j, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and the positions come from earlier launches
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    # the offset is added as an integer, then converted: the reference's order
    pos = (tl.load(pos_ptr + row).to(tl.int64) + pos_offset).to(tl.float32)
    angle = pos * inv_freq
    if LIBDEVICE:  # full argument reduction at any position, as torch's CUDA cos/sin
        cos = tl.extra.cuda.libdevice.cos(angle) * attention_factor
        sin = tl.extra.cuda.libdevice.sin(angle) * attention_factor
    else:
        cos = tl.cos(angle) * attention_factor
        sin = tl.sin(angle) * attention_factor
    src = x_ptr + row * stride_x + head * HEAD_DIM
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + row * stride_out + head * HEAD_DIM
    tl.store(dst + j, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + j, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rope_freqs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor, *,
               head_dim: int, attention_factor: float = 1.0, pos_offset: int = 0) -> None:
    """x, out [n, heads * head_dim] (same float dtype family, unit inner stride); positions [n]
    int32/int64; inv_freq float32 [head_dim // 2]. No host sync."""
    n, dev = x.shape[0], x.device
    check(head_dim > 0 and head_dim % 2 == 0 and x.dim() == 2 and x.shape[1] % head_dim == 0,
          lambda: f"head_dim {head_dim} must be even and divide x's width {list(x.shape)}")
    check_operand("x", x, (n, x.shape[1]), FLOAT_DTYPES, dev)
    check_operand("out", out, (n, x.shape[1]), FLOAT_DTYPES, dev)
    check_operand("positions", positions, (n,), INDEX_DTYPES, dev)
    check_operand("inv_freq", inv_freq, (head_dim // 2,), (torch.float32,), dev)
    if n == 0:
        return
    pdl = launch_kwargs(x)
    rope_freqs_kernel[(n, x.shape[1] // head_dim)](
        x, positions, inv_freq, out, x.stride(0), out.stride(0), int(pos_offset), float(attention_factor),
        HEAD_DIM=head_dim, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        LIBDEVICE=not interpreting(), **pdl_args(pdl, n), num_warps=1, **pdl,
    )
