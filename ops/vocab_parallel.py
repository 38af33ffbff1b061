"""`vocab_parallel_argmax` (issue 21): the lm-head's top-1 across tensor-parallel ranks with its
full-vocabulary log-probability, as one op over ops/collectives.py's group machinery.

Each rank reduces its vocabulary rows to a partial (its lowest-id maximum, the maximum and the
log-sum-exp of its allowed logits: `argmax_partial`), the partials are gathered in rank order,
and every rank combines them alike (`combine_partials`), so every rank holds the same bits. Its
reference is the world-size-1 form, bitwise `argmax_logprob` over the whole vocabulary. On CUDA
(and under the interpreter) the partial and combine are Triton kernels (kernels/
vocab_parallel_argmax.py); on CPU and in the eager oracle, torch ops around the gather.
"""
from __future__ import annotations

from functools import cache
from typing import Any, Callable, Sequence

import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import TRITON, Applies, Launch, Scratch, Tensors, aten_kernels, kernel
from draft_circuit.ops.collectives import (ANY_DEVICE, CollectiveAttrs, CollectiveBinding, _gather_into,
                                           _link_cost, _single_process)
from draft_circuit.ops.registry import (REDUCTION, SAMPLING, Cost, CostContext, Env, OpDef, Reference, Specs,
                                        check, register)
from draft_circuit.ops.sampling import _check_mask, allowed_tokens

_NO_ID = torch.iinfo(torch.int32).max  # above every vocabulary id: min() skips it


class VocabParallelAttrs(CollectiveAttrs):
    """This rank's logits are rows [vocab_offset, vocab_offset + local) of a `vocab_size` vocabulary."""

    vocab_size: int
    vocab_offset: int = 0

    def model_post_init(self, _: object) -> None:
        super().model_post_init(_)
        if self.vocab_size < 1 or not 0 <= self.vocab_offset < self.vocab_size:
            raise ValueError(f"vocab_offset {self.vocab_offset} must lie in [0, vocab_size "
                             f"{self.vocab_size})")


