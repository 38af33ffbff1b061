"""Sigmoid gating: out[n, C] = x * sigmoid(gate), with gate [n, C] or [n, 1] (one gate a row).

Qwen3-Next's two gates: the attention output times sigmoid of q_proj's gate half, and the shared
expert's output times sigmoid(shared_expert_gate(x)). The rounding is transformers' in x's dtype:
the sigmoid is computed in fp32 and rounded to x's dtype (torch.sigmoid on a bf16 tensor), the
product is computed in fp32 and rounded once more. In fp32 both roundings are no-ops.

`sigmoid_mul(x, gate, out)`; rows unit-stride. Grid over (rows, column blocks).
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
def sigmoid_mul_kernel(
    x_ptr, gate_ptr, out_ptr,
    stride_x, stride_gate, stride_out,
    cols_total, pdl_release,
    GATE_COLS: tl.constexpr,  # 1: one gate a row (broadcast); 0: one gate a column
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < cols_total
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and gate come from previous launches
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if GATE_COLS == 1:
        g = tl.load(gate_ptr + row * stride_gate).to(tl.float32)
    else:
        g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    # sigmoid rounded to x's dtype first, as torch.sigmoid(gate) in that dtype is
    s = tl.sigmoid(g).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
    """out = x * sigmoid(gate); x, out [n, C] of one float dtype, gate [n, C] or [n, 1] of it."""
    check(x.dim() == 2, lambda: f"{describe('x', x)}: expected [n, C]")
    n, cols = x.shape
    check(gate.dim() == 2 and gate.shape[0] == n and gate.shape[1] in (1, cols),
          lambda: f"{describe('gate', gate)}: expected [{n}, {cols}] or [{n}, 1]")
    check_operand("x", x, (n, cols), FLOAT_DTYPES, x.device)
    check_operand("gate", gate, tuple(gate.shape), (x.dtype,), x.device)
    check_operand("out", out, (n, cols), (x.dtype,), x.device)
    if n == 0 or cols == 0:
        return
    pdl = launch_kwargs(x)
    grid = (n, triton.cdiv(cols, BLOCK))
    sigmoid_mul_kernel[grid](
        x, gate, out, x.stride(0), gate.stride(0), out.stride(0), cols,
        GATE_COLS=int(gate.shape[1]) if gate.shape[1] == 1 else 0,
        BLOCK=BLOCK, **pdl_args(pdl, n), num_warps=4, **pdl,
    )
