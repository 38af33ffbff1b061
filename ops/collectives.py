"""Collectives as ops (issue 21): `all_reduce` (sum), `all_gather` and `vocab_parallel_argmax`, the
lm-head's cross-rank top-1 with its full-vocabulary log-probability.

Each op's reference is the single-process one (world size 1): all_reduce is the identity,
all_gather a stack of one, vocab_parallel_argmax is `argmax_logprob` over the whole vocabulary
(bitwise). A reference asked for a larger world refuses with `CollectiveError`: a collective runs
only on a process group. The group reaches the launches through `CollectiveBinding`: its
`on_group(group)` is the destination-passing launch bound to that group (what ProgramRunner and
the CUDA graphs replay), `eager_on_group(group)` the out-of-place form EagerRunner calls. Launches
call torch.distributed in place on the program's static buffers (the output slot, or planned
workspace), so a call allocates no buffer of its own; with NCCL they are captured like any kernel.
vocab_parallel_argmax runs its partial and combine as Triton kernels on CUDA (and under the
interpreter), torch ops on CPU and in the eager oracle.

Sum order. A sum of two is exact in either order, so `torch_all_reduce` serves world size 2 as
width independent (a row's bits never depend on the batch). A ring or tree all-reduce over more
ranks adds a row's elements in an order set by its chunk of the message, i.e. by the batch width:
there `gather_sum` (all_gather, then a sum in rank order) keeps rows width independent and equal
on every rank, and the backend's all-reduce is chosen only with `width_independent=False`.

Costs are every op's (inputs read once, outputs written once) plus the bytes over the link:
`bytes_written` adds what a rank sends, `bytes_read` what it receives (ring all-reduce: 2 (w - 1)
/ w of the buffer each way; all-gather and the argmax's partials: w - 1 shards each way).

One module, over 400 lines: the three collectives share the group lookup, the world-size-1
references and the link cost; the vocabulary argmax's kernels live in kernels/.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import CircuitError, TensorSpec
from draft_circuit.ops.bindings import (TRITON, Applies, Condition, KernelBinding, Launch, Scratch, Tensors,
                                        aten_kernels, kernel)
from draft_circuit.ops.registry import (ELEMENTWISE, LAYOUT, REDUCTION, SAMPLING, Cost, CostContext, Env, OpDef, Reference,
                                        Specs, check, default_cost, register)
from draft_circuit.ops.sampling import _check_mask, allowed_tokens

# every device the planner selects for: collectives run wherever torch.distributed has a backend
# (gloo on CPU, NCCL on CUDA); "interpret" is CPU with Triton kernels interpreted
ANY_DEVICE: frozenset[str] = frozenset({"cpu", "cuda", "interpret"})
_NO_ID = torch.iinfo(torch.int32).max  # above every vocabulary id: min() skips it


class CollectiveError(CircuitError):
    """A collective asked of the wrong world: a world size above 1 without a process group, or a
    group whose size is not the one the circuit was emitted for."""


class CollectiveAttrs(BaseModel):
    """`world_size`: the ranks of the tensor-parallel group the circuit was emitted for."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    world_size: int = 1

    def model_post_init(self, _: object) -> None:
        if isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")


class VocabParallelAttrs(CollectiveAttrs):
    """This rank's logits are rows [vocab_offset, vocab_offset + local) of a `vocab_size` vocabulary."""

    vocab_size: int
    vocab_offset: int = 0

    def model_post_init(self, _: object) -> None:
        super().model_post_init(_)
        if self.vocab_size < 1 or not 0 <= self.vocab_offset < self.vocab_size:
            raise ValueError(f"vocab_offset {self.vocab_offset} must lie in [0, vocab_size "
                             f"{self.vocab_size})")


def _single_process(op: str, a: CollectiveAttrs) -> None:
    if a.world_size != 1:
        raise CollectiveError(f"{op} over {a.world_size} ranks needs a process group: run it through a "
                              "runner given one (runners/distributed.py); the reference is single-process",
                              op=op)


def _link_cost(ins: Specs, outs: Specs, env: Env, sent: int, received: int) -> Cost:
    local = default_cost(ins, outs, env)
    return Cost(bytes_read=local.bytes_read + received, bytes_written=local.bytes_written + sent, flops=0)


# ---- torch.distributed, in place on given buffers ----
def _dist() -> Any:
    import torch.distributed as dist  # imported at launch-binding time, not with the registry

    return dist


