"""Collectives as ops (issue 21): `all_reduce` (sum) and `all_gather`, and what every collective op
shares: the attrs, the group lookup, the world-size-1 refusal, the link cost and
`CollectiveBinding`. The lm-head's cross-rank top-1, `vocab_parallel_argmax`, is
ops/vocab_parallel.py, built on these.

Each op's reference is the single-process one (world size 1): all_reduce is the identity,
all_gather a stack of one. A reference asked for a larger world refuses with `CollectiveError`: a collective runs
only on a process group. The group reaches the launches through `CollectiveBinding`: its
`on_group(group)` is the destination-passing launch bound to that group (what ProgramRunner and
the CUDA graphs replay), `eager_on_group(group)` the out-of-place form EagerRunner calls. Launches
call torch.distributed in place on the program's static buffers (the output slot, or planned
workspace), so a call allocates no buffer of its own; with NCCL they are captured like any kernel.

Sum order. A sum of two is exact in either order, so `torch_all_reduce` serves world size 2 as
width independent (a row's bits never depend on the batch). A ring or tree all-reduce over more
ranks adds a row's elements in an order set by its chunk of the message, i.e. by the batch width:
there `gather_sum` (all_gather, then a sum in rank order) keeps rows width independent and equal
on every rank, and the backend's all-reduce is chosen only with `width_independent=False`.

Costs are every op's (inputs read once, outputs written once) plus the bytes over the link:
`bytes_written` adds what a rank sends, `bytes_read` what it receives (ring all-reduce: 2 (w - 1)
/ w of the buffer each way; all-gather: w - 1 shards each way).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import CircuitError, TensorSpec
from draft_circuit.ops.bindings import Applies, Condition, KernelBinding, Launch, Scratch, Tensors
from draft_circuit.ops.registry import (ELEMENTWISE, LAYOUT, Cost, CostContext, Env, OpDef, Reference,
                                        Specs, check, default_cost, register)

# every device the planner selects for: collectives run wherever torch.distributed has a backend
# (gloo on CPU, NCCL on CUDA); "interpret" is CPU with Triton kernels interpreted
ANY_DEVICE: frozenset[str] = frozenset({"cpu", "cuda", "interpret"})


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
