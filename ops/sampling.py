"""The vocabulary reduction: top-1 token and its log-probability, optionally under a bitmask.

Policy (FAULTS 14-16): token v is allowed iff bit v & 31 of word v >> 5 of the row's int32 mask is
set; non-finite logits are never allowed. Ties go to the lowest id. A row with nothing allowed
gives token -1 and log-probability -inf: reported, never a garbage id. Also the per-row
confidence stop (`confidence_gate`) and `keep_if_active`; Triton bindings for the two argmaxes.
"""
from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import Dim, TensorSpec
from draft_circuit.ops.basic import _infer_linear, linear_ref
from draft_circuit.ops.bindings import TRITON, Applies, Condition, KernelBinding, Scratch, Tensors, kernel
from draft_circuit.ops.registry import (ELEMENTWISE, FUSED, MATMUL, REDUCTION, SAMPLING, Cost, CostContext,
                                        Env, OpDef, Specs, check, default_cost, register)

_k_argmax = kernel("argmax_logprob", "argmax_logprob")
_k_lin_argmax = kernel("argmax_logprob", "linear_argmax_logprob")
_k_lin_argmax_ws = kernel("argmax_logprob", "linear_argmax_workspace_shape")
# kernels.argmax_logprob carries token ids through its fp32 workspace: exact below 2**24
MAX_FUSED_VOCAB = 1 << 24


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, W] int32 words -> [n, vocab] bool. The bit table is made every call, not cached by
    device: a torch binding's launch count is its aten kernels traced on meta tensors
    (ops/bindings.py), which must not depend on whether an earlier call filled a cache."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int64)
    expanded = (bitmask.long().unsqueeze(-1) >> bits) & 1  # the sign bit is just bit 31
    return expanded.view(bitmask.shape[0], -1)[:, :vocab].bool()


