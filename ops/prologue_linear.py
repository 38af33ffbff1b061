"""Linears with their neighbour folded into a prologue or an epilogue (issue 15: fewer launches a
draft step where that is the faster). Each fused op's reference is the composition of its parts' references,
so a fused circuit's eager run is the unfused one's, bitwise; each has a Triton binding
(kernels.linear_fused's one launch, or the lm-head's two-launch argmax with the norm in its
partials kernel), and linear_add and the MTP input a two-launch split-K binding bound before it,
taken by the weight's shape only where one launch's grid is too small; the lm-head ops likewise
a three-launch `*_prenorm` binding (the norm a launch of its own) where the weight is large.
The norm-prologue bindings of q/k/v, SwiGLU and the MTP input take one launch more at the widths
kernels.prologue_norm.prenorm_pays names (the prologue stored by a launch of its own, then the
plain kernel: the same bits, measured faster there); their workspace and launch-count rules say
which widths, the launchers follow the buffer they are given.

- `linear_add(x, weight, residual) -> residual + x @ weight^T` (o_proj / down_proj and the
  residual add after them; split-K where the plain linear would split);
- `rmsnorm_linear_qkv(x, norm_weight, w_q, w_k, w_v) -> q, k, v` (input_layernorm into q/k/v);
- `rmsnorm_linear_silu_mul(x, norm_weight, gate_up) -> out` (post_attention_layernorm into the
  SwiGLU gate_up);
- the lm-head's `rmsnorm_linear_argmax*` ops: ops/prologue_argmax.py;
- `rmsnorm_linear_qkv_rope_kv_write(x, norm, w_q, w_k, w_v, positions, caches, tables, live,
  [active])`: the above and rope_kv_write after it (kernels.qkv_rope: q, k, v never stored
  unroped);
- `embed_rmsnorm_linear_concat(table, ids, norm1, x2, norm2, weight)`: the MTP input,
  eh_proj([enorm(embedding(ids)), hnorm(x2)]), with neither the embedding, the norms nor the
  concat stored; split-K (kernels.linear_fused_splitk, the prologue in the partials kernel) where
  the weight's shape says one launch cannot fill the GPU (K >= 4096, < 256 tiles of 32 columns).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.basic import (EpsAttrs, _infer_add, _infer_linear,
                                     _infer_linear_silu_mul, _infer_rmsnorm, _linear_cost,
                                     _many_splits, _silu_mul, _splitk_workspace, linear_ref,
                                     rmsnorm_ref)
from draft_circuit.ops.bindings import (CUDA, TRITON, Applies, Condition, KernelBinding, LaunchCount,
                                       Scratch, Tensors, WorkspaceRule, kernel)
from draft_circuit.ops.attention import RopeKvWriteAttrs, _infer_rope_kv_write, _rope_kv_write
from draft_circuit.ops.fused_linear import _infer_linear_concat, _infer_qkv
from draft_circuit.ops.registry import (ATTENTION, FUSED, GATHER, LAYOUT, MATMUL, NORM, REDUCTION, Cost,
                                        CostContext, Env, OpDef, Specs, default_cost, register)
from draft_circuit.ops.tokens import _infer_embedding, embedding_ref

_k_prologue = kernel("linear_fused", "linear_prologue")
_k_norm_qkv = kernel("linear_fused", "rmsnorm_linear_qkv")
_k_splitk = kernel("linear_splitk", "linear_splitk")
_k_prologue_splitk = kernel("linear_fused_splitk", "linear_prologue_splitk")
_k_prologue_splitk_pays = kernel("linear_fused_splitk", "splitk_pays")
_k_splitk_ws = kernel("linear_splitk", "splitk_workspace_shape")
# PDL weight prefetch (issue 15 item 2): each kernels.linear_fused binding has a variant that
# loads its first weight tile before the PDL wait and releases its dependents after the first K
# step. The same bits, so it is bound last: only a tuning pass that measures it faster (or
# CompileOptions.kernels) binds it. CUDA only: the interpreter has no PDL.
def _prefetch_variant(name: str, launch: Callable[..., None], workspace: WorkspaceRule | None = None,
                      launches: int | LaunchCount = 1) -> KernelBinding:
    return KernelBinding(f"{name}_pdl_prefetch", partial(launch, prefetch=True), Applies(CUDA),
                         workspace=workspace, launches=launches)


# The prologue as a launch of its own at wide n (kernels.prologue_norm: the same bits, one more
# launch): the workspace rule gives a launch the `normed` [n, K] buffer exactly at the widths
# where prenorm_pays(n), the launcher takes that path when given it, and the launch count
# follows the same rule (a symbolic n, outside a width's program, counts as narrow).
_k_prenorm_pays = kernel("prologue_norm", "prenorm_pays")


def _wide(rows: int | str, parts: Sequence[int | str], qkv: bool = False) -> bool:
    concrete = isinstance(rows, int) and all(isinstance(p, int) for p in parts)
    return concrete and bool(_k_prenorm_pays()(rows, parts, qkv))


def _normed_ws(dtype: str, n: int, parts: Sequence[int], qkv: bool = False) -> Scratch:
    """[the normed x buffer] at a width whose prologue runs on its own, else []."""
    return [(dtype, (n, sum(parts)))] if _wide(n, parts, qkv) else []


def _norm_x_ws(ins: Sequence[TensorSpec], env: Env, a: Any, qkv: bool = False) -> Scratch:
    n, k = ins[0].concrete(env)  # x [n, K] with its norm in the prologue
    return _normed_ws(ins[0].dtype, n, (k,), qkv)


def _norm_x_launches(base: int, qkv: bool = False) -> Callable[[Sequence[TensorSpec], Any], int]:
    # from the specs as given: a plan's per-width launches carry concrete shapes (report.py)
    return lambda ins, a: base + _wide(ins[0].shape[0], (ins[0].shape[1],), qkv)


def _norm_then(ins: list[TensorSpec], a: EpsAttrs) -> TensorSpec:
    """The normed x of a prologue op's (x, norm_weight, ...) inputs, checked as rmsnorm checks."""
    return _infer_rmsnorm(ins[:2], a)[0]


