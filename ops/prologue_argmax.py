"""The final norm folded into the lm-head's argmax (issue 15), split from ops/prologue_linear.py
with the same conventions: each op's reference is the composition of its parts' references.

- `rmsnorm_linear_argmax_logprob` / `rmsnorm_linear_argmax_keep` (the final norm into the lm-head);
  `rmsnorm_linear_argmax_keep_last`, `_gate`, `_last_gate`: the chain's keep_if_active(token,
  active, last) and confidence_gate(active, logprob, log_tau) in the merge's epilogue too.

Each has two Triton bindings over kernels.argmax_logprob: `*_prenorm` first (the norm a launch
of its own, then the partials and the merge: three launches) where the weight's shape says the
prologue costs more (V x K from argmax_logprob.PRENORM_FROM), and the norm in the partials'
prologue (two launches) for the rest. With attr `ids` (fuse_lm_head_argmax absorbed the map_ids
of a reduced draft vocabulary) the last input is the id table and every token output is mapped
through it in the merge (ops/sampling.py's IdsAttrs).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.basic import EpsAttrs, rmsnorm_ref
from draft_circuit.ops.bindings import TRITON, Applies, Condition, KernelBinding, Scratch, Tensors, kernel
from draft_circuit.ops.prologue_linear import _norm_then
from draft_circuit.ops.registry import (FUSED, MATMUL, NORM, REDUCTION, SAMPLING, Cost, CostContext, Env,
                                        OpDef, Specs, register)
from draft_circuit.ops.sampling import (MAX_FUSED_VOCAB, IdsAttrs, KeepAttrs, _infer_gate, _infer_keep, _infer_linear_argmax,
                                        _infer_linear_argmax_keep, _linear_argmax, _linear_argmax_keep,
                                        _linear_argmax_ws, gate_on, ids_cost, keep_on, split_ids)

_k_lin_argmax = kernel("argmax_logprob", "linear_argmax_logprob")
_k_prenorm_pays = kernel("argmax_logprob", "prenorm_pays")

VOCAB_FITS = Condition(f"vocab < {MAX_FUSED_VOCAB}",
                       lambda ins, a: isinstance(v := ins[2].shape[0], int) and v < MAX_FUSED_VOCAB)


class EpsIdsAttrs(EpsAttrs, IdsAttrs):
    """The final norm's eps, and `ids` (ops/sampling.py's IdsAttrs): the last input is the id
    table of a reduced draft vocabulary and every token output is mapped through it."""


def _infer_norm_argmax(ins: list[TensorSpec], a: EpsIdsAttrs) -> list[TensorSpec]:
    return _infer_linear_argmax([_norm_then(ins, a), *ins[2:]], a)


def _infer_norm_argmax_keep(ins: list[TensorSpec], a: EpsIdsAttrs) -> list[TensorSpec]:
    return _infer_linear_argmax_keep([_norm_then(ins, a), *ins[2:]], a)


def _norm_argmax_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    return _linear_argmax_ws([ins[0], *ins[2:]], env, a)


# The lm-head's final norm as a launch of its own (kernels.rmsnorm into a workspace the partials
# read) where the weight is large enough that the prologue costs more than the launch
# (kernels.argmax_logprob.PRENORM_FROM says what was measured). Bound before the one-prologue
# binding, by the weight's shape only: every width of a circuit binds the same kernels.
def _prenorm(ins: Sequence[TensorSpec], a: Any) -> bool:
    v, k = ins[2].shape
    return isinstance(v, int) and isinstance(k, int) and bool(_k_prenorm_pays()(v, k))


PRENORM = Condition("V x K from argmax_logprob.PRENORM_FROM (the norm a launch of its own)", _prenorm)


def _prenorm_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    return [*_norm_argmax_ws(ins, env, a), (ins[0].dtype, tuple(ins[0].concrete(env)))]


def _normed(ws: Tensors) -> torch.Tensor | None:
    """The prenorm binding's normed-x buffer (its second workspace entry), None for the prologue's."""
    return ws[1] if len(ws) > 1 else None


def _argmax_bindings(name: str, launch: Callable[..., None]) -> tuple[KernelBinding, KernelBinding]:
    """(the norm a launch of its own, where it pays; the norm in the partials' prologue)."""
    return (KernelBinding(f"{name}_prenorm", launch, Applies(TRITON, conditions=(VOCAB_FITS, PRENORM)),
                          workspace=_prenorm_ws, launches=3),  # the norm, the partials, the merge
            KernelBinding(name, launch, Applies(TRITON, conditions=(VOCAB_FITS,)),
                          workspace=_norm_argmax_ws, launches=2))  # the partials (norm in them), the merge


def _launch_norm_argmax(ins: Tensors, outs: Tensors, ws: Tensors, a: EpsIdsAttrs) -> None:
    (x, norm, w, *mask), ids = split_ids(ins, a)
    _k_lin_argmax()(x, w, outs[0], outs[1], mask[0] if mask else None, ws[0], norm_weight=norm, eps=a.eps,
                    normed=_normed(ws), ids=ids)


def _launch_norm_argmax_keep(ins: Tensors, outs: Tensors, ws: Tensors, a: EpsIdsAttrs) -> None:
    (x, norm, w, active, *mask), ids = split_ids(ins, a)
    _k_lin_argmax()(x, w, outs[0], outs[1], mask[0] if mask else None, ws[0], active=active,
                    kept_out=outs[2], norm_weight=norm, eps=a.eps, normed=_normed(ws), ids=ids)


def _argmax_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    n, k = ins[0].concrete(env)
    return ids_cost(ins, outs, a, env, 2 * n * k * ins[2].concrete(env)[0])


register(OpDef(
    name="rmsnorm_linear_argmax_logprob", inputs=("x", "norm_weight", "weight", "bitmask", "ids"),
    outputs=("token", "logprob"), num_required=3, attrs=EpsIdsAttrs, infer=_infer_norm_argmax,
    reference=lambda t, a: _linear_argmax([rmsnorm_ref(t[0], t[1], a.eps), *t[2:]], a),
    cost=_argmax_cost, tags=frozenset({REDUCTION, MATMUL, NORM, SAMPLING, FUSED}),
    kernels=_argmax_bindings("triton_rmsnorm_linear_argmax_logprob", _launch_norm_argmax),
))

register(OpDef(
    name="rmsnorm_linear_argmax_keep", inputs=("x", "norm_weight", "weight", "active", "bitmask", "ids"),
    outputs=("token", "logprob", "kept"), num_required=4, attrs=EpsIdsAttrs,
    infer=_infer_norm_argmax_keep,
    reference=lambda t, a: _linear_argmax_keep([rmsnorm_ref(t[0], t[1], a.eps), *t[2:]], a),
    cost=_argmax_cost, tags=frozenset({REDUCTION, MATMUL, NORM, SAMPLING, FUSED}),
    kernels=_argmax_bindings("triton_rmsnorm_linear_argmax_keep", _launch_norm_argmax_keep),
))


# ---- the draft bookkeeping in the lm-head merge's epilogue: last_kept and the confidence gate ----
def _draft_parts(t: list[Any], last: bool, gate: bool) -> tuple[list[Any], Any, Any]:
    """(x, norm, w, active, [fallback], [log_tau], [bitmask], [ids]) -> ([x, norm, w, active,
    *bitmask, *ids], fallback, log_tau)."""
    x, norm, w, active, *rest = t
    fallback = rest.pop(0) if last else None
    log_tau = rest.pop(0) if gate else None
    return [x, norm, w, active, *rest], fallback, log_tau


def _draft_op(last: bool, gate: bool) -> OpDef:
    name = "rmsnorm_linear_argmax_keep" + ("_last" if last else "") + ("_gate" if gate else "")
    extra_in = (("fallback",) if last else ()) + (("log_tau",) if gate else ())
    extra_out = (("last",) if last else ()) + (("active_next",) if gate else ())

    def infer(ins: list[TensorSpec], a: EpsIdsAttrs) -> list[TensorSpec]:
        base, fallback, log_tau = _draft_parts(ins, last, gate)
        outs = _infer_norm_argmax_keep(base, a)
        more = []
        if fallback is not None:
            more += _infer_keep([outs[0], base[3], fallback], KeepAttrs())
        if log_tau is not None:
            more += _infer_gate([base[3], outs[1], log_tau], a)
        return [*outs, *more]

    def reference(t: list[torch.Tensor], a: EpsIdsAttrs) -> tuple[torch.Tensor, ...]:
        # _linear_argmax_keep, keep_if_active and confidence_gate's references, active's bool once
        # (the token already mapped through the id table where there is one)
        base, fallback, log_tau = _draft_parts(t, last, gate)
        x, norm, w, active, *tail = base
        token, logprob = _linear_argmax([rmsnorm_ref(x, norm, a.eps), w, *tail], a)
        act = active.bool()
        more = [keep_on(token, act, None)]
        if fallback is not None:
            more.append(keep_on(token, act, fallback))
        if log_tau is not None:
            more.append(gate_on(act, logprob, log_tau))
        return (token, logprob, *more)

    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: EpsIdsAttrs) -> None:
        without, ids = split_ids(ins, a)
        base, fallback, log_tau = _draft_parts(without, last, gate)
        x, norm, w, active, *mask = base
        more = iter(outs[3:])
        last_out = next(more) if last else None
        active_out = next(more) if gate else None
        _k_lin_argmax()(x, w, outs[0], outs[1], mask[0] if mask else None, ws[0], active=active,
                        kept_out=outs[2], norm_weight=norm, eps=a.eps, fallback=fallback,
                        last_out=last_out, log_tau=log_tau, active_out=active_out, normed=_normed(ws),
                        ids=ids)

    return OpDef(
        name=name, inputs=("x", "norm_weight", "weight", "active", *extra_in, "bitmask", "ids"),
        outputs=("token", "logprob", "kept", *extra_out), num_required=4 + len(extra_in),
        attrs=EpsIdsAttrs, infer=infer, reference=reference, cost=_argmax_cost,
        tags=frozenset({REDUCTION, MATMUL, NORM, SAMPLING, FUSED}),
        kernels=_argmax_bindings(f"triton_{name}", launch),
    )


for _last, _gate in ((True, False), (False, True), (True, True)):
    register(_draft_op(_last, _gate))
