"""`CircuitBuilder`: the API layers emit circuits through.

It declares inputs, params and states, applies ops (inferring output specs with the op's shape
rule, naming each node under the current scope and each new state version `root@k`), marks
outputs, and `build()`s a verified, immutable `Circuit`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from draft_circuit.circuit.ir import ROW, Circuit, CircuitError, Dim, Kind, Node, Value
from draft_circuit.circuit.verify import verify
from draft_circuit.ops.registry import ShapeError, get_op


class CircuitBuilder:
    def __init__(self, name: str, *, max_width: int, min_width: int = 1) -> None:
        self.name = name
        self.symbols = {ROW: (min_width, max_width)}
        self._values: dict[str, Value] = {}
        self._nodes: list[Node] = []
        self._outputs: list[str] = []
        self._renames: dict[str, str] = {}
        self._scope: list[str] = []

    # ---- declarations ----
    def _declare(self, name: str, dtype: str, shape: Sequence[Dim], kind: Kind, **kw: Any) -> str:
        if name in self._values:
            raise CircuitError(f"value {name!r} is declared twice")
        self._values[name] = Value(name=name, dtype=dtype, shape=tuple(shape), kind=kind, **kw)
        return name

    def input(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        return self._declare(name, dtype, shape, "input")

    def param(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        return self._declare(name, dtype, shape, "param")

    def state(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        return self._declare(name, dtype, shape, "state", storage=name, version=0)

    def spec(self, value: str):
        return self._values[value].spec

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Prefix the names of nodes and temps made inside (e.g. the draft step `s2`)."""
        self._scope.append(prefix)
        try:
            yield
        finally:
            self._scope.pop()

    def _scoped(self, name: str) -> str:
        return ".".join([*self._scope, name])

    # ---- ops ----
    def op(self, op_name: str, inputs: Sequence[str | None], attrs: dict[str, Any] | None = None,
           name: str | None = None) -> tuple[str, ...]:
        """Apply `op_name`; trailing None inputs are absent optionals. Returns the output names."""
        op = get_op(op_name)
        ins = list(inputs)
        while ins and ins[-1] is None:
            ins.pop()
        node_name = self._scoped(name or op_name)
        if any(n.name == node_name for n in self._nodes):
            raise CircuitError("node name used twice", node=node_name, op=op_name)
        if None in ins:
            raise CircuitError("only trailing optional inputs may be absent", node=node_name,
                               op=op_name)
        for x in ins:
            if x not in self._values:
                raise CircuitError(f"input {x!r} names no value", node=node_name, op=op_name)
        attrs = dict(attrs or {})
        parsed = op.parse_attrs(attrs)
        try:
            specs = op.infer([self._values[x].spec for x in ins], parsed)
        except ShapeError as e:
            shapes = ", ".join(f"{x}: {self._values[x].spec}" for x in ins)
            raise CircuitError(str(e), node=node_name, op=op_name, shapes=shapes) from None
        outs = []
        for i, spec in enumerate(specs):
            if i in op.mutates:
                prev = self._values[ins[op.mutates[i]]]
                out = self._declare(f"{prev.storage}@{prev.version + 1}", spec.dtype, spec.shape,
                                    "state", storage=prev.storage, version=prev.version + 1)
            else:
                suffix = "" if len(specs) == 1 else f".{op.outputs[i]}"
                out = self._declare(node_name + suffix, spec.dtype, spec.shape, "temp")
            outs.append(out)
        self._nodes.append(Node(name=node_name, op=op_name, inputs=tuple(ins),
                                outputs=tuple(outs), attrs=attrs))
        return tuple(outs)

    def op1(self, op_name: str, inputs: Sequence[str | None], attrs: dict[str, Any] | None = None,
            name: str | None = None) -> str:
        """`op` for single-output ops."""
        (out,) = self.op(op_name, inputs, attrs, name)
        return out

    def output(self, value: str, name: str | None = None) -> str:
        """Mark `value` as a circuit output, renamed to `name` if given."""
        v = self._values[value]
        if v.kind == "state":
            self._outputs.append(value)  # a final state version: returned under its own name
            return value
        name = name or value
        if name != value:
            if name in self._values:
                raise CircuitError(f"output name {name!r} is already a value")
            self._renames[value] = name
        self._values[value] = v.model_copy(update={"kind": "output"})
        self._outputs.append(name)
        return name

    def build(self, check: bool = True) -> Circuit:
        r = lambda x: self._renames.get(x, x)  # noqa: E731
        values = tuple(v.model_copy(update={"name": r(v.name)}) for v in self._values.values())
        nodes = tuple(n.model_copy(update={"inputs": tuple(map(r, n.inputs)),
                                           "outputs": tuple(map(r, n.outputs))})
                      for n in self._nodes)
        circuit = Circuit(name=self.name, symbols=self.symbols, values=values, nodes=nodes,
                          outputs=tuple(self._outputs))
        if check:
            verify(circuit)
        return circuit
