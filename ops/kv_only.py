"""The KV-only catch-up's fused ops (issue 14): what is left of a decode step when only its KV
writes are outputs, in as few launches as the full step's same work.

The KV-only circuit (circuit/planner.kv_only_circuit) drops q and its rope with the attention,
so the full step's fusions (fuse_qkv, fuse_rope_kv_write: both need q) never matched there, and
on CUDA its k/v projections ran as three launches and its rope and paged write as ~20 torch
kernels a run (benchmarks/engine_timeline.py, 2026-12-06, H100: a third of the drafter's
kernels a step were these). Each op here is the composition of its parts' references, so a
fused circuit's eager run is the unfused one's, bitwise; and each kernel binding is the full
step's kernel with the q part empty, so the k and v rows a catch-up writes are those the full
step's kernels write: the same K order and sums (where the full step's q/k/v takes the norm as a
launch of its own, kernels.prologue_norm, the k/v here keep the one-launch prologue: the two
paths' bits are checked equal on the GPU from n = 1 to 64 by tests/kernels/test_prologue_norm.py);
the tile shape may differ past n = 32 on sm90 (kernels.tiles chooses it by the launch's program
count, which q no longer adds to), which kernels.tiles measured not to change a row's bits there
(tests/runners/test_kv_only.py checks it on the GPU at n = 64):

- `linear_kv(x, w_k, w_v) -> (k, v)`: kernels.linear_multi.linear_qkv over (no rows, w_k, w_v);
- `rmsnorm_linear_kv(x, norm_weight, w_k, w_v) -> (k, v)`: kernels.linear_fused's
  rmsnorm_linear_qkv over (no rows, w_k, w_v), input_layernorm in the prologue;
- `rope_k_kv_write(k, v, positions, caches, tables, live, [active]) -> caches`: rope(k) and the
  paged write of rope(k) and v, kernels.rope_kv_write with no q heads.
"""
from __future__ import annotations

from typing import Any

import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.attention import (KvWriteAttrs, RopeAttrs, RopeKvWriteAttrs, _infer_kv_write,
                                         _infer_rope, kv_write_ref, rope_ref)
from draft_circuit.ops.basic import EpsAttrs, linear_ref, rmsnorm_ref
from draft_circuit.ops.bindings import TRITON, Applies, KernelBinding, Tensors, kernel
from draft_circuit.ops.fused_linear import _infer_qkv, _qkv_cost
from draft_circuit.ops.prologue_linear import _infer_norm_qkv, _norm_qkv_cost, _norm_qkv_ref
from draft_circuit.ops.registry import ATTENTION, FUSED, MATMUL, NORM, REDUCTION, Cost, OpDef, register

_k_qkv = kernel("linear_multi", "linear_qkv")
_k_norm_qkv = kernel("linear_fused", "rmsnorm_linear_qkv")
_k_rope_kv = kernel("rope_kv_write", "rope_kv_write")


def _no_q(weight: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty q part for the q/k/v kernels: no weight rows, no output columns (no programs)."""
    return weight[:0], out[:, :0]


def _launch_kv(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    w0, o0 = _no_q(ins[1], outs[0])
    _k_qkv()(ins[0], (w0, ins[1], ins[2]), (o0, outs[0], outs[1]))


register(OpDef(
    name="linear_kv", inputs=("x", "k_weight", "v_weight"), outputs=("k", "v"),
    infer=_infer_qkv, cost=_qkv_cost,
    reference=lambda t, a: tuple(linear_ref(t[0], w) for w in t[1:]),
    tags=frozenset({MATMUL, FUSED}),
    kernels=(KernelBinding("triton_linear_kv", _launch_kv, Applies(TRITON)),),
))


def _launch_norm_kv(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    w0, o0 = _no_q(ins[2], outs[0])
    _k_norm_qkv()(ins[0], ins[1], a.eps, (w0, ins[2], ins[3]), (o0, outs[0], outs[1]))


register(OpDef(
    name="rmsnorm_linear_kv", inputs=("x", "norm_weight", "k_weight", "v_weight"),
    outputs=("k", "v"), attrs=EpsAttrs, infer=_infer_norm_qkv, cost=_norm_qkv_cost,
    # one norm for both products, as rmsnorm_linear_qkv (whose shape rule and cost take any
    # number of weights)
    reference=lambda t, a: _norm_qkv_ref(rmsnorm_ref(t[0], t[1], a.eps), t[2:]),
    tags=frozenset({MATMUL, NORM, REDUCTION, FUSED}),
    kernels=(KernelBinding("triton_rmsnorm_linear_kv", _launch_norm_kv, Applies(TRITON)),),
))


def _infer_rope_k_kv_write(ins: list[TensorSpec], a: RopeKvWriteAttrs) -> list[TensorSpec]:
    k, v, pos, kc, vc, tables, live = ins[:7]
    _infer_rope([k, pos], RopeAttrs(head_dim=a.head_dim))
    return _infer_kv_write([kc, vc, k, v, tables, live, *ins[7:]], KvWriteAttrs())


def _rope_k_kv_write(t: list[torch.Tensor], a: RopeKvWriteAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    """rope's reference on k, then kv_write's on the rotated k and v: the unfused pair's values."""
    k, v, pos, kc, vc, tables, live = t[:7]
    k_rot = rope_ref(k, pos, a.head_dim, a.theta, a.pos_offset, a.rotary_dim)
    kv_write_ref(kc, vc, k_rot, v, tables, live, t[7] if len(t) > 7 else None, a.row_offset)
    return kc, vc


def _launch_rope_k_kv_write(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    k, v, pos, kc, vc, tables, live, *active = ins
    q = k[:, :0]  # no q heads: the kernel's grid is the kv heads alone
    _k_rope_kv()(q, k, v, pos, live, tables, kc, vc, q, num_heads=0, num_kv_heads=kc.shape[2],
                 head_dim=a.head_dim, theta=a.theta, pos_offset=a.pos_offset,
                 row_offset=a.row_offset, active=active[0] if active else None,
                 rotary_dim=a.rotary_dim)


register(OpDef(
    name="rope_k_kv_write",
    inputs=("k", "v", "positions", "k_cache", "v_cache", "block_tables", "live_rows", "active"),
    outputs=("k_cache", "v_cache"), num_required=7, attrs=RopeKvWriteAttrs,
    infer=_infer_rope_k_kv_write, reference=_rope_k_kv_write, mutates={0: 3, 1: 4},
    cost=lambda ins, outs, a, ctx, env: Cost(
        sum(s.nbytes(env) for s in ins[:3]), 2 * ins[0].nbytes(env), 0),
    tags=frozenset({ATTENTION, FUSED}),
    kernels=(KernelBinding("triton_rope_k_kv_write", _launch_rope_k_kv_write, Applies(TRITON)),),
))
