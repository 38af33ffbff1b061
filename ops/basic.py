"""Elementwise, norm, layout and matmul ops: add, cast, concat, stack, rmsnorm, add_rmsnorm,
linear, silu_mul, linear_silu_mul. References are the HF-Llama semantics the kernels match."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import DTYPES, TensorSpec
from draft_circuit.ops.registry import (ELEMENTWISE, FUSED, MATMUL, REDUCTION, Cost, OpDef, check, default_cost,
                          dim_eq, rank, register, same_dtype, torch_dtype)


class EpsAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    eps: float = 1e-6

    def model_post_init(self, _: object) -> None:  # eps <= 0 turns an all-zero row into NaN
        if not 0 < self.eps < float("inf"):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")


class DimAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dim: int = -1


class CastAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dtype: str

    def model_post_init(self, _: object) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")


# ---- elementwise ----
def _infer_add(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, y = ins
    same_dtype(x, y)
    check(x.shape == y.shape, lambda: f"add operands differ: {x} vs {y}")
    return [x]


register(OpDef(
    name="add", inputs=("x", "y"), outputs=("out",), infer=_infer_add,
    reference=lambda t, a: (t[0] + t[1],), tags=frozenset({ELEMENTWISE}), inplace={0: 0},
))

register(OpDef(
    name="cast", inputs=("x",), outputs=("out",), attrs=CastAttrs,
    infer=lambda ins, a: [TensorSpec(dtype=a.dtype, shape=ins[0].shape)],
    reference=lambda t, a: (t[0].to(torch_dtype(a.dtype)),), tags=frozenset({ELEMENTWISE}),
))


def _infer_silu_mul(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    (x,) = ins
    rank(x, 2, "silu_mul input")
    check(isinstance(x.shape[1], int) and x.shape[1] % 2 == 0,
          lambda: f"silu_mul input's last dim must be even (gate then up), got {x}")
    return [TensorSpec(dtype=x.dtype, shape=(x.shape[0], x.shape[1] // 2))]


def _silu_mul(t: list[torch.Tensor], a: BaseModel) -> tuple[torch.Tensor]:
    x = t[0].float()
    g, u = x.chunk(2, dim=-1)
    return ((F.silu(g) * u).to(t[0].dtype),)


register(OpDef(
    name="silu_mul", inputs=("gate_up",), outputs=("out",), infer=_infer_silu_mul,
    reference=_silu_mul, tags=frozenset({ELEMENTWISE}),
))


# ---- layout ----
def _infer_concat(ins: list[TensorSpec], a: DimAttrs) -> list[TensorSpec]:
    same_dtype(*ins)
    r = len(ins[0].shape)
    check(all(len(s.shape) == r for s in ins), lambda: "concat operands differ in rank")
    check(-r <= a.dim < r, lambda: f"concat dim {a.dim} is out of range for rank {r}")
    d = a.dim % r
    for s in ins:
        for i in range(r):
            if i != d:
                dim_eq(s.shape[i], ins[0].shape[i], f"concat dim {i}")
    check(all(isinstance(s.shape[d], int) for s in ins), lambda: "concat along the row symbol")
    total = sum(int(s.shape[d]) for s in ins)
    return [TensorSpec(dtype=ins[0].dtype, shape=ins[0].shape[:d] + (total,) + ins[0].shape[d + 1:])]


register(OpDef(
    name="concat", inputs=("x",), outputs=("out",), attrs=DimAttrs, variadic=True,
    infer=_infer_concat, reference=lambda t, a: (torch.cat(t, dim=a.dim),),
))


def _infer_stack(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    same_dtype(*ins)
    for s in ins:
        rank(s, 1, "stack operand")
        dim_eq(s.shape, ins[0].shape, "stack operands")
    return [TensorSpec(dtype=ins[0].dtype, shape=(ins[0].shape[0], len(ins)))]


register(OpDef(
    name="stack", inputs=("x",), outputs=("out",), variadic=True, infer=_infer_stack,
    reference=lambda t, a: (torch.stack(t, dim=1),),
))


# ---- norms ----
def _infer_rmsnorm(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    x, w = ins
    same_dtype(x, w)
    rank(x, 2, "rmsnorm input")
    rank(w, 1, "rmsnorm weight")
    dim_eq(x.shape[1], w.shape[0], f"rmsnorm hidden size ({x} vs weight {w})")
    return [x]


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w  # HF Llama order: back to the input dtype, then the weight


register(OpDef(
    name="rmsnorm", inputs=("x", "weight"), outputs=("out",), attrs=EpsAttrs,
    infer=_infer_rmsnorm, reference=lambda t, a: (rmsnorm_ref(t[0], t[1], a.eps),),
    tags=frozenset({REDUCTION}), inplace={0: 0},
))


def _infer_add_rmsnorm(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    x, r, w = ins
    _infer_add([x, r], a)
    return _infer_rmsnorm([x, w], a) * 2


def _add_rmsnorm(t: list[torch.Tensor], a: EpsAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    s = t[0] + t[1]
    return s, rmsnorm_ref(s, t[2], a.eps)


register(OpDef(
    name="add_rmsnorm", inputs=("x", "residual", "weight"), outputs=("sum", "out"),
    attrs=EpsAttrs, infer=_infer_add_rmsnorm, reference=_add_rmsnorm,
    tags=frozenset({REDUCTION, FUSED}), inplace={0: 0},
))


# ---- matmul ----
class LinearAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    out_dtype: str | None = None  # e.g. float32 logits from bf16 weights; None: the input's

    def model_post_init(self, _: object) -> None:
        if self.out_dtype is not None and self.out_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"out_dtype must be a float dtype, got {self.out_dtype!r}")


def _infer_linear(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, w = ins
    same_dtype(x, w)
    rank(x, 2, "linear input")
    rank(w, 2, "linear weight [out, in]")
    dim_eq(x.shape[1], w.shape[1], f"linear in-features ({x} @ weight {w}^T)")
    out_dtype = getattr(a, "out_dtype", None) or x.dtype
    return [TensorSpec(dtype=out_dtype, shape=(x.shape[0], w.shape[0]))]


def _linear_cost(ins, outs, a, ctx, env) -> Cost:
    n, k = ins[0].concrete(env)
    return default_cost(ins, outs, env, flops=2 * n * k * ins[1].concrete(env)[0])


def linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ w^T one row at a time: a BLAS picks its kernel by the row count, so a batched product
    would give a row different bits at different widths. Row by row, a sequence drafts the same
    alone as inside any batch (what padding, splitting and per-sequence fallback rely on).
    A wider out_dtype computes in it (fp32 logits from bf16 weights are fp32 products)."""
    if out_dtype is not None and out_dtype != x.dtype:
        return linear_ref(x.to(out_dtype), w.to(out_dtype))
    out = x.new_empty(x.shape[0], w.shape[0])
    for i in range(x.shape[0]):
        torch.mv(w, x[i], out=out[i])
    return out


def _linear(t: list[torch.Tensor], a: LinearAttrs) -> tuple[torch.Tensor]:
    return (linear_ref(t[0], t[1], torch_dtype(a.out_dtype) if a.out_dtype else None),)


register(OpDef(
    name="linear", inputs=("x", "weight"), outputs=("out",), attrs=LinearAttrs,
    infer=_infer_linear, reference=_linear, cost=_linear_cost, tags=frozenset({MATMUL}),
))


def _infer_linear_silu_mul(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    return _infer_silu_mul(_infer_linear(ins, a), a)


register(OpDef(
    name="linear_silu_mul", inputs=("x", "gate_up_weight"), outputs=("out",),
    infer=_infer_linear_silu_mul, cost=_linear_cost,
    # the composition of the two references, so CPU programs match eager bitwise
    reference=lambda t, a: _silu_mul([linear_ref(t[0], t[1])], a),
    tags=frozenset({MATMUL, FUSED}),
))