def argmax_logprob_ref(logits: torch.Tensor, bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # a disallowed logit becomes -inf, which no allowed (finite) one loses to, so a row has
    # nothing allowed exactly when its max is -inf; max(dim) gives the first index of the
    # maximum: ties to the lowest id (fewest torch ops, issue 20: each costs microseconds here)
    ninf = float("-inf")
    masked = logits.float().nan_to_num(ninf, ninf, ninf)
    if bitmask is not None:
        masked.masked_fill_(~allowed_tokens(bitmask, masked.shape[1]), ninf)
    best, token = masked.max(dim=-1)
    none = best == ninf
    logprob = (best - torch.logsumexp(masked, dim=-1)).masked_fill_(none, ninf)
    return token.to(torch.int32).masked_fill_(none, -1), logprob


def _check_mask(logits_or_x: TensorSpec, vocab: int, mask: TensorSpec) -> None:
    check(mask.dtype == "int32", lambda: f"bitmask must be int32, got {mask}")
    check(len(mask.shape) == 2 and mask.shape[0] == logits_or_x.shape[0],
          lambda: f"bitmask must be [rows, words], got {mask} for {logits_or_x}")
    check(mask.shape[1] == mask_words(vocab),
          lambda: f"bitmask has {mask.shape[1]} words a row; vocab {vocab} needs "
                  f"ceil({vocab}/32) = {mask_words(vocab)}")


def _outs(rows: Dim) -> list[TensorSpec]:
    return [TensorSpec(dtype="int32", shape=(rows,)), TensorSpec(dtype="float32", shape=(rows,))]


def _infer_argmax(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    logits = ins[0]
    check(len(logits.shape) == 2 and isinstance(logits.shape[1], int),
          lambda: f"logits must be [n, vocab], got {logits}")
    check(logits.dtype in ("float32", "float16", "bfloat16"), lambda: f"logits {logits} not float")
    if len(ins) > 1:
        _check_mask(logits, int(logits.shape[1]), ins[1])
    return _outs(logits.shape[0])


register(OpDef(
    name="argmax_logprob", inputs=("logits", "bitmask"), outputs=("token", "logprob"),
    num_required=1, infer=_infer_argmax,
    reference=lambda t, a: argmax_logprob_ref(t[0], t[1] if len(t) > 1 else None),
    tags=frozenset({REDUCTION, SAMPLING}),
    kernels=(KernelBinding(
        "triton_argmax_logprob",
        lambda i, o, w, a: _k_argmax()(i[0], o[0], o[1], i[1] if len(i) > 1 else None), Applies(TRITON)),),
))


# ---- the lm-head's argmax ops over a reduced draft vocabulary: the id table as their last input ----
class IdsAttrs(BaseModel):
    """`ids` (fuse_lm_head_argmax absorbed a map_ids): the op's last input is an int32 id table
    [V], one target id per vocabulary row, and its token is ids[top-1 index], -1 staying -1 (what
    argmax then map_ids computes; kept / last carry the mapped id too). The kernels read the
    winner's entry in the merge, so the mapping costs no launch."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ids: bool = False


T = TypeVar("T")


def split_ids(t: Sequence[T], a: Any) -> tuple[list[T], T | None]:
    """(an lm-head argmax op's inputs without its id table, the table: None unless `a.ids`)."""
    if getattr(a, "ids", False):
        return list(t[:-1]), t[-1]
    return list(t), None


def map_through(token: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[token] as int32, -1 (an all-masked draft) staying -1: map_ids' arithmetic, the ids
    in range (ops/vocab.py's map_ids_ref checks that first)."""
    out = table[token.clamp(min=0).long()].to(torch.int32)
    return out.masked_fill(token < 0, -1)


def _check_ids(vocab: Dim, ids: TensorSpec) -> None:
    check(ids.dtype == "int32" and ids.shape == (vocab,),
          lambda: f"id table must be int32 [{vocab}] (one target id per vocabulary row), got {ids}")


def _infer_linear_argmax(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    ins, ids = split_ids(ins, a)
    check(len(ins) >= 2, lambda: f"takes x and weight before its id table, got {len(ins)} input(s)")
    (logits,) = _infer_linear(ins[:2], a)
    if len(ins) > 2:
        _check_mask(logits, int(logits.shape[1]), ins[2])
    if ids is not None:
        _check_ids(logits.shape[1], ids)
    return _outs(logits.shape[0])


def _linear_argmax(t: list[torch.Tensor], a: BaseModel) -> tuple[torch.Tensor, torch.Tensor]:
    # logits in fp32 whatever the weights (the kernel never rounds them); in fp32 this is the
    # unfused pair's computation exactly, so CPU programs match eager bitwise
    t, ids = split_ids(t, a)
    logits = linear_ref(t[0], t[1], torch.float32)
    token, logprob = argmax_logprob_ref(logits, t[2] if len(t) > 2 else None)
    return (token if ids is None else map_through(token, ids)), logprob


def ids_cost(ins: Specs, outs: Specs, a: Any, env: Env, flops: int) -> Cost:
    """Every input read once and every output written once, but an id table only at the rows'
    winners (one entry a row, as map_ids' cost counts it), never whole."""
    base, ids = split_ids(ins, a)
    cost = default_cost(base, outs, env, flops=flops)
    return cost if ids is None else Cost(cost.bytes_read + outs[0].nbytes(env), cost.bytes_written, flops)


def _linear_argmax_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    n, k = ins[0].concrete(env)
    return ids_cost(ins, outs, a, env, 2 * n * k * ins[1].concrete(env)[0])


def _launch_linear_argmax(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    ins, ids = split_ids(ins, a)
    _k_lin_argmax()(ins[0], ins[1], outs[0], outs[1], ins[2] if len(ins) > 2 else None, ws[0], ids=ids)


def _linear_argmax_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    return [("float32", _k_lin_argmax_ws()(ins[0].concrete(env)[0], int(ins[1].shape[0])))]


register(OpDef(
    name="linear_argmax_logprob", inputs=("x", "weight", "bitmask", "ids"), outputs=("token", "logprob"),
    num_required=2, attrs=IdsAttrs, infer=_infer_linear_argmax, reference=_linear_argmax,
    cost=_linear_argmax_cost, tags=frozenset({REDUCTION, MATMUL, SAMPLING, FUSED}),
    kernels=(KernelBinding("triton_linear_argmax_logprob", _launch_linear_argmax, Applies(TRITON, conditions=(
        Condition(f"vocab < {MAX_FUSED_VOCAB}", lambda ins, a: isinstance(v := ins[1].shape[0], int) and v < MAX_FUSED_VOCAB),)),
        workspace=_linear_argmax_ws, launches=2),),  # the chunk partials, then their merge
))


# ---- the confidence stop, per row and on the device ----
def _infer_gate(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    active, logprob, log_tau = ins
    check(active.dtype == "int32" and logprob.dtype == "float32" and log_tau.dtype == "float32",
          lambda: f"confidence_gate takes int32 active, float32 logprob and log_tau; got "
                  f"{active}, {logprob}, {log_tau}")
    check(active.shape == logprob.shape == log_tau.shape and len(active.shape) == 1,
          lambda: f"confidence_gate operands must all be [n]: {active}, {logprob}, {log_tau}")
    return [active]


def confidence_gate_ref(active: torch.Tensor, logprob: torch.Tensor,
                        log_tau: torch.Tensor) -> torch.Tensor:
    """A row stays active unless this draft's top-1 log-probability is below log(tau).
    NaN compares false, so an unmeasured confidence never stops a chain."""
    return gate_on(active.bool(), logprob, log_tau)


def gate_on(active: torch.Tensor, logprob: torch.Tensor, log_tau: torch.Tensor) -> torch.Tensor:
    """confidence_gate_ref with active already bool: active and not below (bool > bool is
    True > False only)."""
    return active.gt(logprob < log_tau).to(torch.int32)


register(OpDef(
    name="confidence_gate", inputs=("active", "logprob", "log_tau"), outputs=("active",),
    infer=_infer_gate, reference=lambda t, a: (confidence_gate_ref(*t),),
    tags=frozenset({SAMPLING, ELEMENTWISE}),
))


class KeepAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    fill: int = -1


def _infer_keep(ins: list[TensorSpec], a: KeepAttrs) -> list[TensorSpec]:
    token = ins[0]
    check(all(s.dtype == "int32" and s.shape == token.shape and len(s.shape) == 1 for s in ins),
          lambda: f"keep_if_active operands must be int32[n]: {', '.join(map(str, ins))}")
    return [token]


def _keep(t: list[torch.Tensor], a: KeepAttrs) -> tuple[torch.Tensor]:
    return (keep_on(t[0], t[1].bool(), t[2] if len(t) > 2 else None, a.fill),)


def keep_on(token: torch.Tensor, active: torch.Tensor, fallback: torch.Tensor | None,
            fill: int = -1) -> torch.Tensor:
    """keep_if_active with active already bool."""
    return torch.where(active, token, fill if fallback is None else fallback)


register(OpDef(
    # rows still drafting keep this step's token; stopped (or inert) rows keep the fallback,
    # or `fill` (-1: "no draft here") without one
    name="keep_if_active", inputs=("token", "active", "fallback"), outputs=("out",),
    num_required=2, attrs=KeepAttrs, infer=_infer_keep, reference=_keep,
    tags=frozenset({SAMPLING, ELEMENTWISE}),
))


# ---- the lm-head's draft: linear_argmax_logprob with keep_if_active in its epilogue ----
def _infer_linear_argmax_keep(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, w, active, *tail = ins  # tail: the bitmask and the id table, each where present
    outs = _infer_linear_argmax([x, w, *tail], a)
    _infer_keep([outs[0], active], KeepAttrs())
    return [*outs, outs[0]]


def _linear_argmax_keep(t: list[torch.Tensor], a: BaseModel) -> tuple[torch.Tensor, ...]:
    token, logprob = _linear_argmax([t[0], t[1], *t[3:]], a)
    return token, logprob, keep_on(token, t[2].bool(), None)


def _launch_linear_argmax_keep(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    ins, ids = split_ids(ins, a)
    _k_lin_argmax()(ins[0], ins[1], outs[0], outs[1], ins[3] if len(ins) > 3 else None, ws[0],
                    active=ins[2], kept_out=outs[2], ids=ids)


register(OpDef(
    # fuse_argmax_keep: `kept` is keep_if_active(token, active) (fill -1); `token` stays for the
    # next step's embedding, which drafts on even where this row's draft is not kept
    name="linear_argmax_keep", inputs=("x", "weight", "active", "bitmask", "ids"),
    outputs=("token", "logprob", "kept"), num_required=3, attrs=IdsAttrs, infer=_infer_linear_argmax_keep,
    reference=_linear_argmax_keep, cost=_linear_argmax_cost,
    tags=frozenset({REDUCTION, MATMUL, SAMPLING, FUSED}),
    kernels=(KernelBinding("triton_linear_argmax_keep", _launch_linear_argmax_keep, Applies(TRITON, conditions=(
        Condition(f"vocab < {MAX_FUSED_VOCAB}", lambda ins, a: isinstance(v := ins[1].shape[0], int) and v < MAX_FUSED_VOCAB),)),
        workspace=_linear_argmax_ws, launches=2),),  # the chunk partials, then the merge with keep
))
