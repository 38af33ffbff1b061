"""Elementwise, norm, layout and matmul ops: add, cast, concat, stack, rmsnorm, add_rmsnorm,
linear, silu_mul, linear_silu_mul, with their kernel bindings. References are the HF-Llama
semantics the kernels match."""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import DTYPES, TensorSpec
from draft_circuit.ops.bindings import CUDA, TRITON, Applies, Condition, KernelBinding, Scratch, Tensors, kernel
from draft_circuit.ops.registry import (ELEMENTWISE, FUSED, LAYOUT, MATMUL, NORM, REDUCTION, Cost, CostContext,
                                        Env, OpDef, Specs, check, default_cost, dim_eq, rank, register, same_dtype,
                                        torch_dtype)
from draft_circuit.ops.row_invariant import row_invariant_linear

_k_rmsnorm, _k_add_rmsnorm = kernel("rmsnorm", "rmsnorm"), kernel("rmsnorm", "add_rmsnorm")
_k_silu = kernel("silu_mul", "silu_mul")
_k_linear, _k_linear_silu = kernel("linear", "linear"), kernel("linear", "linear_silu_mul")
_k_splitk = kernel("linear_splitk", "linear_splitk")
_k_splitk_ws = kernel("linear_splitk", "splitk_workspace_shape")
_k_splitk_splits = kernel("linear_splitk", "num_splits")
# kernels.rmsnorm normalises a row in one program
ONE_PROGRAM_ROW = Condition("hidden <= 65536", lambda ins, a: isinstance(ins[0].shape[1], int)
                            and ins[0].shape[1] <= 65536)


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
    return [TensorSpec(dtype=x.dtype, shape=(x.shape[0], int(x.shape[1]) // 2))]


def _silu_mul(t: list[torch.Tensor], a: BaseModel) -> tuple[torch.Tensor]:
    x = t[0].float()
    g, u = x.chunk(2, dim=-1)
    return ((F.silu(g) * u).to(t[0].dtype),)


register(OpDef(
    name="silu_mul", inputs=("gate_up",), outputs=("out",), infer=_infer_silu_mul,
    reference=_silu_mul, tags=frozenset({ELEMENTWISE}),
    kernels=(KernelBinding("triton_silu_mul", lambda i, o, w, a: _k_silu()(i[0], o[0]),
                           Applies(TRITON)),),
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
    infer=_infer_concat, reference=lambda t, a: (torch.cat(t, dim=a.dim),), tags=frozenset({LAYOUT}),
))


def _infer_stack(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    same_dtype(*ins)
    for s in ins:
        rank(s, 1, "stack operand")
        dim_eq(s.shape, ins[0].shape, "stack operands")
    return [TensorSpec(dtype=ins[0].dtype, shape=(ins[0].shape[0], len(ins)))]


register(OpDef(
    name="stack", inputs=("x",), outputs=("out",), variadic=True, infer=_infer_stack,
    reference=lambda t, a: (torch.stack(t, dim=1),), tags=frozenset({LAYOUT}),
))


# ---- norms ----
def _infer_rmsnorm(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    x, w = ins
    same_dtype(x, w)
    rank(x, 2, "rmsnorm input")
    rank(w, 1, "rmsnorm weight")
    dim_eq(x.shape[1], w.shape[0], f"rmsnorm hidden size ({x} vs weight {w})")
    return [x]


# eps as a 0-dim fp32 tensor, made once: a Python float is rounded to fp32 all the same (the add
# is fp32), but torch wraps it into a tensor on every call (issue 20: microseconds a norm on CPU)
@lru_cache(maxsize=16)
def _eps(eps: float) -> torch.Tensor:
    return torch.tensor(eps, dtype=torch.float32)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    e = _eps(eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e)
    return y.to(x.dtype) * w  # HF Llama order: back to the input dtype, then the weight


register(OpDef(
    name="rmsnorm", inputs=("x", "weight"), outputs=("out",), attrs=EpsAttrs,
    infer=_infer_rmsnorm, reference=lambda t, a: (rmsnorm_ref(t[0], t[1], a.eps),),
    tags=frozenset({REDUCTION, NORM}), inplace={0: 0},
    kernels=(KernelBinding("triton_rmsnorm", lambda i, o, w, a: _k_rmsnorm()(i[0], i[1], o[0], a.eps),
                           Applies(TRITON, conditions=(ONE_PROGRAM_ROW,))),),
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
    tags=frozenset({REDUCTION, NORM, FUSED}), inplace={0: 0},
    kernels=(KernelBinding(
        "triton_add_rmsnorm", lambda i, o, w, a: _k_add_rmsnorm()(i[0], i[1], i[2], o[0], o[1], a.eps),
        Applies(TRITON, conditions=(ONE_PROGRAM_ROW,))),),
))


# ---- matmul ----
class LinearAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    out_dtype: str | None = None  # e.g. float32 logits from bf16 weights; None: the input's

    def model_post_init(self, _: object) -> None:
        if self.out_dtype is not None and self.out_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"out_dtype must be a float dtype, got {self.out_dtype!r}")


def _infer_linear(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, w = ins[:2]
    same_dtype(x, w)
    rank(x, 2, "linear input")
    rank(w, 2, "linear weight [out, in]")
    dim_eq(x.shape[1], w.shape[1], f"linear in-features ({x} @ weight {w}^T)")
    if len(ins) > 2:  # the optional bias [out] (Qwen2's q/k/v, GLM-4.5's attention_bias)
        same_dtype(x, ins[2])
        check(ins[2].shape == (w.shape[0],), lambda: f"linear bias must be [{w.shape[0]}] (the "
                                                     f"weight's rows), got {ins[2]}")
    out_dtype = getattr(a, "out_dtype", None) or x.dtype
    return [TensorSpec(dtype=out_dtype, shape=(x.shape[0], w.shape[0]))]


def _linear_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    n, k = ins[0].concrete(env)
    return default_cost(ins, outs, env, flops=2 * n * k * ins[1].concrete(env)[0])


def linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ w^T with each row's bits independent of the rows beside it (`row_invariant_linear`:
    fixed-shape GEMM tiles on CPU), so a sequence drafts the same alone as inside any batch (what
    padding, splitting and per-sequence fallback rely on) and a verify row equals its decode row.
    A wider out_dtype computes in it (fp32 logits from bf16 weights are fp32 products)."""
    if out_dtype is not None and out_dtype != x.dtype:
        return linear_ref(x.to(out_dtype), w.to(out_dtype))
    return row_invariant_linear(x, w)


def _linear(t: list[torch.Tensor], a: LinearAttrs) -> tuple[torch.Tensor]:
    out = linear_ref(t[0], t[1], torch_dtype(a.out_dtype) if a.out_dtype else None)
    # the bias after the product, in the output's dtype (one rounding more than a fused epilogue)
    return (out + t[2].to(out.dtype) if len(t) > 2 else out,)


def _splitk_workspace(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    rows, k = ins[1].shape
    return [("float32", _k_splitk_ws()(ins[0].concrete(env)[0], int(rows), int(k)))]


def _many_splits(ins: Sequence[TensorSpec], a: Any) -> bool:
    rows, k = ins[1].shape  # the weight's shape only: every width of a circuit picks the same kernel
    return isinstance(rows, int) and isinstance(k, int) and _k_splitk_splits()(rows, k) >= 2


def _cublas_linear(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    if len(ins) > 2:
        torch.addmm(ins[2], ins[0], ins[1].t(), out=outs[0])
    else:
        torch.matmul(ins[0], ins[1].t(), out=outs[0])


register(OpDef(
    name="linear", inputs=("x", "weight", "bias"), outputs=("out",), attrs=LinearAttrs, num_required=2,
    infer=_infer_linear, reference=_linear, cost=_linear_cost, tags=frozenset({MATMUL}),
    kernels=(
        # split-K first: chosen where the plain kernel's grid is too small and the output is the
        # fp32-accumulating result rounded once; the single-pass kernel serves the rest
        KernelBinding("triton_linear_splitk", lambda i, o, w, a: _k_splitk()(i[0], i[1], o[0], w[0]),
                      Applies(TRITON, conditions=(
                          Condition("out_dtype None or float32",
                                    lambda ins, a: a.out_dtype in (None, "float32")),
                          Condition("no bias (its reduction has no epilogue)", lambda ins, a: len(ins) == 2),
                          Condition("K in >= 2 splits", _many_splits))),
                      workspace=_splitk_workspace, launches=2),  # partials, then their reduce
        KernelBinding("triton_linear", lambda i, o, w, a: _k_linear()(i[0], i[1], o[0], *i[2:]),
                      Applies(TRITON)),
        KernelBinding("cublas_linear", _cublas_linear, Applies(CUDA, conditions=(
            Condition("out_dtype None or the input's", lambda ins, a: a.out_dtype in (None, ins[0].dtype)),)),
            width_independent=False),
    ),
))


def _infer_linear_silu_mul(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    return _infer_silu_mul(_infer_linear(ins, a), a)


register(OpDef(
    name="linear_silu_mul", inputs=("x", "gate_up_weight"), outputs=("out",),
    infer=_infer_linear_silu_mul, cost=_linear_cost,
    # the composition of the two references, so CPU programs match eager bitwise
    reference=lambda t, a: _silu_mul([linear_ref(t[0], t[1])], a),
    tags=frozenset({MATMUL, FUSED}),
    # no split-K for SwiGLU: on the H200 the fused single pass was as fast at n = 1 and 1.2-1.6x
    # faster at n = 64 (benchmarks/tune_kernels.py); kernels.linear_splitk keeps the variant
    kernels=(KernelBinding("triton_linear_silu_mul", lambda i, o, w, a: _k_linear_silu()(i[0], i[1], o[0]),
                           Applies(TRITON)),),
))