def _weight_cost(ins: Specs, outs: Specs, env: Env, x: TensorSpec, weights: Sequence[TensorSpec]) -> Cost:
    n, k = x.concrete(env)
    rows = sum(w.concrete(env)[0] for w in weights)
    return default_cost(ins, outs, env, flops=2 * n * k * rows)


# ---- linear_add: the residual add in the linear's epilogue ----
def _launch_linear_add(i: Tensors, o: Tensors, w: Tensors, a: Any, prefetch: bool = False) -> None:
    _k_prologue()(i[0], i[1], o[0], residual=i[2], prefetch=prefetch)


def _cublas_linear_add(i: Tensors, o: Tensors, w: Tensors, a: Any) -> None:
    # residual + x @ w^T rounded once (cuBLAS's beta = 1): not linear-then-add's two roundings,
    # and its kernel depends on n, so only a plan without width independence binds it
    torch.addmm(i[2], i[0], i[1].t(), out=o[0])

def _infer_linear_add(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    (out,) = _infer_linear(ins[:2], a)
    return _infer_add([ins[2], out], a)


register(OpDef(
    name="linear_add", inputs=("x", "weight", "residual"), outputs=("out",),
    infer=_infer_linear_add, cost=_linear_cost,
    # add(residual, linear(x, w)), the two references in the circuit's order
    reference=lambda t, a: (t[2] + linear_ref(t[0], t[1]),),
    tags=frozenset({MATMUL, FUSED}), inplace={0: 2},  # each tile reads its residual, then writes
    kernels=(
        # split-K where kernels.linear would split (the same rule, by the weight's shape only)
        KernelBinding("triton_linear_add_splitk",
                      lambda i, o, w, a: _k_splitk()(i[0], i[1], o[0], w[0], residual=i[2]),
                      Applies(TRITON, conditions=(Condition("K in >= 2 splits", _many_splits),)),
                      workspace=_splitk_workspace, launches=2),
        KernelBinding("triton_linear_add", _launch_linear_add, Applies(TRITON)),
        _prefetch_variant("triton_linear_add", _launch_linear_add),
        # circuit_fast's o_proj / down_proj (what cublas_linear was before the add folded in)
        KernelBinding("cublas_linear_add", _cublas_linear_add, Applies(CUDA), width_independent=False),
    ),
))


# ---- rmsnorm in the prologue ----
def _infer_norm_qkv(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    return _infer_qkv([_norm_then(ins, a), *ins[2:]], a)


def _norm_qkv_ref(normed: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(linear_ref(normed, w) for w in weights)  # one norm for the three products


def _norm_qkv_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    return _weight_cost(ins, outs, env, ins[0], ins[2:])


register(OpDef(
    name="rmsnorm_linear_qkv", inputs=("x", "norm_weight", "q_weight", "k_weight", "v_weight"),
    outputs=("q", "k", "v"), attrs=EpsAttrs, infer=_infer_norm_qkv, cost=_norm_qkv_cost,
    reference=lambda t, a: _norm_qkv_ref(rmsnorm_ref(t[0], t[1], a.eps), t[2:]),
    tags=frozenset({MATMUL, NORM, REDUCTION, FUSED}),
    kernels=(KernelBinding("triton_rmsnorm_linear_qkv",
                           lambda i, o, w, a: _k_norm_qkv()(i[0], i[1], a.eps, i[2:], o,
                                                            normed=w[0] if w else None),
                           Applies(TRITON), workspace=partial(_norm_x_ws, qkv=True),
                           launches=_norm_x_launches(1, qkv=True)),),
))


def _launch_norm_silu(i: Tensors, o: Tensors, w: Tensors, a: EpsAttrs, prefetch: bool = False) -> None:
    _k_prologue()(i[0], i[2], o[0], norm1=i[1], eps1=a.eps, silu_mul=True, prefetch=prefetch,
                  normed=w[0] if w else None)


def _infer_norm_silu(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    return _infer_linear_silu_mul([_norm_then(ins, a), ins[2]], a)


register(OpDef(
    name="rmsnorm_linear_silu_mul", inputs=("x", "norm_weight", "gate_up_weight"), outputs=("out",),
    attrs=EpsAttrs, infer=_infer_norm_silu,
    cost=lambda ins, outs, a, ctx, env: _weight_cost(ins, outs, env, ins[0], ins[2:]),
    reference=lambda t, a: _silu_mul([linear_ref(rmsnorm_ref(t[0], t[1], a.eps), t[2])], a),
    tags=frozenset({MATMUL, NORM, REDUCTION, FUSED}),
    kernels=(KernelBinding("triton_rmsnorm_linear_silu_mul", _launch_norm_silu, Applies(TRITON),
                           workspace=_norm_x_ws, launches=_norm_x_launches(1)),
             _prefetch_variant("triton_rmsnorm_linear_silu_mul", _launch_norm_silu, _norm_x_ws,
                               _norm_x_launches(1))),
))


# ---- the MTP input: embedding, its norm, the hidden's norm and the concat, all in eh_proj ----
def _infer_embed_concat(ins: list[TensorSpec], a: EpsAttrs) -> list[TensorSpec]:
    table, ids, norm1, x2, norm2, w = ins
    (emb,) = _infer_embedding([table, ids], a)
    x1 = _infer_rmsnorm([emb, norm1], a)[0]
    return _infer_linear_concat([x1, _infer_rmsnorm([x2, norm2], a)[0], w], a)


def _embed_concat_ref(t: list[torch.Tensor], a: EpsAttrs) -> tuple[torch.Tensor]:
    table, ids, norm1, x2, norm2, w = t
    x1 = rmsnorm_ref(embedding_ref(table, ids), norm1, a.eps)
    return (linear_ref(torch.cat([x1, rmsnorm_ref(x2, norm2, a.eps)], dim=-1), w),)


def _launch_embed_concat(i: Tensors, o: Tensors, w: Tensors, a: EpsAttrs, prefetch: bool = False) -> None:
    _k_prologue()(i[0], i[5], o[0], ids=i[1], norm1=i[2], eps1=a.eps, x2=i[3], norm2=i[4], eps2=a.eps,
                  prefetch=prefetch, normed=w[0] if w else None)


def _launch_embed_concat_splitk(i: Tensors, o: Tensors, w: Tensors, a: EpsAttrs) -> None:
    _k_prologue_splitk()(i[0], i[5], o[0], w[0], ids=i[1], norm1=i[2], eps1=a.eps, x2=i[3],
                         norm2=i[4], eps2=a.eps, normed=w[1] if len(w) > 1 else None)


def _embed_parts(ins: Sequence[TensorSpec]) -> tuple[int | str, int | str]:
    return ins[0].shape[1], ins[3].shape[1]  # the table's columns, x2's


def _embed_normed_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    k1, k2 = (int(k) for k in _embed_parts(ins))  # the normed x: [n, K1 + K2]
    return _normed_ws(ins[0].dtype, ins[3].concrete(env)[0], (k1, k2))


def _embed_concat_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    rows, k = ins[5].shape
    return [("float32", _k_splitk_ws()(ins[3].concrete(env)[0], int(rows), int(k))),
            *_embed_normed_ws(ins, env, a)]


def _embed_launches(base: int) -> Callable[[Sequence[TensorSpec], Any], int]:
    return lambda ins, a: base + _wide(ins[3].shape[0], _embed_parts(ins))  # n: x2's rows


def _embed_concat_splits_pay(ins: Sequence[TensorSpec], a: Any) -> bool:
    rows, k = ins[5].shape  # the weight's shape only: every width of a circuit picks the same kernel
    return isinstance(rows, int) and isinstance(k, int) and bool(_k_prologue_splitk_pays()(rows, k))


EMBED_CONCAT_SPLITK = Condition("K >= 4096, cdiv(N, 32) < 256 output tiles and K in >= 2 splits",
                                _embed_concat_splits_pay)


def _embed_concat_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    table, ids, norm1, x2, norm2, w = ins
    rows = outs[0].concrete(env)[0]
    n, k2 = x2.concrete(env)
    k1 = int(table.shape[1])
    gathered = rows * k1 * TensorSpec(dtype=table.dtype, shape=(1,)).nbytes({})  # only the rows read
    read = gathered + sum(s.nbytes(env) for s in (ids, norm1, x2, norm2, w))
    return Cost(read, outs[0].nbytes(env), 2 * n * (k1 + k2) * int(w.shape[0]))


register(OpDef(
    name="embed_rmsnorm_linear_concat",
    inputs=("table", "ids", "norm1_weight", "x2", "norm2_weight", "weight"), outputs=("out",),
    attrs=EpsAttrs, infer=_infer_embed_concat, reference=_embed_concat_ref, cost=_embed_concat_cost,
    tags=frozenset({GATHER, NORM, REDUCTION, LAYOUT, MATMUL, FUSED}),
    # an id outside the table reads a zero row on the device (the reference raises TokenError):
    # the GPU cannot raise, and the input checks refuse such ids before a run (FAULTS 25)
    kernels=(
        # split-K first, by the weight's shape only: at n = 1 the one-launch kernel's grid is
        # N / 32 programs each walking all of K (the 8B eh_proj: 128 programs over K 8192)
        KernelBinding("triton_embed_rmsnorm_linear_concat_splitk", _launch_embed_concat_splitk,
                      Applies(TRITON, conditions=(EMBED_CONCAT_SPLITK,)),
                      # partials (prologue in them), reduce; the prologue first at wide n
                      workspace=_embed_concat_ws, launches=_embed_launches(2)),
        KernelBinding("triton_embed_rmsnorm_linear_concat", _launch_embed_concat, Applies(TRITON),
                      workspace=_embed_normed_ws, launches=_embed_launches(1)),
        _prefetch_variant("triton_embed_rmsnorm_linear_concat", _launch_embed_concat,
                          _embed_normed_ws, _embed_launches(1))),
))


# ---- the attention's input: the normed q/k/v products, rope and the paged KV write, one launch ----
class NormRopeKvWriteAttrs(RopeKvWriteAttrs):
    """rope_kv_write's attrs and the input norm's eps."""
    eps: float = 1e-6

    def model_post_init(self, _: object) -> None:
        super().model_post_init(_)
        EpsAttrs(eps=self.eps)  # the same refusal rmsnorm makes


def _qkv_rope_parts(t: list[Any]) -> tuple[list[Any], list[Any]]:
    """(x, norm, wq, wk, wv, positions, kc, vc, tables, live, [active]) -> the norm-qkv inputs
    and the rope_kv_write inputs after the three products."""
    return t[:5], t[5:]


def _infer_qkv_rope(ins: list[TensorSpec], a: NormRopeKvWriteAttrs) -> list[TensorSpec]:
    qkv, rest = _qkv_rope_parts(ins)
    q, k, v = _infer_norm_qkv(qkv, EpsAttrs(eps=a.eps))
    return _infer_rope_kv_write([q, k, v, *rest], a)


def _qkv_rope_ref(t: list[torch.Tensor], a: NormRopeKvWriteAttrs) -> tuple[torch.Tensor, ...]:
    (x, norm, *weights), rest = _qkv_rope_parts(t)
    return _rope_kv_write([*_norm_qkv_ref(rmsnorm_ref(x, norm, a.eps), weights), *rest], a)


def _qkv_rope_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    n, k = ins[0].concrete(env)
    rows = sum(w.concrete(env)[0] for w in ins[2:5])
    kv_rows = 2 * n * ins[3].concrete(env)[0] * TensorSpec(dtype=ins[6].dtype, shape=(1,)).nbytes({})
    read = sum(s.nbytes(env) for i, s in enumerate(ins) if i not in (6, 7))  # not the caches
    return Cost(read, outs[0].nbytes(env) + kv_rows, 2 * n * k * rows)


def _launch_qkv_rope(ins: Tensors, outs: Tensors, ws: Tensors, a: NormRopeKvWriteAttrs) -> None:
    (x, norm, *weights), (pos, kc, vc, tables, live, *active) = _qkv_rope_parts(ins)
    _k_qkv_rope()(x, norm, a.eps, weights, pos, live, tables, kc, vc, outs[0], head_dim=a.head_dim,
                  theta=a.theta, pos_offset=a.pos_offset, row_offset=a.row_offset,
                  active=active[0] if active else None)


_k_qkv_rope = kernel("qkv_rope", "rmsnorm_qkv_rope_kv_write")
FULL_ROTARY = Condition("rotary_dim None or head_dim (the kernel rotates whole heads)",
                        lambda ins, a: a.rotary_dim in (None, a.head_dim))

register(OpDef(
    name="rmsnorm_linear_qkv_rope_kv_write",
    inputs=("x", "norm_weight", "q_weight", "k_weight", "v_weight", "positions", "k_cache",
            "v_cache", "block_tables", "live_rows", "active"),
    outputs=("q_out", "k_cache", "v_cache"), num_required=10, attrs=NormRopeKvWriteAttrs,
    infer=_infer_qkv_rope, reference=_qkv_rope_ref, cost=_qkv_rope_cost, mutates={1: 6, 2: 7},
    tags=frozenset({MATMUL, NORM, REDUCTION, ATTENTION, FUSED}),
    kernels=(KernelBinding("triton_rmsnorm_linear_qkv_rope_kv_write", _launch_qkv_rope,
                           Applies(TRITON, conditions=(FULL_ROTARY,))),),
))
