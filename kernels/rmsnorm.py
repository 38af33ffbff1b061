"""RMSNorm over the rows of a [n, hidden] matrix, HF Llama order, optionally fused with a residual add;
and the zero-centred RMSNorm of Qwen3-Next, (1 + weight) * x in transformers' Qwen3NextRMSNorm order.

`rmsnorm(x, weight, out, eps)`; `add_rmsnorm(x, residual, weight, sum_out, norm_out, eps)` with
sum_out = x + residual (may alias x or residual); `zero_centred_rmsnorm(x, weight, out, eps)`.
One program per row; any hidden size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import (
    FLOAT_DTYPES, check, check_operand, describe, launch_kwargs, pdl_args,
)


@triton.jit(do_not_specialize=["pdl_release"])
def rmsnorm_kernel(
    x_ptr, res_ptr, sum_ptr, out_ptr, w_ptr,
    stride_x, stride_res, stride_sum, stride_out,
    hidden, eps, pdl_release,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x / residual may come from the previous launch
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # One rounding to x's dtype, as torch's `x + residual` (fp32 sum then round is exact
        # rounding for fp16/bf16 operands).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    if HAS_RESIDUAL:
        # Stored after the reduction (a block-wide barrier): sum_out may alias x or residual,
        # and every element of the row must be read before any is overwritten.
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        # Qwen3NextRMSNorm: the normalised row and the gain 1 + weight both in fp32, one rounding
        # at the end (a gain 1 + w formed in bf16 keeps ~8 bits: w in steps of 1/128)
        tl.store(out_ptr + row * stride_out + cols, (xf * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        # HF order: normalise in fp32, round to x's dtype, then scale by weight in x's dtype. The
        # product of two 16-bit floats is exact in fp32, so multiplying there and rounding once is
        # bit-identical to a native 16-bit multiply (and the interpreter has no bf16 arithmetic).
        y = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, sum_out, norm_out, weight, eps: float, zero_centred: bool = False) -> None:
    check(x.dim() == 2, lambda: f"{describe('x', x)}: expected [n, hidden]")
    n, hidden = x.shape
    check_operand("x", x, (n, hidden), FLOAT_DTYPES, x.device)
    check_operand("weight", weight, (hidden,), (x.dtype,), x.device)
    check_operand("out", norm_out, (n, hidden), (x.dtype,), x.device)
    if residual is not None:
        check_operand("residual", residual, (n, hidden), (x.dtype,), x.device)
        check_operand("sum_out", sum_out, (n, hidden), (x.dtype,), x.device)
    check(hidden <= 65536, lambda: f"{describe('x', x)}: hidden > 65536 does not fit one program")
    if n == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    pdl = launch_kwargs(x)
    rmsnorm_kernel[(n,)](
        x, residual if has_residual else x, sum_out if has_residual else x, norm_out, weight,
        x.stride(0), residual.stride(0) if has_residual else 0,
        sum_out.stride(0) if has_residual else 0, norm_out.stride(0),
        hidden, float(eps),  # an int eps would reach the kernel as i32
        HAS_RESIDUAL=has_residual, ZERO_CENTRED=zero_centred, BLOCK=block,
        **pdl_args(pdl, n),
        num_warps=min(max(block // 512, 1), 16),
        **pdl,
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """out[n, hidden] = rmsnorm(x) * weight. x, out, weight share one float dtype; rows unit-stride."""
    _launch(x, None, None, out, weight, eps)


def zero_centred_rmsnorm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """out[n, hidden] = (rmsnorm(x) * (1 + weight)) computed in fp32 and rounded once to x's dtype:
    transformers' Qwen3NextRMSNorm (`weight` is the stored zero-centred weight, not the gain).
    x, out, weight share one float dtype; rows unit-stride."""
    _launch(x, None, None, out, weight, eps, zero_centred=True)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    sum_out: torch.Tensor,
    norm_out: torch.Tensor,
    eps: float,
) -> None:
    """sum_out = x + residual in x's dtype (sum_out may alias x or residual); norm_out = rmsnorm(sum_out).

    All five tensors share one float dtype; rows unit-stride. `weight` sits between the inputs and
    the outputs, as in `rmsnorm(x, weight, out, eps)`.
    """
    _launch(x, residual, sum_out, norm_out, weight, eps)
