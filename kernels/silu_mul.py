"""SwiGLU activation: out[n, I] = silu(x[:, :I]) * x[:, I:], computed in fp32 and rounded once.

`silu_mul(x, out)`; x is [n, 2*I]; rows unit-stride. Grid over (rows, column blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)

BLOCK = 1024


@triton.jit(do_not_specialize=["pdl_release"])
def silu_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_out,
    inter, pdl_release,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(a) = a * sigmoid(a); same multiplication order as the reference (a * sigmoid(a)) * b
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, I] = silu(x[:, :I]) * x[:, I:]; x [n, 2I] and out [n, I] float (dtypes may differ)."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, lambda: f"{describe('x', x)}: expected [n, 2*I]")
    n, inter = x.shape[0], x.shape[1] // 2
    check_operand("x", x, (n, 2 * inter), FLOAT_DTYPES, x.device)
    check_operand("out", out, (n, inter), FLOAT_DTYPES, x.device)
    if n == 0 or inter == 0:
        return
    pdl = launch_kwargs(x)
    grid = (n, triton.cdiv(inter, BLOCK))
    silu_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter,
        BLOCK=BLOCK, **pdl_args(pdl, n), num_warps=4, **pdl,
    )