def _gather_into(group: Any, out: torch.Tensor, x: torch.Tensor) -> None:
    """out [w, *x.shape] (rank-major) <- every rank's x. Gloo takes the concatenated form only;
    the view is the same storage."""
    dist = _dist()
    flat = out.view(out.shape[0] * x.shape[0], *x.shape[1:]) if x.dim() else out
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, x, group=group)


def _all_reduce(group: Any, t: torch.Tensor) -> None:
    dist = _dist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def check_group_size(op: str, a: CollectiveAttrs, group: Any) -> None:
    """The group the runner was given has the world size the node was emitted for."""
    size = 1 if group is None else int(group.size())
    if size != a.world_size:
        raise CollectiveError(f"{op} was emitted for {a.world_size} ranks; the process group has {size}",
                              op=op)


def resolve_group(op: str, a: CollectiveAttrs, group: Any) -> Any:
    """The group a collective runs on: the runner's, else (as torch.distributed's own calls do)
    the default group when the node was emitted for more than one rank and torch.distributed is
    initialized, else None (one process). Checked against the node's world size."""
    if group is None and a.world_size > 1:
        dist = _dist()
        if dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
    check_group_size(op, a, group)
    return group


GroupLaunch = Callable[[Any], Launch]       # (process group or None) -> the bound launch
GroupReference = Callable[[Any], Reference]  # (process group or None) -> an out-of-place reference


@dataclass(frozen=True, kw_only=True)
class CollectiveBinding(KernelBinding):
    """A binding that calls torch.distributed. `launch` is its world-size-1 form (no group);
    `on_group(group)` the launch bound to the runner's group, `eager_on_group(group)` the same
    collective out of place, for the eager oracle."""

    on_group: GroupLaunch
    eager_on_group: GroupReference


# ---- all_reduce ----
def _infer_same(ins: list[TensorSpec], a: CollectiveAttrs) -> list[TensorSpec]:
    (x,) = ins
    check(x.dtype in ("float32", "float16", "bfloat16"), lambda: f"all_reduce sums floats, got {x}")
    return [x]


def _all_reduce_ref(t: list[torch.Tensor], a: CollectiveAttrs) -> tuple[torch.Tensor]:
    _single_process("all_reduce", a)
    return (t[0],)


def _all_reduce_cost(ins: Specs, outs: Specs, a: CollectiveAttrs, ctx: CostContext, env: Env) -> Cost:
    moved = 2 * (a.world_size - 1) * ins[0].nbytes(env) // a.world_size
    return _link_cost(ins, outs, env, moved, moved)


def _all_reduce_on(group: Any) -> Launch:
    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
        if outs[0].data_ptr() != ins[0].data_ptr():  # planned apart (the input lives on): copy first
            outs[0].copy_(ins[0])
        if group is None:
            _single_process("all_reduce", a)
        else:
            _all_reduce(group, outs[0])
    return launch


def _all_reduce_eager(group: Any) -> Reference:
    def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
        out = t[0].clone()
        _all_reduce_on(group)([t[0]], [out], [], a)
        return (out,)
    return ref


def _gather_sum_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    return [(ins[0].dtype, (a.world_size, *ins[0].concrete(env)))]


def _gather_sum_on(group: Any) -> Launch:
    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
        if group is None:
            _single_process("all_reduce", a)
            outs[0].copy_(ins[0])
            return
        _gather_into(group, ws[0], ins[0])
        torch.sum(ws[0], dim=0, out=outs[0])  # ranks in order, the same on every rank
    return launch


def _gather_sum_eager(group: Any) -> Reference:
    def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
        out, ws = torch.empty_like(t[0]), t[0].new_empty(a.world_size, *t[0].shape)
        _gather_sum_on(group)([t[0]], [out], [ws], a)
        return (out,)
    return ref


def _world_at_most_two(ins: Sequence[TensorSpec], a: Any) -> bool:
    return bool(a.world_size <= 2)


