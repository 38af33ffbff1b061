"""Ops the checkpoint families need beyond the Llama vocabulary: `head_rmsnorm`, the per-head RMSNorm
of Qwen3's and GLM-4.5's `q_norm` / `k_norm` (before RoPE); `zero_centred_rmsnorm` and
`zero_centred_head_rmsnorm`, Qwen3-Next's RMSNorms ((1 + weight) * x over the stored weight, the
gain formed in fp32 inside the norm, as transformers' Qwen3NextRMSNorm: a gain 1 + weight stored in
bf16 would keep w only to steps of 1/128; ops of their own, not a flag on `rmsnorm`, because the
fusion passes rewrite `rmsnorm` by name into Llama-order fused kernels); and `sigmoid_mul`, Qwen3-Next's two
sigmoid gates (the attention output's, from q_proj's gate half, and the shared expert's). The
families' other needs are attrs or inputs of existing ops: a bias on `linear` (ops/basic.py),
`rotary_dim` on `rope` and `rope_kv_write` (ops/attention.py).
"""
from __future__ import annotations

from typing import Any

import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.basic import ONE_PROGRAM_ROW, EpsAttrs, _infer_rmsnorm, rmsnorm_ref
from draft_circuit.ops.bindings import TRITON, Applies, Condition, KernelBinding, Tensors, kernel
from draft_circuit.ops.registry import ELEMENTWISE, NORM, REDUCTION, OpDef, check, dim_eq, rank, register, same_dtype

_k_rmsnorm = kernel("rmsnorm", "rmsnorm")
_k_zc_rmsnorm = kernel("rmsnorm", "zero_centred_rmsnorm")
_k_sigmoid_mul = kernel("sigmoid_mul", "sigmoid_mul")


def _infer_head_rmsnorm(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    x, w = ins
    same_dtype(x, w)
    rank(x, 2, "head_rmsnorm input [n, heads * head_dim]")
    rank(w, 1, "head_rmsnorm weight [head_dim]")
    check(isinstance(x.shape[1], int) and isinstance(w.shape[0], int) and w.shape[0] > 0
          and x.shape[1] % w.shape[0] == 0,
          lambda: f"head_rmsnorm weight {w} (one head) must divide the row {x} into heads")
    return [x]


def head_rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head_dim group of a row normalised alone, with HF's cast order (Qwen3RMSNorm,
    Glm4MoeRMSNorm: normalise in fp32, back to the input dtype, then times the weight)."""
    return rmsnorm_ref(x.reshape(-1, w.shape[0]), w, eps).view(x.shape)


def _launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    # a row of heads is heads rows of head_dim: the rmsnorm kernel on the [n * heads, head_dim]
    # views (arena values are contiguous, so the views alias the buffers)
    d = ins[1].shape[0]
    _k_rmsnorm()(ins[0].view(-1, d), ins[1], outs[0].view(-1, d), a.eps)


register(OpDef(
    name="head_rmsnorm", inputs=("x", "weight"), outputs=("out",), attrs=EpsAttrs,
    infer=_infer_head_rmsnorm, reference=lambda t, a: (head_rmsnorm_ref(t[0], t[1], a.eps),),
    tags=frozenset({REDUCTION, NORM}), inplace={0: 0},
    # kernels.rmsnorm normalises a row (here: a head) in one program
    kernels=(KernelBinding("triton_head_rmsnorm", _launch, Applies(TRITON, conditions=(
        Condition("head_dim <= 65536", lambda ins, a: int(ins[1].shape[0]) <= 65536),))),),
))


# ---- Qwen3-Next's zero-centred norms ----
def zero_centred_rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3NextRMSNorm.forward: normalise in fp32, times 1.0 + weight.float() in
    fp32, one rounding to x's dtype (unlike `rmsnorm_ref`'s Llama order, which rounds the
    normalised row first)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def _zc_head_launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    d = ins[1].shape[0]  # per-head views, as head_rmsnorm's launch
    _k_zc_rmsnorm()(ins[0].view(-1, d), ins[1], outs[0].view(-1, d), a.eps)


register(OpDef(
    name="zero_centred_rmsnorm", inputs=("x", "weight"), outputs=("out",), attrs=EpsAttrs,
    infer=_infer_rmsnorm, reference=lambda t, a: (zero_centred_rmsnorm_ref(t[0], t[1], a.eps),),
    tags=frozenset({REDUCTION, NORM}), inplace={0: 0},
    kernels=(KernelBinding("triton_zero_centred_rmsnorm",
                           lambda i, o, w, a: _k_zc_rmsnorm()(i[0], i[1], o[0], a.eps),
                           Applies(TRITON, conditions=(ONE_PROGRAM_ROW,))),),
))

register(OpDef(
    name="zero_centred_head_rmsnorm", inputs=("x", "weight"), outputs=("out",), attrs=EpsAttrs,
    infer=_infer_head_rmsnorm,
    reference=lambda t, a: (zero_centred_rmsnorm_ref(t[0].reshape(-1, t[1].shape[0]), t[1], a.eps).view(t[0].shape),),
    tags=frozenset({REDUCTION, NORM}), inplace={0: 0},
    kernels=(KernelBinding("triton_zero_centred_head_rmsnorm", _zc_head_launch, Applies(TRITON, conditions=(
        Condition("head_dim <= 65536", lambda ins, a: int(ins[1].shape[0]) <= 65536),))),),
))


def _infer_sigmoid_mul(ins: list[TensorSpec], a: Any) -> list[TensorSpec]:
    x, gate = ins
    same_dtype(x, gate)
    rank(x, 2, "sigmoid_mul input [n, C]")
    rank(gate, 2, "sigmoid_mul gate [n, C] or [n, 1]")
    dim_eq(gate.shape[0], x.shape[0], "sigmoid_mul rows")
    check(gate.shape[1] in (1, x.shape[1]),
          lambda: f"sigmoid_mul gate {gate} must be as wide as the input {x} or one column")
    return [x]


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) as transformers' Qwen3NextAttention / Qwen3NextSparseMoeBlock compute it
    in x's dtype: sigmoid rounded to that dtype, then the product (each in fp32, rounded once)."""
    s = torch.sigmoid(gate.float()).to(x.dtype)
    return (x.float() * s.float()).to(x.dtype)


register(OpDef(
    name="sigmoid_mul", inputs=("x", "gate"), outputs=("out",), infer=_infer_sigmoid_mul,
    reference=lambda t, a: (sigmoid_mul_ref(t[0], t[1]),), tags=frozenset({ELEMENTWISE}),
    kernels=(KernelBinding("triton_sigmoid_mul", lambda i, o, w, a: _k_sigmoid_mul()(i[0], i[1], o[0]),
                           Applies(TRITON)),),
))