# ---- the vocabulary-parallel argmax ----
def argmax_partial(logits: torch.Tensor, bitmask: torch.Tensor | None, offset: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's top-1 over its vocabulary rows [offset, offset + V_r) as int32 [n, 3]: the
    global id of its lowest-id maximum (-1: nothing allowed), then the maximum and the
    log-sum-exp of its allowed logits as float32 bits (-inf where nothing is allowed). Allowed
    is `argmax_logprob`'s rule: finite, and its bit set in the full vocabulary's mask."""
    x = logits.float()
    allowed = torch.isfinite(x)
    if bitmask is not None:
        allowed &= allowed_tokens(bitmask, offset + x.shape[1])[:, offset:]
    masked = x.masked_fill(~allowed, float("-inf"))
    best = masked.max(dim=-1).values
    local = (masked == best.unsqueeze(-1)).to(torch.int8).argmax(dim=-1).to(torch.int32)
    none = ~allowed.any(dim=-1)
    out = torch.empty(x.shape[0], 3, dtype=torch.int32, device=x.device) if out is None else out
    out[:, 0] = (local + offset).masked_fill(none, -1)
    floats = out.view(torch.float32)  # bits only: a gather copies them unchanged
    floats[:, 1] = best
    floats[:, 2] = torch.logsumexp(masked, dim=-1)
    return out


def combine_partials(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[w, n, 3] partials (rank-major) -> (token i32[n], logprob f32[n]): the highest logit, the
    lowest global id among the ranks that hold it, and max - log(sum_r exp(lse_r)), the
    full-vocabulary log-probability. Nothing allowed anywhere: -1 and -inf. Rank order is fixed,
    so every rank computes the same bits."""
    ids, floats = parts[..., 0], parts.view(torch.float32)
    vals, lses = floats[..., 1], floats[..., 2]
    best = vals.max(dim=0).values
    token = torch.where((vals == best.unsqueeze(0)) & (ids >= 0), ids, _NO_ID).min(dim=0).values
    none = token == _NO_ID
    logprob = (best - torch.logsumexp(lses, dim=0)).masked_fill(none, float("-inf"))
    return token.masked_fill(none, -1), logprob


def _infer_vp_argmax(ins: list[TensorSpec], a: VocabParallelAttrs) -> list[TensorSpec]:
    logits = ins[0]
    check(len(logits.shape) == 2 and isinstance(logits.shape[1], int),
          lambda: f"logits must be [n, local vocab], got {logits}")
    check(logits.dtype in ("float32", "float16", "bfloat16"), lambda: f"logits {logits} not float")
    local = int(logits.shape[1])
    check(a.vocab_offset + local <= a.vocab_size,
          lambda: f"local vocabulary rows [{a.vocab_offset}, {a.vocab_offset + local}) run past the "
                  f"vocabulary of {a.vocab_size}")
    check(a.world_size > 1 or (a.vocab_offset == 0 and local == a.vocab_size),
          lambda: f"world size 1 holds the whole vocabulary of {a.vocab_size}; got rows "
                  f"[{a.vocab_offset}, {a.vocab_offset + local})")
    if len(ins) > 1:  # the host's mask covers the whole vocabulary on every rank
        _check_mask(TensorSpec(dtype=logits.dtype, shape=(logits.shape[0], a.vocab_size)),
                    a.vocab_size, ins[1])
    rows = logits.shape[0]
    return [TensorSpec(dtype="int32", shape=(rows,)), TensorSpec(dtype="float32", shape=(rows,))]


def _vp_argmax_ref(t: list[torch.Tensor], a: VocabParallelAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    _single_process("vocab_parallel_argmax", a)
    return combine_partials(argmax_partial(t[0], t[1] if len(t) > 1 else None, 0).unsqueeze(0))


def _vp_argmax_cost(ins: Specs, outs: Specs, a: VocabParallelAttrs, ctx: CostContext, env: Env) -> Cost:
    part = 12 * ins[0].concrete(env)[0]  # [n, 3] 4-byte words a rank contributes
    return _link_cost(ins, outs, env, (a.world_size - 1) * part, (a.world_size - 1) * part)


def _vp_argmax_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    n = ins[0].concrete(env)[0]
    return [("int32", (n, 3)), ("int32", (a.world_size, n, 3))]


@cache
def _vp_argmax_launches(ins: Sequence[TensorSpec], a: Any) -> int:
    """The aten kernels one launch runs (its world-size-1 form on meta tensors, rows = 2: the
    gather is one kernel, as the copy standing in for it there)."""
    env = {name: 2 for s in ins for name in s.shape if isinstance(name, str)}
    local = a.model_copy(update={"world_size": 1})

    def meta(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    tin = [meta(s.dtype, s.concrete(env)) for s in ins]
    rows = tin[0].shape[0]  # 2, or the width where the specs are concrete (plan reports)
    tout = [meta("int32", (rows,)), meta("float32", (rows,))]
    ws = [meta(dt, shape) for dt, shape in _vp_argmax_ws(ins, env, local)]
    return aten_kernels(lambda: _vp_argmax_on(None)(tin, tout, ws, local))


def _vp_argmax_on(group: Any) -> Launch:
    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
        argmax_partial(ins[0], ins[1] if len(ins) > 1 else None, a.vocab_offset, out=ws[0])
        if group is None:
            _single_process("vocab_parallel_argmax", a)
            ws[1][0].copy_(ws[0])
        else:
            _gather_into(group, ws[1], ws[0])
        token, logprob = combine_partials(ws[1])
        outs[0].copy_(token)
        outs[1].copy_(logprob)
    return launch


def _eager(on_group: Callable[[Any], Launch]) -> Callable[[Any], Reference]:
    """The out-of-place form of a destination-passing launch for EagerRunner: fresh outputs and
    workspace (the planner's shapes, `_vp_argmax_ws`) a call."""
    def eager(group: Any) -> Reference:
        def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
            n = t[0].shape[0]
            outs = [t[0].new_empty(n, dtype=torch.int32), t[0].new_empty(n, dtype=torch.float32)]
            ws = [t[0].new_empty(n, 3, dtype=torch.int32),
                  t[0].new_empty(a.world_size, n, 3, dtype=torch.int32)]
            on_group(group)(t, outs, ws, a)
            return tuple(outs)
        return ref
    return eager


_vp_argmax_eager = _eager(_vp_argmax_on)


_k_partial = kernel("vocab_parallel_argmax", "vocab_partial")
_k_combine = kernel("vocab_parallel_argmax", "vocab_combine")


def _vp_triton_on(group: Any) -> Launch:
    """Triton partial, the gather, Triton combine: three launches (two at world size 1, where the
    one partial is the gathered set)."""
    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
        _k_partial()(ins[0], ins[1] if len(ins) > 1 else None, a.vocab_offset, ws[0])
        if a.world_size == 1:
            parts = ws[0].view(1, *ws[0].shape)
        else:
            if group is None:
                _single_process("vocab_parallel_argmax", a)
            _gather_into(group, ws[1], ws[0])
            parts = ws[1]
        _k_combine()(parts, outs[0], outs[1])
    return launch


_vp_triton_eager = _eager(_vp_triton_on)


register(OpDef(
    # the tie rule of argmax_logprob across ranks; the confidence is the full-vocabulary softmax
    name="vocab_parallel_argmax", inputs=("logits", "bitmask"), outputs=("token", "logprob"),
    num_required=1, attrs=VocabParallelAttrs, infer=_infer_vp_argmax, reference=_vp_argmax_ref,
    cost=_vp_argmax_cost, tags=frozenset({REDUCTION, SAMPLING}),
    kernels=(CollectiveBinding(name="triton_vocab_parallel_argmax", launch=_vp_triton_on(None),
                               on_group=_vp_triton_on, eager_on_group=_vp_triton_eager,
                               applies=Applies(TRITON), workspace=_vp_argmax_ws,
                               launches=lambda ins, a: 2 if a.world_size == 1 else 3),
             # CPU, and the eager oracle's collective: torch ops around the gather
             CollectiveBinding(name="torch_vocab_parallel_argmax", launch=_vp_argmax_on(None),
                               on_group=_vp_argmax_on, eager_on_group=_vp_argmax_eager,
                               applies=Applies(ANY_DEVICE), workspace=_vp_argmax_ws,
                               launches=lambda ins, a: _vp_argmax_launches(tuple(ins), a)),),
))
