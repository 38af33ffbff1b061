"""An n-row `Program`: the fixed launch sequence of one width over one static arena, as plain data.

`ProgramBuilder(circuit, device, ...).build(width)` specialises `n`, picks each node's kernel, plans
intermediates into the arena (with in-place reuse where an op allows it) and costs every launch.
Params, states, inputs and outputs are pinned outside the arena, in slots the runner binds once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Value:
    """What a launch argument's slot needs of its value, found once per circuit."""

    where: Literal["arena", "input", "output", "param", "state"]  # Slot.where; arena: temps
    name: str   # the slot's name: the root storage for states
    dtype: str
    spec: TensorSpec


@dataclass(frozen=True)
class _Step:
    """One node as every width launches it: what neither its kernel nor its costs' inputs
    depend on n for (specs keep the row symbol; a binding applies or not whatever n is)."""

    node: Node
    op: OpDef
    attrs: BaseModel
    kernel: KernelBinding | None
    ins: list[TensorSpec]
    outs: list[TensorSpec]
    step: int | None


class ProgramBuilder:
    """A width's program in two halves: the constructor does what every width shares (the
    schedule, each node's parsed attrs and kernel, its values' specs and slot kinds, the temps'
    first and last steps), `build(width)` what a width decides (shapes, workspaces, the arena's
    placement, costs). A 64-width plan parses, binds and looks up each node once, not 64 times.
    `overrides`: node name -> the kernel to bind there (the planner's measured choice, which
    must be one of the node's applicable bindings) instead of the first that applies."""

    def __init__(self, c: Circuit, device: str, *, kernels: set[str] | None = None,
                 width_independent: bool = True, overrides: dict[str, str] | None = None) -> None:
        self.circuit = c
        order = c.topo_order()
        steps = []
        for n in order:
            op = get_op(n.op)
            attrs = op.parse_attrs(n.attrs)
            ins = [c.value(x).spec for x in n.inputs]
            kernel = _override(op, n, ins, attrs, device, overrides[n.name]) \
                if overrides and n.name in overrides else \
                choose_kernel(op, ins, attrs, device, kernels, width_independent)
            steps.append(_Step(n, op, attrs, kernel, ins, [c.value(x).spec for x in n.outputs],
                               step_of(n.name)))
        self.order, self.steps = order, steps
        self.values = {v.name: _Value("arena" if v.kind == "temp" else v.kind,
                                      (v.storage or v.name) if v.kind == "state" else v.name,
                                      v.dtype, v.spec) for v in c.values}
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, node in enumerate(order):
            for v in node.inputs:
                last[v] = i
            for v in node.outputs:
                first[v] = i
                last.setdefault(v, i)
        self.first, self.last = first, last
        self.temps = {v.name for v in c.values if v.kind == "temp"}
        self._fixed: dict[str, Slot] = {}  # params' and states' slots of no row symbol

    def _slot(self, value: str, env: dict[str, int], offsets: dict[str, int],
              memo: dict[str, Slot]) -> Slot:
        """Value's slot at this width: made once a width (`memo`), and once a plan for a param or
        state of fixed shape (the same slot at every width)."""
        got = self._fixed.get(value) or memo.get(value)
        if got is None:
            v = self.values[value]
            got = memo[value] = Slot(where=v.where, name=v.name, dtype=v.dtype,
                                     shape=v.spec.concrete(env),
                                     offset=offsets[value] if v.where == "arena" else 0)
            if v.where in ("param", "state") and got.shape == v.spec.shape:
                self._fixed[value] = got
        return got

    def build(self, width: int, *, kv_rows: int = 100, alignment: int = 256) -> Program:
        env = {ROW: width}
        workspaces = _workspaces(self.steps, env)
        groups, buffers = _arena_buffers(self, env, workspaces)
        placement = plan_memory(buffers, alignment)
        offsets = {v: placement.offsets[root] for v, root in groups.items()}
        ctx = CostContext(width=width, kv_rows=kv_rows)
        launches: list[Launch] = []
        memo: dict[str, Slot] = {}
        for i, st in enumerate(self.steps):
            node = st.node
            cost = st.op.cost_at(st.ins, st.outs, st.attrs, ctx, env)
            ws = tuple(Slot(where="arena", name=name, dtype=dt, shape=shape, offset=offsets[name])
                       for name, dt, shape in workspaces.get(i, ()))
            launches.append(Launch(
                node=node.name, op=node.op, kernel=st.kernel.name if st.kernel else REFERENCE,
                step=st.step, inputs=tuple(self._slot(x, env, offsets, memo) for x in node.inputs),
                outputs=tuple(self._slot(x, env, offsets, memo) for x in node.outputs), workspace=ws,
                attrs=dict(node.attrs), fused=node.fused, bytes_read=cost.bytes_read,
                bytes_written=cost.bytes_written, flops=cost.flops))
        members: dict[str, list[str]] = {}
        for v, root in groups.items():
            members.setdefault(root, []).append(v)
        arena = tuple(ArenaBuffer(name=b.name, offset=placement.offsets[b.name], size_bytes=b.size_bytes,
                                  first=b.first, last=b.last, values=tuple(members[b.name]))
                      for b in sorted(buffers, key=lambda b: (b.first, b.name)))
        outputs = {o: self._slot(o, env, offsets, memo) for o in self.circuit.outputs}
        return Program(width=width, launches=tuple(launches), outputs=outputs, buffers=arena,
                       arena_bytes=placement.arena_bytes, lower_bound_bytes=placement.lower_bound_bytes,
                       naive_bytes=placement.naive_bytes, strategy=placement.strategy)


