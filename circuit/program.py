"""An n-row `Program`: the fixed launch sequence of one width over one static arena, as plain data.

`build_program(circuit, width, device, options)` specialises `n`, picks each node's kernel, plans
intermediates into the arena (with in-place reuse where an op allows it) and costs every launch.
Params, states, inputs and outputs are pinned outside the arena, in slots the runner binds once.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.ir import ROW, Circuit, CircuitError, Node, TensorSpec
from draft_circuit.circuit.memory import Buffer, plan_memory
from draft_circuit.ops.bindings import KernelBinding
from draft_circuit.ops.registry import CostContext, OpDef, get_op

REFERENCE = "reference"
_STEP = re.compile(r"^s(\d+)\.")


class Slot(BaseModel):
    """Where a launch argument lives. Arena slots carry a byte offset; others name their tensor."""

    model_config = ConfigDict(frozen=True)
    where: Literal["arena", "input", "output", "param", "state"]
    name: str  # value name; for states the root storage name
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0


class Launch(BaseModel):
    model_config = ConfigDict(frozen=True)
    node: str
    op: str
    kernel: str
    step: int | None  # the draft step a node belongs to (its `sN.` scope), None outside steps
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    workspace: tuple[Slot, ...] = ()
    attrs: dict[str, Any]
    fused: tuple[str, ...] = ()
    bytes_read: int
    bytes_written: int
    flops: int


class ArenaBuffer(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    offset: int
    size_bytes: int
    first: int
    last: int
    values: tuple[str, ...]  # the values sharing it (in-place reuse)


class Program(BaseModel):
    model_config = ConfigDict(frozen=True)
    width: int
    launches: tuple[Launch, ...]
    outputs: dict[str, Slot]
    buffers: tuple[ArenaBuffer, ...]
    arena_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    strategy: str

    @property
    def bytes_moved(self) -> int:
        return sum(x.bytes_read + x.bytes_written for x in self.launches)


def step_of(node_name: str) -> int | None:
    m = _STEP.match(node_name)
    return int(m.group(1)) if m else None


def choose_kernel(op: OpDef, ins: list[TensorSpec], attrs: Any, device: str,
                  allowed: set[str] | None, width_independent: bool = True) -> KernelBinding | None:
    """The first bound kernel whose applicability holds (device, float dtypes and conditions such
    as block sizes, checked here at plan time so a planned kernel never refuses its launch) and
    the options allow; None: the reference. Without width independence, kernels that give it up
    (cuBLAS) are preferred: they trade it for speed."""
    kernels = [k for k in op.kernels if (allowed is None or k.name in allowed)
               and (k.width_independent or not width_independent)]
    kernels.sort(key=lambda k: k.width_independent)  # stable: bound order within each kind
    return next((k for k in kernels if k.applies(device, ins, attrs)), None)


def _override(op: OpDef, node: Node, ins: list[TensorSpec], attrs: Any, device: str,
              name: str) -> KernelBinding:
    binding = next((k for k in op.kernels if k.name == name), None)
    if binding is None or not binding.applies(device, ins, attrs):
        raise CircuitError(f"node {node.name!r}: kernel {name!r} was chosen for it but is not an "
                           f"applicable binding of {op.name!r} on {device}")
    return binding


def _slot(c: Circuit, value: str, env: dict[str, int], offsets: dict[str, int]) -> Slot:
    v = c.value(value)
    shape = v.spec.concrete(env)
    if v.kind == "state":
        return Slot(where="state", name=v.storage or v.name, dtype=v.dtype, shape=shape)
    if v.kind in ("input", "param", "output"):
        return Slot(where=v.kind, name=v.name, dtype=v.dtype, shape=shape)
    return Slot(where="arena", name=v.name, dtype=v.dtype, shape=shape, offset=offsets[value])


def build_program(c: Circuit, width: int, device: str, *, kv_rows: int = 100,
                  alignment: int = 256, kernels: set[str] | None = None,
                  width_independent: bool = True,
                  overrides: dict[str, str] | None = None) -> Program:
    """`overrides`: node name -> the kernel to bind there (the planner's measured choice, which
    must be one of the node's applicable bindings) instead of the first that applies."""
    env = {ROW: width}
    order = c.topo_order()
    parsed = [get_op(n.op).parse_attrs(n.attrs) for n in order]
    chosen = [_override(get_op(n.op), n, [c.value(x).spec for x in n.inputs], a, device,
                        overrides[n.name])
              if overrides and n.name in overrides else
              choose_kernel(get_op(n.op), [c.value(x).spec for x in n.inputs], a, device, kernels,
                            width_independent)
              for n, a in zip(order, parsed)]
    workspaces = _workspaces(c, order, parsed, chosen, env)
    groups, buffers = _arena_buffers(c, order, env, workspaces)
    placement = plan_memory(buffers, alignment)
    offsets = {v: placement.offsets[root] for v, root in groups.items()}
    ctx = CostContext(width=width, kv_rows=kv_rows)
    launches = []
    for i, (node, attrs, kernel) in enumerate(zip(order, parsed, chosen)):
        op = get_op(node.op)
        ins = [c.value(x).spec for x in node.inputs]
        outs = [c.value(x).spec for x in node.outputs]
        cost = op.cost_at(ins, outs, attrs, ctx, env)
        ws = tuple(Slot(where="arena", name=name, dtype=dt, shape=shape, offset=offsets[name])
                   for name, dt, shape in workspaces.get(i, ()))
        launches.append(Launch(
            node=node.name, op=node.op, kernel=kernel.name if kernel else REFERENCE,
            step=step_of(node.name), inputs=tuple(_slot(c, x, env, offsets) for x in node.inputs),
            outputs=tuple(_slot(c, x, env, offsets) for x in node.outputs), workspace=ws,
            attrs=dict(node.attrs), fused=node.fused, bytes_read=cost.bytes_read,
            bytes_written=cost.bytes_written, flops=cost.flops))
    members: dict[str, list[str]] = {}
    for v, root in groups.items():
        members.setdefault(root, []).append(v)
    arena = tuple(ArenaBuffer(name=b.name, offset=placement.offsets[b.name], size_bytes=b.size_bytes,
                              first=b.first, last=b.last, values=tuple(members[b.name]))
                  for b in sorted(buffers, key=lambda b: (b.first, b.name)))
    outputs = {o: _slot(c, o, env, offsets) for o in c.outputs}
    return Program(width=width, launches=tuple(launches), outputs=outputs, buffers=arena,
                   arena_bytes=placement.arena_bytes, lower_bound_bytes=placement.lower_bound_bytes,
                   naive_bytes=placement.naive_bytes, strategy=placement.strategy)


def _workspaces(c: Circuit, order: tuple[Node, ...], parsed: list[BaseModel],
                chosen: list[KernelBinding | None],
                env: dict[str, int]) -> dict[int, list[tuple[str, str, tuple[int, ...]]]]:
    """Step -> scratch buffers its kernel asked for, named `<node>.ws<i>`."""
    out: dict[int, list[tuple[str, str, tuple[int, ...]]]] = {}
    for i, (node, attrs, kernel) in enumerate(zip(order, parsed, chosen)):
        if kernel is not None and kernel.workspace is not None:
            ins = [c.value(x).spec for x in node.inputs]
            out[i] = [(f"{node.name}.ws{j}", dt, tuple(shape))
                      for j, (dt, shape) in enumerate(kernel.workspace(ins, env, attrs))]
    return out


def _arena_buffers(c: Circuit, order: tuple[Node, ...], env: dict[str, int],
                   workspaces: dict[int, list[tuple[str, str, tuple[int, ...]]]]
                   ) -> tuple[dict[str, str], list[Buffer]]:
    """Temps -> arena buffers over schedule steps; an in-place output joins its input's buffer
    when that input is a temp read for the last time by the same node."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, node in enumerate(order):
        for v in node.inputs:
            last[v] = i
        for v in node.outputs:
            first[v] = i
            last.setdefault(v, i)
    temps = {v.name for v in c.values if v.kind == "temp"}
    root: dict[str, str] = {}
    for i, node in enumerate(order):
        for out_i, in_i in get_op(node.op).inplace.items():
            src, dst = node.inputs[in_i], node.outputs[out_i]
            if (src in temps and dst in temps and last[src] == i
                    and c.value(src).spec.nbytes(env) == c.value(dst).spec.nbytes(env)
                    and src not in node.inputs[:in_i] + node.inputs[in_i + 1:]):
                root[dst] = root.get(src, src)
    # in schedule order, not set order: the report lists each buffer's values from this, and
    # must be byte-identical across processes (a set's order changes with PYTHONHASHSEED)
    groups = {v: root.get(v, v) for v in first if v in temps}
    span: dict[str, tuple[int, int, int]] = {}
    for v, r in groups.items():
        lo, hi, size = span.get(r, (first[v], last[v], 0))
        span[r] = (min(lo, first[v]), max(hi, last[v]), max(size, c.value(v).spec.nbytes(env)))
    buffers = [Buffer(name=r, size_bytes=s, first=lo, last=hi) for r, (lo, hi, s) in span.items()]
    for i, scratch in workspaces.items():
        for name, dt, shape in scratch:
            size = TensorSpec(dtype=dt, shape=shape).nbytes({})
            buffers.append(Buffer(name=name, size_bytes=size, first=i, last=i))
            groups[name] = name
    return groups, buffers
