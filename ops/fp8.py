"""`linear_fp8`: a dense projection whose weight stays fp8 e4m3 with per-row block scales
(`row_scale` [N, ceil(K / 128)]: DeepSeek-V3's 128x128 `weight_scale_inv` expanded to its rows, so
a bound weight's rows may be split or permuted). Activations stay in x's dtype (weight-only fp8;
DeepSeek's reference engines also quantise activations per 128-group, which this does not).
The reference dequantises to fp32 and multiplies row-invariantly; the kernel scales each
128-column partial product, so the two agree to rounding, not bitwise.
"""
from __future__ import annotations

import math

import torch
from pydantic import BaseModel

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import KERNEL_FLOATS, TRITON, Applies, KernelBinding, kernel
from draft_circuit.ops.moe import FP8, SCALE_BLOCK
from draft_circuit.ops.registry import MATMUL, OpDef, check, default_cost, dim_eq, rank, register
from draft_circuit.ops.row_invariant import row_invariant_linear

FLOATS = tuple(sorted(KERNEL_FLOATS))


def expand_row_scales(row_scale: torch.Tensor, k: int) -> torch.Tensor:
    """[N, ceil(K/128)] -> [N, K], one scale per weight element (expand: no host sync)."""
    rows, blocks = row_scale.shape
    return row_scale[:, :, None].expand(rows, blocks, SCALE_BLOCK).reshape(rows, blocks * SCALE_BLOCK)[:, :k]


def linear_fp8_ref(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """x @ (weight * scale)^T in fp32, each row's bits those it gets alone (width independent:
    `row_invariant_linear`), rounded once."""
    w = weight.float() * expand_row_scales(row_scale.float(), weight.shape[1])
    return row_invariant_linear(x.float(), w).to(x.dtype)


def _infer(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, w, s = ins
    rank(x, 2, "linear_fp8 input [n, K]")
    rank(w, 2, "linear_fp8 weight [N, K]")
    check(x.dtype in FLOATS, lambda: f"linear_fp8 input must be fp32/fp16/bf16, got {x}")
    check(w.dtype == FP8, lambda: f"linear_fp8 weight must be {FP8}, got {w}")
    dim_eq(x.shape[1], w.shape[1], f"linear_fp8 in-features ({x} @ weight {w}^T)")
    blocks = (int(w.shape[0]), math.ceil(int(w.shape[1]) / SCALE_BLOCK))
    check(s.dtype == "float32" and s.shape == blocks, lambda: f"row_scale must be float32{list(blocks)}, got {s}")
    return [TensorSpec(dtype=x.dtype, shape=(x.shape[0], w.shape[0]))]


_k_linear_fp8 = kernel("linear_fp8", "linear_fp8")

register(OpDef(
    name="linear_fp8", inputs=("x", "weight", "row_scale"), outputs=("out",), infer=_infer,
    reference=lambda t, a: (linear_fp8_ref(t[0], t[1], t[2]),), tags=frozenset({MATMUL}),
    cost=lambda ins, outs, a, ctx, env: default_cost(
        ins, outs, env, flops=2 * ins[0].concrete(env)[0] * int(ins[1].shape[0]) * int(ins[1].shape[1])),
    # fp8 weights are converted exactly in the kernel, under the interpreter too
    kernels=(KernelBinding("triton_linear_fp8", lambda i, o, w, a: _k_linear_fp8()(i[0], i[1], i[2], o[0]),
                           Applies(TRITON, floats=KERNEL_FLOATS | {FP8})),),
))