def _workspaces(steps: list[_Step], env: dict[str, int]
                ) -> dict[int, list[tuple[str, str, tuple[int, ...]]]]:
    """Step -> scratch buffers its kernel asked for, named `<node>.ws<i>`."""
    out: dict[int, list[tuple[str, str, tuple[int, ...]]]] = {}
    for i, st in enumerate(steps):
        if st.kernel is not None and st.kernel.workspace is not None:
            out[i] = [(f"{st.node.name}.ws{j}", dt, tuple(shape))
                      for j, (dt, shape) in enumerate(st.kernel.workspace(st.ins, env, st.attrs))]
    return out


def _arena_buffers(b: ProgramBuilder, env: dict[str, int],
                   workspaces: dict[int, list[tuple[str, str, tuple[int, ...]]]]
                   ) -> tuple[dict[str, str], list[Buffer]]:
    """Temps -> arena buffers over schedule steps; an in-place output joins its input's buffer
    when that input is a temp read for the last time by the same node (and, at this width, of
    the same bytes)."""
    first, last, temps, values = b.first, b.last, b.temps, b.values
    root: dict[str, str] = {}
    for i, st in enumerate(b.steps):
        node = st.node
        for out_i, in_i in st.op.inplace.items():
            src, dst = node.inputs[in_i], node.outputs[out_i]
            if (src in temps and dst in temps and last[src] == i
                    and values[src].spec.nbytes(env) == values[dst].spec.nbytes(env)
                    and src not in node.inputs[:in_i] + node.inputs[in_i + 1:]):
                root[dst] = root.get(src, src)
    # in schedule order, not set order: the report lists each buffer's values from this, and
    # must be byte-identical across processes (a set's order changes with PYTHONHASHSEED)
    groups = {v: root.get(v, v) for v in first if v in temps}
    span: dict[str, tuple[int, int, int]] = {}
    for v, r in groups.items():
        lo, hi, size = span.get(r, (first[v], last[v], 0))
        span[r] = (min(lo, first[v]), max(hi, last[v]), max(size, values[v].spec.nbytes(env)))
    buffers = [Buffer(name=r, size_bytes=s, first=lo, last=hi) for r, (lo, hi, s) in span.items()]
    for i, scratch in workspaces.items():
        for name, dt, shape in scratch:
            size = TensorSpec(dtype=dt, shape=shape).nbytes({})
            buffers.append(Buffer(name=name, size_bytes=size, first=i, last=i))
            groups[name] = name
    return groups, buffers