register(OpDef(
    name="all_reduce", inputs=("x",), outputs=("out",), attrs=CollectiveAttrs, infer=_infer_same,
    # elementwise across ranks: out[i] is the sum of every rank's x[i]
    reference=_all_reduce_ref, cost=_all_reduce_cost, inplace={0: 0}, tags=frozenset({ELEMENTWISE}),
    kernels=(
        CollectiveBinding(name="torch_all_reduce", launch=_all_reduce_on(None), on_group=_all_reduce_on,
                          eager_on_group=_all_reduce_eager,
                          applies=Applies(ANY_DEVICE, conditions=(Condition(
                              "world_size <= 2 (a sum of two is exact in either order)", _world_at_most_two),))),
        CollectiveBinding(name="gather_sum", launch=_gather_sum_on(None), on_group=_gather_sum_on,
                          eager_on_group=_gather_sum_eager, applies=Applies(ANY_DEVICE),
                          workspace=_gather_sum_ws, launches=2),  # the gather, then the sum
        # the backend's own reduction: fewer bytes, but a row's bits follow the batch's chunking
        CollectiveBinding(name="torch_all_reduce_any", launch=_all_reduce_on(None),
                          on_group=_all_reduce_on, eager_on_group=_all_reduce_eager,
                          applies=Applies(ANY_DEVICE), width_independent=False),
    ),
))


# ---- all_gather ----
def _infer_gather(ins: list[TensorSpec], a: CollectiveAttrs) -> list[TensorSpec]:
    (x,) = ins
    return [TensorSpec(dtype=x.dtype, shape=(a.world_size, *x.shape))]


def _all_gather_ref(t: list[torch.Tensor], a: CollectiveAttrs) -> tuple[torch.Tensor]:
    _single_process("all_gather", a)
    return (t[0].unsqueeze(0).clone(),)


def _all_gather_cost(ins: Specs, outs: Specs, a: CollectiveAttrs, ctx: CostContext, env: Env) -> Cost:
    moved = (a.world_size - 1) * ins[0].nbytes(env)
    return _link_cost(ins, outs, env, moved, moved)


def _all_gather_on(group: Any) -> Launch:
    def launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
        if group is None:
            _single_process("all_gather", a)
            outs[0][0].copy_(ins[0])
        else:
            _gather_into(group, outs[0], ins[0])
    return launch


def _all_gather_eager(group: Any) -> Reference:
    def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
        out = t[0].new_empty(a.world_size, *t[0].shape)
        _all_gather_on(group)([t[0]], [out], [], a)
        return (out,)
    return ref


register(OpDef(
    # out[r] is rank r's x on every rank (rank-major, the group's order)
    name="all_gather", inputs=("x",), outputs=("out",), attrs=CollectiveAttrs, infer=_infer_gather,
    reference=_all_gather_ref, cost=_all_gather_cost, tags=frozenset({LAYOUT}),
    kernels=(CollectiveBinding(name="torch_all_gather", launch=_all_gather_on(None),
                               on_group=_all_gather_on, eager_on_group=_all_gather_eager,
                               applies=Applies(ANY_DEVICE)),),
))


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


def _vp_argmax_eager(group: Any) -> Reference:
    def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
        n = t[0].shape[0]
        outs = [t[0].new_empty(n, dtype=torch.int32), t[0].new_empty(n, dtype=torch.float32)]
        ws = [t[0].new_empty(n, 3, dtype=torch.int32), t[0].new_empty(a.world_size, n, 3, dtype=torch.int32)]
        _vp_argmax_on(group)(t, outs, ws, a)
        return tuple(outs)
    return ref


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


def _vp_triton_eager(group: Any) -> Reference:
    def ref(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, ...]:
        n = t[0].shape[0]
        outs = [t[0].new_empty(n, dtype=torch.int32), t[0].new_empty(n, dtype=torch.float32)]
        ws = [t[0].new_empty(n, 3, dtype=torch.int32), t[0].new_empty(a.world_size, n, 3, dtype=torch.int32)]
        _vp_triton_on(group)(t, outs, ws, a)
        return tuple(outs)
    return ref


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


def collective_binding(op: OpDef, kernel: str) -> CollectiveBinding | None:
    """The op's binding named `kernel` if it is a collective's, else None."""
    return next((k for k in op.kernels if k.name == kernel and isinstance(k, CollectiveBinding)), None)


def eager_collective(op: OpDef, attrs: Any, group: Any) -> Reference | None:
    """For EagerRunner: the out-of-place collective of `op` on its group (`resolve_group`; the
    binding the planner would choose on CPU, width independent), or None for an op that is no
    collective or runs in one process (its reference serves)."""
    bindings = [k for k in op.kernels if isinstance(k, CollectiveBinding) and k.width_independent]
    for k in bindings:
        if k.applies("cpu", [], attrs):  # the conditions read attrs only
            resolved = resolve_group(op.name, attrs, group)
            return None if resolved is None else k.eager_on_group(resolved)
    return None
