"""Fused linears that save launches in a draft step, each the composition of its parts'
references (so a fused circuit's eager run is the unfused one's, bitwise):

- `linear_qkv(x, w_q, w_k, w_v) -> (q, k, v)`: three unbiased linears of one input (the
  attention's projections, fused by fuse_qkv). The weights stay three params: the kernel walks
  the three grids in one launch, so bind never stores a concatenated copy.
- `linear_concat(x1, x2, weight) -> out`: linear(concat([x1, x2], dim=-1), weight) without the
  concat (the MTP eh_proj over [enorm(emb), hnorm(hidden)], fused by fuse_concat_linear).
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.basic import _infer_concat, _infer_linear, DimAttrs, linear_ref
from draft_circuit.ops.bindings import TRITON, Applies, KernelBinding, Tensors, kernel
from draft_circuit.ops.registry import (FUSED, LAYOUT, MATMUL, Cost, CostContext, Env, OpDef, Specs, default_cost,
                                        register)

_k_qkv, _k_concat = kernel("linear_multi", "linear_qkv"), kernel("linear_multi", "linear_concat")


def _infer_qkv(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, *weights = ins
    return [_infer_linear([x, w], a)[0] for w in weights]


def _qkv_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    n, k = ins[0].concrete(env)
    rows = sum(w.concrete(env)[0] for w in ins[1:])
    return default_cost(ins, outs, env, flops=2 * n * k * rows)


def _launch_qkv(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    _k_qkv()(ins[0], ins[1:], outs)


register(OpDef(
    name="linear_qkv", inputs=("x", "q_weight", "k_weight", "v_weight"), outputs=("q", "k", "v"),
    infer=_infer_qkv, cost=_qkv_cost,
    reference=lambda t, a: tuple(linear_ref(t[0], w) for w in t[1:]),
    tags=frozenset({MATMUL, FUSED}),
    kernels=(KernelBinding("triton_linear_qkv", _launch_qkv, Applies(TRITON)),),
))


def _infer_linear_concat(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x1, x2, w = ins
    (x,) = _infer_concat([x1, x2], DimAttrs(dim=-1))
    return _infer_linear([x, w], a)


def _linear_concat_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    rows, k = ins[2].concrete(env)  # the weight [N, K1 + K2]
    return default_cost(ins, outs, env, flops=2 * ins[0].concrete(env)[0] * k * rows)


register(OpDef(
    name="linear_concat", inputs=("x1", "x2", "weight"), outputs=("out",),
    infer=_infer_linear_concat, cost=_linear_concat_cost,
    reference=lambda t, a: (linear_ref(torch.cat([t[0], t[1]], dim=-1), t[2]),),
    tags=frozenset({MATMUL, LAYOUT, FUSED}),
    kernels=(KernelBinding("triton_linear_concat", lambda i, o, w, a: _k_concat()(i[0], i[1], i[2], o[0]),
                           Applies(TRITON)),),
))
